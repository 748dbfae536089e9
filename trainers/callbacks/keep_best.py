"""checkpoint.keep_best: the k checkpoints with the best evaluation figure, kept in <run>/best/ (a built-in callback).

The ranking and the folder are trainers/run/retention.py's BestCheckpoints; this callback offers it each checkpoint
once the checkpoint is complete (rank 0, the writer's thread) and puts the ranking into summary.json. Its state is
best/ itself, so a resumed run ranks what every earlier attempt kept.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from stride.trainers.callbacks.base import Callback, CallbackState
from stride.trainers.run.retention import BestCheckpoints, BucketBestCheckpoints


class KeepBest(Callback):
    def __init__(self, metric: str = "val_loss", mode: str = "min", k: int = 1):
        self.metric, self.mode, self.k = metric, mode, k
        self._best: BestCheckpoints | None = None

    def best(self, state: CallbackState) -> BestCheckpoints:
        if self._best is None:
            remote = state.remote  # a run on a bucket keeps best/ there
            self._best = (BucketBestCheckpoints(remote, self.metric, self.mode, self.k) if remote is not None
                          else BestCheckpoints(state.run_dir, self.metric, self.mode, self.k))
        return self._best

    def on_checkpoint_complete(self, state: CallbackState, folder: Path) -> None:
        self.best(state).offer(folder)

    def summary_fields(self, state: CallbackState) -> dict[str, Any]:
        return {"best_checkpoints": self.best(state).summary()} if state.rank == 0 else {}
