"""train.ema: an exponential moving average of the weights, held as the parameters are held: a built-in callback.

Each parameter gets a shadow copy made like it (under FSDP a DTensor with the same shards, so no rank holds more of
the average than of the model), updated after every optimizer step with one fused lerp,

    ema <- ema + (1 - decay) * (param - ema)

and saved in the checkpoint beside the model under "ema" (the callback's state_tensors; DCP: any world size reads
its slices on resume). An evaluation with `eval: ema` or `both` swaps the average into the model for the forwards
and puts the trained weights back (evaluation_weights); `stride export --ema` writes it. Plain PyTorch: the same
under Ray and torchrun.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch

from stride.trainers.callbacks.base import Callback, CallbackState


class EMACallback(Callback):
    """train.ema as a callback: the average is made from the model's parameters as the run starts (after init.from
    and a resume), updated after every optimizer step, evaluated as `eval` says, and kept in every checkpoint."""

    tensors_key = "ema"  # its name in the checkpoint's DCP state and meta.json since before callbacks held tensors

    def __init__(self, decay: float, eval: str = "ema"):
        self.decay, self.eval = decay, eval
        self.average: EMA | None = None
        self.restored = False

    def of(self, model: torch.nn.Module) -> EMA:
        """The average of `model`'s parameters, made at the first call (a copy of the weights as they are then)."""
        if self.average is None:
            self.average = EMA(model, self.decay)
        return self.average

    def state_tensors(self, state: CallbackState) -> dict[str, torch.Tensor]:
        return self.of(state.model).state_dict()

    def load_state_tensors(self, state: CallbackState, tensors: dict[str, torch.Tensor]) -> None:
        self.restored = True  # DCP filled the shadow tensors in place

    def on_fit_start(self, state: CallbackState) -> None:
        if not self.restored:  # a fresh run, or a checkpoint written without train.ema: start at these weights
            self.of(state.model).reset()

    def on_optimizer_step(self, state: CallbackState) -> None:
        self.average.update()

    def evaluation_weights(self, state: CallbackState) -> dict:
        # eval: ema replaces the trained weights' figures; both adds the average's as val_<name>_ema
        if self.eval == "raw":
            return {}
        return {"" if self.eval == "ema" else "_ema": self.of(state.model).swapped_in}


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
