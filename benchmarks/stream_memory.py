"""How a training run's memory grows with the size of its data set.

    python benchmarks/stream_memory.py                                  # 200k vs 4M rows x 64 features (~1 GB raw)
    python benchmarks/stream_memory.py --reps 1 --rows-small 20000 --rows-large 200000 --out stream.json   # a check
    python benchmarks/stream_memory.py --data data/stream_bench         # keep the generated sets there for reruns
    python benchmarks/stream_memory.py --formats parquet                # Parquet only (default: parquet,jsonl)

Two synthetic tabular sets (datasets/prepare.py tabular, 64 float32 features, 4 classes): a small one and a large
one. On each, one epoch of trainers/main.py (tabular_mlp.yaml, a small MLP, large batches, 2 CPU workers, an embedded
local Ray). While a run goes, the PSS of its whole process tree (the driver and every descendant: Ray's GCS, raylet,
workers) is summed every 0.2 s; the peak is that run's memory. PSS, not RSS: a page shared by several processes
(Ray's object store in /dev/shm, shared libraries) is counted once in the sum, not once per process. (The JSON also
holds the RSS sum and the machine's used-memory rise over each run, as cross-checks.)

    growth              = peak_large - peak_small   (Ray's and torch's fixed cost cancels out)
    memory_growth_ratio = growth / raw bytes of the large set (rows x features x 4; train + val)
    goal                : memory_growth_ratio <= 0.35 (a worker streams its data: memory bounded by a window)

The same again on JSON Lines copies of both sets (benchmarks/jsonl_copy.py: the same rows, one object per line):
jsonl_memory_growth_ratio, over the same raw bytes. Their line index is made once before the runs, into the runs'
layout cache (run.storage_path's .stride-cache/index, where a first run would leave it), so that every JSON Lines run
finds it made, as every Parquet run finds its footers.

Both runs are repeated --reps times (5; about 2 minutes a repetition here), alternating which goes first: one
sample per repetition, the figure is their median (benchmarks/figures.py memory_figure). A run whose tree goes over
--limit-gib (or that leaves the machine under 1.5 GiB available) is stopped by pid and reported as aborted: its peak,
and so that sample, is then a lower bound, which decides only a goal it is already over. Results: printed as JSON
(and --out FILE). `measure(rows_small, rows_large, tmp, reps=...)` returns the raw runs, for benchmarks/run.py.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # `python benchmarks/stream_memory.py` puts only benchmarks/ on the path
PY = sys.executable

from benchmarks.figures import GOALS, FORMAT_GOALS, fmt, jsonl_memory_figure, memory_figure, spread, verdict  # noqa: E402
from benchmarks.jsonl_copy import jsonl_copy  # noqa: E402
from benchmarks.procs import clean_env, kill_exact, meminfo, processes, rollup, system_used_bytes, tree  # noqa: E402

FEATURES = 64
CLASSES = 4
VAL_FRACTION = 0.01  # validation is not what is measured: keep it small
SAMPLE_EVERY_S = 0.2
MIN_AVAILABLE_BYTES = int(1.5 * 2**30)  # the machine is shared: stop our run before it starves everyone else
GIB, MIB = 2**30, 2**20

# One epoch, a small model, large batches: the data path dominates memory, and a run over 4M rows takes 1-2 minutes
# on 2 cores (most of it Ray's start and the data load). Validation and the checkpoint only at the end (null
# cadence), one checkpoint kept.
TRAIN_OVERRIDES = ["train.epochs=1", "train.max_steps=null", "scaling.num_workers=2", "scaling.cpus_per_worker=1",
                   "tracking.mlflow=false", "model.hidden_sizes=[64]", "train.batch_size_per_worker=4096",
                   "train.log_every_steps=50", "train.eval_every_steps=null", "checkpoint.every_steps=null",
                   "checkpoint.keep_last=1"]
CONFIG = "trainers/configs/tabular_mlp.yaml"


# ---------------------------------------------------------------- data sets

def raw_bytes(rows: int) -> int:
    """The feature matrix as float32 in memory: what "the size of the data set" means in the goal."""
    return rows * FEATURES * 4


def folder_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def make_set(out: Path, rows: int) -> dict:
    """Generate the set (train/ and val/ Parquet folders) unless `out` already holds it: prepare.py publishes by
    renaming a finished folder into place, so an existing `out` is a complete set."""
    t0 = time.perf_counter()
    generated = not out.exists()
    if generated:
        subprocess.run([PY, "datasets/prepare.py", "tabular", "--out", str(out), "--rows", str(rows),
                        "--features", str(FEATURES), "--classes", str(CLASSES), "--seed", "0",
                        "--val-fraction", str(VAL_FRACTION)], cwd=REPO, check=True, capture_output=True)
    return {"path": str(out), "rows": rows, "features": FEATURES, "raw_bytes": raw_bytes(rows),
            "parquet_bytes": folder_bytes(out), "generated": generated, "generate_s": time.perf_counter() - t0}


def make_jsonl_set(parquet: dict, out: Path, cache: Path) -> dict:
    """A JSON Lines copy of a generated set (unless `out` already holds one: it is copied beside it and renamed into
    place), and its line index made in the runs' layout cache `cache`."""
    from stride.datasets.splits import read_layouts, resolve_files

    t0 = time.perf_counter()
    generated = not out.exists()
    if generated:
        partial = out.with_name(out.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        jsonl_copy(Path(parquet["path"]), partial)
        partial.rename(out)
    copied = time.perf_counter()
    for split in ("train", "val"):
        key = f"data.{split}_path"
        read_layouts(resolve_files(str(out / split), key), key, cache)
    return {"path": str(out), "rows": parquet["rows"], "features": FEATURES, "raw_bytes": parquet["raw_bytes"],
            "jsonl_bytes": folder_bytes(out), "generated": generated, "generate_s": copied - t0,
            "index_s": time.perf_counter() - copied}


# ---------------------------------------------------------------- memory of a process tree

class TreeSampler:
    """Sums the PSS of a process tree on each call to sample(); keeps the peak, who held it, and a timeline."""

    def __init__(self, root: int, t0: float):
        self.root, self.t0 = root, t0
        self.seen: dict[int, float] = {}  # pid -> start time: every process of the tree ever seen, to stop leftovers
        self.peak, self.peak_at_s, self.peak_by_process = 0, None, []
        self.peak_rss_sum = 0  # RSS summed over the tree (shared pages counted once per process): for comparison
        self.system_base = system_used_bytes()
        self.system_peak = 0  # the machine's used memory above what it was at launch (a cross-check, noisy)
        self.timeline: list[tuple[float, int]] = []
        self.samples = 0
        self.live = 0  # processes of the tree alive at the last sample

    def sample(self) -> int:
        procs = processes()
        # Once seen, a process stays counted while it lives (same pid and start time), even after the driver has
        # exited and its daemons were re-parented out of the tree.
        pids = tree(self.root, procs) | {pid for pid, started in self.seen.items()
                                         if pid in procs and procs[pid]["start_s"] == started}
        self.seen.update((pid, procs[pid]["start_s"]) for pid in pids)
        self.live = len(pids)
        per = {pid: r for pid in pids if (r := rollup(pid)) is not None}
        total = sum(pss for pss, _ in per.values())
        t = time.perf_counter() - self.t0
        self.samples += 1
        self.timeline.append((t, total))
        self.peak_rss_sum = max(self.peak_rss_sum, sum(rss for _, rss in per.values()))
        self.system_peak = max(self.system_peak, system_used_bytes() - self.system_base)
        if total > self.peak:
            self.peak, self.peak_at_s = total, t
            top = sorted(((pss, pid) for pid, (pss, _) in per.items()), reverse=True)[:8]
            self.peak_by_process = [{"pid": pid, "pss_mib": round(pss / MIB, 1), "cmd": procs[pid]["cmdline"][:100]}
                                    for pss, pid in top]
        return total

    def coarse_timeline(self, points: int = 120) -> list[list[float]]:
        """At most `points` (seconds since launch, GiB) pairs: the shape of the run, not every sample."""
        step = max(1, len(self.timeline) // points)
        return [[round(t, 1), round(b / GIB, 3)] for t, b in self.timeline[::step]]


# ---------------------------------------------------------------- one training run

def stop_tree(proc: subprocess.Popen, sampler: TreeSampler) -> int:
    """SIGKILL the run's process group and every process of its tree still alive (by pid and start time, so a
    recycled pid is never hit). Ray's workers have process groups of their own, and the raylet may be forking one
    as we kill: sweep until a fresh look at the tree finds nobody. Returns how many were killed by pid."""
    killed = 0
    for _ in range(20):
        sampler.sample()  # also picks up what was forked since the last look (it is in the run's session)
        if not sampler.live:
            break
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the run's own group (start_new_session): only its processes
        except ProcessLookupError:
            pass
        killed += kill_exact(sampler.seen)
        time.sleep(0.1)
    return killed


def run_epoch(data: Path, storage: Path, name: str, timeout_s: float, limit_bytes: int) -> dict:
    """One epoch of trainers/main.py on `data`, its process tree's PSS sampled until it exits. Ray's daemons exit
    after the driver: those that outlive it by 10 s are stopped by pid."""
    cmd = [PY, "trainers/main.py", "--config", CONFIG, f"data.train_path={data / 'train'}",
           f"data.val_path={data / 'val'}", f"run.storage_path={storage}", f"run.name={name}", *TRAIN_OVERRIDES]
    log_path = storage / f"{name}.log"
    storage.mkdir(parents=True, exist_ok=True)
    aborted = None
    with open(log_path, "wb") as log:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=REPO, env=clean_env(), stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        sampler = TreeSampler(proc.pid, t0)
        try:
            while proc.poll() is None:
                tick = time.perf_counter()
                total = sampler.sample()
                if total > limit_bytes:
                    aborted = f"process tree PSS {total / GIB:.1f} GiB over the limit of {limit_bytes / GIB:.1f} GiB"
                elif meminfo()["MemAvailable"] < MIN_AVAILABLE_BYTES:
                    aborted = f"the machine had under {MIN_AVAILABLE_BYTES / GIB:.1f} GiB available"
                elif time.perf_counter() - t0 > timeout_s:
                    aborted = f"timed out after {timeout_s:.0f}s"
                if aborted:
                    stop_tree(proc, sampler)
                    break
                time.sleep(max(0.0, tick + SAMPLE_EVERY_S - time.perf_counter()))  # steady, whatever a sample costs
        except BaseException:  # Ctrl-C, SIGTERM or a bug here: never leave a training run (and its Ray) behind
            stop_tree(proc, sampler)
            raise
        rc = proc.wait()
        wall = time.perf_counter() - t0
    # The driver is gone; the daemons it started are shutting down. Keep sampling (they still hold memory).
    deadline = time.time() + 10
    while time.time() < deadline:
        sampler.sample()
        if not sampler.live:
            break
        time.sleep(SAMPLE_EVERY_S)
    leftovers = stop_tree(proc, sampler) if sampler.live else 0
    summary_path = storage / name / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    out = {"rc": rc, "aborted": aborted, "status": summary.get("status"), "wall_s": round(wall, 1),
           "train_wall_s": summary.get("train_wall_s"), "peak_pss_bytes": sampler.peak,
           "peak_pss_gib": round(sampler.peak / GIB, 3), "peak_at_s": sampler.peak_at_s,
           "peak_by_process": sampler.peak_by_process, "peak_rss_sum_bytes": sampler.peak_rss_sum,
           "system_used_peak_delta_bytes": sampler.system_peak, "samples": sampler.samples,
           "processes_seen": len(sampler.seen), "leftovers_killed": leftovers,
           "pss_gib_timeline": sampler.coarse_timeline(), "log": str(log_path)}
    if rc != 0 and not aborted:
        out["log_tail"] = log_path.read_text(errors="replace")[-3000:]
    return out


# ---------------------------------------------------------------- the measurement

def measure(rows_small: int, rows_large: int, tmp: Path, data: Path | None = None, reps: int = 5,
            timeout_s: float = 3600, limit_gib: float = 18.0, formats: tuple[str, ...] = ("parquet", "jsonl")) -> dict:
    """Generate both sets (under `data`, kept, or under `tmp`; with "jsonl" in `formats`, their JSON Lines copies
    too), then `reps` times one epoch on each, one run at a time, alternating which of a format's two goes first.
    Returns the raw runs; benchmarks/figures.py's memory_figure (jsonl_memory_figure) makes the figure of them (one
    sample per repetition). Runs write under `tmp`; the caller owns and removes it."""
    tmp, data = Path(tmp), Path(data) if data else Path(tmp) / "data"
    sets = {"small": make_set(data / f"tabular_{rows_small}x{FEATURES}", rows_small),
            "large": make_set(data / f"tabular_{rows_large}x{FEATURES}", rows_large)}
    pairs = [("small", "large")] if "parquet" in formats else []
    if "jsonl" in formats:
        cache = (tmp / "runs").resolve() / ".stride-cache" / "index"  # stride.datasets.splits.cache_folder of the runs
        for which in ("small", "large"):
            sets[f"{which}_jsonl"] = make_jsonl_set(sets[which], data / f"tabular_{sets[which]['rows']}x{FEATURES}_jsonl",
                                                    cache)
        pairs.append(("small_jsonl", "large_jsonl"))
    out_reps = []
    for rep in range(reps):
        runs = {}
        for which in (w for pair in pairs for w in (pair if rep % 2 == 0 else pair[::-1])):
            s = sets[which]
            size = (f"{s['parquet_bytes'] / MIB:.0f} MiB Parquet" if "parquet_bytes" in s
                    else f"{s['jsonl_bytes'] / MIB:.0f} MiB JSON Lines")
            print(f"stream_memory: rep {rep + 1}/{reps} {which}: {s['rows']} rows ({s['raw_bytes'] / MIB:.0f} MiB raw, "
                  f"{size}), one epoch on 2 workers", file=sys.stderr, flush=True)
            # Each run is stopped at the limit on its own, so the repetitions go on after an aborted one: an aborted
            # large run is a lower bound, an aborted small one leaves that repetition without a sample.
            r = run_epoch(Path(s["path"]), tmp / "runs", f"{which}_r{rep}", timeout_s, int(limit_gib * GIB))
            runs[which] = r
            print(f"stream_memory: {which}: exit {r['rc']}, peak PSS {r['peak_pss_gib']:.2f} GiB, "
                  f"wall {r['wall_s']:.0f}s" + (f" - ABORTED: {r['aborted']}" if r["aborted"] else ""),
                  file=sys.stderr, flush=True)
            if r["rc"] != 0 and not r["aborted"]:
                raise RuntimeError(f"the {which} run failed (exit {r['rc']}); log {r['log']}:\n{r.get('log_tail', '')}")
        out_reps.append({"rep": rep, **runs})
    return {
        "sets": {k: {kk: v for kk, v in s.items() if kk != "path"} for k, s in sets.items()},
        "reps": out_reps,
        "job": f"{CONFIG} " + " ".join(TRAIN_OVERRIDES),
        "sample_every_s": SAMPLE_EVERY_S, "limit_gib": limit_gib,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python benchmarks/stream_memory.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows-small", type=int, default=200_000, help="rows of the small set (200k: ~50 MB raw)")
    ap.add_argument("--rows-large", type=int, default=4_000_000, help="rows of the large set (4M: ~1 GB raw)")
    ap.add_argument("--data", type=Path, help="folder for the generated sets, kept and reused by later runs")
    ap.add_argument("--out", type=Path, help="also write the JSON result to this file")
    ap.add_argument("--reps", type=int, default=5, help="repetitions (samples); a verdict needs 5")
    ap.add_argument("--timeout-s", type=float, default=3600, help="per training run")
    ap.add_argument("--limit-gib", type=float, default=18.0, help="stop a run whose process tree's PSS goes over this")
    ap.add_argument("--keep-tmp", action="store_true", help="keep the temporary folder (runs, logs, generated sets)")
    ap.add_argument("--formats", default="parquet,jsonl", help="the sets' formats, comma-separated: parquet, jsonl")
    args = ap.parse_args(argv)
    # A SIGTERM (a CI timeout) unwinds like Ctrl-C: the run being measured is stopped and the temporary folder removed.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    tmp = Path(tempfile.mkdtemp(prefix="stride-stream-memory-"))
    try:
        formats = tuple(f.strip() for f in args.formats.split(",") if f.strip())
        if not formats or set(formats) - {"parquet", "jsonl"}:
            ap.error(f"--formats takes parquet, jsonl or both, not {args.formats!r}")
        raw = measure(args.rows_small, args.rows_large, tmp, data=args.data, reps=args.reps,
                      timeout_s=args.timeout_s, limit_gib=args.limit_gib, formats=formats)
    finally:
        if args.keep_tmp:
            print(f"stream_memory: kept {tmp}", file=sys.stderr)
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    figs = {}
    if "parquet" in formats:
        figs["memory_growth_ratio"] = (memory_figure({"memory": raw}), GOALS["memory_growth_ratio"])
    if "jsonl" in formats:
        figs["jsonl_memory_growth_ratio"] = (jsonl_memory_figure({"memory": raw}),
                                             FORMAT_GOALS["jsonl_memory_growth_ratio"])
    results = {name: verdict(fig, goal) for name, (fig, goal) in figs.items()}
    text = json.dumps({"raw": raw, **{name: fig for name, (fig, _) in figs.items()},
                       "goals": results}, indent=1, default=str)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    for name, (fig, _) in figs.items():
        print(f"stream_memory: {name} {fmt(fig['median'], 'ratio')} ({spread(fig)}, n={fig['n']}) "
              f"(goal {results[name]['goal']}): {results[name]['verdict']}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
