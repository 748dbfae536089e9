"""Where Stride's two-worker step gap to torchrun comes from (README, Performance: `step_time_ratio`).

    .venv/bin/python benchmarks/step_gap.py [--steps 400] [--reps 3] [--out benchmarks/results]

Runs the default job (trainers/configs/char_gpt.yaml, no checkpoints or evaluation in the measured window) four
ways, one after the other: Stride and torchrun with 1 worker, then with 2. For each run it reports the median
steady-state `step_time_s`; for the 2-worker runs also, over 10 s of steady state:
* the CPU each thread of the job used (/proc/<pid>/task/*/stat), the training thread's share of a core and its
  CPU seconds per step (= share x step time: the work one step costs);
* with py-spy (--native --idle, 200 Hz) on rank 0, after that: the share of the training thread's samples spent
  in `pthread_cond_timedwait` (CPython 3.11's GIL wait, under Python frames or pybind11's gil_scoped_acquire) and
  in `pthread_cond_wait` (gloo's all-reduce and the autograd engine waiting), and what the process's other
  threads were doing when not idle.
Each of the four runs is repeated (--reps, interleaved); medians and per-rep ratios go to step-gap-<date>.json.
About 4 minutes per repetition on 2 cores.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from stride.ray_cluster.node import processes  # noqa: E402

PYTHON = sys.executable
BIN = Path(PYTHON).parent
WARM_STEP = 60  # measure after this step: start-up, compilation of the first steps and the first log lines are over
SAMPLE_S = 10.0


def job_args(root: Path, name: str, steps: int) -> list[str]:
    """The default job, no checkpoints, evaluation or MLflow: the same for every runtime compared."""
    return ["--config", "trainers/configs/char_gpt.yaml", f"run.storage_path={root}", f"run.name={name}",
            f"train.max_steps={steps}", "train.log_every_steps=5", "train.eval_every_steps=100000",
            "checkpoint.every_steps=100000", "tracking.mlflow=false"]


def command(runtime: str, workers: int, args: list[str]) -> list[str]:
    if runtime == "stride":
        return [PYTHON, "trainers/main.py", *args, f"scaling.num_workers={workers}"]
    return [str(BIN / "torchrun"), "--nproc-per-node", str(workers), "--master-port", str(29400 + workers),
            "trainers/torchrun.py", *args]


def job(runtime: str, workers: int, steps: int, root: Path) -> tuple[subprocess.Popen, Path]:
    run = Path(tempfile.mkdtemp(prefix=f"{runtime}{workers}-", dir=root))  # a new run each time, never a resume
    proc = subprocess.Popen(command(runtime, workers, job_args(root, run.name, steps)), cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return proc, run / "metrics.jsonl"


def logged(metrics: Path) -> list[dict]:
    try:
        return [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    except OSError:
        return []


def wait_for_step(proc: subprocess.Popen, metrics: Path, step: int) -> None:
    while not any(r.get("step", 0) >= step for r in logged(metrics)):
        if proc.poll() is not None:
            raise RuntimeError(f"the job exited with {proc.returncode} before step {step}")
        time.sleep(0.5)


def tree(pid: int) -> dict[int, dict]:
    procs = processes()
    found = {pid}
    while True:
        kids = {q for q, p in procs.items() if p["ppid"] in found and q not in found}
        if not kids:
            return {q: procs[q] for q in found if q in procs}
        found |= kids


def training_pids(runtime: str, procs: dict[int, dict]) -> list[int]:
    if runtime == "stride":
        return sorted(q for q, p in procs.items() if "RayTrainWorker" in p["cmdline"])
    # torchrun's workers; not its agent (`python .../bin/torchrun ... trainers/torchrun.py`)
    return sorted(q for q, p in procs.items() if "trainers/torchrun.py" in p["cmdline"] and "bin/torchrun" not in p["cmdline"])


def thread_cpu(pids: list[int]) -> dict[tuple[int, int], tuple[str, int]]:
    out = {}
    for pid in pids:
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
            except OSError:
                continue
            fields = stat[stat.rindex(")") + 2:].split()
            out[(pid, int(tid))] = (stat[stat.index("(") + 1:stat.rindex(")")], int(fields[11]) + int(fields[12]))
    return out


def classify(raw: Path) -> dict:
    """py-spy raw stacks of one process -> where its training thread waited, and its other threads' activity."""
    training, others = collections.Counter(), collections.Counter()
    for line in raw.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        frames = stack.split(";")
        # The innermost named frame (py-spy ends a stack in libc with an unnamed address: skip it).
        named = [f for f in frames if not f.startswith("0x")]
        leaf = named[-1]
        if "train_step" in stack or "(trainers/loop.py" in stack:
            if leaf.startswith("pthread_cond_timedwait"):
                # CPython's take_gil (static, unnamed by py-spy) waits with a timeout: under a Python frame, or under
                # pybind11's gil_scoped_acquire / ~gil_scoped_release where torch takes the GIL back
                training["gil_wait"] += int(n)
            elif leaf.startswith("pthread_cond_wait"):
                training["cond_wait"] += int(n)  # gloo all-reduce / autograd engine waiting for work
            else:
                training["running_or_runnable"] += int(n)
        else:
            idle = leaf.startswith(("epoll_wait", "pthread_cond", "Event.wait", "Condition.wait")) or frames[-1].startswith("0x")
            py = [f.split(" (")[0] for f in frames if ".py" in f]
            others["idle" if idle else (py[-1] if py else frames[-1].split(" (")[0])] += int(n)
    total = sum(training.values()) or 1
    return {"training_thread_samples": total, **{k: v / total for k, v in training.items()},
            "other_threads_busy_samples": dict(collections.Counter({k: v for k, v in others.items() if k != "idle"})
                                               .most_common(8))}


def measure(runtime: str, workers: int, steps: int, root: Path) -> dict:
    proc, metrics = job(runtime, workers, steps, root)
    out: dict = {"runtime": runtime, "workers": workers}
    try:
        wait_for_step(proc, metrics, WARM_STEP)
        if workers == 2:
            procs = tree(proc.pid)
            train = training_pids(runtime, procs)
            everything = sorted(procs)
            # First the threads' CPU, then py-spy (its sampling takes CPU of its own: not while counting).
            a, t0 = thread_cpu(everything), time.perf_counter()
            time.sleep(SAMPLE_S)
            b, dt = thread_cpu(everything), time.perf_counter() - t0
            tick = os.sysconf("SC_CLK_TCK")
            cores = {k: (b[k][1] - a[k][1]) / tick / dt for k in b if k in a}
            busiest = [max((c, k) for k, c in cores.items() if k[0] == pid) for pid in train]
            out["training_thread_cores"] = [round(c, 3) for c, _ in busiest]
            out["other_threads_cores"] = round(sum(cores.values()) - sum(c for c, _ in busiest), 3)
            spy = shutil.which("py-spy") or (str(BIN / "py-spy") if (BIN / "py-spy").exists() else None)
            raw = root / f"{runtime}-spy.txt"
            if spy and train:
                r = subprocess.run([spy, "record", "--pid", str(train[0]), "--native", "--idle", "--threads",
                                    "-d", str(int(SAMPLE_S)), "-r", "200", "--format", "raw", "-o", str(raw)],
                                   capture_output=True, text=True, timeout=120)
                out["py_spy_rank0"] = (classify(raw) if raw.exists() else
                                       {"skipped": f"py-spy exited {r.returncode}: {r.stderr.strip()[-300:]}"})
            else:
                out["py_spy_rank0"] = {"skipped": "py-spy is not installed"}
        proc.wait(timeout=900)
    finally:
        if proc.poll() is None:
            proc.kill()
    times = sorted(r["step_time_s"] for r in logged(metrics) if "step_time_s" in r and r["step"] > WARM_STEP // 2)
    out["step_time_s"] = statistics.median(times)
    if "training_thread_cores" in out:
        out["cpu_s_per_step"] = round(statistics.mean(out["training_thread_cores"]) * out["step_time_s"], 4)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--reps", type=int, default=3, help="repetitions of the four runs, interleaved")
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="stride-gap-"))
    try:
        runs = [measure(rt, w, args.steps, root) for _ in range(args.reps) for w in (1, 2)
                for rt in ("stride", "torchrun")]
    finally:
        shutil.rmtree(root, ignore_errors=True)

    def median(runtime: str, workers: int, key: str, pick=lambda v: v) -> float | None:
        values = [pick(r[key]) for r in runs if r["runtime"] == runtime and r["workers"] == workers and key in r]
        values = [v for v in values if v is not None]
        return statistics.median(values) if values else None

    summary = {f"{rt}_{w}": {"step_time_s": median(rt, w, "step_time_s")} for w in (1, 2) for rt in ("stride", "torchrun")}
    for rt in ("stride", "torchrun"):
        summary[f"{rt}_2"].update(
            training_thread_cores=median(rt, 2, "training_thread_cores", statistics.mean),
            cpu_s_per_step=median(rt, 2, "cpu_s_per_step"), other_threads_cores=median(rt, 2, "other_threads_cores"),
            gil_wait=median(rt, 2, "py_spy_rank0", lambda d: d.get("gil_wait", 0.0) if "skipped" not in d else None),
            cond_wait=median(rt, 2, "py_spy_rank0", lambda d: d.get("cond_wait", 0.0) if "skipped" not in d else None))
    ratios = {f"step_time_ratio_{w}_worker{'s' if w > 1 else ''}": sorted(
        a["step_time_s"] / b["step_time_s"] for a, b in zip(
            [r for r in runs if r["runtime"] == "stride" and r["workers"] == w],
            [r for r in runs if r["runtime"] == "torchrun" and r["workers"] == w])) for w in (1, 2)}
    result = {"started": time.strftime("%Y-%m-%dT%H:%M:%S"), "loadavg": os.getloadavg(), "cpu_count": os.cpu_count(),
              "steps": args.steps, "reps": args.reps, "ratios_per_rep": ratios, "medians": summary, "runs": runs}
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"step-gap-{time.strftime('%Y-%m-%dT%H%M')}.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    for key, m in summary.items():
        print(f"{key:10s} " + ", ".join(f"{k} {v:.4g}" for k, v in m.items() if v is not None))
    for key, values in ratios.items():
        print(f"{key}: median {statistics.median(values):.3f} (per rep {', '.join(f'{v:.3f}' for v in values)})")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
