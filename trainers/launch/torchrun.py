"""Run Stride's loop without Ray, under torchrun: the same step, eval and checkpoint code as on Ray Train.

    torchrun --nproc-per-node 2 trainers/torchrun.py --config trainers/configs/char_gpt.yaml [section.field=value ...]

Used for A/B benchmarks against Ray Train and on machines without Ray. Data stream as under Ray (datasets/stream.py);
checkpoints go to <run.storage_path>/<run.name>/checkpoint_<step>; the same run name resumes. The gang is torchrun's:
scaling.num_workers is --nproc-per-node, scaling.max_failures and resize_check_s are refused (check_scaling), and
scaling.preflight checks torchrun's own processes (ray_cluster/doctor.py's check_gang_in_place).
"""

from __future__ import annotations

from stride.errors import RunLockedError
import math
import os
import socket
import sys
import time
from concurrent.futures import Future
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist

from stride.errors import EXIT_FAILED, StrideError
from stride.errors import UsageError
from stride.trainers.launch.scaling import gpu_shortfall
from stride.trainers.launch import lifecycle
from stride.trainers.run import lock as runlock
from stride.trainers.config_reader import load_config
from stride.trainers.launch.checks import prepare
from stride.trainers.loop import WorkerEnv, plan_run, run
from stride.trainers.step import ddp_options
from stride.trainers.run.storage import import_library, location_of
from stride.trainers.policies import clear_stop_request


# Retention is the checkpoint module's (the names kept here for their callers).
from stride.trainers.run.retention import complete_checkpoints, prune_checkpoints


# How long a rank other than 0 holds back an error it found before the gang started: every rank reads the same config
# and data, so rank 0 finds the same error and shows it, and torchrun ends this rank as soon as rank 0 exits. A rank
# still alive after this found an error of its own (a node's own GPUs, a path only its node lacks): it shows it then.
QUIET_RANK_WAIT_S = 10.0


def main(argv: list[str] | None = None) -> int:
    """Exit codes as the Ray driver's: 2 and one line for a problem the user can fix (config, data, GPUs this node
    lacks, a checkpoint of another model), 1 and one line for a failed run, 128 + the signal after a checkpointed
    stop. torchrun itself exits 1 when a rank fails, after its own report (which names the line: stride/cli.py's
    record_for_torchrun)."""
    from stride.cli import ArgumentParser

    ap = ArgumentParser(prog="torchrun ... trainers/torchrun.py")
    ap.add_argument("--config", required=True)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)
    try:
        return train(args.config, args.overrides)
    except StrideError as e:
        show_error(e)
        return e.exit_code


def show_error(e: StrideError) -> None:
    """The run's one error line. An error found before the gang started (config, data, scaling.*) is shown once, by
    rank 0; the other ranks hold theirs back (QUIET_RANK_WAIT_S) and torchrun ends them when rank 0 exits. Errors
    found in the gang are every rank's own line, as before."""
    from stride.cli import error_line, record_for_torchrun

    rank, world_size, _ = gang_rank()
    if rank != 0 and world_size > 1 and under_torchrun() and not dist.is_initialized():
        record_for_torchrun(f"stride: error: {e}")  # torchrun's report names it if this rank is the first to go
        time.sleep(QUIET_RANK_WAIT_S)
    error_line(e)


# scaling.* settings of Ray's that torchrun has no counterpart for, and what to use instead. The others work under
# torchrun: use_gpu (against this node's devices), cpus_per_worker (each rank's CPU threads, checked against this
# node's cores), preflight (the doctor's checks on torchrun's gang); num_workers is torchrun's --nproc-per-node.
RAY_ONLY_SCALING = {
    "max_failures": "torchrun's --max-restarts",
    "resize_check_s": "torchrun's elastic --nnodes MIN:MAX",
    "hang_detector": "train.hang_timeout_s (Stride's own watchdog, on both launchers)",
}


def check_scaling(cfg, local_world_size: int, cores: int) -> None:
    """scaling.* under torchrun, before anything starts: a Ray-only key set away from its default is refused rather
    than ignored, and --nproc-per-node x scaling.cpus_per_worker must fit this node's `cores` (as a Ray gang must fit
    the cluster). UsageError, exit 2."""
    from stride.trainers.config import ScalingSection

    for key, instead in RAY_ONLY_SCALING.items():
        value = getattr(cfg.scaling, key)
        if value != ScalingSection.model_fields[key].default:
            shown = f"{value:g}" if isinstance(value, (int, float)) else value
            raise UsageError(f"scaling.{key} ({shown}) is a Ray setting that torchrun cannot honour; use {instead}, "
                             f"or run on Ray")
    cpus = cfg.scaling.cpus_per_worker
    if local_world_size * cpus > cores + 1e-9:
        fit = math.floor(cores / local_world_size * 100) / 100  # rounded down: the value named must fit
        raise UsageError(f"--nproc-per-node ({local_world_size}) x scaling.cpus_per_worker ({cpus:g}) = "
                         f"{local_world_size * cpus:g} CPUs exceeds this node's {cores} CPUs; use "
                         + (f"scaling.cpus_per_worker={fit:g}" if fit >= 0.1 else f"--nproc-per-node {cores}"))


def usable_cores() -> int:
    """The cores this process may run on: its CPU affinity, which a container or taskset may narrow."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def take_run_lock(cfg, task, rank: int, world_size: int) -> tuple[runlock.RunLock | None, str]:
    """Rank 0 opens the run (lifecycle.open_run: storage, lock, resume check) and beats the lock; every rank gets its
    token (the workers' fence), or rank 0's one-line refusal, so that a refused run exits 2 on every rank instead of
    leaving the others in a collective."""
    lock, outcome, refusal = None, None, None
    if rank == 0:
        try:
            lock = lifecycle.open_run(cfg, task, runlock.launcher_instance())
            outcome = ("held", lock.token)
        except UsageError as e:
            refusal, outcome = e, ("refused", str(e))
    elif (location := location_of(cfg.run.storage_path)) is not None:
        import_library(location.scheme)  # while rank 0 takes the lock: off this rank's way to its first step
    if world_size > 1:
        box = [outcome]
        dist.broadcast_object_list(box, src=0)
        outcome = box[0]
    if refusal is not None:
        raise refusal
    if outcome[0] == "refused":
        raise RunLockedError(outcome[1])
    return lock, outcome[1]


def gang_rank() -> tuple[int, int, int]:
    """(rank, world size, local rank) of this process in torchrun's gang (one process without torchrun)."""
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("LOCAL_RANK", "0"))


def start_gang(cfg) -> torch.device:
    """This process's device, and the process group of torchrun's gang. scaling.use_gpu as on Ray, against this
    node's devices (one per process): refused (exit 2) before anything is written, never quietly run on the CPU."""
    _, world_size, local_rank = gang_rank()
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if problem := gpu_shortfall(cfg.scaling.use_gpu, local_world_size, gpus, workers_key="--nproc-per-node",
                                where="this node"):
        raise UsageError(problem)
    use_cuda = gpus > 0 and cfg.scaling.use_gpu is not False
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    if world_size > 1:
        dist.init_process_group("nccl" if use_cuda else "gloo", timeout=timedelta(seconds=cfg.train.collective_timeout_s))
    return device


def leave_gang() -> None:
    """Free the DDP/FSDP modules (reference cycles) while the interpreter is alive: left to interpreter
    finalization, gloo's work threads could be torn down unjoined ("terminate called without an active exception",
    SIGABRT) after a run that had finished its work."""
    if dist.is_initialized():
        import gc

        gc.collect()
        dist.destroy_process_group()


def preflight(cfg, device: torch.device, rank: int) -> None:
    """scaling.preflight under torchrun: the doctor's quick checks on this gang's own processes (versions, GPUs, GEMM,
    storage from each node, all-reduce on the process group), judged as on Ray (driver.judge_preflight): every rank
    gets the same rows, so a failure is exit 2 on every rank; rank 0 prints."""
    from stride.ray_cluster.doctor import check_gang_in_place
    from stride.trainers.launch.checks import judge_preflight

    t0 = time.perf_counter()
    judge_preflight(check_gang_in_place(device, str(cfg.run_dir.parent), quick=True), t0, show=rank == 0)


def train(config: str, overrides: list[str]) -> int:
    cfg = load_config(config, overrides)
    rank, world_size, local_rank = gang_rank()
    check_scaling(cfg, int(os.environ.get("LOCAL_WORLD_SIZE", "1")), usable_cores())
    task, specs = prepare(cfg, world_size)
    device = start_gang(cfg)
    use_cuda = device.type == "cuda"
    if cfg.scaling.preflight:
        preflight(cfg, device, rank)

    run_dir = cfg.run_dir

    def ddp(m: torch.nn.Module) -> torch.nn.Module:
        return torch.nn.parallel.DistributedDataParallel(m, device_ids=[local_rank] if use_cuda else None,
                                                         **ddp_options(m))

    def report(metrics: dict, written: Future | None) -> None:
        # Every rank writes its shards into run_dir/checkpoint_<step> in the background; rank 0 prunes the old ones
        # once the new one is complete.
        if written is not None and rank == 0:
            written.add_done_callback(prune)

    def prune(written: Future) -> None:
        if written.exception() is None:  # a failed write is the loop's to raise; keep every older checkpoint
            prune_old()

    def prune_old() -> None:
        prune_checkpoints(run_dir, cfg.checkpoint.keep_last)

    def progress_bar(**kwargs):
        from tqdm import tqdm

        return tqdm(**kwargs)

    def train_here(token: str | None) -> dict[str, Any]:
        if rank == 0:
            clear_stop_request(run_dir)
        if world_size > 1:
            dist.barrier()
        plan = plan_run(cfg, specs, task.facts, progress_bar=sys.stdout.isatty(), run_lock_token=token)
        env = WorkerEnv.for_gang(rank, world_size, local_rank, device, socket.gethostname(), plan, wrap_model=ddp,
                                 report=report, progress_bar=progress_bar)
        summary = run(cfg, env, plan)
        if rank == 0:
            # A future's done-callbacks run after its waiters wake: the last write's prune may not have run yet.
            prune_old()
            ckpts = complete_checkpoints(run_dir)
            summary["checkpoint"] = str(ckpts[-1]) if ckpts else None
        return summary

    def still_ours(lock: runlock.RunLock) -> bool:
        # A gang whose folder another run took over ends with the fence's error line, as its workers would.
        runlock.fence_for(cfg, run_dir, lock.token).still_holds()
        return True

    summary = lifecycle.train_and_record(cfg, lambda: take_run_lock(cfg, task, rank, world_size), train_here,
                                         still_ours=still_ours, runtime="torchrun")
    if rank == 0:
        # The Ray driver's end-of-run lines: status and figures, summary, metrics, checkpoint, trackers; and the
        # error line of a completed run whose summary the storage refused (record_summary).
        lifecycle.report_paths(cfg, run_dir, summary)
    leave_gang()
    if summary["status"] == "failed":
        return EXIT_FAILED
    # Stopped by SIGTERM/SIGINT (checkpointed): 128 + the signal, as the Ray driver exits; the same command resumes.
    return 128 + summary["stop_signal"] if summary.get("stop_signal") else 0


def under_torchrun() -> bool:
    """Whether torchrun (torch.distributed.run) started this process: it sets TORCHELASTIC_RUN_ID for its workers."""
    return "TORCHELASTIC_RUN_ID" in os.environ


def on_rank0(fn: Callable[[], None], rank: int, world_size: int) -> None:
    """`fn` on rank 0; its refusal (a StrideError) raised on every rank, so that the gang exits alike."""
    refusal = None
    if rank == 0:
        try:
            fn()
        except StrideError as e:
            refusal = e
    if world_size > 1:
        box = [None if refusal is None else (type(refusal), str(refusal))]
        dist.broadcast_object_list(box, src=0)  # within the gang's own process group: nothing from storage
        if box[0] is not None and refusal is None:
            refusal = box[0][0](box[0][1])
    if refusal is not None:
        raise refusal


def run_job(cfg, job, plan, before) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    """A command's job (jobs.py) in place, on the gang torchrun started: (the result on rank 0, None elsewhere;
    where it ran). `before` runs on rank 0 first, and its refusal ends every rank alike."""

    rank, world_size, local_rank = gang_rank()
    device = start_gang(cfg)
    try:
        if before is not None:
            on_rank0(before, rank, world_size)
        env = WorkerEnv.for_gang(rank, world_size, local_rank, device, socket.gethostname())
        result = job(cfg, env, plan)
    finally:
        leave_gang()
    return (result if rank == 0 else None), {"runtime": "torchrun", "world_size": world_size}
