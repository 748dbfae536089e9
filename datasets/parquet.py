"""Parquet inputs: find the shards, check them against the config, and turn Arrow tables into arrays.

The driver calls `inspect()` once (Parquet footers, plus whatever the task's own `inspect` reads) so that a
wrong path, a missing column or a corrupted shard is a one-line usage error before any worker starts. The footers
also give the split's blocks (row groups), from which datasets/order.py builds the order and datasets/stream.py
streams the rows to each worker. Nothing here knows a model: the task names its columns and turns rows into
tensors (`Task.transform`).
"""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

SAMPLE_ID = "sample_id"


class DataError(ValueError):
    """Bad input data the user can fix (exit code 2)."""


@dataclass(frozen=True)
class DataSpec:
    """What a worker reads of one split: the files and their blocks, the columns (the task's, plus sample_id when
    present)."""

    columns: tuple[str, ...]
    has_sample_id: bool = True
    num_rows: int = 0
    files: tuple[str, ...] = field(default=(), repr=False)
    # (file index, row group, rows) of every row group, in file order: the units the order permutes and reads.
    blocks: tuple[tuple[int, int, int], ...] = field(default=(), repr=False)
    split: str = "train"


@dataclass(frozen=True)
class DataSplit:
    """One split as the driver sees it before training: its files, schema and row count, and a reader.

    `Task.inspect` gets one per split to check the data and derive facts from it (input width, class count,
    feature statistics). Errors it raises as `DataError` reach the user as one line, exit 2."""

    name: str  # "train" or "val"
    key: str  # the config key that named it, for messages: data.train_path
    files: tuple[str, ...]
    schema: pa.Schema
    num_rows: int
    blocks: tuple[tuple[int, int, int], ...] = ()

    def read(self, columns: list[str] | tuple[str, ...] | None = None) -> pa.Table:
        """The split's rows (all columns, or `columns`) as one pyarrow Table, in file order: the whole split in
        the driver's memory (fine for a label column; use `batches` for statistics over large splits)."""
        return read_files(self.files, None if columns is None else list(columns), self.key)

    def batches(self, columns: list[str] | tuple[str, ...] | None = None, rows: int = 65536):
        """The split's rows as pyarrow Tables of at most `rows` rows, in file order: memory bounded by `rows`."""
        for f in self.files:
            try:
                for batch in pq.ParquetFile(_open(f)).iter_batches(batch_size=rows, columns=columns and list(columns)):
                    yield pa.Table.from_batches([batch])
            except (pa.ArrowException, OSError) as e:
                raise damaged(self.key, f, e) from None


def resolve_files(path: str, key: str) -> list[str]:
    """A folder, a file, a glob, or a URI pyarrow understands (s3://, gs://, hdfs://) -> sorted Parquet files."""
    if any(ch in path for ch in "*?["):
        files = sorted(f for f in glob.glob(os.path.expanduser(path), recursive=True) if os.path.isfile(f))
        if not files:
            raise DataError(f"{key} ({path}) matches no files; check the glob or run python datasets/prepare.py")
        return _only_parquet(files, key, path)
    try:
        fs, root = pafs.FileSystem.from_uri(path) if "://" in path else (pafs.LocalFileSystem(), os.path.abspath(os.path.expanduser(path)))
        info = fs.get_file_info(root)
    except (pa.ArrowInvalid, OSError) as e:
        raise DataError(f"{key} ({path}) cannot be opened: {e}; use a local path or a URI pyarrow can read") from None
    if info.type == pafs.FileType.NotFound:
        raise DataError(f"{key} ({path}) does not exist; run python datasets/prepare.py or set {key}=<folder of .parquet files>")
    if info.type == pafs.FileType.File:
        files = [root]
    else:
        entries = fs.get_file_info(pafs.FileSelector(root, recursive=True))
        files = sorted(e.path for e in entries if e.type == pafs.FileType.File and not _hidden(e.path, root))
        if not files:
            raise DataError(f"{key} ({path}) is an empty folder; put .parquet files in it or point {key} elsewhere")
    files = _only_parquet(files, key, path)
    prefix = path.split("://")[0] + "://" if "://" in path else ""
    return [prefix + f if prefix and not f.startswith(prefix) else f for f in files]


def _hidden(p: str, root: str) -> bool:
    rel = os.path.relpath(p, root)
    return any(part.startswith((".", "_")) for part in rel.split(os.sep))


def _only_parquet(files: list[str], key: str, path: str) -> list[str]:
    bad = [f for f in files if not f.endswith((".parquet", ".pq"))]
    if bad:
        raise DataError(f"{key} ({path}) holds a non-Parquet file ({os.path.basename(bad[0])}); "
                        f"remove it or point {key} at the .parquet files only")
    return files


def _open(f: str):
    if "://" in f:
        fs, p = pafs.FileSystem.from_uri(f)
        return fs.open_input_file(p)
    return f


def read_schema(files: list[str], key: str) -> tuple[pa.Schema, tuple[tuple[int, int, int], ...]]:
    """The common schema and the blocks (file index, row group, rows), from every file's footer; a corrupted file
    is named."""
    schema, blocks = None, []
    for i, f in enumerate(files):
        try:
            meta = pq.read_metadata(_open(f))
        except (pa.ArrowInvalid, OSError) as e:
            raise DataError(f"{key}: {f} is not a readable Parquet file ({str(e).splitlines()[0]}); "
                            f"rewrite or remove it") from None
        s = meta.schema.to_arrow_schema()
        if schema is None:
            schema = s
        elif not s.equals(schema, check_metadata=False):
            raise DataError(f"{key}: {f} has columns {s.names}, unlike {files[0]} ({schema.names}); give every shard the same schema")
        blocks += [(i, g, meta.row_group(g).num_rows) for g in range(meta.num_row_groups)
                   if meta.row_group(g).num_rows]
    if not blocks:
        raise DataError(f"{key}: the Parquet files hold no rows; point it at a non-empty data set")
    return schema, tuple(blocks)


def open_split(data_cfg, split: str) -> DataSplit:
    """`split` ("train" or "val") of the data section: its files, checked to be readable Parquet with one schema."""
    key = f"data.{split}_path"
    files = resolve_files(getattr(data_cfg, f"{split}_path"), key)
    schema, blocks = read_schema(files, key)
    return DataSplit(split, key, tuple(files), schema, sum(n for _, _, n in blocks), blocks)


UNIQUE_CHECK_ROWS = 50_000_000  # above this, sample_ids the footers cannot prove unique are not read to check


def check_sample_ids(split: DataSplit) -> None:
    """Duplicate sample_ids are refused where that is cheap: the footers' statistics prove a split unique when its
    row groups hold disjoint ranges of consecutive ids (what prepare.py writes); otherwise the one column is read,
    up to UNIQUE_CHECK_ROWS rows."""
    ranges = []
    for f in split.files:
        meta = pq.read_metadata(_open(f))
        col = meta.schema.to_arrow_schema().get_field_index(SAMPLE_ID)
        for g in range(meta.num_row_groups):
            st = meta.row_group(g).column(col).statistics
            if st is None or not st.has_min_max or st.null_count:
                ranges = None
                break
            ranges.append((st.min, st.max, meta.row_group(g).num_rows))
        if ranges is None:
            break
    if ranges is not None:
        ranges.sort()
        if all(hi - lo + 1 == n for lo, hi, n in ranges) and all(a[1] < b[0] for a, b in zip(ranges, ranges[1:])):
            return
    if split.num_rows > UNIQUE_CHECK_ROWS:
        return
    ids = np.concatenate([pq.read_table(_open(f), columns=[SAMPLE_ID]).column(0).to_numpy(zero_copy_only=False)
                          for f in split.files])
    values, counts = np.unique(ids, return_counts=True)
    if len(values) < len(ids):
        dup = values[counts > 1][0]
        raise DataError(f"{split.key}: sample_id {dup} appears {counts[values == dup][0]} times; make {SAMPLE_ID} "
                        f"unique per row, or drop the column (rows are then numbered in file order)")


def inspect(cfg, task) -> dict[str, DataSpec]:
    """Check the config's splits against the task on the driver, before any worker starts: the task's own checks
    and facts (`task.inspect`, which sets task.facts), then the columns it reads. Returns the specs the workers read."""
    splits = {"train": open_split(cfg.data, "train")}
    if cfg.data.val_path:
        splits["val"] = open_split(cfg.data, "val")
    task.facts = dict(task.inspect(splits["train"], splits.get("val")) or {})
    # A task's inspect may stream a whole split through Arrow: hand the pool's cached memory back (mimalloc keeps
    # hundreds of MB otherwise, for the whole run, in the driver).
    pa.default_memory_pool().release_unused()
    specs = {}
    for name, split in splits.items():
        columns = tuple(task.columns) if task.columns is not None else tuple(c for c in split.schema.names if c != SAMPLE_ID)
        missing = [c for c in columns if c not in split.schema.names]
        if missing:
            raise DataError(f"{split.key}: no column {missing[0]!r}, which model.name ({cfg.model.name}) reads "
                            f"(columns: {split.schema.names}); point {split.key} at data with it")
        has_id = SAMPLE_ID in split.schema.names
        if has_id:
            check_sample_ids(split)
        specs[name] = DataSpec(columns + ((SAMPLE_ID,) if has_id else ()), has_id, split.num_rows, split.files,
                               split.blocks, name)
    return specs


def read_files(files, columns: list[str] | None = None, key: str = "data") -> pa.Table:
    """pyarrow reads the shards in file order (a task's inspect, tests)."""
    tables = []
    for f in files:
        try:
            tables.append(pq.read_table(_open(f), columns=columns))
        except (pa.ArrowException, OSError) as e:
            raise damaged(key, f, e) from None
    return pa.concat_tables(tables)


def damaged(key: str, f: str, e: BaseException) -> DataError:
    """A file whose footer reads but whose pages do not (a torn copy, a bad disk): one line naming it."""
    reason = " ".join(str(e).split())[:200]
    return DataError(f"{key}: {f} could not be read ({type(e).__name__}: {reason}); the file is damaged: copy or "
                     f"write it again (python datasets/prepare.py), or remove it from {key}")


def column_to_numpy(col: pa.ChunkedArray | pa.Array) -> np.ndarray:
    """One column as a numpy array with the rows as first dimension: numbers 1-D, fixed-size lists 2-D (n, size),
    everything else (bytes, strings, variable lists) an object array of Python values."""
    if isinstance(col, pa.ChunkedArray):  # one chunk (a row group) is used as it is: combining would copy it
        col = col.chunk(0) if col.num_chunks == 1 else col.combine_chunks()
    t = col.type
    if pa.types.is_fixed_size_list(t) and (pa.types.is_integer(t.value_type) or pa.types.is_floating(t.value_type)) \
            and not col.null_count:
        return col.flatten().to_numpy(zero_copy_only=False).reshape(len(col), t.list_size)
    if pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t):
        return col.to_numpy(zero_copy_only=False)
    return np.array(col.to_pylist() + [None], dtype=object)[:-1]  # the None keeps numpy from stacking lists


@dataclass
class Columns:
    """Rows of a split as numpy arrays (the task's columns) and their sample ids (the sample_id column, or the row's
    index in file order)."""

    data: dict[str, np.ndarray]
    sample_id: np.ndarray  # (n,) int64

    def __len__(self) -> int:
        return len(self.sample_id)

    def take(self, index: np.ndarray) -> Columns:
        return Columns({name: col.take(index, axis=0) for name, col in self.data.items()}, self.sample_id.take(index))

    def rows(self, index: np.ndarray) -> dict[str, np.ndarray]:
        return {name: col[index] for name, col in self.data.items()}
