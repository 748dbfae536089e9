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
and other items through torch.load(weights_only=True). Folders of the earlier format (one `state.pt` written by
rank 0) still load, through torch.load(weights_only=True).
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import pickle
import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

import torch

STATE = "state.pt"  # the earlier format's single file
META = "meta.json"
DCP_METADATA = ".metadata"
log = logging.getLogger("stride")


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


def with_retries(fn, where: str, attempts: int = 4, first_wait_s: float = 0.5, errors: tuple = (OSError,)):
    """Run fn(); on OSError (or `errors`) wait and try again (0.5 s, 1 s, 2 s): transient storage errors (an NFS
    hiccup, an object store's 503) must not end a run. Raises CheckpointWriteError naming `where` when all attempts
    fail."""
    for attempt in range(1, attempts + 1):
        try:
            return fn()
        except errors as e:
            if attempt == attempts:
                raise CheckpointWriteError(f"writing checkpoint to {where} failed {attempts} times ({_reason(e)}); "
                                           f"check that run.storage_path is writable and has space") from None
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

    def __init__(self, rank: int, process_group=None, written: Callable[[Path, float], Any] | None = None):
        # DCP's modules take about 0.3 s to import: here, at setup, not inside the first checkpoint's blocking time.
        import torch.distributed.checkpoint  # noqa: F401
        import torch.distributed.checkpoint.staging  # noqa: F401
        import torch.distributed.checkpoint.state_dict  # noqa: F401

        self.rank, self.process_group, self.written = rank, process_group, written
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="stride-checkpoint")
        self._pending: Future | None = None

    def save(self, folder: Path, state: dict[str, Any], meta: dict[str, Any]) -> Future:
        """Stage `state` (tensors, DTensors) now and write it with `meta` into `folder` in the background; returns
        the write's future (its result: the folder, complete)."""
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        self.wait()  # at most one in flight: a second would hold a second copy of the state
        if self.rank == 0:  # a torn folder of the same step (a killed run) is overwritten: unmark it first
            (Path(folder) / META).unlink(missing_ok=True)
        staged = DefaultStager(StagingOptions(False, False, False, False)).stage(state)
        self._pending = self._pool.submit(self._write, Path(folder), staged, meta)
        return self._pending

    def wait(self) -> Path | None:
        """Block until the write in flight (if any) is complete; re-raises its failure (CheckpointWriteError)."""
        pending, self._pending = self._pending, None
        return pending.result() if pending is not None else None

    def close(self) -> None:
        self._pool.shutdown(wait=False)

    def _write(self, folder: Path, staged: dict[str, Any], meta: dict[str, Any]) -> Path:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.api import CheckpointException

        t0 = time.perf_counter()
        def save() -> None:
            with warnings.catch_warnings():  # one process: "assuming the intent is to save in a single process"
                warnings.simplefilter("ignore", UserWarning)
                dcp.save(staged, storage_writer=dcp.FileSystemWriter(folder), process_group=self.process_group,
                         no_dist=self.process_group is None)

        # A failed write fails on every rank (DCP gathers each rank's result), so every rank retries it together.
        with_retries(save, str(folder), errors=(OSError, CheckpointException))
        if self.rank == 0:
            with_retries(lambda: write_marker(folder, meta), str(folder))
            if self.written is not None:
                self.written(folder, time.perf_counter() - t0)
        return folder


def checkpoint_folder(run_dir: Path, step: int) -> Path:
    """Where the checkpoint of `step` goes: <run>/checkpoint_<step, 8 digits> (torchrun's pruning matches the name)."""
    return Path(run_dir) / f"checkpoint_{step:08d}"


def write_marker(folder: Path, meta: dict[str, Any]) -> None:
    """meta.json, with the size and sha256 of every other file in `folder`: written last, it marks the checkpoint
    complete."""
    files = {p.name: {"bytes": p.stat().st_size, "sha256": _sha256(p)}
             for p in sorted(Path(folder).iterdir()) if p.is_file() and p.name != META and not p.name.endswith(".tmp")}
    atomic_write_text(Path(folder) / META, json.dumps(dict(meta, format="dcp", files=files), indent=1))


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def read_meta(folder: Path) -> dict[str, Any]:
    return json.loads((Path(folder) / META).read_text())


def is_sharded(folder: Path) -> bool:
    """A DCP checkpoint (this format), not the earlier single state.pt."""
    return (Path(folder) / DCP_METADATA).exists() or not (Path(folder) / STATE).exists()


def verify(folder: Path) -> str | None:
    """None when the checkpoint is complete and intact, else what is wrong with it."""
    folder = Path(folder)
    try:
        meta = read_meta(folder)
    except (OSError, ValueError) as e:
        return f"no readable {META} ({e.__class__.__name__})"
    if "files" not in meta:  # the earlier format: state.pt and its digest
        meta = dict(meta, files={STATE: {"bytes": meta.get("state_bytes"), "sha256": meta.get("state_sha256")}})
    if not isinstance(meta["files"], dict) or not meta["files"]:
        return f"{META} lists no files"
    for name, want in meta["files"].items():
        path = folder / name
        if Path(name).name != name or not isinstance(want, dict):
            return f"{META} lists an unexpected entry {name!r}"
        try:
            if path.stat().st_size != want.get("bytes") or _sha256(path) != want.get("sha256"):
                return f"{name} does not match the digest in {META} (torn or corrupted write)"
        except OSError as e:
            return f"no readable {name} ({e.__class__.__name__})"
    return None


# ---- reading: never an unrestricted unpickler ----

class UnsafeCheckpointError(ValueError):
    """A checkpoint file that holds more than tensors, plain values and DCP's own metadata: refused, never
    unpickled (it could run code)."""


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


def _safe_reader(folder: Path):
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any):
            path = Path(folder) / DCP_METADATA
            try:
                with open(path, "rb") as f:
                    metadata = _MetadataUnpickler(f).load()
            except pickle.UnpicklingError as e:
                raise _refused(path, str(e)) from None
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
                raise _refused(Path(folder), f"{read_item.dest_index.fqn}: "
                               f"{str(e).split('WeightsUnpickler error:')[-1].strip().splitlines()[0][:200]}") from None
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
        refused = [err for err in _errors(e) if isinstance(err, UnsafeCheckpointError)]
        if refused:
            raise refused[0] from None
        raise


def saved_model_shapes(folder: Path) -> dict[str, tuple[int, ...]]:
    """The model tensors' names and full shapes in a checkpoint (either format), without loading them."""
    folder = Path(folder)
    if not is_sharded(folder):
        return {k: tuple(v.shape) for k, v in load_state(folder / STATE, mmap=True)["model"].items()}
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    return {k.removeprefix("model."): tuple(m.size) for k, m in dcp_metadata(folder).state_dict_metadata.items()
            if k.startswith("model.") and isinstance(m, TensorStorageMetadata)}


def load_model_state(folder: Path) -> dict[str, torch.Tensor]:
    """The full (consolidated) model weights of a checkpoint of either format, in one process, as plain CPU
    tensors: for trainers/generate.py and trainers/export.py."""
    folder = Path(folder)
    if not is_sharded(folder):
        return load_state(folder / STATE)["model"]
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    meta = dcp_metadata(folder).state_dict_metadata
    model = {k.removeprefix("model."): torch.empty(tuple(m.size), dtype=m.properties.dtype)
             for k, m in meta.items() if k.startswith("model.") and isinstance(m, TensorStorageMetadata)}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.load({"model": model}, storage_reader=_safe_reader(folder), planner=_safe_planner(folder), no_dist=True)
    return model


def load_state(path: Path, mmap: bool = False) -> dict[str, Any]:
    """An earlier-format state.pt, unpickled only as tensors, numbers, strings and containers (torch's
    weights_only)."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:
        raise _refused(path, str(e).split("WeightsUnpickler error:")[-1].strip().splitlines()[0][:200]) from None


def load(folder: Path, mmap: bool = False) -> tuple[dict[str, Any], dict[str, Any]]:
    """An earlier-format checkpoint: state.pt and meta.json; `mmap`: tensors map the file and are read only when
    touched (FSDP's other ranks)."""
    folder = Path(folder)
    return load_state(folder / STATE, mmap=mmap), read_meta(folder)


def shape_mismatch(model: dict[str, tuple[int, ...]], saved: dict[str, tuple[int, ...]]) -> str | None:
    """Describe the first tensor whose name or shape differs between a model and a checkpoint (name -> shape)."""
    for name, shape in model.items():
        if name not in saved:
            return f"tensor {name} is missing from the checkpoint"
        if tuple(saved[name]) != tuple(shape):
            return f"tensor {name} has shape {tuple(saved[name])} in the checkpoint but {tuple(shape)} in the model"
    extra = sorted(set(saved) - set(model))
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
