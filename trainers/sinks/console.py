"""The console: a progress bar when the launcher has a terminal (rank 0), else one log line per log step."""

from __future__ import annotations

import logging
from typing import Any

from stride.trainers.sinks.base import RunInfo, Sink

log = logging.getLogger("stride")


class ConsoleSink(Sink):
    name = "console"

    def open(self, run: RunInfo) -> None:
        self.total_steps = run.total_steps
        self.bar = (run.progress_bar(total=run.total_steps, initial=run.resume_step or 0, desc=run.cfg.run.name)
                    if run.progress_bar is not None else None)

    def train(self, metrics: dict[str, Any], own: dict[str, Any], eta_s: float) -> None:
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{metrics['train_loss']:.4f}", sps=f"{metrics['samples_per_second']:.0f}")
        else:
            log.info("step %d/%d epoch %d loss %.4f lr %.2e %.0f samples/s eta %.0fs", metrics["step"],
                     self.total_steps, metrics["epoch"], metrics["train_loss"], metrics["lr"],
                     metrics["samples_per_second"], eta_s)

    def eval(self, step: int, metrics: dict[str, float]) -> None:
        log.info("step %d %s", step, " ".join(f"{k} {v:.4f}" for k, v in metrics.items()))

    def step_done(self) -> None:
        if self.bar is not None:
            self.bar.update(1)

    def close(self, status: str) -> None:
        if self.bar is not None:
            self.bar.close()
