"""Where a sweep's own files live: the driver's state, trial events, worker log and summary, and each trial's run.

A sweep in a folder keeps them in <storage_path>/<name>/, beside its trials' run folders. A sweep on a bucket
(`sweep.storage_path: s3://bucket/prefix` or `gs://...`) keeps them under <storage_path>/<name>/ in the bucket: the
driver writes them in this machine's private working copy of the sweep (the same place a run's working copy goes:
trainers/run/remote.py, under `checkpoint.staging_dir`) and pushes each one whole after every change, so a rerun of
the sweep from any machine pulls them back and resumes. Each trial is a run on the bucket at
<storage_path>/<name>/<trial id>, and Ray Tune keeps its experiment state at <storage_path>/<name> itself.

`SweepFiles` travels in Tune's pickled state (its ConsoleCallback): it holds only strings, and finds its working
copy again on the machine that unpickles it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from stride.trainers.run.storage import location_of

EVENTS = "trial_events.jsonl"  # the driver's record of each trial's start, results and end (tune/trial.py)
# One bucket side per sweep in a process: Tune's copy of the console callback (unpickled on a resume) and the driver
# push the same files through one RunRemote, so a background push never lands after a newer one.
_REMOTES: dict[tuple[str, str], Any] = {}


def sweep_location(root: str, name: str) -> str:
    """The sweep's place as a user reads it: the folder <root>/<name>, or s3://bucket/prefix/<name>."""
    location = location_of(root)
    return str(location.join(name)) if location is not None else str(Path(root) / name)


class SweepFiles:
    """The sweep's own files under `root` (the normalized sweep.storage_path) / `name`."""

    def __init__(self, root: str, name: str, staging_dir: str | None):
        self.root, self.name, self.staging_dir = root, name, staging_dir
        self._local: Path | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {"root": self.root, "name": self.name, "staging_dir": self.staging_dir}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(**state)

    @property
    def on_bucket(self) -> bool:
        return location_of(self.root) is not None

    @property
    def where(self) -> str:
        return sweep_location(self.root, self.name)

    def trial(self, trial_id: str) -> str:
        """A trial's run: its folder, or its URI."""
        return sweep_location(self.where, trial_id)

    @property
    def local(self) -> Path:
        """The folder the driver writes the sweep's files in: the sweep folder, or this machine's working copy."""
        if self._local is None:
            location = location_of(self.root)
            if location is None:
                self._local = Path(self.where)
            else:
                from stride.trainers.run.remote import working_copy

                self._local = working_copy(location, self.name, self.staging_dir)
        return self._local

    def remote(self):
        """The bucket side (trainers/run/remote.py's RunRemote on <root>/<name>); None for a folder."""
        location = location_of(self.root)
        if location is None:
            return None
        key = (self.root, self.name)
        if key not in _REMOTES:
            from stride.trainers.run.remote import RunRemote
            from stride.trainers.run.storage import ObjectStore

            _REMOTES[key] = RunRemote(ObjectStore(location.join(self.name)), self.local)
        return _REMOTES[key]

    def path(self, name: str) -> Path:
        return self.local / name

    def describe(self, name: str) -> str:
        remote = self.remote()
        return remote.store.describe(name) if remote is not None else str(self.path(name))

    def pull(self, *names: str) -> None:
        """The bucket's copies of `names` into the working copy; one the bucket lacks is removed here (a stale copy
        of a sweep since deleted from the bucket must not come back)."""
        remote = self.remote()
        if remote is None:
            return
        for name in names:
            if not remote.pull(name):
                self.path(name).unlink(missing_ok=True)

    def push(self, name: str) -> None:
        """`name` to the bucket now, whole (nothing for a folder)."""
        remote = self.remote()
        if remote is not None:
            from stride.trainers.run.storage import with_backoff

            with_backoff(lambda: remote.push(name))

    def push_soon(self, name: str) -> None:
        """`name` to the bucket from a background thread (a Tune callback never waits on the network)."""
        remote = self.remote()
        if remote is not None:
            remote.push_soon(name)

    def flush(self) -> None:
        remote = self.remote()
        if remote is not None:
            remote.flush()

    def drop_local(self) -> None:
        """The end of a sweep on a bucket: its files are there, and no copy stays on this machine's disk."""
        if self.on_bucket:
            import shutil

            self.flush()
            shutil.rmtree(self.local, ignore_errors=True)
