"""train.ema: an exponential moving average of the weights, held as the parameters are held.

Each parameter gets a shadow copy made like it (under FSDP a DTensor with the same shards, so no rank holds more of
the average than of the model), updated after every optimizer step with one fused lerp,

    ema <- ema + (1 - decay) * (param - ema)

and saved in the checkpoint beside the model under "ema" (DCP: any world size reads its slices on resume). An
evaluation with `eval: ema` or `both` swaps the average into the model for the forwards and puts the trained
weights back; `export.py --ema` writes it. Plain PyTorch: the same under Ray and torchrun.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch


class EMA:
    def __init__(self, model: torch.nn.Module, decay: float):
        self.decay = decay
        named = list(model.named_parameters())
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        with torch.no_grad():
            self.shadow = [p.detach().clone() for p in self.params]

    def reset(self) -> None:
        """Start the average at the weights as they are (a fresh run, or a checkpoint written without one)."""
        _copy(self.shadow, self.params)

    def update(self) -> None:
        with torch.no_grad():
            torch._foreach_lerp_(self.shadow, [p.detach() for p in self.params], 1.0 - self.decay)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Name -> this rank's shadow tensor (DCP fills these in place on load)."""
        return dict(zip(self.names, self.shadow))

    def swap(self) -> None:
        """Exchange the average and the weights in the model's parameters (twice: as they were)."""
        _swap(self.params, self.shadow)

    @contextmanager
    def swapped_in(self) -> Iterator[None]:
        """The average in the model's parameters for the block; the trained weights back afterwards, bitwise.
        Exchanged tensor by tensor, so the swap holds one parameter's copy at a time, not a second model."""
        _swap(self.params, self.shadow)
        try:
            yield
        finally:
            _swap(self.params, self.shadow)


def _swap(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    with torch.no_grad():
        for x, y in zip(a, b):
            kept = x.detach().clone()
            x.detach().copy_(y.detach())
            y.detach().copy_(kept)


def _copy(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    with torch.no_grad():
        for d, s in zip(dst, src):
            d.detach().copy_(s.detach())
