"""One run at a time per run folder: the run lock `<run folder>/stride.lock`, its heartbeat, and the fence every
worker checks before it writes.

A run folder lives on storage other jobs can reach (a shared filesystem that every node mounts), so the lock is a file
created with O_EXCL, which NFS and FUSE mounts honour across nodes, not an flock, which many of them do not. It names
its holder: a token (uuid4), a fencing number (the previous holder's + 1), host, pid and the pid's start time (a reused
pid is not the holder), when it was taken, and the run's instance (SLURM_JOB_ID, a Tune trial id: the same run
restarted, which takes over at once).

The holder (the launcher's process: Ray's driver, torchrun's rank 0, a Tune trial) refreshes the file's mtime every few
seconds from a daemon thread. Staleness is judged without comparing two hosts' clocks: a contender compares the lock's
mtime with that of a probe file it creates beside it, both stamped by the same filesystem.

Workers never hold the lock; they fence. Before each checkpoint write and (rank 0) each metrics write,
`Fence.still_holds()` re-reads the file and stops the run (RunLockLostError, exit 1) when another run holds it now or it
is gone, or when its heartbeat stood still for run.lock_stale_s on the worker's own clock: an orphan of a killed driver
stops by itself. What is left is one write already past its check when the lock changed hands.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import random
import socket
import stat
import sys
import threading
import time
import uuid
import weakref
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

from stride.ray_cluster.connect import process_start
from stride.errors import UsageError

__all__ = ["Fence", "RunLock", "acquire"]

LOCK = "stride.lock"
MAX_LOCK_BYTES = 64 * 1024  # a lock record is ~300 bytes; a bigger file is not Stride's
log = logging.getLogger("stride")


from stride.errors import RunLockedError, RunLockLostError  # noqa: E402


def heartbeat_interval(stale_s: float) -> float:
    """Several beats per stale period, so that a late beat or two (a busy GIL, an NFS hiccup) never looks stale."""
    return min(5.0, stale_s / 4)


def _alive(pid: int, start) -> bool:
    if Path("/proc/self/stat").exists():
        now = process_start(pid)
        return now is not None and now == start
    try:  # no /proc (macOS): the pid alone
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def _short(value, limit: int = 80) -> str:
    """A field of a file someone else may have written, fit for one line of an error."""
    text = "".join(c if c.isprintable() else "?" for c in str(value))
    return text if len(text) <= limit else text[:limit] + "..."


def read_lock(path: Path) -> tuple[dict, float] | None:
    """(the lock's record, its mtime), or None when there is none. A record still being written, or not Stride's JSON,
    reads as {} (its holder unknown, judged by its heartbeat alone). Never follows a link, never opens a FIFO or device
    for long: a link or anything but a regular file there is a UsageError naming it."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise UsageError(f"{path} is a symlink, not Stride's run lock; remove it (Stride never follows links "
                             f"in a run folder)") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UsageError(f"{path} is not a regular file, so not Stride's run lock; remove it")
        data = os.read(fd, MAX_LOCK_BYTES)
    finally:
        os.close(fd)
    try:
        record = json.loads(data)
    except ValueError:
        record = {}
    return (record if isinstance(record, dict) else {}), st.st_mtime


def heartbeat_age(run_dir: Path, lock_mtime: float) -> float:
    """Seconds since the lock's last beat on the filesystem's own clock: the mtime of a probe created now beside it
    minus the lock's (both stamped by the same server, whatever the clocks of the hosts involved say)."""
    probe = Path(run_dir) / f".stride-lock-probe-{uuid.uuid4().hex}"
    fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    try:
        now = os.fstat(fd).st_mtime
    finally:
        os.close(fd)
        probe.unlink(missing_ok=True)
    return max(0.0, now - lock_mtime)


def describe(record: dict, age: float | None) -> str:
    """The holder, as a refusal or a warning names it."""
    started = record.get("started")
    since = (time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started))
             if isinstance(started, (int, float)) and 0 <= started < 1e11 else "?")
    beat = f", heartbeat {age:.0f}s ago" if age is not None else ""
    return f"host {_short(record.get('host', '?'))}, pid {_short(record.get('pid', '?'))}, since {since}{beat}"


class RunLock:
    """The run lock this process holds. A daemon thread beats until `release()`; a lock found taken over is logged
    once and no longer beaten (its workers' fences stop them)."""

    def __init__(self, path: Path, record: dict, stale_s: float):
        self.path, self.record, self.stale_s = Path(path), record, stale_s
        self.token, self.fence = record["token"], record["fence"]
        self.lost = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat_until_stopped, name="stride-run-lock", daemon=True)
        self._thread.start()

    def _beat_until_stopped(self) -> None:
        while not self._stop.wait(heartbeat_interval(self.stale_s)):
            if not self.beat():
                return

    def beat(self) -> bool:
        """Refresh the heartbeat if the lock is still ours. False when it is not."""
        try:
            found = read_lock(self.path)
            if found is not None and found[0].get("token") == self.token:
                os.utime(self.path, follow_symlinks=False)  # None: "now" on the file server's clock (NFS)
                return True
        except (OSError, UsageError) as e:  # storage down for a moment: the next beat tries again
            log.warning("run lock %s: heartbeat failed (%s); retrying", self.path, e)
            return True
        return self._lost_to(self.path.parent, found[0] if found else None)

    def _lost_to(self, where, holder: dict | None) -> bool:
        """Say once that the run lost its folder (to `holder`, or to nobody), and stop beating (False)."""
        self.lost = True
        who = describe(holder, None) if holder is not None else "nobody: the lock is gone"
        print(f"stride: warning: {where} is no longer this run's (its run lock is now held by {who}); this run's "
              f"workers stop before their next write", file=sys.stderr, flush=True)
        return False

    def held(self) -> bool:
        """Whether the lock file still holds this lock's token (one read)."""
        try:
            found = read_lock(self.path)
        except (OSError, UsageError):
            return False
        return found is not None and found[0].get("token") == self.token

    def release(self) -> None:
        """Stop beating and delete the lock, only if it is still ours."""
        self._stop.set()
        self._thread.join(timeout=10)
        if self.held():
            self.path.unlink(missing_ok=True)

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def _create(path: Path, fence: int, instance: str | None) -> dict | None:
    """Create the lock with O_EXCL (None when another process created it first) and fill it in."""
    record = {"token": uuid.uuid4().hex, "fence": fence, "host": socket.gethostname(), "pid": os.getpid(),
              "pid_start": process_start(os.getpid()), "started": time.time(), "instance": instance}
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    except FileExistsError:
        return None
    try:
        os.write(fd, json.dumps(record).encode())
        os.fsync(fd)
    except OSError:
        path.unlink(missing_ok=True)
        raise
    finally:
        os.close(fd)
    return record


def takeover_reason(record: dict, age: float, stale_s: float, instance: str | None) -> str | None:
    """Why a found lock may be taken over, or None when its holder may be alive."""
    if instance is not None and record.get("instance") == instance:
        return f"same job {_short(instance)}"
    pid = record.get("pid")
    if record.get("host") == socket.gethostname() and isinstance(pid, int) and not _alive(pid, record.get("pid_start")):
        return "dead"
    if age > stale_s:
        return f"stale heartbeat {age:.0f}s"
    return None


@contextmanager
def _takeover_claim(path: Path, stale_s: float):
    """Yields True while this contender alone may break the stale lock at `path` (an O_EXCL claim file beside it);
    False when another contender is breaking it now, after a short wait, so that the caller looks again. Without
    it, a contender that judged the lock stale could rename aside the live lock a faster contender had just
    created. A claim older than stale_s (its contender died mid-takeover) is removed."""
    claim = path.with_name(f".{LOCK}.takeover")
    try:
        fd = os.open(claim, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    except FileExistsError:
        try:
            if time.time() - os.lstat(claim).st_mtime > stale_s:
                claim.unlink(missing_ok=True)
        except FileNotFoundError:
            pass
        time.sleep(0.01 + random.random() * 0.05)
        yield False
        return
    os.close(fd)
    try:
        yield True
    finally:
        claim.unlink(missing_ok=True)


def _move_aside(path: Path, token) -> Path | None:
    """Rename the lock we judged stale to a name of our own. Only one contender's rename of it succeeds; should
    another contender's fresh lock have replaced it in between, that one is put back. None when we lost the race."""
    aside = path.with_name(f".{LOCK}.stale-{uuid.uuid4().hex}")
    found = read_lock(path)
    if found is None or found[0].get("token") != token:
        return None
    try:
        os.rename(path, aside)
    except FileNotFoundError:
        return None
    moved = read_lock(aside)
    if moved is None or moved[0].get("token") != token:
        os.rename(aside, path)
        return None
    return aside


def acquire(run_dir: Path, stale_s: float, instance: str | None = None) -> RunLock:
    """Take the run lock of `run_dir` (the folder exists), starting its heartbeat. A lock whose holder is dead on this
    host, is the same instance, or has not beaten for `stale_s` is taken over with one warning line; any other raises
    RunLockedError."""
    run_dir = Path(run_dir)
    path = run_dir / LOCK
    try:
        for _ in range(10):  # each pass loses only to a contender that made progress; ten losses in a row: give up
            found = read_lock(path)
            if found is None:
                record = _create(path, 1, instance)
                if record is not None:
                    return RunLock(path, record, stale_s)
                continue
            held, mtime = found
            age = heartbeat_age(run_dir, mtime)
            why = takeover_reason(held, age, stale_s, instance)
            if why is None:
                raise RunLockedError(f"run.name ({_short(run_dir.name)}): {run_dir} is in use by another run "
                                     f"({describe(held, age)}); wait for it, stop it, or use another run.name")
            with _takeover_claim(path, stale_s) as claimed:
                aside = _move_aside(path, held.get("token")) if claimed else None
                if aside is None:
                    continue
                fence = held.get("fence")
                record = _create(path, (fence if isinstance(fence, int) and fence > 0 else 0) + 1, instance)
                aside.unlink(missing_ok=True)
            if record is None:
                continue
            print(f"stride: warning: taking over the run lock of {run_dir} from {describe(held, age)} ({why})",
                  file=sys.stderr, flush=True)
            return RunLock(path, record, stale_s)
    except OSError as e:
        raise UsageError(f"run.storage_path ({run_dir.parent}): cannot take the run lock {path} ({e.strerror or e}); "
                         f"set run.storage_path=<a folder you can write>") from None
    raise RunLockedError(f"run.name ({_short(run_dir.name)}): {run_dir}'s run lock changed hands 10 times while this "
                         f"run tried to take it; another run is starting there: wait for it, or use another run.name")


class Fence:
    """A worker's check that its run still holds the run folder. `token` None: no lock was taken (a Trainer built
    without a launcher), and every check passes. `clock` is the worker's own clock (seconds; tests pass theirs)."""

    def __init__(self, run_dir: Path | str, token: str | None, stale_s: float,
                 clock: Callable[[], float] = time.monotonic):
        self.path, self.token, self.stale_s, self._clock = Path(run_dir) / LOCK, token, stale_s, clock
        self._verified: tuple | None = None  # the lstat signature of the file last read and found ours
        self._mtime: float | None = None
        self._since = clock()  # this worker's clock when it saw the mtime change last
        self._mutex = threading.Lock()  # the checkpoint writer's thread checks too

    def still_holds(self) -> None:
        """Raise RunLockLostError unless the lock is still this run's and beating. One lstat; the file is read only
        when that changed since it was last read and found ours."""
        if self.token is None:
            return
        with self._mutex:
            try:
                st = os.lstat(self.path)
            except FileNotFoundError:
                self._lost("its run lock is gone")
            except OSError:  # storage down for a moment: not a beat, so a lasting failure ends as a stale heartbeat
                st = None
            if st is not None:
                # Content changes only by a write, which moves mtime and ctime; a new file (a takeover) is a new
                # inode while the old one still exists. Same signature, same token.
                signature = (st.st_ino, st.st_dev, st.st_mtime_ns, st.st_ctime_ns, st.st_size, st.st_mode)
                if signature != self._verified and self._read_own():
                    self._verified = signature
            now = self._clock()
            if st is not None and st.st_mtime != self._mtime:
                self._mtime, self._since = st.st_mtime, now
            elif now - self._since > self.stale_s:
                raise RunLockLostError(
                    f"{self.path}: the driver's heartbeat has not moved for {now - self._since:.0f}s "
                    f"(run.lock_stale_s={self.stale_s:g}): the run's driver is gone; this worker stops before writing "
                    f"anything more there")

    def _read_own(self) -> bool:
        """Raise unless the lock file holds this run's token; False when it could not be read just now."""
        try:
            found = read_lock(self.path)
        except UsageError as e:
            self._lost(f"its run lock was replaced: {e}")
        except OSError:
            return False
        if found is None:
            self._lost("its run lock is gone")
        if found[0].get("token") != self.token:
            self._lost(f"its run lock is held by {describe(found[0], None)}")
        return True

    def _lost(self, why: str):
        raise RunLockLostError(f"{self.path.parent} is no longer this run's ({why}); this worker stops before writing "
                               f"anything more there")


def launcher_instance() -> str | None:
    """What makes a relaunch "the same run restarted" outside Tune: the SLURM job id, which a requeue keeps."""
    job = os.environ.get("SLURM_JOB_ID")
    return f"slurm:{job}" if job else None


# ---- the lock of a run on a bucket ------------------------------------------------------------------------------
# The same semantics on an object store, built on its conditional writes instead of O_EXCL and rename: the lock is
# created only if absent; a beat rewrites it only if it is unchanged since this holder's last write (so a takeover in
# between makes the beat fail, not undo the takeover); a stale lock is taken over by replacing exactly the version
# judged stale. Staleness is judged on the storage's clock (the object's modification time against a probe's), as
# the folder lock judges it on the file server's.


class ObjectRunLock(RunLock):
    """The run lock of a run on a bucket (`store`: trainers/run/storage.py at the run's prefix)."""

    def __init__(self, store, record: dict, version: str, stale_s: float):
        self.store, self.version = store, version
        self._version_lock = threading.Lock()
        super().__init__(Path(store.describe(LOCK)), record, stale_s)

    def beat(self) -> bool:
        try:
            with self._version_lock:
                record = dict(self.record, beat=self.record.get("beat", 0) + 1)
                new = self.store.replace(LOCK, json.dumps(record).encode(), self.version)
                if new is not None:
                    self.record, self.version = record, new
                    return True
        except OSError as e:
            log.warning("run lock %s: heartbeat failed (%s); retrying", self.store.describe(LOCK), e)
            return True
        found = _read_object_lock(self.store)
        return self._lost_to(self.store.describe(), found[0] if found else None)

    def held(self) -> bool:
        try:
            found = _read_object_lock(self.store)
        except OSError:
            return False
        return found is not None and found[0].get("token") == self.token

    def release(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        if self.held():
            self.store.delete(LOCK)


def _read_object_lock(store) -> tuple[dict, str] | None:
    """(record, version) of the lock object, or None. A record that is not Stride's JSON reads as {}."""
    found = store.read_versioned(LOCK)
    if found is None:
        return None
    data, version = found
    try:
        record = json.loads(data[:MAX_LOCK_BYTES])
    except ValueError:
        record = {}
    return (record if isinstance(record, dict) else {}), version


def _new_record(fence: int, instance: str | None) -> dict:
    return {"token": uuid.uuid4().hex, "fence": fence, "host": socket.gethostname(), "pid": os.getpid(),
            "pid_start": process_start(os.getpid()), "started": time.time(), "instance": instance, "beat": 0}


def acquire_object(store, run_name: str, stale_s: float, instance: str | None = None) -> ObjectRunLock:
    """acquire() for a run on a bucket: create the lock if absent; take over a stale one by replacing exactly the
    version judged stale; else RunLockedError naming the run and the holder."""
    for _ in range(10):
        found = _read_object_lock(store)
        if found is None:
            record = _new_record(1, instance)
            version = store.create(LOCK, json.dumps(record).encode())
            if version is not None:
                return ObjectRunLock(store, record, version, stale_s)
            continue
        held, version = found
        modified = store.modified(LOCK)
        age = max(0.0, store.now() - modified) if modified is not None else 0.0
        why = takeover_reason(held, age, stale_s, instance)
        if why is None:
            raise RunLockedError(f"run.name ({_short(run_name)}): {store.describe()} is in use by another run "
                                 f"({describe(held, age)}); wait for it, stop it, or use another run.name")
        fence = held.get("fence")
        record = _new_record((fence if isinstance(fence, int) and fence > 0 else 0) + 1, instance)
        new = store.replace(LOCK, json.dumps(record).encode(), version)
        if new is None:  # another contender changed it first: look again
            continue
        print(f"stride: warning: taking over the run lock of {store.describe()} from {describe(held, age)} ({why})",
              file=sys.stderr, flush=True)
        return ObjectRunLock(store, record, new, stale_s)
    raise RunLockedError(f"run.name ({_short(run_name)}): {store.describe()}'s run lock changed hands 10 times while "
                         f"this run tried to take it; another run is starting there: wait for it, or use another "
                         f"run.name")


class ObjectFence(Fence):
    """Fence for a run on a bucket. A daemon thread reads the lock object's version once every POLL_S (and its record
    when the version moved); `still_holds` judges what it last found, without a network call on the training step's
    path. So a write may follow the lock's loss by up to POLL_S plus one request (the folder fence: one write already
    past its check). A lock gone or another run's stops the worker; a version standing still for stale_s on this
    worker's clock is a driver gone; storage that cannot be reached is neither (a lasting outage ends as the latter)."""

    POLL_S = 1.0

    def __init__(self, store, token: str | None, stale_s: float, clock: Callable[[], float] = time.monotonic):
        super().__init__(Path(store.describe()), token, stale_s, clock)
        self.store = store
        self._seen_version: str | None = None
        self._lost_why: str | None = None
        if token is not None:
            self._look()  # the first verdict before the first write
            threading.Thread(target=ObjectFence._poll, args=(weakref.ref(self),), name="stride-fence",
                             daemon=True).start()

    @staticmethod
    def _poll(ref) -> None:
        """Until the fence is lost or gone (a weak reference: a finished Trainer's fence stops polling)."""
        while (fence := ref()) is not None and fence._lost_why is None:
            wait = min(fence.POLL_S, fence.stale_s / 8)
            del fence
            time.sleep(wait)
            if (fence := ref()) is not None:
                fence._look()
            del fence

    def _look(self) -> None:
        try:
            # One metadata request while the version stands still; the record only when it moved (or first).
            version = self.store.version(LOCK) if self._seen_version is not None else ""
            if version is not None and version != self._seen_version:
                found = _read_object_lock(self.store)
                version = found[1] if found else None
        except OSError:  # storage down for a moment: not a beat
            return
        with self._mutex:
            if version is None:
                self._lost_why = "its run lock is gone"
            elif version != self._seen_version:
                if found[0].get("token") != self.token:
                    self._lost_why = f"its run lock is held by {describe(found[0], None)}"
                self._seen_version, self._since = version, self._clock()

    def still_holds(self) -> None:
        if self.token is None:
            return
        with self._mutex:
            if self._lost_why is not None:
                self._lost(self._lost_why)
            if self._clock() - self._since > self.stale_s:
                raise RunLockLostError(
                    f"{self.store.describe(LOCK)}: the driver's heartbeat has not moved for "
                    f"{self._clock() - self._since:.0f}s (run.lock_stale_s={self.stale_s:g}): the run's driver is gone; "
                    f"this worker stops before writing anything more there")

    def _lost(self, why: str):
        raise RunLockLostError(f"{self.store.describe()} is no longer this run's ({why}); this worker stops before "
                               f"writing anything more there")


def fence_for(cfg, run_dir: Path | str, token: str | None, clock: Callable[[], float] = time.monotonic) -> Fence:
    """The fence of a config's run: on its bucket's lock object, or on its folder's lock file."""
    from stride.trainers.run.remote import RunRemote

    remote = RunRemote.of(cfg)
    if remote is not None:
        return ObjectFence(remote.store, token, cfg.run.lock_stale_s, clock)
    return Fence(run_dir, token, cfg.run.lock_stale_s, clock)
