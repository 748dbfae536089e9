"""What the metric sinks and train.ema cost a training step, side by side (issue 25).

    python benchmarks/run.py --only sinks

sink_overhead_ratio: one process trains tabular_mlp made wide (HIDDEN: steps of tens of milliseconds, as a real
model's, not the microseconds of the default MLP's) with trainers/torchrun.py without a launcher for STEPS steps,
logging every LOG_EVERY, with metrics.jsonl alone (tracking.sinks=[]) and with MLflow (sqlite), TensorBoard and W&B
offline all on, alternating which goes first; a sample per repetition: the all-on run's seconds per step over the
alone run's (summary.json's train_wall_s / global_step: the loop's wall time, every log step's sinks included).
The difference in milliseconds per step is reported beside it.

ema_step_time_ratio: the same model made wide (FSDP's cost of a step, not the data's) under FSDP on 2 CPU ranks
(torch.distributed.run --standalone), train.ema on and off, alternating; a sample per repetition: the median
step_time_s of metrics.jsonl past the warm-up, on over off.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.append(str(REPO))  # appended: the repository's datasets/ must not hide Hugging Face's `datasets`

from benchmarks.procs import run_checked  # noqa: E402

PY = sys.executable
CONFIG = REPO / "trainers" / "configs" / "tabular_mlp.yaml"
ROWS = 20_000
STEPS, LOG_EVERY = 300, 10
HIDDEN = "[1024, 1024, 1024]"
EMA_STEPS, WARMUP = 120, 20
_run = functools.partial(run_checked, who="sinks_bench")  # a step that must succeed
SMOKE = {"steps": 60, "ema_steps": 30, "warmup": 5}
SINKS = {"alone": "tracking.sinks=[]", "all": "tracking.sinks=[mlflow,tensorboard,wandb]"}
EMA = {"off": "train.ema=null", "on": "train.ema={decay: 0.999, eval: raw}"}




def _common(data: Path, storage: Path, name: str, steps: int) -> list[str]:
    return ["--config", str(CONFIG), f"data.train_path={data}/train", f"data.val_path={data}/val",
            f"run.storage_path={storage}", f"run.name={name}", "train.epochs=null", f"train.max_steps={steps}",
            f"train.log_every_steps={LOG_EVERY}", "train.eval_every_steps=null", "checkpoint.every_steps=null",
            "train.num_threads=1"]


def sinks_run(data: Path, tmp: Path, variant: str, rep: int, steps: int, timeout_s: int) -> dict:
    storage = tmp / f"sinks_{variant}_{rep}"
    env = dict(os.environ, WANDB_MODE="offline", WANDB_DIR=str(tmp / "wandb"), WANDB_CONFIG_DIR=str(tmp / "wandb"),
               WANDB_CACHE_DIR=str(tmp / "wandb"), WANDB_SILENT="true", PYTHONUNBUFFERED="1")
    _run([PY, "trainers/torchrun.py", *_common(data, storage, "s", steps), f"model.hidden_sizes={HIDDEN}",
          SINKS[variant]], env, timeout_s)
    s = json.loads((storage / "s" / "summary.json").read_text())
    shutil.rmtree(storage, ignore_errors=True)
    return {"rep": rep, "variant": variant, "steps": s["global_step"], "train_wall_s": s["train_wall_s"],
            "s_per_step": s["train_wall_s"] / s["global_step"], "loadavg": os.getloadavg()[0]}


def ema_run(data: Path, tmp: Path, variant: str, rep: int, steps: int, warmup: int, timeout_s: int) -> dict:
    storage = tmp / f"ema_{variant}_{rep}"
    cmd = [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "trainers/torchrun.py",
           *_common(data, storage, "e", steps), "train.strategy=fsdp", f"model.hidden_sizes={HIDDEN}",
           "tracking.sinks=[]", EMA[variant]]
    _run(cmd, dict(os.environ, PYTHONUNBUFFERED="1"), timeout_s)
    lines = [json.loads(x) for x in (storage / "e" / "metrics.jsonl").read_text().splitlines() if x.strip()]
    times = [x["step_time_s"] for x in lines if "step_time_s" in x and x["step"] > warmup]
    shutil.rmtree(storage, ignore_errors=True)
    return {"rep": rep, "variant": variant, "step_time_s": statistics.median(times), "log_lines": len(times),
            "loadavg": os.getloadavg()[0]}


def measure(reps: int = 5, smoke: bool = False, timeout_s: int = 600) -> dict:
    steps, ema_steps, warmup = ((SMOKE["steps"], SMOKE["ema_steps"], SMOKE["warmup"]) if smoke
                                else (STEPS, EMA_STEPS, WARMUP))
    tmp = Path(tempfile.mkdtemp(prefix="stride-sinks-bench-"))
    started = datetime.now().isoformat(timespec="seconds")
    t0 = time.perf_counter()
    try:
        data = tmp / "data"
        _run([PY, "datasets/prepare.py", "tabular", "--out", str(data), "--rows", str(ROWS)], dict(os.environ), 300)
        runs, ema = [], []
        for rep in range(reps):
            for v in (("alone", "all") if rep % 2 == 0 else ("all", "alone")):
                runs.append(sinks_run(data, tmp, v, rep, steps, timeout_s))
                print(f"sinks_bench: rep {rep + 1}/{reps} sinks {v:5s} {runs[-1]['s_per_step'] * 1e3:.2f} ms/step",
                      flush=True)
            for v in (("off", "on") if rep % 2 == 0 else ("on", "off")):
                ema.append(ema_run(data, tmp, v, rep, ema_steps, warmup, timeout_s))
                print(f"sinks_bench: rep {rep + 1}/{reps} ema {v:3s} {ema[-1]['step_time_s'] * 1e3:.2f} ms/step",
                      flush=True)
        return {"started": started, "cpu_count": os.cpu_count(), "steps": steps, "log_every": LOG_EVERY,
                "ema_steps": ema_steps, "hidden": HIDDEN, "warmup": warmup, "rows": ROWS, "runs": runs,
                "ema_runs": ema, "wall_s": time.perf_counter() - t0}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    print(json.dumps(measure(reps=int(sys.argv[1]) if len(sys.argv) > 1 else 1, smoke="--smoke" in sys.argv),
                     indent=1))
