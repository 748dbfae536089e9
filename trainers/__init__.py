"""Stride trainers: the driver (main.py), config, the per-worker loop and its plain-PyTorch core."""
