"""The loop's policies, free of training: when to log, evaluate and checkpoint; what a non-finite step does;
when to stop on request; how each step's randomness is seeded. Each is unit-tested without a model."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from stride.trainers import checkpointing, runfolder

log = logging.getLogger("stride")


from stride.errors import TrainingError  # noqa: E402, F401 - its home is stride/errors.py


@dataclass(frozen=True)
class Due:
    log: bool
    eval: bool
    checkpoint: bool
    last: bool

    @property
    def any(self) -> bool:
        return self.log or self.eval or self.checkpoint


@dataclass(frozen=True)
class Cadence:
    """What happens after optimizer step `step`. The last step (or a stop) always logs and checkpoints; it
    evaluates at the end of the run but not on a stop (a preempted job should go quickly)."""

    total_steps: int
    log_every: int
    eval_every: int | None
    checkpoint_every: int | None
    has_val: bool

    def due(self, step: int, stopping: bool = False) -> Due:
        last = step >= self.total_steps or stopping
        return Due(
            log=step % self.log_every == 0 or last,
            eval=self.has_val and (bool(self.eval_every and step % self.eval_every == 0) or (last and not stopping)),
            checkpoint=bool(self.checkpoint_every and step % self.checkpoint_every == 0) or last,
            last=last)


class NonFinitePolicy:
    """train.nonfinite: `skip` leaves the weights as they were and goes on, up to train.max_nonfinite_steps in a
    row; `stop` ends the run at the first. Ending keeps the last good checkpoint (TrainingError, exit 1)."""

    def __init__(self, mode: str, limit: int):
        self.mode, self.limit, self.in_a_row = mode, limit, 0

    def observe(self, step: int, finite: bool, loss: float, grad_norm: float | None) -> str | None:
        """None after a finite step; the warning to log after a skipped one; raises when the run must stop."""
        if finite:
            self.in_a_row = 0
            return None
        self.in_a_row += 1
        what = f"non-finite loss/gradients at step {step} (loss {loss:.4g}, grad norm {grad_norm:.4g})"
        if self.mode == "stop" or self.in_a_row >= self.limit:
            raise TrainingError(f"{what}, {self.in_a_row} in a row; the last good checkpoint is kept: lower optim.lr, "
                                f"set optim.grad_clip_norm, or check the data for NaN")
        return f"{what}: step skipped ({self.in_a_row} in a row, limit train.max_nonfinite_steps={self.limit})"


def step_seed(seed: int, rank: int, step: int, *stream: int) -> int:
    """The seed of `rank`'s random streams for optimizer step `step` (dropout), or for another `stream` of it (the
    transform of step `step`: TRANSFORM_STREAM): different per rank and step, the same after any resume.
    Reseeding costs microseconds and needs no RNG state in checkpoints."""
    return int(np.random.SeedSequence([seed, rank, step, *stream]).generate_state(1, np.uint64)[0] >> 1)


TRANSFORM_STREAM = 1


def reseed(seed: int, rank: int, step: int, *stream: int) -> None:
    s = step_seed(seed, rank, step, *stream)
    torch.manual_seed(s)
    np.random.seed(s % 2**32)


STOP_FILE = runfolder.STOP_FILE


def clear_stop_request(run_dir: str | Path) -> None:
    """A stale request from an earlier run must not stop this one: every launcher calls this before training. Anyone
    may write the file, so anything but a regular file there (a link, a FIFO) is refused (RunFolderError)."""
    path = Path(run_dir) / STOP_FILE
    if runfolder.refuse_unless_regular(path) is not None:
        path.unlink(missing_ok=True)


def request_stop(run_dir: str | Path, status: str, signum: int) -> None:
    """Ask a running job to checkpoint at the next step boundary and stop (used by signal handlers)."""
    checkpointing.atomic_write_text(Path(run_dir) / STOP_FILE, json.dumps({"status": status, "signal": signum}))


class StopRequest:
    """Preemption and interrupts: a stop file in the run folder (written by the driver's signal handler,
    or by anyone) or a signal to this process. Checked at every step boundary and agreed on by all
    ranks with one tiny all-reduce, so either every rank stops at the same step or none does."""

    def __init__(self, run_dir: Path, device: torch.device, world_size: int):
        self.path = Path(run_dir) / STOP_FILE
        self.device, self.world_size = device, world_size
        self.local: dict[str, Any] | None = None
        self.previous: dict = {}

    def on_signal(self, signum: int, _frame=None) -> None:
        self.local = {"status": "interrupted", "signal": signum}

    def install(self) -> None:
        import signal

        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
            try:
                self.previous[sig] = signal.signal(sig, self.on_signal)
            except ValueError:  # not the main thread (Ray Train runs the loop in a thread): the driver handles it
                return

    def uninstall(self) -> None:
        import signal

        for sig, handler in self.previous.items():
            signal.signal(sig, handler)

    def request(self, status: str) -> None:
        """A callback's request (trainers/callbacks.py): it ends the run for good (its checkpoint says so)."""
        self.local = self.local or {"status": status, "final": True}

    def final_status(self) -> str | None:
        """The status of a stop that ends the run for good (a callback's), None for a signal's or none."""
        return self.local["status"] if self.local and self.local.get("final") else None

    def requested(self) -> bool:
        flag = 1.0 if (self.local is not None or self.path.exists()) else 0.0
        if self.world_size > 1:
            t = torch.tensor([flag], device=self.device if self.device.type == "cuda" else "cpu")
            torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
            flag = float(t[0])
        return flag > 0

    def status(self) -> str:
        return self._request().get("status", "interrupted")

    def signal(self) -> int | None:
        """The signal behind the request (this process's own, or the one the driver wrote), if any."""
        return self._request().get("signal")

    def _request(self) -> dict[str, Any]:
        try:
            request = runfolder.read_json(self.path)  # a regular file only: a FIFO planted here never blocks a rank
        except (OSError, ValueError, runfolder.RunFolderError):
            return self.local or {}
        return request if isinstance(request, dict) else self.local or {}
