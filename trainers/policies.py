"""The loop's policies, free of training: when to log, evaluate and checkpoint; what a non-finite step does;
when to stop on request or on a node's preemption; how each step's randomness is seeded. Each is unit-tested
without a model."""

from __future__ import annotations

from stride.errors import RunFolderError
from stride.trainers.run.folder import atomic_write_text
import gc
import json
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from stride.trainers.run import checkpointing
from stride.trainers.run import folder as runfolder

log = logging.getLogger("stride")


from stride.errors import TrainingError  # noqa: E402


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


class GarbageCollection:
    """train.gc_every_steps. Python's automatic collection runs when allocations pass a threshold, so its pauses fall
    on arbitrary steps of arbitrary ranks (a GPU step's mean exceeded its median by 2.6-3.8 ms, benchmarks/README.md),
    and a rank that pauses holds up the gang at the next collective. Here, as torchtitan does: what set-up built is
    frozen out of every later collection (gc.freeze: the model, the data's indexes), automatic collection is off
    while training, and a young-generation collection runs every N steps, at the same step on every rank. 0: Python's
    own collection, untouched. Everything is as it was after the `with`."""

    def __init__(self, every_steps: int):
        self.every = every_steps
        self._was_enabled = gc.isenabled()

    def __enter__(self) -> GarbageCollection:
        if self.every:
            self._was_enabled = gc.isenabled()
            gc.collect()
            gc.freeze()
            gc.disable()
        return self

    def step(self, step: int) -> None:
        if self.every and step % self.every == 0:
            gc.collect(1)

    def __exit__(self, *exc) -> None:
        if self.every:
            gc.unfreeze()
            if self._was_enabled:
                gc.enable()


class NonFinitePolicy:
    """train.nonfinite: `skip` leaves the weights as they were and goes on, up to train.max_nonfinite_steps in a
    row; `stop` ends the run at the first. Ending keeps the last good checkpoint (TrainingError, exit 1)."""

    def __init__(self, mode: str, limit: int, spikes: "SpikeLog | None" = None):
        self.mode, self.limit, self.in_a_row, self.spikes = mode, limit, 0, spikes
        self.pending: list[tuple[int, Any]] = []  # (step, StepResult) not read yet
        self.loss: float = math.nan  # the newest read step's loss
        self.norms: list[float] = []  # the gradient norms (before clipping) of the steps read since take_norms()
        self.group_norms: list[float] = []  # the newest read step's per-group norms (optim.groups), if any

    def defer(self, step: int, result) -> None:
        """A step's result (trainers/step.py StepResult, on the device), judged at the next `settle`."""
        self.pending.append((step, result))

    def take_norms(self) -> list[float]:
        """The gradient norms read since the last call, oldest first."""
        norms, self.norms = self.norms, []
        return norms

    def settle(self) -> list[str]:
        """Read the deferred steps' figures in one device-to-host copy and judge them in order, as if each had been
        read at its own step: the warnings to log, or the TrainingError of the step that ends the run. The loop
        settles at log, evaluation and checkpoint steps only, so a GPU is never made to wait in between; a run that
        must stop does so at the next of those (its non-finite steps were skipped on the device meanwhile, and no
        checkpoint is written before it stops)."""
        from stride.trainers.step import read_many

        pending, self.pending = self.pending, []
        warnings = []
        for (step, _), (loss, grad_norm, finite) in zip(pending, read_many([r for _, r in pending])):
            self.loss = loss
            self.norms.append(grad_norm)
            if (warning := self.observe(step, finite, loss, grad_norm)) is not None:
                warnings.append(warning)
        if pending and pending[-1][1].group_norms is not None:  # after read_many's copy: it waits for nothing
            self.group_norms = pending[-1][1].group_norms.tolist()
        if self.spikes is not None and pending:
            verdicts = torch.stack([r.spike for _, r in pending]).tolist()
            self.spikes.warnings += [w for (step, _), v in zip(pending, verdicts) if (w := self.spikes.observe(step, *v))]
        return warnings

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


class SpikeLog:
    """train.spike's verdicts (trainers/step.py SpikeGuard), as the loop reads them: a warning per spike, and the
    counts summary.json gives."""

    def __init__(self, figure: str, factor: float, window: int, skip: bool):
        self.figure, self.factor, self.window, self.skip = figure, factor, window, skip
        self.count, self.steps, self.warnings = 0, [], []  # warnings: read since the loop last logged them

    def observe(self, step: int, spike: float, median: float, value: float) -> str | None:
        if not spike:
            return None
        self.count += 1
        self.steps.append(step)
        return (f"spike at step {step}: {self.figure} {value:.4g} > {self.factor:g} x {median:.4g}, the median of "
                f"the last {self.window} steps: " + ("its update skipped" if self.skip else "trained on"))

    def summary(self) -> dict[str, Any]:
        return {"spikes": self.count, "spike_steps": self.steps[-100:], "spikes_skipped": self.count * self.skip}


@dataclass(frozen=True)
class RankPace:
    """One rank's own pace over a log interval, per optimizer step: what no other rank's speed changes (its data wait,
    and its forward, which has no collective under DDP)."""

    data_wait_s: float
    forward_s: float

    @property
    def own_s(self) -> float:
        return self.data_wait_s + self.forward_s


class Stragglers:
    """straggler_ratio at each log step (the slowest rank's own time per step over the median rank's), and one
    warning once it has stayed above `warn_ratio` for `intervals` log intervals in a row, naming the rank, its node,
    and whether its data or its compute is slow. Another warning only after the ratio came back under."""

    def __init__(self, warn_ratio: float, intervals: int = 3):
        self.warn_ratio, self.intervals, self.above = warn_ratio, intervals, 0

    def observe(self, paces: list[RankPace], nodes: list[str]) -> tuple[float, str | None]:
        median = float(np.median([p.own_s for p in paces]))
        slowest = max(range(len(paces)), key=lambda r: paces[r].own_s)
        ratio = paces[slowest].own_s / median if median > 0 else 1.0
        self.above = self.above + 1 if ratio > self.warn_ratio else 0
        if self.above != self.intervals:
            return ratio, None
        p = paces[slowest]
        data_excess = p.data_wait_s - float(np.median([q.data_wait_s for q in paces]))
        forward_excess = p.forward_s - float(np.median([q.forward_s for q in paces]))
        what = (f"its data (data wait {p.data_wait_s:.3g} s a step)" if data_excess > forward_excess
                else f"its compute (forward {p.forward_s:.3g} s a step)")
        return ratio, (f"rank {slowest} on node {nodes[slowest]} has been the slowest for {self.intervals} log "
                       f"intervals (straggler_ratio {ratio:.2f} > train.straggler_warn_ratio {self.warn_ratio:g}): "
                       f"{what}, against the median rank's {median:.3g} s; the gang waits for it every step")


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
    atomic_write_text(Path(run_dir) / STOP_FILE, json.dumps({"status": status, "signal": signum}))


@dataclass(frozen=True)
class Preemption:
    """A runtime's notice that a node of the gang is about to be taken away: Ray's, when a node is drained with reason
    preemption (what a cloud autoscaler does before it reclaims a spot instance). The runtime then ends the gang and
    starts it again from the newest checkpoint, on the nodes that remain."""

    nodes: tuple[str, ...]  # the nodes that go, as the runtime names them (Ray: node ids); () when not known here
    deadline_s: float | None  # when they go (UNIX time); None: none announced

    def describe(self, now: float | None = None) -> str:
        nodes = "node " + ", ".join(self.nodes) if len(self.nodes) == 1 else \
            "nodes " + ", ".join(self.nodes) if self.nodes else "a node"
        if self.deadline_s is None:
            return f"preemption of {nodes} announced (no deadline)"
        left = self.deadline_s - (time.time() if now is None else now)
        return f"preemption of {nodes} announced (deadline in {left:.0f} s)"


# A preemption without a deadline: Ray Train ends the gang this long after it noticed it (its
# DEFAULT_PREEMPTION_DEADLINE_S); the workers wait as long.
NO_DEADLINE_WAIT_S = 120.0
# After a preemption checkpoint the workers wait for the runtime to end them; if it has not this long after the
# deadline (a runtime that did not act on its own notice), they train on from where they are.
PREEMPTION_OVERRUN_S = 60.0


class StopRequest:
    """Interrupts and preemption: a stop file in the run folder (written by the driver's signal handler, or by
    anyone), a signal to this process, a callback's request, or the runtime's notice that a node of the gang will be
    preempted (`preempted`: WorkerEnv.preempted). Checked at every step boundary and agreed on by all ranks with one
    tiny all-reduce, so either every rank stops at the same step or none does. The all-reduce runs on `group`, a gloo
    group of the host (None: the default group): on GPUs it never waits for the device's queued step, so checking
    every step costs the GPU nothing and a stop is still agreed at the step it was asked at.

    A stop ends the run after its checkpoint. A preemption does not: after its checkpoint the workers wait
    (wait_out_preemption) for the runtime to end the gang at the deadline and start it again from that checkpoint,
    so that nothing is trained that the restart would lose. A stop and a preemption at the same step: the stop."""

    def __init__(self, run_dir: Path, device: torch.device, world_size: int,
                 preempted: Callable[[], Preemption | None] | None = None,
                 posted: Callable[[], dict[str, Any] | None] | None = None, group=None):
        self.path = Path(run_dir) / STOP_FILE
        self.group = group
        self.posted = posted  # the driver's request by another way than the file (Ray's stop channel)
        self.device, self.world_size = device, world_size
        self.local: dict[str, Any] | None = None
        self.previous: dict = {}
        self.preempted = preempted
        self.preemption: Preemption | None = None  # the notice the agreed stop answers (its deadline the earliest)
        self.answered = False  # a gang answers one notice: the runtime ends it at that notice's deadline

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

    def _notice(self) -> Preemption | None:
        return None if self.preempted is None or self.answered else self.preempted()

    def requested(self) -> bool:
        """Whether every rank stops at this step boundary. A preemption any rank has heard of counts for all (each
        hears of it on its own, not at the same step), with the earliest deadline any of them heard."""
        notice = self._notice()
        # [stop, preempted, -deadline]: one all-reduce (MAX) agrees on all three.
        flags = [1.0 if (self.local is not None or self._driver_request()) else 0.0, 1.0 if notice else 0.0,
                 -notice.deadline_s if notice and notice.deadline_s is not None else -math.inf]
        if self.world_size > 1:
            on = "cpu" if self.group is not None or self.device.type != "cuda" else self.device
            t = torch.tensor(flags, dtype=torch.float64, device=on)
            torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX, group=self.group)
            flags = t.tolist()
        stop, preempted, deadline = flags
        if not stop and preempted:
            notice = notice or self._notice()  # another rank heard first: this one may have by now
            self.preemption = Preemption(notice.nodes if notice else (), -deadline if deadline > -math.inf else None)
            self.answered = True
        return bool(stop or preempted)

    def wait_out_preemption(self, clock: Callable[[], float] = time.time, sleep: Callable[[float], None] = time.sleep,
                            poll_s: float = 0.5) -> bool:
        """After the preemption checkpoint: wait, training nothing, until the runtime ends this process (Ray ends the
        gang at the deadline). Returns True when a stop was requested meanwhile (the stop file: the run ends now, its
        checkpoint written), False when the runtime let PREEMPTION_OVERRUN_S pass after the deadline (train on)."""
        p, start = self.preemption, clock()
        until = (p.deadline_s if p is not None and p.deadline_s is not None else start + NO_DEADLINE_WAIT_S) \
            + PREEMPTION_OVERRUN_S
        while (now := clock()) < until:
            if self._driver_request():
                return True
            sleep(min(poll_s, until - now))
        self.preemption = None
        return False

    def status(self) -> str:
        if self.preemption is not None and not (self.local or self._driver_request()):
            return "preempted"
        return self._request().get("status", "interrupted")

    def signal(self) -> int | None:
        """The signal behind the request (this process's own, or the one the driver wrote), if any."""
        return self._request().get("signal")

    def _driver_request(self) -> bool:
        return self.path.exists() or (self.posted is not None and self.posted() is not None)

    def _request(self) -> dict[str, Any]:
        if self.local is None and self.posted is not None and (posted := self.posted()) is not None:
            return posted
        try:
            request = runfolder.read_json(self.path)  # a regular file only: a FIFO planted here never blocks a rank
        except (OSError, ValueError, RunFolderError):
            return self.local or {}
        return request if isinstance(request, dict) else self.local or {}
