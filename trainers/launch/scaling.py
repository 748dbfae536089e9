"""A gang's size against what it runs on: scaling.num_workers and use_gpu ("auto" included) resolved against the
connected Ray cluster's CPUs, GPUs and nodes (the Ray launcher), or checked against a node's own GPUs (torchrun).
Each refusal is one UsageError line naming the setting, what was asked and what there is."""

from __future__ import annotations

from stride.errors import UsageError


def resolve_scaling(cfg) -> tuple[int, bool, dict]:
    """num_workers/use_gpu 'auto' -> numbers, checked against what the connected cluster has. Raises UsageError."""
    import ray

    return plan_scaling(cfg, ray.cluster_resources(), [n for n in ray.nodes() if n.get("Alive")])



def plan_scaling(cfg, total: dict, nodes: list[dict]) -> tuple[int, bool, dict]:
    """resolve_scaling for a cluster of `total` resources and these live nodes (ray.nodes() entries): a pure
    function of the config and the cluster, so that every refusal is tested without starting one."""
    cpus, gpus = total.get("CPU", 0.0), total.get("GPU", 0.0)
    use_gpu = cfg.scaling.use_gpu if cfg.scaling.use_gpu != "auto" else gpus > 0
    if cfg.scaling.num_workers == "auto":
        num_workers = int(gpus) if use_gpu else max(1, len(nodes))
    elif elastic(cfg):
        num_workers = elastic(cfg)[0]  # elastic: the minimum must fit; Ray starts as many as fit up to max
    else:
        num_workers = cfg.scaling.num_workers
    need_cpu = num_workers * cfg.scaling.cpus_per_worker
    if problem := gpu_shortfall(cfg.scaling.use_gpu, num_workers, gpus):
        raise UsageError(problem)
    biggest = max((n["Resources"].get("CPU", 0.0) for n in nodes), default=0.0)
    if cfg.scaling.cpus_per_worker > biggest:
        raise UsageError(f"scaling.cpus_per_worker ({cfg.scaling.cpus_per_worker:g}) exceeds the largest node's "
                         f"{biggest:g} CPUs; use scaling.cpus_per_worker={biggest:g} or less")
    if need_cpu > cpus + 1e-9:
        fit = cpus / num_workers
        raise UsageError(f"scaling.num_workers ({num_workers}) x scaling.cpus_per_worker ({cfg.scaling.cpus_per_worker:g}) "
                         f"= {need_cpu:g} CPUs exceeds the cluster's {cpus:g} CPUs; use "
                         + (f"scaling.cpus_per_worker={fit:.2g}" if fit >= 0.1 else f"scaling.num_workers={max(1, int(cpus))}")
                         + " or a bigger cluster")
    return num_workers, bool(use_gpu), {"CPU": cpus, "GPU": gpus, "nodes": len(nodes)}



def gpu_shortfall(use_gpu: bool | str, num_workers: int, gpus: float, *, workers_key: str = "scaling.num_workers",
                  where: str = "the cluster") -> str | None:
    """The one line refusing scaling.use_gpu (true, false or auto) for `num_workers` workers when `where` has `gpus`
    GPUs; None when each worker gets one, or none is asked for. Both launchers ask it, so that neither trains on the
    CPU when GPUs were asked for: the Ray driver of the cluster (resolve_scaling), trainers/torchrun.py of its node's
    CUDA devices. `workers_key`: what sets the worker count there."""
    if not (gpus > 0 if use_gpu == "auto" else use_gpu):
        return None
    if not gpus:
        return f"scaling.use_gpu (true) needs GPUs but {where} has none; set scaling.use_gpu=false (or auto)"
    if gpus < num_workers:
        return (f"{workers_key} ({num_workers}) with scaling.use_gpu={str(use_gpu).lower()} needs {num_workers} GPUs "
                f"but {where} has {gpus:g}; use {workers_key}={int(gpus)} or scaling.use_gpu=false")
    return None



def elastic(cfg) -> tuple[int, int] | None:
    nw = cfg.scaling.num_workers
    return tuple(nw) if isinstance(nw, (tuple, list)) else None
