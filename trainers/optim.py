"""The optimizer and its schedule: optim.name's classes, parameter groups (optim.groups), freezing and the lr
scheduler (optim.schedule). A schedule is a function of (step, warmup_steps, total_steps, min_lr_ratio,
decay_fraction) -> the peak lr's multiplier; `optim.schedule` names a built-in one (trainers/schedules.py, where
each is defined and registered) or a "<module>:<function>" of your own. Imports with torch alone, as the step does
(benchmarks/gpu.py)."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.nn as nn

from stride.trainers.schedules import SCHEDULES, Schedule

if TYPE_CHECKING:  # config needs pydantic
    from stride.trainers.config import Config

__all__ = ["build_optimizer", "build_scheduler", "implementation", "kernel_kwargs"]


# optim.name's short names: the class, and the config fields it takes beyond lr (optim.kwargs override them).
BUILTIN_OPTIMIZERS: dict[str, tuple[type[torch.optim.Optimizer], Callable[[Any], dict[str, Any]]]] = {
    "adamw": (torch.optim.AdamW, lambda o: {"betas": tuple(o.betas)}),
    "adam": (torch.optim.Adam, lambda o: {"betas": tuple(o.betas)}),
    "sgd": (torch.optim.SGD, lambda o: {"momentum": o.momentum}),
    "adafactor": (torch.optim.Adafactor, lambda o: {}),
}


# optim.implementation: what each built-in optimizer offers (torch.optim's kernels). auto: fused on CUDA where there is
# one (one kernel for every parameter: nanoGPT's and torchtitan's choice), else foreach (torch's own CUDA default).
IMPLEMENTATIONS = {"adamw": ("fused", "foreach", "for_loop"), "adam": ("fused", "foreach", "for_loop"),
                   "sgd": ("fused", "foreach", "for_loop"), "adafactor": ("foreach", "for_loop")}
_KWARGS = {"fused": {"fused": True, "foreach": False}, "foreach": {"foreach": True}, "for_loop": {"foreach": False}}


def implementation(name: str, chosen: str, device: torch.device) -> str | None:
    """The kernel optim.implementation picks for optimizer `name` on `device`; None: the optimizer's own default (a
    user's optimizer under auto). Raises ConfigError for one the optimizer does not have."""
    from stride.errors import ConfigError

    offered = IMPLEMENTATIONS.get(name)
    if chosen == "auto":
        if offered is None:
            return None
        return "fused" if device.type == "cuda" and "fused" in offered else "foreach"
    if offered is None or chosen not in offered:
        has = ", ".join(offered) if offered else "only its own (a user's optimizer)"
        raise ConfigError(f"optim.implementation ({chosen}): optim.name {name} has {has}; use "
                          f"optim.implementation=auto" + (f" or one of {', '.join(offered)}" if offered else ""))
    return chosen


def kernel_kwargs(kernel: str | None) -> dict[str, bool]:
    """The constructor arguments of a torch.optim optimizer that select `kernel` (implementation()'s answer)."""
    return dict(_KWARGS.get(kernel, {}))


def optimizer_class(name: str) -> tuple[type[torch.optim.Optimizer], bool]:
    """optim.name -> (the optimizer class, whether it is built in). A "<module>:<Class>" is found the way
    model.name finds a user's task. Raises ConfigError (exit 2) for a name that is no torch.optim.Optimizer."""
    from stride.errors import ConfigError
    from stride.user_code import load_class

    if name in BUILTIN_OPTIMIZERS:
        return BUILTIN_OPTIMIZERS[name][0], True
    cls = load_class("optim.name", name, name)
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise ConfigError(f"optim.name ({name}) is not a torch.optim.Optimizer subclass; name one, e.g. "
                          f"optim.name=torch.optim:RAdam, or define class {name.partition(':')[2]}(torch.optim.Optimizer)")
    return cls, False


@dataclass
class GroupPlan:
    """One optim.groups entry (None: the default group) and the trainable parameters it took."""

    label: str  # lr/<label>: the entry's name or its index; "default"
    spec: Any  # config.ParamGroup | None
    names: list[str]
    params: list[nn.Parameter]

    def frozen_at(self, step: int) -> bool:
        return self.spec is not None and self.spec.frozen_at(step)


def resolve_groups(cfg: Config, model: nn.Module) -> list[GroupPlan]:
    """The model's trainable parameters by optim.groups, the default group first: the first entry whose `match`
    is found in a name takes it. A parameter the task built with requires_grad=False (a PEFT model's base) is in no
    group: it is the task's to freeze. An entry that takes nothing is a ConfigError (exit 2)."""
    from stride.errors import ConfigError

    specs = cfg.optim.groups
    plans = [GroupPlan("default", None, [], [])] + [GroupPlan(g.name or str(i), g, [], []) for i, g in enumerate(specs)]
    patterns = [re.compile(g.match) for g in specs]
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    for name, p in named:
        i = next((i for i, pat in enumerate(patterns) if pat.search(name)), None)
        plan = plans[0 if i is None else i + 1]
        plan.names.append(name)
        plan.params.append(p)
    for plan in plans[1:]:
        if not plan.params:
            first = ", ".join(n for n, _ in named[:3])
            raise ConfigError(f"optim.groups[{plans.index(plan) - 1}].match ({plan.spec.match!r}) matches none of the "
                              f"model's {len(named)} trainable parameters not taken by an earlier group (first names: "
                              f"{first}); fix the pattern")
    return plans


def split_groups(cfg: Config, groups: list[GroupPlan], lr: float) -> list[tuple[GroupPlan, dict[str, Any]]]:
    """The optimizer's groups, two per GroupPlan (the default first): its 2-d and larger parameters with the group's
    weight decay, and its 1-d ones (biases, norms) without (the usual GPT recipe); each with the group's lr (lr x
    lr_scale). With optim.groups, empty ones are left out (torch's distributed state dict takes one at most)."""
    out = []
    for g in groups:
        scale = g.spec.lr_scale if g.spec else 1.0
        decay = g.spec.weight_decay if g.spec and g.spec.weight_decay is not None else cfg.optim.weight_decay
        out += [(g, {"params": [p for p in g.params if p.dim() >= 2], "weight_decay": decay, "lr": lr * scale}),
                (g, {"params": [p for p in g.params if p.dim() < 2], "weight_decay": 0.0, "lr": lr * scale})]
    return [(g, d) for g, d in out if d["params"] or not cfg.optim.groups]


def param_groups(cfg: Config, model: nn.Module, lr: float) -> list[dict[str, Any]]:
    """The trainable parameters in optimizer groups (split_groups of resolve_groups)."""
    return [d for _, d in split_groups(cfg, resolve_groups(cfg, model), lr)]


class Freezer:
    """optim.groups' freeze schedule: frozen groups' parameters have requires_grad=False (no gradient, so no
    optimizer state, weight decay or all-reduce: bitwise unchanged), set for each step before it runs."""

    def __init__(self, groups: list[GroupPlan]):
        self.groups = [g for g in groups if g.spec is not None and (g.spec.freeze or g.spec.unfreeze_at_step)]
        self.trainable: list[bool | None] = [None] * len(self.groups)  # as last set: the step loop skips the rest

    def apply(self, step: int) -> bool:
        """Set requires_grad for the optimizer step after `step` completed ones; True if any parameter changed
        (DDP then needs a new reducer: it all-reduces only what required grad when it was built)."""
        changed = False
        for i, g in enumerate(self.groups):
            trainable = not g.frozen_at(step)
            if self.trainable[i] == trainable:  # every step calls this: touch the parameters only on a change
                continue
            self.trainable[i] = trainable
            for p in g.params:
                if p.requires_grad != trainable:
                    p.requires_grad_(trainable)
                    changed = True
        return changed


def build_optimizer(cfg: Config, model: nn.Module, world_size: int, task: Any = None) -> torch.optim.Optimizer:
    """The optimizer over `model`'s parameter groups: the task's own (Task.configure_optimizer) if it builds one,
    else optim.name with optim.kwargs."""
    from stride.trainers.config import scaled_lr

    o = cfg.optim
    lr = scaled_lr(cfg, world_size)
    groups = param_groups(cfg, model, lr)
    if task is not None:
        optimizer = task.configure_optimizer(model, groups)
        if optimizer is not None:
            if not isinstance(optimizer, torch.optim.Optimizer):
                raise TypeError(f"{type(task).__name__}.configure_optimizer returned {type(optimizer).__name__}, not "
                                f"a torch.optim.Optimizer; return one, or None to let Stride build optim.name")
            return optimizer
    cls, builtin = optimizer_class(o.name)
    defaults = BUILTIN_OPTIMIZERS[o.name][1](o) if builtin else {}
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    kernel = implementation(o.name, o.implementation, device)
    return cls(groups, lr=lr, **{**defaults, **kernel_kwargs(kernel), **o.kwargs})  # optim.kwargs win


def check_optimizer(cfg: Config) -> None:
    """Build optim.name with optim.kwargs over a dummy model and take one step, on the driver before any worker
    starts: an unknown class or a keyword it refuses is a ConfigError (exit 2) here, not a failure on every worker."""
    from stride.errors import ConfigError
    from stride.errors import quote

    optimizer_class(cfg.optim.name)  # its own errors name optim.name
    implementation(cfg.optim.name, cfg.optim.implementation, torch.device("cpu"))  # one it has, or exit 2
    check_schedule(cfg)
    dummy = nn.Linear(2, 2)  # a 2-d and a 1-d parameter: both groups
    plain = cfg.model_copy(update={"optim": cfg.optim.model_copy(update={"groups": []})})  # groups: the real model's
    try:
        optimizer = build_optimizer(plain, dummy, 1)
        dummy(torch.ones(1, 2)).sum().backward()
        optimizer.step()
    except Exception as e:  # noqa: BLE001 - whatever the optimizer refuses, one line naming the setting
        key, value = ("optim.kwargs", quote(cfg.optim.kwargs)) if cfg.optim.kwargs else ("optim.name", cfg.optim.name)
        reason = " ".join(str(e).split())[:200]
        raise ConfigError(f"{key} ({value}): {cfg.optim.name} refused it ({type(e).__name__}: {reason}); fix {key} "
                          f"to what the optimizer's constructor takes") from None


def group_factor(factor: Callable[[int], float], spec: Any, warmup_steps: int) -> Callable[[int], float]:
    """A group's lr multiplier: 0 while frozen; from unfreeze_at_step on, the schedule's times a linear warm-up of
    its own over warmup_steps (a group that starts training late does not start at the peak lr)."""
    if spec is None or not (spec.freeze or spec.unfreeze_at_step):
        return factor
    u = spec.unfreeze_at_step

    def frozen_then_warm(s: int) -> float:
        if spec.frozen_at(s):
            return 0.0
        rewarm = min(1.0, (s - u + 1) / warmup_steps) if u is not None and warmup_steps else 1.0
        return factor(s) * rewarm
    return frozen_then_warm


def schedule_function(name: str) -> Schedule:
    """optim.schedule -> its function: a built-in one, or the "<module>:<function>" found as optim.name finds a
    class. Raises ConfigError (exit 2) for a name that is not a function."""
    from stride.errors import ConfigError
    from stride.user_code import load_class

    if name in SCHEDULES:
        return SCHEDULES[name]
    fn = load_class("optim.schedule", name, name)
    if not callable(fn) or isinstance(fn, type):
        raise ConfigError(f"optim.schedule ({name}) is not a function; name one defined as def "
                          f"{name.partition(':')[2]}(step, warmup_steps, total_steps, min_lr_ratio, decay_fraction)")
    return fn


def schedule(cfg: Config, total_steps: int) -> Callable[[int], float]:
    """optim.schedule's multiplier of the peak lr at each optimizer step."""
    o = cfg.optim
    fn = schedule_function(o.schedule)

    def factor(s: int) -> float:
        return float(fn(s, o.warmup_steps, total_steps, o.min_lr_ratio, o.decay_fraction))
    return factor


def check_schedule(cfg: Config) -> None:
    """optim.schedule imported and called over a short run on the driver, before any worker starts: a function that
    fails or returns no finite number >= 0 is a ConfigError (exit 2) here, not on every worker."""
    from stride.errors import ConfigError

    factor = schedule(cfg, 100)
    for step in (0, 50, 99):
        try:
            value = factor(step)
        except Exception as e:  # noqa: BLE001 - the user's function failed: one line naming it
            raise ConfigError(f"optim.schedule ({cfg.optim.schedule}) failed at step {step} of 100 ({type(e).__name__}: "
                              f"{' '.join(str(e).split())[:200]}); fix the function") from None
        if not (math.isfinite(value) and value >= 0):
            raise ConfigError(f"optim.schedule ({cfg.optim.schedule}) returned {value} at step {step} of 100; return "
                              f"the peak lr's multiplier, a finite number >= 0")


def build_scheduler(cfg: Config, optimizer: torch.optim.Optimizer, total_steps: int,
                    groups: list[GroupPlan] | None = None):
    """LambdaLR with the optim.schedule multiplier; with optim.groups, each optimizer group's own (group_factor).
    A task's own optimizer (configure_optimizer) with other groups gets the schedule alone."""
    factor = schedule(cfg, total_steps)
    lambdas: Any = factor
    if cfg.optim.groups and groups:
        owners = [g for g, _ in split_groups(cfg, groups, 1.0)]
        if len(owners) == len(optimizer.param_groups):
            lambdas = [group_factor(factor, g.spec, cfg.optim.warmup_steps) for g in owners]
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambdas)


def logged_lrs(cfg: Config, scheduler, groups: list[GroupPlan], peak_lr: float, total_steps: int) -> dict[str, float]:
    """lr (the schedule's, what the default group trains at) and, with optim.groups, lr/<label> of every group,
    for the optimizer step after the last one taken (what the scheduler has set)."""
    owners = [g for g, _ in split_groups(cfg, groups, 1.0)] if cfg.optim.groups else []
    if len(owners) != len(scheduler.get_last_lr()):  # no optim.groups, or a task's own optimizer's groups
        return {"lr": scheduler.get_last_lr()[0]}
    step = scheduler.last_epoch
    factor = schedule(cfg, total_steps)
    return {"lr": peak_lr * factor(step)} | {
        f"lr/{g.label}": 0.0 if g.frozen_at(step) else peak_lr * (g.spec.lr_scale if g.spec else 1.0)
        * group_factor(factor, g.spec, cfg.optim.warmup_steps)(step) for g in groups}
