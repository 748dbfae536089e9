"""Train state on disk: what a checkpoint holds, and writing it so that a reader never sees half of one.

A checkpoint folder holds `state.pt` (model, optimizer, scaler, scheduler, RNG states) and `meta.json`
(step, data position, samples seen, MLflow run id, a digest of state.pt). `meta.json` is written last, by
rename, so its presence marks a complete checkpoint; `verify()` re-checks the digest before a resume.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Callable

import torch

STATE = "state.pt"
META = "meta.json"


def atomic_write_bytes(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode())


class CheckpointWriteError(RuntimeError):
    """Storage stayed broken through every retry; the message names the path."""


def with_retries(fn, where: str, attempts: int = 4, first_wait_s: float = 0.5):
    """Run fn(); on OSError wait and try again (0.5 s, 1 s, 2 s): transient storage errors (an NFS hiccup, an
    object store's 503) must not end a run. Raises CheckpointWriteError naming `where` when all attempts fail."""
    import logging
    import time

    for attempt in range(1, attempts + 1):
        try:
            return fn()
        except OSError as e:
            if attempt == attempts:
                raise CheckpointWriteError(f"writing checkpoint to {where} failed {attempts} times ({e}); check that "
                                           f"run.storage_path is writable and has space") from None
            wait = first_wait_s * 2 ** (attempt - 1)
            logging.getLogger("stride").warning("writing checkpoint to %s failed (%s); retry %d/%d in %.1fs",
                                                where, e, attempt, attempts - 1, wait)
            time.sleep(wait)


def stage(obj: Any) -> Any:
    """A private CPU copy of a state tree, so training can go on changing the live tensors while the copy is
    written in the background."""
    import copy

    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: stage(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(stage(v) for v in obj)
    return copy.deepcopy(obj)


def save(folder: Path, state: dict[str, Any], meta: dict[str, Any]) -> Path:
    """Write state then meta (with state's digest) into `folder`, retrying transient errors; returns the folder."""
    folder = Path(folder)
    import io

    buf = io.BytesIO()
    torch.save(state, buf)
    data = buf.getvalue()
    meta = dict(meta, state_sha256=hashlib.sha256(data).hexdigest(), state_bytes=len(data))

    def write():
        folder.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(folder / STATE, data)
        atomic_write_text(folder / META, json.dumps(meta, indent=1))

    with_retries(write, str(folder))
    return folder


def read_meta(folder: Path) -> dict[str, Any]:
    return json.loads((Path(folder) / META).read_text())


def verify(folder: Path) -> str | None:
    """None when the checkpoint is complete and intact, else what is wrong with it."""
    folder = Path(folder)
    try:
        meta = read_meta(folder)
    except (OSError, ValueError) as e:
        return f"no readable {META} ({e.__class__.__name__})"
    try:
        data = (folder / STATE).read_bytes()
    except OSError as e:
        return f"no readable {STATE} ({e.__class__.__name__})"
    if len(data) != meta.get("state_bytes") or hashlib.sha256(data).hexdigest() != meta.get("state_sha256"):
        return f"{STATE} does not match the digest in {META} (torn or corrupted write)"
    return None


class UnsafeCheckpointError(ValueError):
    """A state.pt that is not plain tensors and containers: refused, never unpickled (it could run code)."""


def load_state(path: Path, mmap: bool = False) -> dict[str, Any]:
    """A state file, unpickled only as tensors, numbers, strings and containers (torch's weights_only): whoever can
    write the run folder (a shared filesystem, a bucket) must not run code in every process that resumes from it.
    The digest in meta.json does not help there: who writes state.pt writes meta.json too."""
    import pickle

    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:
        what = str(e).split("WeightsUnpickler error:")[-1].strip().splitlines()[0][:200]
        raise UnsafeCheckpointError(f"{path} holds more than tensors ({what}); it was not loaded. Move that "
                                    f"checkpoint folder away if you did not write it, or use another run.name") from None


def load(folder: Path, mmap: bool = False) -> tuple[dict[str, Any], dict[str, Any]]:
    """state.pt and meta.json; `mmap`: tensors map the file and are read only when touched (FSDP's other ranks)."""
    folder = Path(folder)
    return load_state(folder / STATE, mmap=mmap), read_meta(folder)


def shape_mismatch(model_state: dict[str, torch.Tensor], saved: dict[str, torch.Tensor]) -> str | None:
    """Describe the first tensor whose name or shape differs between a model and a checkpoint."""
    for name, t in model_state.items():
        if name not in saved:
            return f"tensor {name} is missing from the checkpoint"
        if tuple(saved[name].shape) != tuple(t.shape):
            return f"tensor {name} has shape {tuple(saved[name].shape)} in the checkpoint but {tuple(t.shape)} in the model"
    extra = sorted(set(saved) - set(model_state))
    return f"the checkpoint has tensor {extra[0]} that the model lacks" if extra else None


def newest_complete(run_dir: Path, warn: Callable[[str], Any] | None = None) -> Path | None:
    """The checkpoint folder with the highest step whose contents verify: the one to resume from, whoever wrote
    it. Ray's own pointer is not enough: a driver killed between a checkpoint's write and Ray's registration of
    it leaves a complete checkpoint that Ray does not know. Torn or corrupted folders are skipped; `warn` gets one
    line naming those newer than the folder returned."""
    candidates, bad = [], []
    for folder in Path(run_dir).glob("checkpoint_*"):
        if not folder.is_dir() or folder.name.endswith(".tmp"):  # .tmp: torchrun's publish in progress
            continue
        try:
            candidates.append((read_meta(folder)["step"], folder))
        except (OSError, ValueError, KeyError) as e:
            bad.append((folder.stat().st_mtime, folder, f"no readable {META} ({e.__class__.__name__})"))
    newest = None
    for _, folder in sorted(candidates, reverse=True):  # hash only down to the first intact one
        problem = verify(folder)
        if problem is None:
            newest = folder
            break
        bad.append((folder.stat().st_mtime, folder, problem))
    since = newest.stat().st_mtime if newest else float("-inf")
    skipped = [f"{folder.name} ({problem})" for mtime, folder, problem in sorted(bad) if mtime >= since]
    if skipped and warn is not None:
        warn(f"checkpoint {'; '.join(skipped)} is unusable; resuming from "
             f"{newest.name if newest else 'the start (no complete checkpoint)'} instead")
    return newest
