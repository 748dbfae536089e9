"""The Ray Train edge: what Ray Train runs on each worker. It builds the Ray `WorkerEnv` (rank, device,
checkpoints through Ray's storage, Prometheus gauges, Ray's preemption notices), then runs the plain-PyTorch
`Trainer`."""

from __future__ import annotations

from concurrent.futures import Future
from pathlib import Path
from typing import Any

from stride.trainers import telemetry
from stride.trainers.run import checkpointing
from stride.trainers.launch import stop_channel
from stride.trainers.run.remote import RunRemote, replica_on_this_node
from stride.trainers.config_reader import from_dict
from stride.trainers.loop import RunPlan, WorkerEnv, run
from stride.trainers.step import ddp_options
from stride.trainers.policies import Preemption


def preemption_notice() -> Preemption | None:
    """This worker's copy of Ray Train's preemption notice (ray_edge.preemption_info), as the loop's Preemption."""
    from stride.ray_cluster.ray_edge import preemption_info

    info = preemption_info()
    if info is None:
        return None
    return Preemption(tuple(info.preempted_node_ids), info.deadline_ms / 1000.0 if info.deadline_ms else None)


def prepare_model(model):
    """Ray Train's DDP wrapping, with the settings torchrun's DDP has (step.ddp_options)."""
    import ray.train.torch

    return ray.train.torch.prepare_model(model, parallel_strategy_kwargs=ddp_options(model))


def train_loop_per_worker(config: dict[str, Any]) -> dict[str, Any]:
    """Entry point Ray Train runs on each worker: {"cfg": the resolved config's dict, "plan": RunPlan}."""
    import ray
    import ray.train
    import ray.train.torch

    from stride.ray_cluster.ray_edge import quiet_train_loggers

    quiet_train_loggers()
    ctx = ray.train.get_context()
    cfg = from_dict(config["cfg"])
    plan: RunPlan = config["plan"]

    on_bucket = RunRemote.of(cfg) is not None  # its checkpoints are Stride's to upload and find, not Ray's

    def report(metrics: dict[str, Any], written: Future | None) -> None:
        if written is None or ctx.get_world_rank() != 0 or on_bucket:
            ray.train.report(metrics)
            return
        from ray.train import CheckpointUploadMode

        def register(checkpoint, dir_name: str):
            # Ray's upload thread: every rank already writes its shards into the run folder (shared storage, as
            # every worker reads it to resume); Ray registers the folder once it is complete, where it is.
            return ray.train.Checkpoint(path=str(written.result()))

        folder = checkpointing.checkpoint_folder(Path(plan.run_dir), metrics["step"])
        ray.train.report(metrics, checkpoint=ray.train.Checkpoint(path=str(folder)),
                         checkpoint_upload_mode=CheckpointUploadMode.ASYNC, delete_local_checkpoint_after_upload=False,
                         checkpoint_upload_fn=register)

    def progress_bar(**kwargs):
        from ray.experimental.tqdm_ray import tqdm

        return tqdm(**kwargs)

    stream_factory = None
    if plan.data_pipeline == "ray_data":
        from functools import partial

        from stride.datasets.ray_pipeline import RayDataStream

        stream_factory = partial(RayDataStream, cpus_per_task=plan.data_cpus_per_task,
                                 timeout_s=cfg.data.pipeline_timeout_s)

    env = WorkerEnv.for_gang(
        ctx.get_world_rank(), ctx.get_world_size(), ctx.get_local_rank(), ray.train.torch.get_device(),
        ray.get_runtime_context().get_node_id(), plan, wrap_model=prepare_model, report=report,
        progress_bar=progress_bar,
        # Prometheus: stride_samples_per_second ... stride_checkpoint_blocked_seconds (trainers/telemetry.py).
        record_metrics=telemetry.Gauges(cfg.run.name, ctx.get_world_rank()).record,
        stream_factory=stream_factory,
        # A node announced as preempted: checkpoint at the next step, then wait for Ray to restart the gang from it.
        preempted=preemption_notice,
        stop_requested=stop_channel.poller(plan.stop_channel) if plan.stop_channel else None,
    )
    return run(cfg, env, plan)


def job_per_worker(config: dict[str, Any]) -> dict[str, Any]:
    """What Ray Train runs on each worker of a command after training (trainers/launch/jobs.py): config["job"](cfg, env,
    plan), with no checkpoints and no reports."""
    import ray
    import ray.train
    import ray.train.torch

    ctx = ray.train.get_context()
    env = WorkerEnv.for_gang(ctx.get_world_rank(), ctx.get_world_size(), ctx.get_local_rank(),
                             ray.train.torch.get_device(), ray.get_runtime_context().get_node_id())
    # A bucket run's copy on this node (fetched by its first rank, where the driver's is not), in place before any
    # rank reads it and kept until every rank is done.
    first_here = _first_rank_on_node(ray.get_runtime_context().get_node_id())
    with replica_on_this_node(config.get("replica") if first_here else None):
        _gang_barrier()
        result = config["job"](from_dict(config["cfg"]), env, config["plan"])
        _gang_barrier()
    return result


def _first_rank_on_node(node_id: str) -> bool:
    """Whether this worker is the lowest rank on its Ray node. Not Ray Train's local rank: that counts workers by IP
    address, and two nodes behind one address (containers, network namespaces) would each have no local rank 0."""
    import torch.distributed as dist

    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return True
    nodes: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(nodes, node_id)
    return nodes.index(node_id) == dist.get_rank()


def _gang_barrier() -> None:
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
