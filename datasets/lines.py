"""Text files one row per line (JSON Lines, CSV): cut into parts of whole lines, read back by byte range.

A text file has no footer, so the driver scans it once: the newlines give parts of at most PART_ROWS lines and
PART_BYTES bytes, and the format parses each part once to learn its rows and types (a malformed line is found here,
before any worker starts, and named by its line number). The layout is then cached (datasets/index.py), and a worker
reads a part with one positioned read and one parse, which is what makes a text file seekable on resume.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np
import pyarrow as pa

from stride.datasets.formats import FileLayout, PartReader, first_line, open_input, stamp
from stride.errors import DataError

PART_ROWS = 4096  # lines per part: the same granularity as prepare.py's Parquet row groups
PART_BYTES = 8 << 20  # and a bound on a part's bytes, so that long lines (inline blobs) keep parts small
SCAN_BYTES = 16 << 20  # read at a time while looking for newlines
# pyarrow's text readers take a part as one block, and a block's size is a 32-bit int: a longer part (one line,
# since PART_BYTES bounds the rest) cannot be parsed at all, so it is refused by name instead of overflowing.
MAX_PART_BYTES = (1 << 31) - 2


def line_extents(path: str, start: int = 0) -> Iterator[tuple[int, int, int]]:
    """(byte offset, length, number of its first line, 1-based) of every part of the file from byte `start` (the
    first line after a header), each of whole lines. A last line without a newline is a line."""
    f = open_input(path)
    try:
        size = f.size()
        next_line = 1 + (f.read_at(start, 0).count(b"\n") if start else 0)  # the number of the next line
        part_start = part_end = pos = start
        lines, first = 0, next_line  # of the part being filled
        while pos < size:
            chunk = f.read_at(min(SCAN_BYTES, size - pos), pos)
            ends = np.flatnonzero(np.frombuffer(chunk, np.uint8) == 10) + (pos + 1)  # the offset after each newline
            pos += len(chunk)
            if pos == size and (not len(ends) or ends[-1] != size):
                ends = np.append(ends, size)
            i = 0
            while i < len(ends):
                # The part closes at its PART_ROWS-th line, or at its last line within PART_BYTES (a part holds one
                # line at least), whichever comes first; a part still open continues into the next chunk.
                by_bytes = int(np.searchsorted(ends, part_start + PART_BYTES, side="right")) - 1
                j = min(i + PART_ROWS - lines - 1, by_bytes if lines else max(by_bytes, i))
                if j < i:  # the next line does not fit: close the part before it
                    yield part_start, part_end - part_start, first
                    part_start, lines, first = part_end, 0, next_line
                    continue
                if j >= len(ends):
                    lines, next_line, part_end = lines + len(ends) - i, next_line + len(ends) - i, int(ends[-1])
                    break
                next_line += j - i + 1
                part_end = int(ends[j])
                yield part_start, part_end - part_start, first
                part_start, lines, first, i = part_end, 0, next_line, j + 1
        if part_start < size:
            yield part_start, size - part_start, first
    finally:
        f.close()


def read_part(f, path: str, key: str, offset: int, length: int, first: int) -> bytes:
    """The bytes of one part, read on the driver to learn its rows; a part too long to parse is a DataError naming
    its line (checked before reading: such a line would cost its size in memory first)."""
    if length > MAX_PART_BYTES:
        raise DataError(f"{key}: {path} line {first} is {length:,} bytes long, over the {MAX_PART_BYTES:,} a line may "
                        f"hold; split that row, or keep large values as files named by a file column "
                        f"(docs/data.md) or in Parquet")
    return f.read_at(length, offset)


def bad_line(data: bytes, first: int, check: Callable[[bytes], str | None], row: int | None = None) -> tuple[int, str]:
    """(line number, why) of the first line of a part that `check` refuses; else the `row`-th non-blank line (a
    parser that named the row, not the line); else the part's first line."""
    nonblank = -1
    for n, line in enumerate(data.split(b"\n")):
        if not line.strip():
            continue
        nonblank += 1
        if (why := check(line)) is not None:
            return first + n, why
        if row is not None and nonblank == row:
            return first + n, ""
    return first, ""


def nonblank_lines(data: bytes) -> int:
    """Lines holding more than whitespace: the rows a part must hold if every row is one line."""
    return sum(1 for line in data.split(b"\n") if line.strip())


class LineReader(PartReader):
    """Reads parts of a text file by byte range and parses them with the format's `parse(data, columns)`."""

    def __init__(self, layout: FileLayout, key: str, parse: Callable[[bytes, list[str]], pa.Table]):
        self.layout, self.key, self.parse = layout, key, parse
        self._file = None

    def read(self, parts: list[int], columns: list[str]) -> pa.Table:
        self._check_unchanged()
        tables = []
        for p in parts:
            offset, length, first = self.layout.extents[p]
            try:
                if self._file is None:
                    self._file = open_input(self.layout.path)
                data = self._file.read_at(length, offset)
                table = self.parse(data, columns)
            except (OSError, pa.ArrowException) as e:
                self._file = None
                raise DataError(f"{self.key}: {self.layout.path} could not be read (lines from {first}: "
                                f"{first_line(e)}); it changed or disappeared after the run started: restore it, or "
                                f"start a new run.name without it") from None
            if table.num_rows != self.layout.rows[p]:
                raise DataError(f"{self.key}: {self.layout.path} lines from {first} hold {table.num_rows} rows, not "
                                f"the {self.layout.rows[p]} they held when the run started; restore the file or start "
                                f"a new run.name")
            tables.append(table)
        return pa.concat_tables(tables) if len(tables) != 1 else tables[0]

    def _check_unchanged(self) -> None:
        try:
            now = stamp(self.layout.path)
        except (OSError, pa.ArrowException) as e:
            raise DataError(f"{self.key}: {self.layout.path} could not be read ({first_line(e)}); it disappeared "
                            f"after the run started: restore it, or start a new run.name without it") from None
        if self.layout.stamp != (0, 0) and now != self.layout.stamp:
            raise DataError(f"{self.key}: {self.layout.path} changed after the run started (size or modification "
                            f"time); restore it, or start a new run.name to train on the new contents")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
