"""optim.schedule's built-in lr schedules, and the one place they are listed: a new built-in schedule is one function
here under `@builtin`. A schedule is a function (step, warmup_steps, total_steps, min_lr_ratio, decay_fraction) -> the
peak lr's multiplier at optimizer step `step` (0-based); each built-in one starts with a linear warm-up.

Standard library only, and no other Stride module: the config's schema (trainers/config.py) validates optim.schedule
against SCHEDULES and describes each entry from here, without importing torch; trainers/optim.py builds the
scheduler from them.
"""

from __future__ import annotations

import math
from typing import Callable

Schedule = Callable[[int, int, int, float, float], float]

SCHEDULES: dict[str, Schedule] = {}  # optim.schedule's built-in names, in the order the docs list them
DESCRIPTIONS: dict[str, str] = {}  # name -> what optim.schedule's description says of it (docs/configuration.md)


def builtin(name: str, description: str) -> Callable[[Schedule], Schedule]:
    """Register the decorated function as optim.schedule=`name`, described in the config's docs by `description`."""
    def register(fn: Schedule) -> Schedule:
        SCHEDULES[name] = fn
        DESCRIPTIONS[name] = description
        return fn
    return register


def _warmup(step: int, warmup_steps: int) -> float:
    return (step + 1) / warmup_steps


@builtin("cosine", "to min_lr_ratio at the last step")
def cosine_factor(step: int, warmup_steps: int, total_steps: int, min_lr_ratio: float, decay_fraction: float = 1.0) -> float:
    """Cosine from the peak to min_lr_ratio at total_steps (Stride's schedule before optim.schedule existed)."""
    if step < warmup_steps:
        return _warmup(step, warmup_steps)
    decay_steps = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


@builtin("linear", "likewise")
def linear_factor(step: int, warmup_steps: int, total_steps: int, min_lr_ratio: float, decay_fraction: float) -> float:
    """A straight line from the peak to min_lr_ratio at total_steps."""
    if step < warmup_steps:
        return _warmup(step, warmup_steps)
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_lr_ratio + (1.0 - min_lr_ratio) * (1.0 - progress)


@builtin("constant", "the peak lr")
def constant_factor(step: int, warmup_steps: int, total_steps: int, min_lr_ratio: float, decay_fraction: float) -> float:
    """The peak lr after the warm-up."""
    return _warmup(step, warmup_steps) if step < warmup_steps else 1.0


@builtin("wsd", "the peak lr, then linear to min_lr_ratio over the last decay_fraction of training")
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


@builtin("inverse_sqrt", "peak x sqrt(warmup_steps / n) at step n, never below min_lr_ratio")
def inverse_sqrt_factor(step: int, warmup_steps: int, total_steps: int, min_lr_ratio: float, decay_fraction: float) -> float:
    """sqrt(warmup_steps / n) at the n-th optimizer step (n = step + 1; warmup_steps=0 counts as 1), so it continues
    the warm-up's peak; never below min_lr_ratio."""
    if step < warmup_steps:
        return _warmup(step, warmup_steps)
    return max(min_lr_ratio, math.sqrt(max(1, warmup_steps) / (step + 1)))
