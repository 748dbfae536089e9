"""A JSON Lines copy of a Parquet data set, for the benchmarks that read the same rows in both formats.

    jsonl_copy(src, dst) -> {"files", "rows", "parquet_bytes", "jsonl_bytes", "seconds"}

Every `*.parquet` file under `src` (train/part-0000.parquet, ...) becomes `dst/<same path>.jsonl`: one JSON object per
row, the columns as keys in the file's order. Made with Arrow's compute functions, batch by batch (a 4M-row set would
take minutes through json.dumps): integers as they are, floats in their shortest round-trip form for their own
width (a float32 0.1 is written 0.1, not 0.10000000149011612), always with a "." or an exponent so that JSON's
type inference reads them back as floats (a constant column of 3.0 would otherwise come back as integers). Only
numeric columns (and fixed-size lists of numbers, written as JSON arrays): bytes and strings are refused, since
JSON cannot hold bytes as they are, and NaN and infinities, which JSON has no literal for. The caller owns `dst`
(a temporary folder) and removes it.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

BATCH_ROWS = 65536  # rows converted at a time: a batch of 64 float columns is ~70 MB of text


def _number_text(col: pa.Array, name: str) -> pa.Array:
    """A numeric column as JSON number literals (strings)."""
    t = col.type
    if pa.types.is_integer(t):
        return pc.cast(col, pa.string())
    if pa.types.is_floating(t):
        if not pc.all(pc.is_finite(col)).as_py():
            raise ValueError(f"column {name!r} holds NaN or an infinity, which JSON cannot represent")
        text = pc.cast(col, pa.string())  # shortest round-trip digits of the column's own width
        plain = pc.invert(pc.match_substring_regex(text, r"[.eE]"))
        return pc.if_else(plain, pc.binary_join_element_wise(text, ".0", ""), text)
    raise ValueError(f"column {name!r} is {t}: only numbers (and fixed-size lists of numbers) are copied to JSON")


def _value_text(col: pa.Array, name: str) -> pa.Array:
    if col.null_count:
        raise ValueError(f"column {name!r} has nulls: not copied (the benchmark sets have none)")
    if pa.types.is_fixed_size_list(col.type):
        size = col.type.list_size
        values = _number_text(col.flatten(), name)
        lists = pa.ListArray.from_arrays(pa.array(np.arange(len(col) + 1, dtype=np.int32) * size), values)
        return pc.binary_join_element_wise("[", pc.binary_join(lists, ","), "]", "")
    return _number_text(col, name)


def _lines(batch: pa.RecordBatch) -> pa.Array:
    """One JSON object per row, each ending in a newline."""
    parts: list = []
    for i, name in enumerate(batch.schema.names):
        parts += [("{" if i == 0 else ",") + json.dumps(name) + ":", _value_text(batch.column(i), name)]
    return pc.binary_join_element_wise(*parts, "}\n", "")


def _write(lines: pa.Array, f) -> None:
    """The lines' characters are one contiguous buffer: written as one range of it, not row by row."""
    offsets = np.frombuffer(lines.buffers()[1], np.int32)[lines.offset:lines.offset + len(lines) + 1]
    f.write(memoryview(lines.buffers()[2])[offsets[0]:offsets[-1]])


def jsonl_copy(src: Path, dst: Path) -> dict:
    """JSON Lines copies of every Parquet file under `src`, mirrored under `dst` (see the module's doc)."""
    t0 = time.perf_counter()
    files, rows, pbytes, jbytes = 0, 0, 0, 0
    for path in sorted(Path(src).rglob("*.parquet")):
        out = Path(dst) / path.relative_to(src).with_suffix(".jsonl")
        out.parent.mkdir(parents=True, exist_ok=True)
        with open(out, "wb") as f:
            for batch in pq.ParquetFile(path).iter_batches(batch_size=BATCH_ROWS):
                _write(_lines(batch), f)
                rows += batch.num_rows
        files += 1
        pbytes += path.stat().st_size
        jbytes += out.stat().st_size
    if not files:
        raise ValueError(f"{src} holds no Parquet files to copy")
    return {"files": files, "rows": rows, "parquet_bytes": pbytes, "jsonl_bytes": jbytes,
            "seconds": round(time.perf_counter() - t0, 2)}
