"""SLURM launcher for Stride: stride.sbatch plus its helpers (launch.py, ports.py)."""
