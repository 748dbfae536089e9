"""Build Stride's data sets as sharded Parquet. Nothing is downloaded.

    python datasets/prepare.py pystdlib --out data/pystdlib
    python datasets/prepare.py tabular --out data/tabular --rows 20000 --features 16 --classes 4 --seed 0

pystdlib: the running Python's standard library `.py` files (test folders left out) as bytes (vocab 256),
cut into fixed-length sequences, split into train/val by file, `tokens` (fixed-size list of uint8) + `sample_id`.
tabular: a synthetic classification task that is not linearly separable (classes are unions of Gaussian
clusters, plus distractor features), numeric `f0..fN`, `label`, `sample_id`.
An existing output folder is never overwritten: the data are written next to it and renamed into place.
"""

from __future__ import annotations

import argparse
import hashlib
import shutil
import sys
import sysconfig
import tempfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}


def stdlib_files(root: Path | None = None) -> list[Path]:
    root = Path(root or sysconfig.get_paths()["stdlib"])
    files = []
    for p in sorted(root.rglob("*.py")):
        parts = p.relative_to(root).parts
        if any(part in SKIP_DIRS or part.startswith("test") for part in parts[:-1]) or parts[-1].startswith("test_"):
            continue
        files.append(p)
    return files


def split_of(name: str, val_fraction: float) -> str:
    """Deterministic train/val assignment by file name (stable across machines and Python builds)."""
    h = int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little") / 2**64
    return "val" if h < val_fraction else "train"


def write_shards(table: pa.Table, out: Path, num_shards: int) -> None:
    out.mkdir(parents=True, exist_ok=True)
    bounds = np.linspace(0, table.num_rows, num_shards + 1).astype(int)
    for i, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:])):
        pq.write_table(table.slice(lo, hi - lo), out / f"part-{i:04d}.parquet")


def build_pystdlib(out: Path, seq_len: int, val_fraction: float, shards: int, root: Path | None = None) -> dict:
    chunks: dict[str, list[np.ndarray]] = {"train": [], "val": []}
    base = Path(root or sysconfig.get_paths()["stdlib"])
    for path in stdlib_files(base):
        data = np.frombuffer(path.read_bytes(), dtype=np.uint8)
        n = len(data) // seq_len
        if n:
            chunks[split_of(path.relative_to(base).as_posix(), val_fraction)].append(data[: n * seq_len].reshape(n, seq_len))
    counts, next_id = {}, 0
    for split, parts in chunks.items():
        tokens = np.concatenate(parts) if parts else np.zeros((0, seq_len), np.uint8)
        ids = np.arange(next_id, next_id + len(tokens), dtype=np.int64)
        next_id += len(tokens)
        col = pa.FixedSizeListArray.from_arrays(pa.array(tokens.reshape(-1), pa.uint8()), seq_len)
        write_shards(pa.table({"tokens": col, "sample_id": ids}), out / split, shards)
        counts[split] = len(tokens)
    return counts


def build_tabular(out: Path, rows: int, features: int, classes: int, seed: int, val_fraction: float, shards: int) -> dict:
    rng = np.random.default_rng(seed)
    informative = min(features, 8)
    # Each class is a union of 3 Gaussian clusters scattered in the informative subspace: no single
    # hyperplane separates a class, yet an MLP can reach high accuracy. The rest are noise features
    # on different scales (so standardisation matters), one of them constant.
    clusters_per_class = 3
    centers = rng.normal(0.0, 2.2, size=(classes * clusters_per_class, informative))
    cluster = rng.integers(0, classes * clusters_per_class, size=rows)
    label = (cluster % classes).astype(np.int64)
    x = np.empty((rows, features), dtype=np.float32)
    x[:, :informative] = centers[cluster] + rng.normal(0.0, 1.1, size=(rows, informative))
    if features > informative:
        scales = rng.uniform(0.5, 50.0, size=features - informative)
        x[:, informative:] = rng.normal(0.0, 1.0, size=(rows, features - informative)) * scales
        x[:, -1] = 3.0
    # A fixed random rotation mixes informative and noise dimensions (still learnable).
    q, _ = np.linalg.qr(rng.normal(size=(informative, informative)))
    x[:, :informative] = x[:, :informative] @ q.astype(np.float32)
    is_val = rng.random(rows) < val_fraction
    counts = {}
    for split, mask in (("train", ~is_val), ("val", is_val)):
        cols = {f"f{i}": x[mask, i] for i in range(features)}
        cols["label"] = label[mask]
        cols["sample_id"] = np.flatnonzero(mask).astype(np.int64)
        write_shards(pa.table(cols), out / split, shards)
        counts[split] = int(mask.sum())
    return counts


def publish(build, out: Path, force: bool) -> dict:
    """Write into a fresh sibling folder, then rename into place: a failed build never leaves half a data set."""
    if out.exists() and not force:
        raise SystemExit(f"prepare: --out ({out}) already exists; remove it or pass --force to rebuild")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        counts = build(tmp)
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return counts


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="kind", required=True)
    a = sub.add_parser("pystdlib", help="byte-level text corpus from the Python standard library")
    a.add_argument("--out", type=Path, default=Path("data/pystdlib"))
    a.add_argument("--seq-len", type=int, default=129, help="tokens per row (model.context + 1)")
    a.add_argument("--val-fraction", type=float, default=0.03)
    a.add_argument("--shards", type=int, default=8)
    b = sub.add_parser("tabular", help="synthetic, not linearly separable classification set")
    b.add_argument("--out", type=Path, default=Path("data/tabular"))
    b.add_argument("--rows", type=int, default=20000)
    b.add_argument("--features", type=int, default=16)
    b.add_argument("--classes", type=int, default=4)
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--val-fraction", type=float, default=0.1)
    b.add_argument("--shards", type=int, default=4)
    for p in (a, b):
        p.add_argument("--force", action="store_true", help="rebuild an existing --out folder")
    args = ap.parse_args(argv)
    if args.kind == "pystdlib":
        counts = publish(lambda d: build_pystdlib(d, args.seq_len, args.val_fraction, args.shards), args.out, args.force)
    else:
        if args.features < 2 or args.classes < 2 or args.rows < 10:
            ap.error("tabular needs --features >= 2, --classes >= 2 and --rows >= 10")
        counts = publish(lambda d: build_tabular(d, args.rows, args.features, args.classes, args.seed,
                                                 args.val_fraction, args.shards), args.out, args.force)
    print(f"wrote {args.out}: {counts['train']} train rows, {counts['val']} val rows")
    return 0


if __name__ == "__main__":
    sys.exit(main())
