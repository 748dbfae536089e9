"""The training step, evaluation and precision: plain PyTorch, no Ray (the optimizer and its schedule: optim.py).

The same functions run under Ray Train (trainers/loop.py) and under `torchrun` (trainers/torchrun.py).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn

# The public names (benchmarks/ and users import only these; tests/test_bench_imports.py checks benchmarks/).
__all__ = ["LossFn", "LossOutput", "Precision", "StepResult", "ddp_options", "evaluate", "read_many",
           "resolve_precision", "skip_nonfinite_step", "train_step"]

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
    """train.precision on one device: the autocast a forward runs under and the GradScaler a step uses
    (`Precision.create("bf16", device)`); `sharded` under FSDP."""

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


# ---- data parallel ----

def ddp_options(model: nn.Module) -> dict[str, bool]:
    """DistributedDataParallel's settings for `model`, the same on both launchers (torchrun's DDP, Ray's
    prepare_model): gradients are views into DDP's all-reduce buckets (no copy of every gradient after each
    all-reduce, one gradient's memory less), and the buffers are broadcast from rank 0 before every forward only when
    the model has buffers."""
    return {"gradient_as_bucket_view": True, "broadcast_buffers": any(True for _ in model.buffers())}


# ---- one optimizer step ----

@dataclass
class StepResult:
    """What train_step returns, left on the device: the step's loss, its gradient norm and whether both were finite
    (0-d tensors). Reading them waits for the step's kernels, so the loop reads them at log, evaluation and
    checkpoint steps only, all at once (`read`, `read_many`)."""

    loss: torch.Tensor  # mean over micro-steps, this rank; with (loss_sum, count) losses, the global sum / global count
    grad_norm: torch.Tensor
    finite: torch.Tensor  # bool: the loss and gradients were finite (applied, unless train.spike skipped it)
    group_norms: torch.Tensor | None = None  # with parameter groups: each group's gradient norm before clipping
    spike: torch.Tensor | None = None  # with train.spike: [spike (0/1), the window's median, the figure]

    def read(self) -> tuple[float, float, bool]:
        """(loss, grad_norm, finite) as Python values: one device-to-host copy."""
        return read_many([self])[0]


def read_many(results: list[StepResult]) -> list[tuple[float, float, bool]]:
    """(loss, grad_norm, finite) of every result, in one device-to-host copy: each read waits for every kernel queued
    before it, so a loop that read every step left the GPU idle while the CPU queued the next step."""
    if not results:
        return []
    norms = [r.grad_norm.full_tensor() if hasattr(r.grad_norm, "full_tensor") else r.grad_norm for r in results]
    device = norms[0].device
    rows = torch.stack([torch.stack([r.loss.detach().float().to(device), n.detach().float(),
                                     r.finite.float().to(device)]) for r, n in zip(results, norms)])
    return [(loss, norm, bool(ok)) for loss, norm, ok in rows.tolist()]


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


class SpikeGuard:
    """train.spike on the device: a step whose figure (the loss averaged over the ranks, or the gradient norm before
    clipping, the same on every rank) exceeds `factor` x the median of the last `window` steps' figures is a spike,
    once the window holds MIN_HISTORY of them; with `skip` its update is dropped as a non-finite step's is. Every rank
    takes the same decision; spikes (and non-finite figures) never enter the window. Nothing is read: the verdict
    goes back in StepResult.spike and the loop reads it with the loss at the next log step."""

    MIN_HISTORY = 10

    def __init__(self, figure: str, window: int, factor: float, skip: bool):
        self.figure, self.factor, self.skip = figure, factor, skip
        self.window, self.slot = window, 0
        self.values: torch.Tensor | None = None

    def judge(self, loss: torch.Tensor, norm: torch.Tensor) -> torch.Tensor:
        figures = {"grad_norm": lambda: norm, "train_loss": lambda: all_reduce_sum_here(loss.float()) / _world_size()}
        x = figures[self.figure]().detach().float().reshape(())
        if self.values is None:
            self.values = torch.full((self.window,), float("nan"), device=x.device)
        median = torch.nanmedian(self.values)
        known = (~torch.isnan(self.values)).sum() >= min(self.MIN_HISTORY, self.window)
        spike = known & torch.isfinite(x) & (x > self.factor * median)
        self.values[self.slot] = torch.where(spike | ~torch.isfinite(x), self.values[self.slot], x)
        self.slot = (self.slot + 1) % self.window
        return torch.stack([spike.float(), median, x])


def train_step(loss_fn: LossFn, model: nn.Module, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler,
               precision: Precision, micro_batches: list[Any], grad_clip_norm: float | None,
               observe: Callable[[nn.Module, Any, Any], None] | None = None,
               groups: list[list[nn.Parameter]] | None = None, guard: SpikeGuard | None = None) -> StepResult:
    """Accumulate gradients over `micro_batches`, then one optimizer step.

    The all-reduce (FSDP: reduce-scatter) runs only on the last micro-step (`no_sync`, or FSDP's
    `set_requires_gradient_sync(False)`, on the others); each micro-loss is divided by
    the number of micro-steps so the accumulated gradient equals that of one batch of the combined size.
    A loss_fn returning (loss_sum, count) is instead normalised by the count summed over every micro-batch of every
    rank (one all-reduce; fp16 one more, _fp16_weight), so the step equals one batch of all those terms (tokens)
    whatever their spread.
    Gradients are unscaled before clipping so the clip threshold is in true units under fp16. `groups` (optim.groups'
    parameters): each group's gradient norm as well, from the same pass as the total's.
    """
    n = len(micro_batches)
    total: torch.Tensor | None = None  # the micro-losses' fp32 sum, left on the device (read once, with the norm)
    sums: torch.Tensor | None = None  # this rank's [loss_sum, count], float64, for the (loss_sum, count) form
    weight = torch.ones((), dtype=torch.float64)  # the sums' multiplier before backward: 1, or _fp16_weight
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
            scaler.scale(loss / n if count is None else loss * weight.to(loss.dtype)).backward()
        if count is None:
            total = loss.detach().float() if total is None else total + loss.detach().float()
        else:  # float64 where the loss is: summed over micro-batches and ranks without a read
            own = torch.stack([loss.detach().double(), _on(count, loss.device).double()])
            sums = own if sums is None else sums + own
    if sums is None:
        return _optimizer_step(model, optimizer, scaler, grad_clip_norm, total.double() / n, groups=groups,
                               guard=guard)
    # Every rank joins the all-reduce, one without terms too; the result is the same everywhere, so is the decision.
    loss_sum, count = all_reduce_sum_here(sums)
    # DDP and FSDP average the ranks' gradients of their weighted sums: x W / (weight x count) makes that the
    # global mean's. No term on any rank (count 0): the factor and the loss are not finite, so the step is skipped.
    return _optimizer_step(model, optimizer, scaler, grad_clip_norm, loss_sum / count,
                           _world_size() / (weight * count), groups, guard)


def _on(value: Any, device: torch.device) -> torch.Tensor:
    """A count (a Python number or a tensor) as a tensor on `device`: a host-to-device copy at most, never a read."""
    return torch.as_tensor(value).detach().to(device, non_blocking=True)


def _fp16_weight(count: Any, device: torch.device) -> torch.Tensor:
    """1 / the mean count per rank of the step's first micro-batch (one all-reduce), for fp16. A sum's gradients
    are ~count times a mean's: at the GradScaler's initial scale they would overflow for ~log2(count) steps in a
    row, each skipped, and train.max_nonfinite_steps would end the run. The same weight on every rank and
    micro-batch keeps the step exact (train_step divides it out)."""
    world = _world_size()
    total = all_reduce_sum_here(_on(count, device).double().reshape(1))[0]
    return world / total.clamp(min=world)


def group_grad_norms(groups: list[list[nn.Parameter]]) -> tuple[torch.Tensor, torch.Tensor]:
    """(each group's gradient norm, the norm of them all), on the gradients' device; under FSDP reduced across the
    ranks (one small all-reduce per group), so every rank holds the same values. The total is the norm of the group
    norms: what clip_grad_norm_ computes over all the parameters, up to float rounding."""
    from torch.distributed.tensor import DTensor

    norms = []
    for params in groups:
        grads = [p.grad for p in params if p.grad is not None]
        norm = torch.nn.utils.get_total_norm(grads) if grads else None
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    device = next((n.device for n in norms if n is not None), torch.device("cpu"))
    norms = torch.stack([n if n is not None else torch.zeros((), device=device) for n in norms])
    return norms, torch.linalg.vector_norm(norms)


def _optimizer_step(model: nn.Module, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler,
                    grad_clip_norm: float | None, loss: torch.Tensor,
                    grad_factor: torch.Tensor | None = None,
                    groups: list[list[nn.Parameter]] | None = None, guard: SpikeGuard | None = None) -> StepResult:
    """Unscale, multiply the gradients by grad_factor, clip, then step unless the loss or the gradients are not
    finite; the gradients are cleared either way. Decided on the device (skip_nonfinite_step): nothing here waits for
    the GPU."""
    # The norm is taken after the all-reduce, so every rank sees the same value and takes the same decision.
    # Under FSDP the gradients are DTensor shards: clip_grad_norm_ reduces the shards' norms across ranks, so
    # a NaN/inf in any rank's shard makes the norm non-finite on every rank.
    scaler.unscale_(optimizer)
    if grad_factor is not None:  # before clipping: the threshold is for the true gradient
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        if grads:
            # in the gradients' dtype, as a Python number's would be; DTensors under FSDP take it as plain tensors do
            torch._foreach_mul_(grads, grad_factor.to(grads[0].device, grads[0].dtype))
    group_norms = None
    if groups:
        group_norms, norm = group_grad_norms(groups)
        torch.nn.utils.clip_grads_with_norm_(model.parameters(), grad_clip_norm or float("inf"), norm)
    else:
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip_norm or float("inf"))
    local_norm = norm.to_local() if hasattr(norm, "to_local") else norm  # FSDP: replicated, the same on every rank
    spike = guard.judge(loss, local_norm) if guard is not None else None
    if scaler.is_enabled():
        # fp16: the scaler skips steps with inf/NaN gradients (its found_inf, handed to a fused optimizer on the
        # device) and lowers the scale; a lowered scale is a step not taken.
        scale_before = scaler._scale.clone()
        scaler.step(optimizer)
        scaler.update()
        finite = scaler._scale >= scale_before
    else:
        finite = torch.isfinite(local_norm) & torch.isfinite(loss.to(local_norm.device))
        apply = finite & (spike[0] == 0) if spike is not None and guard.skip else finite
        skip_nonfinite_step(optimizer, apply)  # never apply NaN/inf gradients: the weights would be lost
    optimizer.zero_grad(set_to_none=True)
    return StepResult(loss.detach(), norm.detach(), finite, group_norms, spike)


def skip_nonfinite_step(optimizer: torch.optim.Optimizer, finite: torch.Tensor) -> None:
    """optimizer.step() where `finite` (a bool on the device) holds, a skipped step (weights, moments and step count
    as they were) where not. A fused optimizer (AdamW, Adam, SGD with optim.implementation fused, auto's choice on
    CUDA) takes the decision on the device, as GradScaler hands it found_inf; other kernels cannot, so theirs is one
    read of `finite` per step (on CPU, foreach's default there, a read waits for nothing)."""
    if getattr(optimizer, "_step_supports_amp_scaling", False):
        optimizer.found_inf = (~finite).float()
        try:
            optimizer.step()
        finally:
            del optimizer.found_inf
    elif bool(finite):
        optimizer.step()


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
             groups: tuple[str, ...] = (), loss_fn: LossFn | None = None) -> dict[str, float]:
    """val_loss (task.loss) and val_<name> (task.metrics, per sample) over this rank's rows, then summed across
    ranks so every rank returns the mean over every validation sample; a task.loss returning (loss_sum, count)
    gives the mean over every term (token) instead. `batches` yields (batch, rows) or (batch, rows, group): a batch
    with 0 rows only keeps the ranks' forwards in step (FSDP all-gathers in every forward) and counts for nothing.
    With `groups` (data.val's sources), each batch's group also gets its own means, val_loss/<group> and
    val_<name>/<group>, reduced in the same all-reduce. `loss_fn`: the task's loss as training runs it (compiled with
    train.compile=model), task.loss by default."""
    loss_fn = loss_fn or task.loss
    was_training = model.training
    model.eval()
    total, parts = _EvalSums(), [_EvalSums() for _ in groups]
    summed: bool | None = None
    for batch, n, *group in batches:
        with precision.autocast():
            loss, count = split_loss(loss_fn(model, batch), summed)
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


def all_reduce_sum_here(t: torch.Tensor) -> torch.Tensor:
    """The sum of `t` over every rank, left where `t` is (NCCL on the GPU, gloo on the CPU): no read."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        buf = t.clone()
        dist.all_reduce(buf)
        return buf
    return t


def all_reduce_sum(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        # NCCL needs CUDA tensors; gloo takes CPU tensors. float64 survives the round trip exactly enough.
        buf = t.to(device) if device.type == "cuda" else t.clone()
        dist.all_reduce(buf)
        return buf.cpu()
    return t


def all_gather_rows(row: list[float], device: torch.device) -> list[list[float]]:
    """Every rank's `row` (the same length on each), in rank order: one all-reduce of a world x len(row) matrix that
    holds this rank's row and zeros elsewhere."""
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    rank = dist.get_rank() if world > 1 else 0
    rows = torch.zeros(world, len(row), dtype=torch.float64)
    rows[rank] = torch.tensor(row, dtype=torch.float64)
    return all_reduce_sum(rows, device).tolist()


def all_reduce_mean_many(values: list[float], device: torch.device) -> list[float]:
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    return [float(v) / world for v in all_reduce_sum(torch.tensor(values, dtype=torch.float64), device)]
