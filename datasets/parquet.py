"""Parquet inputs: find the shards, check them against the config, and turn Arrow tables into arrays.

The driver calls `inspect()` once (fast: Parquet footers plus the label column) so that a wrong path, a
missing column or a corrupted shard is a one-line usage error before any worker starts. Workers receive
the rows from Ray Data (`ray.train.get_dataset_shard`) as Arrow batches, or read them with pyarrow under
torchrun, and both paths end in `table_to_arrays()`, so the two runtimes see identical tensors.
"""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.parquet as pq

SAMPLE_ID = "sample_id"


class DataError(ValueError):
    """Bad input data the user can fix (exit code 2)."""


@dataclass(frozen=True)
class DataSpec:
    """What the loop needs to know about a split's columns; built from the Parquet schema."""

    kind: str  # "text" (a `tokens` fixed-size list) or "tabular"
    columns: tuple[str, ...]  # columns to read
    feature_columns: tuple[str, ...] = ()
    label_column: str | None = None
    seq_len: int = 0
    num_classes: int | None = None
    has_sample_id: bool = True
    num_rows: int = 0
    files: tuple[str, ...] = field(default=(), repr=False)


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


def read_schema(files: list[str], key: str) -> tuple[pa.Schema, int]:
    """The common schema and the row count, from every file's footer; a corrupted file is named."""
    schema, rows = None, 0
    for f in files:
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
        rows += meta.num_rows
    if rows == 0:
        raise DataError(f"{key}: the Parquet files hold no rows; point it at a non-empty data set")
    return schema, rows


def _is_numeric(t: pa.DataType) -> bool:
    return pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t)


def inspect(data_cfg, model_cfg, split: str = "train") -> DataSpec:
    """Check a split against the config and describe it. `split` is "train" or "val"."""
    key = f"data.{split}_path"
    files = resolve_files(getattr(data_cfg, f"{split}_path"), key)
    schema, rows = read_schema(files, key)
    has_id = SAMPLE_ID in schema.names
    if model_cfg.name == "char_gpt":
        if "tokens" not in schema.names:
            raise DataError(f"{key}: no 'tokens' column (found {schema.names}); char_gpt needs fixed-length token rows "
                            f"from python datasets/prepare.py pystdlib, or set model.name=mlp for tabular data")
        t = schema.field("tokens").type
        if not (pa.types.is_fixed_size_list(t) and pa.types.is_integer(t.value_type)):
            raise DataError(f"{key}: column 'tokens' is {t}, must be a fixed-size list of integers")
        if model_cfg.context + 1 > t.list_size:
            raise DataError(f"model.context ({model_cfg.context}) needs rows of {model_cfg.context + 1} tokens but "
                            f"{key} has {t.list_size}; use model.context={t.list_size - 1} or prepare longer rows")
        cols = ("tokens",) + ((SAMPLE_ID,) if has_id else ())
        return DataSpec("text", cols, seq_len=t.list_size, num_classes=None, has_sample_id=has_id,
                        num_rows=rows, files=tuple(files))

    label = data_cfg.label_column
    if label not in schema.names:
        raise DataError(f"data.label_column ({label}) is not a column of {key} (columns: {schema.names}); "
                        f"set data.label_column=<name>")
    if not pa.types.is_integer(schema.field(label).type):
        raise DataError(f"data.label_column ({label}) has type {schema.field(label).type}; labels must be integers 0..C-1")
    if data_cfg.feature_columns:
        missing = [c for c in data_cfg.feature_columns if c not in schema.names]
        if missing:
            raise DataError(f"data.feature_columns ({missing}) are not columns of {key} (columns: {schema.names}); "
                            f"fix the names or leave data.feature_columns empty to use every numeric column")
        non_numeric = [c for c in data_cfg.feature_columns if not _is_numeric(schema.field(c).type)]
        if non_numeric:
            raise DataError(f"data.feature_columns ({non_numeric}) are not numeric; remove them from data.feature_columns")
        feats = tuple(data_cfg.feature_columns)
    else:
        feats = tuple(n for n in schema.names if n not in (label, SAMPLE_ID) and _is_numeric(schema.field(n).type))
        if not feats:
            raise DataError(f"{key}: no numeric feature columns besides '{label}'; set data.feature_columns")
    labels = pa.concat_arrays([pq.read_table(_open(f), columns=[label]).column(0).combine_chunks() for f in files])
    if labels.null_count:
        raise DataError(f"data.label_column ({label}) has {labels.null_count} missing values in {key}; drop those rows")
    lo, hi = (v.as_py() for v in (pc.min(labels), pc.max(labels)))
    num_classes = model_cfg.num_classes or hi + 1
    if lo < 0 or hi >= num_classes:
        raise DataError(f"model.num_classes ({num_classes}) does not cover the labels in {key} (range {lo}..{hi}); "
                        f"labels must be 0..num_classes-1: set model.num_classes={hi + 1} or relabel")
    if data_cfg.nan_policy == "error":
        # Never train on NaN silently: count missing values per feature column before any worker starts.
        for f in files:
            t = pq.read_table(_open(f), columns=list(feats))
            for name in feats:
                col = t.column(name)
                bad = col.null_count + (pc.sum(pc.is_nan(col)).as_py() or 0 if pa.types.is_floating(col.type) else 0)
                if bad:
                    raise DataError(f"{key}: feature column '{name}' has {bad} NaN/missing values in {os.path.basename(f)}; "
                                    f"clean the data or set data.nan_policy=impute (training mean)")
    cols = feats + (label,) + ((SAMPLE_ID,) if has_id else ())
    return DataSpec("tabular", cols, feature_columns=feats, label_column=label, num_classes=num_classes,
                    has_sample_id=has_id, num_rows=rows, files=tuple(files))


def read_local(spec: DataSpec) -> pa.Table:
    """pyarrow reads the shards in file order (the torchrun path and tests)."""
    return pa.concat_tables(pq.read_table(_open(f), columns=list(spec.columns)) for f in spec.files)


@dataclass
class Arrays:
    """One split in memory, rows sorted by sample_id so the order is independent of how rows arrived."""

    x: np.ndarray  # text: (n, seq_len) integer tokens; tabular: (n, F) float32
    y: np.ndarray | None  # tabular labels (n,) int64
    sample_id: np.ndarray  # (n,) int64

    def __len__(self) -> int:
        return len(self.sample_id)


def table_to_arrays(table: pa.Table, spec: DataSpec) -> Arrays:
    n = table.num_rows
    if spec.has_sample_id:
        ids = table.column(SAMPLE_ID).to_numpy().astype(np.int64, copy=False)
    else:
        # No sample_id: rows arrive in file order (read_local, or Ray Data with preserve_order), so the
        # position is a stable id.
        ids = np.arange(n, dtype=np.int64)
    if spec.kind == "text":
        col = table.column("tokens").combine_chunks()
        x = col.flatten().to_numpy(zero_copy_only=False).reshape(n, spec.seq_len)
        y = None
    else:
        x = np.empty((n, len(spec.feature_columns)), dtype=np.float32)
        for i, c in enumerate(spec.feature_columns):
            x[:, i] = table.column(c).to_numpy(zero_copy_only=False)
        y = table.column(spec.label_column).to_numpy().astype(np.int64, copy=False)
    order = np.argsort(ids, kind="stable")
    if spec.has_sample_id and len(ids) > 1 and np.any(np.diff(ids[order]) == 0):
        raise DataError(f"{SAMPLE_ID} has duplicate values; make it unique per row or drop the column")
    return Arrays(x[order], None if y is None else y[order], ids[order])
