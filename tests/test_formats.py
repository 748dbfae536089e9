"""Data formats (datasets/formats/): JSON Lines and CSV read natively, in the same order and with the same values as
Parquet; their layouts cached under the run storage, never beside the data, and checked against the file; bad lines
named by file and line number."""

import csv
import json
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import stride.datasets.lines as lines
from stride.datasets import index
from stride.datasets.formats import formats
from stride.datasets.order import Order
from stride.datasets.splits import DataSpec, open_split, read_files, resolve_files
from stride.errors import DataError
from stride.datasets.stream import TrainStream, eval_stream

ROWS = 1003


def rows(n=ROWS):
    return [{"x": float(i) / 4, "label": i % 3, "text": f"row {i}, \"quoted\""} for i in range(n)]


def write(folder, fmt, table_rows, files=3):
    """The rows in `files` files of format `fmt` (split unevenly), in row order."""
    folder.mkdir(parents=True, exist_ok=True)
    cuts = np.linspace(0, len(table_rows), files + 1).astype(int)
    for i, (lo, hi) in enumerate(zip(cuts, cuts[1:])):
        part = table_rows[lo:hi]
        path = folder / f"part-{i}.{fmt}"
        if fmt == "parquet":
            pq.write_table(pa.Table.from_pylist(part), path, row_group_size=97)
        elif fmt == "jsonl":
            path.write_text("".join(json.dumps(r) + "\n" for r in part))
        else:
            with open(path, "w", newline="") as f:
                out = csv.DictWriter(f, fieldnames=list(part[0]), lineterminator="\n")
                out.writeheader()
                out.writerows(part)
    return folder


def split_of(folder, cache=None):
    class Data:
        train_path = str(folder)

    return open_split(Data, "train", cache)


def stream_all(split, world_size, G=24, window=100, columns=("x", "label", "text")):
    """(sample ids, x, label, text) of every micro-batch of epoch 0, ranks' slices in rank order."""
    spec = DataSpec(columns, False, split.num_rows, split.layouts, split.blocks, "train")
    order = Order(tuple(n for _, _, n in spec.blocks), 7, G, window)
    streams = [TrainStream(spec, order, r, world_size, 0, 2, order.micro_steps_per_epoch) for r in range(world_size)]
    out = []
    try:
        for _ in range(order.micro_steps_per_epoch):
            parts = [s.next() for s in streams]
            out.append((np.concatenate([p.sample_id for p in parts]),
                        *(np.concatenate([p.data[c] for p in parts]) for c in columns)))
    finally:
        for s in streams:
            s.close()
    return out


@pytest.fixture(scope="module")
def sets(tmp_path_factory):
    base = tmp_path_factory.mktemp("formats")
    return {fmt: write(base / fmt, fmt, rows()) for fmt in ("parquet", "jsonl", "csv")}


def test_csv_equals_jsonl_equals_parquet_row_for_row(sets):
    tables = {fmt: read_files(resolve_files(str(folder), "data.train_path")) for fmt, folder in sets.items()}
    assert tables["jsonl"].equals(tables["parquet"]) and tables["csv"].equals(tables["parquet"])
    assert tables["parquet"].num_rows == ROWS


@pytest.mark.parametrize("fmt", ["jsonl", "csv"])
def test_text_files_stream_in_parquets_order_with_its_values_at_any_world_size(sets, fmt, tmp_path):
    lines.PART_ROWS, saved = 97, lines.PART_ROWS  # parts as small as the Parquet row groups: same blocks, same order
    try:
        split = split_of(sets[fmt], tmp_path / "cache")
    finally:
        lines.PART_ROWS = saved
    reference = stream_all(split_of(sets["parquet"]), 1)
    for world_size in (1, 2, 3):
        got = stream_all(split, world_size, G=24)
        assert len(got) == len(reference) == ROWS // 24
        for a, b in zip(got, reference):
            for x, y in zip(a, b):
                np.testing.assert_array_equal(x, y)
    ids = np.concatenate([c.sample_id for c in eval_stream(
        DataSpec(("x",), False, split.num_rows, split.layouts, split.blocks, "val"), 0, 1, 50)])
    assert sorted(ids.tolist()) == list(range(ROWS))  # validation: every row once


def test_a_json_file_of_one_object_per_line_and_types_widened_across_files(tmp_path):
    d = tmp_path / "d"
    d.mkdir()
    (d / "a.json").write_text('{"x": 1, "y": null}\n\n{"x": 2, "y": "b"}\n')  # a blank line is no row
    (d / "b.jsonl").write_text('{"x": 2.5, "y": "c", "extra": true}\n')
    with pytest.raises(DataError, match=r"b.jsonl has columns \['x', 'y', 'extra'\], unlike .*a.json"):
        split_of(d)
    (d / "b.jsonl").write_text('{"x": 2.5, "y": "c"}')  # no final newline: still a line
    table = split_of(d).read()
    assert table.column("x").to_pylist() == [1.0, 2.0, 2.5] and table.column("y").to_pylist() == [None, "b", "c"]


@pytest.mark.parametrize("name, text, match", [
    ("bad.jsonl", '{"x": 1}\n{"x": 2}\n{"x": \n{"x": 4}\n', r"bad.jsonl line 3 is malformed \(not JSON"),
    ("list.jsonl", '{"x": 1}\n\n[1, 2]\n', r"list.jsonl line 3 is malformed \(a JSON list, not an object\)"),
    ("types.jsonl", '{"x": 1}\n{"x": 2}\n{"x": "two"}\n', r"types.jsonl line 3 is malformed \(JSON parse error"),
    ("ragged.csv", "a,b\n1,2\n3,4\n5\n6,7\n", r"ragged.csv line 4 is malformed \(1 fields where the header has 2\)"),
    ("header.csv", "a,a\n1,2\n", r"header.csv line 1 is not a header of distinct column names"),
    ("empty.jsonl", "\n\n", r"empty.jsonl (is empty|holds no rows)"),
    ("pretty.jsonl", '{"x": 1}\n{"x":\n  2}\n', r"pretty.jsonl line 2 starts an object that spans lines"),
    ("quoted.csv", 'a,b\n1,"x"\n2,"y\nz"\n', r"quoted.csv line 3 starts a quoted value that spans lines"),
    ("notes.txt", "hello\n", r"holds notes.txt, whose extension is not a data format Stride reads \(.csv, .json"),
])
def test_a_bad_file_is_one_data_error_naming_file_and_line(tmp_path, name, text, match):
    d = tmp_path / "d"
    d.mkdir()
    (d / name).write_text(text)
    before = (d / name).read_bytes()
    with pytest.raises(DataError, match=match) as e:
        split_of(d, tmp_path / "cache")
    assert "\n" not in str(e.value)
    assert sorted(os.listdir(d)) == [name] and (d / name).read_bytes() == before  # nothing of the user's touched


def test_a_layout_is_cached_under_the_run_storage_and_redone_when_the_file_changes(tmp_path, monkeypatch):
    d = write(tmp_path / "data", "jsonl", rows(300), files=1)
    cache = tmp_path / "runs" / ".stride-cache" / "index"
    made = []
    jsonl = formats()["jsonl"]
    original = type(jsonl).layout
    monkeypatch.setattr(type(jsonl), "layout", lambda self, path, key: made.append(path) or original(self, path, key))
    first = split_of(d, cache)
    assert len(made) == 1 and sorted(os.listdir(d)) == ["part-0.jsonl"]  # nothing written beside the data
    (entry,) = cache.iterdir()
    assert oct(entry.stat().st_mode & 0o777) == "0o600" and oct(cache.stat().st_mode & 0o777) == "0o700"
    again = split_of(d, cache)
    assert len(made) == 1 and again.layouts == first.layouts  # the cached layout, no second parse

    with open(d / "part-0.jsonl", "a") as f:  # a changed file: laid out again
        f.write(json.dumps({"x": 9.0, "label": 0, "text": "new"}) + "\n")
    assert split_of(d, cache).num_rows == 301 and len(made) == 2

    entry.write_text(entry.read_text().replace('"rows":[', '"rows":[1,'))  # a damaged entry is not used
    assert split_of(d, cache).num_rows == 301 and len(made) == 3


def test_a_text_file_changed_under_a_run_is_a_data_error_naming_it(tmp_path):
    d = write(tmp_path / "data", "jsonl", rows(300), files=1)
    split = split_of(d)
    spec = DataSpec(("x",), False, split.num_rows, split.layouts, split.blocks, "train")
    order = Order(tuple(n for _, _, n in spec.blocks), 0, 10, 50)
    (d / "part-0.jsonl").write_text((d / "part-0.jsonl").read_text().replace('"x": 1.0,', '"x": 10.0,'))
    stream = TrainStream(spec, order, 0, 1, 0, 1, order.micro_steps_per_epoch)
    try:
        with pytest.raises(DataError, match=r"data.train_path: .*part-0.jsonl changed after the run started"):
            stream.next()
    finally:
        stream.close()


def test_line_parts_tile_the_file_in_whole_lines(tmp_path, monkeypatch):
    rng = np.random.default_rng(0)
    for trial in range(200):
        body = b"\n".join(b"x" * int(n) for n in rng.integers(0, 12, rng.integers(0, 30)))
        data = body + (b"\n" if body and rng.random() < 0.5 else b"")
        start = data.index(b"\n") + 1 if b"\n" in data and rng.random() < 0.3 else 0
        monkeypatch.setattr(lines, "PART_ROWS", int(rng.integers(1, 6)))
        monkeypatch.setattr(lines, "PART_BYTES", int(rng.integers(1, 40)))
        monkeypatch.setattr(lines, "SCAN_BYTES", 7)
        (tmp_path / "f").write_bytes(data)
        pos = start
        for offset, length, first in lines.line_extents(str(tmp_path / "f"), start):
            part = data[offset:offset + length]
            assert offset == pos and first == data[:offset].count(b"\n") + 1
            n = part.count(b"\n") + (not part.endswith(b"\n"))
            assert n <= lines.PART_ROWS and (length <= lines.PART_BYTES or n == 1)
            pos += length
        assert pos == len(data)


def test_a_cache_entry_must_tile_its_file():
    assert index._tiles(((0, 10, 1), (10, 5, 3)), 15)
    assert not index._tiles(((0, 10, 1), (11, 4, 3)), 15)  # a gap
    assert not index._tiles(((0, 10, 1), (10, 5, 3)), 16)  # short of the end
    assert not index._tiles((), 0)
