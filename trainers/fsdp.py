"""`train.strategy: fsdp`: shard parameters, gradients and optimizer state across workers with PyTorch's FSDP2.

`fully_shard` is applied bottom-up: each of the task's repeated blocks (`Task.blocks`: char_gpt's transformer
blocks, the MLP's hidden Linears, a user model's layers) is one group whose parameters are all-gathered for its
forward/backward and freed afterwards, then the root takes what is left (embeddings, final norm, a tied head). Every parameter becomes a DTensor
sharded on dim 0 over the data-parallel mesh, so a worker holds 1/world_size of the weights, of their gradients
(reduce-scattered instead of all-reduced) and of the AdamW moments (the optimizer is built on the shards).

Checkpoints are sharded (trainers/run/checkpointing.py: every rank writes its DTensor shards with DCP).
`full_state_dict` gathers the full model and optimizer state on rank 0, as the format before DCP saved it:
benchmarks/checkpoint_bench.py measures that against DCP.

Plain PyTorch, no Ray: the loop calls these on Ray Train and under torchrun alike, after the process group is
up.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.nn as nn

__all__ = ["full_state_dict", "is_sharded", "local_param_bytes", "shard_model"]


def shard_model(model: nn.Module, units: list[nn.Module], device: torch.device, world_size: int,
                param_dtype: torch.dtype | None) -> nn.Module:
    """Apply FSDP2 in place (each unit, then the root) over all `world_size` ranks and return the model. The units
    are the task's repeated blocks (Task.blocks).

    `param_dtype` (bf16 or None): the MixedPrecisionPolicy's compute dtype; gradients are reduced in fp32 and the
    sharded master weights and optimizer state stay fp32."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if device.type == "cuda":
        torch.cuda.set_device(device)
    mesh = init_device_mesh(device.type, (world_size,))
    mp = (MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32) if param_dtype is not None
          else MixedPrecisionPolicy())
    for unit in units:
        fully_shard(unit, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return model


# ---- building a model that no rank holds whole: parameters on the meta device, sharded, then materialised ----

@contextlib.contextmanager
def params_on_meta():
    """Parameters created inside are moved to the meta device as they are registered (one at a time: the largest
    parameter is the most ever allocated); buffers stay real, so that what a model computes at build time (a causal
    mask, rotary tables) survives `materialize`. Tied parameters stay tied (the second registration is the same
    meta parameter). Accelerate's init_empty_weights(include_buffers=False) does the same."""
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(module, name, param)
        if param is not None and param.device.type != "meta":
            module._parameters[name] = type(param)(param.to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def materialize(model: nn.Module, device: torch.device) -> None:
    """Allocate a sharded meta model's parameters on `device` (each rank its shards, uninitialised) and keep the
    buffers as built (to_empty would leave them uninitialised too)."""
    buffers = {name: b for name, b in model.named_buffers() if b.device.type != "meta"}
    model.to_empty(device=device)
    with torch.no_grad():
        for name, b in buffers.items():
            model.get_buffer(name).copy_(b)


def broadcast_full_model(model: nn.Module, full: nn.Module | None, rank: int) -> None:
    """Fill a sharded, materialised model from rank 0's full model (`full`, None elsewhere), tensor by tensor: the
    other ranks never hold more than one full tensor. A collective."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    state = full.state_dict() if rank == 0 else {}
    set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))


def is_sharded(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def reshard(model: nn.Module) -> None:
    """Free the root's unsharded parameters left after a forward without backward (evaluation): afterwards every
    registered parameter is a shard again."""
    if is_sharded(model):
        model.reshard()


# ---- what a worker holds ----

def _local(p: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return p.to_local() if isinstance(p, DTensor) else p


def local_param_bytes(model: nn.Module) -> int:
    """Bytes of parameters this worker stores: the local shards under FSDP, the whole model otherwise."""
    return sum(_local(p).numel() * p.element_size() for p in model.parameters())


def full_param_checksum(model: nn.Module) -> float:
    """Sum of the full parameters (gathered from the shards under FSDP: a collective, every rank calls it), in
    the same order and precision as the DDP checksum so the two are comparable."""
    from torch.distributed.tensor import DTensor

    reshard(model)
    total = torch.zeros((), dtype=torch.float64)
    with torch.no_grad():
        for p in model.parameters():
            full = p.full_tensor() if isinstance(p, DTensor) else p
            total += full.detach().double().sum().cpu()
    return float(total)


# ---- the full state on rank 0 (benchmarks/checkpoint_bench.py's baseline) ----

def full_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict[str, Any], dict[str, Any]]:
    """Full (unsharded) model and optimizer state on rank 0, on CPU; empty dicts on the other ranks.
    A collective: every rank must call it. The optimizer state is keyed by parameter names."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    reshard(model)
    return get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
