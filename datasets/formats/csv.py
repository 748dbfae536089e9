"""CSV (`.csv`) with a header line, parsed by pyarrow.csv part by part; one row per line (a quoted value may not
span lines: such data is better kept as JSON Lines or Parquet)."""

from __future__ import annotations

import csv
import io

import pyarrow as pa
import pyarrow.compute as pcomp
import pyarrow.csv as pc

from stride.datasets.formats import FileLayout, Format, PartReader, first_line, open_input, stamp
from stride.errors import DataError
from stride.datasets.lines import LineReader, bad_line, line_extents, nonblank_lines, read_part


def _parse(data: bytes, names: list[str], types: dict[str, pa.DataType] | None = None,
           columns: list[str] | None = None) -> pa.Table:
    read = pc.ReadOptions(column_names=names, use_threads=False, block_size=max(len(data) + 1, 1 << 16))
    convert = pc.ConvertOptions(column_types=types or {}, include_columns=columns or [])
    return pc.read_csv(pa.BufferReader(data), read_options=read, convert_options=convert)


def _header(f, path: str, key: str) -> tuple[list[str], int]:
    """The column names and the offset of the first data line."""
    head = f.read_at(min(f.size(), 1 << 20), 0)
    end = head.find(b"\n")
    if end < 0 and len(head) == f.size():
        end = len(head)
    if end < 0:
        raise DataError(f"{key}: {path} has no header line within its first MiB; give the CSV a header line")
    text = head[:end].decode("utf-8-sig", errors="replace").rstrip("\r")
    names = next(csv.reader([text]), [])
    if not names or any(not n for n in names) or len(set(names)) != len(names):
        raise DataError(f"{key}: {path} line 1 is not a header of distinct column names ({text[:120]!r}); give the CSV "
                        f"a header line")
    return names, min(end + 1, f.size())


# A cell pyarrow would read as a number (what decides a column's inferred type): only used to sort the cells of a
# column pyarrow already read as text, and those it calls numbers are confirmed by pyarrow's own cast.
_NUMBER = r"^[+-]?(([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?|[iI]nf(inity)?|[nN]a[nN])$"
_MISSING = pa.array(pc.ConvertOptions().null_values)  # cells pyarrow reads as null in a column of numbers


class _Kinds:
    """Numbers and text cells of each column, over every part of one file: pyarrow infers a column's type per part,
    so one damaged cell makes its whole part (and, widened, the file) text, and a model reading numeric columns
    would silently drop the feature. A column mostly of numbers with a text cell is refused by that cell's line; a
    column mostly of text is text (a number among words is a word)."""

    def __init__(self, names: list[str]):
        self.numbers = dict.fromkeys(names, 0)
        self.words = dict.fromkeys(names, 0)
        self.first_word: dict[str, tuple[int, str]] = {}  # column -> (line, value) of its first text cell

    def count(self, table: pa.Table, data: bytes, first: int) -> None:
        for name in table.column_names:
            col = table.column(name)
            if pa.types.is_integer(col.type) or pa.types.is_floating(col.type):
                self.numbers[name] += len(col) - col.null_count
            elif pa.types.is_string(col.type):
                self._count_text(name, col, data, first)

    def _count_text(self, name: str, col: pa.ChunkedArray, data: bytes, first: int) -> None:
        present = pcomp.fill_null(pcomp.invert(pcomp.is_in(col, value_set=_MISSING)), False)
        number = pcomp.fill_null(pcomp.and_(present, pcomp.match_substring_regex(col, _NUMBER)), False)
        try:
            pcomp.cast(pcomp.filter(col, number), pa.float64())
        except pa.ArrowInvalid:  # the pattern took a cell pyarrow does not: trust pyarrow, and call the column text
            number = pcomp.and_(present, False)
        numbers = pcomp.sum(number).as_py() or 0
        words = (pcomp.sum(present).as_py() or 0) - numbers
        self.numbers[name] += numbers
        self.words[name] += words
        if words and name not in self.first_word:
            row = pcomp.index(pcomp.and_(present, pcomp.invert(number)), True).as_py()
            line, _ = bad_line(data, first, lambda s: None, row)
            self.first_word[name] = (line, col[row].as_py())

    def check(self, path: str, key: str) -> None:
        for name, (line, value) in self.first_word.items():
            if self.numbers[name] >= self.words[name]:
                raise DataError(f"{key}: {path} line {line} column {name!r} holds {value[:60]!r}, not a number as "
                                f"{self.numbers[name]:,} of its values are; fix that cell (leave it empty for a missing "
                                f"value), or keep a text column as JSON Lines or Parquet")


def _unify(schemas: list[pa.Schema]) -> pa.Schema:
    """The parts' inferred types, widened where they differ: int and float to float, anything else to string (a
    column that is numbers in one part and words in another stays text, as a spreadsheet would keep it)."""
    fields = []
    for i, f in enumerate(schemas[0]):
        types = {s.field(i).type for s in schemas}
        try:
            merged = pa.unify_schemas([pa.schema([pa.field(f.name, t)]) for t in types],
                                      promote_options="permissive").field(0).type
        except (pa.ArrowTypeError, pa.ArrowInvalid, pa.ArrowNotImplementedError):
            merged = pa.string()
        fields.append(pa.field(f.name, merged))
    return pa.schema(fields)


class Csv(Format):
    name = "csv"
    cached = True  # a layout costs a parse of the file: datasets/index.py keeps it
    extensions = (".csv",)

    def layout(self, path: str, key: str) -> FileLayout:
        size_mtime = stamp(path)
        extents, rows, schemas = [], [], []
        with open_input(path) as f:
            names, start = _header(f, path, key)
            kinds = _Kinds(names)
            for offset, length, first in line_extents(path, start):
                data = read_part(f, path, key, offset, length, first)
                try:
                    table = _parse(data, names)
                except pa.ArrowException as e:
                    line, why = bad_line(data, first, lambda s: _ragged(s, len(names)))
                    raise DataError(f"{key}: {path} line {line} is malformed ({why or first_line(e)}); fix or remove "
                                    f"that line") from None
                if table.num_rows < nonblank_lines(data):  # a quoted newline: parses or not by where a cut falls
                    line, _ = bad_line(data, first, lambda s: "odd quotes" if s.count(b'"') % 2 else None)
                    raise DataError(f"{key}: {path} line {line} starts a quoted value that spans lines; Stride reads "
                                    f"CSV one row per line: remove the line breaks inside values, or use JSON Lines")
                kinds.count(table, data, first)
                extents.append((offset, length, first))
                rows.append(table.num_rows)
                schemas.append(table.schema)
        if not schemas:
            raise DataError(f"{key}: {path} holds a header and no rows; remove it or add rows")
        kinds.check(path, key)
        return FileLayout(path, self.name, _unify(schemas), tuple(rows), tuple(extents), size_mtime,
                          sum(n for _, n, _ in extents))

    def reader(self, layout: FileLayout, key: str) -> PartReader:
        names, schema = layout.schema.names, layout.schema

        def parse(data: bytes, columns: list[str]) -> pa.Table:
            return _parse(data, names, {c: schema.field(c).type for c in columns}, columns).select(columns)

        return LineReader(layout, key, parse)


def _ragged(line: bytes, width: int) -> str | None:
    fields = next(csv.reader(io.StringIO(line.decode("utf-8", errors="replace").rstrip("\r"))), [])
    return None if len(fields) == width else f"{len(fields)} fields where the header has {width}"


FORMAT = Csv()
