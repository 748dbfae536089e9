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
from pathlib import Path
from typing import Any, Callable, ContextManager

import torch

from stride.errors import TrainingError
from stride.trainers.callbacks.base import Callback, CallbackState


def parse_entry(entry: str | dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """A train.callbacks entry: "module:Class", or {"module:Class": {keyword arguments}}."""
    if isinstance(entry, str):
        return entry, {}
    (spec, kwargs), = entry.items()
    return spec, dict(kwargs or {})


def load(spec: str, kwargs: dict[str, Any], where: str) -> Callback:
    """Import and construct one callback, its module found as a task's is (the working directory, PYTHONPATH, and
    on workers the launcher's folders); a mistake is a one-line ConfigError naming `where` (the config key)."""
    from stride.errors import ConfigError
    from stride.user_code import load_class

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
    """The run's callbacks, in the order their hooks run: train.ema's average first (its update is part of the
    optimizer step), then train.callbacks, Stride's other built-ins, and the task's own."""
    from stride.errors import ConfigError

    out = [*averages(cfg)]
    out += [load(*parse_entry(entry), f"train.callbacks[{i}]") for i, entry in enumerate(cfg.train.callbacks)]
    out += builtin(cfg, task)
    own = list(task.callbacks())
    if bad := [c for c in own if not isinstance(c, Callback)]:
        raise ConfigError(f"model.name ({cfg.model.name}): Task.callbacks returned {type(bad[0]).__name__}, not a "
                          f"stride.Callback; return instances of Callback subclasses")
    return out + own


def check_evaluation_figure(cfg, task, key: str) -> None:
    """`key` (a section with a `metric`: train.early_stopping, checkpoint.keep_best) watches an evaluation figure:
    the run must evaluate, and the figure must be one the task reports (when it declares metric_names)."""
    from stride.errors import ConfigError

    section, _, field = key.partition(".")
    metric = getattr(getattr(cfg, section), field).metric
    if not (cfg.data.val_path or cfg.data.val):
        raise ConfigError(f"{key} needs a validation split to watch; set data.val_path (or data.val), or remove {key}")
    figures = ["val_loss", *(f"val_{n}" for n in task.metric_names or ())]
    if task.metric_names is not None and metric.split("/")[0] not in figures:
        raise ConfigError(f"{key}.metric ({metric}) is not a figure {cfg.model.name} reports; use one of "
                          f"{', '.join(figures)}")


def averages(cfg) -> list[Callback]:
    """train.ema's average of the weights, when set (trainers/callbacks/ema.py)."""
    if cfg.train.ema is None:
        return []
    from stride.trainers.callbacks.ema import EMACallback

    return [EMACallback(cfg.train.ema.decay, cfg.train.ema.eval)]


def builtin(cfg, task) -> list[Callback]:
    """The callbacks Stride's own keys ask for after train.callbacks (train.early_stopping, checkpoint.keep_best),
    checked against the task and the data."""
    out = []
    if (es := cfg.train.early_stopping) is not None:
        from stride.trainers.callbacks.early_stopping import EarlyStopping

        check_evaluation_figure(cfg, task, "train.early_stopping")
        out.append(EarlyStopping(es.metric, es.mode, es.patience, es.min_delta))
    if (best := cfg.checkpoint.keep_best) is not None:
        from stride.trainers.callbacks.keep_best import KeepBest

        check_evaluation_figure(cfg, task, "checkpoint.keep_best")
        out.append(KeepBest(best.metric, best.mode, best.k))
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

    def optimizer_step(self) -> None:
        self._call("on_optimizer_step")

    def checkpoint_complete(self, folder: Path) -> None:
        self._call("on_checkpoint_complete", folder)

    def evaluation_weights(self) -> dict[str, Callable[[], ContextManager]]:
        """Every callback's weights to evaluate (suffix -> context manager factory), in the callbacks' order."""
        out: dict[str, Callable[[], ContextManager]] = {}
        for key, cb in zip(self.keys, self.callbacks):
            for suffix, swapped in self._guarded(key, "evaluation_weights", cb.evaluation_weights, self.state).items():
                if suffix in out:
                    raise TrainingError(f"callback {key}: evaluation_weights' suffix {suffix!r} is another "
                                        f"callback's too; give each its own suffix")
                out[suffix] = swapped
        return out

    def summary_fields(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, cb in zip(self.keys, self.callbacks):
            out.update(self._guarded(key, "summary_fields", cb.summary_fields, self.state))
        return out

    def state_dict(self) -> dict[str, Any]:
        return {key: self._guarded(key, "state_dict", cb.state_dict) for key, cb in zip(self.keys, self.callbacks)}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        for key, cb in zip(self.keys, self.callbacks):
            if key in saved:
                self._guarded(key, "load_state_dict", cb.load_state_dict, saved[key])

    # ---- tensor state: in the checkpoint's DCP state beside "model" and "optim" ----

    def _place(self, key: str, cb: Callback) -> tuple[str, ...]:
        """Where a callback's tensors lie in the checkpoint's state: ("callbacks", key), or a built-in's own name."""
        return (cb.tensors_key,) if cb.tensors_key else ("callbacks", key)

    def _tensors(self) -> list[tuple[str, Callback, tuple[str, ...], dict[str, torch.Tensor]]]:
        out = []
        for key, cb in zip(self.keys, self.callbacks):
            tensors = self._guarded(key, "state_tensors", cb.state_tensors, self.state)
            if tensors:
                out.append((key, cb, self._place(key, cb), dict(tensors)))
        return out

    @staticmethod
    def _nest(entries) -> dict[str, Any]:
        state: dict[str, Any] = {}
        for *_, place, tensors in entries:
            d = state
            for name in place[:-1]:
                d = d.setdefault(name, {})
            d[place[-1]] = tensors
        return state

    def state_tensors(self) -> tuple[dict[str, Any], dict[str, bool]]:
        """This rank's callback tensors, nested as the checkpoint's DCP state holds them, and meta.json's flags: a
        built-in's own name is true where its tensors are saved (train.ema's "ema", as before callbacks held it)."""
        entries = self._tensors()
        return self._nest(entries), {place[0]: True for *_, place, _ in entries if len(place) == 1}

    def tensors_to_fill(self, saved: set[str]) -> tuple[dict[str, Any], list]:
        """The callback tensors a checkpoint holds (`saved`: its DCP keys, flattened with "."), nested for DCP to
        fill in place, and what `loaded` needs afterwards. A callback whose tensors the checkpoint lacks (written
        before it was added) is left as it is; one whose names it holds only in part is refused."""
        present = []
        for key, cb, place, tensors in self._tensors():
            names = {".".join((*place, name)): name for name in tensors}
            found = [n for flat, n in names.items() if flat in saved]
            if len(found) == len(names):
                present.append((key, cb, place, tensors))
            elif found:
                missing = sorted(set(tensors) - set(found))
                raise TrainingError(f"callback {key}: the checkpoint holds some of its state_tensors but not "
                                    f"{', '.join(missing[:3])}; state_tensors must name the tensors it saved")
        return self._nest(present), present

    def loaded(self, present: list) -> None:
        for key, cb, _, tensors in present:
            self._guarded(key, "load_state_tensors", cb.load_state_tensors, self.state, tensors)
