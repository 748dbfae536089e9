"""Write the signal data set for signal_task.py: train/ and val/ Parquet folders.

    python make_data.py [--out data] [--train-rows 2048] [--val-rows 512]

Columns: sample_id (int64, unique), signal (fixed_size_list<float32>[length]: a waveform), target (int64: the
class). Class k oscillates at FREQS[k] whole periods per window, under random phase, offset, gain and noise, so
a small CNN tells them apart within a few dozen steps.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

FREQS = (1, 3, 6, 12)  # periods per window; whole periods, so a circular shift keeps the class


def make_split(rows: int, length: int, seed: int, first_id: int = 0) -> pa.Table:
    rng = np.random.default_rng(seed)
    target = rng.integers(0, len(FREQS), size=rows)
    t = np.arange(length) / length
    phase = rng.uniform(0, 2 * np.pi, size=(rows, 1))
    freq = np.asarray(FREQS)[target][:, None]
    x = np.sin(2 * np.pi * freq * t[None, :] + phase)
    x = x * rng.uniform(0.5, 2.0, size=(rows, 1)) + rng.normal(0, 1, size=(rows, 1))  # gain, offset
    x = x + rng.normal(0, 0.3, size=x.shape)  # noise
    signal = pa.FixedSizeListArray.from_arrays(pa.array(x.astype(np.float32).ravel(), pa.float32()), length)
    return pa.table({"sample_id": pa.array(np.arange(first_id, first_id + rows), pa.int64()), "signal": signal,
                     "target": pa.array(target.astype(np.int64), pa.int64())})


def make_data(out: str | Path = "data", train_rows: int = 2048, val_rows: int = 512, length: int = 64,
              seed: int = 0) -> Path:
    out = Path(out)
    for split, rows, s, first in (("train", train_rows, seed, 0), ("val", val_rows, seed + 1, train_rows)):
        (out / split).mkdir(parents=True, exist_ok=True)
        pq.write_table(make_split(rows, length, s, first), out / split / "part-0000.parquet")
    return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="data")
    ap.add_argument("--train-rows", type=int, default=2048)
    ap.add_argument("--val-rows", type=int, default=512)
    ap.add_argument("--length", type=int, default=64)
    a = ap.parse_args()
    print(f"wrote {make_data(a.out, a.train_rows, a.val_rows, a.length)}/{{train,val}}")
