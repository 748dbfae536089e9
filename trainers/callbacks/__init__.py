"""Callbacks: user code at fixed points of the training loop, on every rank, with state that resumes.

    from stride import Callback

    class StopAt(Callback):
        def __init__(self, step: int):
            self.at, self.seen = step, 0

        def on_step_end(self, state, metrics):
            self.seen += 1
            if state.step == self.at:
                state.request_stop()           # every rank agrees; the run checkpoints at this step and ends

        def state_dict(self):
            return {"seen": self.seen}         # JSON values: saved in the checkpoint, restored on resume

        def load_state_dict(self, state):
            self.seen = state["seen"]

Added with `train.callbacks: ["my_module:StopAt", {"my_module:StopAt": {"step": 30}}]` (a class, or a class with
its keyword arguments; the module found as a task's is: the launch folder, PYTHONPATH) or by
returning instances from `Task.callbacks(self)`. Plain PyTorch, no Ray: they run under Ray Train and torchrun alike.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from stride.trainers.policies import TrainingError


class Callback:
    """Base class of a callback. Every hook is optional and runs on every rank, in the order the callbacks were
    given (train.callbacks first, then the task's). An exception in a hook ends the run (exit 1) with one line
    naming the callback and the hook; the checkpoints written before it stay as they are."""

    def on_fit_start(self, state: "CallbackState") -> None:
        """Before the first step of this attempt (after a resume: the checkpoint and this callback's state are
        restored)."""

    def on_step_end(self, state: "CallbackState", metrics: dict[str, Any]) -> None:
        """After every optimizer step. `metrics` holds step, epoch and samples_seen, and on a log step the training
        figures (train_loss, lr, ...; averaged over ranks), on an evaluation step the validation ones too."""

    def on_eval_end(self, state: "CallbackState", metrics: dict[str, float]) -> None:
        """After an evaluation: val_loss and the task's val_<metric> (reduced across ranks: equal on every rank)."""

    def on_checkpoint(self, state: "CallbackState") -> None:
        """After a checkpoint is staged (its files are written in the background)."""

    def on_fit_end(self, state: "CallbackState", summary: dict[str, Any]) -> None:
        """After the last step of this attempt; `summary` is rank 0's (other ranks: status and stop_signal)."""

    def state_dict(self) -> dict[str, Any]:
        """This callback's state, as JSON values: rank 0's is saved in every checkpoint."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """On resume, on every rank, before on_fit_start."""


class CallbackState:
    """What a hook sees of the run. Counters are read-only; the model and the optimizer are the live ones (the
    model unwrapped: under FSDP its parameters are this rank's shards)."""

    def __init__(self, trainer):
        self._trainer = trainer

    @property
    def step(self) -> int:
        return self._trainer.state.step

    @property
    def epoch(self) -> int:
        return self._trainer.stream.position(self._trainer.state.micro_step)[0]

    @property
    def samples_seen(self) -> int:
        return self._trainer.state.samples_seen

    @property
    def total_steps(self) -> int:
        return self._trainer.total_steps

    @property
    def rank(self) -> int:
        return self._trainer.env.world_rank

    @property
    def world_size(self) -> int:
        return self._trainer.env.world_size

    @property
    def run_dir(self):
        return self._trainer.run_dir

    @property
    def config(self):
        return self._trainer.cfg

    @property
    def model(self) -> torch.nn.Module:
        return self._trainer.raw_model

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self._trainer.optimizer

    def request_stop(self, status: str = "stopped") -> None:
        """End the run after this step, with a checkpoint: every rank agrees at the step boundary (a request on any
        rank stops all). `status` goes to summary.json; a rerun of the same command does not train further."""
        self._trainer.stop.request(status)


def parse_entry(entry: str | dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """A train.callbacks entry: "module:Class", or {"module:Class": {keyword arguments}}."""
    if isinstance(entry, str):
        return entry, {}
    (spec, kwargs), = entry.items()
    return spec, dict(kwargs or {})


def load(spec: str, kwargs: dict[str, Any], where: str) -> Callback:
    """Import and construct one callback, its module found as a task's is (the working directory, PYTHONPATH, and
    on workers the launcher's folders); a mistake is a one-line ConfigError naming `where` (the config key)."""
    from stride.trainers.config import ConfigError
    from stride.trainers.tasks import load_class

    cls = load_class(where, spec, spec)
    name = spec.partition(":")[2]
    if not (inspect.isclass(cls) and issubclass(cls, Callback)):
        raise ConfigError(f"{where} ({spec}): {name} is not a stride.Callback; name a subclass of stride.Callback")
    try:
        inspect.signature(cls).bind(**kwargs)
    except TypeError as e:
        raise ConfigError(f"{where} ({spec}): {e}; give the arguments {name}.__init__ takes") from None
    return cls(**kwargs)


def build(cfg, task) -> list[Callback]:
    from stride.trainers.config import ConfigError

    out = [load(*parse_entry(entry), f"train.callbacks[{i}]") for i, entry in enumerate(cfg.train.callbacks)]
    out += builtin(cfg, task)
    own = list(task.callbacks())
    if bad := [c for c in own if not isinstance(c, Callback)]:
        raise ConfigError(f"model.name ({cfg.model.name}): Task.callbacks returned {type(bad[0]).__name__}, not a "
                          f"stride.Callback; return instances of Callback subclasses")
    return out + own


def check_evaluation_figure(cfg, task, key: str) -> None:
    """`key` (a section with a `metric`: train.early_stopping, checkpoint.keep_best) watches an evaluation figure:
    the run must evaluate, and the figure must be one the task reports (when it declares metric_names)."""
    from stride.trainers.config import ConfigError

    section, _, field = key.partition(".")
    metric = getattr(getattr(cfg, section), field).metric
    if not (cfg.data.val_path or cfg.data.val):
        raise ConfigError(f"{key} needs a validation split to watch; set data.val_path (or data.val), or remove {key}")
    figures = ["val_loss", *(f"val_{n}" for n in task.metric_names or ())]
    if task.metric_names is not None and metric.split("/")[0] not in figures:
        raise ConfigError(f"{key}.metric ({metric}) is not a figure {cfg.model.name} reports; use one of "
                          f"{', '.join(figures)}")


def builtin(cfg, task) -> list[Callback]:
    """The callbacks Stride's own keys ask for (train.early_stopping), checked against the task and the data."""
    out = []
    if (es := cfg.train.early_stopping) is not None:
        from stride.trainers.callbacks.early_stopping import EarlyStopping

        check_evaluation_figure(cfg, task, "train.early_stopping")
        out.append(EarlyStopping(es.metric, es.mode, es.patience, es.min_delta))
    return out


class Callbacks:
    """The run's callbacks: each hook called on each in order; their state keyed by class and position."""

    def __init__(self, callbacks: list[Callback], state: CallbackState):
        self.callbacks, self.state = callbacks, state
        counts: dict[str, int] = {}
        self.keys = []
        for cb in callbacks:
            name = f"{type(cb).__module__}:{type(cb).__qualname__}"
            counts[name] = counts.get(name, 0) + 1
            self.keys.append(name if counts[name] == 1 else f"{name}#{counts[name]}")

    @staticmethod
    def _guarded(key: str, hook: str, fn, *args) -> Any:
        """One callback's hook; its exception becomes one line naming the callback and the hook (exit 1)."""
        try:
            return fn(*args)
        except TrainingError:
            raise
        except Exception as e:  # noqa: BLE001 - the user's code
            first = (str(e).splitlines() or [""])[0][:300]
            raise TrainingError(f"callback {key} failed in {hook}: {type(e).__name__}: {first}") from e

    def _call(self, hook: str, *args) -> None:
        for key, cb in zip(self.keys, self.callbacks):
            self._guarded(key, hook, getattr(cb, hook), self.state, *args)

    def fit_start(self) -> None:
        self._call("on_fit_start")

    def step_end(self, metrics: dict[str, Any]) -> None:
        self._call("on_step_end", metrics)

    def eval_end(self, metrics: dict[str, float]) -> None:
        self._call("on_eval_end", metrics)

    def checkpoint(self) -> None:
        self._call("on_checkpoint")

    def fit_end(self, summary: dict[str, Any]) -> None:
        self._call("on_fit_end", summary)

    def state_dict(self) -> dict[str, Any]:
        return {key: self._guarded(key, "state_dict", cb.state_dict) for key, cb in zip(self.keys, self.callbacks)}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        for key, cb in zip(self.keys, self.callbacks):
            if key in saved:
                self._guarded(key, "load_state_dict", cb.load_state_dict, saved[key])
