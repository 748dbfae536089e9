"""The driver's stop request (SIGTERM, Ctrl-C, SLURM's warning), carried to every Ray worker by a small actor of the
run's job: a run on a bucket has no folder that every node shares, so the stop file in the run folder
(trainers/policies.py) reaches only the workers on the driver's node. The file stays for everything else (torchrun,
anyone who writes it by hand); a worker stops on either."""

from __future__ import annotations

import time
from typing import Any, Callable

POLL_S = 1.0  # a stop is asked for at a step boundary; one actor call a second per rank costs nothing next to a step


def _flag_class():
    import ray

    @ray.remote(num_cpus=0, max_restarts=0)
    class StopFlag:
        def __init__(self):
            self.request: dict[str, Any] | None = None

        def post(self, request: dict[str, Any]) -> None:
            self.request = self.request or request  # the first request is the one answered

        def get(self) -> dict[str, Any] | None:
            return self.request

    return StopFlag


class StopChannel:
    """The driver's end: a named actor of this job, alive while the driver holds this object."""

    def __init__(self, name: str):
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        self.name = name
        # On the driver's own node: a drained or lost worker node must not take the channel with it.
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        self.actor = _flag_class().options(name=name, scheduling_strategy=here).remote()

    def post(self, request: dict[str, Any]) -> None:
        self.actor.post.remote(request)  # not waited on: a signal handler must not block

    def close(self) -> None:
        import ray

        try:
            ray.kill(self.actor, no_restart=True)
        except Exception:  # noqa: BLE001 - already gone with its job: nothing to close
            pass


def poller(name: str, clock: Callable[[], float] = time.monotonic) -> Callable[[], dict[str, Any] | None]:
    """A worker's end: the driver's request, or None; asks the actor at most once every POLL_S."""
    import ray
    import ray.exceptions

    actor = ray.get_actor(name)
    seen: dict[str, Any] = {"at": float("-inf"), "request": None}

    def requested() -> dict[str, Any] | None:
        if seen["request"] is None and clock() - seen["at"] >= POLL_S:
            seen["at"] = clock()
            try:
                seen["request"] = ray.get(actor.get.remote(), timeout=30)
            except (ray.exceptions.RayError, TimeoutError):  # the driver is gone: its fence stops this worker
                return None
        return seen["request"]

    return requested
