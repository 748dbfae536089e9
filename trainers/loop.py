"""The per-worker training loop.

`train_loop_per_worker(config)` is what Ray Train runs on every worker; `run()` is the loop itself and only
talks to the outside world through a `WorkerEnv` (rank, device, data, checkpoints, reports). trainers/torchrun.py
builds the same `WorkerEnv` from torch.distributed, so the loop runs unchanged under `torchrun`.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from datasets.order import Order, eval_rows
from datasets.parquet import Arrays, DataError, DataSpec, table_to_arrays
from trainers import checkpointing, fsdp, telemetry
from trainers.config import Config, from_dict, global_batch_size, global_micro_batch
from trainers.step import (Precision, build_model, build_optimizer, build_scheduler, evaluate, resolve_precision,
                           train_step, all_reduce_mean_many)

log = logging.getLogger("stride")


class TrainingError(RuntimeError):
    """A run that cannot go on (exit 1); the message is one line saying why and what to change."""


@dataclass
class WorkerEnv:
    """Everything the loop needs from its runtime (Ray Train or torchrun)."""

    world_rank: int
    world_size: int
    local_rank: int
    device: torch.device
    load_split: Callable[[str, DataSpec], Arrays]
    wrap_model: Callable[[torch.nn.Module], torch.nn.Module]
    latest_checkpoint: Callable[[], Path | None]
    # report(metrics, folder, write): every rank calls it the same number of times. On a checkpoint step rank 0
    # passes an empty folder and write(), which fills it from state already staged in CPU memory: the runtime may
    # run write() in the background, persists the folder, deletes it, and appends the whole write's seconds to
    # checkpoint_write_s.
    report: Callable[[dict[str, Any], Path | None, Callable[[], Path] | None], None]
    progress_bar: Callable[..., Any] | None = None
    # record(figures): this rank's figures of a log step to the runtime's metrics system (Ray: Prometheus gauges).
    record_metrics: Callable[[dict[str, Any]], None] | None = None
    checkpoint_write_s: list[float] = field(default_factory=list)


def setup_logging(world_rank: int) -> None:
    """Rank 0 logs at INFO, the others at WARNING; Stride's own handler, so other libraries stay as they are."""
    log.handlers.clear()
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter(f"[stride rank {world_rank}] %(asctime)s %(levelname)s %(message)s", "%H:%M:%S"))
    log.addHandler(handler)
    log.propagate = False
    log.setLevel(logging.INFO if world_rank == 0 else logging.WARNING)


def _to_batch(arrays: Arrays, rows: np.ndarray, cfg: Config, device: torch.device, stats) -> tuple[torch.Tensor, torch.Tensor]:
    x = arrays.x[rows]
    if cfg.model.name == "char_gpt":
        t = torch.from_numpy(x[:, : cfg.model.context + 1].astype(np.int64))
        inputs, targets = t[:, :-1], t[:, 1:]
    else:
        if stats is not None:
            x = (x - stats[0]) / stats[1]
        inputs, targets = torch.from_numpy(x), torch.from_numpy(arrays.y[rows])
    return inputs.to(device, non_blocking=True), targets.to(device, non_blocking=True)


def standardization(arrays: Arrays, cfg: Config):
    """Mean/std of the training features; constant columns get std 1 so they map to 0, never NaN or inf."""
    if cfg.model.name != "mlp" or not cfg.data.standardize:
        return None
    x = arrays.x.astype(np.float64)
    mean = np.nanmean(x, axis=0)
    std = np.nanstd(x, axis=0)
    std[~np.isfinite(std) | (std < 1e-12)] = 1.0
    return mean.astype(np.float32), std.astype(np.float32)


def handle_nan(arrays: Arrays, cfg: Config, split: str, fill: np.ndarray | None) -> None:
    if cfg.model.name != "mlp":
        return
    bad = np.isnan(arrays.x)
    if not bad.any():
        return
    if cfg.data.nan_policy == "error":
        raise DataError(f"data.{split}_path has {int(bad.sum())} NaN feature values; clean the data or set data.nan_policy=impute")
    col_fill = fill if fill is not None else np.nan_to_num(np.nanmean(arrays.x, axis=0))
    arrays.x[bad] = np.take(col_fill, np.nonzero(bad)[1])


def total_steps(cfg: Config, order: Order) -> int:
    if cfg.train.max_steps is not None:
        return cfg.train.max_steps
    return max(1, math.ceil(cfg.train.epochs * order.micro_steps_per_epoch / cfg.train.grad_accum_steps))


class MetricsFile:
    """metrics.jsonl, written by rank 0. On resume, lines past the checkpoint's step are dropped so the
    file continues exactly from the checkpointed step."""

    def __init__(self, path: Path, resume_step: int | None):
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        if resume_step is None:
            checkpointing.atomic_write_text(path, "")
        elif path.exists():
            keep = [ln for ln in path.read_text().splitlines() if ln.strip() and json.loads(ln)["step"] <= resume_step]
            checkpointing.atomic_write_text(path, "".join(ln + "\n" for ln in keep))

    def write(self, record: dict[str, Any]) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")


STOP_FILE = ".stride-stop"


def clear_stop_request(run_dir: str | Path) -> None:
    """A stale request from an earlier run must not stop this one: every launcher calls this before training."""
    (Path(run_dir) / STOP_FILE).unlink(missing_ok=True)


def request_stop(run_dir: str | Path, status: str, signum: int) -> None:
    """Ask a running job to checkpoint at the next step boundary and stop (used by signal handlers)."""
    checkpointing.atomic_write_text(Path(run_dir) / STOP_FILE, json.dumps({"status": status, "signal": signum}))


class StopRequest:
    """Preemption and interrupts: a stop file in the run folder (written by the driver's signal handler,
    or by anyone) or a signal to this process. Checked at every step boundary and agreed on by all
    ranks with one tiny all-reduce, so either every rank stops at the same step or none does."""

    def __init__(self, run_dir: Path, device: torch.device, world_size: int):
        self.path = run_dir / STOP_FILE
        self.device, self.world_size = device, world_size
        self.local: dict[str, Any] | None = None

    def on_signal(self, signum: int, _frame=None) -> None:
        self.local = {"status": "interrupted", "signal": signum}

    def install(self) -> None:
        import signal

        self.previous = {}
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
            try:
                self.previous[sig] = signal.signal(sig, self.on_signal)
            except ValueError:  # not the main thread (Ray Train runs the loop in a thread): the driver handles it
                return

    def uninstall(self) -> None:
        import signal

        for sig, handler in getattr(self, "previous", {}).items():
            signal.signal(sig, handler)

    def requested(self) -> bool:
        flag = 1.0 if (self.local is not None or self.path.exists()) else 0.0
        if self.world_size > 1:
            t = torch.tensor([flag], device=self.device if self.device.type == "cuda" else "cpu")
            torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
            flag = float(t[0])
        return flag > 0

    def status(self) -> str:
        return self._request().get("status", "interrupted")

    def signal(self) -> int | None:
        """The signal behind the request (this process's own, or the one the driver wrote), if any."""
        return self._request().get("signal")

    def _request(self) -> dict[str, Any]:
        try:
            return json.loads(self.path.read_text())
        except (OSError, ValueError):
            return self.local or {}


def start_profiler(device: torch.device):
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    profiler = torch.profiler.profile(activities=activities, record_shapes=True)
    profiler.start()
    return profiler


def stop_profiler(profiler, run_dir: Path, rank: int, world_size: int, tracker) -> None:
    """Every rank writes profile/rank<k>.json (Chrome trace: Perfetto, chrome://tracing); rank 0 then logs the
    traces it can see to MLflow (all of them when run_dir is shared)."""
    profiler.stop()
    out = run_dir / "profile"
    out.mkdir(parents=True, exist_ok=True)
    profiler.export_chrome_trace(str(out / f"rank{rank}.json"))
    log.info("profile trace written to %s", out / f"rank{rank}.json")
    if world_size > 1:
        torch.distributed.barrier()
    if tracker is not None:
        for trace in sorted(out.glob("rank*.json")):
            tracker.log_artifact(trace, "profile")


def step_seed(seed: int, rank: int, step: int) -> int:
    """The seed of `rank`'s random stream (dropout) for optimizer step `step`: different per rank and step, the
    same after any resume. Reseeding costs microseconds and needs no RNG state in checkpoints."""
    return int(np.random.SeedSequence([seed, rank, step]).generate_state(1, np.uint64)[0] >> 1)


def run(cfg: Config, env: WorkerEnv, runtime: dict[str, Any]) -> dict[str, Any]:
    """Train; returns rank 0's summary fields (the driver writes summary.json from them)."""
    rank0 = env.world_rank == 0
    setup_logging(env.world_rank)
    if cfg.train.deterministic:
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    if env.device.type == "cpu":
        torch.set_num_threads(cfg.train.num_threads or max(1, int(runtime.get("cpus_per_worker", 1))))

    # ---- data: every worker holds the split in memory; the order is a function of (seed, epoch) ----
    t0 = time.perf_counter()
    train_spec: DataSpec = runtime["train_spec"]
    train = env.load_split("train", train_spec)
    val = env.load_split("val", runtime["val_spec"]) if runtime.get("val_spec") else None
    stats = standardization(train, cfg)
    handle_nan(train, cfg, "train", None)
    if val is not None:
        handle_nan(val, cfg, "val", None if stats is None else stats[0])
    B, W, A = cfg.train.batch_size_per_worker, env.world_size, cfg.train.grad_accum_steps
    # GM rows per micro-step over all workers (B x W; elastic runs: B x max workers, whatever W is now).
    GM = global_micro_batch(cfg, W)
    rows_per_worker = GM // W  # B, or an elastic run's share of B x max workers
    order = Order(len(train), cfg.run.seed, GM)
    if order.micro_steps_per_epoch == 0:
        raise DataError(f"train.batch_size_per_worker ({B}) x {GM // B} workers exceeds the {len(train)} training "
                        f"rows; use a smaller train.batch_size_per_worker")
    steps = total_steps(cfg, order)
    log.info("data: %d train rows, %s val rows, loaded in %.1fs; global batch %d = %d per worker x %d workers x %d "
             "accumulation; %d rows dropped per epoch", len(train), len(val) if val is not None else 0,
             time.perf_counter() - t0, global_batch_size(cfg, W), rows_per_worker, W, A, order.rows_dropped_per_epoch)

    # ---- model: identical init on every rank, per-rank RNG for dropout ----
    torch.manual_seed(cfg.run.seed)
    in_features = train.x.shape[1] if cfg.model.name == "mlp" else None
    model = build_model(cfg, in_features, runtime.get("num_classes")).to(env.device)
    precision_name = resolve_precision(cfg.train.precision, env.device)
    sample_flops = telemetry.flops_per_sample(cfg.model.name, sum(p.numel() for p in model.parameters()), cfg.model)
    device_peak = telemetry.peak_flops(env.device, precision_name, cfg.train.peak_flops)
    if precision_name != "fp32" and env.device.type == "cpu" and rank0:
        log.warning("train.precision=%s on CPU runs in emulation, many times slower than fp32; "
                    "use train.precision=auto (fp32 on CPU) unless you are testing mixed precision", precision_name)
    # train.strategy=fsdp: shard before the optimizer is built, so that it holds (and updates) only the shards.
    sharded = cfg.train.strategy == "fsdp" and W > 1
    if cfg.train.strategy == "fsdp" and not sharded and rank0:
        log.info("train.strategy=fsdp with 1 worker: nothing to shard, training unsharded")
    precision = Precision.create(precision_name, env.device, sharded)
    strategy = "fsdp" if sharded else "ddp" if W > 1 else "none"
    if sharded:
        model = fsdp.shard_model(model, env.device, W, precision.fsdp_param_dtype)
    optimizer = build_optimizer(cfg, model, W)
    scheduler = build_scheduler(cfg, optimizer, steps)
    scaler = precision.grad_scaler()

    # ---- restore ----
    # A caller that already opened the MLflow run (a restarted Tune trial with no checkpoint yet) passes its id.
    step, micro_step, samples_seen, restarts, mlflow_run_id = 0, 0, 0, 0, runtime.get("mlflow_run_id")
    ckpt_dir = env.latest_checkpoint()
    if ckpt_dir is not None:
        # FSDP: only rank 0's copy of the weights is read (and broadcast); the other ranks map the file.
        state, meta = checkpointing.load(ckpt_dir, mmap=sharded)
        mismatch = checkpointing.shape_mismatch(model.state_dict(), state["model"])
        if mismatch:
            raise DataError(f"checkpoint {ckpt_dir} does not fit model (the {mismatch}); use a new run.name "
                            f"or the model settings it was trained with")
        # Either strategy's checkpoint loads under either strategy and any world size: both hold the full model;
        # the optimizer is keyed by position (DDP, 1 worker) or by parameter name (FSDP).
        if sharded:
            fsdp.load_full_state_dict(model, optimizer, state["model"], state["optimizer"], env.world_rank)
        else:
            model.load_state_dict(state["model"])
            optimizer.load_state_dict(fsdp.optimizer_state_by_ids(state["optimizer"],
                                                                  fsdp.optimizer_param_names(model, optimizer)))
        scheduler.load_state_dict(state["scheduler"])
        scaler.load_state_dict(state["scaler"])
        step, samples_seen = meta["step"], meta["samples_seen"]
        # The data position is (epoch, samples into the epoch): valid for any world size with the same
        # global micro-batch (elastic resume), translated into this run's micro-step counter.
        epoch, offset = meta["epoch"], meta["epoch_offset_samples"]
        if offset % order.global_micro_batch:
            raise DataError(f"checkpoint position ({offset} samples into epoch {epoch}) is not a multiple of the "
                            f"global micro-batch {order.global_micro_batch}; resume with the same "
                            f"train.batch_size_per_worker x num_workers as before")
        micro_step = epoch * order.micro_steps_per_epoch + offset // order.global_micro_batch
        restarts = meta.get("restarts", 0) + 1
        mlflow_run_id = meta.get("mlflow_run_id") or mlflow_run_id
        log.info("resumed from %s at step %d (epoch %d, +%d samples), restart %d", ckpt_dir, step, epoch, offset, restarts)
    if not sharded:  # DDP (Ray: prepare_model; torchrun: DistributedDataParallel); FSDP sharded above
        model = env.wrap_model(model)
    raw_model = getattr(model, "module", model)

    # ---- rank-0 duties: metrics file, MLflow, progress ----
    run_dir = Path(runtime["run_dir"])
    metrics_file = MetricsFile(run_dir / "metrics.jsonl", step if ckpt_dir is not None else None) if rank0 else None
    tracker = None
    if rank0 and runtime.get("mlflow_uri"):
        from trainers.tracking import Tracker

        tracker = Tracker(runtime["mlflow_uri"], cfg.tracking.experiment, cfg.run.storage_path)
        mlflow_run_id = tracker.start(cfg.run.name, mlflow_run_id, cfg.to_dict(), runtime.get("mlflow_parent_run_id"))
    bar = env.progress_bar(total=steps, initial=step, desc=cfg.run.name) if rank0 and env.progress_bar else None
    # Debugging aid (and the exactly-once tests): every rank logs the sample_ids it trains on.
    sample_log = None
    if runtime.get("sample_log"):
        Path(runtime["sample_log"]).mkdir(parents=True, exist_ok=True)
        sample_log = open(Path(runtime["sample_log"]) / f"rank{env.world_rank}.jsonl", "a", buffering=1)
    stop = StopRequest(run_dir, env.device, W)
    stop.install()
    status = "completed"

    def batches_for_eval():
        rows = eval_rows(len(val), env.world_rank, W)
        eb = max(B, 64)
        for i in range(0, len(rows), eb):
            yield _to_batch(val, rows[i:i + eb], cfg, env.device, stats)
        if sharded:
            # Every FSDP forward all-gathers, so every rank must run as many as rank 0 (which has the most rows):
            # the others pad with a batch whose targets are all ignored (-100).
            mine, most = math.ceil(len(rows) / eb), math.ceil(len(eval_rows(len(val), 0, W)) / eb)
            for _ in range(most - mine):
                x, y = _to_batch(val, rows[:1] if len(rows) else np.arange(1), cfg, env.device, stats)
                yield x, torch.full_like(y, -100)

    def run_eval() -> dict[str, Any]:
        if val is None:
            return {}
        out = evaluate(model, precision, batches_for_eval(), cfg.model.name == "char_gpt", env.device)
        if sharded:
            fsdp.reshard(model)  # a forward without backward leaves the root unsharded
        return out

    def save_checkpoint(metrics: dict[str, Any]) -> tuple[Path, Callable[[], Path]] | None:
        epoch, in_epoch = order.position(micro_step)
        # No RNG state to gather: every rank reseeds from (seed, rank, step) at each step (step_seed), so the
        # step stored here restores every rank's random stream, for any world size.
        if sharded:  # a collective: every rank sends its shards, rank 0 gets the full model and optimizer state
            model_state, optim_state = fsdp.full_state_dict(model, optimizer)
        if not rank0:
            return None
        if not sharded:
            model_state, optim_state = raw_model.state_dict(), optimizer.state_dict()
        folder = Path(tempfile.mkdtemp(prefix="stride-ckpt-"))
        # Staged: a CPU copy taken now; serialising and writing it happen in write(), possibly in the background.
        state = checkpointing.stage({"model": model_state, "optimizer": optim_state,
                                     "scheduler": scheduler.state_dict(), "scaler": scaler.state_dict()})
        meta = {"step": step, "epoch": epoch, "epoch_offset_samples": in_epoch * order.global_micro_batch,
                "samples_seen": samples_seen, "restarts": restarts, "mlflow_run_id": mlflow_run_id,
                "world_size": W, "model": cfg.model.name, "initial_val_loss": initial_val, "metrics": metrics,
                "strategy": strategy}
        return folder, lambda: checkpointing.save(folder, state, meta)

    initial_val = None
    if ckpt_dir is not None:
        initial_val = meta.get("initial_val_loss")
    if initial_val is None and val is not None:
        initial_val = run_eval()["val_loss"]
        log.info("untrained val_loss %.4f", initial_val)

    # ---- the loop ----
    model.train()
    last_log_t, last_log_samples = time.perf_counter(), samples_seen
    train_start = time.perf_counter()
    start_step = step
    last_metrics: dict[str, Any] = {}
    last_val: dict[str, Any] = {}
    nonfinite_run = 0
    clock = telemetry.StepClock()
    profiler = None
    while step < steps:
        if cfg.train.profile_steps and step + 1 == cfg.train.profile_steps[0]:
            profiler = start_profiler(env.device)
        torch.manual_seed(step_seed(cfg.run.seed, env.world_rank, step))  # dropout: a function of the step
        t_data = time.perf_counter()
        micro = []
        for _ in range(A):
            rows = order.rows(micro_step, env.world_rank, W)
            if sample_log is not None:
                sample_log.write(json.dumps({"step": step, "micro_step": micro_step, "rank": env.world_rank, "world_size": W,
                                             "sample_ids": train.sample_id[rows].tolist()}) + "\n")
            micro.append(_to_batch(train, rows, cfg, env.device, stats))
            micro_step += 1
        clock.data_wait += time.perf_counter() - t_data
        try:
            result = train_step(model, optimizer, scaler, precision, micro, cfg.optim.grad_clip_norm)
        except torch.OutOfMemoryError:
            raise TrainingError(
                f"out of memory at step {step + 1} with train.batch_size_per_worker={B}; use a smaller "
                f"train.batch_size_per_worker with more train.grad_accum_steps (same global batch), "
                f"train.precision=bf16, or train.strategy=fsdp") from None
        scheduler.step()
        step += 1
        if result.finite:
            nonfinite_run = 0
        else:
            nonfinite_run += 1
            what = f"non-finite loss/gradients at step {step} (loss {result.loss:.4g}, grad norm {result.grad_norm:.4g})"
            if cfg.train.nonfinite == "stop" or nonfinite_run >= cfg.train.max_nonfinite_steps:
                raise TrainingError(f"{what}, {nonfinite_run} in a row; the last good checkpoint is kept: lower "
                                    f"optim.lr, set optim.grad_clip_norm, or check the data for NaN")
            if rank0 and not scaler.is_enabled():
                log.warning("%s: step skipped (%d in a row, limit train.max_nonfinite_steps=%d)", what,
                            nonfinite_run, cfg.train.max_nonfinite_steps)
        samples_seen += GM * A
        clock.steps += 1
        if bar is not None:
            bar.update(1)
        if profiler is not None and step == cfg.train.profile_steps[1]:
            stop_profiler(profiler, run_dir, env.world_rank, W, tracker)
            profiler = None

        stopping = stop.requested()
        if stopping:
            status = stop.status()
            log.warning("stop requested (%s): checkpointing at step %d", status, step)
        is_last = step == steps or stopping
        is_log = step % cfg.train.log_every_steps == 0 or is_last
        is_eval = val is not None and ((cfg.train.eval_every_steps and step % cfg.train.eval_every_steps == 0)
                                       or (is_last and not stopping))
        is_ckpt = (cfg.checkpoint.every_steps and step % cfg.checkpoint.every_steps == 0) or is_last
        if not (is_log or is_eval or is_ckpt):
            continue
        epoch = order.position(micro_step)[0]
        metrics: dict[str, Any] = {"step": step, "epoch": epoch, "samples_seen": samples_seen}
        if is_log:
            now = time.perf_counter()
            own = clock.figures()
            if env.device.type == "cuda":
                own["gpu_memory_bytes"] = float(torch.cuda.max_memory_allocated(env.device))
                torch.cuda.reset_peak_memory_stats(env.device)
            # One all-reduce per log step: the loss and this rank's timings, averaged over ranks.
            keys = ("step_time_s", "data_wait_s", "data_wait_fraction")
            mean = all_reduce_mean_many([result.loss, *(own[k] for k in keys)], env.device)
            sps = (samples_seen - last_log_samples) / max(now - last_log_t, 1e-9)
            last_log_t, last_log_samples = now, samples_seen
            metrics.update(train_loss=mean[0], lr=scheduler.get_last_lr()[0], samples_per_second=sps,
                           **{k: v for k, v in zip(keys, mean[1:])})
            if cfg.model.name == "char_gpt":
                metrics["tokens_per_second"] = sps * cfg.model.context
            if device_peak:  # this rank's model FLOPs per second of step time, over its device's peak
                own["mfu"] = sample_flops * rows_per_worker * A / own["step_time_s"] / device_peak
                metrics["mfu"] = sample_flops * rows_per_worker * A / metrics["step_time_s"] / device_peak
            if clock.checkpoint_blocked_s is not None:
                own["checkpoint_blocked_s"] = metrics["checkpoint_blocked_s"] = clock.checkpoint_blocked_s
                clock.checkpoint_blocked_s = None
            if env.checkpoint_write_s:  # the newest finished write (rank 0)
                metrics["checkpoint_write_s"] = env.checkpoint_write_s[-1]
                env.checkpoint_write_s.clear()
            if env.record_metrics is not None:
                env.record_metrics({**metrics, **own})
            clock.reset()
            loss = metrics["train_loss"]
            if rank0:
                metrics_file.write({k: metrics[k] for k in ("step", "epoch", "samples_seen", "train_loss", "lr",
                                                            "samples_per_second", *keys, "tokens_per_second", "mfu",
                                                            "checkpoint_blocked_s", "checkpoint_write_s")
                                   if k in metrics})
                if bar is not None:
                    bar.set_postfix(loss=f"{loss:.4f}", sps=f"{sps:.0f}")
                else:
                    eta = (steps - step) * (now - train_start) / max(step - start_step, 1)
                    log.info("step %d/%d epoch %d loss %.4f lr %.2e %.0f samples/s eta %.0fs",
                             step, steps, epoch, loss, metrics["lr"], sps, eta)
            last_metrics = metrics
        if is_eval:
            t_eval = time.perf_counter()
            last_val = run_eval()
            clock.excluded += time.perf_counter() - t_eval
            metrics.update(last_val)
            if rank0:
                metrics_file.write({"step": step, "val_loss": last_val["val_loss"], "val_accuracy": last_val["val_accuracy"]})
                log.info("step %d val_loss %.4f%s", step, last_val["val_loss"],
                         f" val_accuracy {last_val['val_accuracy']:.4f}" if last_val["val_accuracy"] is not None else "")
        if tracker is not None:
            tracker.log_metrics({k: v for k, v in metrics.items() if k not in ("step",)}, step)
        t_ckpt = time.perf_counter()
        staged = save_checkpoint(metrics) if is_ckpt else None
        # Ray's report is a round trip through Train's synchronization actor on every rank (~7 ms here): done
        # where someone reads it (checkpoints, evaluations; a Tune trial's every log step), not on every log step.
        if is_ckpt or is_eval or runtime.get("report_log_steps"):
            env.report({k: v for k, v in metrics.items() if v is not None}, *(staged or (None, None)))
        if is_ckpt:  # what training waited for: staging, plus the write itself where the runtime writes in line
            clock.checkpoint_blocked_s = time.perf_counter() - t_ckpt
            clock.excluded += clock.checkpoint_blocked_s
        if stopping:
            break

    if profiler is not None:  # the run ended (or stopped) inside the profiled range
        stop_profiler(profiler, run_dir, env.world_rank, W, tracker)
    if bar is not None:
        bar.close()
    stop.uninstall()
    if sample_log is not None:
        sample_log.close()
    wall = time.perf_counter() - train_start
    # Replicas must hold identical weights after DDP training; the summary records each rank's checksum (FSDP:
    # of the full parameters gathered from the shards) and the parameter bytes each rank holds.
    if sharded:
        checksum = fsdp.full_param_checksum(model)
    else:
        checksum = float(sum(p.detach().double().sum() for p in raw_model.parameters()))
    per_rank = [None] * W
    if W > 1:
        torch.distributed.all_gather_object(per_rank, (checksum, fsdp.local_param_bytes(raw_model)))
    else:
        per_rank = [(checksum, fsdp.local_param_bytes(raw_model))]
    summary = {
        "status": status, "stop_signal": stop.signal() if status != "completed" else None, "world_size": W, "global_step": step, "epochs_completed": micro_step / order.micro_steps_per_epoch,
        "samples_seen": samples_seen, "rows_dropped": order.rows_dropped_per_epoch,
        "train_loss": last_metrics.get("train_loss"), "val_loss": last_val.get("val_loss"),
        "initial_val_loss": initial_val, "val_accuracy": last_val.get("val_accuracy"),
        "val_bpb": last_val.get("val_bpb"),
        "samples_per_second": (step - start_step) * GM * A / max(wall, 1e-9) if step > start_step else None,
        "train_wall_s": wall, "mlflow_run_id": mlflow_run_id, "restarts": restarts, "precision": precision_name,
        "param_checksums": [c for c, _ in per_rank], "strategy": strategy,
        "param_bytes_per_worker": [b for _, b in per_rank],
    }
    if tracker is not None:
        tracker.finish()
    return summary if rank0 else {"status": status, "stop_signal": summary["stop_signal"]}


# ---- Ray Train edge ----

def train_loop_per_worker(config: dict[str, Any]) -> dict[str, Any]:
    """Entry point Ray Train runs on each worker: builds the Ray `WorkerEnv`, then `run()`."""
    import ray.train
    import ray.train.torch

    from ray.train.v2._internal.execution import context as train_context
    from ray.train.v2._internal.execution import storage as train_storage

    # Ray logs one INFO line per report and per checkpoint (loggers named after their files); Stride's say more.
    train_context.logger.setLevel(logging.WARNING)
    train_storage.logger.setLevel(logging.WARNING)
    ctx = ray.train.get_context()
    cfg = from_dict(config["cfg"])
    runtime = config["runtime"]

    def load_split(name: str, spec: DataSpec) -> Arrays:
        import pyarrow as pa

        shard = ray.train.get_dataset_shard(name)
        batches = [b for b in shard.iter_batches(batch_size=None, batch_format="pyarrow", prefetch_batches=2)]
        table = pa.concat_tables(batches) if batches else None
        if table is None:
            raise DataError(f"data.{name}_path produced no rows through Ray Data")
        return table_to_arrays(table, spec)

    def latest_checkpoint() -> Path | None:
        # Not ray.train.get_checkpoint(): Ray's pointer misses a checkpoint written but never registered (driver
        # killed in between), and run.storage_path is a local (or shared) folder that every worker reads.
        return checkpointing.newest_complete(Path(runtime["run_dir"]), log.warning if ctx.get_world_rank() == 0 else None)

    def report(metrics: dict[str, Any], folder: Path | None, write: Callable[[], Path] | None) -> None:
        if folder is None:
            ray.train.report(metrics)
            return
        from ray.train import CheckpointUploadMode

        storage = ray.train.get_context().get_storage()

        def upload(checkpoint, dir_name: str):
            # Ray's upload thread: serialise the staged state, then copy it to storage, retrying transient errors.
            t0 = time.perf_counter()
            write()
            persisted = checkpointing.with_retries(lambda: storage.persist_current_checkpoint(checkpoint, dir_name),
                                                   f"{storage.experiment_fs_path}/{dir_name}")
            env.checkpoint_write_s.append(time.perf_counter() - t0)
            return persisted

        ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(str(folder)),
                         checkpoint_upload_mode=CheckpointUploadMode.ASYNC, delete_local_checkpoint_after_upload=True,
                         checkpoint_upload_fn=upload)

    def progress_bar(**kwargs):
        from ray.experimental.tqdm_ray import tqdm

        return tqdm(**kwargs)

    env = WorkerEnv(
        world_rank=ctx.get_world_rank(), world_size=ctx.get_world_size(), local_rank=ctx.get_local_rank(),
        device=ray.train.torch.get_device(), load_split=load_split,
        wrap_model=lambda m: ray.train.torch.prepare_model(m) if ctx.get_world_size() > 1 else m,
        latest_checkpoint=latest_checkpoint, report=report,
        progress_bar=progress_bar if runtime.get("progress_bar") else None,
        # Prometheus: stride_samples_per_second ... stride_checkpoint_blocked_seconds (trainers/telemetry.py).
        record_metrics=telemetry.Gauges(cfg.run.name, ctx.get_world_rank()).record,
    )
    return run(cfg, env, runtime)
