"""`stride eval`: a run's checkpoint evaluated on its validation split, or on other data, on a gang.

    stride eval --run runs/my_run [--checkpoint last|best|PATH] [--data PATH] [--name NAME] [section.field=value ...]
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
from stride.trainers.loop import RunPlan, Trainer


@dataclass(frozen=True)
class JobPlan(RunPlan):
    """A RunPlan for work after training: the checkpoint to load, and the command's own settings."""

    checkpoint: str = ""
    out: str = ""  # predict: the output folder
    batch_rows: int = 64  # predict: rows per forward
    keep_columns: tuple[str, ...] = ()  # predict: input columns copied into the output rows


class CheckpointModel(Trainer):
    """The Trainer's model, precision and strategy with a checkpoint's weights, for work after training: no
    optimizer, no data order, no sinks. `shard=False` keeps the whole model on every rank (predict: no rank waits
    on another's collectives, so each can skip work that is already done)."""

    def __init__(self, cfg, env, plan: JobPlan, shard: bool = True):
        super().__init__(cfg, env, plan)
        self.checkpoint_dir = Path(plan.checkpoint)
        self.resume_meta = checkpointing.read_meta(self.checkpoint_dir)
        self.shard = shard

    def load(self) -> None:
        self.setup_process()
        self.setup_precision(self.shard)
        model = self.model = self.raw_model = self.build_model()  # init.from too, under a trainable_only checkpoint
        # train.ema's callback, where the checkpoint holds the average: evaluate() then measures the weights the run
        # evaluated (train.ema.eval), and predict swaps it in. No other callback runs after training.
        self.ema = next(iter(averages(self.cfg)), None) if self.resume_meta.get("ema") else None
        self.callbacks = Callbacks([self.ema] if self.ema is not None else [], CallbackState(self))
        group = torch.distributed.new_group(backend="gloo") if torch.distributed.is_initialized() else None
        self.load_weights(group)
        self.task.training = False
        model.eval()

    def load_weights(self, group) -> None:
        """The checkpoint's model (and average) into this rank's tensors: DCP reads each rank's slices."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

        ckpt = self.checkpoint_dir
        partial = bool(self.resume_meta.get("trainable_only"))  # the frozen base came from init.from
        if not checkpointing.is_sharded(ckpt):  # the earlier one-file format: every rank reads it whole
            set_model_state_dict(self.raw_model, checkpointing.load_model_state(ckpt),
                                 options=StateDictOptions(full_state_dict=True, strict=not partial))
            return
        saved = checkpointing.saved_model_shapes(ckpt)
        callback_tensors, present = self.callbacks.tensors_to_fill(checkpointing.saved_keys(ckpt))
        state = {"model": {k: v for k, v in get_model_state_dict(self.raw_model).items() if not partial or k in saved},
                 **callback_tensors}
        checkpointing.load_sharded(ckpt, state, group)
        self.callbacks.loaded(present)
        set_model_state_dict(self.raw_model, state["model"], options=StateDictOptions(strict=not partial))


def evaluate_job(cfg, env, plan: JobPlan) -> dict[str, Any]:
    """One worker's share of `stride eval` (Ray or torchrun): every rank returns the same figures."""
    job = CheckpointModel(cfg, env, plan)
    job.load()
    return job.evaluate()


def parse_args(argv):
    from stride.cli import ArgumentParser
    from stride.trainers.commands import trained

    ap = ArgumentParser(prog="stride eval",
                        description="Evaluate a run's checkpoint (val_loss and the task's metrics) on a gang.")
    ap.add_argument("--data", help="Parquet, JSON Lines or text files to evaluate on (default: the run's validation "
                                   "split); the task's columns")
    ap.add_argument("--name", help="the result's name: <run>/eval/<name>.json (default: the checkpoint's name, "
                                   "plus the data's with --data)")
    trained.add_arguments(ap)
    return ap.parse_args(argv)


@reports_errors
def main(argv: list[str] | None = None) -> int:
    return evaluate_command(parse_args(argv))


def evaluate_command(args) -> int:
    from stride.trainers.commands import trained
    from stride.trainers.launch import jobs as gang
    from stride.trainers.run.folder import atomic_write_text, make_folder, refuse_link

    t0 = time.time()
    run = trained.open_run(args)
    spec = trained.split_spec(run, "val", args.data)
    plan = JobPlan(run_dir=str(run.run_dir), train=None, val=spec, facts=run.facts,
                   cpus_per_worker=run.cfg.scaling.cpus_per_worker, checkpoint=str(run.checkpoint))
    name = trained.output_name(args.name or run.checkpoint.name + (f"-{Path(args.data).stem}" if args.data else ""))
    if gang.rank0():
        print(f"stride: evaluating {run.checkpoint} (step {run.meta.get('step')}) on {spec.num_rows} rows of "
              f"{args.data or 'the validation split'}", flush=True)
    path = make_folder(run.run_dir / "eval") / f"{name}.json"  # planted links are refused now, not written through
    refuse_link(path)
    metrics, where = gang.run_job(run, evaluate_job, plan, f"eval-{name}")
    if metrics is None:  # a torchrun rank other than 0
        return 0
    record = {"checkpoint": str(run.checkpoint.resolve()), "step": run.meta.get("step"), "data": args.data or "validation",
              "rows": spec.num_rows, **where, "wall_s": time.time() - t0, "metrics": metrics, **metrics}
    atomic_write_text(path, json.dumps(record, indent=1, default=str) + "\n")
    shown = " ".join(f"{k} {v:.6g}" for k, v in metrics.items() if isinstance(v, float))
    print(f"stride: eval: {shown}")
    print(f"stride: eval written to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
