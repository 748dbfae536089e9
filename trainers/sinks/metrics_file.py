"""metrics.jsonl: every log step's and evaluation's figures, one JSON line each, written by rank 0. Always on."""

from __future__ import annotations

from stride.trainers.run.folder import atomic_write_text
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

from stride.trainers.run import checkpointing
from stride.trainers.run import folder as runfolder
from stride.trainers.sinks.base import RunInfo, Sink

log = logging.getLogger("stride")

# The fields of a training line, in order (those present); per-group figures (lr/<group>, grad_norm/<group>,
# samples_seen/<source>) and the task's own train_<name> figures follow them.
TRAIN_FIELDS = ("step", "epoch", "samples_seen", "train_loss", "lr", "samples_per_second", "step_time_s",
                "data_wait_s", "data_wait_fraction", "tokens_per_second", "mfu", "checkpoint_blocked_s",
                "checkpoint_write_s", "padding_fraction", "grad_norm", "clipped", "loss_scale", "straggler_ratio", "goodput")


class MetricsFile:
    """metrics.jsonl. On resume, lines past the checkpoint's step are dropped so the file continues exactly from
    the checkpointed step; a torn last line (a kill mid-write) is dropped with a warning. A fresh start over an
    earlier run's file (no checkpoint of it verified) keeps that history beside it, never deletes it."""

    def __init__(self, path: Path, resume_step: int | None):
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        # The file is shared storage (trainers/run/folder.py): a link or a FIFO under its name is refused, never
        # read from or written through.
        st = runfolder.refuse_unless_regular(path)
        if resume_step is None:
            if st is not None and st.st_size:
                kept = path.with_name(f"{path.name}.{time.strftime('%Y%m%dT%H%M%S')}")
                runfolder.refuse_link(kept)
                os.replace(path, kept)
                log.warning("%s holds an earlier run that no checkpoint continues: kept as %s", path, kept.name)
            atomic_write_text(path, "")
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
            atomic_write_text(path, "".join(ln + "\n" for ln in keep))

    def write(self, record: dict[str, Any]) -> None:
        with runfolder.open_append(self.path) as f:
            f.write(json.dumps(record) + "\n")


class MetricsFileSink(Sink):
    name = "metrics.jsonl"
    essential = True  # the run's own record: a failure to write it (disk full) ends the run, as any write does

    def open(self, run: RunInfo) -> None:
        from stride.trainers.run.remote import RunRemote

        # A run on a bucket: the bucket's file is the record (this node's copy may be another node's, or none); it is
        # trimmed to the resumed step here as a folder's is, then every write reaches the bucket whole.
        self.remote = RunRemote.of(run.cfg)
        if self.remote is not None:
            self.remote.pull(runfolder.METRICS)
        self.file = MetricsFile(run.run_dir / runfolder.METRICS, run.resume_step)
        self._published()

    def train(self, metrics: dict[str, Any], own: dict[str, Any], eta_s: float) -> None:
        extra = [k for k in metrics if k.startswith(("lr/", "grad_norm/", "samples_seen/", "train_"))
                 and k not in TRAIN_FIELDS]
        self.file.write({k: metrics[k] for k in (*TRAIN_FIELDS, *extra) if k in metrics})
        self._published()

    def eval(self, step: int, metrics: dict[str, float]) -> None:
        self.file.write({"step": step, **metrics})
        self._published()

    def close(self, status: str) -> None:
        if self.remote is not None:  # the last lines (and the trackers' files), then no copy on this node's disk
            self.remote.sync_side_files()
            self.remote.flush()
            (self.file.path).unlink(missing_ok=True)

    def _published(self) -> None:
        if self.remote is not None:
            self.remote.push_soon(runfolder.METRICS)
