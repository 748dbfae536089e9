"""train.early_stopping: end the run when a validation figure stops improving (status "stopped_early")."""

from __future__ import annotations

import logging
from typing import Any

from stride.trainers.callbacks.base import Callback, CallbackState

log = logging.getLogger("stride")


class EarlyStopping(Callback):
    """After each evaluation: `metric` improved when it beats the best so far by more than `min_delta` (lower for
    mode min, higher for max); `patience` evaluations in a row without improvement stop the run, with a checkpoint
    at that step. Its best value and count resume with the run."""

    def __init__(self, metric: str = "val_loss", mode: str = "min", patience: int = 3, min_delta: float = 0.0):
        self.metric, self.mode, self.patience, self.min_delta = metric, mode, patience, min_delta
        self.best: float | None = None
        self.bad = 0

    def improved(self, value: float) -> bool:
        if self.best is None:
            return True
        return value < self.best - self.min_delta if self.mode == "min" else value > self.best + self.min_delta

    def on_eval_end(self, state: CallbackState, metrics: dict[str, float]) -> None:
        if self.metric not in metrics:
            raise KeyError(f"train.early_stopping.metric ({self.metric}) is not among this run's evaluation figures "
                           f"({', '.join(sorted(metrics))})")
        value = metrics[self.metric]
        if self.improved(value):
            self.best, self.bad = value, 0
            return
        self.bad += 1
        if self.bad >= self.patience:
            if state.rank == 0:
                log.info("early stopping at step %d: %s %.4f has not improved on %.4f for %d evaluation(s)",
                         state.step, self.metric, value, self.best, self.bad)
            state.request_stop("stopped_early")

    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best, "bad": self.bad}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best, self.bad = state["best"], state["bad"]
