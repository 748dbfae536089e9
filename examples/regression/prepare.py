"""Data step of the regression example: a noisy nonlinear function of four numeric columns, as Parquet.

    python prepare.py                 # -> data/train/part-0.parquet, data/val/part-0.parquet
    python prepare.py --rows 20000 --noise 0.2 --out /path/to/data

Columns: sample_id (int64, unique per row), x1..x4 (float32, uniform in [-2, 2]) and the target
y = sin(2 x1) + 0.5 x2^2 - x3 x4 + noise (float32, Gaussian noise of std --noise).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq


def target(x: np.ndarray) -> np.ndarray:
    """The noiseless function the model has to learn."""
    return np.sin(2 * x[:, 0]) + 0.5 * x[:, 1] ** 2 - x[:, 2] * x[:, 3]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("data"))
    ap.add_argument("--rows", type=int, default=8000)
    ap.add_argument("--val-fraction", type=float, default=0.2)
    ap.add_argument("--noise", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()

    rng = np.random.default_rng(a.seed)
    x = rng.uniform(-2.0, 2.0, size=(a.rows, 4))
    y = target(x) + a.noise * rng.standard_normal(a.rows)
    table = pa.table({"sample_id": np.arange(a.rows, dtype=np.int64),
                      **{f"x{i + 1}": x[:, i].astype(np.float32) for i in range(4)},
                      "y": y.astype(np.float32)})
    n_val = int(a.rows * a.val_fraction)
    for split, rows in (("train", table.slice(n_val)), ("val", table.slice(0, n_val))):
        (a.out / split).mkdir(parents=True, exist_ok=True)
        pq.write_table(rows, a.out / split / "part-0.parquet")
        print(f"{split}: {rows.num_rows} rows -> {a.out / split}")


if __name__ == "__main__":
    main()
