"""The training step, evaluation, precision, optimizer and schedule: plain PyTorch, no Ray.

The same functions run under Ray Train (trainers/loop.py) and under `torchrun` (trainers/torchrun.py).
"""

from __future__ import annotations

import contextlib
import math
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn

if TYPE_CHECKING:  # config needs pydantic; the step itself must import with torch alone (benchmarks/gpu.py)
    from stride.trainers.config import Config

# The loss of one micro-batch: Task.loss, or any function of (model, batch) (benchmarks/gpu.py's hand-written one).
# A scalar mean, or (loss_sum, count) for losses weighted by their terms (tokens) across micro-batches and ranks.
LossFn = Callable[[nn.Module, Any], "torch.Tensor | tuple[torch.Tensor, Any]"]


# ---- precision ----

def resolve_precision(requested: str, device: torch.device) -> str:
    """`auto` -> bf16 on GPUs that support it, fp16 on older GPUs, fp32 on CPU (bf16 there is ~20x slower)."""
    if requested != "auto":
        return requested
    if device.type == "cuda":
        return "bf16" if torch.cuda.is_bf16_supported() else "fp16"
    return "fp32"


@dataclass(frozen=True)
class Precision:
    device_type: str
    dtype: torch.dtype | None
    # FSDP (train.strategy=fsdp): bf16 comes from FSDP's MixedPrecisionPolicy (bf16 compute, fp32 gradient
    # reduction, fp32 sharded master weights), not from autocast; fp16 keeps autocast with a sharded GradScaler.
    sharded: bool = False

    @classmethod
    def create(cls, name: str, device: torch.device, sharded: bool = False) -> "Precision":
        return cls(device.type, {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[name], sharded)

    @property
    def fsdp_param_dtype(self) -> torch.dtype | None:
        """The dtype FSDP casts parameters to for compute (MixedPrecisionPolicy.param_dtype), or None."""
        return torch.bfloat16 if self.sharded and self.dtype == torch.bfloat16 else None

    def autocast(self):
        enabled = self.dtype is not None and self.fsdp_param_dtype is None
        return torch.autocast(self.device_type, dtype=self.dtype or torch.float32, enabled=enabled)

    def grad_scaler(self) -> torch.amp.GradScaler:
        # Dynamic loss scaling only for fp16; disabled it is a no-op pass-through.
        if self.sharded and self.dtype == torch.float16:
            # Each rank sees only its gradient shard: the sharded scaler all-reduces found_inf, so every rank
            # skips the same steps.
            from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

            return ShardedGradScaler(self.device_type, enabled=True)
        return torch.amp.GradScaler(self.device_type, enabled=self.dtype == torch.float16)


# ---- optimizer, schedule ----

# optim.name's short names: the class, and the config fields it takes beyond lr (optim.kwargs override them).
BUILTIN_OPTIMIZERS: dict[str, tuple[type[torch.optim.Optimizer], Callable[[Any], dict[str, Any]]]] = {
    "adamw": (torch.optim.AdamW, lambda o: {"betas": tuple(o.betas)}),
    "adam": (torch.optim.Adam, lambda o: {"betas": tuple(o.betas)}),
    "sgd": (torch.optim.SGD, lambda o: {"momentum": o.momentum}),
    "adafactor": (torch.optim.Adafactor, lambda o: {}),
}


def optimizer_class(name: str) -> tuple[type[torch.optim.Optimizer], bool]:
    """optim.name -> (the optimizer class, whether it is built in). A "<module>:<Class>" is found the way
    model.name finds a user's task. Raises ConfigError (exit 2) for a name that is no torch.optim.Optimizer."""
    from stride.trainers.config import ConfigError
    from stride.trainers.tasks import load_class

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
    from stride.trainers.config import ConfigError

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
    return cls(groups, lr=lr, **{**defaults, **o.kwargs})


def check_optimizer(cfg: Config) -> None:
    """Build optim.name with optim.kwargs over a dummy model and take one step, on the driver before any worker
    starts: an unknown class or a keyword it refuses is a ConfigError (exit 2) here, not a failure on every worker."""
    from stride.trainers.config import ConfigError, quote

    optimizer_class(cfg.optim.name)  # its own errors name optim.name
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


# ---- schedules: the multiplier of the peak lr at optimizer step `step` (0-based), after a linear warm-up ----

def _warmup(step: int, warmup_steps: int) -> float:
    return (step + 1) / warmup_steps


def cosine_factor(step: int, warmup_steps: int, total_steps: int, min_lr_ratio: float, decay_fraction: float = 1.0) -> float:
    """Cosine from the peak to min_lr_ratio at total_steps (Stride's schedule before optim.schedule existed)."""
    if step < warmup_steps:
        return _warmup(step, warmup_steps)
    decay_steps = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


lr_factor = cosine_factor  # the name callers used before optim.schedule existed


def linear_factor(step: int, warmup_steps: int, total_steps: int, min_lr_ratio: float, decay_fraction: float) -> float:
    """A straight line from the peak to min_lr_ratio at total_steps."""
    if step < warmup_steps:
        return _warmup(step, warmup_steps)
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_lr_ratio + (1.0 - min_lr_ratio) * (1.0 - progress)


def constant_factor(step: int, warmup_steps: int, total_steps: int, min_lr_ratio: float, decay_fraction: float) -> float:
    """The peak lr after the warm-up."""
    return _warmup(step, warmup_steps) if step < warmup_steps else 1.0


def wsd_factor(step: int, warmup_steps: int, total_steps: int, min_lr_ratio: float, decay_fraction: float) -> float:
    """Warm-up, stable at the peak, then a straight line to min_lr_ratio over the last
    round(decay_fraction x total_steps) steps (at least 1; never starting inside the warm-up)."""
    if step < warmup_steps:
        return _warmup(step, warmup_steps)
    decay_start = max(warmup_steps, total_steps - max(1, round(decay_fraction * total_steps)))
    if step < decay_start:
        return 1.0
    progress = min(1.0, (step - decay_start) / max(1, total_steps - decay_start))
    return min_lr_ratio + (1.0 - min_lr_ratio) * (1.0 - progress)


def inverse_sqrt_factor(step: int, warmup_steps: int, total_steps: int, min_lr_ratio: float, decay_fraction: float) -> float:
    """sqrt(warmup_steps / n) at the n-th optimizer step (n = step + 1; warmup_steps=0 counts as 1), so it continues
    the warm-up's peak; never below min_lr_ratio."""
    if step < warmup_steps:
        return _warmup(step, warmup_steps)
    return max(min_lr_ratio, math.sqrt(max(1, warmup_steps) / (step + 1)))


SCHEDULES: dict[str, Callable[[int, int, int, float, float], float]] = {
    "cosine": cosine_factor, "linear": linear_factor, "constant": constant_factor, "wsd": wsd_factor,
    "inverse_sqrt": inverse_sqrt_factor,
}


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


def schedule(cfg: Config, total_steps: int) -> Callable[[int], float]:
    """optim.schedule's multiplier of the peak lr at each optimizer step."""
    o = cfg.optim

    def factor(s: int) -> float:
        return SCHEDULES[o.schedule](s, o.warmup_steps, total_steps, o.min_lr_ratio, o.decay_fraction)
    return factor


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


# ---- one optimizer step ----

@dataclass
class StepResult:
    loss: float  # mean over micro-steps, this rank; with (loss_sum, count) losses, the global sum / global count
    grad_norm: float | None
    finite: bool


@dataclass
class LossOutput:
    """What Task.loss may return instead of a bare loss: the loss (a mean, or a sum with its `count` of terms)
    and the forward's `outputs` (logits, predictions), handed to Task.train_metrics without a second forward."""

    loss: torch.Tensor
    count: Any = None
    outputs: Any = None


def split_loss(out: Any, summed: bool | None) -> tuple[torch.Tensor, Any]:
    """Task.loss's return -> (mean, None), or (loss_sum, count). `summed`: whether the earlier batches of the same
    step or evaluation returned (loss_sum, count); None for the first. One form throughout: a mean and a sum cannot
    be weighted against each other."""
    if isinstance(out, LossOutput):
        out = out.loss if out.count is None else (out.loss, out.count)
    if isinstance(out, tuple) and len(out) != 2:
        raise TypeError(f"Task.loss returned a tuple of {len(out)}; return a scalar mean, or (loss_sum, count)")
    loss, count = out if isinstance(out, tuple) else (out, None)
    if summed is not None and summed != (count is not None):
        forms = ("a scalar mean", "a (loss_sum, count) tuple")
        raise TypeError(f"Task.loss returned {forms[summed]} for one batch and {forms[not summed]} for another of the "
                        f"same step or evaluation; return the same form for every batch")
    return loss, count


def _world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


class TrainMetrics:
    """Task.train_metrics over a logging interval: per-sample values summed on each rank as the micro-batches go
    by, averaged over every sample of every rank at the log step (one all-reduce), reported as train_<name>."""

    def __init__(self, task):
        self.task, self.names, self.sums = task, None, None

    def observe(self, model: nn.Module, batch: dict[str, torch.Tensor], outputs: Any) -> None:
        with torch.no_grad():
            values = self.task.train_metrics(model, batch, outputs)
        if self.names is None:
            self.names = sorted(values)
        # Summed where the values are (no host sync per micro-batch); copied to the host at the log step.
        own = torch.stack([torch.stack([values[n].detach().double().sum(),
                                        values[n].new_tensor(values[n].numel(), dtype=torch.float64)])
                           for n in self.names])
        self.sums = own if self.sums is None else self.sums + own

    def take(self, device: torch.device) -> dict[str, float]:
        """The interval's means, over every rank (each rank calls it at the same log step), then a new interval."""
        if self.names is None:
            return {}
        totals = all_reduce_sum(self.sums.reshape(-1).cpu(), device).reshape(-1, 2)
        self.sums = torch.zeros_like(self.sums)
        return {f"train_{n}": float(s / c) if c else math.nan for n, (s, c) in zip(self.names, totals.tolist())}


def train_step(loss_fn: LossFn, model: nn.Module, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler,
               precision: Precision, micro_batches: list[Any], grad_clip_norm: float | None,
               observe: Callable[[nn.Module, Any, Any], None] | None = None) -> StepResult:
    """Accumulate gradients over `micro_batches`, then one optimizer step.

    The all-reduce (FSDP: reduce-scatter) runs only on the last micro-step (`no_sync`, or FSDP's
    `set_requires_gradient_sync(False)`, on the others); each micro-loss is divided by
    the number of micro-steps so the accumulated gradient equals that of one batch of the combined size.
    A loss_fn returning (loss_sum, count) is instead normalised by the count summed over every micro-batch of every
    rank (one all-reduce; fp16 one more, _fp16_weight), so the step equals one batch of all those terms (tokens)
    whatever their spread.
    Gradients are unscaled before clipping so the clip threshold is in true units under fp16.
    """
    n = len(micro_batches)
    total: torch.Tensor | None = None  # the micro-losses' fp32 sum, left on the device (read once, with the norm)
    sums: torch.Tensor | None = None  # this rank's [loss_sum, count], float64, for the (loss_sum, count) form
    weight = 1.0  # the sums' multiplier before backward: 1, or _fp16_weight
    for i, batch in enumerate(micro_batches):
        sync = i == n - 1
        if hasattr(model, "set_requires_gradient_sync"):
            # FSDP2: no reduce-scatter on the other micro-steps; gradients accumulate unsharded until the last.
            model.set_requires_gradient_sync(sync)
            ctx = contextlib.nullcontext()
        else:
            ctx = model.no_sync() if (not sync and hasattr(model, "no_sync")) else contextlib.nullcontext()
        with ctx:
            with precision.autocast():
                out = loss_fn(model, batch)
                loss, count = split_loss(out, None if i == 0 else sums is not None)
                if observe is not None:  # Task.train_metrics on this forward's outputs
                    observe(model, batch, out.outputs if isinstance(out, LossOutput) else None)
            if count is not None and i == 0 and scaler.is_enabled():
                weight = _fp16_weight(count, loss.device)
            # A sum is not divided by its count here: the global count is known only after every micro-batch of
            # every rank.
            scaler.scale(loss / n if count is None else loss * weight).backward()
        if count is None:
            total = loss.detach().float() if total is None else total + loss.detach().float()
        else:
            own = torch.stack([loss.detach().double().cpu(), torch.as_tensor(count).detach().double().cpu()])
            sums = own if sums is None else sums + own
    if sums is None:
        return _optimizer_step(model, optimizer, scaler, grad_clip_norm, total, loss_divisor=n)
    # Every rank joins the all-reduce, one without terms too; the result is the same everywhere, so is the decision.
    loss_sum, count = all_reduce_sum(sums, loss.device).tolist()
    if count == 0:  # no term on any rank: nothing to average, no step
        optimizer.zero_grad(set_to_none=True)
        return StepResult(math.nan, math.nan, False)
    # DDP and FSDP average the ranks' gradients of their weighted sums: x W / (weight x count) makes that the
    # global mean's.
    return _optimizer_step(model, optimizer, scaler, grad_clip_norm, loss_sum / count,
                           _world_size() / (weight * count))


def _fp16_weight(count: Any, device: torch.device) -> float:
    """1 / the mean count per rank of the step's first micro-batch (one all-reduce), for fp16. A sum's gradients
    are ~count times a mean's: at the GradScaler's initial scale they would overflow for ~log2(count) steps in a
    row, each skipped, and train.max_nonfinite_steps would end the run. The same weight on every rank and
    micro-batch keeps the step exact (train_step divides it out)."""
    world = _world_size()
    total = float(all_reduce_sum(torch.as_tensor(count).detach().double().cpu().reshape(1), device))
    return world / max(total, world)


def _optimizer_step(model: nn.Module, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler,
                    grad_clip_norm: float | None, loss: float | torch.Tensor, grad_factor: float | None = None,
                    loss_divisor: int = 1) -> StepResult:
    """Unscale, multiply the gradients by grad_factor, clip, then step unless the loss (`loss` / `loss_divisor`) or
    the gradients are not finite; the gradients are cleared either way."""
    # The norm is taken after the all-reduce, so every rank sees the same value and takes the same decision.
    # Under FSDP the gradients are DTensor shards: clip_grad_norm_ reduces the shards' norms across ranks, so
    # a NaN/inf in any rank's shard makes the norm non-finite on every rank.
    scaler.unscale_(optimizer)
    if grad_factor is not None:  # before clipping: the threshold is for the true gradient
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        if grads:
            torch._foreach_mul_(grads, grad_factor)  # DTensors under FSDP take it as plain tensors do
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip_norm or float("inf"))
    grad_norm, loss = _read_floats(norm, loss)
    loss = loss / loss_divisor
    if scaler.is_enabled():
        # fp16: the scaler skips steps with inf/NaN gradients and lowers the scale; that counts as not finite.
        scale_before = scaler.get_scale()
        scaler.step(optimizer)
        scaler.update()
        finite = scaler.get_scale() >= scale_before
    else:
        finite = math.isfinite(grad_norm) and math.isfinite(loss)
        if finite:  # never apply NaN/inf gradients: the weights would be lost
            optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return StepResult(loss, grad_norm, finite)


def _read_floats(norm: torch.Tensor, loss: float | torch.Tensor) -> tuple[float, float]:
    """The gradient norm and the loss as Python floats, in one device-to-host copy: each read waits for every
    queued kernel, and a second wait per step (the loss after backward) left a GPU idle while the CPU queued the
    clipping, then the optimizer (benchmarks/README.md, GPU)."""
    if hasattr(norm, "full_tensor"):  # FSDP: a replicated DTensor, the same value on every rank
        norm = norm.full_tensor()
    if not torch.is_tensor(loss):
        return float(norm), loss
    grad_norm, value = torch.stack([norm.float(), loss.float().to(norm.device)]).tolist()
    return grad_norm, value


# ---- evaluation, reduced across ranks ----

class _EvalSums:
    """One set of validation sums: the loss (x rows, or its terms), rows, terms, and each metric's per-sample sum."""

    def __init__(self):
        self.loss, self.rows, self.terms = torch.zeros((), dtype=torch.float64), 0.0, torch.zeros((), dtype=torch.float64)
        self.metrics: dict[str, torch.Tensor] = {}

    def add(self, loss: torch.Tensor, count: Any, n: int, per_sample: dict[str, torch.Tensor]) -> None:
        if count is None:
            self.loss += loss.detach().double().cpu() * n
        elif n:  # a padding batch's sum is of a real row's terms
            self.loss += loss.detach().double().cpu()
            self.terms += torch.as_tensor(count).detach().double().cpu()
        self.rows += n
        for name, values in per_sample.items():
            total = values.detach().double().reshape(-1)[:n].sum().cpu()
            self.metrics[name] = self.metrics.get(name, torch.zeros((), dtype=torch.float64)) + total

    def vector(self, names: list[str]) -> list[torch.Tensor]:
        zero = torch.zeros((), dtype=torch.float64)
        return [self.loss, torch.tensor(self.rows, dtype=torch.float64), self.terms,
                *(self.metrics.get(n, zero) for n in names)]


def _means(reduced: list[float], names: list[str], summed: bool | None, suffix: str = "") -> dict[str, float]:
    count = max(reduced[1], 1.0)
    val_loss = (reduced[0] / reduced[2] if reduced[2] else 0.0) if summed else reduced[0] / count
    return {f"val_loss{suffix}": val_loss} | {f"val_{n}{suffix}": v / count for n, v in zip(names, reduced[3:])}


@torch.no_grad()
def evaluate(task, model: nn.Module, precision: Precision, batches, device: torch.device,
             groups: tuple[str, ...] = ()) -> dict[str, float]:
    """val_loss (task.loss) and val_<name> (task.metrics, per sample) over this rank's rows, then summed across
    ranks so every rank returns the mean over every validation sample; a task.loss returning (loss_sum, count)
    gives the mean over every term (token) instead. `batches` yields (batch, rows) or (batch, rows, group): a batch
    with 0 rows only keeps the ranks' forwards in step (FSDP all-gathers in every forward) and counts for nothing.
    With `groups` (data.val's sources), each batch's group also gets its own means, val_loss/<group> and
    val_<name>/<group>, reduced in the same all-reduce."""
    was_training = model.training
    model.eval()
    total, parts = _EvalSums(), [_EvalSums() for _ in groups]
    summed: bool | None = None
    for batch, n, *group in batches:
        with precision.autocast():
            loss, count = split_loss(task.loss(model, batch), summed)
            per_sample = task.metrics(model, batch)
        summed = count is not None
        total.add(loss, count, n, per_sample)
        if group and group[0] is not None:
            parts[group[0]].add(loss, count, n, per_sample)
    if was_training:
        model.train()
    names = sorted(total.metrics)  # every rank ran the task's metrics at least once: the same names, in the same order
    width = 3 + len(names)
    reduced = all_reduce_sum(torch.stack([x for sums in (total, *parts) for x in sums.vector(names)]), device).tolist()
    out = _means(reduced[:width], names, summed)
    for i, name in enumerate(groups, 1):
        out |= _means(reduced[i * width:(i + 1) * width], names, summed, f"/{name}")
    return out


def all_reduce_sum(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        # NCCL needs CUDA tensors; gloo takes CPU tensors. float64 survives the round trip exactly enough.
        buf = t.to(device) if device.type == "cuda" else t.clone()
        dist.all_reduce(buf)
        return buf.cpu()
    return t


def all_reduce_mean(value: float, device: torch.device) -> float:
    return all_reduce_mean_many([value], device)[0]


def all_reduce_mean_many(values: list[float], device: torch.device) -> list[float]:
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    return [float(v) / world for v in all_reduce_sum(torch.tensor(values, dtype=torch.float64), device)]
