"""Which checkpoints a run keeps: the complete ones of the loop's own (checkpoint_<step>, verified once each),
checkpoint.keep_last's pruning and checkpoint.keep_best's best/ folder. A torn, foreign or tampered folder is never
listed, so never pruned (the newest usable one, a resume's: checkpointing.newest_complete)."""

from __future__ import annotations

from stride.errors import RunFolderError
import os
import re
import shutil
from pathlib import Path
from typing import Any

from stride.errors import CheckpointFormatError, RunFolderError
from stride.trainers.run import folder as runfolder
from stride.trainers.run.checkpointing import META, read_meta, verify


BEST = "best"


class BestCheckpoints:
    """checkpoint.keep_best: the k checkpoints with the best `metric` (those written at evaluation steps), kept in
    <run>/best/ beside keep_last's newest ones. Each is the checkpoint's files hard-linked (copied across
    filesystems) into best/checkpoint_<step>, so the launcher's pruning of old checkpoints never takes them, and a
    resumed run ranks what is on disk. Rank 0 offers each checkpoint once its write is complete."""

    def __init__(self, run_dir: Path, metric: str, mode: str, k: int):
        self.folder, self.metric, self.mode, self.k = Path(run_dir) / BEST, metric, mode, k

    def _better(self, a: float, b: float) -> bool:
        return a < b if self.mode == "min" else a > b

    def _ranked_entry(self, folder: Path) -> tuple[float, int, Path] | None:
        """(value, step, folder) from its meta.json (schema-checked), or None: not an evaluation step's, or not a
        checkpoint. Only meta.json is read: best/'s folders appear by rename once their files are all linked, and
        whoever loads one (export.py --best) verifies it."""
        try:
            meta = read_meta(folder)
        except (OSError, ValueError, RunFolderError, CheckpointFormatError):
            return None
        value = (meta.get("metrics") or {}).get(self.metric)
        if not isinstance(value, (int, float)) or value != value:  # missing, or NaN
            return None
        return float(value), meta["step"], folder

    def ranked(self) -> list[tuple[float, int, Path]]:
        """(value, step, folder) of the kept ones, best first (ties: the earlier step)."""
        kept = [e for f in (self.folder.glob("checkpoint_*") if self.folder.is_dir() else ())
                if f.is_dir() and not f.is_symlink() and (e := self._ranked_entry(f)) is not None]
        return sorted(kept, key=lambda t: (t[0] if self.mode == "min" else -t[0], t[1]))

    def offer(self, checkpoint: Path) -> None:
        if (entry := self._ranked_entry(checkpoint)) is None:  # not an evaluation step's checkpoint
            return
        value = entry[0]
        kept = self.ranked()
        target = self.folder / checkpoint.name
        if target.exists() or (len(kept) >= self.k and not self._better(value, kept[-1][0])):
            return
        runfolder.make_folder(self.folder)
        staging = runfolder.temp_name(target)
        staging.mkdir()
        for f in checkpoint.iterdir():
            if f.is_file() and not f.is_symlink():
                try:
                    os.link(f, staging / f.name)
                except OSError:  # another filesystem, or no hard links there
                    shutil.copy2(f, staging / f.name)
        os.rename(staging, target)
        for *_, worse in self.ranked()[self.k:]:
            shutil.rmtree(worse, ignore_errors=True)

    def summary(self) -> list[dict[str, Any]]:
        return [{"checkpoint": str(folder), "step": step, self.metric: value} for value, step, folder in self.ranked()]


class BucketBestCheckpoints(BestCheckpoints):
    """checkpoint.keep_best for a run on a bucket (trainers/run/remote.py): best/ is a prefix beside the run's
    checkpoints, and a kept checkpoint is a server-side copy of its objects (object storage has no hard links),
    meta.json copied last so that a copy cut short is never complete. Ranked from the bucket's meta.json files."""

    def __init__(self, remote, metric: str, mode: str, k: int):
        self.remote, self.metric, self.mode, self.k = remote, metric, mode, k

    def _entry(self, name: str) -> tuple[float, int, str] | None:
        import json

        try:
            meta = json.loads(self.remote.store.read(f"{name}/{META}") or b"null")
            value, step = (meta.get("metrics") or {}).get(self.metric), meta["step"]
        except (ValueError, TypeError, KeyError, AttributeError):
            return None
        if not isinstance(value, (int, float)) or value != value or not isinstance(step, int):
            return None
        return float(value), step, name

    def ranked(self) -> list[tuple[float, int, str]]:
        kept = [e for n in self.remote.store.folders(BEST) if OWN_CHECKPOINT.fullmatch(n)
                and (e := self._entry(f"{BEST}/{n}")) is not None]
        return sorted(kept, key=lambda t: (t[0] if self.mode == "min" else -t[0], t[1]))

    def offer(self, checkpoint: Path) -> None:
        store, name = self.remote.store, Path(checkpoint).name
        if (entry := self._entry(name)) is None:
            return
        kept = self.ranked()
        if any(n == f"{BEST}/{name}" for *_, n in kept) or (len(kept) >= self.k and not self._better(entry[0], kept[-1][0])):
            return
        files = sorted(store.listing(name), key=lambda n: n.endswith("/" + META))  # meta.json last
        for n in files:
            store.copy(n, f"{BEST}/{n}")
        for *_, worse in self.ranked()[self.k:]:
            store.delete(worse)

    def summary(self) -> list[dict[str, Any]]:
        return [{"checkpoint": self.remote.store.describe(name), "step": step, self.metric: value}
                for value, step, name in self.ranked()]


# ---- retention: checkpoint.keep_last (torchrun prunes here; Ray Train keeps num_to_keep of those it registered) ----

OWN_CHECKPOINT = re.compile(r"checkpoint_\d{8}")  # checkpoint_<step>, as the loop names them (not Ray's own names)
_verified: set[tuple[str, int]] = set()  # (folder, meta.json mtime) that verified: each read and hashed once


def complete_checkpoints(run_dir: Path) -> list[Path]:
    """The loop's checkpoints (checkpoint_<step>) that verify, oldest first. Anything else (folders Ray named, torn
    writes, an unreadable meta.json) is never listed, so never pruned."""
    found = []
    for p in run_dir.glob("checkpoint_*"):
        if not (p.is_dir() and OWN_CHECKPOINT.fullmatch(p.name)):
            continue
        try:
            key = (str(p), (p / META).stat().st_mtime_ns)
            if key not in _verified and verify(p) is None:
                _verified.add(key)
            if key in _verified:
                found.append((read_meta(p)["step"], p))
        except (OSError, ValueError, KeyError, RunFolderError, CheckpointFormatError):  # never listed, never pruned
            continue
    return [p for _, p in sorted(found)]


def prune_checkpoints(run_dir: Path, keep_last: int) -> None:
    """Delete all but the newest `keep_last` complete checkpoints of the loop's own (never a torn or foreign one)."""
    import shutil

    for old in complete_checkpoints(run_dir)[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)
