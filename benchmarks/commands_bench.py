"""What the commands after training and a run's start cost, side by side (issue 26).

    python benchmarks/run.py --only commands

predict_throughput_ratio: rows per second of `stride predict` on 2 CPU workers (torch.distributed.run --standalone,
the gang's own path; the same job code runs on Ray) over a hand-written loop on 2 processes launched the same way
(benchmarks/commands_bench.py `hand`: the checkpoint's weights loaded with safetensors-free torch, each process's
row groups read with pyarrow, the same transform, a torch.no_grad() forward, one Parquet file per row group), over
the same Parquet and checkpoint (tabular_mlp made wide: HIDDEN), alternating which goes first; a sample per
repetition: rows / the launch's wall seconds, Stride's over the hand loop's.

time_to_first_step_ratio: seconds from the launch to the first training step's line in metrics.jsonl (polled every
20 ms), `stride train` with an embedded Ray over the same job under torchrun (2 CPU workers each), alternating; and
the same with `stride train` joining an already-running head (RAY_ADDRESS, as `ray job submit` users run) over
torchrun: time_to_first_step_on_head_ratio.

preemption_steps_lost: benchmarks/preemption_bench.py's scenario per repetition (a two-node cluster on this machine,
a node drained with reason preemption under a 2-worker run): the steps trained after the preemption checkpoint that
the restarted gang trained again. The figure is their median, as every figure's (benchmarks/figures.py); the largest
is beside it (`worst`).
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.append(str(REPO))  # appended: the repository's datasets/ must not hide Hugging Face's `datasets`

from benchmarks.procs import free_port, run_checked  # noqa: E402

PY = sys.executable
CONFIG = REPO / "trainers" / "configs" / "tabular_mlp.yaml"
ROWS, PREDICT_ROWS = 4_000, 200_000
HIDDEN = "[1024, 1024, 1024]"
SMOKE = {"predict_rows": 20_000}
_run = functools.partial(run_checked, who="commands_bench")  # a step that must succeed; its seconds
TORCHRUN = [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]




def _train_args(data: Path, storage: Path, name: str, *extra: str) -> list[str]:
    return ["--config", str(CONFIG), f"data.train_path={data}/train", f"data.val_path={data}/val",
            f"run.storage_path={storage}", f"run.name={name}", "train.epochs=null", "tracking.sinks=[]",
            "scaling.num_workers=2", "scaling.cpus_per_worker=1", f"model.hidden_sizes={HIDDEN}", *extra]


# ---- predict ----

def hand(argv: list[str]) -> None:
    """The hand-written loop: `commands_bench.py hand RUN_DIR DATA OUT BATCH` on each rank of a torchrun launch."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq
    import torch

    sys.path.insert(0, str(REPO))
    from stride.trainers.run import checkpointing
    from stride.trainers.config_reader import from_dict
    from stride.trainers.tasks import make_task

    run, data, out, batch = Path(argv[0]), Path(argv[1]), Path(argv[2]), int(argv[3])
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    torch.set_num_threads(1)
    summary = json.loads((run / "summary.json").read_text())
    task = make_task(from_dict(summary["config"]), summary["facts"])
    model = task.build_model()
    model.load_state_dict(checkpointing.load_model_state(checkpointing.newest_complete(run)))
    model.eval()
    task.training = False
    f = pq.ParquetFile(data)
    out.mkdir(parents=True, exist_ok=True)
    with torch.no_grad():
        for g in range(rank, f.metadata.num_row_groups, world):
            table = f.read_row_group(g, columns=list(task.predict_columns))
            labels, probs = [], []
            for lo in range(0, table.num_rows, batch):
                part = table.slice(lo, batch)
                x = task.transform({c: part.column(c).to_numpy() for c in part.column_names})
                p = torch.softmax(model(torch.from_numpy(x["x"])).float(), -1)
                labels.append(p.argmax(-1).numpy())
                probs.append(p.numpy())
            p = np.concatenate(probs)
            pq.write_table(pa.table({"label": np.concatenate(labels), "probs": pa.FixedSizeListArray.from_arrays(
                pa.array(p.reshape(-1)), p.shape[1])}), out / f"part-{g:06d}.parquet")


def predict_run(run: Path, data: Path, tmp: Path, variant: str, rep: int, rows: int, timeout_s: int) -> dict:
    out = tmp / f"predict_{variant}_{rep}"
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    if variant == "stride":
        cmd = [*TORCHRUN, "-m", "stride", "predict", "--run-dir", str(run), "--data", str(data), "--out", str(out),
               "--batch-size", "1024", "train.num_threads=1"]
    else:
        cmd = [*TORCHRUN, str(Path(__file__).resolve()), "hand", str(run), str(data), str(out), "1024"]
    wall = _run(cmd, env, timeout_s)
    shutil.rmtree(out, ignore_errors=True)
    return {"rep": rep, "variant": variant, "rows": rows, "wall_s": wall, "rows_per_s": rows / wall,
            "loadavg": os.getloadavg()[0]}


# ---- time to the first step ----

def first_step_run(data: Path, tmp: Path, variant: str, rep: int, timeout_s: int, head_env: dict | None) -> dict:
    """Launch, then poll metrics.jsonl until the first training line: seconds from the launch."""
    storage, name = tmp / f"first_{variant}_{rep}", "f"
    args = _train_args(data, storage, name, "train.max_steps=3", "train.log_every_steps=1",
                       "train.eval_every_steps=null", "checkpoint.every_steps=null", "tracking.mlflow=false")
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("RAY_ADDRESS", None)
    if variant == "torchrun":
        cmd = [*TORCHRUN, "trainers/torchrun.py", *args]
    else:
        cmd = [PY, "-m", "stride", "train", *args]
        if variant == "head":
            env.update(head_env)
    metrics = storage / name / "metrics.jsonl"
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    first = None
    try:
        while first is None and time.perf_counter() - t0 < timeout_s:
            if metrics.exists() and '"train_loss"' in metrics.read_text():
                first = time.perf_counter() - t0
            elif proc.poll() is not None and proc.returncode != 0:
                raise RuntimeError(f"commands_bench: {variant} exited {proc.returncode}: {proc.stderr.read()[-2000:]}")
            time.sleep(0.02)
        proc.wait(timeout_s)
    finally:
        if proc.poll() is None:
            proc.kill()
    shutil.rmtree(storage, ignore_errors=True)
    return {"rep": rep, "variant": variant, "first_step_s": first, "loadavg": os.getloadavg()[0]}


def start_head() -> tuple[dict, object]:
    """A token-auth local head on free ports with 2 CPUs (ray_cluster/local.py; a short folder: Ray's socket paths),
    stopped by its own pids afterwards (local.stop_head)."""
    sys.path.insert(0, str(REPO))
    from stride.ray_cluster import local

    head = local.start_head(temp_dir=Path(tempfile.mkdtemp(prefix="scb-", dir="/tmp")), port=free_port(),
                            dashboard_port=free_port(), num_cpus=2)
    return head.client_env(), head


def local_stop(head) -> None:
    from stride.ray_cluster import local

    local.stop_head(head)
    shutil.rmtree(head.temp_dir, ignore_errors=True)


def preemption_run(tmp: Path, rep: int) -> dict:
    """benchmarks/preemption_bench.py's scenario (a node drained for preemption under a 2-worker run)."""
    from benchmarks.preemption_bench import scenario

    work = tmp / f"preempt_{rep}"
    work.mkdir()
    r = scenario(work)
    shutil.rmtree(work, ignore_errors=True)
    print(f"commands_bench: rep {rep + 1} preemption: {r.get('preemption_steps_lost')} steps lost", flush=True)
    return {"rep": rep, "steps_lost": r.get("preemption_steps_lost"), "status": (r.get("summary") or {}).get("status"),
            "checkpoint_step": r.get("preemption_checkpoint_step"), "resumed_at_step": r.get("resumed_at_step"),
            "resumed_after_deadline_s": r.get("resumed_after_deadline_s"), "wall_s": r.get("wall_s")}




def measure(reps: int = 5, smoke: bool = False, timeout_s: int = 600) -> dict:
    rows = SMOKE["predict_rows"] if smoke else PREDICT_ROWS
    tmp = Path(tempfile.mkdtemp(prefix="stride-commands-bench-"))
    started = datetime.now().isoformat(timespec="seconds")
    t0 = time.perf_counter()
    head = None
    try:
        data, big = tmp / "data", tmp / "predict_data"
        _run([PY, "datasets/prepare.py", "tabular", "--out", str(data), "--rows", str(ROWS)], dict(os.environ), 300)
        _run([PY, "datasets/prepare.py", "tabular", "--out", str(big), "--rows", str(rows)], dict(os.environ), 300)
        import pyarrow.parquet as pq

        table = pq.read_table(big / "train").drop_columns(["label", "sample_id"])
        pq.write_table(table, tmp / "predict.parquet", row_group_size=max(1, table.num_rows // 32))
        run_storage = tmp / "runs"
        _run([*TORCHRUN, "trainers/torchrun.py", *_train_args(data, run_storage, "model", "train.max_steps=2",
                                                              "checkpoint.every_steps=2", "train.eval_every_steps=null")],
             dict(os.environ), timeout_s)
        head_env, head = start_head()
        predicts, firsts = [], []
        for rep in range(reps):
            for v in (("stride", "hand") if rep % 2 == 0 else ("hand", "stride")):
                predicts.append(predict_run(run_storage / "model", tmp / "predict.parquet", tmp, v, rep, table.num_rows,
                                            timeout_s))
                print(f"commands_bench: rep {rep + 1}/{reps} predict {v:6s} {predicts[-1]['rows_per_s']:.0f} rows/s",
                      flush=True)
            order = ("embedded", "torchrun", "head") if rep % 2 == 0 else ("head", "torchrun", "embedded")
            for v in order:
                firsts.append(first_step_run(data, tmp, v, rep, timeout_s, head_env))
                print(f"commands_bench: rep {rep + 1}/{reps} first step {v:8s} {firsts[-1]['first_step_s']:.1f} s",
                      flush=True)
        local_stop(head)
        head = None
        preemptions = [preemption_run(tmp, rep) for rep in range(max(1, reps // 2) if smoke else reps)]
        return {"started": started, "cpu_count": os.cpu_count(), "hidden": HIDDEN, "predict_rows": table.num_rows,
                "row_groups": pq.ParquetFile(tmp / "predict.parquet").metadata.num_row_groups,
                "predict_runs": predicts, "first_step_runs": firsts, "preemption_runs": preemptions,
                "wall_s": time.perf_counter() - t0}
    finally:
        if head is not None:
            local_stop(head)
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    if sys.argv[1:2] == ["hand"]:
        hand(sys.argv[2:])
    else:
        print(json.dumps(measure(reps=int(sys.argv[1]) if len(sys.argv) > 1 else 1, smoke="--smoke" in sys.argv),
                         indent=1))
