"""Hybrid sharding (train.strategy: hsdp, issue 47) beside ddp and fsdp on the same 4 ranks: what each rank holds,
and what it sends to the ranks outside its shard group.

    python benchmarks/run.py --only hsdp
    python benchmarks/hsdp_bench.py [REPS] [--smoke]   # alone: the raw runs as JSON

One `torch.distributed.run --standalone --nproc-per-node 4` launch of this file (gloo on CPU, one torch thread per
rank) trains the same char_gpt (stride.trainers.models.CharGPT, MODEL: 16 blocks of width 512, context 64, tied
embeddings, fp32: 50.6M parameters) under three strategies, one after the other, each a fresh model from one seed:

* ddp: torch's DistributedDataParallel over the 4 ranks;
* fsdp: Stride's fsdp.shard_model over fsdp.Mesh.flat(4): each transformer block one FSDP2 unit (the task's blocks,
  CharGPTTask.blocks), then the root;
* hsdp: the same over fsdp.plan_mesh("hsdp", 2, nodes), the ranks laid out as on two nodes of two workers: shard
  groups {0, 1} and {2, 3}, each a replica of the other.

AdamW over the (sharded) parameters; a step is a forward and backward of a cross-entropy loss on a batch of random
tokens (BATCH sequences of the context, the same per rank and step under every strategy), then AdamW's step. One
warm-up step (AdamW makes its state, FSDP2 its lazy init), then `reps` measured steps, a sample each. Per rank and
measured step:

* held: bytes of the rank's parameters (their local shards, DTensor.to_local(), under fsdp and hsdp), of their
  gradients (after AdamW's step, before zero_grad) and of AdamW's state tensors. Tensor sizes, not the process's
  memory: DDP's gradient buckets, the parameters FSDP2 all-gathers for a unit and frees after it, and activations are
  not counted.
* sent: torch.distributed's collectives wrapped for the step (the module's attributes, which FSDP2 looks up at each
  call: torch 2.13's _fsdp_collectives calls `dist.all_gather_single`, `dist.reduce_scatter_single` and
  `dist.all_reduce`; all_gather_into_tensor and reduce_scatter_tensor, the older names, are wrapped too). Each call's
  group (get_process_group_ranks) and tensor bytes become bytes sent to each other member of the group by a model
  that does not depend on the backend's algorithm: an all-gather of an input of b bytes over n ranks sends b to each
  other member; a reduce-scatter of an input of N bytes, N/n to each; an all-reduce of N bytes, 2N/n to each (a
  reduce-scatter, then an all-gather). What goes to ranks outside the rank's shard group ({0, 1} or {2, 3}, under
  fsdp too) is summed. The worker fails unless the wrapper saw every gradient reduce-scattered (the inputs add up to
  the parameters' bytes at least) and, under hsdp, all-reduced across the replicas. DDP's all-reduces run in its C++
  reducer, out of the wrapper's sight: ddp's traffic is not counted, and no figure needs it.

By arithmetic (P: the fp32 parameters' bytes): under fsdp each rank sends its P/4 shard to the 2 ranks of the other
group in the forward's all-gathers and again in the backward's (except the root's, which FSDP2 keeps gathered
between forward and backward: 0.3% of P here), and N/4 of each unit's N bytes of gradients to each of them in the
reduce-scatters: ~1.5 P. Under hsdp the all-gathers and reduce-scatters stay in the group, and the all-reduce of the
P/2 gradient shard over the 2 replicas sends 2 (P/2) / 2 = P/2 to the other: ~0.5 P, a ratio of ~0.33. Held: ddp
holds P of parameters, P of gradients and 2 P of AdamW moments; hsdp half of each.

benchmarks/figures.py makes hsdp_param_memory_ratio (hsdp's held bytes / ddp's) and hsdp_cross_group_bytes_ratio
(hsdp's bytes to the other group / fsdp's), each of the largest rank, a sample per measured step. Both are counts of
bytes, the same at every steady step: the samples say so, they are not noise.
"""

from __future__ import annotations

import functools
import inspect
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.append(str(REPO))  # appended: the repository's datasets/ must not hide Hugging Face's `datasets`

from benchmarks.procs import clean_env  # noqa: E402

WORLD, SHARD_SIZE = 4, 2
MODEL = {"layers": 16, "width": 512, "heads": 8, "context": 64, "vocab": 256}  # 50.6M parameters
SMOKE_MODEL = {"layers": 2, "width": 64, "heads": 4, "context": 16, "vocab": 256}
BATCH = 2  # sequences per rank and step: the step's collectives do not depend on it, its time does
STRATEGIES = ("ddp", "fsdp", "hsdp")
SEED = 0

# op name -> (the tensor argument whose bytes count, the bytes sent to each other member: f(bytes, group size))
COLLECTIVES = {
    "all_gather_single": ("input_tensor", lambda b, n: b),
    "all_gather_into_tensor": ("input_tensor", lambda b, n: b),
    "reduce_scatter_single": ("input", lambda b, n: b / n),
    "reduce_scatter_tensor": ("input", lambda b, n: b / n),
    "all_reduce": ("tensor", lambda b, n: 2 * b / n),
}


# ---------------------------------------------------------------- a rank

class CollectiveCounter:
    """While entered, every call of COLLECTIVES through torch.distributed's attributes is counted per op: calls, the
    groups' ranks, tensor bytes, the bytes this rank sends to the group's other members (the model above) and those
    that go to ranks outside `shard_group`."""

    def __init__(self, rank: int, shard_group: tuple[int, ...]):
        self.rank, self.shard_group = rank, set(shard_group)
        self.ops: dict[str, dict] = {}
        self._saved: dict = {}
        self._ranks: dict = {}  # process group -> its global ranks (a lookup per call would add to the step)

    def __enter__(self):
        import torch.distributed as dist

        for name in COLLECTIVES:
            if hasattr(dist, name):
                self._saved[name] = getattr(dist, name)
                setattr(dist, name, self._wrap(name, self._saved[name]))
        return self

    def __exit__(self, *exc):
        import torch.distributed as dist

        for name, fn in self._saved.items():
            setattr(dist, name, fn)

    def _wrap(self, name: str, fn):
        signature = inspect.signature(fn)

        @functools.wraps(fn)
        def counted(*args, **kwargs):
            bound = signature.bind(*args, **kwargs)
            self.record(name, bound.arguments[COLLECTIVES[name][0]], bound.arguments.get("group"))
            return fn(*args, **kwargs)

        return counted

    def group_ranks(self, group) -> tuple[int, ...]:
        import torch.distributed as dist

        key = group if group is not None else dist.group.WORLD
        if key not in self._ranks:
            self._ranks[key] = tuple(dist.get_process_group_ranks(key))
        return self._ranks[key]

    def record(self, name: str, tensor, group) -> None:
        ranks = self.group_ranks(group)
        size = tensor.numel() * tensor.element_size()
        per_peer = COLLECTIVES[name][1](size, len(ranks))
        peers = [r for r in ranks if r != self.rank]
        op = self.ops.setdefault(name, {"calls": 0, "groups": [], "tensor_bytes": 0, "sent_bytes": 0.0,
                                        "cross_group_bytes": 0.0})
        op["calls"] += 1
        if list(ranks) not in op["groups"]:
            op["groups"].append(list(ranks))
        op["tensor_bytes"] += size
        op["sent_bytes"] += per_peer * len(peers)
        op["cross_group_bytes"] += per_peer * sum(1 for r in peers if r not in self.shard_group)


def local(t):
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def nbytes(t) -> int:
    t = local(t)
    return t.numel() * t.element_size()


def held_bytes(model, optimizer) -> dict:
    """The rank's parameters, gradients and optimizer state, in bytes of its local tensors."""
    params = list(model.parameters())
    state = [v for s in optimizer.state.values() for v in s.values() if hasattr(v, "element_size")]
    out = {"param_bytes": sum(nbytes(p) for p in params),
           "grad_bytes": sum(nbytes(p.grad) for p in params if p.grad is not None),
           "optim_bytes": sum(nbytes(v) for v in state)}
    return {**out, "held_bytes": sum(out.values())}


def build(strategy: str, dims: dict, mesh):
    """A fresh char_gpt from SEED under `strategy`, and AdamW over what the rank holds of it."""
    import torch
    from torch.nn.parallel import DistributedDataParallel

    from stride.trainers import fsdp
    from stride.trainers.models import CharGPT

    torch.manual_seed(SEED)
    model = CharGPT(dims["vocab"], dims["context"], dims["layers"], dims["heads"], dims["width"])
    if strategy == "ddp":
        model = DistributedDataParallel(model)
    else:  # Stride's units for char_gpt: its blocks (CharGPTTask.blocks), then the root
        model = fsdp.shard_model(model, list(model.blocks), torch.device("cpu"), mesh, None)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def batch(dims: dict, rank: int, step: int):
    """Random tokens for this rank and step: the same under every strategy."""
    import torch

    g = torch.Generator().manual_seed(SEED * 1_000_003 + rank * 10_007 + step)
    return torch.randint(0, dims["vocab"], (BATCH, dims["context"] + 1), generator=g)


def train_step(model, optimizer, tokens) -> float:
    import torch.nn.functional as F

    logits = model(tokens[:, :-1])
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
    loss.backward()
    optimizer.step()
    return float(loss)


def check_seen(strategy: str, ops: dict, held: dict, mesh) -> None:
    """The wrapper saw FSDP2's traffic: every gradient reduce-scattered (the inputs are the unsharded, padded
    gradients: at least the parameters' bytes times the shard size) and, under hsdp, every shard all-reduced."""
    gathered = sum(ops.get(n, {}).get("calls", 0) for n in ("all_gather_single", "all_gather_into_tensor"))
    scattered = sum(ops.get(n, {}).get("tensor_bytes", 0) for n in ("reduce_scatter_single", "reduce_scatter_tensor"))
    if not gathered or scattered < held["param_bytes"] * mesh.shard_size * 0.99:
        raise RuntimeError(f"hsdp_bench: the wrapper missed FSDP2's collectives under {strategy}: {ops}")
    if mesh.replicas > 1 and ops.get("all_reduce", {}).get("tensor_bytes", 0) < held["param_bytes"] * 0.99:
        raise RuntimeError(f"hsdp_bench: the wrapper missed the all-reduce across replicas under {strategy}: {ops}")


def run_strategy(strategy: str, dims: dict, mesh, rank: int, shard_group: tuple, steps: int) -> list[dict]:
    """One warm-up step, then `steps` measured ones: per measured step, what the rank holds and sends."""
    import gc

    import torch.distributed as dist

    model, optimizer = build(strategy, dims, mesh)
    params = sum(p.numel() for p in model.parameters())  # a DTensor's numel is the whole parameter's
    records = []
    for step in range(steps + 1):
        dist.barrier()
        t0 = time.perf_counter()
        with CollectiveCounter(rank, shard_group) as counter:
            loss = train_step(model, optimizer, batch(dims, rank, step))
        step_s = time.perf_counter() - t0
        held = held_bytes(model, optimizer)
        optimizer.zero_grad(set_to_none=True)
        if step == 0:
            continue  # warm-up: the lazy init's and AdamW's first step are not a steady step's
        if strategy != "ddp":
            check_seen(strategy, counter.ops, held, mesh)
        records.append({"strategy": strategy, "step": step, "rank": rank, "params": params, "loss": loss,
                        "step_s": step_s, **held,
                        "sent_bytes": sum(o["sent_bytes"] for o in counter.ops.values()),
                        "cross_group_bytes": sum(o["cross_group_bytes"] for o in counter.ops.values()),
                        "collectives": counter.ops})
    del model, optimizer
    gc.collect()
    return records


def worker(args) -> None:
    import torch
    import torch.distributed as dist

    from stride.trainers import fsdp

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != WORLD:
        raise SystemExit(f"hsdp_bench: {world} ranks; the figures are for {WORLD}")
    dims = json.loads(args.dims)
    nodes = [f"node{r // SHARD_SIZE}" for r in range(world)]  # as on 2 nodes of 2 workers: the groups are the nodes
    meshes = {"ddp": None, "fsdp": fsdp.Mesh.flat(world), "hsdp": fsdp.plan_mesh("hsdp", SHARD_SIZE, nodes)}
    shard_group = next(g for g in meshes["hsdp"].groups if rank in g)
    records = []
    for strategy in STRATEGIES:
        records += run_strategy(strategy, dims, meshes[strategy], rank, shard_group, args.steps)
    every = [None] * world
    dist.all_gather_object(every, records)
    if rank == 0:
        params = records[0]["params"]
        Path(args.result).write_text(json.dumps({
            "params": params, "param_bytes": params * 4, "world_size": world,
            "groups": [list(g) for g in meshes["hsdp"].groups], "mesh_notes": list(meshes["hsdp"].notes),
            "runs": [r for rank_records in every for r in rank_records]}))
    leave_process_group()


def leave_process_group() -> None:
    """As trainers/torchrun.py ends a rank (benchmarks/finetune_bench.py: gloo's threads torn down unjoined at the
    interpreter's finalization aborted launches): the group destroyed while the interpreter is alive, then
    os._exit in main."""
    import gc

    import torch.distributed as dist

    gc.collect()
    dist.destroy_process_group()


# ---------------------------------------------------------------- the launch

def measure(reps: int = 5, smoke: bool = False, timeout_s: int = 600) -> dict:
    """One launch of WORLD ranks, `reps` measured steps per strategy. Returns the raw runs (figures.hsdp_figures
    makes the figures)."""
    dims = SMOKE_MODEL if smoke else MODEL
    tmp = Path(tempfile.mkdtemp(prefix="stride-hsdp-bench-"))
    started = datetime.now().isoformat(timespec="seconds")
    failed: list = []
    t0 = time.perf_counter()
    try:
        result = tmp / "result.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(WORLD),
               str(Path(__file__).resolve()), "--worker", "--dims", json.dumps(dims), "--steps", str(reps),
               "--result", str(result)]
        load_before = os.getloadavg()
        for attempt in (1, 2):  # gloo crashed once in checkpoint_bench's launches here: retry once, recorded
            r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout_s,
                               env=dict(clean_env(), OMP_NUM_THREADS="1"))
            if r.returncode == 0 and result.exists():
                break
            failed.append({"exit": r.returncode, "stderr_tail": r.stderr[-1500:]})
            if attempt == 2:
                raise RuntimeError(f"hsdp_bench failed (exit {r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
        one = json.loads(result.read_text())
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"hsdp_bench: {reps} measured step(s) per strategy in {time.perf_counter() - t0:.0f}s", flush=True)
    return {"started": started, "cpu_count": os.cpu_count(), "model": dims, "batch": BATCH, "shard_size": SHARD_SIZE,
            "steps": reps, "warmup_steps": 1, "strategies": list(STRATEGIES), **one, "failed_launches": failed,
            "loadavg_before": load_before, "loadavg_after": os.getloadavg(), "wall_s": time.perf_counter() - t0}


def main(argv: list[str]) -> int:
    if "--worker" in argv:
        import argparse

        ap = argparse.ArgumentParser()
        ap.add_argument("--worker", action="store_true")
        for name in ("--dims", "--result"):
            ap.add_argument(name, required=True)
        ap.add_argument("--steps", type=int, required=True)
        worker(ap.parse_args(argv))
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)  # the result is written: no interpreter finalization (leave_process_group)
    reps = int(argv[0]) if argv and argv[0].isdigit() else 1
    print(json.dumps(measure(reps=reps, smoke="--smoke" in argv), indent=1))
    return 0


if __name__ == "__main__":
    if not __package__:  # run as a file from a checkout: import Stride as the `stride` package
        import runpy

        runpy.run_path(str(REPO / "stride" / "_checkout.py"))
    sys.exit(main(sys.argv[1:]))
