"""`stride eval`: a run's checkpoint evaluated on its validation split, or on other data, on a gang.

    stride eval --run runs/my_run [--checkpoint last|best|PATH] [--data PATH] [--name NAME] [section.field=value ...]
    stride eval --run s3://bucket/runs/my_run     # a run on a bucket: eval/<name>.json is uploaded beside it
    torchrun --standalone --nproc-per-node 2 -m stride eval --run runs/my_run

The gang is the run's (scaling.*; overrides change it), with its task, precision and strategy (FSDP shards the
model again), and evaluation is the loop's own (trainers/loop.py): on the run's validation split, its checkpoint and
world size, val_loss equals the one the run recorded, bitwise on CPU. Writes <run>/eval/<name>.json (name: the
checkpoint's, plus the data's with --data) and prints the figures. On Ray (RAY_ADDRESS, or an embedded local Ray),
or under torchrun when started by it.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from stride.cli import reports_errors
from stride.trainers.run import checkpointing
from stride.trainers.callbacks import Callbacks, averages
from stride.trainers.callbacks.base import CallbackState
from stride.trainers.commands import trained
from stride.trainers.loop import RunPlan, Trainer

# `stride NAME`, its line in `stride --help` and its place there (stride/commands.py reads these unimported).
NAME = "eval"
HELP = "evaluate a run's checkpoint on its validation split or other data"
ORDER = 10


@dataclass(frozen=True)
class JobPlan(RunPlan):
    """A RunPlan for work after training: the checkpoint to load, and the command's own settings."""

    checkpoint: str = ""
    out: str = ""  # predict: the output folder
    out_uri: str = ""  # predict: the output on a bucket (each worker uploads its parts there; out is unused)
    batch_rows: int = 64  # predict: rows per forward
    keep_columns: tuple[str, ...] = ()  # predict: input columns copied into the output rows

    @classmethod
    def of(cls, run, spec, **settings) -> JobPlan:
        """The job over `spec`'s rows with the trained run's (trained.TrainedRun) checkpoint, facts and workers."""
        return cls(run_dir=str(run.run_dir), train=None, val=spec, facts=run.facts, checkpoint=str(run.checkpoint),
                   cpus_per_worker=run.cfg.scaling.cpus_per_worker, **settings)


class CheckpointModel:
    """The run's model, precision and strategy with a checkpoint's weights, for work after training: no optimizer,
    no data order, no sinks. Composed of the training loop's own phases (a Trainer's setup_process, setup_precision,
    build_model and evaluate, so that FSDP shards and evaluation are the run's), never a run of its own. `shard=False`
    keeps the whole model on every rank (predict: no rank waits on another's collectives, so each can skip work that
    is already done)."""

    def __init__(self, cfg, env, plan: JobPlan, shard: bool = True):
        self.cfg, self.env, self.plan, self.shard = cfg, env, plan, shard
        self.loop = Trainer(cfg, env, plan)  # its phases; fit() is never called
        self.task = self.loop.task
        self.checkpoint_dir = Path(plan.checkpoint)
        # build_model reads init.from under a trainable_only checkpoint, as a resume does
        self.meta = self.loop.resume_meta = checkpointing.read_meta(self.checkpoint_dir)
        self.model = self.precision = self.ema = None

    def load(self) -> None:
        loop = self.loop
        loop.setup_process()
        loop.setup_precision(self.shard)
        self.precision = loop.precision
        self.model = loop.model = loop.raw_model = loop.build_model()
        # train.ema's callback, where the checkpoint holds the average: evaluate() then measures the weights the run
        # evaluated (train.ema.eval), and predict swaps it in. No other callback runs after training.
        self.ema = next(iter(averages(self.cfg)), None) if self.meta.get("ema") else None
        loop.callbacks = Callbacks([self.ema] if self.ema is not None else [], CallbackState(loop))
        group = torch.distributed.new_group(backend="gloo") if torch.distributed.is_initialized() else None
        trained.load_weights(self.checkpoint_dir, self.meta, self.model, loop.callbacks, group)
        self.task.training = False
        self.model.eval()

    def evaluate(self) -> dict[str, Any]:
        """The loop's evaluation of these weights (and of the average's, as train.ema.eval says)."""
        return self.loop.evaluate()


def evaluate_job(cfg, env, plan: JobPlan) -> dict[str, Any]:
    """One worker's share of `stride eval` (Ray or torchrun): every rank returns the same figures."""
    job = CheckpointModel(cfg, env, plan)
    job.load()
    return job.evaluate()


def parse_args(argv):
    ap = trained.parser("stride eval", "Evaluate a run's checkpoint (val_loss and the task's metrics) on a gang.")
    ap.add_argument("--data", help="Parquet, JSON Lines or text files to evaluate on (default: the run's validation "
                                   "split); the task's columns")
    ap.add_argument("--name", help="the result's name: <run>/eval/<name>.json (default: the checkpoint's name, "
                                   "plus the data's with --data)")
    return ap.parse_args(argv)


@reports_errors
def main(argv: list[str] | None = None) -> int:
    t0, args = time.time(), parse_args(argv)
    with trained.open_run(args) as run:  # a run on a bucket: a local copy, removed at the end
        return evaluate_run(run, args, t0)


def evaluate_run(run: trained.TrainedRun, args, t0: float) -> int:
    from stride.trainers.launch import jobs as gang
    from stride.trainers.run.folder import atomic_write_text, make_folder, refuse_link

    spec = trained.split_spec(run, "val", args.data)
    plan = JobPlan.of(run, spec)
    name = trained.output_name(args.name or run.checkpoint.name + (f"-{Path(args.data).stem}" if args.data else ""))
    if gang.rank0():
        print(f"stride: evaluating {run.where(run.checkpoint)} (step {run.meta.get('step')}) on {spec.num_rows} "
              f"rows of {args.data or 'the validation split'}", flush=True)
    path = make_folder(run.run_dir / "eval") / f"{name}.json"  # planted links are refused now, not written through
    refuse_link(path)
    metrics, where = gang.run_job(run, evaluate_job, plan, f"eval-{name}")
    if metrics is None:  # a torchrun rank other than 0
        return 0
    record = {"checkpoint": run.where(run.checkpoint), "step": run.meta.get("step"), "data": args.data or "validation",
              "rows": spec.num_rows, **where, "wall_s": time.time() - t0, "metrics": metrics, **metrics}
    atomic_write_text(path, json.dumps(record, indent=1, default=str) + "\n")
    shown = " ".join(f"{k} {v:.6g}" for k, v in metrics.items() if isinstance(v, float))
    print(f"stride: eval: {shown}")
    print(f"stride: eval written to {run.publish(path)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
