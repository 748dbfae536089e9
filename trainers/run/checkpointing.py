"""Train state on disk: sharded with torch.distributed.checkpoint (DCP), written in the background, safe to load.

A checkpoint folder (`checkpoint_<step>`) holds:
* DCP's files: `__<rank>_0.distcp`, one per rank, and `.metadata` (rank 0). Every rank writes its own part of the
  model and optimizer state, keyed by parameter names (torch.distributed.checkpoint.state_dict): FSDP's DTensor
  shards as they are, DDP's replicated tensors split between the ranks by DCP's de-duplication. Nothing is gathered
  on rank 0, and any world size and either strategy loads them: DCP reads the slices each rank needs.
* `meta.json`, written last by rank 0: the step, the data position, the scheduler and grad-scaler state (small,
  exact, JSON), the run's identity, and the size and sha256 of every other file. Its presence marks a complete
  checkpoint; `verify()` re-checks every file before a resume, so a torn checkpoint is skipped for the one before.

Nothing read from a checkpoint is unpickled with an unrestricted unpickler: whoever can write the run folder (a shared
filesystem, a bucket) must not run code in every process that resumes from it, and the hashes do not help there (who
writes the files writes meta.json too). DCP's `.metadata` goes through an allow-list of DCP's own classes, its tensors
and other items through torch.load(weights_only=True). Folders of the format before DCP (one `state.pt` written by
rank 0) are no longer read: read_meta refuses them by name (CheckpointFormatError), never passes over them.
"""

from __future__ import annotations

import errno
import hashlib
import io
import json
import logging
import os
import pickle
import shutil
import stat
import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable

import torch

from stride.trainers.run import folder as runfolder

# The public names (benchmarks/ and users import only these; tests/test_bench_imports.py checks benchmarks/).
__all__ = ["META", "CheckpointWriter", "checkpoint_folder", "load_model_state", "load_sharded",
           "newest_complete", "read_meta", "saved_keys", "saved_model_shapes", "shape_mismatch", "verify",
           "write_marker"]

META = "meta.json"
DCP_METADATA = ".metadata"
log = logging.getLogger("stride")

from stride.errors import CheckpointFormatError, CheckpointWriteError, RunFolderError, UnsafeCheckpointError
from stride.trainers.run.folder import atomic_write_text


# A full disk, a quota or a read-only mount stays so for minutes or until a person acts: retrying only delays the
# one line that tells them, and fills the log with warnings.
PERSISTENT_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS})


def persistent_storage_error(e: BaseException) -> OSError | None:
    """The OSError of a persistent storage condition behind `e` (DCP's per-rank failures, and the exception chain:
    torch's serializer reports a short write as a RuntimeError whose context is the OSError), else None."""
    for err in _errors(e):
        seen = set()
        while err is not None and id(err) not in seen:
            seen.add(id(err))
            if isinstance(err, OSError) and err.errno in PERSISTENT_ERRNOS:
                return err
            err = err.__cause__ or err.__context__
    return None


def out_of_space(where: str | Path) -> OSError | None:
    """ENOSPC when the filesystem of `where` has (almost) no space left. torch's serializer can report a short write
    as a bare RuntimeError ("unexpected pos"), the errno lost: the filesystem itself is then the witness."""
    path = Path(where)
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)) if st.f_bavail * st.f_frsize < 1 << 20 else None


def with_retries(fn, where: str, attempts: int = 4, first_wait_s: float = 0.5, errors: tuple = (OSError,)):
    """Run fn(); on OSError (or `errors`) wait and try again (0.5 s, 1 s, 2 s): transient storage errors (an NFS
    hiccup, an object store's 503) must not end a run. A persistent one (no space, quota, read-only) fails at once.
    Raises CheckpointWriteError naming `where` when all attempts fail."""
    for attempt in range(1, attempts + 1):
        try:
            return fn()
        except errors as e:
            if persistent := persistent_storage_error(e) or out_of_space(where):
                reason = persistent.strerror or _reason(persistent)
                raise CheckpointWriteError(f"writing checkpoint to {where} failed ({reason})", reason,
                                           persistent.errno) from None
            if attempt == attempts:
                reason = f"{_reason(e)}; failed {attempts} times"
                raise CheckpointWriteError(f"writing checkpoint to {where} failed {attempts} times ({_reason(e)}); "
                                           f"check that run.storage_path is writable and has space", reason) from None
            wait = first_wait_s * 2 ** (attempt - 1)
            log.warning("writing checkpoint to %s failed (%s); retry %d/%d in %.1fs", where, _reason(e), attempt,
                        attempts - 1, wait)
            time.sleep(wait)


def _errors(e: BaseException) -> list[BaseException]:
    """The ranks' own errors inside DCP's CheckpointException ({rank: (error, traceback)}), else [e]."""
    failures = getattr(e, "failures", None)
    return [f[0] if isinstance(f, tuple) else f for f in failures.values()] if failures else [e]


def _reason(e: BaseException) -> str:
    """The first line of what went wrong (for DCP's CheckpointException, of the first rank's own error)."""
    e = _errors(e)[0]
    return str(e).splitlines()[0] if str(e) else type(e).__name__


# ---- writing: every rank its shards, in the background; rank 0 the marker, last ----

class CheckpointWriter:
    """Writes checkpoints in a background thread, one at a time. `save` blocks only while the state is copied to CPU
    memory (DCP's stager); the files are written while training goes on. A collective: every rank calls `save` and
    `wait` in the same order. `process_group`: a group of its own (gloo), so that the writer's collectives never
    interleave with training's; None without torch.distributed (one process)."""

    def __init__(self, rank: int, process_group=None, written: Callable[[Path, float], Any] | None = None,
                 fence: Callable[[], None] = lambda: None, remote=None, sync: bool = False):
        # DCP's modules take about 0.3 s to import: here, at setup, not inside the first checkpoint's blocking time.
        import torch.distributed.checkpoint  # noqa: F401
        import torch.distributed.checkpoint.staging  # noqa: F401
        import torch.distributed.checkpoint.state_dict  # noqa: F401

        self.rank, self.process_group, self.written = rank, process_group, written
        self.fence = fence  # raises when this run no longer holds its run folder (trainers/run/lock.py)
        # A run on a bucket (trainers/run/remote.py): the folder is node-local staging, published after the write.
        self.remote, self.sync = remote, sync
        self.keep_last = 1 << 30  # the run sets checkpoint.keep_last (a bucket's retention is the writer's)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="stride-checkpoint")
        self._pending: Future | None = None

    def save(self, folder: Path, state: dict[str, Any], meta: dict[str, Any]) -> Future:
        """Stage `state` (tensors, DTensors) now and write it with `meta` into `folder` in the background; returns
        the write's future (its result: the folder, complete)."""
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        self.wait()  # at most one in flight: a second would hold a second copy of the state
        if self.rank == 0:
            # Before staging, so before this save's collective plan step: no other rank writes into `folder` until
            # rank 0 is past that step, and so past this.
            fresh_folder(Path(folder))
        elif self.remote is not None and not Path(folder).is_dir():
            Path(folder).mkdir(parents=True, exist_ok=True)  # staging is node-local: rank 0's is on its node only
        staged = DefaultStager(StagingOptions(False, False, False, False)).stage(state)
        self._pending = self._pool.submit(self._write, Path(folder), staged, meta)
        if self.sync:  # checkpoint.upload=sync: the step waits for the upload
            pending = self._pending
            pending.exception()
        return self._pending

    def wait(self) -> Path | None:
        """Block until the write in flight (if any) is complete; re-raises its failure (CheckpointWriteError)."""
        pending, self._pending = self._pending, None
        return pending.result() if pending is not None else None

    def settle(self) -> None:
        """After the loop failed (a callback, a batch, a collective): let the write in flight complete instead of
        being cut off when the process exits, so that the checkpoint it began is resumable. Its own failure is not
        the run's (the loop's error is what the user reads); the write's collectives are bounded by the group's
        timeout should another rank be gone."""
        pending, self._pending = self._pending, None
        if pending is not None:
            try:
                pending.result()
            except Exception:  # noqa: BLE001 - a failed write leaves its folder unmarked: never resumed from
                pass

    def close(self) -> None:
        self._pool.shutdown(wait=False)

    def _write(self, folder: Path, staged: dict[str, Any], meta: dict[str, Any]) -> Path:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.api import CheckpointException

        t0 = time.perf_counter()
        def save() -> None:
            self.fence()
            writer = dcp.FileSystemWriter(folder)
            writer.fs = _no_follow_fs()
            try:
                with warnings.catch_warnings():  # one process: "assuming the intent is to save in a single process"
                    warnings.simplefilter("ignore", UserWarning)
                    dcp.save(staged, storage_writer=writer, process_group=self.process_group,
                             no_dist=self.process_group is None)
            except CheckpointException as e:  # a link planted in the folder: the user's to fix, no retry mends it
                if link := next((err for err in _errors(e) if isinstance(err, RunFolderError)), None):
                    raise link from None
                raise

        try:
            # A failed write fails on every rank (DCP gathers each rank's result), so every rank retries it together.
            with_retries(save, str(folder), errors=(OSError, CheckpointException))
            if self.rank == 0 and self.remote is None:
                with_retries(lambda: (self.fence(), write_marker(folder, meta)), str(folder))
        except CheckpointWriteError as e:
            if self.rank == 0:
                # Unmarked, the folder is never resumed from; its bytes would only take the space that the run's
                # failure record (summary, Ray's checkpoint list) still needs. Every rank is done with it: DCP's
                # save returns on all ranks together.
                shutil.rmtree(folder, ignore_errors=True)
            line = storage_failure_line(f"checkpoint {folder.name}", folder.parent, e.reason, e.errno)
            raise CheckpointWriteError(line, e.reason, e.errno) from None
        if self.remote is not None:  # staged locally: now to the bucket (its failures say so themselves)
            return self._publish(folder, meta, t0)
        if self.rank == 0 and self.written is not None:
            self.written(folder, time.perf_counter() - t0)
        return folder


    def _publish(self, folder: Path, meta: dict[str, Any], t0: float) -> Path | None:
        """A run on a bucket: every rank uploads its own staged files (retried with backoff); rank 0 writes meta.json
        into the bucket last, only once every rank's files are there, and prunes past checkpoint.keep_last. The staged
        files are removed either way. A failed upload is one warning, and the previous checkpoint stays the newest
        (None is returned); `max_upload_failures` in a row fail the run (CheckpointWriteError, exit 1)."""
        from stride.trainers.run.storage import with_backoff

        remote = self.remote
        try:
            files, error = with_backoff(lambda: remote.upload_shards(folder, self.rank)), None
        except OSError as e:
            files, error = {}, _reason(e)
        every = self._gather((files, error))
        errors = [err for _, err in every if err]
        if not errors and self.rank == 0:
            merged = {name: want for own, _ in every for name, want in own.items()}
            try:
                with_backoff(lambda: (self.fence(), remote.sync_side_files(wait=True),
                                      remote.commit(folder.name, meta, merged)))
            except OSError as e:
                errors.append(_reason(e))
        errors = self._gather(errors)[0]  # rank 0's verdict, on every rank
        for p in remote.own_files(folder, self.rank):
            p.unlink(missing_ok=True)
        if self.rank == 0:
            shutil.rmtree(folder, ignore_errors=True)
        if errors:
            remote.failures += 1
            line = (f"checkpoint {folder.name} could not be uploaded to {remote} ({errors[0]}); "
                    f"{remote.failures} in a row (checkpoint.max_upload_failures={remote.max_upload_failures})")
            if remote.failures >= remote.max_upload_failures:
                raise CheckpointWriteError(line + "; the newest complete checkpoint there is kept: rerun to resume "
                                                  "from it", errors[0], None)
            if self.rank == 0:
                log.warning("%s; training goes on, the previous checkpoint stays the newest", line)
            return None
        remote.failures = 0
        if self.rank == 0:
            try:  # housekeeping: a storage hiccup here costs old objects kept a little longer, not the checkpoint
                remote.prune(self.keep_last)
            except OSError as e:
                log.warning("checkpoint.keep_last: old checkpoints in %s stay until the next one (%s)", remote,
                            _reason(e))
            if self.written is not None:
                self.written(folder, time.perf_counter() - t0)
        return folder

    def _gather(self, obj):
        """Every rank's `obj`, in rank order, over the writer's own group (one process: just this one)."""
        if self.process_group is None:
            return [obj]
        import torch.distributed as dist

        out = [None] * dist.get_world_size(self.process_group)
        dist.all_gather_object(out, obj, group=self.process_group)
        return out


# Checkpoints whose shards stay in a bucket (trainers/run/remote.py resume_copy): the folder holds meta.json and
# .metadata; every other file is read from the bucket by byte range, so a rank reads only the tensors it holds.
# folder -> (name -> its size in the bucket, an opener of a seekable binary file of it)
_REMOTE_SHARDS: dict[str, tuple[dict[str, int], Callable[[str], Any]]] = {}


def read_shards_from(folder: Path, sizes: dict[str, int], opener: Callable[[str], Any] | None) -> None:
    """Register (or with `opener` None, forget) the bucket that holds `folder`'s shards."""
    if opener is None:
        _REMOTE_SHARDS.pop(str(Path(folder)), None)
    else:
        _REMOTE_SHARDS[str(Path(folder))] = (dict(sizes), opener)


def _remote(path: Path) -> tuple[int, Callable[[], Any]] | None:
    """(size, opener) of a file of a registered folder that is not on this disk, or None."""
    found = _REMOTE_SHARDS.get(str(Path(path).parent))
    if found is None or Path(path).name not in found[0] or runfolder.lstat_or_none(path) is not None:
        return None
    sizes, opener = found
    return sizes[Path(path).name], lambda: opener(Path(path).name)


# What the checks below read of a tensor item: torch.load onto the meta device reads the zip's records at its start
# (the pickle) and its directory at its end, never the tensor's bytes between.
_ITEM_EDGE = 8 << 10


def _check_span(metadata) -> Callable[[Any], list[tuple[int, int]]]:
    """The byte ranges of a storage item that verify's checks read: a bytes item whole, a tensor item's edges."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    kinds = {index: metadata.state_dict_metadata.get(index.fqn) for index in metadata.storage_data}

    def span(index_and_info) -> list[tuple[int, int]]:
        index, info = index_and_info
        start, end = info.offset, info.offset + info.length
        if isinstance(kinds[index], BytesStorageMetadata) or info.length <= 2 * _ITEM_EDGE:
            return [(start, end)]
        return [(start, start + _ITEM_EDGE), (end - _ITEM_EDGE, end)]
    return span


def _prefetch(folder: Path, infos, span: Callable[[Any], list[tuple[int, int]]] | None = None) -> None:
    """For a folder whose shards stay in a bucket: fetch the ranges these storage items will be read at, per file
    in one batch of concurrent requests (RangedObject.prefetch), before they are read one by one. `infos`: DCP's
    _StorageInfo, or (index, info) pairs with `span`. Nothing for a folder on disk."""
    found = _REMOTE_SHARDS.get(str(Path(folder)))
    if found is None:
        return
    by_file: dict[str, list[tuple[int, int]]] = {}
    for item in infos:
        info = item[1] if span is not None else item
        ranges = span(item) if span is not None else [(info.offset, info.offset + info.length)]
        by_file.setdefault(info.relative_path, []).extend(ranges)
    for name, ranges in by_file.items():
        if (remote := _remote(Path(folder) / name)) is not None:
            with remote[1]() as f:
                f.prefetch(ranges)


def _open_read(path: Path):
    """A checkpoint file for reading: a regular file of the folder, never through a link; or, for a folder whose
    shards stay in a bucket, the object, read by byte range."""
    if (remote := _remote(path)) is not None:
        return remote[1]()
    return os.fdopen(runfolder.open_regular(path), "rb")


def storage_failure_line(what: str, run_dir: Path, reason: str, errno_: int | None = None) -> str:
    """The one line a run ends with when the storage refused `what`: what failed, why, and what the rerun resumes
    from (the same command resumes; nothing to clean up by hand)."""
    last = newest_complete(run_dir)
    fix = ("free space" if errno_ in (errno.ENOSPC, errno.EDQUOT)
           else f"make run.storage_path ({Path(run_dir).parent}) writable, with space to spare,")
    then = (f"the last complete checkpoint is {last}: {fix} and rerun to resume from it" if last
            else f"no checkpoint of this run is complete: {fix} and rerun to start it over")
    return f"{what} could not be written ({reason}); {then}"


def fresh_folder(folder: Path) -> None:
    """An empty `folder` that Stride created, for a checkpoint's files. A folder of that name left by a killed run
    (torn, or an older complete one of the same step) is removed first, so that every file DCP writes is new; but a
    symlinked folder, or one holding a symlink, is someone else's: refused (RunFolderError), never written into or
    removed. (shutil.rmtree removes links without following them; the walk is there to say so, not to rely on it.)"""
    st = runfolder.lstat_or_none(folder)
    if st is not None and not stat.S_ISDIR(st.st_mode):
        raise runfolder.refused(folder, runfolder.kind(st.st_mode))
    if st is not None:
        for parent, dirs, files in os.walk(folder):
            for name in dirs + files:
                if os.path.islink(os.path.join(parent, name)):
                    raise runfolder.refused(Path(parent) / name, "a symlink")
        shutil.rmtree(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    runfolder.make_folder(folder)


def _no_follow_fs():
    """DCP's FileSystem, creating every file new (O_EXCL) and never through a link (O_NOFOLLOW), and reading only
    regular files (trainers/run/folder.py). Built on use, as DCP's modules are imported (0.3 s) only then."""
    from torch.distributed.checkpoint.filesystem import FileSystem

    class NoFollowFileSystem(FileSystem):
        @contextmanager
        def create_stream(self, path, mode: str):
            path = Path(path)
            if mode == "rb":
                with _open_read(path) as stream:
                    yield stream
                return
            assert mode == "wb", mode
            with os.fdopen(_create_replacing_leftover(path), mode) as stream:
                yield stream

        def rename(self, path, new_path) -> None:
            runfolder.refuse_link(Path(new_path))
            os.replace(path, new_path)

        def mkdir(self, path) -> None:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            runfolder.make_folder(Path(path))

    return NoFollowFileSystem()


def _create_replacing_leftover(path: Path) -> int:
    """A new file at `path`. A regular file already there is this folder's own, from an attempt that failed
    (with_retries runs DCP's save again): unlinked, then created anew. A symlink there is refused
    (runfolder.create_new)."""
    try:
        return runfolder.create_new(path)
    except FileExistsError:
        path.unlink()
        return runfolder.create_new(path)


def checkpoint_folder(run_dir: Path, step: int) -> Path:
    """Where the checkpoint of `step` goes: <run>/checkpoint_<step, 8 digits> (torchrun's pruning matches the name)."""
    return Path(run_dir) / f"checkpoint_{step:08d}"


def write_marker(folder: Path, meta: dict[str, Any]) -> None:
    """meta.json, with the size and sha256 of every other file in `folder`: written last, it marks the checkpoint
    complete. Only regular files are listed and hashed; a link that appeared in the folder is refused, not read."""
    files = {}
    for p in sorted(Path(folder).iterdir()):
        if p.name == META or p.name.endswith(".tmp"):
            continue
        st = os.lstat(p)
        if stat.S_ISLNK(st.st_mode):
            raise runfolder.refused(p, "a symlink")
        if stat.S_ISREG(st.st_mode):
            files[p.name] = {"bytes": st.st_size, "sha256": _sha256(p)}
    atomic_write_text(Path(folder) / META, json.dumps(dict(meta, format="dcp", files=files), indent=1))


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with os.fdopen(runfolder.open_regular(path), "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def read_meta(folder: Path) -> dict[str, Any]:
    """meta.json, checked against its schema (runfolder.CheckpointMeta). Raises ValueError (not JSON, a field of the
    wrong type: runfolder.SchemaError), OSError, RunFolderError (not a regular file), or CheckpointFormatError (a
    checkpoint of the format before DCP)."""
    path = Path(folder) / META
    data = runfolder.read_json(path)
    if _before_dcp(data):
        raise CheckpointFormatError(
            f"checkpoint {folder} has the single-file state.pt format from before DCP, which this version of Stride "
            f"no longer reads (nothing in it was changed); export its weights with the previous release's `stride "
            f"export` and start a new run from them (init.from=<the .safetensors>), or use another run.name")
    return runfolder.validated(runfolder.CheckpointMeta, data, path)


def _before_dcp(meta: Any) -> bool:
    """meta.json as the format before DCP wrote it: the digest of its one state.pt, no list of files."""
    return isinstance(meta, dict) and "files" not in meta and "state_sha256" in meta


def verify(folder: Path) -> str | None:
    """None when the checkpoint is complete, intact and contained, else what is wrong with it. Whoever can write the
    run folder can write meta.json too, so beyond the digests: meta.json's fields have their types
    (runfolder.CheckpointMeta); every file it lists is a regular file of this folder, checked with lstat before it
    is opened (a FIFO never hangs, a device is never read); DCP's `.metadata` names only those files; its bytes
    items (the optimizer's hyperparameters) unpickle as plain values; and its tensor items hold tensors of their
    dtype and shape (no pickle payload, no other item's bytes). Raises only CheckpointFormatError (read_meta): a
    checkpoint of the format before DCP is refused by name, never passed over for an older one or the start."""
    folder = Path(folder)
    st = runfolder.lstat_or_none(folder)
    if st is None or not stat.S_ISDIR(st.st_mode):
        return "not a folder" if st is None or not stat.S_ISLNK(st.st_mode) else "a symlink, not followed"
    try:
        meta = read_meta(folder)
    except runfolder.SchemaError as e:
        return f"{META} is not what Stride writes: {e.problem}"
    except (OSError, ValueError, RunFolderError) as e:
        return _unreadable(folder / META, e)
    files = meta["files"]
    if not files:
        return f"{META} lists no files"
    for name, want in files.items():
        if not _plain_name(name):
            return f"{META} lists an unexpected entry {name!r}"
        if problem := _file_problem(folder / name, want):
            return problem
    return _dcp_problem(folder, files)


def _unreadable(path: Path, e: BaseException) -> str:
    st = runfolder.lstat_or_none(path) if isinstance(e, RunFolderError) else None
    if st is not None and not stat.S_ISREG(st.st_mode):
        return f"{path.name} is {runfolder.kind(st.st_mode)}, not a regular file (not read)"
    return f"no readable {path.name} ({e.__class__.__name__})"


def _plain_name(name: str) -> bool:
    """A file directly inside the checkpoint folder: no separator, not `.` or `..`."""
    return isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and "\\" not in name \
        and "\0" not in name


def _file_problem(path: Path, want: dict[str, Any]) -> str | None:
    if (remote := _remote(path)) is not None:
        # In the bucket: whole or absent (an object is written at once), so its size is its check; its bytes are
        # read by range, and every tensor item is still loaded as a tensor only (below, and DCP's own read).
        return None if remote[0] == want["bytes"] else \
            f"{path.name} does not match the size in {META} ({remote[0]} bytes, {want['bytes']} expected)"
    st = runfolder.lstat_or_none(path)
    if st is None:
        return f"no readable {path.name} (FileNotFoundError)"
    if not stat.S_ISREG(st.st_mode):
        return f"{path.name} is {runfolder.kind(st.st_mode)}, not a regular file (not read)"
    try:
        if st.st_size != want["bytes"] or _sha256(path) != want["sha256"]:
            return f"{path.name} does not match the digest in {META} (torn or corrupted write)"
    except (OSError, RunFolderError) as e:
        return f"no readable {path.name} ({e.__class__.__name__})"
    return None


def _dcp_problem(folder: Path, files: dict[str, Any]) -> str | None:
    """What keeps DCP's files from loading safely: `.metadata` unlisted, refused by the allow-list, naming a file
    outside `files`, or a bytes item that holds more than plain values."""
    if DCP_METADATA not in files:
        return f"{META} does not list {DCP_METADATA}"
    try:
        metadata = _read_dcp_metadata(folder / DCP_METADATA)
        if problem := _storage_problem(metadata, files):
            return problem
        _prefetch(folder, metadata.storage_data.items(), _check_span(metadata))
        return _bytes_items_problem(folder, metadata) or _tensor_items_problem(folder, metadata)
    except UnsafeCheckpointError as e:
        return str(e)
    except Exception as e:  # noqa: BLE001 - a pickle from a shared folder can fail in any way; it is only unusable
        return f"no readable {DCP_METADATA} ({e.__class__.__name__})"


def _storage_problem(metadata, files: dict[str, Any] | None) -> str | None:
    """Every storage item DCP would read is a slice of a plain file name of this folder (in `files`, meta.json's
    list, when given), with no stream transform (Stride writes none, and a transform's bytes are not what the
    checks here read)."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex

    if not isinstance(metadata, Metadata) or not isinstance(metadata.storage_data, dict):
        return f"{DCP_METADATA} is not DCP's metadata"
    for index, info in metadata.storage_data.items():
        if not isinstance(index, MetadataIndex) or not isinstance(info, _StorageInfo):
            return f"{DCP_METADATA} holds a storage entry that is not DCP's"
        name = info.relative_path
        if not _plain_name(name) or name == DCP_METADATA or (files is not None and name not in files):
            return f"{DCP_METADATA} names {str(name)[:200]!r} for {index.fqn}, not a file of this checkpoint's {META}"
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (info.offset, info.length)) \
                or (files is not None and info.offset + info.length > files[name]["bytes"]):
            return f"{DCP_METADATA} places {index.fqn} outside {name}"
        if getattr(info, "transform_descriptors", None):
            return f"{DCP_METADATA} gives {index.fqn} stream transforms, which Stride never writes"
    return None


def _bytes_items_problem(folder: Path, metadata) -> str | None:
    """DCP's bytes items (the optimizer's hyperparameters) are torch.save'd values inside the .distcp files: each
    must load with weights_only=True, as Stride's planner loads it, so that a pickle is found here, not in a worker."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    for index, info in metadata.storage_data.items():
        if not isinstance(metadata.state_dict_metadata.get(index.fqn), BytesStorageMetadata):
            continue
        with _open_read(folder / info.relative_path) as f:
            f.seek(info.offset)
            data = f.read(info.length)
        try:
            torch.load(io.BytesIO(data), weights_only=True)
        except pickle.UnpicklingError as e:
            raise _refused(folder / info.relative_path, f"{index.fqn}: {_unpickler_reason(e)}") from None
    return None


def _tensor_items_problem(folder: Path, metadata) -> str | None:
    """DCP reads each tensor item with torch.load(weights_only=True): a tensor item whose slice holds a pickle
    payload, or another item's bytes, would fail there, inside a worker. Each slice is loaded here onto the meta
    device (its pickle only, never its data: cheap at any size) and must be one tensor of the dtype and shape that
    .metadata gives it, so that such a checkpoint is unusable (skipped on resume, refused by name) instead."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    from torch.distributed.checkpoint.utils import _create_file_view

    for index, info in metadata.storage_data.items():
        saved = metadata.state_dict_metadata.get(index.fqn)
        if not isinstance(saved, TensorStorageMetadata):
            continue
        path = folder / info.relative_path
        with _open_read(path) as f:
            try:
                tensor = torch.load(_create_file_view(f, info.offset, info.length), map_location="meta",
                                    weights_only=True)
            except pickle.UnpicklingError as e:
                raise _refused(path, f"{index.fqn}: {_unpickler_reason(e)}") from None
            except Exception as e:  # noqa: BLE001 - bytes that are no torch.save'd tensor fail in any way
                return f"{DCP_METADATA} places tensor {index.fqn} on bytes of {path.name} that hold no tensor " \
                       f"({e.__class__.__name__})"
        if problem := _chunk_problem(index, saved, tensor):
            return f"{DCP_METADATA} places tensor {index.fqn} on bytes of {path.name} that hold {problem}"
    return None


def _chunk_problem(index, saved, tensor) -> str | None:
    """What the loaded `tensor` is, when it is not the chunk of `saved` (TensorStorageMetadata) that `index` names."""
    if not isinstance(tensor, torch.Tensor):
        return f"a {type(tensor).__name__}, not a tensor"
    sizes = next((tuple(c.sizes) for c in saved.chunks if tuple(c.offsets) == tuple(index.offset or ())), None)
    if tensor.dtype != saved.properties.dtype or (sizes is not None and tuple(tensor.shape) != sizes):
        return (f"a {str(tensor.dtype).removeprefix('torch.')} tensor of shape {tuple(tensor.shape)}, not its "
                f"{str(saved.properties.dtype).removeprefix('torch.')} chunk of shape {sizes}")
    return None


# ---- reading: never an unrestricted unpickler ----



def _refused(path: Path, what: str) -> UnsafeCheckpointError:
    return UnsafeCheckpointError(f"{path} holds more than tensors ({what}); it was not loaded. Move that checkpoint "
                                 f"folder away if you did not write it, or use another run.name")


class _MetadataUnpickler(pickle.Unpickler):
    """DCP's `.metadata` is a pickle (torch/distributed/checkpoint/filesystem.py); only the classes DCP writes there
    may be built from it."""

    ALLOWED = {("torch.distributed.checkpoint.metadata", n) for n in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
        "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")} | {
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
        ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),
        ("collections", "OrderedDict")}

    def find_class(self, module: str, name: str):
        if (module, name) in self.ALLOWED or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in DCP metadata")


def _unpickler_reason(e: pickle.UnpicklingError) -> str:
    """torch.load(weights_only=True)'s refusal, without its long advice: the class it would not build."""
    text = str(e)
    if "WeightsUnpickler error:" in text:
        text = text.split("WeightsUnpickler error:")[-1]
    elif text.startswith("Weights only load failed"):  # a legacy (not zip) pickle: the advice, then the refusal
        paragraphs = [p for p in text.split("\n\n") if p.strip()]
        text = paragraphs[1] if len(paragraphs) > 1 else text
    return text.strip().splitlines()[0][:200]


def _read_dcp_metadata(path: Path):
    """A `.metadata` (a regular file) unpickled through the allow-list; UnsafeCheckpointError for another class, or
    for a link, FIFO or device in its place."""
    try:
        with os.fdopen(runfolder.open_regular(path), "rb") as f:
            return _MetadataUnpickler(f).load()
    except pickle.UnpicklingError as e:
        raise _refused(path, str(e)) from None
    except RunFolderError as e:
        raise UnsafeCheckpointError(str(e)) from None


def _safe_reader(folder: Path):
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeReader(FileSystemReader):
        """Reads `.metadata` through the allow-list and only regular files (no link, FIFO or device), and refuses
        a `.metadata` that names a file outside the folder: verify() checked that too, but the folder may have
        changed since (time of check, time of use)."""

        def __init__(self, path: str):
            super().__init__(path)
            self.fs = _no_follow_fs()

        def read_data(self, plan, planner):
            # A folder whose shards stay in a bucket: this rank's items, fetched in one batch before DCP reads them
            # one at a time.
            _prefetch(Path(folder), [self.storage_data[item.storage_index] for item in plan.items])
            return super().read_data(plan, planner)

        def read_metadata(self, *args: Any, **kwargs: Any):
            path = Path(folder) / DCP_METADATA
            metadata = _read_dcp_metadata(path)
            if problem := _storage_problem(metadata, None):
                raise UnsafeCheckpointError(f"{path}: {problem}; it was not loaded. Move that checkpoint folder away "
                                            f"if you did not write it, or use another run.name")
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeReader(str(folder))


def _safe_planner(folder: Path):
    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.checkpoint._traverse import set_element

    class SafeLoadPlanner(DefaultLoadPlanner):
        """DCP's default planner reads non-tensor items (the optimizer's hyperparameters) with
        torch.load(weights_only=False); here with weights_only=True."""

        def load_bytes(self, read_item, value: io.BytesIO) -> None:
            try:
                obj = torch.load(value, weights_only=True)
            except pickle.UnpicklingError as e:
                raise _refused(Path(folder), f"{read_item.dest_index.fqn}: {_unpickler_reason(e)}") from None
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
            else:
                self.state_dict[read_item.dest_index.fqn] = obj

    return SafeLoadPlanner()


def dcp_metadata(folder: Path):
    """DCP's metadata of a checkpoint, read through the allow-list."""
    return _safe_reader(folder).read_metadata()


def load_sharded(folder: Path, state: dict[str, Any], process_group=None) -> None:
    """Fill `state` (this rank's tensors and DTensors, as torch.distributed.checkpoint.state_dict gives them) from a
    checkpoint written at any world size, in place. A collective (None: one process)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        with warnings.catch_warnings():  # one process: "assuming the intent is to load in a single process"
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(state, storage_reader=_safe_reader(folder), planner=_safe_planner(folder),
                     process_group=process_group, no_dist=process_group is None)
    except CheckpointException as e:  # DCP wraps each rank's failure; a refused file is the user's to fix
        refused = [err for err in _errors(e) if isinstance(err, (UnsafeCheckpointError, RunFolderError))]
        if refused:
            raise UnsafeCheckpointError(str(refused[0])) from None
        # DCP's own torch.load(weights_only=True) of a tensor item refused a pickle: the folder changed since
        # verify() (time of check, time of use)
        if pickled := next((err for err in _errors(e) if isinstance(err, pickle.UnpicklingError)), None):
            raise _refused(Path(folder), _unpickler_reason(pickled)) from None
        raise


def saved_model_shapes(folder: Path) -> dict[str, tuple[int, ...]]:
    """The model tensors' names and full shapes in a checkpoint, without loading them."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    return {k.removeprefix("model."): tuple(m.size) for k, m in dcp_metadata(folder).state_dict_metadata.items()
            if k.startswith("model.") and isinstance(m, TensorStorageMetadata)}


def saved_keys(folder: Path) -> set[str]:
    """The names of a sharded checkpoint's items as DCP flattens them ("model.<name>", "ema.<name>", a callback's
    "callbacks.<module>:<Class>.<name>"), from `.metadata` alone: what a resume may ask DCP to fill."""
    return set(dcp_metadata(folder).state_dict_metadata)


def load_model_state(folder: Path, part: str = "model") -> dict[str, torch.Tensor]:
    """The full (consolidated) model weights of a checkpoint, in one process, as plain CPU
    tensors: for the commands' one weights reader (trainers/commands/trained.py load_weights) and init.from of a
    Stride checkpoint. `part`: "ema" for train.ema's average (empty when the run had none)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    meta = dcp_metadata(folder).state_dict_metadata
    model = {k.removeprefix(f"{part}."): torch.empty(tuple(m.size), dtype=m.properties.dtype)
             for k, m in meta.items() if k.startswith(f"{part}.") and isinstance(m, TensorStorageMetadata)}
    if model:
        load_sharded(folder, {part: model})
    return model


def shape_mismatch(model: dict[str, tuple[int, ...]], saved: dict[str, tuple[int, ...]]) -> str | None:
    """Describe the first tensor whose name or shape differs between a model and a checkpoint (name -> shape)."""
    for name, shape in model.items():
        if name not in saved:
            return f"tensor {name} is missing from the checkpoint"
        if tuple(saved[name]) != tuple(shape):
            return f"tensor {name} has shape {tuple(saved[name])} in the checkpoint but {tuple(shape)} in the model"
    extra = sorted(set(saved) - set(model))
    return f"the checkpoint has tensor {extra[0]} that the model lacks" if extra else None


def _step_before_dcp(folder: Path) -> int:
    """The step a checkpoint of the format before DCP names (0 when it names none, or is gone meanwhile)."""
    try:
        step = runfolder.read_json(folder / META).get("step")
    except (OSError, ValueError, RunFolderError):
        return 0
    return step if isinstance(step, int) and not isinstance(step, bool) else 0


def _mtime(folder: Path) -> float | None:
    """The folder's own mtime (never a link's target), or None when it is gone: another process's keep_last may
    remove an old checkpoint while it is being listed."""
    try:
        return folder.lstat().st_mtime
    except FileNotFoundError:
        return None


def newest_complete(run_dir: Path, warn: Callable[[str], Any] | None = None,
                    using: str = "resuming from") -> Path | None:
    """The checkpoint folder with the highest step whose contents verify: the one to resume from, whoever wrote
    it. Ray's own pointer is not enough: a driver killed between a checkpoint's write and Ray's registration of
    it leaves a complete checkpoint that Ray does not know. Torn or corrupted folders are skipped; `warn` gets one
    line naming those newer than the folder returned, each with its reason, and what is done instead (`using`:
    "resuming from", "exporting"). A checkpoint of the format before DCP where the returned one would be is refused
    (CheckpointFormatError): passed over, its run would start again from an older step or from the start."""
    candidates, bad = [], []
    for folder in Path(run_dir).glob("checkpoint_*"):
        # lstat: a symlinked folder is listed as unusable (verify says why), never followed
        if not (folder.is_dir() or folder.is_symlink()) or folder.name.endswith(".tmp"):  # .tmp: torchrun's publish
            continue
        try:
            candidates.append((read_meta(folder)["step"], folder))
        except CheckpointFormatError:  # refused (verify, below) only where it is the one a resume would take
            candidates.append((_step_before_dcp(folder), folder))
        except runfolder.SchemaError as e:
            bad.append((_mtime(folder), folder, f"{META} is not what Stride writes: {e.problem}"))
        except (OSError, ValueError, RunFolderError) as e:
            bad.append((_mtime(folder), folder, _unreadable(folder / META, e)))
    newest = None
    for _, folder in sorted(candidates, reverse=True):  # hash only down to the first intact one
        problem = verify(folder)
        if problem is None:
            newest = folder
            break
        bad.append((_mtime(folder), folder, problem))
    bad = [b for b in bad if b[0] is not None]  # folders removed meanwhile (keep_last's pruning): not there, not bad
    since = (_mtime(newest) or float("-inf")) if newest else float("-inf")
    skipped = [f"{folder.name} ({problem})" for mtime, folder, problem in sorted(bad) if mtime >= since]
    if skipped and warn is not None:
        warn(f"checkpoint {'; '.join(skipped)} is unusable; {using} "
             f"{newest.name if newest else 'the start (no complete checkpoint)'} instead")
    return newest


# ---- Ray Train's own list of a run's checkpoints: never a reason a rerun cannot start ----


