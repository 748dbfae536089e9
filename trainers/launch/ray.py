"""The Ray launcher: a TorchTrainer for a run (`python -m stride`, trainers/main.py; sweeps, tune/) or for a
command's job (eval, predict: jobs.py), on an embedded local Ray or a cluster, and the one line a failed one ends
with. What runs on each worker: ray_worker.py."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import time
from pathlib import Path
from typing import Any

from stride.datasets.splits import DataSpec
from stride.errors import EXIT_FAILED, EXIT_OK, EXIT_USAGE, DataError, RunFolderError, TrainingError, UsageError
from stride.trainers import sinks
from stride.trainers.config import Config, check_mesh_fits
from stride.trainers.launch.checks import check_batch_fits, check_multinode_paths, preflight
from stride.trainers.launch.lifecycle import last_line
from stride.trainers.launch.scaling import elastic, resolve_scaling
from stride.trainers.run import folder as runfolder
from stride.trainers.run.folder import atomic_write_text

__all__ = ["build_trainer"]


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


def hang_detector_for(mode: str) -> None:
    """scaling.hang_detector: Ray Train's NCCL RAS hang detector, which its controller registers when these are set
    in the driver's environment (read when the trainer is built)."""
    if mode != "off":
        os.environ["RAY_TRAIN_ENABLE_NCCL_HANG_DETECTOR"] = "1"
        os.environ["RAY_TRAIN_NCCL_RAS_ACTION"] = mode


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
    from ray.train import FailureConfig, LoggingConfig, RunConfig

    from stride.trainers.run import checkpointing
    from stride.trainers.loop import plan_run
    from stride.trainers.launch.ray_worker import train_loop_per_worker

    num_workers, use_gpu, resources = resolve_scaling(cfg)
    check_multinode_paths(cfg, resources["nodes"])
    check_batch_fits(cfg, specs, num_workers)
    check_mesh_fits(cfg, num_workers)
    pipeline, data_cpus = choose_pipeline(cfg, num_workers, use_gpu, resources)
    plan = plan_run(cfg, specs, facts, progress_bar=progress_bar, data_pipeline=pipeline, data_cpus_per_task=data_cpus,
                    **plan_extra)
    ray_train_metrics_for(cfg.run.name)
    hang_detector_for(cfg.scaling.hang_detector)
    trainer = torch_trainer(
        cfg, train_loop_per_worker, {"cfg": cfg.to_dict(), "plan": plan}, elastic(cfg) or num_workers, use_gpu,
        # num_workers=auto on CPU means one worker per node: SPREAD places them so (PACK would stack them).
        elastic_resize_monitor_interval_s=cfg.scaling.resize_check_s,
        placement_strategy="SPREAD" if cfg.scaling.num_workers == "auto" and not use_gpu else "PACK",
        run_config=RunConfig(name=cfg.run.name, storage_path=str(cfg.run_dir.parent),
                             checkpoint_config=ray_checkpoint_config(cfg.checkpoint.keep_last),
                             # A preempted node (drained with a deadline, then gone) restarts the gang from its
                             # preemption checkpoint on Ray's own budget, unlimited: it is no failure.
                             failure_config=FailureConfig(max_failures=cfg.scaling.max_failures,
                                                          max_preemption_failures=-1),
                             callbacks=list(callbacks),
                             # A failed run ends in Stride's one line (summary "error"); Ray Train's tracebacks of
                             # it (about 90 lines) go only to its session logs (logs/train/ray-train-sys-*.log) and
                             # the summary's "error_detail", not to the console.
                             logging_config=LoggingConfig(log_level="CRITICAL")))
    # No Ray datasets: each worker streams its rows of the split's blocks itself (datasets/stream.py), in the order
    # of datasets/order.py, which Ray Data's streaming_split cannot reproduce.
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
    if repaired := repair_snapshot(cfg.run_dir):  # else Ray refuses the run folder before any step
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


def _worker_data_error(e: BaseException) -> bool:
    """Whether a worker failed with DataError (Ray re-raises a worker's exception as an instance of its class)."""
    from stride.errors import DataError

    return any(isinstance(f, DataError) for f in (getattr(e, "worker_failures", None) or {}).values())


def _error_line(e: BaseException, run_dir: Path) -> str:
    """The one line a run that Ray Train failed ends with."""
    from stride.trainers.run import checkpointing

    controller_failure = getattr(e, "controller_failure", None)
    if controller_failure is not None and (full := checkpointing.persistent_storage_error(controller_failure)):
        # Ray Train's controller records each checkpoint in the run folder (its snapshot): on a full disk that
        # write fails first, while a worker's checkpoint is being written.
        return checkpointing.storage_failure_line(f"Ray Train's {SNAPSHOT} in {run_dir}", run_dir,
                                                  full.strerror or str(full), full.errno)
    return last_line(e)


SNAPSHOT = "checkpoint_manager_snapshot.json"  # Ray Train's list of a run's checkpoints, in the run folder


SNAPSHOT_COPY = ".stride-last-good-snapshot.json"  # a sweep's copy of the last readable one (tune/trial.py)



def is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True



def _text_or_empty(path: Path) -> str:
    """A run folder's file as text, or "" when it is no regular file or unreadable (a FIFO never blocks here)."""
    try:
        return runfolder.read_bytes(path).decode(errors="replace")
    except (OSError, ValueError, RunFolderError):
        return ""



def _usable_snapshot(run_dir: Path, text: str) -> bool:
    """A snapshot Ray Train can start from: JSON, and every checkpoint it names still on disk."""
    if not is_json(text):
        return False
    names = [c.get("checkpoint_dir_name") for c in json.loads(text).get("checkpoint_results", [])]
    return all((run_dir / n).is_dir() for n in names if n)



def repair_snapshot(run_dir: Path) -> str | None:
    """Before a TorchTrainer starts on `run_dir` (the driver's, a sweep trial's): Ray Train rewrites its snapshot in
    place, so a process killed during the write, or a full disk, leaves it empty or torn, and Ray then refuses the
    run folder for good (CheckpointManagerInitializationError). An unreadable snapshot is replaced by the last good
    copy, or, with no usable copy, moved aside (Ray starts a new list; Stride resumes from the newest complete
    checkpoint either way, found on disk). Returns what was done, for the log, or None.

    The copy lags Ray by one checkpoint, and Ray may already have deleted the oldest checkpoint it names: then the
    newer copy a kill left complete but not yet renamed (atomic_write_text's temporary file) is the one to use."""
    run_dir = Path(run_dir)
    snap = run_dir / SNAPSHOT
    if not snap.exists() or is_json(_text_or_empty(snap)):
        return None
    # atomic_write_text's temporary names are unique (runfolder.temp_name): the newest first.
    kept = sorted(run_dir.glob(f".{SNAPSHOT_COPY}*.tmp"), key=lambda p: p.lstat().st_mtime, reverse=True)
    for copy in (run_dir / SNAPSHOT_COPY, *kept):
        if copy.exists() and _usable_snapshot(run_dir, text := _text_or_empty(copy)):
            atomic_write_text(snap, text)
            return f"{snap} was unreadable (Ray was stopped while writing it); restored the last good copy"
    aside = run_dir / f"{SNAPSHOT}.unreadable-{int(time.time())}"
    snap.rename(aside)
    return (f"{snap} was unreadable (Ray was stopped while writing it) and no usable copy exists; moved it aside to "
            f"{aside.name}")



def ray_checkpoint_config(keep_last: int):
    """checkpoint.keep_last on Ray Train: it deletes what it registered beyond num_to_keep (deleting one of them
    ourselves would make it refuse the run folder on resume)."""
    from ray.train import CheckpointConfig

    return CheckpointConfig(num_to_keep=keep_last)


def torch_trainer(cfg: Config, loop, loop_config: dict, num_workers: int, use_gpu: bool, run_config, **scaling):
    """The one TorchTrainer of a run and of a job: the loop on `num_workers` workers of scaling.cpus_per_worker CPUs
    each, with a hung collective failing after train.collective_timeout_s (not the 30-minute default)."""
    from ray.train import ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    return TorchTrainer(loop, train_loop_config=loop_config,
                        torch_config=TorchConfig(timeout_s=int(cfg.train.collective_timeout_s)),
                        scaling_config=ScalingConfig(num_workers=num_workers, use_gpu=use_gpu,
                                                     resources_per_worker={"CPU": cfg.scaling.cpus_per_worker},
                                                     **scaling),
                        run_config=run_config)


def run_job(cfg: Config, job, plan, storage: Path, name: str, replica: dict[str, str] | None = None
            ) -> tuple[dict[str, Any], dict[str, Any]]:
    """A command's job (jobs.py) on the run's gang on Ray: (rank 0's result, where it ran). Ray Train's own records
    of it go to storage/<name>-<random> and are removed after it."""
    import ray.train
    from ray.train import FailureConfig, LoggingConfig, RunConfig

    from stride.ray_cluster.connect import init_ray, quiet_ray_env
    from stride.trainers.launch.ray_worker import job_per_worker

    runfolder.make_folder(storage)  # a real folder, or refused (a link planted since the caller's check)
    quiet_ray_env()
    init_ray()
    num_workers, use_gpu, res = resolve_scaling(cfg)
    print(f"stride: {num_workers} {'GPU' if use_gpu else 'CPU'} worker(s); cluster {res['CPU']:g} CPUs, "
          f"{res['GPU']:g} GPUs, {res['nodes']} node(s)", flush=True)
    # The run folder is shared storage: the job's name is new each time, so that nothing can be planted under it
    # in advance, and an earlier job's records are never taken for a run to resume.
    name = f"{name}-{secrets.token_hex(4)}"
    folder = storage / name
    trainer = torch_trainer(cfg, job_per_worker, {"cfg": cfg.to_dict(), "plan": plan, "job": job, "replica": replica},
                            num_workers, use_gpu,
                            run_config=RunConfig(name=name, storage_path=str(storage),
                                                 failure_config=FailureConfig(max_failures=0),
                                                 logging_config=LoggingConfig(log_level="CRITICAL")))
    trainer._register_sigint_handler = lambda controller: None  # Ctrl-C stops the command, as any other
    try:
        result = trainer.fit()
    except ray.train.TrainingFailedError as e:
        line = _error_line(e, folder)
        raise (DataError(line) if _worker_data_error(e) else TrainingError(line)) from None
    finally:
        shutil.rmtree(folder, ignore_errors=True)
        if storage.is_dir() and not any(storage.iterdir()):
            storage.rmdir()
    return dict(result.return_value or {}), {"runtime": "ray", "world_size": num_workers}
