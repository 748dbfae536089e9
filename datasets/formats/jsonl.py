"""JSON Lines (`.jsonl`, and `.json` holding one object per line), parsed by pyarrow.json part by part."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.json as pj

from stride.datasets.formats import FileLayout, Format, PartReader, first_line, open_input, stamp
from stride.errors import DataError
from stride.datasets.lines import LineReader, bad_line, line_extents, nonblank_lines, read_part


def _parse(data: bytes, schema: pa.Schema | None = None) -> pa.Table:
    # One block for the whole part: a line longer than pyarrow's block would otherwise be an error.
    read = pj.ReadOptions(use_threads=False, block_size=max(len(data) + 1, 1 << 16))
    parse = pj.ParseOptions(explicit_schema=schema, unexpected_field_behavior="ignore") if schema is not None else None
    return pj.read_json(pa.BufferReader(data), read_options=read, parse_options=parse)


def _not_an_object(line: bytes) -> str | None:
    try:
        value = json.loads(line)
    except ValueError as e:
        return f"not JSON: {e}"
    return None if isinstance(value, dict) else f"a JSON {type(value).__name__}, not an object"


class JsonLines(Format):
    name = "jsonl"
    cached = True  # a layout costs a parse of the file: datasets/index.py keeps it
    extensions = (".jsonl", ".json", ".ndjson")

    def layout(self, path: str, key: str) -> FileLayout:
        size_mtime = stamp(path)
        extents, rows, schemas = [], [], []
        with open_input(path) as f:
            for offset, length, first in line_extents(path):
                data = read_part(f, path, key, offset, length, first)
                try:
                    table = _parse(data)
                except pa.ArrowException as e:
                    raise self._malformed(key, path, data, first, e) from None
                if table.num_rows < nonblank_lines(data):  # an object over several lines: parses or not by the cut
                    line, _ = bad_line(data, first, _not_an_object)
                    raise DataError(f"{key}: {path} line {line} starts an object that spans lines; JSON Lines holds "
                                    f"one object per line: write each on one line")
                extents.append((offset, length, first))
                rows.append(table.num_rows)
                schemas.append(table.schema)
        if not sum(rows):
            raise DataError(f"{key}: {path} holds no rows; remove it or give it one JSON object per line")
        try:
            schema = pa.unify_schemas(schemas, promote_options="permissive")
        except (pa.ArrowTypeError, pa.ArrowInvalid) as e:
            raise DataError(f"{key}: {path} has a field whose type changes between lines ({first_line(e)}); give "
                            f"each field one type") from None
        return FileLayout(path, self.name, schema, tuple(rows), tuple(extents), size_mtime,
                          sum(n for _, n, _ in extents))

    def reader(self, layout: FileLayout, key: str) -> PartReader:
        schema = layout.schema

        def parse(data: bytes, columns: list[str]) -> pa.Table:
            # Only the task's columns are built (the others are skipped), in the layout's types for every part.
            return _parse(data, pa.schema([schema.field(c) for c in columns])).select(columns)

        return LineReader(layout, key, parse)

    @staticmethod
    def _malformed(key: str, path: str, data: bytes, first: int, e: BaseException) -> DataError:
        why = first_line(e)
        row = int(why.rsplit("in row ", 1)[1]) if "in row " in why and why.rsplit("in row ", 1)[1].isdigit() else None
        line, reason = bad_line(data, first, _not_an_object, row)
        return DataError(f"{key}: {path} line {line} is malformed ({reason or why}); fix or remove that line")


FORMAT = JsonLines()
