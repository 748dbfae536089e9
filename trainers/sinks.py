"""Where a run's figures go, decided in one place: metrics.jsonl, MLflow and the console or progress bar (rank 0),
Prometheus gauges (every rank, on Ray). The loop hands each log and evaluation to `Sinks`; nothing else writes."""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any, Callable

from stride.trainers import checkpointing, runfolder

log = logging.getLogger("stride")

# The fields of a training line in metrics.jsonl, in order (those present).
TRAIN_FIELDS = ("step", "epoch", "samples_seen", "train_loss", "lr", "samples_per_second", "step_time_s",
                "data_wait_s", "data_wait_fraction", "tokens_per_second", "mfu", "checkpoint_blocked_s",
                "checkpoint_write_s", "padding_fraction")


class MetricsFile:
    """metrics.jsonl, written by rank 0. On resume, lines past the checkpoint's step are dropped so the file continues
    exactly from the checkpointed step; a torn last line (a kill mid-write) is dropped with a warning. A fresh start
    over an earlier run's file (no checkpoint of it verified) keeps that history beside it, never deletes it."""

    def __init__(self, path: Path, resume_step: int | None):
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        # The file is shared storage (trainers/runfolder.py): a link or a FIFO under its name is refused, never
        # read from or written through.
        st = runfolder.refuse_unless_regular(path)
        if resume_step is None:
            if st is not None and st.st_size:
                kept = path.with_name(f"{path.name}.{time.strftime('%Y%m%dT%H%M%S')}")
                runfolder.refuse_link(kept)
                os.replace(path, kept)
                log.warning("%s holds an earlier run that no checkpoint continues: kept as %s", path, kept.name)
            checkpointing.atomic_write_text(path, "")
        elif st is not None:
            keep, unreadable = [], 0
            for line in runfolder.read_bytes(path, limit=None).decode(errors="replace").splitlines():
                record = runfolder.metrics_line(line)
                if record is None:  # torn by a kill, or a line of the wrong types (someone else's)
                    unreadable += line.strip() != ""
                elif record["step"] <= resume_step:
                    keep.append(line)
            if unreadable:
                log.warning("%s: dropped %d unreadable line(s) (a write cut off by a kill, or not a record Stride "
                            "writes)", path, unreadable)
            checkpointing.atomic_write_text(path, "".join(ln + "\n" for ln in keep))

    def write(self, record: dict[str, Any]) -> None:
        with runfolder.open_append(self.path) as f:
            f.write(json.dumps(record) + "\n")


class Sinks:
    """One log or evaluation goes out to every sink this rank has."""

    def __init__(self, rank0: bool, metrics_file: MetricsFile | None, tracker, bar,
                 record: Callable[[dict[str, Any]], None] | None, total_steps: int):
        self.rank0, self.metrics_file, self.tracker, self.bar = rank0, metrics_file, tracker, bar
        self.record, self.total_steps = record, total_steps

    def train(self, metrics: dict[str, Any], own: dict[str, Any], eta_s: float) -> None:
        """A log step: `metrics` averaged over ranks (rank 0 writes them), `own` this rank's figures (Prometheus)."""
        if self.record is not None:
            self.record({**metrics, **own})
        if not self.rank0:
            return
        # optim.groups' own lrs and data.train's sources' counts, after the fields every run has
        per_group = [k for k in metrics if k.startswith(("lr/", "samples_seen/"))]
        self.metrics_file.write({k: metrics[k] for k in (*TRAIN_FIELDS, *per_group) if k in metrics})
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{metrics['train_loss']:.4f}", sps=f"{metrics['samples_per_second']:.0f}")
        else:
            log.info("step %d/%d epoch %d loss %.4f lr %.2e %.0f samples/s eta %.0fs", metrics["step"],
                     self.total_steps, metrics["epoch"], metrics["train_loss"], metrics["lr"],
                     metrics["samples_per_second"], eta_s)

    def val(self, step: int, val: dict[str, float]) -> None:
        if not self.rank0:
            return
        self.metrics_file.write({"step": step, **val})
        log.info("step %d %s", step, " ".join(f"{k} {v:.4f}" for k, v in val.items()))

    def step_done(self) -> None:
        if self.bar is not None:
            self.bar.update(1)

    def mlflow(self, metrics: dict[str, Any], step: int) -> None:
        if self.tracker is not None:
            self.tracker.log_metrics({k: v for k, v in metrics.items() if k != "step"}, step)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
