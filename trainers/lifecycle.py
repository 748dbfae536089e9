"""A run's start and finish, the same for every launcher (the Ray driver, torchrun's rank 0, a Tune trial).

Start: trainers/driver.py's `prepare` (the config's, data's and model's checks, the batch-fit check: before
anything is written), then `open_run` (the storage, the run folder's lock, the resume check). Finish: `finish`
(summary.json) and `last_line` (the one error line). The exit codes are stride/errors.py's.
"""

from __future__ import annotations

import errno
import re
import time
from pathlib import Path
from typing import Any


def open_run(cfg, task, instance: str):
    """A checked run's folder, opened the same way by every launcher: the storage is writable, no link is planted
    where the run writes, the run folder's lock is taken (`instance` names its holder: trainers/runlock.py), and a
    checkpoint already there is of this task's model (it is resumed from). Each refusal is one UsageError line
    (exit 2) that leaves the folder as it was. Returns the held lock: release it (or use it in `with`) at the end."""
    from stride.trainers import runfolder, runlock
    from stride.trainers.driver import check_resume, check_storage

    run_dir = check_storage(cfg)
    runfolder.check_run_folder(run_dir)  # a link planted where the run writes: refused before its lock is written
    lock = runlock.acquire(run_dir, cfg.run.lock_stale_s, instance)
    try:
        check_resume(cfg, run_dir, task)
    except BaseException:
        lock.release()
        raise
    return lock


def write_summary(run_dir: Path, summary: dict) -> Path:
    """summary.json; but a rerun that did not end the run (failed, interrupted) never replaces a completed run's
    record: its summary goes beside it as summary.<status>.json. Returns the path written."""
    import json

    from stride.trainers import runfolder
    from stride.trainers.checkpointing import atomic_write_text

    path = run_dir / "summary.json"
    if not summary.get("final", summary.get("status") == "completed"):
        try:  # an earlier summary that is not what Stride writes counts as none
            earlier = runfolder.read_summary(path)
        except (OSError, ValueError, runfolder.RunFolderError):
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

    summary.update(wall_s=time.time() - t_start, config=public_dict(cfg), **fields)
    summary.setdefault("restarts", 0)
    return record_summary(run_dir, summary)


def last_line(error: BaseException | str) -> str:
    """The one line an error ends a command with: the last non-empty line of its text (Ray wraps a worker's exception
    in its traceback), without the class path of Stride's own errors, whose message is the line."""
    text = str(error)
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    line = lines[-1] if lines else type(error).__name__ if isinstance(error, BaseException) else ""
    return re.sub(r"^stride(\.\w+)+: ", "", line)[:500]
