"""What in Ray costs Stride its step time against torchrun: Ray's daemons, Train's worker group, or the GIL?

    .venv/bin/python benchmarks/child_loop.py [--steps 300] [--reps 3] [--out benchmarks/results]

README, Performance: where the step-time gap between Stride on Ray Train and torchrun comes from. Each runtime
trains the default job (trainers/configs/char_gpt.yaml, 2 workers, no checkpoints, evaluation or MLflow in the
measured window); the runtimes chosen (--runtimes, torchrun last) are interleaved, --reps times:
* `stride`: `python trainers/main.py` (embedded Ray, the loop in the Ray worker's training thread);
* `stride_nice0`: Ray starts its workers at nice 15, below its daemons; this starts them at nice 0;
* `stride_poll2`, `ray_child_poll2`: with Ray Train's default 2 s controller poll instead of Stride's 0.1 s;
* `ray_child`: the same embedded Ray start (stride.ray_cluster.connect's quiet_ray_env and init_ray, as
  trainers/main.py calls them) and a 2-worker TorchTrainer whose per-worker function only starts
  `trainers/torchrun.py` as a child process (RANK/WORLD_SIZE/MASTER_* set, a process group of its own) and waits
  for it: Ray's resident processes and idle Ray workers are all there, but no Ray thread shares the training
  process;
* `ray_child_driver_env`: `ray_child` whose child gets the driver's environment (as torchrun's workers get their
  launcher's), not the one Ray gives its worker processes;
* `torchrun_beside_ray`: the same embedded Ray start, idle (no Train, no workers), and beside it
  `torchrun --nproc-per-node 2 trainers/torchrun.py` started by that driver: what Ray's resident processes alone cost;
* `torchrun`: `torchrun --nproc-per-node 2 trainers/torchrun.py`.
Median steady-state `step_time_s` of each run, and per-rep ratios to torchrun, go to child-loop-<date>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.step_gap import WARM_STEP, command, job_args, logged, wait_for_step  # noqa: E402

PYTHON = sys.executable
# Variants: the same runtime with these environment variables (set before Ray starts, so its raylet and workers
# see them). Stride asks for a 0.1 s controller poll (stride.ray_cluster.connect.quiet_ray_env); Ray's default is 2 s.
VARIANTS = {"stride_nice0": ("stride", {"RAY_worker_niceness": "0"}),
            "stride_poll2": ("stride", {"RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "2"}),
            "ray_child_poll2": ("ray_child", {"RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "2"}),
            "ray_child_driver_env": ("ray_child", {"CHILD_LOOP_DRIVER_ENV": "1"})}
RUNTIMES = ("stride", *VARIANTS, "ray_child", "torchrun_beside_ray", "torchrun")


def ray_driver(runtime: str, args: list[str]) -> int:
    """The driver of `ray_child` and `torchrun_beside_ray`: embedded Ray as trainers/main.py starts it, then
    either Train workers that each run the loop as a child, or torchrun beside the idle Ray."""
    import ray.train
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from stride.ray_cluster.connect import init_ray, quiet_ray_env

    quiet_ray_env()
    init_ray(log_to_driver=False)
    if runtime == "torchrun_beside_ray":
        return subprocess.run(command("torchrun", 2, args), cwd=REPO, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL).returncode
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

    driver_env = dict(os.environ, OMP_NUM_THREADS="1")  # torchrun sets 1 thread per worker too

    def per_worker(config: dict) -> None:
        ctx = ray.train.get_context()
        env = dict(config["driver_env"] or os.environ, RANK=str(ctx.get_world_rank()),
                   WORLD_SIZE=str(ctx.get_world_size()), LOCAL_RANK=str(ctx.get_local_rank()),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(config["port"]))
        subprocess.run([config["python"], "trainers/torchrun.py", *config["args"]], cwd=config["repo"], env=env,
                       check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    storage = tempfile.mkdtemp(prefix="ray-child-")
    config = {"python": PYTHON, "repo": str(REPO), "args": args, "port": port,
              "driver_env": driver_env if os.environ.get("CHILD_LOOP_DRIVER_ENV") else None}
    trainer = TorchTrainer(per_worker, train_loop_config=config,
                           scaling_config=ScalingConfig(num_workers=2, resources_per_worker={"CPU": 1}),
                           run_config=RunConfig(storage_path=storage, name="ray-child"))
    trainer.fit()
    shutil.rmtree(storage, ignore_errors=True)
    return 0


def measure(runtime: str, steps: int, root: Path) -> float:
    name = f"{runtime}-{time.monotonic_ns()}"
    args = job_args(root, name, steps)
    base, extra = VARIANTS.get(runtime, (runtime, {}))
    env = dict(os.environ, **extra)
    if base in ("stride", "torchrun"):
        cmd = command(base, 2, args)
    else:
        cmd = [PYTHON, __file__, "--ray-driver", base, "--", *args]
    metrics = root / name / "metrics.jsonl"
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for_step(proc, metrics, steps)
        proc.wait(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
    times = [r["step_time_s"] for r in logged(metrics) if "step_time_s" in r and r["step"] > WARM_STEP // 2]
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--runtimes", default=",".join(RUNTIMES), help="comma-separated subset of " + ",".join(RUNTIMES))
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    ap.add_argument("--ray-driver", choices=("ray_child", "torchrun_beside_ray"), help=argparse.SUPPRESS)
    ap.add_argument("job", nargs="*", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.ray_driver:
        return ray_driver(args.ray_driver, args.job)
    runtimes = [rt for rt in RUNTIMES if rt in args.runtimes.split(",")]
    assert "torchrun" in runtimes, "the ratios need torchrun"
    root = Path(tempfile.mkdtemp(prefix="stride-child-"))
    started, load_start = time.strftime("%Y-%m-%dT%H:%M:%S"), os.getloadavg()
    try:
        runs = [{"rep": rep, "runtime": rt, "step_time_s": measure(rt, args.steps, root)}
                for rep in range(args.reps) for rt in runtimes]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    step = {rt: [r["step_time_s"] for r in runs if r["runtime"] == rt] for rt in runtimes}
    ratios = {rt: [a / b for a, b in zip(step[rt], step["torchrun"])] for rt in runtimes[:-1]}
    result = {"started": started, "loadavg_start": load_start, "loadavg_end": os.getloadavg(),
              "cpu_count": os.cpu_count(), "steps": args.steps, "reps": args.reps,
              "median_step_time_s": {rt: statistics.median(v) for rt, v in step.items()},
              "ratio_to_torchrun_per_rep": ratios,
              "ratio_to_torchrun_median": {rt: statistics.median(v) for rt, v in ratios.items()}, "runs": runs}
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"child-loop-{time.strftime('%Y-%m-%dT%H%M')}.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    for rt in runtimes:
        line = f"{rt:10s} median step {statistics.median(step[rt]):.4f} s"
        if rt in ratios:
            line += (f", / torchrun: median {statistics.median(ratios[rt]):.3f} "
                     f"(per rep {', '.join(f'{v:.3f}' for v in ratios[rt])})")
        print(line)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
