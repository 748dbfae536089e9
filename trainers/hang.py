"""A watchdog in every rank for a step that does not finish (issue 46, point 3): a rank stuck in a collective, or one
that never reaches it, otherwise ends the run only when the collective times out (train.collective_timeout_s, ten
minutes by default), and says nothing about which rank waited on what.

The loop beats at the start of every step; a thread checks every second. A step unfinished after `timeout_s`
(train.hang_timeout_s; by default 50 x the median of the recent step times, at least 5 minutes, armed once a step
has finished, so a first step's compilation is never taken for a hang):

1. writes every thread's Python stack of this rank to <run>/diagnostics/hang-<step>/rank<k>.txt (faulthandler), and
   where NCCL is the backend its flight recorder's dump beside it (set TORCH_NCCL_TRACE_BUFFER_SIZE to record one);
2. prints one line: a rank whose training thread is outside torch (in the task, the data, a callback) did not arrive at
   the step's collective, and says so with its node and the frame it is in; a rank waiting inside torch says it
   waited, and where the stacks are;
3. ends this rank's attempt (exit 1): on Ray the gang restarts from its last checkpoint (counted in
   scaling.max_failures); torchrun ends the run with exit 1.

Plain Python and torch: the same on Ray and under torchrun. Evaluation and checkpoints pause it (`paused`).
"""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import os
import statistics
import sys
import threading
import time
import traceback
from collections import deque
from pathlib import Path
from typing import Callable

import torch

log = logging.getLogger("stride")

MIN_AUTO_TIMEOUT_S = 300.0
STEP_TIMES_MULTIPLE = 50
TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep


class HangWatchdog:
    def __init__(self, run_dir: Path, rank: int, node: str, timeout_s: float | None, nccl: bool,
                 end: Callable[[int], None] = os._exit, poll_s: float = 1.0):
        self.run_dir, self.rank, self.node, self.nccl = Path(run_dir), rank, node, nccl
        self.fixed_timeout, self.end, self.poll_s = timeout_s, end, poll_s
        self.recent: deque[float] = deque(maxlen=100)
        self.step: int | None = None
        self.started = 0.0
        self.lock = threading.Lock()
        self.stopped = threading.Event()
        self.training_thread = threading.main_thread().ident
        self.thread = threading.Thread(target=self._watch, name="stride-hang-watchdog", daemon=True)

    def start(self) -> "HangWatchdog":
        self.thread.start()
        return self

    def close(self) -> None:
        self.stopped.set()

    def beat(self, step: int) -> None:
        """The start of optimizer step `step` (the previous one finished)."""
        now = time.monotonic()
        self.training_thread = threading.get_ident()  # Ray Train runs the loop in a thread of its own, not the main one
        with self.lock:
            if self.step is not None:
                self.recent.append(now - self.started)
            self.step, self.started = step, now

    @contextlib.contextmanager
    def paused(self):
        """Evaluation and checkpoints: long, and timed on their own."""
        with self.lock:
            step, self.step = self.step, None
        try:
            yield
        finally:
            with self.lock:
                self.step, self.started = step, time.monotonic()

    def timeout(self) -> float | None:
        if self.fixed_timeout is not None:
            return self.fixed_timeout
        if not self.recent:
            return None  # nothing finished yet: a first step may compile for minutes
        return max(MIN_AUTO_TIMEOUT_S, STEP_TIMES_MULTIPLE * statistics.median(self.recent))

    def _watch(self) -> None:
        while not self.stopped.wait(self.poll_s):
            with self.lock:
                step, started, limit = self.step, self.started, self.timeout()
            if step is not None and limit is not None and time.monotonic() - started > limit:
                self.fire(step, limit)
                return

    def fire(self, step: int, limit: float) -> None:
        folder = self.run_dir / "diagnostics" / f"hang-{step:08d}"
        folder.mkdir(parents=True, exist_ok=True)
        with open(folder / f"rank{self.rank}.txt", "w") as f:
            faulthandler.dump_traceback(f, all_threads=True)
        if self.nccl:
            self._dump_flight_recorder(folder)
        where = self.training_frame()
        if where is None:
            line = (f"stride: hang: step {step} did not finish within {limit:g} s; rank {self.rank} on node "
                    f"{self.node} waited inside torch (a collective); every rank's stacks: {folder}")
        else:
            line = (f"stride: hang: rank {self.rank} on node {self.node} did not arrive at step {step}'s collective "
                    f"within {limit:g} s: it is in {where}; every rank's stacks: {folder}")
        print(line, file=sys.stderr, flush=True)
        self.end(1)

    def training_frame(self) -> str | None:
        """Where the training thread is, when outside torch (the task, the data, a callback): "file:line in
        function"; None when it is inside torch (waiting in a collective, or in torch's own work)."""
        frame = sys._current_frames().get(self.training_thread)
        if frame is None:
            return None
        innermost = traceback.extract_stack(frame)[-1]
        if os.path.abspath(innermost.filename).startswith(TORCH_DIR):
            return None
        return f"{innermost.filename}:{innermost.lineno} in {innermost.name}"

    def _dump_flight_recorder(self, folder: Path) -> None:
        try:
            dump = torch._C._distributed_c10d._dump_nccl_trace()
        except Exception as e:  # noqa: BLE001 - a diagnostic must not hide the hang it reports
            log.warning("hang: no NCCL flight recorder dump (%s); set TORCH_NCCL_TRACE_BUFFER_SIZE", e)
            return
        (folder / f"rank{self.rank}-nccl.pickle").write_bytes(dump)
