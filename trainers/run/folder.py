"""A run folder is shared, untrusted storage: how Stride writes into it and reads back from it.

`run.storage_path` is meant to be a shared filesystem or bucket, so other people and other jobs can write a run
folder (<run.storage_path>/<run.name>) too. Two rules follow:

* Writes never follow links. Every file Stride writes there is created new (O_EXCL) without following a symlink
  (O_NOFOLLOW), then renamed onto its name; a symlink where Stride would write is refused (RunFolderError: exit 2,
  one line naming it) instead of being written through to whatever it points at. metrics.jsonl, appended to, is
  opened O_NOFOLLOW and must be a regular file of one link.
* What is read back is checked, never trusted: a file is lstat'ed before it is opened (a FIFO would hang a reader,
  a device would be read forever), opened O_NOFOLLOW|O_NONBLOCK and re-checked, and the JSON Stride reads back
  (meta.json, summary.json, metrics.jsonl lines) is validated against the schemas below.

`check_run_folder` is the launchers' pre-flight scan of what a run is about to write.
"""

from __future__ import annotations

import json
import os
import secrets
import stat
from pathlib import Path
from typing import Any



META = "meta.json"
SUMMARY = "summary.json"
METRICS = "metrics.jsonl"
PROFILE = "profile"
STOP_FILE = ".stride-stop"

_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
# O_NONBLOCK: opening a FIFO for reading returns at once instead of waiting for a writer; it is refused right after.
_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
JSON_LIMIT = 64 << 20  # meta.json, summary.json, the stop file: far above what Stride writes, far below a machine's memory


from stride.errors import RunFolderError, StrideError  # noqa: E402


def kind(mode: int) -> str:
    for test, name in ((stat.S_ISLNK, "a symlink"), (stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a regular file"


def refused(path: Path, what: str) -> RunFolderError:
    return RunFolderError(f"{path} is {what} inside the run folder, where Stride writes and reads its own files; "
                          f"it was not followed. Remove it if you did not put it there, or use another run.name")


def lstat_or_none(path: Path) -> os.stat_result | None:
    try:
        return os.lstat(path)
    except FileNotFoundError:
        return None


def refuse_link(path: Path) -> None:
    """Raise RunFolderError when `path` exists as a symlink (a name Stride is about to replace)."""
    st = lstat_or_none(path)
    if st is not None and stat.S_ISLNK(st.st_mode):
        raise refused(path, "a symlink")


def refuse_unless_regular(path: Path) -> os.stat_result | None:
    """The lstat of `path` (None: absent); RunFolderError when it is anything but a regular file."""
    st = lstat_or_none(path)
    if st is not None and not stat.S_ISREG(st.st_mode):
        raise refused(path, kind(st.st_mode))
    return st


# ---- writing ----

def create_new(path: Path) -> int:
    """A new file at `path`, opened for writing (a file descriptor). Never through a link: a symlink there, even a
    dangling one, fails O_EXCL and is refused (RunFolderError); another existing file raises FileExistsError."""
    try:
        return os.open(path, _CREATE, 0o644)
    except FileExistsError:
        refuse_link(path)
        raise


def make_folder(path: Path) -> Path:
    """Create the folder `path` (its parent must exist), or accept it where it already is a real folder; a symlink
    or a file of that name is refused."""
    try:
        os.mkdir(path)
    except FileExistsError:
        st = os.lstat(path)
        if not stat.S_ISDIR(st.st_mode):
            raise refused(path, kind(st.st_mode)) from None
    return path


def temp_name(path: Path) -> Path:
    """A fresh hidden name beside `path` for an atomic write: pid and random, so that no planted file can sit there
    in advance and two writers never share one. Ends in .tmp (checkpoint markers and pruning skip such names)."""
    return path.with_name(f".{path.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp")


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write `data` to a new temporary file beside `path`, fsync it, and rename it onto `path`: a reader sees the old
    file or the new one, never half of one, and nothing is written through a link (a symlink at `path` is refused,
    not replaced)."""
    path = Path(path)
    tmp = temp_name(path)
    fd = create_new(tmp)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        refuse_link(path)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode())


def open_append(path: Path):
    """metrics.jsonl opened to append one record (a text file object). A symlink fails O_NOFOLLOW; a FIFO, a device
    or a file with a second hard link (someone else's file under this name) is refused."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
    except OSError:
        refuse_link(path)
        raise
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
        os.close(fd)
        raise refused(path, kind(st.st_mode) if not stat.S_ISREG(st.st_mode) else "a file with other hard links")
    os.set_blocking(fd, True)
    return os.fdopen(fd, "a")


# ---- reading ----

def open_regular(path: Path) -> int:
    """A read-only descriptor of `path`, which must be a regular file: checked with lstat before the open (a FIFO
    never blocks, a device is never opened) and with fstat after it (the same file, not one swapped in between).
    RunFolderError otherwise; FileNotFoundError when absent."""
    before = os.lstat(path)
    if not stat.S_ISREG(before.st_mode):
        raise refused(path, kind(before.st_mode))
    try:
        fd = os.open(path, _READ)
    except OSError:
        refuse_link(path)  # swapped for a link after the lstat: O_NOFOLLOW failed (ELOOP)
        raise
    after = os.fstat(fd)
    if not stat.S_ISREG(after.st_mode) or (after.st_dev, after.st_ino) != (before.st_dev, before.st_ino):
        os.close(fd)
        raise refused(path, "a file replaced while it was opened")
    os.set_blocking(fd, True)
    return fd


def read_bytes(path: Path, limit: int | None = JSON_LIMIT) -> bytes:
    """The bytes of the regular file `path` (open_regular's checks); a file over `limit` bytes raises ValueError."""
    with os.fdopen(open_regular(path), "rb") as f:
        data = f.read() if limit is None else f.read(limit + 1)
    if limit is not None and len(data) > limit:
        raise ValueError(f"{path} is over {limit} bytes")
    return data


def read_json(path: Path) -> Any:
    """JSON from a regular file of at most JSON_LIMIT bytes: ValueError (bad JSON, too big), OSError (unreadable),
    RunFolderError (not a regular file)."""
    return json.loads(read_bytes(path))


# ---- the schemas of what Stride reads back ----

SCHEMAS = ("FileDigest", "CheckpointMeta", "Summary", "MetricsLine")


def __getattr__(name: str):
    if name in SCHEMAS:  # pydantic only when a schema is used
        from stride.trainers.run import schema as runschema

        return getattr(runschema, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def schema_problem(error) -> str:
    """One line from pydantic's ValidationError: the first field, its value and the rule."""
    from stride.trainers.run.schema import _quote

    first = error.errors()[0]
    where = ".".join(str(p) for p in first["loc"]) or "the file"
    value = f" ({_quote(first['input'])})" if first["loc"] else ""
    return f"{where}{value}: {first['msg'].removeprefix('Value error, ')}"


class SchemaError(StrideError, ValueError):
    """JSON that Stride wrote once but that is not what it writes now: `problem` names the field and its value."""

    def __init__(self, path: Path, problem: str):
        super().__init__(f"{path}: {problem}")
        self.problem = problem


def validated(schema, data: Any, path: Path) -> dict[str, Any]:
    """`data` (parsed JSON) when it fits `schema` (a pydantic model of runschema), as it was; else SchemaError naming
    `path`, the field and its value."""
    from pydantic import ValidationError

    try:
        schema.model_validate(data)
    except ValidationError as e:
        raise SchemaError(path, schema_problem(e)) from None
    return data


def read_summary(path: Path) -> dict[str, Any]:
    """summary.json, validated: ValueError (not JSON, or a field of the wrong type), OSError, RunFolderError."""
    from stride.trainers.run.schema import Summary

    return validated(Summary, read_json(path), path)


def metrics_line(line: str) -> dict[str, Any] | None:
    """One metrics.jsonl line parsed and validated; None when it is torn or untyped."""
    from stride.trainers.run.schema import MetricsLine

    try:
        record = json.loads(line)
        MetricsLine.model_validate(record)
    except ValueError:  # ValidationError is a ValueError
        return None
    return record


# ---- the pre-flight scan ----

def check_run_folder(run_dir: Path) -> Path:
    """Before a run writes anything: refuse (RunFolderError, exit 2, one line naming it) a symlink or another
    non-regular file where the run will write: the checkpoint folders and their entries, metrics.jsonl,
    summary.json, profile/ and its traces, the stop file. The run folder itself may sit under a symlinked
    storage_path (shared storage is often mounted so): its path is resolved once, and only what lies inside it is
    checked. Returns the resolved run folder. Reads nothing, writes nothing."""
    run_dir = Path(os.path.realpath(run_dir))
    if not run_dir.is_dir():
        return run_dir
    for entry in os.scandir(run_dir):
        path = Path(entry.path)
        if entry.name in (METRICS, SUMMARY, STOP_FILE) or (entry.name.startswith("summary.")
                                                          and entry.name.endswith(".json")):
            refuse_unless_regular(path)
        elif entry.name == PROFILE or entry.name.startswith("checkpoint_"):
            _check_folder(path)
    return run_dir


def _check_folder(path: Path) -> None:
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        raise refused(path, "a symlink")
    if not stat.S_ISDIR(st.st_mode):
        return  # a stray file named checkpoint_*: never a checkpoint, never written into
    for entry in os.scandir(path):
        if entry.is_symlink():
            raise refused(Path(entry.path), "a symlink")
