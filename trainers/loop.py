"""The per-worker training loop: a `Trainer` in named phases (setup, restore, step, evaluate, checkpoint, log).

Plain PyTorch. The trainer talks to its runtime only through a `WorkerEnv` (rank, device, data, checkpoints,
reports), built by the Ray Train edge (trainers/launch/ray_worker.py) or the torchrun edge (trainers/torchrun.py), and
gets what the launcher decided as a typed `RunPlan`. What varies between models is the task's (trainers/task.py):
nothing here asks which task it runs.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from stride.datasets.budget import BudgetStream
from stride.datasets.mixing import order_for
from stride.datasets.splits import DataSpec
from stride.errors import DataError
from stride.datasets.stream import TrainStream, eval_batch_counts, eval_sources, eval_stream
from stride.trainers import blocks as trainer_blocks
from stride.trainers import fsdp, pretrained, sinks as run_sinks, telemetry
from stride.trainers.hang import HangWatchdog
from stride.trainers.run import checkpointing
from stride.trainers.run import lock as runlock
from stride.trainers.run.remote import RunRemote
from stride.trainers.callbacks import Callbacks, build as build_callbacks
from stride.trainers.callbacks.base import CallbackState
from stride.trainers.config import (Config, check_batch_fits, check_mesh_fits, global_batch_size, global_micro_batch,
                                    public_dict, scaled_lr)
from stride.trainers.policies import (TRANSFORM_STREAM, Cadence, GarbageCollection, NonFinitePolicy, Preemption, RankPace,
                                     SpikeLog, StopRequest, Stragglers, reseed)
from stride.errors import TrainingError
from stride.trainers.sinks import Sinks, saved_state
from stride.trainers.sinks.base import RunInfo
from stride.trainers.optim import Freezer, build_optimizer, build_scheduler, logged_lrs, resolve_groups
from stride.trainers.step import (Precision, SpikeGuard, StepResult, TrainMetrics, all_gather_rows, all_reduce_mean_many,
                                  evaluate, resolve_precision, train_step)
from stride.trainers.task import Task
from stride.trainers.tasks import make_task

__all__ = ["RunPlan", "Trainer", "WorkerEnv", "plan_run"]

log = logging.getLogger("stride")


@dataclass
class WorkerEnv:
    """Everything the loop needs from its runtime (Ray Train or torchrun)."""

    world_rank: int
    world_size: int
    local_rank: int
    device: torch.device
    wrap_model: Callable[[torch.nn.Module], torch.nn.Module]
    latest_checkpoint: Callable[[], Path | None]
    # report(metrics, checkpoint): every rank calls it the same number of times. On a checkpoint step every rank
    # passes the future of the checkpoint's background write (its result: the folder, complete; the loop waits for
    # it before the next checkpoint and before the run ends): Ray registers the folder, torchrun prunes old ones.
    report: Callable[[dict[str, Any], Future | None], None]
    progress_bar: Callable[..., Any] | None = None
    # record(figures): this rank's figures of a log step to the runtime's metrics system (Ray: Prometheus gauges).
    record_metrics: Callable[[dict[str, Any]], None] | None = None
    checkpoint_write_s: list[float] = field(default_factory=list)  # rank 0: each finished write's seconds
    # Where this rank runs, as its runtime names nodes (Ray: the node id; torchrun: the host): summary.json's
    # worker_nodes, so that a user sees how the gang was placed.
    node: str = ""
    # The training rows' pipeline: TrainStream's signature (datasets/stream.py); None: TrainStream (a thread).
    # The Ray edge passes a Ray Data pipeline when the driver chose data.pipeline=ray_data.
    stream_factory: Callable[..., Any] | None = None
    # The runtime's notice that a node of the gang is about to be preempted, or None; asked at every step boundary,
    # so it must be cheap (Ray: this worker's own copy of the notice, no collective). None: no such notices (torchrun).
    preempted: Callable[[], Preemption | None] | None = None
    # The driver's stop request where the run folder is not shared (Ray: its stop channel), or None; asked at every
    # step boundary (the channel rate-limits itself).
    stop_requested: Callable[[], dict[str, Any] | None] | None = None

    @classmethod
    def for_gang(cls, world_rank: int, world_size: int, local_rank: int, device: torch.device, node: str,
                 plan: RunPlan | None = None, *, wrap_model: Callable[[torch.nn.Module], torch.nn.Module] | None = None,
                 report: Callable[[dict[str, Any], Future | None], None] | None = None,
                 progress_bar: Callable[..., Any] | None = None, **runtime: Any) -> WorkerEnv:
        """This rank's env on either launcher, which passes only what differs: its place in the gang and its node's
        name; for a run's `plan`, how it wraps the model for a gang of more than one (DDP, Ray's prepare_model),
        where reports go, its progress bar (shown when the plan asks for one) and its extras (`runtime`: Ray's
        metrics, data pipeline and preemption notices). Without a plan, a command's job after training (eval,
        predict): the model as built (the job shards or keeps it whole itself), no checkpoint to resume, nothing to
        report."""
        if plan is None:
            return cls(world_rank, world_size, local_rank, device, wrap_model=lambda m: m,
                       latest_checkpoint=lambda: None, report=lambda metrics, written: None, node=node)
        run_dir = Path(plan.run_dir)
        return cls(world_rank, world_size, local_rank, device,
                   wrap_model=wrap_model if world_size > 1 and wrap_model is not None else lambda m: m,
                   # Not Ray's pointer (ray.train.get_checkpoint): it misses a checkpoint written but never registered
                   # (driver killed in between); every worker reads the run folder. What the newest complete one
                   # passes over, the driver said (lifecycle.check_resume).
                   latest_checkpoint=lambda: checkpointing.newest_complete(run_dir),
                   report=report, progress_bar=progress_bar if plan.progress_bar else None, node=node, **runtime)


@dataclass(frozen=True)
class RunPlan:
    """What the launcher decided for every worker, beyond the config: the same fields under Ray and torchrun
    (built by `plan_run`)."""

    run_dir: str
    train: DataSpec
    val: DataSpec | None
    facts: dict[str, Any]  # what the task's inspect found in the data (Task.facts)
    cpus_per_worker: float
    # Per tracker of tracking.sinks, what the launcher decided for every rank (trainers/sinks: Sink.plan), and a
    # sweep's additions (its parent run).
    sink_options: dict[str, dict[str, Any]] = field(default_factory=dict)
    report_log_steps: bool = False  # report every log step to Ray (Tune's schedulers read train_* figures)
    progress_bar: bool = False
    sample_log: str | None = None  # debugging aid: every rank logs the sample_ids it trains on (STRIDE_SAMPLE_LOG)
    data_pipeline: str = "thread"  # or "ray_data" (the driver's choice for data.pipeline)
    data_cpus_per_task: float = 1.0  # data.pipeline=ray_data: CPUs of each Ray Data task
    run_lock_token: str | None = None  # the launcher's run lock (trainers/run/lock.py); None: no lock, no fence
    stop_channel: str | None = None  # Ray: the driver's stop channel (trainers/launch/stop_channel.py); None: none
    init_sha256: str | None = None  # init.from's digest as the driver's check computed it; None: rank 0 hashes it


def plan_run(cfg: Config, specs: dict[str, DataSpec], facts: dict[str, Any], sink_options: dict | None = None,
             **extra: Any) -> RunPlan:
    from stride.trainers.pretrained import known_sha256

    options = run_sinks.plan(cfg)
    for name, more in (sink_options or {}).items():
        options[name] = {**options.get(name, {}), **more}
    return RunPlan(run_dir=str(cfg.run_dir), train=specs["train"], val=specs.get("val"), facts=facts,
                   cpus_per_worker=cfg.scaling.cpus_per_worker, sink_options=options,
                   sample_log=os.environ.get("STRIDE_SAMPLE_LOG"), init_sha256=known_sha256(cfg.init.from_), **extra)


@dataclass
class TrainState:
    """What a checkpoint restores besides tensors: the counters and the run's identity."""

    step: int = 0
    micro_step: int = 0  # global micro-step counter over epochs: the data position
    samples_seen: int = 0
    restarts: int = 0
    preemptions: int = 0  # of the restarts, those from a preemption checkpoint
    sinks: dict[str, Any] = field(default_factory=dict)  # each tracker's state (its run id), from the checkpoint
    initial_val_loss: float | None = None


def setup_logging(world_rank: int) -> None:
    """Rank 0 logs at INFO, the others at WARNING; Stride's own handler, so other libraries stay as they are."""
    log.handlers.clear()
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter(f"[stride rank {world_rank}] %(asctime)s %(levelname)s %(message)s", "%H:%M:%S"))
    log.addHandler(handler)
    log.propagate = False
    log.setLevel(logging.INFO if world_rank == 0 else logging.WARNING)


def to_device(batch: dict[str, np.ndarray], device: torch.device, task_name: str) -> dict[str, torch.Tensor]:
    out = {}
    for key, value in batch.items():
        value = np.asarray(value)
        if value.dtype == object:
            raise TrainingError(f"model.name ({task_name}): transform returned '{key}' as Python objects; return "
                                f"numeric numpy arrays (decode bytes, pad lists) from transform")
        # A column the transform passed through is a view of the window's read-only Arrow memory: torch gets a copy.
        value = np.ascontiguousarray(value) if value.flags.writeable else value.copy()
        tensor = torch.from_numpy(value)
        if device.type == "cuda":  # page-locked, so that the copy is asynchronous: the host goes on queueing the step
            tensor = tensor.pin_memory()
        out[key] = tensor.to(device, non_blocking=True)
    return out


class TrainTransform:
    """The task's transform of one training micro-batch. Its random streams (augmentation) are reseeded from
    (seed, rank, step) at a step's first micro-batch and run on through the step's others, called in order: the
    same rows give the same arrays in the training thread or in a Ray Data task on another node, and 2 micro-batches
    of 16 draw what one batch of 32 draws. Pickled without its task (a Ray Data task builds its own once)."""

    def __init__(self, cfg: Config, facts: dict[str, Any], rank: int, task: Task | None = None):
        self.cfg_dict, self.facts, self.rank, self.seed = cfg.to_dict(), facts, rank, cfg.run.seed
        self.accum = cfg.train.grad_accum_steps
        self.task = task

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "task": None}

    def __call__(self, rows, micro_step: int) -> dict[str, np.ndarray]:
        if self.task is None:
            from stride.trainers.config_reader import from_dict

            self.task = make_task(from_dict(self.cfg_dict), self.facts)
        self.task.training = True
        if micro_step % self.accum == 0:
            reseed(self.seed, self.rank, micro_step // self.accum, TRANSFORM_STREAM)
        return self.task.transform(rows.data)


class Trainer:
    """One worker's run. `fit()` calls the phases in order and returns rank 0's summary fields."""

    def __init__(self, cfg: Config, env: WorkerEnv, plan: RunPlan):
        self.cfg, self.env, self.plan = cfg, env, plan
        self.rank0 = env.world_rank == 0
        self.run_dir = Path(plan.run_dir)
        self.checkpoint_metrics: dict[str, Any] = {}  # the figures the resumed checkpoint recorded
        self.task = make_task(cfg, plan.facts)
        self.loss_fn = self.task.loss  # training's and evaluation's; train.compile=model compiles it (compile_loss)
        # Task.train_metrics, when the task has them: computed on each training forward's outputs.
        own_metrics = type(self.task).train_metrics is not Task.train_metrics
        self.train_metrics = TrainMetrics(self.task) if own_metrics else None
        self.state = TrainState()
        self.start_position = (0, 0)  # (epoch, rows into it): where a token-budget stream starts (resume sets it)
        self.stream = None  # fit()'s stream of training micro-batches: it knows the data position
        self.ended: str | None = None  # the status of a run a callback ended (its rerun trains no further)
        # Checked before every checkpoint and metrics write: a worker whose run lost the folder never writes again.
        self.fence = runlock.fence_for(cfg, self.run_dir, plan.run_lock_token)
        self.remote = RunRemote.of(cfg)  # a run on a bucket: what reaches it, and when (None: a folder)
        self.watchdog: HangWatchdog | None = None  # while train_loop runs
        self.goodput = telemetry.Goodput()  # this attempt starts now; a resume adds what the checkpoint saved

    # ---- setup: data, order, model, precision, sharding, optimizer ----

    def setup_process(self) -> None:
        """This process's logging, determinism and CPU threads."""
        t = self.cfg.train
        setup_logging(self.env.world_rank)
        if t.deterministic:
            torch.use_deterministic_algorithms(True)
            torch.backends.cudnn.benchmark = False
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        if self.env.device.type == "cpu":
            torch.set_num_threads(t.num_threads or max(1, int(self.plan.cpus_per_worker)))

    def setup_precision(self, shard: bool = True, strict: bool = False) -> None:
        """train.precision and train.strategy on this gang (fsdp and hsdp shard only across several workers).
        `strict` (training a fixed gang): an hsdp layout the workers cannot hold is refused rather than adapted."""
        t, W = self.cfg.train, self.env.world_size
        self.precision_name = resolve_precision(t.precision, self.env.device)
        # train.strategy=fsdp/hsdp: shard before the optimizer is built, so that it holds (and updates) only the shards.
        if strict:
            check_mesh_fits(self.cfg, W)
        self.sharded = shard and t.strategy != "ddp" and W > 1
        if t.strategy != "ddp" and not self.sharded and self.rank0:
            log.info("train.strategy=%s with %d worker(s): training unsharded", t.strategy, W)
        self.mesh = self.plan_mesh() if self.sharded else None
        self.strategy = self.mesh.strategy if self.mesh else "ddp" if W > 1 else "none"
        self.precision = Precision.create(self.precision_name, self.env.device, self.sharded)

    @functools.cached_property
    def gang_nodes(self) -> list[str]:
        """Every rank's node (Ray's node id, or the host under torchrun), in rank order. A collective on first use:
        every rank reaches it at the same point (the mesh's plan, the first log step)."""
        nodes = [self.env.node] * self.env.world_size
        if self.env.world_size > 1:
            torch.distributed.all_gather_object(nodes, self.env.node)
        return nodes

    def plan_mesh(self) -> fsdp.Mesh:
        """Which ranks shard together (fsdp.plan_mesh), from every rank's node; rank 0 says what the layout costs."""
        t = self.cfg.train
        mesh = fsdp.plan_mesh(t.strategy, t.fsdp.shard_size, self.gang_nodes)
        if self.rank0:
            for note in mesh.notes:
                log.warning("train.strategy=hsdp: %s", note)
            log.info("train.strategy=%s: %d shard group(s) of %d rank(s)%s", mesh.strategy, mesh.replicas,
                     mesh.shard_size, "" if t.fsdp.offload == "none" else "; parameters and optimizer state on the CPU")
        return mesh

    def setup(self) -> None:
        cfg, env, t = self.cfg, self.env, self.cfg.train
        self.setup_process()
        # The order is a function of (seed, epoch, the split's blocks) only; the rows stream in (fit).
        train, val, W = self.plan.train, self.plan.val, env.world_size
        self.global_micro = global_micro_batch(cfg, W)  # B x W; elastic runs: B x max workers, whatever W is now
        self.rows_per_worker = self.global_micro // W
        self.order = order_for(train, cfg.run.seed, self.global_micro, cfg.data.shuffle_window_rows,
                               cfg.data.shuffle_window_bytes)
        check_batch_fits(cfg, train.num_rows, W)  # the driver's check, again for the gang as it started
        self.total_steps = t.max_steps or max(1, math.ceil(t.epochs * self.order.micro_steps_per_epoch / t.grad_accum_steps))
        log.info("data: %d train rows in %d blocks, %s val rows; shuffle window %d rows; %s", train.num_rows,
                 len(train.blocks), val.num_rows if val else 0, self.order.window_rows, self.batch_text(W))

        self.setup_precision(strict=True)
        self.checkpoint_dir = self.remote.resume_copy(env.world_rank) if self.remote else env.latest_checkpoint()
        self.resume_meta = checkpointing.read_meta(self.checkpoint_dir) if self.checkpoint_dir else None
        model = self.build_model()
        self.sample_flops = self.task.flops_per_sample(model)
        self.device_peak = telemetry.peak_flops(env.device, self.precision_name, t.peak_flops)
        if self.device_peak and self.sample_flops and type(self.task).flops_per_sample is Task.flops_per_sample \
                and self.rank0:
            log.info("mfu uses Task.flops_per_sample's default estimate, 6 x %d parameters per sample: low for "
                     "sequence models; override flops_per_sample in %s", self.sample_flops // 6, cfg.model.name)
        if self.precision_name != "fp32" and env.device.type == "cpu" and self.rank0:
            log.warning("train.precision=%s on CPU runs in emulation, many times slower than fp32; use "
                        "train.precision=auto (fp32 on CPU) unless you are testing mixed precision", self.precision_name)
        self.model = self.raw_model = model  # restore wraps self.model (DDP); raw_model stays the module
        # optim.groups over the trainable parameters as built (before any freezing), then the step-0 freeze
        self.groups = resolve_groups(cfg, model)
        # With optim.groups, grad_norm/<group> too (one pass over the gradients, as the total alone takes).
        self.grad_groups = [g.params for g in self.groups] if cfg.optim.groups else None
        self.optimizer = build_optimizer(cfg, model, W, self.task)
        self.peak_lr = scaled_lr(cfg, W)
        self.scheduler = build_scheduler(cfg, self.optimizer, self.total_steps, self.groups)
        self.freezer = Freezer(self.groups)
        self.freezer.apply(0)
        # train.callbacks, the task's and Stride's own (train.ema, early stopping, keep_best): built over the model
        # and optimizer, so that a resume can restore their state (tensors too) with the checkpoint's.
        self.callbacks = Callbacks(build_callbacks(cfg, self.task), CallbackState(self))
        self.scaler = self.precision.grad_scaler()
        self.forward_clock, self.stragglers = telemetry.ForwardClock(env.device), Stragglers(t.straggler_warn_ratio)
        self.spike_guard, self.spike_log = self.spike_watch()
        # Checkpoints are written in the background over a gloo group of their own (DCP's collectives, CPU tensors).
        self.checkpoint_group = (torch.distributed.new_group(backend="gloo") if torch.distributed.is_initialized()
                                 else None)
        # The stop agreement of every step, on the host (StopRequest): another gloo group, as the writer's
        # collectives run on theirs from its own thread.
        self.control_group = (torch.distributed.new_group(backend="gloo") if torch.distributed.is_initialized()
                              else None)
        self.writer = checkpointing.CheckpointWriter(env.world_rank, self.checkpoint_group, self.written,
                                                     fence=self.fence.still_holds, remote=self.remote,
                                                     sync=cfg.checkpoint.upload == "sync")
        self.writer.keep_last = cfg.checkpoint.keep_last

    def spike_watch(self) -> tuple[SpikeGuard | None, SpikeLog | None]:
        """train.spike: the guard the step consults on the device, and the log the loop reads it into."""
        spike = self.cfg.train.spike
        if spike is None:
            return None, None
        skip = spike.action == "skip" and not self.scaler.is_enabled()
        if spike.action == "skip" and not skip and self.rank0:
            log.warning("train.spike.action=skip: train.precision resolved to fp16 on this device, whose GradScaler "
                        "decides each step; spikes are logged, not skipped (use train.precision=bf16 to skip them)")
        return (SpikeGuard(spike.metric, spike.window, spike.factor, skip),
                SpikeLog(spike.metric, spike.factor, spike.window, skip))

    def written(self, folder: Path, seconds: float) -> None:
        """Rank 0, once a checkpoint's files are all in (the writer's thread)."""
        self.env.checkpoint_write_s.append(seconds)
        self.callbacks.checkpoint_complete(folder)  # checkpoint.keep_best ranks it

    def build_model(self) -> torch.nn.Module:
        """The task's model on this rank's device, with its initial weights: seeded (the same on every rank), then
        init.from where a fresh run loads it. Under FSDP it is built on the meta device and sharded before any
        weight exists, so no device ever holds it whole. From scratch, rank 0 builds the seeded weights in host
        memory and broadcasts them tensor by tensor (DDP's weights, at any world size); with init.from or a task's
        own init_weights, no rank holds it whole anywhere: each initialises its shards and reads its slices."""
        cfg, env = self.cfg, self.env
        torch.manual_seed(cfg.run.seed)
        if not self.sharded:
            model = self.task.build_model()
            self.init_record = self.load_init(model)
            model = model.to(env.device)
            self.apply_block_settings(model)
            return model
        with fsdp.params_on_meta():
            model = self.task.build_model()
        self.apply_block_settings(model)
        model = fsdp.shard_model(model, self.task.blocks(model), env.device, self.mesh,
                                 self.precision.fsdp_param_dtype, offload=self.cfg.train.fsdp.offload == "cpu")
        # Offloaded shards live in host memory (FSDP2 copies each unit to the device for its compute), as
        # torchtitan initialises them.
        fsdp.materialize(model, torch.device("cpu") if cfg.train.fsdp.offload == "cpu" else env.device)
        if self.init_source() is None and type(self.task).init_weights is Task.init_weights:
            torch.manual_seed(cfg.run.seed)
            fsdp.broadcast_full_model(model, self.task.build_model() if self.rank0 else None, env.world_rank)
            self.init_record = self.load_init(model)
        else:
            self.init_record = self.load_init(model, initialise=self.task.init_weights)
        return model

    def init_source(self) -> str | None:
        """init.from where this run reads it: at a fresh start, and on resuming a checkpoint.trainable_only run
        (its checkpoints lack the frozen base)."""
        meta = self.resume_meta
        if meta is not None and not meta.get("trainable_only"):
            return None
        return self.cfg.init.from_

    def load_init(self, model: torch.nn.Module, initialise: Callable[[torch.nn.Module], None] | None = None
                  ) -> dict[str, Any] | None:
        """init.from into `model` (under FSDP each rank reads its slices); `initialise` (a model built on the meta
        device) first, unless init.from fills every parameter. Returns what was loaded (summary.json, meta.json,
        the trackers); a resumed run keeps the record of its first start."""
        earlier = (self.resume_meta or {}).get("init")
        source = self.init_source()
        if source is None:
            if initialise is not None:
                initialise(model)
            return earlier
        i, adapt = self.cfg.init, pretrained.adapter(self.task)
        with pretrained.open_source(source) as src, ThreadPoolExecutor(1) as pool:
            # The driver's digest; else rank 0 hashes the file while every rank loads it (hashing releases the GIL).
            known = self.plan.init_sha256
            digest = pool.submit(src.sha256) if self.rank0 and known is None else None
            plan = pretrained.plan_model(model, src, "pending", strict=i.strict, include=i.include,
                                         exclude=i.exclude, rename=i.rename, adapt=adapt)
            if initialise is not None and not set(plan.mapping) >= {n for n, _ in model.named_parameters()}:
                initialise(model)  # what init.from leaves out
            pretrained.load_into(model, src, plan, rename=i.rename, adapt=adapt)
            plan.sha256 = self.from_rank0(known or (digest.result() if digest is not None else None))
        record = plan.record()
        if earlier and earlier.get("sha256") != record["sha256"]:  # the driver refuses it first (check_model)
            raise DataError(pretrained.changed_base_line(source, earlier["sha256"], record["sha256"]))
        if self.rank0:
            log.info("init: %d tensors (%d parameters) loaded from %s", record["loaded"], record["parameters_loaded"],
                     source)
        return earlier or record

    def from_rank0(self, value: Any) -> Any:
        """Rank 0's `value` on every rank (a collective where there are several)."""
        box = [value]
        if self.env.world_size > 1 and torch.distributed.is_initialized():
            torch.distributed.broadcast_object_list(box, src=0)
        return box[0]

    def apply_block_settings(self, model: torch.nn.Module) -> None:
        """train.activation_checkpointing and train.compile on the task's repeated blocks, before FSDP wraps them."""
        t, blocks = self.cfg.train, self.task.blocks(model)
        self.block_settings = {"activation_checkpointed_blocks": 0, "compiled_modules": 0}  # what they did: summary.json
        if t.activation_checkpointing:
            if not blocks and self.rank0:
                log.warning("train.activation_checkpointing=true: %s's task names no repeated blocks (Task.blocks), "
                            "so nothing is recomputed; override blocks() in the task", self.cfg.model.name)
            n = self.block_settings["activation_checkpointed_blocks"] = trainer_blocks.checkpoint_activations(
                blocks, t.activation_checkpointing_every)
            if self.rank0:
                log.info("activation checkpointing: %d of %d blocks recompute their activations", n, len(blocks))
        if t.compile_scope == "blocks":
            n = self.block_settings["compiled_modules"] = trainer_blocks.compile_blocks(model, blocks, t.compile_mode)
            if self.rank0:
                log.info("torch.compile (mode %s): %d module(s); compiled at the first training and evaluation "
                         "forwards", t.compile_mode, n)

    def compile_loss(self) -> None:
        """train.compile=model: the task's loss and the (wrapped) model it calls, one compiled function, for training
        and evaluation. After DDP wraps the model, so dynamo sees DDP and splits the graph at its buckets."""
        self.loss_fn = self.task.loss
        if self.cfg.train.compile_scope != "model":
            return
        self.loss_fn = trainer_blocks.compile_loss(self.task.loss, self.cfg.train.compile_mode)
        self.block_settings["compiled_modules"] = 1
        if self.rank0:
            log.info("torch.compile (mode %s): the model and the task's loss in one graph; compiled at the first "
                     "training and evaluation forwards", self.cfg.train.compile_mode)

    # ---- restore: the newest complete checkpoint, at any world size and either strategy ----

    def restore(self) -> None:
        if self.checkpoint_dir is not None:
            self._load(self.checkpoint_dir)
        self.callbacks.load_state_dict((self.resume_meta or {}).get("callbacks") or {})
        if not self.sharded:  # DDP (Ray: prepare_model; torchrun: DistributedDataParallel); FSDP sharded in setup
            self.model = self.env.wrap_model(self.model)
        self.raw_model = getattr(self.model, "module", self.model)
        self.compile_loss()
        if self.remote is not None:
            self.remote.drop_resume_copy(self.env.world_rank)  # everything is loaded: staging holds no checkpoint

    def _load(self, ckpt_dir: Path) -> None:
        meta = self.resume_meta
        # As when it was saved, after its last step: the groups frozen then hold no optimizer state (and, under
        # trainable_only, no tensors), so the state to fill must not either. The next step applies its own.
        self.freezer.apply(max(meta["step"] - 1, 0))
        saved = checkpointing.saved_model_shapes(ckpt_dir)
        shapes = {k: tuple(v.shape) for k, v in self.model.state_dict().items()
                  if not meta.get("trainable_only") or k in saved}  # the rest came from init.from
        if mismatch := checkpointing.shape_mismatch(shapes, saved):
            raise DataError(f"checkpoint {ckpt_dir} does not fit model (the {mismatch}); use a new run.name "
                            f"or the model settings it was trained with")
        self._load_sharded(ckpt_dir, meta)
        # The data position is (epoch, samples into the epoch): valid for any world size with the same global
        # micro-batch (elastic resume), translated into this run's micro-step counter. Micro-batches sized by a
        # token budget have no such arithmetic: the stream starts from the position itself.
        epoch, offset = meta["epoch"], meta["epoch_offset_samples"]
        s = self.state
        if self.cfg.train.tokens_per_micro_batch:
            self.start_position = (epoch, offset)
            s.step, s.samples_seen = meta["step"], meta["samples_seen"]
            s.micro_step = s.step * self.cfg.train.grad_accum_steps
        elif offset % self.global_micro:
            raise DataError(f"checkpoint position ({offset} samples into epoch {epoch}) is not a multiple of the "
                            f"global micro-batch {self.global_micro}; resume with the same "
                            f"train.batch_size_per_worker x num_workers as before")
        else:
            s.step, s.samples_seen = meta["step"], meta["samples_seen"]
            s.micro_step = epoch * self.order.micro_steps_per_epoch + offset // self.global_micro
        if meta.get("ended"):  # a callback ended the run (early stopping): it stays ended
            self.ended, self.total_steps = meta["ended"], s.step
        # Rerunning a finished run trains nothing: it is not a restart, and its results are the checkpoint's.
        s.restarts = meta.get("restarts", 0) + (s.step < self.total_steps)
        s.preemptions = meta.get("preemptions", 0) + bool(meta.get("preempted") and s.step < self.total_steps)
        self.checkpoint_metrics = meta.get("metrics") or {}
        s.sinks = saved_state(meta)
        s.initial_val_loss = meta.get("initial_val_loss")
        self.goodput.resume(meta.get("goodput"))
        log.info("resumed from %s at step %d (epoch %d, +%d samples), restart %d", ckpt_dir, s.step, epoch, offset,
                 s.restarts)

    def _load_sharded(self, ckpt_dir: Path, meta: dict[str, Any]) -> None:
        """DCP: each rank reads the slices of the tensors it holds, whatever world size and strategy wrote them."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

        partial = bool(meta.get("trainable_only"))  # the rest is init.from's, loaded in build_model
        model_state, optim_state = self.training_state(partial)  # this rank's tensors, to fill
        # The callbacks' tensors that the checkpoint holds (train.ema's average), filled in place, each rank its
        # own slices; a callback the checkpoint has none of starts as it is (the EMA: at these weights).
        callback_tensors, present = self.callbacks.tensors_to_fill(checkpointing.saved_keys(ckpt_dir))
        state = {"model": model_state, "optim": optim_state, **callback_tensors}
        checkpointing.load_sharded(ckpt_dir, state, self.checkpoint_group)
        self.callbacks.loaded(present)
        set_state_dict(self.raw_model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                       options=StateDictOptions(strict=not partial))
        self.scheduler.load_state_dict(meta["scheduler"])
        self.scaler.load_state_dict(meta["scaler"])

    def trainable_names(self) -> list[str] | None:
        """The parameters that train now, where some do not (export --trainable-only writes these); None: all."""
        named = list(self.raw_model.named_parameters())
        trainable = [n for n, p in named if p.requires_grad]
        return None if len(trainable) == len(named) else trainable

    def training_state(self, trainable_only: bool) -> tuple[dict[str, Any], dict[str, Any]]:
        """The model's and the optimizer's state as checkpoints hold them (FSDP: this rank's shards). trainable_only:
        without the frozen parameters, under every name they have (a tied copy too: torch's ignore_frozen_params
        keeps it), which init.from holds."""
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_state, optim_state = get_state_dict(self.raw_model, self.optimizer)
        if trainable_only:
            frozen = {n for n, p in self.raw_model.named_parameters(remove_duplicate=False) if not p.requires_grad}
            model_state = {k: v for k, v in model_state.items() if k not in frozen}
        return model_state, optim_state

    # ---- rank-0 duties and the sinks ----

    def open_sinks(self) -> Sinks:
        """metrics.jsonl, the console, Prometheus and tracking.sinks' trackers (trainers/sinks), which continue
        their own records on resume."""
        if self.rank0:
            self.fence.still_holds()  # opening metrics.jsonl trims it on resume
        resumed = self.checkpoint_dir is not None
        run = RunInfo(self.cfg, self.run_dir, self.state.step if resumed else None, state=self.state.sinks,
                      options=self.plan.sink_options, params=public_dict(self.cfg), tags=self.init_record or {},
                      total_steps=self.total_steps, progress_bar=self.env.progress_bar,
                      record_metrics=self.env.record_metrics)
        return Sinks.open(run, self.rank0)

    # ---- one optimizer step ----

    def batch_text(self, W: int) -> str:
        """The data line's account of the batches: a fixed number of rows, or a budget on the sum of lengths."""
        t = self.cfg.train
        if t.tokens_per_micro_batch:  # datasets/budget.py: every row once, as many rows per micro-batch as fit
            return (f"micro-batches of rows whose {self.cfg.data.length_column} sums to at most "
                    f"{t.tokens_per_micro_batch:g} per worker x {W} workers x {t.grad_accum_steps} accumulation; no "
                    f"rows dropped")
        return (f"global batch {global_batch_size(self.cfg, W)} = {self.rows_per_worker} per worker x {W} workers x "
                f"{t.grad_accum_steps} accumulation; {self.order.rows_dropped_per_epoch} rows dropped per epoch")

    def open_stream(self) -> TrainStream:
        """This rank's transformed micro-batches from the restored position on: a resume reads from the window it
        falls in, never through the data before it."""
        transform = TrainTransform(self.cfg, self.plan.facts, self.env.world_rank, self.task)
        if budget := self.cfg.train.tokens_per_micro_batch:  # micro-batches by the sum of lengths: datasets/budget.py
            workers = self.global_micro // self.cfg.train.batch_size_per_worker
            return BudgetStream(self.plan.train, self.order, self.env.world_rank, self.env.world_size,
                                self.start_position, self.cfg.data.read_ahead_windows, budget * workers, transform)
        factory = self.env.stream_factory or TrainStream
        return factory(self.plan.train, self.order, self.env.world_rank, self.env.world_size, self.state.micro_step,
                       self.cfg.data.read_ahead_windows, end_micro_step=self.total_steps * self.cfg.train.grad_accum_steps,
                       transform=transform)

    def micro_batches(self, stream: TrainStream, sample_log) -> list[dict[str, torch.Tensor]]:
        batches = []
        for _ in range(self.cfg.train.grad_accum_steps):
            ids, arrays = stream.next_batch(self.state.micro_step)
            if sample_log is not None:
                sample_log.write(json.dumps({"step": self.state.step, "micro_step": self.state.micro_step,
                                             "rank": self.env.world_rank, "world_size": self.env.world_size,
                                             "sample_ids": ids.tolist()}) + "\n")
            batches.append(to_device(arrays, self.env.device, self.cfg.model.name))
            self.state.micro_step += 1
            self.state.samples_seen += stream.global_rows
        return batches

    def unfreeze(self) -> None:
        """optim.groups' schedule for the coming step. DDP all-reduces only the parameters that required grad when
        it was built: a change needs a new reducer (the old one's hooks removed first, or both would reduce)."""
        if not self.freezer.apply(self.state.step) or self.model is self.raw_model or self.sharded:
            return
        old, self.model = self.model, None
        old._remove_autograd_hooks()
        del old
        self.model = self.env.wrap_model(self.raw_model)
        if self.rank0:
            log.info("step %d: optim.groups' trainable parameters changed; DDP rebuilt over them", self.state.step)

    def step(self, batches: list[dict[str, torch.Tensor]]) -> StepResult:
        self.unfreeze()
        try:
            result = train_step(self.forward_clock.timed(self.loss_fn), self.model, self.optimizer, self.scaler, self.precision, batches,
                                self.cfg.optim.grad_clip_norm, self.train_metrics and self.train_metrics.observe,
                                self.grad_groups, self.spike_guard)
        except torch.OutOfMemoryError:
            raise TrainingError(
                f"out of memory at step {self.state.step + 1} with train.batch_size_per_worker="
                f"{self.cfg.train.batch_size_per_worker}; use a smaller train.batch_size_per_worker with more "
                f"train.grad_accum_steps (same global batch), train.precision=bf16, or train.strategy=fsdp") from None
        self.scheduler.step()
        self.state.step += 1
        return result

    # ---- evaluate: every validation row once across ranks ----

    def evaluate(self) -> dict[str, float]:
        """val_loss and the task's figures, of the trained weights and of the weights callbacks swap in (train.ema:
        the average's instead, eval: ema, or as well, as val_<name>_ema, eval: both), from the same batches."""
        if self.plan.val is None:
            return {}
        swaps = self.callbacks.evaluation_weights()  # suffix -> a context manager with those weights in the model
        out = self.evaluate_weights() if "" not in swaps else {}
        for suffix, swapped_in in swaps.items():
            with swapped_in():
                figures = self.evaluate_weights()
            out.update({f"{k}{suffix}": v for k, v in figures.items()})
        return out

    def evaluate_weights(self) -> dict[str, float]:
        self.task.training = False
        out = evaluate(self.task, self.model, self.precision, self._eval_batches(), self.env.device,
                       tuple(src.name for src in self.plan.val.sources), self.loss_fn)
        if self.sharded:
            fsdp.reshard(self.model)  # a forward without backward leaves the root unsharded
        return out

    def _eval_batches(self):
        W, rank, spec = self.env.world_size, self.env.world_rank, self.plan.val
        eb = max(self.cfg.train.batch_size_per_worker, 64)
        first = None
        for rows, source in eval_sources(spec, rank, W, eb):
            first = first or rows
            yield self._val_batch(rows.data), len(rows), source
        # Every rank runs as many forwards as the rank with the most batches: FSDP all-gathers in each, and every
        # rank must know the task's metric names for the all-reduce. The padding batches count for nothing.
        counts = eval_batch_counts(spec, W, eb)
        for _ in range(max(counts) - counts[rank]):
            if first is None:  # a rank with no block of its own pads with one row of the first block
                first = next(eval_stream(spec, 0, 1, 1))
            yield self._val_batch({k: v[:1] for k, v in first.data.items()}), 0

    def _val_batch(self, rows: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
        return to_device(self.task.transform(rows), self.env.device, self.cfg.model.name)

    # ---- checkpoint: staged on the CPU now, written in the background (trainers/run/checkpointing.py) ----

    def checkpoint(self, metrics: dict[str, Any]) -> Future:
        """Every rank stages its own shards (a CPU copy: what training waits for); they are written in the
        background, and rank 0 marks the folder complete after every rank's files are in."""
        s = self.state
        epoch, offset = self.stream.position(s.micro_step)
        # No RNG state: every rank reseeds from (seed, rank, step) at each step (policies.reseed).
        trainable_only = self.cfg.checkpoint.trainable_only
        model_state, optim_state = self.training_state(trainable_only)
        callback_tensors, flags = self.callbacks.state_tensors()  # train.ema's average: "ema", and meta's "ema": true
        state = {"model": model_state, "optim": optim_state, **callback_tensors}
        meta = {**flags, "trainable_only": trainable_only, "init": self.init_record, "trainable": self.trainable_names(),
                "step": s.step, "epoch": epoch, "epoch_offset_samples": offset,
                "samples_seen": s.samples_seen, "restarts": s.restarts, "preemptions": s.preemptions,
                "preempted": self.stop.preemption is not None, "sinks": self.sinks.state_dict(),
                "callbacks": self.callbacks.state_dict(), "ended": self.stop.final_status(),
                "world_size": self.env.world_size, "model": self.cfg.model.name, "facts": self.plan.facts,
                "initial_val_loss": s.initial_val_loss, "metrics": metrics, "strategy": self.strategy,
                "scheduler": self.scheduler.state_dict(), "scaler": self.scaler.state_dict(),
                "goodput": self.goodput.state()}
        self.fence.still_holds()  # save() clears a torn folder of this step on rank 0 before its background write
        return self.writer.save(checkpointing.checkpoint_folder(self.run_dir, s.step), state, meta)

    def settle(self, nonfinite: NonFinitePolicy) -> None:
        """The steps since the last read, read and judged (NonFinitePolicy.settle); fp16's skipped steps are the
        GradScaler's normal business, not warned about."""
        for warning in nonfinite.settle():
            if self.rank0 and not self.scaler.is_enabled():
                log.warning(warning)
        if self.spike_log is not None:  # logged under fp16 too: a spike is not the GradScaler's business
            for warning in self.spike_log.warnings if self.rank0 else ():
                log.warning(warning)
            self.spike_log.warnings.clear()

    # ---- log: the loss and this rank's timings, averaged over ranks with one all-reduce ----

    def gradient_figures(self, norms: list[float], group_norms: list[float]) -> dict[str, float]:
        """grad_norm: the log step's global gradient norm before clipping (the same on every rank); grad_norm/<group>
        with optim.groups: each group's, which combine to it (the root of their squares' sum); clipped: the share of
        the steps since the last log line that optim.grad_clip_norm clipped; loss_scale: fp16's GradScaler scale.
        Read from what the steps left on the device (NonFinitePolicy.settle): no read of their own."""
        if not norms:
            return {}
        clip = self.cfg.optim.grad_clip_norm
        out = {"grad_norm": norms[-1], "clipped": sum(clip is not None and n > clip for n in norms) / len(norms)}
        out.update({f"grad_norm/{g.label}": n for g, n in zip(self.groups, group_norms)})
        if self.scaler.is_enabled():
            out["loss_scale"] = float(self.scaler.get_scale())
        return out

    def log_figures(self, loss: float, clock: telemetry.StepClock, since: tuple[float, int],
                    padding=None) -> tuple[dict, dict]:
        now, s, A = time.perf_counter(), self.state, self.cfg.train.grad_accum_steps
        own = clock.figures()
        if padding is not None:  # data.length_column: the share of this rank's batches' cells padding fills
            own["padding_fraction"] = padding.take()
        if self.env.device.type == "cuda":
            own["gpu_memory_bytes"] = float(torch.cuda.max_memory_allocated(self.env.device))
            torch.cuda.reset_peak_memory_stats(self.env.device)
        keys = ("step_time_s", "data_wait_s", "data_wait_fraction", *(("padding_fraction",) if padding is not None else ()))
        mean = all_reduce_mean_many([loss, *(own[k] for k in keys)], self.env.device)
        own["forward_s"] = self.forward_clock.take() / max(clock.steps, 1)
        straggler_ratio = self.straggler_check(own)
        sps = (s.samples_seen - since[1]) / max(now - since[0], 1e-9)
        lrs = logged_lrs(self.cfg, self.scheduler, self.groups, self.peak_lr, self.total_steps)
        own["goodput"] = self.goodput.figures()["goodput"]  # rank 0's is the run's; every rank's on Prometheus
        metrics = {"train_loss": mean[0], **lrs,
                   "samples_per_second": sps, **dict(zip(keys, mean[1:])), "straggler_ratio": straggler_ratio,
                   "goodput": own["goodput"],
                   **{f"samples_seen/{name}": n for name, n in self.order.source_counts(s.micro_step).items()}}
        if self.train_metrics is not None:
            metrics.update(self.train_metrics.take(self.env.device))
        if (tokens := self.task.tokens_per_sample()) is not None:
            metrics["tokens_per_second"] = sps * tokens
        if self.device_peak and self.sample_flops:  # model FLOPs per second of step time, over the device's peak
            flops = self.sample_flops * self.rows_per_worker * A
            own["mfu"] = flops / own["step_time_s"] / self.device_peak
            metrics["mfu"] = flops / metrics["step_time_s"] / self.device_peak
        if clock.checkpoint_blocked_s is not None:
            own["checkpoint_blocked_s"] = metrics["checkpoint_blocked_s"] = clock.checkpoint_blocked_s
            clock.checkpoint_blocked_s = None
        if self.env.checkpoint_write_s:  # the newest finished write (rank 0)
            metrics["checkpoint_write_s"] = self.env.checkpoint_write_s[-1]
            self.env.checkpoint_write_s.clear()
        clock.reset()
        return metrics, own

    def straggler_check(self, own: dict[str, float]) -> float:
        """straggler_ratio over every rank's own pace this interval (one all-reduce); rank 0 warns of a rank that
        stays the slowest (policies.Stragglers)."""
        rows = all_gather_rows([own["data_wait_s"], own["forward_s"]], self.env.device)
        ratio, warning = self.stragglers.observe([RankPace(*row) for row in rows], self.gang_nodes)
        if warning and self.rank0:
            log.warning(warning)
        return ratio

    # ---- the loop ----

    def fit(self) -> dict[str, Any]:
        self.setup()
        self.restore()
        stream = self.stream = self.open_stream()
        try:
            with trainer_blocks.compile_errors(self.cfg.train.compile), \
                    GarbageCollection(self.cfg.train.gc_every_steps) as self.collector:
                return self.train_loop(stream)
        except Exception:
            self.writer.settle()  # the checkpoint being written when the run failed is completed, not torn
            raise
        finally:
            if self.watchdog is not None:
                self.watchdog.close()
            stream.close()
            self.writer.close()

    def train_loop(self, stream: TrainStream) -> dict[str, Any]:
        sinks = self.sinks = self.open_sinks()
        cfg, env, s = self.cfg, self.env, self.state
        sample_log = _open_sample_log(self.plan.sample_log, env.world_rank)
        stop = self.stop = StopRequest(self.run_dir, env.device, env.world_size, env.preempted, env.stop_requested,
                                       group=self.control_group)
        stop.install()
        callbacks = self.callbacks
        cadence = Cadence(self.total_steps, cfg.train.log_every_steps, cfg.train.eval_every_steps,
                          cfg.checkpoint.every_steps, self.plan.val is not None)
        nonfinite = NonFinitePolicy(cfg.train.nonfinite, cfg.train.max_nonfinite_steps, self.spike_log)
        callbacks.fit_start()  # before the untrained evaluation, which may evaluate train.ema's average
        if s.initial_val_loss is None and self.plan.val is not None:
            s.initial_val_loss = self.evaluate()["val_loss"]
            log.info("untrained val_loss %.4f", s.initial_val_loss)
        self.model.train()
        clock, profiler = telemetry.StepClock(), telemetry.Profiler(cfg.train.profile_steps, self.run_dir, env)
        watchdog = self.watchdog = HangWatchdog(self.run_dir, env.world_rank, env.node, cfg.train.hang_timeout_s,
                                                nccl=env.device.type == "cuda").start()
        train_start, start_step, since = time.perf_counter(), s.step, (time.perf_counter(), s.samples_seen)
        # Until this run logs and evaluates, its latest figures are the checkpoint's (a finished run rerun keeps them).
        last_train = {k: v for k, v in self.checkpoint_metrics.items() if k == "train_loss"}
        last_val = {k: v for k, v in self.checkpoint_metrics.items() if k.startswith("val_")}
        status = self.ended or "completed"

        def log_train(metrics: dict[str, Any]) -> None:  # the step's training figures, averaged over ranks
            nonlocal since, last_train
            train, own = self.log_figures(nonfinite.loss, clock, since, stream.padding)
            train.update(self.gradient_figures(nonfinite.take_norms(), nonfinite.group_norms))
            since = (time.perf_counter(), s.samples_seen)
            metrics.update(train)
            eta = (self.total_steps - s.step) * (time.perf_counter() - train_start) / max(s.step - start_step, 1)
            sinks.train(metrics, own, eta)
            last_train = metrics

        self.goodput.training()
        while s.step < self.total_steps:
            watchdog.beat(s.step + 1)
            profiler.before_step(s.step)
            t_data = time.perf_counter()
            batches = self.micro_batches(stream, sample_log)  # augmentation: a function of the micro-step
            clock.data_wait += (waited := time.perf_counter() - t_data)
            self.goodput.waited_for("data_wait", waited)
            reseed(cfg.run.seed, env.world_rank, s.step)  # dropout: a function of the step
            result = self.step(batches)
            callbacks.optimizer_step()  # train.ema's update
            nonfinite.defer(s.step, result)  # read at the next log, evaluation or checkpoint step: no wait per step
            clock.steps += 1
            self.collector.step(s.step)
            sinks.step_done()
            profiler.after_step(s.step, sinks)

            metrics: dict[str, Any] = {"step": s.step, "epoch": self.stream.position(s.micro_step)[0],
                                       "samples_seen": s.samples_seen}
            due = cadence.due(s.step)
            if due.any:
                self.settle(nonfinite)
            if self.rank0 and (due.log or due.eval):  # before the sinks write: one file read per log step
                self.fence.still_holds()
            if due.log:
                log_train(metrics)
            if due.eval:
                t_eval = time.perf_counter()
                with watchdog.paused():
                    last_val = self.evaluate()
                clock.excluded += (waited := time.perf_counter() - t_eval)
                self.goodput.waited_for("evaluation", waited)
                metrics.update(last_val)
                sinks.eval(s.step, last_val)
                callbacks.eval_end(last_val)
            callbacks.step_end(metrics)
            # A signal, the stop file or a callback's request: every rank agrees, and the run checkpoints now.
            if stopping := stop.requested():
                if stop.preemption is None:
                    status = stop.status()
                    log.warning("stop requested (%s): checkpointing at step %d", status, s.step)
                elif self.rank0:
                    log.warning("%s: checkpointing at step %d", stop.preemption.describe(), s.step)
                if not due.log:  # a stop always logs
                    self.settle(nonfinite)
                    if self.rank0:
                        self.fence.still_holds()
                    log_train(metrics)
                due = cadence.due(s.step, stopping)
            if not due.any:
                continue
            sinks.step(s.step, metrics)
            t_ckpt = time.perf_counter()
            with watchdog.paused():
                staged = self.checkpoint(metrics) if due.checkpoint else None
            # Ray's report is a round trip through Train's synchronization actor on every rank (~7 ms here): done
            # where someone reads it (checkpoints, evaluations; a Tune trial's every log step), not every log step.
            if due.checkpoint or due.eval or self.plan.report_log_steps:
                env.report(_reportable(metrics), staged)
            if due.checkpoint:  # what training waited for: the previous write (if still going) and staging
                clock.checkpoint_blocked_s = time.perf_counter() - t_ckpt
                clock.excluded += clock.checkpoint_blocked_s
                self.goodput.waited_for("checkpoint", clock.checkpoint_blocked_s)
                callbacks.checkpoint()
            if stopping and stop.preemption is not None and s.step < self.total_steps:
                with watchdog.paused():
                    self.writer.wait()  # complete before the node goes; then nothing is trained that the restart loses
                    waited_out = stop.wait_out_preemption()
                if not waited_out:
                    if self.rank0:
                        log.warning("the gang was not ended by the preemption's deadline: training on")
                    continue
                status = stop.status()  # a stop requested while waiting: its checkpoint is this one
            if stopping:
                break

        if s.step == start_step and self.checkpoint_metrics:
            # Resumed from its last checkpoint with nothing left to train (a sweep killed after that checkpoint, a
            # finished run rerun): report its figures once more, so that Ray's and Tune's last result is the run's.
            env.report(_reportable(self.checkpoint_metrics), None)
        watchdog.close()
        self.writer.wait()  # a run never ends before its last checkpoint is complete
        profiler.close(sinks)
        stop.uninstall()
        if sample_log is not None:
            sample_log.close()
        summary = self.summary(status, stop, time.perf_counter() - train_start, start_step, last_train, last_val)
        summary["train_rows_read"] = stream.rows_read  # this rank's: a resume reads from its window on
        sinks.close(status)
        callbacks.fit_end(summary if self.rank0 else {"status": status, "stop_signal": summary["stop_signal"]})
        return summary if self.rank0 else {"status": status, "stop_signal": summary["stop_signal"]}

    def summary(self, status: str, stop: StopRequest, wall: float, start_step: int, last_train: dict,
                last_val: dict) -> dict[str, Any]:
        s, W = self.state, self.env.world_size
        # Replicas must hold identical weights after DDP training; the summary records each rank's checksum (FSDP:
        # of the full parameters gathered from the shards) and the parameter bytes each rank holds.
        checksum = (fsdp.full_param_checksum(self.model) if self.sharded
                    else float(sum(p.detach().double().sum() for p in self.raw_model.parameters())))
        per_rank = [(checksum, fsdp.local_param_bytes(self.raw_model), self.env.node, _peak_rss_bytes())]
        if W > 1:
            mine, per_rank = per_rank[0], [None] * W
            torch.distributed.all_gather_object(per_rank, mine)
        trained = s.step - start_step
        return {
            "status": status, "stop_signal": stop.signal() if status != "completed" else None, "world_size": W,
            "final": status == "completed" or status == self.ended or stop.final_status() is not None,
            "global_step": s.step, "epochs_completed": self.stream.epochs_completed(s.micro_step),
            "samples_seen": s.samples_seen, "rows_dropped": self.order.rows_dropped_per_epoch,
            "task": self.cfg.model.name, "facts": self.plan.facts,
            "train_loss": last_train.get("train_loss"), "val_loss": last_val.get("val_loss"),
            "initial_val_loss": s.initial_val_loss, **{k: v for k, v in last_val.items() if k != "val_loss"},
            "samples_per_second": trained * self.global_micro * self.cfg.train.grad_accum_steps / max(wall, 1e-9)
            if trained else None,
            "train_wall_s": wall, **self.goodput.figures(), **(self.spike_log.summary() if self.spike_log else {}),
            **self.sinks.summary(), "restarts": s.restarts,
            "preemptions": s.preemptions,
            "precision": self.precision_name, "strategy": self.strategy, **self.block_settings,
            "param_checksums": [c for c, *_ in per_rank], "param_bytes_per_worker": [b for _, b, *_ in per_rank],
            "worker_nodes": [n for _, _, n, _ in per_rank], "peak_rss_bytes_per_worker": [m for *_, m in per_rank],
            **({"mesh": self.mesh.summary([n for _, _, n, _ in per_rank]), "offload": self.cfg.train.fsdp.offload,
                "state_devices": fsdp.state_devices(self.raw_model, self.optimizer)} if self.mesh else {}),
            **({"init": self.init_record} if self.init_record else {}),
            **(self.callbacks.summary_fields() if self.rank0 else {}),  # checkpoint.keep_best's best_checkpoints
        }


def _peak_rss_bytes() -> int:
    """This process's peak resident memory since it started (Linux counts ru_maxrss in KiB): what an OOM on the host
    would be measured against."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _reportable(metrics: dict[str, Any]) -> dict[str, Any]:
    """What goes to the runtime's report: Tune reads "/" as nesting, so no lr/<group>."""
    return {k: v for k, v in metrics.items() if v is not None and "/" not in k}


def _open_sample_log(folder: str | None, rank: int):
    if not folder:
        return None
    Path(folder).mkdir(parents=True, exist_ok=True)
    return open(Path(folder) / f"rank{rank}.jsonl", "a", buffering=1)


def run(cfg: Config, env: WorkerEnv, plan: RunPlan) -> dict[str, Any]:
    """Train; returns rank 0's summary fields (the launcher writes summary.json from them)."""
    return Trainer(cfg, env, plan).fit()
