"""Pretrained weights for fine-tuning (config section `init`): open init.from (a safetensors file, a Hugging Face
model folder, a plain state dict or a Stride run/checkpoint folder, local or behind a URI pyarrow reads), match its
tensors to the model's names, and copy them in.

The match is planned from headers alone (shapes and dtypes, no tensor data), so that the driver checks it on a
meta-device model and a wrong name or shape is one line before any worker starts; the workers then copy in place,
each rank of an FSDP2 model reading only its own slice. Nothing is unpickled beyond tensors and plain containers
(torch.load(weights_only=True)): a downloaded .pt must not run code in every process that loads it.
"""

from __future__ import annotations

from stride.errors import UnsafeCheckpointError
import contextlib
import hashlib
import json
import math
import os
import pickle
import posixpath
import re
import shutil
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

import torch

from stride.trainers.run import checkpointing
from stride.trainers.config import redact
from stride.errors import ConfigError
from stride.errors import quote

__all__ = ["Source", "check_init", "init_model", "known_sha256", "open_source"]

KINDS = "<a .safetensors file, a Hugging Face model folder, a .pt state dict or a Stride run folder>"
INDEX = "model.safetensors.index.json"
STATE_DICT_SUFFIXES = (".pt", ".pth", ".bin")
# What a folder URI's download takes: weights, their index and Stride's checkpoint files (not a repo's other files).
DOWNLOADED_SUFFIXES = (".safetensors", ".json", ".distcp", checkpointing.DCP_METADATA) + STATE_DICT_SUFFIXES
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "U16": torch.uint16, "U32": torch.uint32, "U64": torch.uint64, "BOOL": torch.bool,
           "C64": torch.complex64, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
Adapt = Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]


@dataclass(frozen=True)
class TensorInfo:
    shape: tuple[int, ...]
    dtype: torch.dtype


def _short(e: BaseException | str) -> str:
    """The first sentence of an error, for an error line (torch's go on for paragraphs)."""
    lines = [line for line in str(e).splitlines() if line.strip()]
    return (lines[0].strip().split(". ")[0] if lines else type(e).__name__)[:150]


def _first(names: list[str], n: int = 3, sep: str = ", ") -> str:
    return sep.join(names[:n]) + (f"{sep}... ({len(names) - n} more)" if len(names) > n else "")


def _unusable(location: str, what: str) -> ConfigError:
    return ConfigError(f"init.from ({redact(location)}) {what}; set init.from={KINDS}")


# Digests this process computed, by file identity: the driver hashes init.from once for its check, and hands the
# digest to the workers (known_sha256 -> RunPlan.init_sha256), so no worker reads the whole file again for it.
_DIGESTS: dict[tuple[int, int, int, int], str] = {}


def _identity(path: Path) -> tuple[int, int, int, int]:
    st = os.stat(path)
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def _file_sha256(path: Path) -> str:
    key = _identity(path)
    if key not in _DIGESTS:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            while chunk := f.read(1 << 22):
                h.update(chunk)
        _DIGESTS[key] = h.hexdigest()
    return _DIGESTS[key]


def _digest(entries: Iterable[tuple[str, str]]) -> str:
    """One sha256 over (relative name, file sha256) pairs, sorted: a folder's identity."""
    return hashlib.sha256("".join(f"{name}\0{sha}\n" for name, sha in sorted(entries)).encode()).hexdigest()


# ---- sources ----

class Source:
    """An opened init.from. Reads headers without reading tensor data where the format allows."""

    def __init__(self, location: str, kind: str, root: Path):
        self.location, self.kind, self.root = location, kind, root
        self._sha256: str | None = None
        self._temp: Path | None = None  # a URI's local copy, removed by close()

    def infos(self) -> dict[str, TensorInfo]:
        raise NotImplementedError

    def read(self, name: str, index: tuple[slice, ...] | None = None) -> torch.Tensor:
        raise NotImplementedError

    def _files(self) -> list[Path]:
        return [self.root]

    def sha256(self) -> str:
        if self._sha256 is None:
            files = self._files()
            self._sha256 = _file_sha256(files[0]) if files == [self.root] else _digest(
                (f.relative_to(self.root).as_posix(), _file_sha256(f)) for f in files)
        return self._sha256

    def close(self) -> None:
        if self._temp is not None:
            shutil.rmtree(self._temp, ignore_errors=True)
            self._temp = None

    def __enter__(self) -> Source:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class _Safetensors(Source):
    """A .safetensors file, or a folder of shards (`weight_map`: its index's name -> file, None: every file)."""

    def __init__(self, location: str, kind: str, root: Path, files: list[Path], weight_map: dict[str, str] | None):
        super().__init__(location, kind, root)
        from safetensors import safe_open

        self._stack, self._where, self._file_of, self._infos = contextlib.ExitStack(), {}, {}, {}
        try:
            for file in files:
                try:
                    handle = self._stack.enter_context(safe_open(str(file), framework="pt"))
                except Exception as e:  # noqa: BLE001 - SafetensorError, OSError: the file is what is wrong
                    raise _unusable(location, f"has {file.name}, which is not a readable safetensors file "
                                              f"({_short(e)})") from None
                names = handle.keys() if weight_map is None else [n for n, f in weight_map.items() if f == file.name]
                present = set(handle.keys())
                for name in names:
                    if name not in present:
                        raise _unusable(location, f"has an {INDEX} that puts {name} in {file.name}, which lacks it")
                    if name in self._file_of:
                        raise _unusable(location, f"has tensor {name} in both {self._file_of[name].name} and "
                                                  f"{file.name}; remove one, or add the {INDEX} that picks one,")
                    view = handle.get_slice(name)
                    if view.get_dtype() not in _DTYPES:
                        raise _unusable(location, f"has tensor {name} of dtype {view.get_dtype()}, which Stride "
                                                  f"does not read")
                    self._where[name], self._file_of[name] = handle, file
                    self._infos[name] = TensorInfo(tuple(view.get_shape()), _DTYPES[view.get_dtype()])
            self._file_list = files
        except BaseException:
            self._stack.close()
            raise

    def infos(self) -> dict[str, TensorInfo]:
        return dict(self._infos)

    def read(self, name: str, index: tuple[slice, ...] | None = None) -> torch.Tensor:
        handle = self._where[name]
        return (handle.get_tensor(name) if index is None else handle.get_slice(name)[index]).contiguous()

    def _files(self) -> list[Path]:
        return self._file_list

    def close(self) -> None:
        self._stack.close()
        super().close()


class _StateDict(Source):
    """A torch.save'd state dict (`file`), memory-mapped where it is zip-format, so only the tensors read count."""

    def __init__(self, location: str, root: Path, file: Path):
        super().__init__(location, "state_dict", root)
        self._file, self._tensors = file, _load_state_dict(file, location)

    def infos(self) -> dict[str, TensorInfo]:
        return {n: TensorInfo(tuple(t.shape), t.dtype) for n, t in self._tensors.items()}

    def read(self, name: str, index: tuple[slice, ...] | None = None) -> torch.Tensor:
        t = self._tensors[name]
        return (t if index is None else t[index]).contiguous()

    def _files(self) -> list[Path]:
        return [self._file]


def _load_state_dict(path: Path, location: str) -> dict[str, torch.Tensor]:
    try:  # mmap only reads zip-format files (torch.save's default since 1.6); the legacy format loads whole
        obj = torch.load(path, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(path))
    except pickle.UnpicklingError as e:
        if found := re.search(r"GLOBAL (\S+) was not an allowed global", str(e)):
            raise ConfigError(f"init.from ({redact(location)}) is not a plain state dict: it pickles {found[1]} "
                              f"which Stride never unpickles; save model.state_dict() with torch.save, or convert "
                              f"it to safetensors") from None
        raise _unusable(location, f"is not a readable state dict ({_short(str(e).split('error:')[-1])})") from None
    except (RuntimeError, OSError, EOFError, ValueError) as e:
        raise _unusable(location, f"is not a readable state dict ({_short(e)})") from None
    if isinstance(obj, dict):
        for key in ("state_dict", "model"):  # Lightning's and many training scripts' checkpoints
            inner = obj.get(key)
            if isinstance(inner, dict) and inner and all(isinstance(v, torch.Tensor) for v in inner.values()):
                obj = inner
                break
    if not isinstance(obj, dict):
        raise _unusable(location, f"holds a {type(obj).__name__}, not a state dict (a dict of name -> tensor)")
    for name, value in obj.items():
        if not isinstance(name, str) or not isinstance(value, torch.Tensor):
            raise _unusable(location, f"is not a flat state dict: {quote(name)} holds a {type(value).__name__}, "
                                      f"not a tensor")
    return obj


class _Checkpoint(Source):
    """A Stride checkpoint folder. Its headers come from DCP's metadata; the first read() loads
    the whole model state (consolidated, on every rank that reads) and later reads slice it."""

    def __init__(self, location: str, folder: Path):
        super().__init__(location, "stride_checkpoint", folder)
        self._state: dict[str, torch.Tensor] | None = None
        try:
            meta = checkpointing.dcp_metadata(folder).state_dict_metadata
            self._infos = {n: TensorInfo(tuple(s), meta["model." + n].properties.dtype)
                           for n, s in checkpointing.saved_model_shapes(folder).items()}
        except (UnsafeCheckpointError, OSError, KeyError, RuntimeError) as e:
            raise _unusable(location, f"is a Stride checkpoint that cannot be read ({_short(e)})") from None

    def infos(self) -> dict[str, TensorInfo]:
        return dict(self._infos)

    def read(self, name: str, index: tuple[slice, ...] | None = None) -> torch.Tensor:
        if self._state is None:
            self._state = checkpointing.load_model_state(self.root)
        t = self._state[name]
        return (t if index is None else t[index]).contiguous()

    def sha256(self) -> str:
        # meta.json lists every file's sha256, and verify() checked them when the source was opened
        if self._sha256 is None:
            files = checkpointing.read_meta(self.root)["files"]
            self._sha256 = _digest((name, entry["sha256"]) for name, entry in files.items())
        return self._sha256


def open_source(location: str) -> Source:
    """init.from, opened: a local path, or a URI (s3://, gs://, file://) whose file or folder is downloaded to a
    private temporary folder that close() removes. ConfigError (one line) for anything Stride cannot read."""
    if "://" in location:
        return _open_uri(location)
    path = os.path.abspath(os.path.expanduser(location))
    return _open_local(Path(path), path)


def _open_local(path: Path, location: str) -> Source:
    if not path.exists():
        raise ConfigError(f"init.from ({redact(location)}) does not exist; set init.from={KINDS}")
    if path.is_dir():
        return _open_folder(path, location)
    if path.suffix.lower() == ".safetensors":
        return _Safetensors(location, "safetensors", path, [path], None)
    if path.suffix.lower() in STATE_DICT_SUFFIXES:
        return _StateDict(location, path, path)
    raise _unusable(location, f"is a {path.suffix or 'extensionless'} file, which Stride does not read as weights")


def _open_folder(folder: Path, location: str) -> Source:
    if (folder / checkpointing.META).exists():
        if problem := checkpointing.verify(folder):
            raise _unusable(location, f"is a Stride checkpoint that cannot be used ({problem})")
        return _Checkpoint(location, folder)
    if any(p.is_dir() for p in folder.glob("checkpoint_*")):  # (Ray's checkpoint_manager_snapshot.json is a file)
        if (newest := checkpointing.newest_complete(folder)) is None:
            raise _unusable(location, "is a Stride run folder with no complete checkpoint")
        return _Checkpoint(location, newest)
    if (folder / INDEX).exists():
        weight_map = _weight_map(folder, location)
        files = [folder / f for f in sorted(set(weight_map.values()))]
        return _Safetensors(location, "safetensors_folder", folder, files, weight_map)
    if files := sorted(p for p in folder.glob("*.safetensors") if p.is_file()):
        return _Safetensors(location, "safetensors_folder", folder, files, None)
    state_dicts = sorted(p for p in folder.iterdir() if p.is_file() and p.suffix.lower() in STATE_DICT_SUFFIXES)
    if len(state_dicts) == 1:
        return _StateDict(location, folder, state_dicts[0])
    what = f"{len(state_dicts)} state dict files ({_first([p.name for p in state_dicts])})" if state_dicts \
        else "no .safetensors file, no .pt/.bin state dict and no Stride checkpoint"
    raise _unusable(location, f"is a folder with {what}")


def _weight_map(folder: Path, location: str) -> dict[str, str]:
    """The index's tensor name -> shard file; each file a plain name inside the folder (a Hugging Face cache's
    files are links into its blobs folder: the name is checked, not where it leads)."""
    try:
        weight_map = json.loads((folder / INDEX).read_text())["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise _unusable(location, f"has an {INDEX} that is not a Hugging Face index ({_short(e)})") from None
    if not isinstance(weight_map, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                   for k, v in weight_map.items()):
        raise _unusable(location, f"has an {INDEX} whose weight_map is no dict of tensor name -> file name")
    for file in sorted(set(weight_map.values())):
        if file in ("", ".", "..") or "/" in file or "\\" in file or os.sep in file:
            raise _unusable(location, f"has an {INDEX} that names {quote(file)}, which is not a file of this folder")
        if not (folder / file).is_file():
            raise _unusable(location, f"has an {INDEX} that names {file}, which is missing")
    return weight_map


def _open_uri(uri: str) -> Source:
    import pyarrow as pa
    import pyarrow.fs as pafs

    try:
        fs, root = pafs.FileSystem.from_uri(uri)
        info = fs.get_file_info(root)
    except (pa.ArrowException, OSError) as e:
        raise ConfigError(f"init.from ({redact(uri)}) cannot be opened ({_short(e)}); use a local path or a URI "
                          f"pyarrow can read") from None
    if info.type == pafs.FileType.NotFound:
        raise ConfigError(f"init.from ({redact(uri)}) does not exist; set init.from={KINDS}")
    temp = Path(tempfile.mkdtemp(prefix="stride-init-"))  # mode 0700: the copy is this user's alone
    try:
        try:
            local = _download(fs, root, info.type == pafs.FileType.File, temp, uri)
        except (pa.ArrowException, OSError) as e:
            raise ConfigError(f"init.from ({redact(uri)}) could not be downloaded ({_short(e)}); check the URI and "
                              f"its credentials") from None
        source = _open_local(local, uri)
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)
        raise
    source._temp = temp
    return source


def _download(fs, root: str, is_file: bool, temp: Path, uri: str) -> Path:
    """A file, or a folder's weight files, copied under `temp`; of a run folder only its newest checkpoint that
    verifies (every checkpoint would be many times the model)."""
    import pyarrow.fs as pafs

    def copy(src: str, dst: Path) -> None:
        with fs.open_input_stream(src) as r, open(dst, "wb") as w:
            shutil.copyfileobj(r, w, 1 << 22)

    def copy_files(entries, dst: Path, keep: Callable[[str], bool]) -> list[str]:
        files = {e.base_name: e.path for e in entries if e.type == pafs.FileType.File}
        names = [n for n in files if keep(n)]
        if any(n.endswith(".safetensors") for n in names):  # a model folder with both: the .bin is not needed
            names = [n for n in names if not n.endswith(STATE_DICT_SUFFIXES)]
        for name in names:
            copy(files[name], dst / name)
        return list(files)

    if is_file:
        copy(root, local := temp / posixpath.basename(root))
        return local
    (local := temp / (posixpath.basename(root.rstrip("/")) or "model")).mkdir()
    entries = fs.get_file_info(pafs.FileSelector(root))
    if checkpointing.META in copy_files(entries, local, lambda n: n.endswith(DOWNLOADED_SUFFIXES)):
        return local
    checkpoints = sorted((e.path for e in entries if e.type == pafs.FileType.Directory
                          and e.base_name.startswith("checkpoint_")), reverse=True)  # checkpoint_<step, 8 digits>
    for path in checkpoints:
        (sub := local / posixpath.basename(path)).mkdir()
        copy_files(fs.get_file_info(pafs.FileSelector(path)), sub, lambda name: True)
        if checkpointing.verify(sub) is None:
            return local
        shutil.rmtree(sub)
    if checkpoints:
        raise _unusable(uri, "is a Stride run folder with no complete checkpoint")
    return local


# ---- planning: which model tensor takes which source tensor, from shapes and dtypes alone ----

@dataclass
class InitPlan:
    source: str  # Source.location
    sha256: str
    mapping: dict[str, str]  # model tensor name -> source tensor name (after rename/adapt): what is loaded
    missing: list[str]  # selected model parameters with no source tensor
    unexpected: list[str]  # selected source tensors (after rename/adapt) that no model tensor takes
    mismatched: list[str]  # "name: source (3, 4) float32, model (4, 3) float32"
    loaded_parameters: int

    def record(self) -> dict[str, Any]:
        return {"from": redact(self.source), "sha256": self.sha256, "loaded": len(self.mapping),
                "missing": len(self.missing), "unexpected": len(self.unexpected),
                "mismatched": len(self.mismatched), "parameters_loaded": self.loaded_parameters}

    def table(self) -> str:
        rows = [("loaded", list(self.mapping)), ("missing", self.missing), ("unexpected", self.unexpected),
                ("mismatched", self.mismatched)]
        head = f"init.from {redact(self.source)} (sha256 {self.sha256[:12]}, {self.loaded_parameters:,} parameters)"
        return "\n".join([head] + [f"  {label:<10} {len(names):>6}  {_first(names, 5, '; ')}".rstrip()
                                   for label, names in rows])


def _compile(key: str, patterns: Iterable[str]) -> list[re.Pattern]:
    compiled = []
    for pattern in [patterns] if isinstance(patterns, str) else patterns:
        try:
            compiled.append(re.compile(pattern))
        except (re.error, TypeError) as e:
            raise ConfigError(f"{key} ({quote(pattern)}) is not a regular expression ({e}); fix the pattern") from None
    return compiled


def renamed_names(names: Iterable[str], rename: Iterable[tuple[str, str]] = ()) -> dict[str, str]:
    """Renamed source name -> its name in the file, after init.rename's [pattern, replacement] pairs (re.sub, in
    order). plan_init and load_into both call it, so the names they see agree."""
    current = {n: n for n in names}
    for pair in rename:
        if not (isinstance(pair, (list, tuple)) and len(pair) == 2 and all(isinstance(x, str) for x in pair)):
            raise ConfigError(f"init.rename ({quote(pair)}) is not a [pattern, replacement] pair; use "
                              f"init.rename=[[\"^encoder\\\\.\", \"model.encoder.\"]]")
        pattern, replacement = pair
        (regex,) = _compile("init.rename", [pattern])
        if not any(regex.search(n) for n in current):
            raise ConfigError(f"init.rename pattern {quote(pattern)} matches none of the {len(current)} source "
                              f"tensors (first: {_first(list(current))}); fix the pattern")
        renamed: dict[str, str] = {}
        for name, original in current.items():
            try:
                new = regex.sub(replacement, name)
            except (re.error, IndexError) as e:
                raise ConfigError(f"init.rename replacement {quote(replacement)} is not valid for {quote(pattern)} "
                                  f"({e}); fix the replacement") from None
            if new in renamed:
                raise ConfigError(f"init.rename [{quote(pattern)}, {quote(replacement)}] renames both "
                                  f"{renamed[new]} and {original} to {new}; make the renamed names distinct")
            renamed[new] = original
        current = renamed
    return current


def _adapted(tensors: dict[str, torch.Tensor], adapt: Adapt) -> dict[str, torch.Tensor]:
    try:
        out = adapt(tensors)
    except Exception as e:  # noqa: BLE001 - the user's code; its error is theirs to fix
        raise ConfigError(f"Task.adapt_init_state failed on init.from's tensors ({type(e).__name__}: {_short(e)}); "
                          f"fix the task's adapt_init_state") from None
    if not isinstance(out, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in out.items()):
        raise ConfigError(f"Task.adapt_init_state returned a {type(out).__name__}, not a dict of name -> tensor; "
                          f"return the state dict it was given, changed")
    return out


def _compatible(a: torch.dtype, b: torch.dtype) -> bool:
    """Floating dtypes cast into each other on load; any other dtype (int, bool) must be the same."""
    return a == b or (a.is_floating_point and b.is_floating_point)


def _described(name: str, source: TensorInfo, model: TensorInfo) -> str:
    dtype = lambda d: str(d).removeprefix("torch.")  # noqa: E731
    return f"{name}: source {source.shape} {dtype(source.dtype)}, model {model.shape} {dtype(model.dtype)}"


def plan_init(source: dict[str, TensorInfo], model: dict[str, TensorInfo], *, location: str, sha256: str,
              strict: bool = True, include: Iterable[str] = (), exclude: Iterable[str] = (),
              rename: Iterable[tuple[str, str]] = (), adapt: Adapt | None = None,
              buffers: frozenset[str] = frozenset()) -> InitPlan:
    """Which model tensor takes which source tensor; ConfigError (one line) for a pattern that matches nothing, and
    under `strict` for any tensor left over. `buffers`: model names that may be absent from the source without
    counting as missing (persistent buffers, and the second name of a tied parameter: model_infos gives them)."""
    infos = {new: source[old] for new, old in renamed_names(source, rename).items()}
    if adapt is not None:  # on meta tensors: the shapes without the data
        meta = {n: torch.empty(i.shape, dtype=i.dtype, device="meta") for n, i in infos.items()}
        infos = {n: TensorInfo(tuple(t.shape), t.dtype) for n, t in _adapted(meta, adapt).items()}
    includes, excludes = _compile("init.include", include), _compile("init.exclude", exclude)
    for key, patterns in (("init.include", includes), ("init.exclude", excludes)):
        for p in patterns:
            if not any(p.search(n) for n in model):
                raise ConfigError(f"{key} pattern {quote(p.pattern)} matches none of the model's {len(model)} "
                                  f"tensors (first: {_first(list(model))}); fix the pattern")

    def selected(name: str) -> bool:
        return (not includes or any(p.search(name) for p in includes)) and not any(p.search(name) for p in excludes)

    model = {n: i for n, i in model.items() if selected(n)}
    infos = {n: i for n, i in infos.items() if selected(n)}
    mapping, mismatched = {}, []
    for name, want in model.items():
        if (have := infos.get(name)) is not None:
            if have.shape == want.shape and _compatible(have.dtype, want.dtype):
                mapping[name] = name
            else:
                mismatched.append(_described(name, have, want))
    plan = InitPlan(location, sha256, mapping, missing=[n for n in model if n not in infos and n not in buffers],
                    unexpected=[n for n in infos if n not in model], mismatched=mismatched,
                    loaded_parameters=sum(math.prod(model[n].shape) for n in mapping if n not in buffers))
    problems = [f"{len(names)} {what} (first: {_first(names, 3 if sep == ', ' else 1, sep)})"
                for names, what, sep in ((plan.missing, "model tensors missing", ", "),
                                         (plan.unexpected, "unexpected source tensors", ", "),
                                         (plan.mismatched, "mismatched", "; ")) if names]
    if strict and problems:
        raise ConfigError(f"init.from ({redact(location)}): {', '.join(problems)} under init.strict=true; rename them "
                          f"with init.rename, select with init.include/init.exclude, or set init.strict=false")
    if not mapping:
        raise ConfigError(f"init.from ({redact(location)}): no tensor of init.from matches the model (source: "
                          f"{_first(list(infos))}; model: {_first(list(model))}); rename them with init.rename or "
                          f"select with init.include/init.exclude")
    return plan


def model_infos(model: torch.nn.Module) -> tuple[dict[str, TensorInfo], frozenset[str]]:
    """The model's tensors init.from may fill: every parameter name (a tied parameter under each of its names, as a
    state dict saved from it has both) and the persistent buffers; plus the names that may be absent from a source
    (the buffers and the tied second names). A meta-device model works; a DTensor (FSDP2) gives its full shape."""
    params = dict(model.named_parameters(remove_duplicate=False))
    first_names = {n for n, _ in model.named_parameters()}
    persistent = set(model.state_dict(keep_vars=True))
    buffers = {n: b for n, b in model.named_buffers() if n in persistent}
    infos = {n: TensorInfo(tuple(t.shape), t.dtype) for n, t in (params | buffers).items()}
    return infos, frozenset((set(params) - first_names) | set(buffers))


# ---- loading ----

def _dtensor_type() -> type | None:
    if not torch.distributed.is_available():
        return None
    from torch.distributed.tensor import DTensor

    return DTensor


def load_into(model: torch.nn.Module, source: Source, plan: InitPlan, *, rename: Iterable[tuple[str, str]] = (),
              adapt: Adapt | None = None) -> None:
    """Copy the planned tensors into `model` in place, cast to each tensor's dtype and device. A DTensor (FSDP2)
    takes only this rank's slice, read as a slice. With `adapt` (Task.adapt_init_state), every source tensor is
    read whole, on every rank, so that the hook sees real tensors: a task with that hook makes every rank read the
    whole source into CPU memory."""
    dtensor = _dtensor_type()
    targets = dict(model.named_parameters(remove_duplicate=False)) | dict(model.named_buffers())
    originals = renamed_names(source.infos(), rename)
    adapted = None if adapt is None else _adapted({n: source.read(o) for n, o in originals.items()}, adapt)
    with torch.no_grad():
        for name, src in plan.mapping.items():
            target, index = targets[name], None
            if dtensor is not None and isinstance(target, dtensor):
                from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

                shape, offset = compute_local_shape_and_global_offset(target.shape, target.device_mesh,
                                                                      target.placements)
                if 0 in shape:  # this rank holds none of it (more ranks than rows)
                    continue
                index = tuple(slice(o, o + n) for o, n in zip(offset, shape))
                local = target.to_local()
            else:
                local = target
            if adapted is None:
                value = source.read(originals[src], index)
            else:
                value = adapted[src]
                if tuple(value.shape) != tuple(target.shape):
                    raise ConfigError(f"Task.adapt_init_state gave {src} the shape {tuple(value.shape)} on the "
                                      f"real tensors but {tuple(target.shape)} on meta tensors; make it depend on "
                                      f"shapes only")
                value = value if index is None else value[index]
            local.copy_(value)


def plan_model(model: torch.nn.Module, source: Source, sha256: str | None, **init: Any) -> InitPlan:
    """plan_init of an opened source against `model` (meta-device, sharded or whole); `sha256`: the source's, when
    known (None: hashed here)."""
    infos, optional = model_infos(model)
    return plan_init(source.infos(), infos, location=source.location, sha256=sha256 or source.sha256(),
                     buffers=optional, **init)


def check_init(model: torch.nn.Module, location: str, *, strict: bool, include: Iterable[str],
               exclude: Iterable[str], rename: Iterable[tuple[str, str]], adapt: Adapt | None = None,
               sha256: str | None = None) -> InitPlan:
    """The driver's check, before any worker starts: open init.from, plan against `model` (meta-device is enough),
    load nothing. `sha256`: a placeholder where the digest is not wanted (None: hashed)."""
    with open_source(location) as source:
        return plan_model(model, source, sha256, strict=strict, include=include, exclude=exclude, rename=rename,
                     adapt=adapt)


def init_model(model: torch.nn.Module, location: str, *, strict: bool, include: Iterable[str],
               exclude: Iterable[str], rename: Iterable[tuple[str, str]], adapt: Adapt | None = None,
               sha256: str | None = None) -> InitPlan:
    """A worker's load: open init.from, plan, copy into `model`, close. `sha256`: the driver's check_init result,
    so that every rank does not hash the whole source again."""
    with open_source(location) as source:
        plan = plan_model(model, source, sha256, strict=strict, include=include, exclude=exclude, rename=rename,
                     adapt=adapt)
        load_into(model, source, plan, rename=rename, adapt=adapt)
        return plan


def adapter(task: Any) -> Adapt | None:
    """The task's adapt_init_state where it overrides the default (which passes names through: no hook, so FSDP
    ranks read only their slices)."""
    from stride.trainers.task import Task

    return task.adapt_init_state if type(task).adapt_init_state is not Task.adapt_init_state else None


def changed_base_line(location: str, recorded: str | None, now: str) -> str:
    """The error of a checkpoint.trainable_only resume whose frozen base is no longer the file it trained on."""
    return (f"init.from ({redact(location)}) has sha256 {now[:12]}..., but this run's checkpoints were trained on "
            f"{(recorded or 'an unrecorded base')[:12]}... and hold only the trainable parameters "
            f"(checkpoint.trainable_only); restore the original file, or start a new run.name")


def known_sha256(location: str | None) -> str | None:
    """init.from's sha256 if this process already hashed its files as they are now (the driver's check_model), else
    None (an object-store URI: not fetched again for this)."""
    if location is None or "://" in location:
        return None
    try:
        with open_source(location) as source:
            if source.kind == "stride_checkpoint" or all(_identity(f) in _DIGESTS for f in source._files()):
                return source.sha256()
    except (ConfigError, OSError):
        pass
    return None
