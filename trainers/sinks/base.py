"""What a sink is: `Sink` (every hook optional), the settings it declares (`SinkSettings`), and what it opens with
(`RunInfo`; a sweep's record: `SweepInfo`). The sinks of this package and a user's own subclass these; the
package itself (trainers/sinks/__init__.py) finds, checks and drives them."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from pydantic import BaseModel, ConfigDict


class SinkSettings(BaseModel):
    """A sink's own settings. A built-in tracker's fields are `tracking.<field>` keys (so name them after the sink:
    wandb_mode); a user's sink gets its entry's mapping, {"module:Class": {field: value}}, checked on the driver."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, frozen=True)


@dataclass
class RunInfo:
    """What a sink opens with: the run, where it resumes, and the state its own tracker left in the checkpoint."""

    cfg: Any  # stride.trainers.config.Config
    run_dir: Path
    resume_step: int | None  # None: a fresh start
    # Per sink name, the sink gets its own entry: its state_dict() from the checkpoint, and what the launcher
    # decided for it (`Sink.plan`, plus a sweep's parent run).
    state: dict[str, Any] = field(default_factory=dict)
    options: dict[str, Any] = field(default_factory=dict)
    params: dict[str, Any] = field(default_factory=dict)  # the run's public config
    tags: dict[str, Any] = field(default_factory=dict)  # where the weights came from (init.*)
    total_steps: int = 0
    progress_bar: Callable[..., Any] | None = None
    record_metrics: Callable[[dict[str, Any]], None] | None = None



class Sink:
    """A destination of a run's figures. Every hook is optional; rank 0 calls them, except where `every_rank`."""

    name = ""
    every_rank = False
    essential = False  # True: its failure ends the run (metrics.jsonl); else it warns once and is dropped
    summary_fields: tuple[str, ...] = ()  # summary.json keys it fills (None when the sink is off)
    legacy_meta_key: str | None = None  # where checkpoints before sinks kept state kept its run id
    package: str | None = None  # the package it needs, installed by the extra of the sink's name
    background = False  # True: its records are made on the sinks' own thread, never inside a training step
    Settings: type[SinkSettings] = SinkSettings  # its keys (see SinkSettings)
    settings: SinkSettings  # this copy's, set before `open`

    def open(self, run: RunInfo) -> None:
        """Before the first step (resumed runs: after the checkpoint is restored)."""

    def train(self, metrics: dict[str, Any], own: dict[str, Any], eta_s: float) -> None:
        """A log step: `metrics` averaged over ranks, `own` this rank's figures."""

    def eval(self, step: int, metrics: dict[str, float]) -> None:
        """An evaluation's figures (val_loss, the task's val_<metric>, per source)."""

    def step(self, step: int, metrics: dict[str, Any]) -> None:
        """Everything one step logged (training figures and evaluation), once: where trackers record."""

    def step_done(self) -> None:
        """After every optimizer step (the progress bar)."""

    def artifact(self, path: Path, folder: str) -> None:
        """A file of the run worth keeping with its record (a profiler trace)."""

    def state_dict(self) -> dict[str, Any]:
        """What a resume needs to continue the same record; saved in the checkpoint."""
        return {}

    def summary(self) -> dict[str, Any]:
        return {}

    def close(self, status: str) -> None:
        """The run ended: status is summary.json's (completed, stopped, ...)."""

    # ---- on the launcher, around the run ----

    @classmethod
    def plan(cls, cfg) -> dict[str, Any]:
        """What the launcher decides for every rank's copy (read from the launcher's environment)."""
        return {}

    @classmethod
    def enabled(cls, tracking) -> bool:
        """Whether a tracker tracking.sinks names records (`tracking`: the config's section; MLflow: tracking.mlflow)."""
        return True

    @classmethod
    def preflight(cls, cfg) -> str | None:
        """Before the run: why this sink cannot work (one line naming the fix), or None."""
        if cls.package and importlib.util.find_spec(cls.package) is None:
            built_in = cls.__module__.startswith(f"{__package__}.")  # installed by Stride's extra of its name
            extra = f"'stride[{cls.name}]'" if built_in else cls.package
            return f"the {cls.package} package is not installed; pip install {extra} or take it out"
        return None

    @classmethod
    def after_run(cls, cfg, summary: dict[str, Any]) -> None:
        """On the launcher once the run is over (the final checkpoint is known)."""

    @classmethod
    def where(cls, cfg, summary: dict[str, Any]) -> str | None:
        """The line the launcher prints to say where this record is and how to view it."""
        return None


    # ---- on a sweep's driver (tune/main.py), around its trials ----

    @classmethod
    def open_sweep(cls, sweep: "SweepInfo", saved: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        """Before a sweep's trials start, and again when it resumes (`saved`: what it returned the first time):
        (its fields, kept in stride_sweep.json and sweep_summary.json under names of its own, such as
        mlflow_parent_run_id; what every trial's copy of this sink gets in RunInfo.options). Default: nothing."""
        return {}, {}

    @classmethod
    def close_sweep(cls, sweep: "SweepInfo", fields: dict[str, Any], trials: list[dict[str, Any]],
                    best: dict[str, Any] | None, complete: bool) -> None:
        """After the sweep's trials (complete, or interrupted): close its record; it may add fields of its own to
        each trial's row (`trials`, sweep_summary.json's) and to `fields`."""

    @classmethod
    def where_sweep(cls, sweep: "SweepInfo", fields: dict[str, Any]) -> str | None:
        """The line the sweep's driver prints to say where the sweep's record is."""
        return None


@dataclass
class SweepInfo:
    """What a sink's sweep hooks see of a sweep."""

    name: str
    sweep_dir: Path
    cfg: Any  # the base config (stride.trainers.config.Config)
    params: dict[str, Any]  # the sweep file, flat (sweep.*, base.*, space.*)
    metric: str
    mode: str
