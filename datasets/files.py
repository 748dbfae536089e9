"""Files by reference: a task's `file_columns` hold paths (audio/clip_00017.wav), and its transform gets each
file's bytes instead.

The paths are resolved when a block is read, against the folder of the manifest the row came from (an absolute path
or a URI stays as it is). The bytes are read after the window's shuffle, only for this rank's rows, by a pool of
`data.file_read_threads` threads beside the read threads (files are I/O, not CPU: many more threads than cores pay),
so the training thread never waits on a file that a read-ahead window could have fetched. A file column of binary
type already holds the bytes (Parquet with the bytes inline) and is passed through.

Before training the driver checks that every referenced file exists, with the same pool, up to CHECK_FILES files
(a stat each; an object store's a request each): a missing file is one line naming it and the manifest row. Past
that, a missing file fails the step that reaches it, with the same line.

With `data.file_root` set, a path must lie inside that folder once links are followed (a manifest someone else
wrote may name /etc/shadow, or ../../ out of its folder): the check above refuses a path outside it by its row, and
the workers check each file again as they read it (a link may have changed since). A URI is outside any folder.
"""

from __future__ import annotations

import os
import posixpath
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs

from typing import TYPE_CHECKING

from stride.datasets.formats import FileLayout, first_line
from stride.errors import DataError

if TYPE_CHECKING:  # frame.py imports splits.py, which imports this module
    from stride.datasets.frame import Frame

CHECK_FILES = 1_000_000  # referenced files checked before training, at most


def is_reference(schema: pa.Schema, column: str) -> bool:
    """A string column holds paths; a binary one holds the bytes already."""
    t = schema.field(column).type
    return pa.types.is_string(t) or pa.types.is_large_string(t)


def resolve(table: pa.Table, columns: tuple[str, ...], manifest: str) -> pa.Table:
    """The file columns' relative paths joined to the manifest's folder (vectorised: one Arrow call per column)."""
    if not columns:
        return table
    uri = "://" in manifest
    folder = (posixpath.dirname(manifest) if uri else os.path.dirname(os.path.abspath(manifest))).rstrip("/") + "/"
    for name in columns:
        col = table.column(name)
        absolute = pc.or_(pc.starts_with(col, "/"), pc.match_substring(col, "://"))
        joined = pc.if_else(absolute, col, pc.binary_join_element_wise(folder, col, ""))
        table = table.set_column(table.schema.get_field_index(name), name, joined)
    return table


def outside(path: str, root: str | None) -> bool:
    """True when a root is set and `path`, links followed, does not lie in it (`root` is already resolved)."""
    if root is None:
        return False
    return "://" in path or not _within(os.path.realpath(path), root)


def _within(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def real_root(root) -> str | None:
    """data.file_root with its own links followed: what every path is compared with."""
    return None if root is None else os.path.realpath(os.path.expanduser(str(root)))


def outside_message(key: str, path: str, where: str, root: str) -> str:
    return (f"{key}: {path} ({where}) is outside data.file_root ({root}); fix that row of the manifest, or set "
            f"data.file_root to a folder that holds the files it should read")


class OutsideRoot(DataError):
    """A file path outside data.file_root, found as a worker went to read it."""


def read_file(path: str, root: str | None = None) -> bytes:
    if outside(path, root):
        raise OutsideRoot(path)
    if "://" in path:
        fs, p = pafs.FileSystem.from_uri(path)
        with fs.open_input_stream(p) as f:
            return f.read()
    with open(path, "rb") as f:
        return f.read()


class FileFetcher:
    """Replaces a frame's file columns (paths) by the files' bytes, `threads` files at a time."""

    def __init__(self, columns: tuple[str, ...], threads: int, where, root: str | None = None):
        self.columns = columns
        self.where = where  # sample id -> "row N of <manifest>", for messages
        self.root = real_root(root)
        self._pool = ThreadPoolExecutor(max(1, threads), thread_name_prefix="stride-files") if columns else None

    def fetch(self, frame: Frame) -> Frame:
        if self._pool is None or not len(frame):
            return frame
        arrays = list(frame.arrays)
        for name in self.columns:
            i = frame.names.index(name)
            paths = arrays[i]
            futures = [self._pool.submit(read_file, p, self.root) for p in paths]
            out = np.empty(len(paths), dtype=object)
            for j, f in enumerate(futures):
                try:
                    out[j] = f.result()
                except OutsideRoot:
                    for rest in futures[j:]:
                        rest.cancel()
                    raise DataError(outside_message(name, paths[j], self.where(int(frame.sample_id[j])),
                                                    self.root)) from None
                except (OSError, pa.ArrowException) as e:
                    for rest in futures[j:]:
                        rest.cancel()
                    raise DataError(f"{name}: {paths[j]} ({self.where(int(frame.sample_id[j]))}) could not be read "
                                    f"({first_line(e)}); restore the file or remove its row from the manifest") from None
            arrays[i] = out
        return replace(frame, arrays=tuple(arrays))

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


def row_of(layouts: tuple[FileLayout, ...], has_sample_id: bool):
    """sample id -> where its row is, for messages: "row N of <manifest>" (rows counted from 1, in file order), or
    the sample_id itself when the data carries its own ids."""
    bases = np.cumsum([0] + [lay.num_rows for lay in layouts])

    def where(sample_id: int) -> str:
        if has_sample_id:
            return f"sample_id {sample_id}"
        f = int(np.searchsorted(bases, sample_id, side="right")) - 1
        return f"row {sample_id - bases[f] + 1} of {layouts[f].path}"

    return where


def check_files(split, columns: tuple[str, ...], threads: int, root=None) -> float:
    """Every referenced file of the split exists (a stat each, `threads` at a time), up to CHECK_FILES, and lies in
    `root` (data.file_root) when it is set: else one DataError naming the first such file and its manifest row.
    Returns the files' mean bytes per row (of the rows checked): what a row weighs in memory once its files are read."""
    root = real_root(root)
    checked = rows_checked = total = 0
    with ThreadPoolExecutor(max(1, threads), thread_name_prefix="stride-check") as pool:
        for layout in split.layouts:
            single = replace(split, layouts=(layout,))
            row = 0
            for table in single.batches(list(columns), rows=65536):
                for name in columns:
                    paths = resolve(table.select([name]), (name,), layout.path).column(0).to_pylist()
                    check_inside(paths, root, split.key, name, row, layout.path, pool)
                    for j, size in enumerate(pool.map(_size, paths)):
                        total += size or 0
                        if size is None:
                            raise DataError(f"{split.key}: {paths[j]} (column {name}, row {row + j + 1} of "
                                            f"{layout.path}) does not exist; restore it or remove its row from the "
                                            f"manifest")
                row += table.num_rows
                rows_checked += table.num_rows
                checked += table.num_rows * len(columns)
                if checked >= CHECK_FILES:
                    return total / rows_checked
    return total / rows_checked if rows_checked else 0.0


def check_inside(paths: list[str | None], root: str | None, key: str, column: str, row: int, manifest: str,
                 pool: ThreadPoolExecutor) -> None:
    """Every path of a batch lies in `root` (None: no root set); else a DataError naming the first that does not.
    `row`: the batch's first row's number in its manifest, less one. Links are followed by the pool's threads (a few
    system calls a path, as the existence check's stat)."""
    if root is None:
        return
    for j, (path, out) in enumerate(zip(paths, pool.map(lambda p: p is not None and outside(p, root), paths))):
        if out:
            raise DataError(outside_message(key, path, f"column {column}, row {row + j + 1} of {manifest}", root))


def _size(path: str | None) -> int | None:
    """The file's size, or None if there is no such file."""
    if path is None:
        return None
    if "://" in path:
        fs, p = pafs.FileSystem.from_uri(path)
        info = fs.get_file_info(p)
        return int(info.size or 0) if info.type == pafs.FileType.File else None
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_size if os.path.isfile(path) else None
