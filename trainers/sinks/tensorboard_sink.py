"""tracking.sinks: [tensorboard]: event files under <run>/tensorboard/, written with torch.utils.tensorboard.

A resumed run continues the same log: its writer starts with `purge_step` at the first step after the
checkpoint, which tells TensorBoard's readers to drop what an earlier attempt logged from that step on (the steps
a kill made the run train twice), so every step appears once, as in metrics.jsonl.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from stride.trainers.run import folder as runfolder
from stride.trainers.sinks.base import RunInfo, Sink

FOLDER = "tensorboard"


class TensorBoardSink(Sink):
    name = "tensorboard"
    background = True
    package = "tensorboard"
    def open(self, run: RunInfo) -> None:
        from torch.utils.tensorboard import SummaryWriter

        folder = run.run_dir / FOLDER
        runfolder.refuse_link(folder)  # shared storage: never write through a planted link
        folder.mkdir(parents=True, exist_ok=True)
        purge = run.resume_step + 1 if run.resume_step is not None else None
        self.writer = SummaryWriter(str(folder), purge_step=purge, flush_secs=30)

    def step(self, step: int, metrics: dict[str, Any]) -> None:
        for key, value in metrics.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                self.writer.add_scalar(key, value, step)
        self.writer.flush()  # on the sinks' thread: the log on disk keeps up with metrics.jsonl

    def close(self, status: str) -> None:
        self.writer.close()

    @classmethod
    def where(cls, cfg, summary: dict[str, Any]) -> str:
        return f"tensorboard {Path(cfg.run_dir) / FOLDER}  (view: tensorboard --logdir {Path(cfg.run_dir) / FOLDER})"
