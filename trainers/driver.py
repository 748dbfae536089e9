"""The driver's work between a resolved config and a finished run, shared by `python -m stride` (trainers/main.py)
and sweeps (tune/): the task and its data checks, the TorchTrainer, signals (the run folder's opening: lifecycle.py).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from stride.datasets.splits import DataSpec, inspect
from stride.ray_cluster.connect import UsageError, elastic, resolve_scaling
from stride.trainers import sinks
from stride.trainers.config import Config

from stride.errors import EXIT_FAILED, EXIT_OK, EXIT_USAGE  # noqa: E402, F401 - the exit codes live in stride/errors.py


# A run's summary and its error line: trainers/lifecycle.py (these names are kept here for their callers).
from stride.trainers.lifecycle import last_line, record_summary, write_summary  # noqa: E402, F401


def prepare(cfg: Config, num_workers: int | None = None):
    """The task of `cfg` with the facts its `inspect` found, and the specs of the splits the workers read.
    Raises ConfigError/DataError (one line, exit 2) before any worker starts. `num_workers`: the world size when
    the launcher knows it (torchrun); else the config's."""
    from stride.trainers.callbacks import build as build_callbacks
    from stride.trainers.lifecycle import check_storage_outside_data
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
    from stride.trainers.config import ConfigError

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
    from stride.trainers.config import ConfigError
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


def choose_pipeline(cfg: Config, num_workers: int, use_gpu: bool, resources: dict) -> tuple[str, float]:
    """data.pipeline -> ("thread" or "ray_data", CPUs per Ray Data task). Ray Data needs CPUs the gang does not
    hold, or its tasks wait forever: refuse ray_data without them (exit 2); auto takes it only for GPU workers (CPU
    workers would share their cores with it for no gain)."""
    workers = elastic(cfg)[1] if elastic(cfg) else num_workers
    free = resources["CPU"] - workers * cfg.scaling.cpus_per_worker
    if cfg.data.pipeline == "thread" or (cfg.data.pipeline == "auto" and (not use_gpu or free < 1
                                                                          or cfg.train.tokens_per_micro_batch)):
        return "thread", 0.0
    if free < 0.5:
        raise UsageError(f"data.pipeline (ray_data) needs CPUs beside the worker gang, but its {workers} x "
                         f"scaling.cpus_per_worker ({cfg.scaling.cpus_per_worker:g}) take {resources['CPU'] - free:g} of "
                         f"the cluster's {resources['CPU']:g}; lower scaling.cpus_per_worker, add a node, or set "
                         f"data.pipeline=thread")
    return "ray_data", min(1.0, free / workers)


def ray_train_metrics_for(run_name: str) -> None:
    """Ray Train tags its own metrics with the run name, and Ray encodes tag values as ASCII: with a non-ASCII
    run.name each record fails the run. Its metrics are switched off for such a run (the variable is read by fit() in
    this process); Stride's own gauges encode the name instead (telemetry.tag_value)."""
    if not run_name.isascii():
        os.environ["RAY_TRAIN_METRICS_ENABLED"] = "0"


def build_trainer(cfg: Config, specs: dict[str, DataSpec], facts: dict, *, progress_bar: bool = False,
                  callbacks=(), **plan_extra):
    """The TorchTrainer for one Stride run (the driver's and every Tune trial's). Returns (trainer, plan, gang):
    gang = (num_workers, use_gpu, the cluster's resources)."""
    from ray.train import FailureConfig, LoggingConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    from stride.trainers.run import checkpointing
    from stride.trainers.loop import plan_run
    from stride.trainers.ray_worker import train_loop_per_worker

    num_workers, use_gpu, resources = resolve_scaling(cfg)
    check_multinode_paths(cfg, resources["nodes"])
    check_batch_fits(cfg, specs, num_workers)
    pipeline, data_cpus = choose_pipeline(cfg, num_workers, use_gpu, resources)
    plan = plan_run(cfg, specs, facts, progress_bar=progress_bar, data_pipeline=pipeline, data_cpus_per_task=data_cpus,
                    **plan_extra)
    ray_train_metrics_for(cfg.run.name)
    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config={"cfg": cfg.to_dict(), "plan": plan},
        # A hung all-reduce fails the run after collective_timeout_s instead of the 30-minute default.
        torch_config=TorchConfig(timeout_s=int(cfg.train.collective_timeout_s)),
        # num_workers=auto on CPU means one worker per node: SPREAD places them so (PACK would stack them).
        scaling_config=ScalingConfig(num_workers=elastic(cfg) or num_workers, use_gpu=use_gpu,
                                     elastic_resize_monitor_interval_s=cfg.scaling.resize_check_s,
                                     resources_per_worker={"CPU": cfg.scaling.cpus_per_worker},
                                     placement_strategy="SPREAD" if cfg.scaling.num_workers == "auto" and not use_gpu
                                     else "PACK"),
        run_config=RunConfig(name=cfg.run.name, storage_path=str(cfg.run_dir.parent),
                             checkpoint_config=checkpointing.ray_checkpoint_config(cfg.checkpoint.keep_last),
                             # A preempted node (drained with a deadline, then gone) restarts the gang from its
                             # preemption checkpoint on Ray's own budget, unlimited: it is no failure.
                             failure_config=FailureConfig(max_failures=cfg.scaling.max_failures,
                                                          max_preemption_failures=-1),
                             callbacks=list(callbacks),
                             # A failed run ends in Stride's one line (summary "error"); Ray Train's tracebacks of
                             # it (about 90 lines) go only to its session logs (logs/train/ray-train-sys-*.log) and
                             # the summary's "error_detail", not to the console.
                             logging_config=LoggingConfig(log_level="CRITICAL")),
        # No Ray datasets: each worker streams its rows of the split's blocks itself (datasets/stream.py), in
        # the order of datasets/order.py, which Ray Data's streaming_split cannot reproduce.
    )
    return trainer, plan, (num_workers, use_gpu, resources)


def train_on_ray(cfg: Config, specs: dict[str, DataSpec], facts: dict, progress_bar: bool,
                 **plan_extra) -> tuple[int, dict]:
    """Fit one run on the connected Ray cluster. Returns (exit code, rank 0's summary fields)."""
    import ray.train

    from stride.trainers.run import checkpointing

    num_workers, use_gpu, _ = resolve_scaling(cfg)  # fail on impossible resources before reading any data
    if cfg.scaling.preflight:
        preflight(cfg, num_workers, use_gpu)
    trainer, plan, (num_workers, use_gpu, res) = build_trainer(cfg, specs, facts, progress_bar=progress_bar,
                                                               **plan_extra)
    workers = "{}-{}".format(*elastic(cfg)) if elastic(cfg) else num_workers
    print(f"stride: training {cfg.run.name} on {workers} {'GPU' if use_gpu else 'CPU'} "
          f"worker(s); cluster {res['CPU']:g} CPUs, {res['GPU']:g} GPUs, {res['nodes']} node(s); data pipeline "
          f"{plan.data_pipeline}", flush=True)
    # Ray 2.60's fit() replaces the process's SIGINT handler with one that aborts the run at once, without
    # Stride's checkpoint: keep ours (Ctrl-C = checkpoint at the next step, exit 130; a second Ctrl-C stops now).
    trainer._register_sigint_handler = lambda controller: None
    if repaired := checkpointing.repair_snapshot(cfg.run_dir):  # else Ray refuses the run folder before any step
        print(f"stride: {repaired}", flush=True)
    try:
        result = trainer.fit()
    except ray.train.TrainingFailedError as e:
        # Data a worker found unreadable (a damaged Parquet page) is the user's to fix, as the driver's checks are.
        code = EXIT_USAGE if _worker_data_error(e) else EXIT_FAILED
        return code, {"status": "failed", "error": _error_line(e, cfg.run_dir), "error_detail": str(e),
                      "world_size": num_workers}
    summary = dict(result.return_value or {})
    summary.setdefault("status", "completed")
    summary["checkpoint"] = result.checkpoint.path if result.checkpoint else None
    sinks.after_run(cfg, summary)  # the trackers' records name the final checkpoint
    return EXIT_OK, summary


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


def _worker_data_error(e: BaseException) -> bool:
    """Whether a worker failed with DataError (Ray re-raises a worker's exception as an instance of its class)."""
    from stride.datasets.splits import DataError

    return any(isinstance(f, DataError) for f in (getattr(e, "worker_failures", None) or {}).values())


def _error_line(e: BaseException, run_dir: Path) -> str:
    """The one line a run that Ray Train failed ends with."""
    from stride.trainers.run import checkpointing

    controller_failure = getattr(e, "controller_failure", None)
    if controller_failure is not None and (full := checkpointing.persistent_storage_error(controller_failure)):
        # Ray Train's controller records each checkpoint in the run folder (its snapshot): on a full disk that
        # write fails first, while a worker's checkpoint is being written.
        return checkpointing.storage_failure_line(f"Ray Train's {checkpointing.SNAPSHOT} in {run_dir}", run_dir,
                                                  full.strerror or str(full), full.errno)
    return last_line(e)


def install_signal_handlers(run_dir: Path) -> list[int]:
    """SIGUSR1 (SLURM's warning before the time limit), SIGTERM (preemption, scancel) and SIGINT ask every rank
    to checkpoint at the next step boundary and stop; the exit code is then 128 + the signal. Under SLURM a
    SIGUSR1/SIGTERM means "you will be requeued" (status preempted), elsewhere SIGTERM/SIGINT mean interrupted."""
    import signal

    from stride.trainers.policies import clear_stop_request, request_stop

    clear_stop_request(run_dir)
    received: list[int] = []

    def handler(signum, _frame):
        if received and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C: stop now
        received.append(signum)
        preempt = signum == signal.SIGUSR1 or (signum == signal.SIGTERM and os.environ.get("SLURM_JOB_ID"))
        request_stop(run_dir, "preempted" if preempt else "interrupted", signum)
        print(f"stride: received {signal.Signals(signum).name}: checkpointing at the next step, then exiting",
              file=sys.stderr, flush=True)

    for sig in (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, handler)
    return received
