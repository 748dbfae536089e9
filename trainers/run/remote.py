"""A run on a bucket (`run.storage_path: s3://...` or `gs://...`), worked on in a node-local copy.

Every process of a run on a bucket works in this node's private working copy (`working_copy`: under
`checkpoint.staging_dir`, default a folder of this user's alone under the temporary directory), with the same names
as a run folder. `RunRemote` is what reaches the bucket, and when:

* checkpoints: each rank writes its DCP shard into the working copy (fast, local), then uploads it while training goes
  on; rank 0 writes `meta.json` into the bucket last, only after every rank's shards are there, recording each file's
  size and sha256. A checkpoint without `meta.json` does not exist for resume, export or eval. The staged shards are
  removed once their upload is confirmed (or given up).
* `metrics.jsonl`, `summary.json`, `tensorboard/`: written locally and uploaded whole, as one object each (a reader
  sees the old object or the new, never half of one), at log flushes, checkpoints and the end.
* the lock: trainers/run/lock.py's object lock, on conditional writes.
* a resume: the newest complete checkpoint in the bucket is downloaded into this rank's working copy, verified
  (sizes and sha256), loaded, and removed.

The names under `<storage_path>/<run.name>/` are those of a folder, so a run copied from a bucket to a folder
(`aws s3 sync`, `gcloud storage rsync`) resumes from the folder, and the other way round.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import posixpath
import shutil
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

from stride.trainers.run.storage import Location, ObjectStore, location_of, with_backoff

log = logging.getLogger("stride")

META = "meta.json"
PUSH_GAP_S = 1.0  # push_soon: at most one upload of a side file per second
CHECKPOINT_PREFIX = "checkpoint_"
SIDE_FILES = ("metrics.jsonl", "tensorboard", "wandb")  # written locally by rank 0's sinks, synced at checkpoints


def staging_root(staging_dir: str | None) -> Path:
    """The node-local folder a run on a bucket works in: `checkpoint.staging_dir`, or a folder this user alone
    controls (mode 0700, checked) under the temporary directory: a shared /tmp is not trusted."""
    from stride.ray_cluster.node import UnsafeStateDir, node_staging_dir, private_dir
    from stride.errors import UsageError

    base = node_staging_dir(staging_dir)
    try:
        return private_dir(base)
    except UnsafeStateDir as e:
        raise UsageError(f"checkpoint.staging_dir ({base}): {e}; set checkpoint.staging_dir=<a private local "
                         f"folder>") from None


def working_copy(location: Location, name: str, staging_dir: str | None) -> Path:
    """This node's working copy of the run `name` under `location`: one folder per (bucket prefix, run)."""
    key = hashlib.sha256(str(location).encode()).hexdigest()[:16]
    return staging_root(staging_dir) / "runs" / key / name


class RunRemote:
    """The bucket side of a run: `store` at `<storage_path>/<run.name>`, `local` the working copy."""

    def __init__(self, store: ObjectStore, local: Path, max_upload_failures: int = 3):
        self.store, self.local = store, Path(local)
        self.max_upload_failures = max_upload_failures
        self.failures = 0  # checkpoints in a row whose upload failed
        self._push_lock = threading.RLock()
        self._wanted: set[str] = set()
        self._ranged: dict[str, Any] = {}  # open_ranged's files, by object name
        self._pusher: threading.Thread | None = None
        self._hurry = threading.Event()  # flush(): the pusher skips its gap
        self._metas: dict[str, bytes] = {}  # meta.json of the checkpoints newest_complete() found complete

    @classmethod
    def of(cls, cfg) -> RunRemote | None:
        """The remote of a config's run, or None for a run in a folder."""
        location = location_of(cfg.run.storage_path)
        if location is None:
            return None
        return cls(ObjectStore(location.join(cfg.run.name)), cfg.run_dir, cfg.checkpoint.max_upload_failures)

    def __str__(self) -> str:
        return self.store.describe()

    # ---- whole files ---------------------------------------------------------------------------------------

    def pull(self, name: str) -> bool:
        """`name` from the bucket into the working copy (replacing it); False when the bucket has none."""
        data = self.store.read(name)
        if data is None:
            return False
        path = self.local / name
        path.parent.mkdir(parents=True, exist_ok=True)
        from stride.trainers.run.folder import atomic_write_bytes

        atomic_write_bytes(path, data)
        return True

    def push(self, name: str) -> None:
        """The working copy's `name` to the bucket, whole (one object: a reader never sees half of it)."""
        path = self.local / name
        if not path.is_file():
            return
        with self._push_lock:  # two pushes of one file never interleave their reads and puts
            data = path.read_bytes()
            if name.endswith(".jsonl"):  # a line being appended right now goes with the next push, whole
                data = data[:data.rfind(b"\n") + 1]
            self.store.write(name, data)

    def push_soon(self, name: str) -> None:
        """push(name) from a background thread, coalesced: the requests within PUSH_GAP_S of an upload are one upload
        of the newest bytes after it, and the caller (a log step) never waits on the network. A PUT per log line would
        cost every step a share of the CPU (the request's signing, the client's event loop) for no reader's gain.
        `flush()` waits for it."""
        with self._push_lock:
            self._wanted.add(name)
            if self._pusher is None or not self._pusher.is_alive():
                self._hurry.clear()
                self._pusher = threading.Thread(target=self._push_wanted, name="stride-push", daemon=True)
                self._pusher.start()

    def _push_wanted(self) -> None:
        while True:
            with self._push_lock:
                if not self._wanted:
                    self._pusher = None
                    return
                names, self._wanted = sorted(self._wanted), set()
            for name in names:
                try:
                    with_backoff(lambda: self.push_tree(name) if (self.local / name).is_dir() else self.push(name))
                except OSError as e:  # the next push carries the whole file again
                    log.warning("%s could not be uploaded to %s (%s); retrying at the next log step", name, self, e)
            self._hurry.wait(PUSH_GAP_S)

    def sync_side_files(self, wait: bool = False) -> None:
        """metrics.jsonl and the trackers' local folders (TensorBoard's events, W&B's offline run) to the bucket: in
        the background, or with `wait` now (a checkpoint's upload thread, before its commit: a checkpoint complete in
        the bucket has every line logged up to its step there too, whenever the run is killed)."""
        for name in SIDE_FILES:
            if not (self.local / name).exists():
                continue
            if wait:
                self.push_tree(name) if (self.local / name).is_dir() else self.push(name)
            else:
                self.push_soon(name)

    def flush(self) -> None:
        """Wait for push_soon's uploads."""
        pusher = self._pusher
        if pusher is not None:
            self._hurry.set()
            pusher.join()

    def push_tree(self, name: str) -> None:
        """Every file under the working copy's folder `name` (TensorBoard's event files, W&B's offline run)."""
        root = self.local / name
        if not root.is_dir():
            return
        for p in sorted(root.rglob("*")):
            if p.is_file() and not p.is_symlink():
                self.store.upload(p, str(p.relative_to(self.local)))

    def publish_record(self, summary_name: str, summary: dict[str, Any]) -> str:
        """The end of a run on a bucket: TensorBoard's files, metrics.jsonl, then the summary (last: the run's own
        record) reach the bucket, and this node's working copy is removed (no run file stays on its disk). The
        summary's checkpoint is the bucket's newest complete one. Returns where the summary went."""
        complete = self.complete()
        summary["checkpoint"] = self.store.describe(complete[-1][1]) if complete else None
        from stride.trainers.run.folder import atomic_write_text

        atomic_write_text(self.local / summary_name, json.dumps(summary, indent=1, default=str) + "\n")
        self.flush()
        for name in SIDE_FILES:
            self.push_tree(name) if (self.local / name).is_dir() else self.push(name)
        self.push(summary_name)
        shutil.rmtree(self.local, ignore_errors=True)
        return self.store.describe(summary_name)

    # ---- checkpoints ---------------------------------------------------------------------------------------

    def own_files(self, folder: Path, rank: int) -> list[Path]:
        """The files of `folder` that `rank` wrote: its DCP shards, and rank 0's `.metadata`."""
        mine = sorted(Path(folder).glob(f"__{rank}_*.distcp"))
        if rank == 0 and (Path(folder) / ".metadata").is_file():
            mine.append(Path(folder) / ".metadata")
        return mine

    def upload_shards(self, folder: Path, rank: int) -> dict[str, dict[str, Any]]:
        """Upload this rank's files of the checkpoint `folder`; returns name -> {bytes, sha256} of each."""
        files = {}
        for p in self.own_files(folder, rank):
            files[p.name] = {"bytes": p.stat().st_size, "sha256": _sha256(p)}
            self.store.upload(p, f"{folder.name}/{p.name}", sha256=files[p.name]["sha256"])
        return files

    def commit(self, folder_name: str, meta: dict[str, Any], files: dict[str, dict[str, Any]]) -> None:
        """meta.json, last: the checkpoint exists from here on. Every file it names must be in the bucket with its
        size (a shard that did not arrive fails the commit, never a resume)."""
        listed = self.store.listing(folder_name)
        for name, want in files.items():
            got = listed.get(f"{folder_name}/{name}")
            if got != want["bytes"]:
                raise OSError(f"{self.store.describe(folder_name + '/' + name)} is not in the bucket as written "
                              f"({got} bytes, {want['bytes']} expected)")
        self.store.write(f"{folder_name}/{META}", json.dumps(dict(meta, format="dcp", files=files), indent=1).encode())

    def complete(self) -> list[tuple[int, str]]:
        """(step, folder name) of every checkpoint in the bucket whose meta.json names files that are all there at
        their recorded sizes, oldest first."""
        return sorted(self.newest_complete(self.store.listing("")))

    def newest_complete(self, listed: dict[str, int]) -> Iterator[tuple[int, str]]:
        """complete()'s checkpoints in `listed` (a listing of the run), newest first, each meta.json read only when
        the caller asks for the next one: a resume reads one, not every kept checkpoint's."""
        names = {n.split("/", 1)[0] for n in listed if n.startswith(CHECKPOINT_PREFIX) and "/" in n}
        # Only checkpoints still in the bucket: prune() calls this after every checkpoint of a long run.
        self._metas = {n: raw for n, raw in self._metas.items() if n in names}
        for name in sorted(names, reverse=True):  # checkpoint_<step, 8 digits>: by name is by step
            if f"{name}/{META}" not in listed:
                continue
            raw = self.store.read(f"{name}/{META}")
            try:
                meta = json.loads(raw or b"null")
                files = meta["files"]
                step = meta["step"]
            except (ValueError, TypeError, KeyError):
                continue
            if isinstance(files, dict) and all(listed.get(f"{name}/{f}") == (w or {}).get("bytes")
                                               for f, w in files.items()):
                self._metas[name] = raw  # fetch() writes these bytes instead of reading them again
                yield step, name

    def fetch(self, folder_name: str, dest_root: Path, only: tuple[str, ...] | None = None,
              listed: dict[str, int] | None = None) -> Path:
        """The checkpoint `folder_name` downloaded under `dest_root` (meta.json last, so that a copy cut short is
        never complete), or just its files named in `only`; the caller verifies and removes it. `listed`: a listing
        of the run already made (one request fewer)."""
        dest = Path(dest_root) / folder_name
        if dest.exists():
            shutil.rmtree(dest)
        dest.mkdir(parents=True)
        if listed is None:
            listed = self.store.listing(folder_name)
        names = sorted(n for n in listed if n.startswith(folder_name + "/")
                       and (only is None or n.rsplit("/", 1)[1] in only))
        for n in [n for n in names if not n.endswith("/" + META)] + [n for n in names if n.endswith("/" + META)]:
            if n == f"{folder_name}/{META}" and folder_name in self._metas:
                (dest / META).write_bytes(self._metas[folder_name])
            else:
                self.store.download(n, dest / posixpath.basename(n))
        return dest

    def resume_copy(self, rank: int) -> Path | None:
        """The newest complete checkpoint in the bucket, its meta.json and DCP's metadata downloaded into this rank's
        staging, its shards read from the bucket by byte range (open_ranged), verified as a folder's is (sizes here;
        every tensor item is still loaded as a tensor only). An unusable one is passed over for the one before, with a
        warning. None: none."""
        from stride.trainers.run import checkpointing

        dest_root = self._resume_root(rank)
        listed = self.store.listing("")
        for step, name in self.newest_complete(listed):
            folder = with_backoff(lambda: self.fetch(name, dest_root, only=(META, ".metadata"), listed=listed))
            sizes = {n.rsplit("/", 1)[1]: size for n, size in listed.items() if n.startswith(name + "/")}
            checkpointing.read_shards_from(
                folder, sizes, lambda shard, name=name: self.open_ranged(f"{name}/{shard}", sizes[shard]))
            problem = checkpointing.verify(folder)
            if problem is None:
                return folder
            log.warning("checkpoint %s in %s is unusable (%s); trying the one before", name, self, problem)
            checkpointing.read_shards_from(folder, {}, None)
            shutil.rmtree(folder, ignore_errors=True)
        return None

    def open_ranged(self, name: str, size: int):
        """A seekable binary file of the object `name` (`size` bytes) that holds only the byte ranges read or
        prefetched (RangedObject): a rank loads the slices it holds, never whole shard files of other ranks. One store
        of parts per object for the whole resume (drop_resume_copy drops them); each open is a cursor over it."""
        with self._push_lock:
            if name not in self._ranged:
                self._ranged[name] = RangedObject(self.store, name, size)
            return self._ranged[name].cursor()

    def drop_resume_copy(self, rank: int) -> None:
        from stride.trainers.run import checkpointing

        root = self._resume_root(rank)
        for folder in root.glob(f"{CHECKPOINT_PREFIX}*"):
            checkpointing.read_shards_from(folder, {}, None)
        with self._push_lock:
            ranged, self._ranged = self._ranged, {}
        shutil.rmtree(root, ignore_errors=True)

    def _resume_root(self, rank: int) -> Path:
        return self.local / ".resume" / f"rank-{rank}"

    def prune(self, keep_last: int, keep: set[str] = frozenset()) -> None:
        """Delete all but the newest `keep_last` complete checkpoints (and those in `keep`), and any incomplete one
        older than the newest complete (an upload given up)."""
        complete = [name for _, name in self.complete()]
        kept = set(complete[-keep_last:]) | set(keep)
        newest = complete[-1] if complete else None
        for name in self.store.folders(""):
            if not name.startswith(CHECKPOINT_PREFIX) or name in kept:
                continue
            if name in complete or (newest is not None and name < newest):
                self.store.delete(name)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


class RangedObject:
    """The byte ranges of one object that a resume has read, kept in memory until the resume is loaded. `prefetch`
    fetches many ranges at once (concurrent requests, adjacent ranges merged, parts already held skipped): verify
    names each tensor item's head and tail, DCP's read names this rank's items, so that a resume costs a few requests
    per shard file, not a few per tensor. A read outside what was fetched fetches exactly its bytes."""

    MERGE_GAP = 64 << 10  # ranges closer than this are one request (the gap's bytes are cheaper than a round trip)

    def __init__(self, store: ObjectStore, name: str, size: int):
        self.store, self.name, self.size = store, name, size
        self.parts: list[tuple[int, bytes]] = []  # (start, bytes), sorted, never overlapping
        self._lock = threading.Lock()

    def cursor(self) -> _RangedCursor:
        return _RangedCursor(self)

    def prefetch(self, ranges: list[tuple[int, int]]) -> None:
        wanted = []
        for start, end in sorted((max(0, s), min(self.size, e)) for s, e in ranges):
            if start >= end:
                continue
            if wanted and start <= wanted[-1][1] + self.MERGE_GAP:
                wanted[-1][1] = max(wanted[-1][1], end)
            else:
                wanted.append([start, end])
        gaps = [g for start, end in wanted for g in self._gaps(start, end)]
        if gaps:
            self._fetch(gaps)

    def read(self, start: int, end: int) -> bytes:
        end = min(end, self.size)
        if start >= end:
            return b""
        if gaps := self._gaps(start, end):
            self._fetch(gaps)
        with self._lock:
            pieces = [(s, d) for s, d in self.parts if s < end and s + len(d) > start]
        return b"".join(d[max(0, start - s):end - s] for s, d in pieces)

    def _gaps(self, start: int, end: int) -> list[tuple[int, int]]:
        """The sub-ranges of [start, end) that no part holds."""
        gaps, at = [], start
        with self._lock:
            for s, d in self.parts:
                if s + len(d) <= at:
                    continue
                if s >= end:
                    break
                if s > at:
                    gaps.append((at, s))
                at = max(at, s + len(d))
        if at < end:
            gaps.append((at, end))
        return gaps

    def _fetch(self, ranges: list[tuple[int, int]]) -> None:
        path = self.store._path(self.name)
        try:
            got = self.store.fs.cat_ranges([path] * len(ranges), [s for s, _ in ranges], [e for _, e in ranges])
        except Exception as e:  # noqa: BLE001 - the libraries' many kinds, as ObjectStore's methods
            raise OSError(f"{type(e).__name__}: {e}") from e
        for (start, end), data in zip(ranges, got):
            if isinstance(data, BaseException):
                raise OSError(f"{self.store.describe(self.name)}: {type(data).__name__}: {data}") from data
            if len(data) != end - start:
                raise OSError(f"{self.store.describe(self.name)} is shorter than listed ({start + len(data)} of "
                              f"{end} bytes)")
        with self._lock:
            self.parts = sorted(self.parts + [(s, d) for (s, _), d in zip(ranges, got)], key=lambda p: p[0])


class _RangedCursor(io.RawIOBase):
    """A seekable read-only file over a RangedObject."""

    def __init__(self, obj: RangedObject):
        super().__init__()
        self.obj, self.pos = obj, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.obj.size}[whence]
        self.pos = max(0, base + offset)
        return self.pos

    def tell(self) -> int:
        return self.pos

    def readinto(self, buffer) -> int:
        data = self.obj.read(self.pos, self.pos + len(buffer))
        memoryview(buffer).cast("B")[:len(data)] = data
        self.pos += len(data)
        return len(data)

    def prefetch(self, ranges: list[tuple[int, int]]) -> None:
        self.obj.prefetch(ranges)


@contextmanager
def replica_on_this_node(spec: dict[str, str] | None):
    """A command's copy of a bucket run (trainers/commands/trained.py BucketCopy) on a worker's node: the driver
    downloaded it into a private folder of its own node, and a worker on another node finds nothing at that path. Here
    the same files (summary.json and the one checkpoint, verified) are fetched to the same path, in a folder of this
    user's alone (mode 0700), for the job's length. `spec`: BucketCopy.replica(); None (a folder run): nothing."""
    from stride.errors import UsageError
    from stride.ray_cluster.node import UnsafeStateDir, private_dir
    from stride.trainers.run import checkpointing

    # The checkpoint's meta.json, not the folder: Ray Train may create the job's own records under the run folder on
    # this node (.jobs) while the job starts.
    if spec is None or (Path(spec["run_dir"]) / spec["checkpoint"] / "meta.json").is_file():
        yield
        return
    run_dir = Path(spec["run_dir"])
    root = run_dir.parent
    if root.is_dir() and not root.is_symlink() and root.lstat().st_uid == os.getuid():
        os.chmod(root, 0o700)  # made by Ray's records just now, with the default mode: this user's alone again
    try:
        private_dir(root)
    except UnsafeStateDir as e:
        raise UsageError(f"--run ({spec['uri']}): {e}") from None
    try:
        remote = RunRemote(ObjectStore(location_of(spec["uri"])), run_dir)
        run_dir.mkdir(exist_ok=True)
        remote.pull("summary.json")
        folder = with_backoff(lambda: remote.fetch(spec["checkpoint"], run_dir))
        if (problem := checkpointing.verify(folder)) is not None:
            raise UsageError(f"--run ({spec['uri']}): {spec['checkpoint']} is unusable on this node ({problem})")
        yield
    finally:
        shutil.rmtree(run_dir.parent, ignore_errors=True)
