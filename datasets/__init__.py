"""Stride's data: prepared Parquet sets, Parquet inspection, and the deterministic sample order.

Installed as `stride.datasets` (setup.cfg's package_dir), never as a top-level `datasets`: Hugging Face `datasets`
keeps its name in any environment Stride is installed in (tests/test_imports.py).
"""
