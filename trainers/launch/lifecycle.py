"""A run's start and finish, the same for every launcher (the Ray driver, torchrun's rank 0, a Tune trial).

Start: trainers/launch/ray.py's `prepare` (the config's, data's and model's checks, the batch-fit check: before
anything is written), then `open_run` (the storage, the run folder's lock, the resume check). Between them and the
end, `train_and_record`: the run trained by the launcher's own callable and its summary written (`finish`) while the
run still holds its folder; `last_line` is the one error line. The exit codes are stride/errors.py's.
"""

from __future__ import annotations

from stride.errors import RunFolderError, UnsafeCheckpointError
import errno
import fnmatch
import json
import os
import re
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from stride.errors import UsageError

if TYPE_CHECKING:
    from stride.trainers.run.lock import RunLock


def open_run(cfg, task, instance: str):
    """A checked run's folder, opened the same way by every launcher: the storage is writable, no link is planted
    where the run writes, the run folder's lock is taken (`instance` names its holder: trainers/run/lock.py), and a
    checkpoint already there is of this task's model (it is resumed from). Each refusal is one UsageError line
    (exit 2) that leaves the folder as it was. Returns the held lock: release it (or use it in `with`) at the end."""
    from stride.trainers.run import folder as runfolder
    from stride.trainers.run import lock as runlock
    from stride.trainers.run.remote import RunRemote

    remote = RunRemote.of(cfg)
    if remote is not None:
        return open_remote_run(cfg, task, instance, remote)
    run_dir = check_storage(cfg)
    runfolder.check_run_folder(run_dir)  # a link planted where the run writes: refused before its lock is written
    lock = runlock.acquire(run_dir, cfg.run.lock_stale_s, instance)
    try:
        check_resume(cfg, run_dir, task)
    except BaseException:
        lock.release()
        raise
    return lock


def open_remote_run(cfg, task, instance: str, remote):
    """open_run for a run on a bucket: the prefix is writable with these credentials, the lock is taken there (on
    conditional writes), and a checkpoint already there is of this task's model."""
    from stride.trainers.run import lock as runlock
    from stride.trainers.run.storage import StorageError, location_of, refusal

    check_job_storage(cfg)
    ensure_writable(cfg.run_dir, "checkpoint.staging_dir", cfg.checkpoint.staging_dir or cfg.run_dir.parent)
    # The lock's conditional write is the first write there: a bucket that does not exist, no credentials or no
    # permission is refused on it (no probe object before it: each request is a round trip before the first step).
    try:
        lock = runlock.acquire_object(remote.store, cfg.run.name, cfg.run.lock_stale_s, instance)
    except OSError as e:
        raise StorageError(f"run.storage_path ({location_of(cfg.run.storage_path)}): "
                           f"{refusal(remote.store.location, e)}") from None
    try:
        check_remote_resume(cfg, remote, task)
    except BaseException:
        lock.release()
        raise
    return lock


def check_remote_resume(cfg, remote, task) -> None:
    """check_resume for a run on a bucket, on the newest complete checkpoint's meta.json and DCP metadata alone."""
    import shutil

    newest = next(remote.newest_complete(remote.store.listing("")), None)
    if newest is None:
        return
    step, name = newest
    probe = cfg.run_dir / ".resume-check"
    shutil.rmtree(probe, ignore_errors=True)
    (probe / name).mkdir(parents=True)
    try:
        for part in ("meta.json", ".metadata"):
            remote.store.download(f"{name}/{part}", probe / name / part)
        _check_model_matches(cfg, probe / name, task, where=str(remote))
    finally:
        shutil.rmtree(probe, ignore_errors=True)


def take_run(cfg, task, instance: str | None) -> Callable[[], tuple[RunLock, str]]:
    """train_and_record's `take` for a launcher whose one process holds the run (the Ray driver, a Tune trial):
    open_run, and the lock's token for the workers' fences."""
    def take() -> tuple[RunLock, str]:
        lock = open_run(cfg, task, instance)
        return lock, lock.token
    return take


def train_and_record(cfg, take: Callable[[], tuple[RunLock | None, str | None]], train: Callable[[str | None], dict],
                     *, t_start: float | None = None, failed: Callable[[BaseException], dict | None] | None = None,
                     still_ours: Callable[[RunLock], bool] | None = None, **fields: Any) -> dict[str, Any]:
    """One run from its folder's lock to its summary, the same for every launcher. `take()` opens the run: (the lock
    this process holds, or None where another process records the run (torchrun's ranks but 0); the lock's token,
    which the workers' fences check). `train(token)` trains and returns rank 0's summary fields. An exception that
    `failed` turns into summary fields (None: not one it knows) is recorded as the run's end, then raised again;
    any other propagates with no summary. The summary is written (`finish`, with `fields`: the runtime, a trial's
    params) only while `still_ours(lock)` (default: the lock file still holds our token): a run that lost its
    folder to another run leaves that run's summary alone. The wall time counts from `t_start` (default: when
    `train` is called). The lock is released on the way out. Returns the summary, with summary_path once written."""
    lock, token = take()
    try:
        t_start = time.time() if t_start is None else t_start
        try:
            summary = train(token)
        except Exception as e:
            ending = failed(e) if failed is not None else None
            if ending is not None:
                _record(cfg, lock, ending, t_start, still_ours, fields)
            raise
        _record(cfg, lock, summary, t_start, still_ours, fields)
        return summary
    finally:
        if lock is not None:
            lock.release()


def _record(cfg, lock: RunLock | None, summary: dict, t_start: float, still_ours, fields: dict) -> None:
    if lock is None:
        return
    if still_ours(lock) if still_ours is not None else lock.held():
        summary["summary_path"] = finish(cfg.run_dir, summary, cfg, t_start, **fields)


def ensure_writable(folder: Path, key: str, value) -> Path:
    """Create `folder` and prove a file can be written there; else a UsageError naming the config key."""
    try:
        from stride.trainers.run import folder as runfolder

        folder.mkdir(parents=True, exist_ok=True)
        probe = runfolder.temp_name(folder / ".write-test")  # created new: never written through a planted link
        os.close(runfolder.create_new(probe))
        probe.unlink()
    except OSError as e:
        raise UsageError(f"{key} ({value}) is not writable ({e.strerror}); set {key}=<a folder you can write>") from None
    return folder


def check_storage(cfg) -> Path:
    """The run folder, created and proven writable (and, in a Ray job, not in its temporary working dir)."""
    check_job_storage(cfg)
    return ensure_writable(cfg.run_dir, "run.storage_path", cfg.run.storage_path)


def check_storage_outside_data(cfg) -> None:
    """A run folder that a data path reads would be read back as data by the next run (its meta.json is JSON Lines
    to the reader), and the run's layout cache would be written into the user's data: refuse it (exit 2) before
    anything is read or written."""
    run_dir = os.path.realpath(cfg.run_dir)
    for key, path in data_paths(cfg):
        if _reads(path, run_dir):
            raise UsageError(f"run.storage_path ({cfg.run.storage_path}) puts the run folder {run_dir} inside {key} "
                             f"({path}), so the next run would read its files as data; set run.storage_path=<a folder "
                             f"outside the data, e.g. ./runs>")


def data_paths(cfg) -> list[tuple[str, str]]:
    """(config key, path) of every local data path of the config: the splits' paths and their sources'."""
    named = [(f"data.{key}", getattr(cfg.data, key)) for key in ("train_path", "val_path")]
    named += [(f"data.{split} ({src.name})", src.path) for split in ("train", "val") for src in getattr(cfg.data, split) or ()]
    return [(key, p) for key, p in named if p and "://" not in p]


# What a run writes that a data path could take for data (JSON and JSON Lines), relative to its folder.
RUN_FILES = ("meta.json", "summary.json", "metrics.jsonl", "checkpoint_0/meta.json")


def _reads(path: str, run_dir: str) -> bool:
    """Whether data path `path` (a folder, file or glob, as datasets/splits.resolve_files reads it) would read files
    of the run folder `run_dir` (links followed). A glob is matched as if its wildcards crossed folders: a pattern
    that could reach the run's JSON files is refused even where only `**` would."""
    path = os.path.abspath(os.path.expanduser(path))
    cut = min((path.index(ch) for ch in "*?[" if ch in path), default=None)
    if cut is not None:
        prefix = os.path.dirname(path[:cut])
        pattern = os.path.realpath(prefix) + path[len(prefix):]
        return any(fnmatch.fnmatchcase(os.path.join(run_dir, f), pattern) for f in RUN_FILES)
    if os.path.isfile(path):
        return False
    folder = os.path.realpath(path)
    return run_dir == folder or run_dir.startswith(folder.rstrip(os.sep) + os.sep)


def _in_uploaded_working_dir() -> bool:
    """Ray sets RAY_JOB_CONFIG_JSON_ENV_VAR for a job's driver; its runtime_env names the uploaded working_dir."""
    text = os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR")
    if not text:
        return False
    try:
        return bool(((json.loads(text) or {}).get("runtime_env") or {}).get("working_dir"))
    except (ValueError, AttributeError):
        return True  # unreadable: a job of unknown shape, so keep results safe


def check_job_storage(cfg) -> None:
    """Under `ray job submit --working-dir`, the driver runs in Ray's temporary copy of the uploaded folder, deleted
    with the session. Refuse (exit 2) what would leave the run pointing there: a relative run.storage_path (the
    results would land in the copy), and an init.from inside the copy (relative paths are resolved against it): the
    run records init.from (summary.json, each checkpoint's meta.json, the trackers), and a checkpoint.trainable_only
    run's export and resume read its base from there again, after the copy is gone."""
    if not _in_uploaded_working_dir():
        return
    if "://" not in cfg.run.storage_path and not Path(cfg.run.storage_path).expanduser().is_absolute():
        raise UsageError(f"run.storage_path ({cfg.run.storage_path}) is relative in a Ray job, so its results would "
                         f"land in the job's temporary copy of --working-dir and be lost with it; set run.storage_path="
                         f"<an absolute path on shared storage, e.g. /mnt/shared/runs>")
    source = cfg.init.from_
    if source and "://" not in source and Path(source).is_relative_to(Path.cwd()):
        raise UsageError(f"init.from ({source}) is in the job's temporary copy of --working-dir, which is deleted with "
                         f"the job, so the run would record (and a trainable_only run read again) a path that is gone; "
                         f"set init.from=<an absolute path on shared storage, or a URI such as s3://bucket/model>")


def check_resume(cfg, run_dir: Path, task) -> None:
    """A run folder that holds a complete checkpoint is resumed from the newest one (the workers pick the same):
    refuse, before any worker starts and with the checkpoint left as it is, a model whose tensors do not match it
    (another model.* setting under the same run.name)."""
    import torch

    from stride.trainers.run import checkpointing

    # An unusable newer checkpoint (torn, tampered) is passed over: said here, once, with the reason.
    newest = checkpointing.newest_complete(run_dir, lambda line: print(f"stride: warning: {line}", flush=True))
    if newest is not None:
        _check_model_matches(cfg, newest, task)


def _check_model_matches(cfg, newest: Path, task, where: str | None = None) -> None:
    import torch

    from stride.trainers.run import checkpointing

    with torch.device("meta"):  # shapes only: no memory for the weights
        model = task.build_model()
    try:
        saved = checkpointing.saved_model_shapes(newest)
    except UnsafeCheckpointError as e:
        raise UsageError(f"run.name ({cfg.run.name}): {e}") from None
    partial = checkpointing.read_meta(newest).get("trainable_only")  # its frozen base comes from init.from
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items() if not partial or k in saved}
    if mismatch := checkpointing.shape_mismatch(shapes, saved):
        raise UsageError(f"run.name ({cfg.run.name}) holds checkpoint {newest.name} of another model (the {mismatch}); "
                         f"use a new run.name, or the model.* settings it was trained with")
    print(f"stride: resuming {cfg.run.name} from {newest.name} (step {checkpointing.read_meta(newest)['step']})"
          + (f" in {where}" if where else ""), flush=True)


def write_summary(run_dir: Path, summary: dict) -> Path:
    """summary.json; but a rerun that did not end the run (failed, interrupted) never replaces a completed run's
    record: its summary goes beside it as summary.<status>.json. Returns the path written."""
    import json

    from stride.trainers.run import folder as runfolder
    from stride.trainers.run.folder import atomic_write_text

    path = run_dir / "summary.json"
    if not summary.get("final", summary.get("status") == "completed"):
        try:  # an earlier summary that is not what Stride writes counts as none
            earlier = runfolder.read_summary(path)
        except (OSError, ValueError, RunFolderError):
            earlier = None
        if earlier is not None and earlier.get("status") == "completed":
            path = run_dir / f"summary.{summary.get('status')}.json"
    atomic_write_text(path, json.dumps(summary, indent=1, default=str) + "\n")
    return path


def record_summary(run_dir: Path, summary: dict) -> str:
    """write_summary on storage that may refuse it (a full disk): a failed run keeps its own error line, and a
    completed run whose record cannot be written becomes a failed one that says so. Returns where the summary went,
    or why it went nowhere."""
    try:
        return str(write_summary(run_dir, summary))
    except OSError as e:
        if summary.get("status") == "completed":
            fix = "free space" if e.errno in (errno.ENOSPC, errno.EDQUOT) else "make run.storage_path writable"
            summary.update(status="failed", error=f"summary.json could not be written in {run_dir} ({e.strerror}); "
                                                  f"{fix} and rerun: it ends at once from the final checkpoint")
        return f"not written ({e.strerror})"


def finish(run_dir: Path, summary: dict[str, Any], cfg, t_start: float, **fields: Any) -> str:
    """The summary every launcher writes at the end of a run: rank 0's fields, the wall time, the config (secrets
    redacted), `fields` (the runtime, a trial's params); recorded as record_summary does. Returns where it went."""
    from stride.trainers.config import public_dict

    from stride.trainers.run.remote import RunRemote

    summary.update(wall_s=time.time() - t_start, config=public_dict(cfg), **fields)
    summary.setdefault("restarts", 0)
    written = record_summary(run_dir, summary)
    remote = RunRemote.of(cfg)
    if remote is not None and Path(written).is_file():
        return remote.publish_record(Path(written).name, summary)
    return written


def report_paths(cfg, run_dir: Path, summary: dict) -> None:
    """The end of a run's output, the same from every launcher (the Ray driver, torchrun's rank 0): the status and
    figures, where the summary, metrics and checkpoint are, each tracker's record, and a failed run's error line."""
    from stride.cli import error_line
    from stride.trainers import sinks

    fmt = lambda v: f"{v:.4f}" if isinstance(v, float) else str(v)  # noqa: E731
    val = "".join(f" {k} {fmt(v)}" for k, v in summary.items() if k.startswith("val_") and k != "val_loss" and v is not None)
    print(f"stride: {summary['status']}: step {summary.get('global_step')} train_loss {fmt(summary.get('train_loss'))} "
          f"val_loss {fmt(summary.get('val_loss'))} (untrained {fmt(summary.get('initial_val_loss'))}){val}")
    if summary.get("error"):
        error_line(summary['error'])
    print(f"stride: summary     {summary.get('summary_path', run_dir / 'summary.json')}")
    print(f"stride: metrics     {cfg.run_location}/metrics.jsonl")
    print(f"stride: checkpoint  {summary.get('checkpoint')}")
    for line in sinks.where(cfg, summary):
        print(f"stride: {line}", flush=True)


def last_line(error: BaseException | str) -> str:
    """The one line an error ends a command with: the last non-empty line of its text (Ray wraps a worker's exception
    in its traceback), without the class path of Stride's own errors, whose message is the line."""
    text = str(error)
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    line = lines[-1] if lines else type(error).__name__ if isinstance(error, BaseException) else ""
    return re.sub(r"^stride(\.\w+)+: ", "", line)[:500]


def install_signal_handlers(run_dir: Path, also: Callable[[dict], None] | None = None) -> list[int]:
    """SIGUSR1 (SLURM's warning before the time limit), SIGTERM (preemption, scancel) and SIGINT ask every rank
    to checkpoint at the next step boundary and stop; the exit code is then 128 + the signal. Under SLURM a
    SIGUSR1/SIGTERM means "you will be requeued" (status preempted), elsewhere SIGTERM/SIGINT mean interrupted.
    `also` gets the same request (the Ray driver's stop channel: workers on nodes that do not share the folder)."""
    import signal

    from stride.trainers.policies import clear_stop_request, request_stop

    clear_stop_request(run_dir)
    received: list[int] = []

    def handler(signum, _frame):
        if received and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C: stop now
        received.append(signum)
        preempt = signum == signal.SIGUSR1 or (signum == signal.SIGTERM and os.environ.get("SLURM_JOB_ID"))
        request = {"status": "preempted" if preempt else "interrupted", "signal": signum}
        request_stop(run_dir, request["status"], signum)
        if also is not None:
            also(request)
        print(f"stride: received {signal.Signals(signum).name}: checkpointing at the next step, then exiting",
              file=sys.stderr, flush=True)

    for sig in (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, handler)
    return received
