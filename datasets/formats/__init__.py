"""Data formats: one module per format in this package, each behind the `Format` interface.

A format turns one file into a `FileLayout` on the driver (its schema and its parts: the blocks the order permutes and
the readers read, Parquet row groups or line ranges of a text file), and reads parts of it back as Arrow tables on
the workers. Everything else (the order, the windows, the reader threads, Ray Data, files by reference, the task's
transform) is format-neutral and sees only layouts and tables. Adding a format is adding a module here that defines
`FORMAT`: the registry finds it by its file extensions.
"""

from __future__ import annotations

import importlib
import os
import pkgutil
import threading
from dataclasses import dataclass, field
from typing import ClassVar

import pyarrow as pa
import pyarrow.fs as pafs

# The public names (benchmarks/ and users import only these; tests/test_bench_imports.py checks benchmarks/).
__all__ = ["FileLayout", "Format", "PartReader", "extensions", "format_of", "formats", "open_input", "stamp"]



@dataclass(frozen=True)
class FileLayout:
    """One data file as the driver found it: what the workers need to read its parts, and what they check that the
    file is still the one the run started with."""

    path: str
    format: str  # the Format's name
    schema: pa.Schema = field(repr=False)
    rows: tuple[int, ...]  # rows of each part
    extents: tuple[tuple[int, int], ...] = field(default=(), repr=False)  # text formats: (byte offset, length)
    stamp: tuple[int, int] = (0, 0)  # (size, mtime_ns) when the layout was made; (0, 0): not checked
    data_bytes: int = 0  # the rows' size in memory, about (Parquet: uncompressed; text: the file's bytes)

    @property
    def num_rows(self) -> int:
        return sum(self.rows)


class PartReader:
    """Reads parts of one file; one per read thread (a file handle is not shared between threads)."""

    def read(self, parts: list[int], columns: list[str]) -> pa.Table:
        """The rows of `parts`, in that order, with `columns` (in that order), as one table."""
        raise NotImplementedError

    def close(self) -> None:
        pass


class Format:
    """The interface of a data format: a layout on the driver, part readers on the workers."""

    name: ClassVar[str]
    extensions: ClassVar[tuple[str, ...]]
    cached: ClassVar[bool] = False  # True: layout() reads the whole file, so datasets/index.py caches it

    def layout(self, path: str, key: str) -> FileLayout:
        """Read the file's schema and split it into parts; a file the format cannot read is a DataError naming it
        (and, for text, the line). `key` is the config key that named the file, for messages."""
        raise NotImplementedError

    def reader(self, layout: FileLayout, key: str) -> PartReader:
        raise NotImplementedError

    def value_ranges(self, layout: FileLayout, column: str) -> list[tuple | None] | None:
        """(min, max) of a numeric column (a list column: of its values) in each part (None: a part without values),
        where the file's metadata tells it without reading the data (Parquet statistics); None where it does not."""
        return None


_REGISTRY: dict[str, Format] = {}
_LOCK = threading.Lock()


def formats() -> dict[str, Format]:
    """Every format of this package, by name (modules are imported on first use, once: a worker's read threads
    may ask at the same moment, and a half-filled registry would lack a format)."""
    if not _REGISTRY:
        with _LOCK:
            if not _REGISTRY:
                found = {}
                for module in pkgutil.iter_modules(__path__):
                    fmt = getattr(importlib.import_module(f"{__name__}.{module.name}"), "FORMAT", None)
                    if fmt is not None:
                        found[fmt.name] = fmt
                _REGISTRY.update(found)
    return _REGISTRY


def format_of(path: str) -> Format | None:
    """The format a file's extension names (case-insensitive), or None."""
    lower = path.lower()
    return next((f for f in formats().values() if lower.endswith(f.extensions)), None)


def extensions() -> list[str]:
    """Every file extension a format of this package reads, sorted (".csv", ".jsonl", ".parquet", ...)."""
    return sorted(e for f in formats().values() for e in f.extensions)


def open_input(path: str):
    """A readable, seekable file of a local path or a URI pyarrow understands (s3://, gs://, hdfs://)."""
    if "://" in path:
        fs, p = pafs.FileSystem.from_uri(path)
        return fs.open_input_file(p)
    return pa.OSFile(path)


def stamp(path: str) -> tuple[int, int]:
    """(size, mtime_ns) of a file: what a layout is checked against."""
    if "://" in path:
        fs, p = pafs.FileSystem.from_uri(path)
        info = fs.get_file_info(p)
        mtime = info.mtime_ns or 0
        return int(info.size or 0), int(mtime)
    st = os.stat(path)
    return st.st_size, st.st_mtime_ns


def first_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return (text or type(e).__name__)[:200]
