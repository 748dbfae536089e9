"""Where a run's figures go. Each destination is one module behind `Sink`: metrics.jsonl (`metrics_file`) and
the console or progress bar (`console`) always, Prometheus gauges on Ray (`prometheus`, every rank), and the
trackers `tracking.sinks` names: MLflow (`mlflow_sink`), TensorBoard (`tensorboard_sink`), Weights & Biases
(`wandb_sink`). The loop hands each log step and evaluation to `Sinks`; it names none of them.

A tracker that fails (its server down, its disk full) warns once, in one line, and the run goes on without it;
a tracker whose package is missing is refused before the run starts (`preflight`). Trackers keep what a resume
needs to continue the same record (a run id) in the checkpoint (`state_dict`).
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import queue
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

log = logging.getLogger("stride")

# tracking.sinks' names (each class's `name`): module:class, imported only when a run asks for it.
TRACKERS = {
    "mlflow": "stride.trainers.sinks.mlflow_sink:MLflowSink",
    "tensorboard": "stride.trainers.sinks.tensorboard_sink:TensorBoardSink",
    "wandb": "stride.trainers.sinks.wandb_sink:WandbSink",
}


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
    def preflight(cls, cfg) -> str | None:
        """Before the run: why this sink cannot work (one line naming the fix), or None."""
        if cls.package and importlib.util.find_spec(cls.package) is None:
            return f"the {cls.package} package is not installed; pip install 'stride[{cls.name}]' or take it out"
        return None

    @classmethod
    def after_run(cls, cfg, summary: dict[str, Any]) -> None:
        """On the launcher once the run is over (the final checkpoint is known)."""

    @classmethod
    def where(cls, cfg, summary: dict[str, Any]) -> str | None:
        """The line the launcher prints to say where this record is and how to view it."""
        return None


def tracker_class(name: str) -> type[Sink]:
    module, _, cls = TRACKERS[name].partition(":")
    return getattr(importlib.import_module(module), cls)


def trackers(cfg) -> list[type[Sink]]:
    """The tracker classes this run records to (tracking.sinks, less MLflow when tracking.mlflow is false)."""
    return [tracker_class(name) for name in cfg.tracking.active_sinks()]


def preflight(cfg) -> None:
    """Refuse, before anything starts, a tracker that cannot work here (its package missing): ConfigError."""
    from stride.errors import ConfigError

    for cls in trackers(cfg):
        if why := cls.preflight(cfg):
            raise ConfigError(f"tracking.sinks ({cls.name}): {why}")


def plan(cfg) -> dict[str, dict[str, Any]]:
    return {cls.name: cls.plan(cfg) for cls in trackers(cfg)}


def saved_state(meta: dict[str, Any]) -> dict[str, Any]:
    """The sinks' states in a checkpoint's meta.json (older checkpoints: their trackers' run ids)."""
    if "sinks" in meta:
        return meta["sinks"] or {}
    return {cls.name: {"run_id": meta[key]} for cls in map(tracker_class, TRACKERS)
            if (key := cls.legacy_meta_key) and meta.get(key)}


def after_run(cfg, summary: dict[str, Any]) -> None:
    for cls in trackers(cfg):
        cls.after_run(cfg, summary)


def where(cfg, summary: dict[str, Any]) -> list[str]:
    return [line for cls in trackers(cfg) if (line := cls.where(cfg, summary))]


# The hooks a background sink runs on the sinks' thread (in order); open, state_dict, summary and close stay on the
# caller's.
BACKGROUND_HOOKS = ("train", "eval", "step", "artifact")


class Sinks:
    """One log step or evaluation goes out to every sink this rank has. metrics.jsonl, the console and Prometheus
    are written in the step; the trackers (`background`) on one thread of their own, in order, so that a slow
    server or disk costs the training thread a queue put, not a round trip."""

    def __init__(self, sinks: list[Sink], off: tuple[str, ...] = ()):
        self.sinks = sinks
        self.dropped: list[Sink] = []  # failed: no more figures, but their run ids stay in summary and checkpoint
        self.off = off  # summary fields of the trackers this run does not use (None in summary.json)
        self._queue: queue.SimpleQueue | None = None
        self._thread: threading.Thread | None = None

    @classmethod
    def open(cls, run: RunInfo, rank0: bool) -> "Sinks":
        from stride.trainers.sinks.console import ConsoleSink
        from stride.trainers.sinks.metrics_file import MetricsFileSink
        from stride.trainers.sinks.prometheus import PrometheusSink

        active = trackers(run.cfg)
        candidates = [MetricsFileSink(), ConsoleSink(), PrometheusSink(), *(c() for c in active)]
        sinks = [s for s in candidates if rank0 or s.every_rank]
        self = cls([], tuple(f for c in map(tracker_class, TRACKERS) if c not in active for f in c.summary_fields))
        for sink in sinks:
            own = RunInfo(**{**run.__dict__, "state": run.state.get(sink.name) or {},
                             "options": run.options.get(sink.name) or {}})
            self.sinks.append(sink)
            self._call(sink, "open", own)
        return self

    def _call(self, sink: Sink, hook: str, *args) -> Any:
        """A hook of one sink; a non-essential sink that fails is dropped with one warning line."""
        if sink.essential:
            return getattr(sink, hook)(*args)
        try:
            return getattr(sink, hook)(*args)
        except Exception as e:  # noqa: BLE001 - a tracker must never end the training it records
            first = (str(e).splitlines() or [""])[0][:200]
            log.warning("sink %s failed in %s (%s: %s); training continues without it", sink.name or
                        type(sink).__name__, hook, type(e).__name__, first)
            if sink in self.sinks:
                self.sinks.remove(sink)
                self.dropped.append(sink)
            return False

    def _each(self, hook: str, *args) -> None:
        for sink in list(self.sinks):
            if getattr(sink, "background", False) and hook in BACKGROUND_HOOKS:
                self._post(sink, hook, tuple(dict(a) if isinstance(a, dict) else a for a in args))
            else:
                self._call(sink, hook, *args)

    def _post(self, sink: Sink, hook: str, args: tuple) -> None:
        if self._thread is None:
            self._queue = queue.SimpleQueue()
            self._thread = threading.Thread(target=self._drain, name="stride-sinks", daemon=True)
            self._thread.start()
        self._queue.put((sink, hook, args))

    def _drain(self) -> None:
        while (item := self._queue.get()) is not None:
            sink, hook, args = item
            if sink in self.sinks:
                self._call(sink, hook, *args)

    def flush(self) -> None:
        """Wait until the background sinks have made every record handed to them."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None

    def train(self, metrics: dict[str, Any], own: dict[str, Any], eta_s: float) -> None:
        self._each("train", metrics, own, eta_s)

    def eval(self, step: int, metrics: dict[str, float]) -> None:
        self._each("eval", step, metrics)

    def step(self, step: int, metrics: dict[str, Any]) -> None:
        self._each("step", step, {k: v for k, v in metrics.items() if k != "step"})

    def step_done(self) -> None:
        self._each("step_done")

    def artifact(self, path: Path, folder: str) -> None:
        self._each("artifact", path, folder)

    def state_dict(self) -> dict[str, Any]:
        return {s.name: state for s in self.sinks + self.dropped if (state := s.state_dict())}

    def summary(self) -> dict[str, Any]:
        out = dict.fromkeys(self.off)
        for sink in self.sinks + self.dropped:
            out.update(sink.summary())
        return out

    def close(self, status: str) -> None:
        self.flush()
        self._each("close", status)
