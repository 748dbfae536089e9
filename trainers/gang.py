"""Running one job on a gang of workers for the commands after training (`stride eval`, `stride predict`): on Ray
(RAY_ADDRESS, or an embedded local Ray; a TorchTrainer with the run's scaling.*), or in place under torchrun when
torchrun started this process. A job is `job(cfg, env, plan) -> dict`, plain PyTorch, as the training loop is.
"""

from __future__ import annotations

import os
import secrets
import shutil
import socket
from pathlib import Path
from typing import Any, Callable

from stride.datasets.splits import DataSpec
from stride.errors import DataError, TrainingError, UsageError
from stride.trainers.run.folder import make_folder, refuse_link

Job = Callable[..., dict[str, Any]]


def under_torchrun() -> bool:
    """Whether torchrun (torch.distributed.run) started this process: it sets TORCHELASTIC_RUN_ID for its workers."""
    return "TORCHELASTIC_RUN_ID" in os.environ


def rank0() -> bool:
    """Whether this process prints for the gang: the driver on Ray, rank 0 under torchrun."""
    return os.environ.get("RANK", "0") == "0" if under_torchrun() else True


def split_spec(run, split: str, path: str | None, columns: tuple[str, ...] | None = None) -> DataSpec:
    """The rows a job reads: `path` (a command's --data), else the run's own `split`, checked against its task."""
    from stride.datasets import splits

    cache = splits.cache_folder(run.cfg)
    if path:
        data = splits.open_path(path, split, "--data", cache)
    elif getattr(run.cfg.data, f"{split}_path") or getattr(run.cfg.data, split):
        data = splits.open_split(run.cfg.data, split, cache)
    else:
        raise UsageError(f"--run ({run.run_dir}) trained without a {split} split (data.{split}_path); pass --data PATH")
    return splits.split_spec(run.cfg, run.task, data, columns)


def run_job(run, job: Job, plan, name: str, before: Callable[[], None] | None = None
            ) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    """(rank 0's result, where it ran); under torchrun the other ranks get (None, ...). `before`: what the driver
    does first, once (prepare an output folder); under torchrun rank 0 does it and every rank raises its refusal."""
    if under_torchrun():
        return _on_torchrun(run.cfg, job, plan, before)
    jobs = run.run_dir.resolve() / ".jobs"
    refuse_link(jobs)  # before anything is written: a planted link would take Ray's records (and their removal) away
    if before is not None:
        before()
    return _on_ray(run.cfg, job, plan, jobs, name)


def _on_rank0(fn: Callable[[], None], rank: int, world_size: int) -> None:
    """`fn` on rank 0; its refusal (a StrideError) raised on every rank, so that the gang exits alike."""
    import torch.distributed as dist

    from stride.errors import StrideError

    refusal = None
    if rank == 0:
        try:
            fn()
        except StrideError as e:
            refusal = e
    if world_size > 1:
        box = [None if refusal is None else (type(refusal), str(refusal))]
        dist.broadcast_object_list(box, src=0)  # within the gang's own process group: nothing from storage
        if box[0] is not None and refusal is None:
            refusal = box[0][0](box[0][1])
    if refusal is not None:
        raise refusal


def _on_torchrun(cfg, job: Job, plan, before) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    from stride.trainers.loop import WorkerEnv
    from stride.trainers.torchrun import gang_rank, leave_gang, start_gang

    rank, world_size, local_rank = gang_rank()
    device = start_gang(cfg)
    try:
        if before is not None:
            _on_rank0(before, rank, world_size)
        env = WorkerEnv(rank, world_size, local_rank, device, wrap_model=lambda m: m, latest_checkpoint=lambda: None,
                        report=lambda metrics, written: None, node=socket.gethostname())
        result = job(cfg, env, plan)
    finally:
        leave_gang()
    return (result if rank == 0 else None), {"runtime": "torchrun", "world_size": world_size}


def _on_ray(cfg, job: Job, plan, storage: Path, name: str) -> tuple[dict[str, Any], dict[str, Any]]:
    import ray.train
    from ray.train import FailureConfig, LoggingConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    from stride.ray_cluster.connect import init_ray, quiet_ray_env, resolve_scaling
    from stride.trainers.driver import _error_line, _worker_data_error
    from stride.trainers.ray_worker import job_per_worker

    make_folder(storage)  # a real folder, or refused (a link planted since the check above)
    quiet_ray_env()
    init_ray()
    num_workers, use_gpu, res = resolve_scaling(cfg)
    print(f"stride: {num_workers} {'GPU' if use_gpu else 'CPU'} worker(s); cluster {res['CPU']:g} CPUs, "
          f"{res['GPU']:g} GPUs, {res['nodes']} node(s)", flush=True)
    # Ray Train keeps its own records of a run under storage/name: a job's are of no use afterwards, and removed. The
    # run folder is shared storage: .jobs must be a real folder (a planted link would send Ray's writes, and the
    # removal, elsewhere), and the job's name is new each time (nothing can be planted under it in advance, and an
    # earlier job's records are never taken for a run to resume).
    name = f"{name}-{secrets.token_hex(4)}"
    folder = storage / name
    trainer = TorchTrainer(
        job_per_worker, train_loop_config={"cfg": cfg.to_dict(), "plan": plan, "job": job},
        torch_config=TorchConfig(timeout_s=int(cfg.train.collective_timeout_s)),
        scaling_config=ScalingConfig(num_workers=num_workers, use_gpu=use_gpu,
                                     resources_per_worker={"CPU": cfg.scaling.cpus_per_worker}),
        run_config=RunConfig(name=name, storage_path=str(storage), failure_config=FailureConfig(max_failures=0),
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
