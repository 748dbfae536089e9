"""A split's files, whatever their format: find them, check them against the config and the task, and turn Arrow
tables into arrays.

The driver calls `inspect()` once (the files' layouts: Parquet footers, text files' cached indexes; plus whatever the
task's own `inspect` reads) so that a wrong path, a missing column or a damaged file is a one-line usage error
before any worker starts. The layouts give the split's blocks (a file's parts), from which datasets/order.py builds
the order and datasets/stream.py streams the rows to each worker. Nothing here knows a model (the task names its
columns and turns rows into tensors) or a format (datasets/formats/ reads them).
"""

from __future__ import annotations

import dataclasses
import glob
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs

from stride.datasets.files import check_files, is_reference
from stride.datasets.formats import FileLayout, extensions, first_line, format_of, formats
from stride.errors import DataError
from stride.datasets.index import cached_layout

__all__ = ["DataSpec", "DataSplit", "SAMPLE_ID", "cache_folder", "inspect", "open_split", "read_files", "read_layouts",
           "resolve_files"]

SAMPLE_ID = "sample_id"


@dataclass(frozen=True)
class DataSpec:
    """What a worker reads of one split: the files' layouts and their blocks, the columns (the task's, plus sample_id
    when present)."""

    columns: tuple[str, ...]
    has_sample_id: bool = True
    num_rows: int = 0
    layouts: tuple[FileLayout, ...] = field(default=(), repr=False)
    # (file index, part, rows) of every non-empty part, in file order: the units the order permutes and reads.
    blocks: tuple[tuple[int, int, int], ...] = field(default=(), repr=False)
    split: str = "train"
    file_columns: tuple[str, ...] = ()  # columns of paths whose files' bytes the task gets (datasets/files.py)
    file_read_threads: int = 16
    sources: tuple = ()  # a mixture's sources (datasets/mixing.MixSource), their blocks one after another
    schema: pa.Schema | None = field(default=None, repr=False)  # the split's types: every file's rows are cast to them
    length_column: str | None = None  # data.length_column: bucketing (datasets/bucketing.py), padding_fraction
    row_bytes: float = 0.0  # a row's mean size in memory, its referenced files included: bounds the window in bytes
    origin: str | None = None  # what named the files, for messages (a command's --data); None: data.<split>_path
    file_root: str | None = None  # data.file_root: the folder file columns' paths must lie in (datasets/files.py)

    @property
    def files(self) -> tuple[str, ...]:
        return tuple(layout.path for layout in self.layouts)

    @property
    def key(self) -> str:
        return self.origin or f"data.{self.split}_path"


@dataclass(frozen=True)
class DataSplit:
    """One split as the driver sees it before training: its files, schema and row count, and a reader.

    `Task.inspect` gets one per split to check the data and derive facts from it (input width, class count,
    feature statistics). Errors it raises as `DataError` reach the user as one line, exit 2."""

    name: str  # "train" or "val"
    key: str  # the config key that named it, for messages: data.train_path
    layouts: tuple[FileLayout, ...]
    schema: pa.Schema
    num_rows: int
    blocks: tuple[tuple[int, int, int], ...] = ()
    # data.train / data.val: each source (datasets/mixing.MixSource) and its own split, its blocks one after another
    sources: tuple[tuple[Any, DataSplit], ...] = ()

    @property
    def files(self) -> tuple[str, ...]:
        return tuple(layout.path for layout in self.layouts)

    def read(self, columns: list[str] | tuple[str, ...] | None = None) -> pa.Table:
        """The split's rows (all columns, or `columns`) as one pyarrow Table, in file order: the whole split in
        the driver's memory (fine for a label column; use `batches` for statistics over large splits)."""
        return pa.concat_tables(list(self.batches(columns, rows=1 << 62)) or [self.schema.empty_table()])

    def batches(self, columns: list[str] | tuple[str, ...] | None = None, rows: int = 65536):
        """The split's rows as pyarrow Tables of about `rows` rows at most (a file part at least), in file order."""
        columns = list(columns) if columns is not None else self.schema.names
        target = pa.schema([self.schema.field(c) for c in columns])
        for layout in self.layouts:
            reader = formats()[layout.format].reader(layout, self.key)
            try:
                parts, n = [], 0
                for p, count in enumerate(layout.rows):
                    if parts and n + count > rows:
                        yield conform(reader.read(parts, columns), target, self.key, layout.path)
                        parts, n = [], 0
                    parts.append(p)
                    n += count
                if parts:
                    yield conform(reader.read(parts, columns), target, self.key, layout.path)
            finally:
                reader.close()

    def value_range(self, column: str) -> tuple | None:
        """(min, max) of a numeric column (of a list column's values) where every file's metadata tells it without
        reading the data (Parquet statistics); None otherwise."""
        ranges = self.part_ranges(column)
        found = [r for r in ranges or () if r is not None]
        return (min(lo for lo, _ in found), max(hi for _, hi in found)) if found else None

    def part_ranges(self, column: str) -> list[tuple | None] | None:
        """value_range of every file part, in file order (None: a part without values); None if a file cannot tell."""
        ranges = []
        for layout in self.layouts:
            found = formats()[layout.format].value_ranges(layout, column)
            if found is None:
                return None
            ranges += found
        return ranges


def conform(table: pa.Table, schema: pa.Schema | None, key: str, path: str) -> pa.Table:
    """A file's rows in the split's types (a float32 Parquet file beside a float64 JSON Lines one: float64)."""
    if schema is None or table.schema.equals(schema, check_metadata=False):
        return table
    try:
        return table.cast(schema)
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError) as e:
        raise DataError(f"{key}: {path} has values that do not fit the split's types ({first_line(e)}); give every "
                        f"file the same types") from None


def resolve_files(path: str, key: str) -> list[str]:
    """A folder, a file, a glob, or a URI pyarrow understands (s3://, gs://, hdfs://) -> sorted data files."""
    if any(ch in path for ch in "*?["):
        files = sorted(f for f in glob.glob(os.path.expanduser(path), recursive=True) if os.path.isfile(f))
        if not files:
            raise DataError(f"{key} ({path}) matches no files; check the glob or run python datasets/prepare.py")
        return _only_data(files, key, path)
    try:
        fs, root = pafs.FileSystem.from_uri(path) if "://" in path else (pafs.LocalFileSystem(), os.path.abspath(os.path.expanduser(path)))
        info = fs.get_file_info(root)
    except (pa.ArrowInvalid, OSError) as e:
        raise DataError(f"{key} ({path}) cannot be opened: {e}; use a local path or a URI pyarrow can read") from None
    if info.type == pafs.FileType.NotFound:
        raise DataError(f"{key} ({path}) does not exist; run python datasets/prepare.py or set {key}=<a data file, "
                        f"folder or glob>")
    if info.type == pafs.FileType.File:
        files = [root]
    else:
        entries = fs.get_file_info(pafs.FileSelector(root, recursive=True))
        files = sorted(e.path for e in entries if e.type == pafs.FileType.File and not _hidden(e.path, root))
        if not files:
            raise DataError(f"{key} ({path}) is an empty folder; put data files ({', '.join(extensions())}) in it "
                            f"or point {key} elsewhere")
    files = _only_data(files, key, path)
    prefix = path.split("://")[0] + "://" if "://" in path else ""
    return [prefix + f if prefix and not f.startswith(prefix) else f for f in files]


def _hidden(p: str, root: str) -> bool:
    rel = os.path.relpath(p, root)
    return any(part.startswith((".", "_")) for part in rel.split(os.sep))


def _only_data(files: list[str], key: str, path: str) -> list[str]:
    bad = [f for f in files if format_of(f) is None]
    if bad:
        raise DataError(f"{key} ({path}) holds {os.path.basename(bad[0])}, whose extension is not a data format "
                        f"Stride reads ({', '.join(extensions())}); remove it or point {key} at the data files only")
    return files


def read_layouts(files: list[str], key: str, cache: Path | None = None) -> tuple[tuple[FileLayout, ...], pa.Schema]:
    """Every file's layout, and the split's schema: the same columns in every file, types widened across files
    (ints in one, floats in another: floats); every file's rows are cast to them when read (`conform`)."""
    layouts = [cached_layout(format_of(f), f, key, cache) for f in files]
    first = layouts[0]
    for layout in layouts[1:]:
        if layout.schema.names != first.schema.names:
            raise DataError(f"{key}: {layout.path} has columns {layout.schema.names}, unlike {first.path} "
                            f"({first.schema.names}); give every file the same columns")
    try:
        schema = pa.unify_schemas([lay.schema for lay in layouts], promote_options="permissive")
    except (pa.ArrowTypeError, pa.ArrowInvalid) as e:
        raise DataError(_type_clash(layouts, key) or f"{key}: the files' column types disagree ({first_line(e)}); "
                        f"give every file the same types") from None
    # Text files are parsed to the split's types, so that every file's rows come out alike.
    layouts = [dataclasses.replace(lay, schema=schema) if formats()[lay.format].cached else lay for lay in layouts]
    if not any(layout.num_rows for layout in layouts):
        raise DataError(f"{key}: the files hold no rows; point it at a non-empty data set")
    return tuple(layouts), schema


def _type_clash(layouts: list[FileLayout], key: str) -> str | None:
    """The first column whose type cannot be widened across the files (numbers in one, text in another), naming
    both files: a CSV file whose column is all text beside files where it is numbers ends here."""
    first = layouts[0]
    for name in first.schema.names:
        for layout in layouts[1:]:
            a, b = first.schema.field(name).type, layout.schema.field(name).type
            try:
                pa.unify_schemas([pa.schema([pa.field(name, a)]), pa.schema([pa.field(name, b)])],
                                 promote_options="permissive")
            except (pa.ArrowTypeError, pa.ArrowInvalid):
                return (f"{key}: column {name!r} is {b} in {layout.path} but {a} in {first.path}; give the column one "
                        f"type in every file (fix the values of the file that differs)")
    return None


def open_split(data_cfg, split: str, cache: Path | None = None) -> DataSplit:
    """`split` ("train" or "val") of the data section: its files (or its sources', data.train / data.val), checked
    to be readable with one schema."""
    if sources := getattr(data_cfg, split, None):
        return open_sources(sources, split, cache)
    return open_path(getattr(data_cfg, f"{split}_path"), split, f"data.{split}_path", cache)


def open_path(path: str, split: str, key: str, cache: Path | None = None) -> DataSplit:
    layouts, schema = read_layouts(resolve_files(path, key), key, cache)
    blocks = tuple((i, p, n) for i, layout in enumerate(layouts) for p, n in enumerate(layout.rows) if n)
    return DataSplit(split, key, layouts, schema, sum(n for _, _, n in blocks), blocks)


def open_sources(sources, split: str, cache: Path | None = None) -> DataSplit:
    """Several sources as one split: their files one after another, and the columns they all have (types widened
    across them). Which columns the task needs is checked per source, naming it (inspect)."""
    from stride.datasets.mixing import MixSource

    members = [open_path(src.path, split, f"data.{split} ({src.name})", cache) for src in sources]
    common = [c for c in members[0].schema.names if all(c in m.schema.names for m in members)]
    try:
        schema = pa.unify_schemas([pa.schema([m.schema.field(c) for c in common]) for m in members],
                                  promote_options="permissive")
    except (pa.ArrowTypeError, pa.ArrowInvalid) as e:
        raise DataError(f"data.{split}: the sources' column types disagree ({first_line(e)}); give every source the "
                        f"same types") from None
    layouts, blocks, mixed = [], [], []
    for src, m in zip(sources, members):
        mixed.append((MixSource(src.name, len(blocks), len(m.blocks), getattr(src, "weight", 1.0)), m))
        blocks += [(f + len(layouts), p, n) for f, p, n in m.blocks]
        layouts += m.layouts
    return DataSplit(split, f"data.{split}", tuple(layouts), schema, sum(m.num_rows for m in members), tuple(blocks),
                     tuple(mixed))


UNIQUE_CHECK_ROWS = 50_000_000  # above this, sample_ids the metadata cannot prove unique are not read to check


def check_sample_ids(split: DataSplit) -> None:
    """Duplicate sample_ids are refused where that is cheap: the metadata (Parquet statistics) proves a split unique
    when its parts hold disjoint ranges of consecutive ids (what prepare.py writes); otherwise the one column is read,
    up to UNIQUE_CHECK_ROWS rows."""
    ranges = split.part_ranges(SAMPLE_ID)
    if ranges is not None and None not in ranges:
        counted = sorted((lo, hi, n) for (lo, hi), n in zip(ranges, (n for lay in split.layouts for n in lay.rows)))
        if all(hi - lo + 1 == n for lo, hi, n in counted) and all(a[1] < b[0] for a, b in zip(counted, counted[1:])):
            return
    if split.num_rows > UNIQUE_CHECK_ROWS:
        return
    ids = np.concatenate([t.column(0).to_numpy(zero_copy_only=False) for t in split.batches([SAMPLE_ID], 1 << 20)])
    values, counts = np.unique(ids, return_counts=True)
    if len(values) < len(ids):
        dup = values[counts > 1][0]
        raise DataError(f"{split.key}: sample_id {dup} appears {counts[values == dup][0]} times; make {SAMPLE_ID} "
                        f"unique per row, or drop the column (rows are then numbered in file order)")


def cache_folder(cfg) -> Path:
    """Where text layouts are cached: the run storage's .stride-cache (shared by the runs there, never beside the
    user's data); for runs on a bucket, this node's private staging folder (the driver makes the layouts, and the
    workers get them in the plan)."""
    if "://" in cfg.run.storage_path:  # a bucket (the config has checked the URI)
        from stride.errors import UsageError
        from stride.ray_cluster.node import UnsafeStateDir, node_staging_dir, private_dir

        try:
            return private_dir(node_staging_dir(cfg.checkpoint.staging_dir)) / ".stride-cache" / "index"
        except UnsafeStateDir as e:
            raise UsageError(f"checkpoint.staging_dir: {e}; set checkpoint.staging_dir=<a private local folder>") \
                from None
    return Path(cfg.run.storage_path).expanduser().resolve() / ".stride-cache" / "index"


def inspect(cfg, task) -> dict[str, DataSpec]:
    """Check the config's splits against the task on the driver, before any worker starts: the task's own checks
    and facts (`task.inspect`, which sets task.facts), then the columns it reads. Returns the specs the workers read."""
    cache = cache_folder(cfg)
    splits = {"train": open_split(cfg.data, "train", cache)}
    if cfg.data.val_path or cfg.data.val:
        splits["val"] = open_split(cfg.data, "val", cache)
    task.facts = dict(task.inspect(splits["train"], splits.get("val")) or {})
    # A task's inspect may stream a whole split through Arrow: hand the pool's cached memory back (mimalloc keeps
    # hundreds of MB otherwise, for the whole run, in the driver).
    pa.default_memory_pool().release_unused()
    return {name: split_spec(cfg, task, split) for name, split in splits.items()}


def split_spec(cfg, task, split: DataSplit, columns: tuple[str, ...] | None = None) -> DataSpec:
    """What the workers read of one split (checked against the task): its columns (the task's, or `columns`), its
    sample ids, its file columns and, for training, its length column. Raises DataError."""
    if columns is None:
        columns = tuple(task.columns) if task.columns is not None else tuple(c for c in split.schema.names if c != SAMPLE_ID)
    for part in [m for _, m in split.sources] or [split]:
        missing = [c for c in columns if c not in part.schema.names]
        if missing:
            raise DataError(f"{part.key}: no column {missing[0]!r}, which model.name ({cfg.model.name}) reads "
                            f"(columns: {part.schema.names}); point {part.key} at data with it")
    # A mixture numbers its rows in order (sources one after another): the sources' own ids may collide.
    has_id = SAMPLE_ID in split.schema.names and not split.sources
    if has_id:
        check_sample_ids(split)
    references = file_columns(task, columns, split)
    root = str(cfg.data.file_root) if cfg.data.file_root is not None else None
    file_bytes = check_files(split, references, cfg.data.file_read_threads, root) if references else 0.0
    lengths = (check_length_column(split, cfg.data.length_column, cfg.train.tokens_per_micro_batch)
               if split.name == "train" else None)
    read = columns + ((SAMPLE_ID,) if has_id else ())
    typed = read + ((lengths,) if lengths and lengths not in read else ())  # what the readers may read
    row_bytes = sum(lay.data_bytes for lay in split.layouts) / max(split.num_rows, 1) + file_bytes
    return DataSpec(read, has_id, split.num_rows, split.layouts, split.blocks, split.name, references,
                    cfg.data.file_read_threads, tuple(src for src, _ in split.sources),
                    pa.schema([split.schema.field(c) for c in typed]), lengths, row_bytes,
                    None if split.key.startswith("data.") else split.key, root)


def check_length_column(split: DataSplit, column: str | None, budget: float | None = None) -> str | None:
    """data.length_column names a numeric column of every source, without missing or negative values, and no row
    longer than train.tokens_per_micro_batch (one pass over that one column on the driver)."""
    if column is None:
        return None
    for part in [m for _, m in split.sources] or [split]:
        if column not in part.schema.names:
            raise DataError(f"data.length_column ({column}): {part.key} has no such column (columns: "
                            f"{part.schema.names}); name the column holding each row's length")
        t = part.schema.field(column).type
        if not (pa.types.is_integer(t) or pa.types.is_floating(t)):
            raise DataError(f"data.length_column ({column}) is {t} in {part.key}, not a number; name a numeric column "
                            f"(tokens, samples, seconds)")
    longest = 0
    for table in split.batches([column], 1 << 20):
        col = table.column(0)
        bad = col.null_count or (len(col) and pc.min(col).as_py() < 0)
        if bad:
            raise DataError(f"data.length_column ({column}) has missing or negative values in {split.key}; give every "
                            f"row its length")
        longest = max(longest, pc.max(col).as_py() or 0)
    if budget is not None and longest > budget:
        raise DataError(f"train.tokens_per_micro_batch ({budget:g}) is below the longest row of {split.key} ({longest:g} "
                        f"in data.length_column {column}); use train.tokens_per_micro_batch={math.ceil(longest)} or more")
    return column


def file_columns(task, columns: tuple[str, ...], split: DataSplit) -> tuple[str, ...]:
    """The task's file columns that hold paths in this split (a binary one holds the bytes already)."""
    declared = tuple(getattr(task, "file_columns", ()) or ())
    unread = [c for c in declared if c not in columns]
    if unread:
        raise DataError(f"{split.key}: file column {unread[0]!r} of model.name is not a column the task reads "
                        f"({list(columns)}); add it to the task's columns or its file_columns")
    bad = [c for c in declared if not is_reference(split.schema, c) and not pa.types.is_binary(split.schema.field(c).type)
           and not pa.types.is_large_binary(split.schema.field(c).type)]
    if bad:
        raise DataError(f"{split.key}: file column {bad[0]!r} is {split.schema.field(bad[0]).type}, not paths (strings) "
                        f"or bytes; point it at a column of file paths")
    return tuple(c for c in declared if is_reference(split.schema, c))


def read_files(files, columns: list[str] | None = None, key: str = "data") -> pa.Table:
    """The files' rows in file order, whatever their format (a task's inspect, tests)."""
    layouts, schema = read_layouts(list(files), key)
    return DataSplit("data", key, layouts, schema, sum(lay.num_rows for lay in layouts)).read(columns)


