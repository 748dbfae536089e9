"""The layout cache: a text file's layout (its parts, rows and schema) costs a parse of the whole file, so it is kept
in a cache folder and used again while the file's size and modification time are unchanged.

The cache folder is the run storage's `.stride-cache/index` (never beside the user's data). Run storage is shared,
so an entry is data, never code: JSON and an Arrow IPC schema, checked before use. An entry that does not tile its
file exactly is ignored; one whose parts do not hold the rows it claims fails the read that finds out, naming the
file, as for a file changed under the run.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import secrets
from pathlib import Path

import pyarrow as pa

from stride.datasets.formats import FileLayout, Format, stamp

VERSION = 1


def cached_layout(fmt: Format, path: str, key: str, folder: Path | None) -> FileLayout:
    """The format's layout of `path`, from the cache when it is there and current, else made and stored."""
    if folder is None or not fmt.cached:
        return fmt.layout(path, key)
    entry = folder / (hashlib.sha256(f"{fmt.name}\0{path}".encode()).hexdigest()[:40] + ".json")
    current = stamp(path)
    layout = _load(entry, fmt, path, current)
    if layout is None:
        layout = fmt.layout(path, key)
        if layout.stamp == current:  # a file that changed while it was scanned is not cached
            _store(entry, layout)
    return layout


def _load(entry: Path, fmt: Format, path: str, current: tuple[int, int]) -> FileLayout | None:
    try:
        fd = os.open(entry, os.O_RDONLY | os.O_NOFOLLOW)
        with os.fdopen(fd, "rb") as f:
            doc = json.loads(f.read(64 << 20))
        schema = pa.ipc.read_schema(pa.py_buffer(base64.b64decode(doc["schema"])))
        rows = tuple(int(n) for n in doc["rows"])
        extents = tuple((int(o), int(n), int(first)) for o, n, first in doc["extents"])
        layout = FileLayout(path, fmt.name, schema, rows, extents, (int(doc["stamp"][0]), int(doc["stamp"][1])),
                            sum(n for _, n, _ in extents))
    except (OSError, ValueError, KeyError, TypeError, pa.ArrowException):
        return None
    if doc.get("version") != VERSION or doc.get("path") != path or layout.stamp != current or len(rows) != len(extents) \
            or any(n < 0 for n in rows) or not _tiles(extents, current[0]):
        return None
    return layout


def _tiles(extents: tuple[tuple[int, int, int], ...], size: int) -> bool:
    """The parts lie end to end and end at the file's end (the first may start after a header)."""
    if not extents:
        return False
    ends = [o + n for o, n, _ in extents]
    return all(n > 0 for _, n, _ in extents) and ends[-1] == size and all(
        b[0] == a for a, b in zip(ends, extents[1:])) and extents[0][0] >= 0


def _store(entry: Path, layout: FileLayout) -> None:
    """Written to a private temporary file and renamed into place: a reader never sees half an entry. A cache that
    cannot be written (read-only storage) only costs the next run the scan again."""
    doc = {"version": VERSION, "path": layout.path, "format": layout.format, "stamp": list(layout.stamp),
           "rows": list(layout.rows), "extents": [list(e) for e in layout.extents],
           "schema": base64.b64encode(layout.schema.serialize().to_pybytes()).decode()}
    tmp = entry.with_name(f".{entry.name}.{secrets.token_hex(8)}")
    try:
        entry.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(doc, f, separators=(",", ":"))
        os.replace(tmp, entry)
    except OSError:
        tmp.unlink(missing_ok=True)
