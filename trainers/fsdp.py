"""`train.strategy: fsdp`: shard parameters, gradients and optimizer state across workers with PyTorch's FSDP2.

`fully_shard` is applied bottom-up: each of the task's repeated blocks (`Task.blocks`: char_gpt's transformer
blocks, the MLP's hidden Linears, a user model's layers) is one group whose parameters are all-gathered for its
forward/backward and freed afterwards, then the root takes what is left (embeddings, final norm, a tied head). Every parameter becomes a DTensor
sharded on dim 0 over the data-parallel mesh, so a worker holds 1/world_size of the weights, of their gradients
(reduce-scattered instead of all-reduced) and of the AdamW moments (the optimizer is built on the shards).

Checkpoints are sharded (trainers/run/checkpointing.py: every rank writes its DTensor shards with DCP).
`full_state_dict` gathers the full model and optimizer state on rank 0, as the format before DCP saved it:
benchmarks/checkpoint_bench.py measures that against DCP.

`train.strategy: hsdp` (hybrid sharding) lays the same units over a 2-D mesh: groups of `train.fsdp.shard_size` ranks
each shard one copy of the model, and the groups are replicas of each other. All-gathers and reduce-scatters stay
inside a group (a node, where the links are fast); only one all-reduce of each gradient shard per step crosses
groups. `plan_mesh` places each group on one node whenever the cluster allows it (the ranks sorted by node), and says
which groups span nodes when it does not.

`train.fsdp.offload: cpu` keeps parameters, gradients and optimizer state on the CPU between uses (FSDP2's
CPUOffloadPolicy): each unit's parameters are copied to the device for its forward and backward, and the optimizer
steps on the CPU.

Plain PyTorch, no Ray: the loop calls these on Ray Train and under torchrun alike, after the process group is
up.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn

__all__ = ["Mesh", "full_state_dict", "is_sharded", "local_param_bytes", "plan_mesh", "shard_model"]


@dataclass(frozen=True)
class Mesh:
    """Which ranks shard one copy of the model together: `groups[i]` is replica i's ranks, in shard order. fsdp is
    one group of every rank; hsdp several groups of `shard_size`."""

    strategy: str  # "fsdp" | "hsdp"
    groups: tuple[tuple[int, ...], ...]
    notes: tuple[str, ...] = field(default=(), compare=False)  # what start-up says about the layout (rank 0 logs)

    @classmethod
    def flat(cls, world_size: int) -> "Mesh":
        """fsdp: every rank shards the one copy."""
        return cls("fsdp", (tuple(range(world_size)),))

    @property
    def shard_size(self) -> int:
        return len(self.groups[0])

    @property
    def replicas(self) -> int:
        return len(self.groups)

    def device_mesh(self, device_type: str):
        """The DeviceMesh fully_shard takes: 1-D over the group, or 2-D (replicate, shard). A collective: every rank
        builds the same one (new process groups)."""
        from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

        if self.strategy == "fsdp":
            return init_device_mesh(device_type, (self.shard_size,))
        return DeviceMesh(device_type, torch.tensor(self.groups, dtype=torch.int), mesh_dim_names=("replicate", "shard"))

    def summary(self, nodes: list[str]) -> dict[str, Any]:
        return {"strategy": self.strategy, "shard_size": self.shard_size, "replicas": self.replicas,
                "groups": [list(g) for g in self.groups],
                "group_nodes": [sorted({nodes[r] for r in g}) for g in self.groups]}


def plan_mesh(strategy: str, shard_size: int | None, nodes: list[str]) -> Mesh:
    """The mesh for ranks whose nodes are `nodes` (rank -> node id). hsdp: groups of `shard_size` ranks (None: the
    most workers any node holds), each on one node whenever the nodes' rank counts allow: ranks are taken node by
    node (in each node's first rank's order), so a group spans nodes only where a node's ranks do not fill whole
    groups, and a note says which. A size that does not divide the ranks (an elastic resize, auto workers) becomes
    the largest that does, with a note."""
    world = len(nodes)
    if strategy == "fsdp":
        return Mesh.flat(world)
    wanted = shard_size or max(Counter(nodes).values())
    size = max(d for d in range(1, min(wanted, world) + 1) if world % d == 0)
    notes = []
    if size != wanted:
        what = f"train.fsdp.shard_size ({wanted})" if shard_size else f"the workers per node ({wanted})"
        notes.append(f"{what} does not divide the {world} workers: shard groups of {size} ranks")
    first = {n: i for i, n in reversed(list(enumerate(nodes)))}
    order = sorted(range(world), key=lambda r: (first[nodes[r]], r))
    groups = tuple(tuple(order[i:i + size]) for i in range(0, world, size))
    for i, g in enumerate(groups):
        if len(spans := sorted({nodes[r] for r in g}, key=first.get)) > 1:
            notes.append(f"shard group {i} (ranks {', '.join(map(str, g))}) spans nodes {', '.join(spans)}: its "
                         f"all-gathers and reduce-scatters cross nodes; train.fsdp.shard_size={min(Counter(nodes).values())} "
                         f"or fewer keeps each group on one node")
    return Mesh("hsdp", groups, tuple(notes))


def shard_model(model: nn.Module, units: list[nn.Module], device: torch.device, mesh: Mesh,
                param_dtype: torch.dtype | None, offload: bool = False) -> nn.Module:
    """Apply FSDP2 in place (each unit, then the root) over `mesh` and return the model. The units are the task's
    repeated blocks (Task.blocks).

    `param_dtype` (bf16 or None): the MixedPrecisionPolicy's compute dtype; gradients are reduced in fp32 and the
    sharded master weights and optimizer state stay fp32. `offload`: they stay on the CPU, pinned where a GPU
    copies from them."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    if device.type == "cuda":
        torch.cuda.set_device(device)
    mp = (MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32) if param_dtype is not None
          else MixedPrecisionPolicy())
    options = {"mesh": mesh.device_mesh(device.type), "mp_policy": mp,
               "offload_policy": CPUOffloadPolicy(pin_memory=device.type == "cuda") if offload else OffloadPolicy()}
    for unit in units:
        fully_shard(unit, **options)
    fully_shard(model, **options)
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


def state_devices(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, list[str]]:
    """The device types that hold this rank's parameters and optimizer state (train.fsdp.offload=cpu: the CPU)."""
    params = {_local(p).device.type for p in model.parameters()}
    state = {_local(v).device.type for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)}
    return {"parameters": sorted(params), "optimizer_state": sorted(state)}


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
