"""The checks before a run starts, the same for both launchers: the task and its data (prepare), keep_best's
cadence, the model's parameter groups, the batch against the data, local paths on several nodes, and the doctor's
quick preflight on the gang. Each refusal is one line (ConfigError, DataError or UsageError: exit 2) before any
worker starts or any checkpoint is written."""

from __future__ import annotations

import os
import sys
import time

from stride.datasets.splits import DataSpec, inspect
from stride.errors import UsageError
from stride.trainers import sinks
from stride.trainers.config import Config
from stride.trainers.launch.scaling import elastic

__all__ = ["prepare"]


def prepare(cfg: Config, num_workers: int | None = None):
    """The task of `cfg` with the facts its `inspect` found, and the specs of the splits the workers read.
    Raises ConfigError/DataError (one line, exit 2) before any worker starts. `num_workers`: the world size when
    the launcher knows it (torchrun); else the config's."""
    from stride.trainers.callbacks import build as build_callbacks
    from stride.trainers.launch.lifecycle import check_storage_outside_data
    from stride.trainers.optim import check_optimizer
    from stride.trainers.tasks import make_task

    check_storage_outside_data(cfg)  # before the data is read: the layout cache would be written into it
    sinks.preflight(cfg)  # a tracker whose package is missing: refused now, not warned about on every worker
    task = make_task(cfg)
    build_callbacks(cfg, task)  # each imported and built once here: a mistake is one line, before any worker
    check_keep_best(cfg, task)
    check_optimizer(cfg)
    specs = inspect(cfg, task)
    check_model(cfg, task)
    if num_workers is None and isinstance(cfg.scaling.num_workers, int):
        num_workers = cfg.scaling.num_workers
    if num_workers is not None or elastic(cfg):  # num_workers "auto": checked once the cluster is known
        check_batch_fits(cfg, specs, num_workers or 1)
    return task, specs



def check_keep_best(cfg: Config, task) -> None:
    """checkpoint.keep_best ranks the checkpoints written at evaluation steps: refuse (ConfigError) a figure the run
    does not report, or a cadence where no periodic checkpoint falls on an evaluation."""
    from stride.trainers.callbacks import check_evaluation_figure
    from stride.errors import ConfigError

    if cfg.checkpoint.keep_best is None:
        return
    check_evaluation_figure(cfg, task, "checkpoint.keep_best")
    every, evals = cfg.checkpoint.every_steps, cfg.train.eval_every_steps
    if every and evals and every % evals:
        raise ConfigError(f"checkpoint.keep_best ranks checkpoints written at evaluation steps, and checkpoint."
                          f"every_steps ({every}) is not a multiple of train.eval_every_steps ({evals}); make it one")



def check_model(cfg: Config, task) -> None:
    """optim.groups and init.from against the task's model built on the meta device (shapes only, no weights),
    before any worker starts: prints each group's counts and init's table; a group that takes nothing, groups that
    freeze everything at step 0, a source that does not fit, or a changed base under a checkpoint.trainable_only
    resume is a ConfigError (exit 2). A resume of any other run never reads init.from again."""
    if not cfg.optim.groups and cfg.init.from_ is None:
        return
    import torch

    from stride.trainers import pretrained
    from stride.trainers.run import checkpointing
    from stride.errors import ConfigError
    from stride.trainers.optim import resolve_groups

    with torch.device("meta"):
        model = task.build_model()
    show = os.environ.get("RANK", "0") == "0"  # torchrun: every rank checks, rank 0 prints
    groups = resolve_groups(cfg, model)
    if cfg.optim.groups:
        if show:
            print(group_table(groups), flush=True)
        if not any(g.params and not g.frozen_at(0) for g in groups):
            raise ConfigError("optim.groups: every trainable parameter is frozen at step 0, so there is nothing to "
                              "train; leave a group unfrozen, or unmatched parameters in the default group")
    if cfg.init.from_ is None:
        return
    newest = checkpointing.newest_complete(cfg.run_dir) if cfg.run_dir.is_dir() else None
    meta = checkpointing.read_meta(newest) if newest is not None else None
    if meta is not None and not meta.get("trainable_only"):
        return
    i = cfg.init
    # torchrun: rank 0 hashes the file (and compares it with a trainable_only run's), the other ranks check names
    plan = pretrained.check_init(model, i.from_, strict=i.strict, include=i.include, exclude=i.exclude,
                                 rename=i.rename, adapt=pretrained.adapter(task), sha256=None if show else "-" * 64)
    if show:
        print(plan.table(), flush=True)
    recorded = ((meta or {}).get("init") or {}).get("sha256")
    if show and meta is not None and recorded != plan.sha256:
        raise ConfigError(pretrained.changed_base_line(i.from_, recorded, plan.sha256))



def group_table(groups) -> str:
    """optim.groups as the driver prints it: each group's tensors, parameters, lr scale and freezing."""
    lines = ["stride: optim.groups (first match wins; unmatched: default)"]
    for g in groups:
        spec = g.spec
        how = "frozen" if spec is not None and spec.freeze and not spec.unfreeze_at_step else \
            f"frozen until step {spec.unfreeze_at_step}" if spec is not None and spec.unfreeze_at_step else "trained"
        lines.append(f"  {g.label:<16} {len(g.params):>6} tensor(s) {sum(p.numel() for p in g.params):>14,} parameters  "
                     f"lr x{spec.lr_scale if spec else 1.0:g}  {how}")
    return "\n".join(lines)



def check_batch_fits(cfg: Config, specs: dict[str, DataSpec], num_workers: int) -> None:
    """One global micro-batch must fit in the training split (config.check_batch_fits)."""
    from stride.trainers.config import check_batch_fits as check

    check(cfg, specs["train"].num_rows, num_workers)



def check_multinode_paths(cfg: Config, nodes: int) -> None:
    if nodes <= 1:
        return
    named = [(f"data.{key}", getattr(cfg.data, key)) for key in ("train_path", "val_path")]
    named += [(f"data.{split} ({src.name})", src.path) for split in ("train", "val") for src in getattr(cfg.data, split) or ()]
    for key, p in named:
        if p and "://" not in p and not os.environ.get("STRIDE_SHARED_FS"):
            # A local path is only safe on a shared filesystem; say so instead of failing on a remote node.
            raise UsageError(f"{key} ({p}) is a local path but the cluster has {nodes} nodes; put the data on "
                             f"shared storage and set STRIDE_SHARED_FS=1, or use an object-store URI (s3://, gs://)")



def preflight(cfg: Config, num_workers: int, use_gpu: bool) -> None:
    """scaling.preflight: the doctor's quick checks on the gang this run is about to place. A failure stops the
    run before any data is read or checkpoint written (exit 2, naming the check, node and measured value)."""
    from stride.ray_cluster.doctor import run_preflight

    t0 = time.perf_counter()
    judge_preflight(run_preflight(num_workers, use_gpu, str(cfg.run_dir.parent), cfg.scaling.cpus_per_worker,
                                  quick=True), t0)



def judge_preflight(rows, t0: float, show: bool = True) -> None:
    """The preflight's verdict on the doctor's rows, the same on Ray and under torchrun: on a failure the table (on
    stderr) and a UsageError naming the first failed check; else one line. `show`: whether this process prints (a
    torchrun rank other than 0 only raises)."""
    from stride.ray_cluster.doctor import format_table

    failed = [r for r in rows if not r.ok]
    if failed:
        if show:
            print(format_table(rows), file=sys.stderr, flush=True)
        raise UsageError(f"scaling.preflight (true) failed: {failed[0].failure_line()}"
                         + (f" (+{len(failed) - 1} more above)" if len(failed) > 1 else "")
                         + "; fix the node or storage, or set scaling.preflight=false to train anyway")
    if show:
        print(f"stride: preflight passed ({len(rows)} checks in {time.perf_counter() - t0:.1f}s)", flush=True)
