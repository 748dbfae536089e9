"""Side-by-side benchmarks of Stride: Ray Train vs torchrun, ingest, scaling, checkpoint blocking.

    python benchmarks/run.py --quick            # make bench: 3 repetitions, < 10 minutes on 2 cores
    python benchmarks/run.py --full             # 5 repetitions, longer runs, a bigger ingest set
    python benchmarks/run.py --smoke --out DIR  # one tiny repetition (the test suite), results into DIR

Every figure is a ratio (or a time) measured side by side, in one process tree on this machine, and repeated; the
JSON holds each repetition, the median and the spread (min, max), the goal and pass/fail, the machine's CPU count
and load averages. Results: <out>/latest.json and a dated copy <out>/<YYYY-MM-DDTHHMM>.json (default out:
benchmarks/results).

What runs (each launch is a fresh process tree; temporary storage only, never the repo's runs/):
1. pairs, `reps` times, order alternating: `torchrun --nproc-per-node 2 trainers/torchrun.py` and
   `python trainers/main.py` (embedded Ray, 2 CPU workers), same config, same data, same loop:
   -> step_time_ratio, wall_ratio, time_to_first_step_s, data_wait_fraction, ckpt_blocked_fraction
2. benchmarks/ray_bench.py (one embedded Ray): ingest from the files through Stride's streaming path vs pyarrow
   (-> ingest_ratio), then Stride fits with 1 and 2 workers alternating (-> scaling_2_over_1).
3. benchmarks/stream_memory.py: peak memory of one epoch over ~1 GB vs ~50 MB of Parquet (-> memory_growth_ratio).
4. benchmarks/checkpoint_bench.py: a 2-worker FSDP char_gpt checkpointed with the earlier rank-0 gather and with DCP
   shards, alternating (-> checkpoint_rank0_memory_ratio, checkpoint_blocked_ratio).
5. benchmarks/blocks_bench.py: train.activation_checkpointing and train.compile on and off, one CPU worker
   (-> ac_memory_ratio, ac_step_time_ratio, compile_step_time_ratio).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # `python benchmarks/run.py` puts only benchmarks/ on the path
PY = sys.executable

from stride.ray_cluster.node import processes  # noqa: E402 - the /proc table, as the cluster tools stop processes
CONFIG = "trainers/configs/char_gpt.yaml"


@dataclass(frozen=True)
class Mode:
    reps: int  # repetitions of every measurement
    steps: int  # optimizer steps of the paired job
    log_every: int
    ckpt_every: int  # one or more checkpoints inside the run (plus the final one)
    warmup_steps: int  # log lines at or below this step are warm-up, dropped
    scale_steps: int
    scale_log_every: int
    scale_warmup_steps: int
    ingest_rows: int  # rows of the generated tabular ingest set
    ingest_features: int
    ingest_passes: int
    timeout_s: int  # per launch
    scale_workers: tuple = (1,)  # (1,): 2-worker throughput from the paired Stride runs; (1, 2): own paired fits
    stream_rows: tuple = (200_000, 4_000_000)  # small / large set of benchmarks/stream_memory.py (~50 MB / ~1 GB raw)
    # benchmarks/checkpoint_bench.py's char_gpt (layers, width, heads): the largest that trains on 2 CPU workers here
    # under FSDP (docs/fsdp.md#memory), 302.6M parameters
    ckpt_model: tuple = (24, 1024, 16)


MODES = {
    "smoke": Mode(reps=1, steps=12, log_every=3, ckpt_every=6, warmup_steps=3, scale_steps=8, scale_log_every=2,
                  scale_warmup_steps=2, ingest_rows=20_000, ingest_features=16, ingest_passes=3, timeout_s=300,
                  stream_rows=(20_000, 200_000), ckpt_model=(2, 256, 4)),
    "quick": Mode(reps=3, steps=40, log_every=5, ckpt_every=20, warmup_steps=10, scale_steps=25, scale_log_every=5,
                  scale_warmup_steps=5, ingest_rows=400_000, ingest_features=32, ingest_passes=9, timeout_s=420),
    "full": Mode(reps=5, steps=200, log_every=10, ckpt_every=100, warmup_steps=20, scale_steps=100, scale_log_every=10,
                 scale_warmup_steps=20, ingest_rows=2_000_000, ingest_features=32, ingest_passes=9, timeout_s=900,
                 scale_workers=(1, 2)),
}

GOALS = {  # figure: (operator, threshold)
    "step_time_ratio": ("<=", 1.02),
    "wall_ratio": ("<=", 1.5),
    "ingest_ratio": (">=", 1.0),
    "data_wait_fraction": ("<", 0.02),
    "ckpt_blocked_fraction": ("<=", 0.2),
    "memory_growth_ratio": ("<=", 0.35),
    "checkpoint_rank0_memory_ratio": ("<=", 0.5),
    "checkpoint_blocked_ratio": ("<", 1.0),
    "ac_memory_ratio": ("<=", 0.6),
    "ac_step_time_ratio": ("<=", 1.5),
    "compile_step_time_ratio": ("<=", 1.0),
}

WHAT = {
    "step_time_ratio": "median steady-state step time, Stride on Ray Train / torchrun (same loop, data, config)",
    "wall_ratio": "wall time launch to exit of the same short job, Stride / torchrun",
    "time_to_first_step_s": "launch to the end of the first optimizer step (rank 0)",
    "ingest_ratio": "rows/s from the files, Stride's streaming path on one worker (row groups in the epoch's order, "
                    "window shuffle, micro-batches of arrays) / pyarrow reading the same files in that process",
    "data_wait_fraction": "share of step time a worker spends building its next batch (Stride, default job)",
    "scaling_2_over_1": "Stride throughput (samples/s), 2 workers / 1 worker at the same per-worker batch",
    "ckpt_blocked_fraction": "training time blocked by a mid-run checkpoint / that checkpoint's total write time (Stride)",
    "memory_growth_ratio": "(peak PSS of the whole process tree, one epoch on ~1 GB of Parquet - on ~50 MB) / raw "
                           "bytes of the large set; 2 CPU workers (benchmarks/stream_memory.py)",
    "checkpoint_rank0_memory_ratio": "rank 0's peak memory rise during a checkpoint of a 2-worker FSDP char_gpt, DCP "
                                     "shards / the earlier rank-0 gather (benchmarks/checkpoint_bench.py)",
    "checkpoint_blocked_ratio": "training time blocked by that checkpoint (the slowest rank), DCP shards / rank-0 gather",
    "ac_memory_ratio": "peak memory rise of a training step, train.activation_checkpointing on / off, a 12-layer "
                       "char_gpt on one CPU worker, RSS with MALLOC_MMAP_THRESHOLD_=65536 so that it follows the "
                       "live tensors (benchmarks/blocks_bench.py; glibc's defaults: rss_ratio_glibc_defaults)",
    "ac_step_time_ratio": "step time, train.activation_checkpointing on / off, the same 12-layer char_gpt",
    "compile_step_time_ratio": "step time, train.compile on / off (inductor), the default char_gpt on one CPU worker",
}


# ---------------------------------------------------------------- small helpers

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def summarize(samples: list[float]) -> dict:
    xs = [x for x in samples if x is not None and math.isfinite(x)]
    if not xs:
        return {"median": float("nan"), "min": float("nan"), "max": float("nan"), "n": 0, "samples": samples}
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs), "samples": samples}


def figure(name: str, samples: list[float], unit: str, goal: tuple[str, float] | None = None, **extra) -> dict:
    s = summarize(samples)
    value = s["median"]
    ok = None
    if goal is not None and math.isfinite(value):
        op, thr = goal
        ok = {"<=": value <= thr, "<": value < thr, ">=": value >= thr, ">": value > thr}[op]
    return {"value": value, **s, "unit": unit, "goal": f"{goal[0]} {goal[1]:g}" if goal else None,
            "pass": ok, "what": WHAT.get(name, ""), **extra}


def descendants(pid: int) -> dict[int, float]:
    """Every process below `pid` with its start time (so a pid reused later is never killed by mistake)."""
    procs = processes()
    children: dict[int, list[int]] = {}
    for child, info in procs.items():
        children.setdefault(info["ppid"], []).append(child)
    out, todo = {}, [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out[child] = procs[child]["start_s"]
            todo.append(child)
    return out


def _alive(procs: dict[int, float]) -> list[int]:
    """Those of `procs` still running as the same process (same pid and start time)."""
    now = processes()
    return [pid for pid, started in procs.items() if pid in now and now[pid]["start_s"] == started]


def kill_exact(procs: dict[int, float]) -> int:
    """SIGKILL the processes we started that are still alive. Returns how many."""
    n = 0
    for pid in _alive(procs):
        try:
            os.kill(pid, signal.SIGKILL)
            n += 1
        except ProcessLookupError:
            pass
    return n


def clean_env() -> dict:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    for k in ("RAY_ADDRESS", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "RAY_AUTH_MODE", "STRIDE_SAMPLE_LOG"):
        env.pop(k, None)
    return env


@dataclass
class Launch:
    rc: int
    wall_s: float
    first_step_s: float | None
    leftovers_killed: int
    log: str
    lines: list


def launch(cmd: list[str], log_path: Path, timeout_s: float, sample_log: Path | None = None, env: dict | None = None) -> Launch:
    """Run one job in its own session, from launch to exit. While it runs, poll (20 ms) for the end of its first
    optimizer step: rank 0's sample log (STRIDE_SAMPLE_LOG, one line per micro-step, written as the step's batch is
    built) gets its second line when step 2 starts, i.e. when step 1 has ended. Both runtimes write it the same way.
    Afterwards, every process of the tree still alive (Ray daemons) is stopped by pid."""
    env = dict(env or clean_env())
    if sample_log is not None:
        env["STRIDE_SAMPLE_LOG"] = str(sample_log)
    rank0 = sample_log / "rank0.jsonl" if sample_log is not None else None
    seen: dict[int, str | None] = {}
    with open(log_path, "w") as logf:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                start_new_session=True)
        # Every output line goes to the log prefixed with its arrival time since launch: the startup phases.
        stamped: list[tuple[float, str]] = []

        def pump():
            for raw in proc.stdout:
                t = time.perf_counter() - t0
                line = raw.decode(errors="replace").rstrip("\n")
                stamped.append((t, line))
                logf.write(f"{t:9.3f} {line}\n")

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        first = None
        next_scan = t0 + 1.0
        timed_out = False
        while proc.poll() is None:
            now = time.perf_counter()
            if first is None and rank0 is not None:
                try:
                    if rank0.stat().st_size and rank0.read_bytes().count(b"\n") >= 2:
                        first = now - t0
                except OSError:
                    pass
            if now >= next_scan:
                seen.update(descendants(proc.pid))
                next_scan = now + 2.0
            if now - t0 > timeout_s:
                timed_out = True
                seen.update(descendants(proc.pid))
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                kill_exact(seen)
                proc.wait()
                break
            time.sleep(0.02 if first is None else 0.1)
        wall = time.perf_counter() - t0
        reader.join(timeout=15)
    # Ray's daemons exit on their own after the driver; give them a moment, then stop what is left of ours.
    deadline = time.time() + 10
    while time.time() < deadline and _alive(seen):
        time.sleep(0.25)
    left = kill_exact(seen)
    return Launch(124 if timed_out else proc.returncode, wall, first, left, str(log_path), stamped)


PHASES = {  # marker in the job's output -> phase that has ended when it appears (first occurrence)
    "stride": [("ray_init", "stride: Ray dashboard"), ("driver_data_read", "stride: read "),
               ("worker_group_started", "Started training worker group"), ("worker_data_loaded", "INFO data: "),
               ("first_log_step", " INFO step ")],
    "torchrun": [("worker_data_loaded", "INFO data: "), ("first_log_step", " INFO step ")],
}


def phases(runtime: str, stamped: list[tuple[float, str]], first_step: float | None, wall: float, steps: int) -> dict:
    """Seconds since launch at which each phase ended, from the job's own output lines (first occurrence)."""
    out: dict = {}
    for name, marker in PHASES[runtime]:
        out[name] = next((t for t, line in stamped if marker in line), None)
    out["first_step_done"] = first_step
    out["last_step_logged"] = next((t for t, line in stamped if f" INFO step {steps}/{steps} " in line), None)
    if runtime == "stride":
        out["fit_returned"] = next((t for t, line in stamped if line.startswith("stride: completed")), None)
    out["exit"] = wall
    return out


def steady(lines: list[dict], warmup_steps: int, ckpt_steps: list[int]) -> list[dict]:
    """Log lines of steady-state training: after warm-up, and not touched by a checkpoint (the line after each
    mid-run checkpoint, and further ones until the line that reports the checkpoint's write as finished)."""
    train = [x for x in lines if "train_loss" in x]
    touched: set[int] = set()
    for c in ckpt_steps:
        after = [x for x in train if x["step"] > c]
        if not after:
            continue
        done = next((i for i, x in enumerate(after) if "checkpoint_write_s" in x), 0)
        touched.update(x["step"] for x in after[:done + 1])
    return [x for x in train if x["step"] > warmup_steps and x["step"] not in touched]


def median_of(lines: list[dict], key: str) -> float | None:
    xs = [x[key] for x in lines if isinstance(x.get(key), (int, float))]
    return statistics.median(xs) if xs else None


def checkpoint_figures(lines: list[dict], ckpt_steps: list[int]) -> list[dict]:
    """Per mid-run checkpoint: seconds it blocked training (first log line after it) and its total write time
    (the first line after it that reports a finished write)."""
    train = [x for x in lines if "train_loss" in x]
    out = []
    for c in ckpt_steps:
        after = [x for x in train if x["step"] > c]
        blocked = next((x["checkpoint_blocked_s"] for x in after if "checkpoint_blocked_s" in x), None)
        write = next((x["checkpoint_write_s"] for x in after if "checkpoint_write_s" in x), None)
        out.append({"step": c, "blocked_s": blocked, "write_s": write,
                    "fraction": blocked / write if blocked is not None and write else None})
    return out


# ---------------------------------------------------------------- the paired runs

def job_overrides(mode: Mode, storage: Path, name: str) -> list[str]:
    # The default job (char_gpt.yaml: 3 layers, width 128, context 64, 32 sequences per worker, AdamW, fp32), shortened;
    # validation off (it would add the same eval time to both sides), MLflow on for both, into the run's own store.
    return [f"run.name={name}", f"run.storage_path={storage}", f"train.max_steps={mode.steps}",
            f"train.log_every_steps={mode.log_every}", f"train.eval_every_steps={mode.steps}",
            f"checkpoint.every_steps={mode.ckpt_every}", "data.val_path=null",
            f"tracking.mlflow_uri=sqlite:///{storage / 'mlflow.db'}"]


def run_pair_member(runtime: str, rep: int, mode: Mode, tmp: Path) -> dict:
    storage = tmp / f"{runtime}_r{rep}"
    storage.mkdir(parents=True)
    name = "bench"
    over = job_overrides(mode, storage, name)
    if runtime == "stride":
        cmd = [PY, "trainers/main.py", "--config", CONFIG, *over]
    else:
        torchrun = str(Path(PY).parent / "torchrun")
        cmd = [torchrun, "--nproc-per-node", "2", "--master-port", str(free_port()), "trainers/torchrun.py",
               "--config", CONFIG, *over]
    load_before = os.getloadavg()
    r = launch(cmd, tmp / f"{runtime}_r{rep}.log", mode.timeout_s, sample_log=storage / "samples")
    run_dir = storage / name
    lines = read_jsonl(run_dir / "metrics.jsonl")
    ckpts = [s for s in range(mode.ckpt_every, mode.steps, mode.ckpt_every)]
    st = steady(lines, mode.warmup_steps, ckpts)
    summary = json.loads((run_dir / "summary.json").read_text()) if (run_dir / "summary.json").exists() else {}
    out = {"runtime": runtime, "rep": rep, "rc": r.rc, "wall_s": r.wall_s, "time_to_first_step_s": r.first_step_s,
           "phases_s": phases(runtime, r.lines, r.first_step_s, r.wall_s, mode.steps),
           "steady_steps": [x["step"] for x in st], "step_time_s": median_of(st, "step_time_s"),
           "samples_per_second": median_of(st, "samples_per_second"),
           "data_wait_fraction": median_of(st, "data_wait_fraction"), "data_wait_s": median_of(st, "data_wait_s"),
           "checkpoints": checkpoint_figures(lines, ckpts), "train_wall_s": summary.get("train_wall_s"),
           "summary_wall_s": summary.get("wall_s"), "status": summary.get("status"),
           "loadavg_before": load_before, "loadavg_after": os.getloadavg(), "leftovers_killed": r.leftovers_killed,
           "log": r.log, "metrics": lines}
    if r.rc != 0:
        out["log_tail"] = Path(r.log).read_text()[-3000:]
    return out


# ---------------------------------------------------------------- ray_bench (ingest, scaling)

def run_ray_bench(mode: Mode, tmp: Path) -> dict:
    ingest_dir = tmp / "ingest_tabular"
    subprocess.run([PY, "datasets/prepare.py", "tabular", "--out", str(ingest_dir), "--rows", str(mode.ingest_rows),
                    "--features", str(mode.ingest_features), "--classes", "4", "--seed", "0"],
                   cwd=REPO, check=True, capture_output=True)
    scale_over = [f"train.max_steps={mode.scale_steps}", f"train.log_every_steps={mode.scale_log_every}",
                  f"train.eval_every_steps={mode.scale_steps}", f"checkpoint.every_steps={mode.scale_steps}",
                  "data.val_path=null"]
    spec = {
        "storage": str(tmp / "ray_bench"), "passes": mode.ingest_passes,
        "ingest_sets": {
            "tabular": {"config": "trainers/configs/tabular_mlp.yaml",
                        "overrides": [f"data.train_path={ingest_dir / 'train'}", f"data.val_path={ingest_dir / 'val'}"]},
            "pystdlib": {"config": CONFIG, "overrides": []},
        },
        "scaling": {"config": CONFIG, "reps": mode.reps, "overrides": scale_over, "workers": list(mode.scale_workers)},
    }
    spec_path, out_path = tmp / "ray_bench_spec.json", tmp / "ray_bench_out.json"
    spec_path.write_text(json.dumps(spec))
    timeout = mode.timeout_s * (len(mode.scale_workers) * mode.reps + 1)
    r = launch([PY, "benchmarks/ray_bench.py", str(spec_path), str(out_path)], tmp / "ray_bench.log", timeout)
    if r.rc != 0 or not out_path.exists():
        raise RuntimeError(f"benchmarks/ray_bench.py failed (exit {r.rc}); log {r.log}:\n"
                           + Path(r.log).read_text()[-3000:])
    out = json.loads(out_path.read_text())
    out["wall_s"] = r.wall_s
    for run in out["scaling"]["runs"]:
        lines = read_jsonl(Path(run["run_dir"]) / "metrics.jsonl")
        st = steady(lines, mode.scale_warmup_steps, [])
        run["steady_steps"] = [x["step"] for x in st]
        run["samples_per_second"] = median_of(st, "samples_per_second")
        run["step_time_s"] = median_of(st, "step_time_s")
        run["metrics"] = lines
    return out


# ---------------------------------------------------------------- figures

def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b not in (None, 0) else None


def compute(mode: Mode, pairs: list[dict], rb: dict) -> dict:
    by = {(p["runtime"], p["rep"]): p for p in pairs}
    reps = range(mode.reps)
    s = [by[("stride", i)] for i in reps]
    t = [by[("torchrun", i)] for i in reps]
    figs: dict = {}
    figs["step_time_ratio"] = figure("step_time_ratio", [ratio(a["step_time_s"], b["step_time_s"]) for a, b in zip(s, t)],
                                     "ratio", GOALS["step_time_ratio"],
                                     stride_step_time_s=summarize([a["step_time_s"] for a in s]),
                                     torchrun_step_time_s=summarize([b["step_time_s"] for b in t]))
    figs["wall_ratio"] = figure("wall_ratio", [ratio(a["wall_s"], b["wall_s"]) for a, b in zip(s, t)], "ratio",
                                GOALS["wall_ratio"], stride_wall_s=summarize([a["wall_s"] for a in s]),
                                torchrun_wall_s=summarize([b["wall_s"] for b in t]),
                                job=f"char_gpt, {mode.steps} steps, no validation, checkpoints at every "
                                    f"{mode.ckpt_every} steps and the end")
    figs["time_to_first_step_s"] = {
        "stride": figure("time_to_first_step_s", [a["time_to_first_step_s"] for a in s], "s"),
        "torchrun": figure("time_to_first_step_s", [b["time_to_first_step_s"] for b in t], "s"),
        "goal": None, "what": WHAT["time_to_first_step_s"],
        "phases_s": {rt: {k: summarize([p["phases_s"].get(k) for p in runs])["median"] for k in runs[0]["phases_s"]}
                     for rt, runs in (("stride", s), ("torchrun", t))}}
    ing = rb["ingest"]
    tab, txt = ing["tabular"], ing["pystdlib"]

    def rows_per_s(block: dict, key: str) -> list[float]:
        return [block["rows"][key] / x for x in block["seconds"][key]]

    def pass_ratios(block: dict, num: str, den: str) -> list[float]:
        return [a / b for a, b in zip(rows_per_s(block, num), rows_per_s(block, den))]

    figs["ingest_ratio"] = figure(
        "ingest_ratio", pass_ratios(tab, "stride", "pyarrow"), "ratio", GOALS["ingest_ratio"],
        data=f"tabular Parquet, {tab['rows']['pyarrow']} rows x {mode.ingest_features} float32 features + label + "
             f"sample_id ({len(ing['files']['tabular'])} files), one worker, from the files (nothing pre-loaded)",
        stride_rows_per_s=summarize(rows_per_s(tab, "stride")), pyarrow_rows_per_s=summarize(rows_per_s(tab, "pyarrow")),
        default_job_data={"data": f"data/pystdlib/train, {txt['rows']['pyarrow']} rows of tokens + sample_id",
                          "ingest_ratio": summarize(pass_ratios(txt, "stride", "pyarrow")),
                          "stride_rows_per_s": summarize(rows_per_s(txt, "stride")),
                          "pyarrow_rows_per_s": summarize(rows_per_s(txt, "pyarrow"))},
        threads_in_worker=ing.get("threads"))
    figs["data_wait_fraction"] = figure("data_wait_fraction", [a["data_wait_fraction"] for a in s], "fraction",
                                        GOALS["data_wait_fraction"],
                                        torchrun=summarize([b["data_wait_fraction"] for b in t]),
                                        stride_data_wait_s=summarize([a["data_wait_s"] for a in s]))
    sc = {(r["workers"], r["rep"]): r for r in rb["scaling"]["runs"]}
    one = [sc[(1, i)]["samples_per_second"] for i in reps]
    if all((2, i) in sc for i in reps):  # --full: 2-worker fits of its own, alternating with the 1-worker ones
        two, source = [sc[(2, i)]["samples_per_second"] for i in reps], "ray_bench 2-worker fits (paired)"
    else:  # the paired Stride runs above: same loop, same per-worker batch, steady-state windows
        two, source = [a["samples_per_second"] for a in s], "the paired trainers/main.py runs (2 workers)"
    figs["scaling_2_over_1"] = figure(
        "scaling_2_over_1", [ratio(b, a) for a, b in zip(one, two)], "ratio", None, ideal=2.0,
        samples_per_second_1=summarize(one), samples_per_second_2=summarize(two), two_worker_source=source,
        job=f"char_gpt, 32 sequences per worker, 1 torch thread per worker; 1 worker: Stride's trainer "
            f"(stride.trainers.driver.build_trainer), {mode.scale_steps} steps")
    ck = [c for a in s for c in a["checkpoints"]]
    ckt = [c for b in t for c in b["checkpoints"]]
    figs["ckpt_blocked_fraction"] = figure(
        "ckpt_blocked_fraction", [c["fraction"] for c in ck], "fraction", GOALS["ckpt_blocked_fraction"],
        blocked_s=summarize([c["blocked_s"] for c in ck]), write_s=summarize([c["write_s"] for c in ck]),
        torchrun=summarize([c["fraction"] for c in ckt]),
        checkpoint_bytes="char_gpt model + AdamW state (about 7.7 MB)")
    return figs


def flat_figures(figs: dict) -> list[tuple[str, dict]]:
    out = []
    for name, f in figs.items():
        if "value" in f:
            out.append((name, f))
        else:
            out.extend((f"{name} ({k})", v) for k, v in f.items() if isinstance(v, dict) and "value" in v)
    return out


def table(figs: dict) -> str:
    rows = [("figure", "median", "spread (min..max, n)", "goal", "result")]
    for name, f in flat_figures(figs):
        fmt = (lambda v: f"{v:.3f}") if f["unit"] != "s" else (lambda v: f"{v:.1f} s")
        res = "-" if f["pass"] is None else ("PASS" if f["pass"] else "FAIL")
        rows.append((name, fmt(f["value"]), f"{fmt(f['min'])}..{fmt(f['max'])}, n={f['n']}", f["goal"] or "-", res))
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def machine() -> dict:
    info = {"cpu_count": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
            "hostname": socket.gethostname()}
    try:
        model = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), None)
        info["cpu_model"] = model
        info["mem_gib"] = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (OSError, ValueError):
        pass
    try:
        import torch

        info["torch"] = torch.__version__
    except ImportError:
        pass
    try:
        from importlib.metadata import version

        info["ray"] = version("ray")
        info["pyarrow"] = version("pyarrow")
    except Exception:  # noqa: BLE001
        pass
    return info


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python benchmarks/run.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--quick", dest="mode", action="store_const", const="quick", help="3 repetitions, < 10 min (default)")
    g.add_argument("--full", dest="mode", action="store_const", const="full", help="5 repetitions, longer runs")
    g.add_argument("--smoke", dest="mode", action="store_const", const="smoke", help="1 tiny repetition (tests)")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results"), help="folder for latest.json and the dated copy")
    ap.add_argument("--keep-tmp", action="store_true", help="keep the temporary run folders and logs")
    args = ap.parse_args(argv)
    mode_name = args.mode or "quick"
    mode = MODES[mode_name]
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="stride-bench-"))
    started = datetime.now()
    t0 = time.perf_counter()
    load_start = os.getloadavg()
    print(f"bench: {mode_name}: {mode.reps} repetition(s); temporary runs in {tmp}; load average "
          f"{load_start[0]:.2f} on {os.cpu_count()} CPUs", flush=True)
    if not (REPO / "data" / "pystdlib" / "train").exists():  # the default job's data, built as `make train` does
        print("bench: building data/pystdlib (datasets/prepare.py pystdlib)", flush=True)
        subprocess.run([PY, "datasets/prepare.py", "pystdlib", "--out", "data/pystdlib"], cwd=REPO, check=True)
    try:
        pairs = []
        for rep in range(mode.reps):
            for runtime in (("torchrun", "stride") if rep % 2 == 0 else ("stride", "torchrun")):
                p = run_pair_member(runtime, rep, mode, tmp)
                pairs.append(p)
                print(f"bench: rep {rep + 1}/{mode.reps} {runtime:8s} exit {p['rc']} wall {p['wall_s']:.1f}s first step "
                      f"{p['time_to_first_step_s'] or float('nan'):.1f}s steady step {p['step_time_s'] or float('nan'):.3f}s "
                      f"(load {p['loadavg_after'][0]:.1f})", flush=True)
                if p["rc"] != 0:
                    raise RuntimeError(f"{runtime} run failed (exit {p['rc']}); log {p['log']}:\n{p.get('log_tail', '')}")
        print("bench: ingest and scaling (benchmarks/ray_bench.py)", flush=True)
        rb = run_ray_bench(mode, tmp)
        print(f"bench: ray_bench done in {rb['wall_s']:.1f}s", flush=True)
        print("bench: memory growth with the data set (benchmarks/stream_memory.py)", flush=True)
        from benchmarks.stream_memory import measure as stream_memory  # here, not at the top: it imports run.py
        sm = stream_memory(*mode.stream_rows, tmp / "stream_memory", timeout_s=mode.timeout_s)
        figs = compute(mode, pairs, rb)
        figs["memory_growth_ratio"] = figure(
            "memory_growth_ratio", [sm["memory_growth_ratio"]], "ratio", GOALS["memory_growth_ratio"],
            growth_bytes=sm["growth_bytes"], peak_pss_bytes=sm["peak_pss_bytes"], raw_bytes=sm["raw_bytes"],
            parquet_bytes=sm["parquet_bytes"], wall_s=sm["wall_s"], lower_bound=sm["lower_bound"])
        print("bench: checkpoint cost per rank, rank-0 gather vs DCP (benchmarks/checkpoint_bench.py)", flush=True)
        from benchmarks.checkpoint_bench import measure as checkpoint_bench

        cb = checkpoint_bench(*mode.ckpt_model, reps=1 if mode_name == "smoke" else 2, tmp=tmp / "checkpoint_bench",
                              timeout_s=mode.timeout_s * 2)
        figs["checkpoint_rank0_memory_ratio"] = figure(
            "checkpoint_rank0_memory_ratio", [cb["rank0_memory_ratio"]], "ratio", GOALS["checkpoint_rank0_memory_ratio"],
            model=cb["model"], params=cb["params"], per_rank=cb["per_rank"])
        figs["checkpoint_blocked_ratio"] = figure(
            "checkpoint_blocked_ratio", [cb["blocked_ratio"]], "ratio", GOALS["checkpoint_blocked_ratio"],
            complete_ratio=cb["complete_ratio"], max_rank_memory_ratio=cb["max_rank_memory_ratio"])
        print("bench: activation checkpointing and torch.compile on CPU (benchmarks/blocks_bench.py)", flush=True)
        from benchmarks.blocks_bench import measure as blocks_bench

        bb = blocks_bench(reps=1 if mode_name == "smoke" else 2, steps=3 if mode_name == "smoke" else 6,
                          warmup=1 if mode_name == "smoke" else 2, smoke=mode_name == "smoke", timeout_s=mode.timeout_s)
        v = bb["variants"]
        figs["ac_memory_ratio"] = figure(
            "ac_memory_ratio", [bb["ac_memory_ratio"]["deep"]], "ratio", GOALS["ac_memory_ratio"],
            default_model=bb["ac_memory_ratio"]["default"],
            allocated_peak_increase_bytes={k: v[k]["median_allocated_peak_increase_bytes"] for k in v
                                           if "median_allocated_peak_increase_bytes" in v[k]},
            rss_ratio_glibc_defaults=bb["ac_rss_ratio"],
            peak_increase_bytes={k: v[k]["median_peak_increase_bytes"] for k in v})
        figs["ac_step_time_ratio"] = figure(
            "ac_step_time_ratio", [bb["ac_step_time_ratio"]["deep"]], "ratio", GOALS["ac_step_time_ratio"],
            default_model=bb["ac_step_time_ratio"]["default"], step_s={k: v[k]["median_step_s"] for k in v})
        figs["compile_step_time_ratio"] = figure(
            "compile_step_time_ratio", [bb["compile_step_time_ratio"]], "ratio", GOALS["compile_step_time_ratio"],
            compile_warmup_s=bb["compile_warmup_s"])
    finally:
        if not args.keep_tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    result = {
        "mode": mode_name, "started": started.isoformat(timespec="seconds"),
        "duration_s": time.perf_counter() - t0, "machine": machine(),
        "loadavg_start": load_start, "loadavg_end": os.getloadavg(),
        "workload": {"model": "char_gpt (trainers/configs/char_gpt.yaml): 3 layers, width 128, 4 heads, context 64, "
                              "fp32, AdamW; 32 sequences per worker, 2 CPU workers of 1 CPU (1 torch thread) each",
                     "data": "data/pystdlib/train (91k rows of 65 bytes)",
                     "why": "the default job; a step is ~0.1-0.5 s of forward/backward on one core, so Ray's "
                            "per-step and per-report costs show against real compute, not against an empty loop",
                     "mode": asdict(mode)},
        "figures": figs,
        "runs": {"pairs": pairs, "ray_bench": rb, "stream_memory": sm, "checkpoint_bench": cb, "blocks_bench": bb},
    }
    stamp = started.strftime("%Y-%m-%dT%H%M")
    text = json.dumps(result, indent=1, default=str) + "\n"
    dated = out_dir / f"{stamp}.json"
    dated.write_text(text)
    (out_dir / "latest.json").write_text(text)
    print()
    print(table(figs))
    print(f"\nbench: {mode_name} took {result['duration_s']:.0f}s; load average {load_start[0]:.2f} -> "
          f"{result['loadavg_end'][0]:.2f} on {os.cpu_count()} CPUs; wrote {out_dir / 'latest.json'} and {dated}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
