"""Files by reference: how fast Stride's stream reads the files a manifest names, beside a plain thread pool reading
the same files (-> file_read_ratio).

    python benchmarks/file_read_bench.py            # 5 repetitions; prints the figure and the raw runs as JSON
    python benchmarks/file_read_bench.py --smoke    # 512 files, 1 repetition: a check that it runs

The data: FILES files of FILE_BYTES random bytes each (20,000 x 16 KiB = 312.5 MiB), in folders of 1,000, written
into a temporary folder this benchmark owns (removed at the end, never the checkout), and a JSON Lines manifest
beside them naming each file by its path relative to the manifest's folder, with a label:
{"path": "files/007/07123.bin", "label": 3}, as examples/audio_clips lays its clips out.

Two sides, in one process, same files, same order, same number of threads (THREADS = 16, data.file_read_threads'
default), each touching every file's bytes (the sum of their lengths):

* stride: one epoch of a TrainStream (datasets/stream.py) at world size 1 over a spec as the driver's inspect makes
  it for a task with columns ("path", "label") and file_columns=("path",): the manifest's rows, file_read_threads =
  THREADS, row_bytes = the manifest's bytes per row + the files' mean size; the order of order_for with the config's
  defaults (seed, a global micro-batch of 32 = train.batch_size_per_worker, shuffle_window_rows 65,536,
  shuffle_window_bytes 1 GiB, read_ahead_windows 2). Every micro-batch is consumed. Timed from building the stream to
  its last micro-batch: reading and parsing the manifest, the window's shuffle, and the files' bytes read by the
  stream's FileFetcher (datasets/files.py) after the shuffle, THREADS at a time.
* threadpool: `concurrent.futures.ThreadPoolExecutor(THREADS).map` of open(path, "rb").read() over the same files in
  the order the stream delivered them (the sample ids of an untimed stride epoch of the same seed), the paths
  resolved beforehand: a plain Python reader of these files with that many threads, doing nothing else (a simple
  baseline, not the fastest possible one: the stream with small windows beat it here, see small_window_ratio).

Warm files on both sides: every file is read once before timing (and an untimed epoch of each side runs), so both
read from the page cache: the figure compares the two read paths, not the disk, and no side pays a cold cache the
other then enjoys. With 20,000 rows the default window (65,536 rows, 1 GiB / ~16.4 KB a row) holds the whole epoch:
the stream reads the manifest, shuffles, then fetches all 20,000 files in one go, as it would for such a set with the
config's defaults. Beside it, not the figure, the same stream with shuffle_window_rows = SMALL_WINDOW (4,096: five
windows, read ahead two at a time, each window's files fetched when it is cut) is timed in the same repetitions:
`small_window_ratio`.

Per repetition, PAIRS pairs of epochs alternating ABBA (stride, threadpool, then threadpool, stride, ...; the
small-window stream after the pair's two), so that this machine's other work weighs on both sides; the sample is the
median over the repetition's pairs of stride's rows/s / the thread pool's. benchmarks/figures.py takes the median over
repetitions.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from datetime import datetime
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pyarrow as pa

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.append(str(REPO))  # appended: the repository's datasets/ must not hide Hugging Face's `datasets`

from benchmarks.report import cpu_model, print_json  # noqa: E402

FILES = 20_000
SMOKE_FILES = 512
FILE_BYTES = 16_384
THREADS = 16  # data.file_read_threads' default
BATCH = 32  # train.batch_size_per_worker's default; world size 1: the global micro-batch
WINDOW_ROWS = 65_536  # data.shuffle_window_rows' default
WINDOW_BYTES = 1 << 30  # data.shuffle_window_bytes' default
SMALL_WINDOW = 4_096
READ_AHEAD = 2  # data.read_ahead_windows' default
SEED = 0
PAIRS = 3  # pairs of epochs per repetition
VARIANTS = ("stride", "threadpool", "stride_small_window")


def write_files(folder: Path, n: int, size: int, seed: int = 0) -> Path:
    """n files of `size` random bytes under folder/files/, and folder/train.jsonl naming them. Returns the manifest."""
    rng = np.random.default_rng(seed)
    lines = []
    for i in range(n):
        rel = f"files/{i // 1000:03d}/{i:05d}.bin"
        path = folder / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(rng.bytes(size))
        lines.append(json.dumps({"path": rel, "label": i % 4}))
    manifest = folder / "train.jsonl"
    manifest.write_text("\n".join(lines) + "\n")
    return manifest


def spec_of(manifest: Path, threads: int):
    """The train spec datasets/splits.inspect makes for a task reading ("path", "label") with file_columns=("path",)
    (no sample_id column: rows are numbered in file order)."""
    from stride.datasets.splits import DataSpec, open_split

    class Data:
        train_path = str(manifest)

    split = open_split(Data, "train")
    columns = ("path", "label")
    sizes = [os.path.getsize(manifest.parent / json.loads(line)["path"]) for line in manifest.read_text().splitlines()]
    row_bytes = sum(lay.data_bytes for lay in split.layouts) / split.num_rows + float(np.mean(sizes))
    return DataSpec(columns, False, split.num_rows, split.layouts, split.blocks, "train", ("path",), threads,
                    schema=pa.schema([split.schema.field(c) for c in columns]), row_bytes=row_bytes)


def stride_epoch(spec, window_rows: int) -> dict:
    """One epoch of the stream, every micro-batch consumed (the files' bytes summed)."""
    from stride.datasets.mixing import order_for
    from stride.datasets.stream import TrainStream

    t0 = time.perf_counter()
    order = order_for(spec, SEED, BATCH, window_rows, WINDOW_BYTES)
    steps = order.micro_steps_per_epoch
    stream = TrainStream(spec, order, 0, 1, 0, READ_AHEAD, steps)
    total, ids = 0, []
    try:
        for _ in range(steps):
            batch = stream.next()
            total += sum(len(b) for b in batch.data["path"])
            ids.append(batch.sample_id)
    finally:
        stream.close()
    seconds = time.perf_counter() - t0
    sample_ids = np.concatenate(ids)
    return {"seconds": seconds, "rows": len(sample_ids), "bytes": total, "window_rows": order.window_rows,
            "sample_ids": sample_ids}


def read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def pool_epoch(paths: list[str], threads: int) -> dict:
    """The same files read by a thread pool, in the given order, their bytes summed."""
    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        total = sum(len(b) for b in pool.map(read, paths))
    return {"seconds": time.perf_counter() - t0, "rows": len(paths), "bytes": total}


def measure(reps: int = 5, files: int = FILES, file_bytes: int = FILE_BYTES, threads: int = THREADS,
            pairs: int = PAIRS) -> dict:
    """`reps` repetitions of `pairs` alternating pairs of epochs (and a small-window epoch each). Returns the raw runs
    (figures.file_read_figure makes the figure)."""
    tmp = Path(tempfile.mkdtemp(prefix="stride-file-read-bench-"))
    t0 = time.perf_counter()
    started = datetime.now().isoformat(timespec="seconds")
    try:
        t = time.perf_counter()
        manifest = write_files(tmp, files, file_bytes)
        write_s = time.perf_counter() - t
        spec = spec_of(manifest, threads)
        rows = [json.loads(line) for line in manifest.read_text().splitlines()]
        by_row = [str(tmp / r["path"]) for r in rows]  # sample id (file order) -> the file's absolute path
        # Warm: every file read once, then an untimed epoch of each side (imports, thread start-up, the manifest).
        warm = pool_epoch(by_row, threads)
        first = stride_epoch(spec, WINDOW_ROWS)
        in_order = [by_row[i] for i in first["sample_ids"]]  # the order the stream delivered the rows in
        if len(set(first["sample_ids"].tolist())) != len(first["sample_ids"]) or files % BATCH:
            raise RuntimeError(f"an epoch reads every row once: {files} files must be a multiple of {BATCH}")
        pool_epoch(in_order, threads)
        stride_epoch(spec, SMALL_WINDOW)
        runs = []
        for rep in range(reps):
            for pair in range(pairs):
                sides = ("stride", "threadpool") if (rep * pairs + pair) % 2 == 0 else ("threadpool", "stride")
                for variant in (*sides, "stride_small_window"):
                    load = os.getloadavg()[0]
                    if variant == "threadpool":
                        r = pool_epoch(in_order, threads)
                    else:
                        r = stride_epoch(spec, WINDOW_ROWS if variant == "stride" else SMALL_WINDOW)
                        if variant == "stride" and not np.array_equal(r["sample_ids"], first["sample_ids"]):
                            raise RuntimeError("the stream's order changed between epochs of the same seed")
                        r.pop("sample_ids")
                    runs.append({"rep": rep, "pair": pair, "variant": variant, **r, "loadavg": load})
            per = {v: [x for x in runs if x["rep"] == rep and x["variant"] == v] for v in VARIANTS}
            rates = {v: np.median([x["rows"] / x["seconds"] for x in xs]) for v, xs in per.items()}
            print(f"file_read_bench: rep {rep + 1}/{reps}: rows/s stride {rates['stride']:,.0f}, thread pool "
                  f"{rates['threadpool']:,.0f}, stride with {SMALL_WINDOW}-row windows "
                  f"{rates['stride_small_window']:,.0f} (load {os.getloadavg()[0]:.1f})", flush=True)
        return {"started": started, "cpu_count": os.cpu_count(), "cpu_model": cpu_model(), "files": files,
                "file_bytes": file_bytes, "threads": threads, "batch": BATCH, "window_rows": first["window_rows"],
                "small_window_rows": SMALL_WINDOW, "read_ahead": READ_AHEAD, "pairs": pairs,
                "warm_read_s": warm["seconds"], "write_s": write_s, "runs": runs, "wall_s": time.perf_counter() - t0}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python benchmarks/file_read_bench.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=5, help="repetitions (samples); a verdict needs 5")
    ap.add_argument("--files", type=int, default=FILES)
    ap.add_argument("--smoke", action="store_true", help=f"{SMOKE_FILES} files, 1 repetition of 1 pair")
    ap.add_argument("--out", help="also write the JSON here")
    args = ap.parse_args(argv)
    from benchmarks.figures import file_read_figure  # after the path set-up above

    raw = (measure(1, SMOKE_FILES, pairs=1) if args.smoke else measure(args.reps, args.files))
    print_json({"file_read_ratio": file_read_figure({"file_read": raw}), "raw": raw}, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
