"""Where a run's figures go. Each destination is one module behind `Sink`: metrics.jsonl (`metrics_file`) and
the console or progress bar (`console`) always, Prometheus gauges on Ray (`prometheus`, every rank), and the
trackers `tracking.sinks` names: MLflow (`mlflow_sink`), TensorBoard (`tensorboard_sink`), Weights & Biases
(`wandb_sink`). The loop hands each log step and evaluation to `Sinks`; it names none of them.

A tracker that fails (its server down, its disk full) warns once, in one line, and the run goes on without it;
a tracker whose package is missing is refused before the run starts (`preflight`). Trackers keep what a resume
needs to continue the same record (a run id) in the checkpoint (`state_dict`).

Plugins. A built-in tracker is one module here, `<something>_sink.py`, whose `Sink` subclass sets `name`: it is found
by that (`builtin`), and its `Settings` (a pydantic model) become `tracking.<key>` keys of the config
(trainers/config.py's TrackingSection inherits them), so adding one touches that module only. A user's own sink is
named in `tracking.sinks` as "module:Class" (a `stride.Sink` subclass; its module found as a task's is: the working
directory, PYTHONPATH, and on Ray workers the launcher's folders, STRIDE_TASK_PATH), or as
{"module:Class": {settings}}, checked against its own `Settings`. Each copy of a sink gets its settings as
`self.settings` before `open`. A sweep asks each tracker to open and close the sweep's own record (`open_sweep`,
`close_sweep`: MLflow's parent run); the others open none.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import queue
import threading
import pkgutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from stride.errors import ConfigError
from stride.trainers.sinks.base import RunInfo, Sink, SinkSettings, SweepInfo

log = logging.getLogger("stride")


_BUILTIN: dict[str, type[Sink]] | None = None


def builtin() -> dict[str, type[Sink]]:
    """tracking.sinks' built-in names -> their classes: the `Sink` subclass with a `name` in each module
    trainers/sinks/*_sink.py, in the modules' order. The modules import nothing heavy (their tracker's package only
    when a sink opens), because the config's schema reads their settings."""
    global _BUILTIN
    if _BUILTIN is None:
        found: dict[str, type[Sink]] = {}
        for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
            if info.name.endswith("_sink"):
                module = importlib.import_module(f"{__name__}.{info.name}")
                for value in vars(module).values():
                    if (isinstance(value, type) and issubclass(value, Sink) and value.__module__ == module.__name__
                            and value.name):
                        found[value.name] = value
        _BUILTIN = found
    return _BUILTIN


def parse_entry(entry: str | dict[str, Any]) -> tuple[str, dict[str, Any] | None]:
    """A tracking.sinks entry: a built-in name or "module:Class" (settings None), or {"module:Class": {settings}}."""
    if isinstance(entry, str):
        return entry, None
    (spec, settings), = entry.items()
    return spec, dict(settings or {})


@dataclass
class Tracker:
    """One entry of tracking.sinks, resolved: its class, its settings, and the key its state, options and warnings
    go by (a built-in's name; a user's "module:Class")."""

    key: str
    cls: type[Sink]
    settings: SinkSettings
    where: str  # tracking.sinks[i]

    def make(self) -> Sink:
        sink = self.cls()
        sink.name, sink.settings = self.key, self.settings
        return sink


def tracker_class(spec: str, where: str = "tracking.sinks") -> type[Sink]:
    """The class a tracking.sinks entry names: a built-in, or a user's "module:Class" (ConfigError naming `where`)."""
    if spec in builtin():
        return builtin()[spec]
    from stride.user_code import load_class

    cls = load_class(where, spec, spec)
    name = spec.partition(":")[2]
    if not (isinstance(cls, type) and issubclass(cls, Sink)):
        raise ConfigError(f"{where} ({spec}): {name} is not a stride.Sink; name a subclass of stride.Sink")
    if not (isinstance(cls.Settings, type) and issubclass(cls.Settings, SinkSettings)):
        raise ConfigError(f"{where} ({spec}): {name}.Settings must subclass stride.trainers.sinks.SinkSettings")
    return cls


def _settings(cfg, cls: type[Sink], spec: str, given: dict[str, Any] | None, where: str) -> SinkSettings:
    if spec in builtin():  # its keys are tracking.<key>, validated with the config
        return cls.Settings.model_construct(**{k: getattr(cfg.tracking, k) for k in cls.Settings.model_fields})
    try:
        return cls.Settings.model_validate(given or {})
    except ValidationError as e:
        err = e.errors()[0]
        key = ".".join(map(str, err["loc"]))
        fields = ", ".join(cls.Settings.model_fields) or "none"
        if err["type"] == "extra_forbidden":
            raise ConfigError(f"{where} ({spec}): {key} is not a setting of {cls.__name__} (its settings: "
                              f"{fields}); give only those") from None
        if err["type"] == "missing":
            raise ConfigError(f"{where} ({spec}): {cls.__name__} needs the setting {key}; give it as "
                              f"{{\"{spec}\": {{{key}: <value>}}}}") from None
        msg = err["msg"].removeprefix("Value error, ")
        raise ConfigError(f"{where} ({spec}): {key} ({repr(err.get('input'))[:200]}) {msg}") from None


def trackers(cfg) -> list[Tracker]:
    """The trackers this run records to (tracking.sinks, less MLflow when tracking.mlflow is false), imported and
    their settings checked; a mistake is a ConfigError naming tracking.sinks[i]."""
    out: list[Tracker] = []
    active = cfg.tracking.active_sinks()
    for i, entry in enumerate(cfg.tracking.sinks):
        spec, given = parse_entry(entry)
        if spec not in active:
            continue
        where = f"tracking.sinks[{i}]"
        cls = tracker_class(spec, where)
        if twin := next((t for t in out if t.cls is cls), None):
            raise ConfigError(f"{where} ({spec}) is the sink {twin.where} ({twin.key}) names already; list each sink "
                              f"once")
        out.append(Tracker(spec, cls, _settings(cfg, cls, spec, given, where), where))
    return out


def preflight(cfg) -> None:
    """Refuse, before anything starts, a tracker that cannot work here (not importable, not a Sink, named twice, its
    settings wrong, its package missing): ConfigError, one line naming tracking.sinks[i]."""
    for t in trackers(cfg):
        if why := t.cls.preflight(cfg):
            raise ConfigError(f"{t.where} ({t.key}): {why}")


def plan(cfg) -> dict[str, dict[str, Any]]:
    return {t.key: t.cls.plan(cfg) for t in trackers(cfg)}


def saved_state(meta: dict[str, Any]) -> dict[str, Any]:
    """The sinks' states in a checkpoint's meta.json (older checkpoints: their trackers' run ids)."""
    if "sinks" in meta:
        return meta["sinks"] or {}
    return {cls.name: {"run_id": meta[key]} for cls in builtin().values()
            if (key := cls.legacy_meta_key) and meta.get(key)}


def after_run(cfg, summary: dict[str, Any]) -> None:
    for t in trackers(cfg):
        t.cls.after_run(cfg, summary)


def where(cfg, summary: dict[str, Any]) -> list[str]:
    return [line for t in trackers(cfg) if (line := t.cls.where(cfg, summary))]


# ---- a sweep's record (tune/main.py) ----

def open_sweep(sweep: SweepInfo, saved: dict[str, Any]) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """Every tracker of the sweep's base config opens the sweep's record: (their fields, each trial's sink
    options by sink key)."""
    fields: dict[str, Any] = {}
    options: dict[str, dict[str, Any]] = {}
    for t in trackers(sweep.cfg):
        own, options[t.key] = t.cls.open_sweep(sweep, saved)
        fields.update(own)
    return fields, options


def close_sweep(sweep: SweepInfo, fields: dict[str, Any], trials: list[dict[str, Any]], best: dict[str, Any] | None,
                complete: bool) -> list[str]:
    """Every tracker closes the sweep's record; a failure warns in one line (the sweep's results stand). The
    lines saying where each record is."""
    lines = []
    for t in trackers(sweep.cfg):
        try:
            t.cls.close_sweep(sweep, fields, trials, best, complete)
            if line := t.cls.where_sweep(sweep, fields):
                lines.append(line)
        except Exception as e:  # noqa: BLE001 - a tracker must never lose the sweep's results
            log.warning("sink %s failed in close_sweep (%s: %s)", t.key, type(e).__name__,
                        (str(e).splitlines() or [""])[0][:200])
    return lines


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
        candidates = [MetricsFileSink(), ConsoleSink(), PrometheusSink(), *(t.make() for t in active)]
        sinks = [s for s in candidates if rank0 or s.every_rank]
        used = {t.cls for t in active}
        self = cls([], tuple(f for c in builtin().values() if c not in used for f in c.summary_fields))
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
