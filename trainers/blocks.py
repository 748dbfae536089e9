"""What the loop does to a task's repeated blocks (Task.blocks, the units FSDP shards): activation checkpointing and
torch.compile. Applied in torchtitan's order, before FSDP wraps them: checkpointing, then compile, then fully_shard.

train.compile=model compiles the task's loss with the model in it instead (compile_loss), after DDP wraps it.

Both change how a block runs, never its parameters or their names, so checkpoints, export and resharding see the same
model with either switch on or off.

Plain PyTorch, no Ray: the loop calls these on Ray Train and under torchrun alike.
"""

from __future__ import annotations

import functools
from contextlib import contextmanager
from typing import Callable

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from stride.errors import TrainingError

__all__ = ["checkpoint_activations", "compile_blocks", "compile_loss"]


def checkpoint_activations(blocks: list[nn.Module], every: int = 1) -> int:
    """Recompute the activations of every `every`-th block in the backward pass instead of keeping them: the block's
    forward runs under torch.utils.checkpoint (non-reentrant), like torchtitan's checkpoint wrapper but without a
    wrapper module, so parameter names stay as they are. Under FSDP2 the block's parameters are all-gathered again for
    the recomputation (its pre-backward hook runs first); random ops (dropout) replay the same draws, so losses equal
    the unchecked run's; torch.compile (compile_blocks, applied after) traces the checkpoint as one region. Returns
    how many blocks."""
    chosen = blocks[::every]
    for block in chosen:
        block.forward = functools.partial(_recomputed, block.forward)
    return len(chosen)


def _recomputed(forward, *args, **kwargs):
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def compile_blocks(model: nn.Module, blocks: list[nn.Module], mode: str) -> int:
    """torch.compile each block's forward (or the whole model's, when the task names no blocks). Only `forward` is
    compiled: the module, its parameters and their names stay as they are, and the hooks around it (FSDP's
    all-gathers, activation checkpointing) run outside the compiled code, as with torchtitan's per-block compile
    before fully_shard. Blocks of one type share their compiled code (dynamo caches by code object and guards).
    Compilation happens at the first forward of training and of evaluation. Returns how many modules."""
    targets = blocks or [model]
    for module in targets:
        module.forward = torch.compile(module.forward, mode=None if mode == "default" else mode)
    return len(targets)


def compile_loss(loss_fn: Callable, mode: str) -> Callable:
    """train.compile=model: `loss_fn(model, batch)` (Task.loss) as one compiled function, so the embedding, every
    block, the head and the loss are one graph with one set of guards (nanoGPT compiles its model with the loss in
    it). Called with the DDP-wrapped model, dynamo splits the graph at DDP's buckets (its DDPOptimizer), so the
    all-reduces still overlap the backward."""
    return torch.compile(loss_fn, mode=None if mode == "default" else mode)


@contextmanager
def compile_errors(setting: str):
    """A failure inside torch.compile (no C++ compiler for inductor on CPU, an op it cannot trace) becomes one line
    naming the setting to turn off."""
    if setting == "off":
        yield
        return
    from torch._dynamo.exc import TorchDynamoException

    try:
        yield
    except TorchDynamoException as e:
        reason = next((ln.strip() for ln in str(e).splitlines() if ln.strip()), type(e).__name__)[:300]
        raise TrainingError(f"train.compile={setting} failed ({type(e).__name__}: {reason}); set train.compile=off, or "
                            f"another train.compile_mode") from None
