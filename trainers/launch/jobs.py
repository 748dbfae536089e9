"""Running one job on a gang of workers for the commands after training (`stride eval`, `stride predict`): on Ray
(RAY_ADDRESS, or an embedded local Ray; ray.run_job), or in place under torchrun when torchrun started this process
(torchrun.run_job). A job is `job(cfg, env, plan) -> dict`, plain PyTorch, as the training loop is.
"""

from __future__ import annotations

import os
from typing import Any, Callable

from stride.trainers.run.folder import refuse_link

Job = Callable[..., dict[str, Any]]


def rank0() -> bool:
    """Whether this process prints for the gang: the driver on Ray, rank 0 under torchrun."""
    from stride.trainers.launch.torchrun import under_torchrun

    return os.environ.get("RANK", "0") == "0" if under_torchrun() else True


def run_job(run, job: Job, plan, name: str, before: Callable[[], None] | None = None
            ) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    """(rank 0's result, where it ran); under torchrun the other ranks get (None, ...). `before`: what the driver
    does first, once (prepare an output folder); under torchrun rank 0 does it and every rank raises its refusal."""
    from stride.trainers.launch import ray, torchrun

    if torchrun.under_torchrun():
        return torchrun.run_job(run.cfg, job, plan, before)
    jobs = run.run_dir.resolve() / ".jobs"
    refuse_link(jobs)  # before anything is written: a planted link would take Ray's records (and their removal) away
    if before is not None:
        before()
    # A run on a bucket was downloaded on this node only: a worker elsewhere fetches its own copy to the same path.
    replica = run.copy.replica() if getattr(run, "copy", None) is not None else None
    return ray.run_job(run.cfg, job, plan, jobs, name, replica=replica)


