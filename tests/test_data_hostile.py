"""Hostile and damaged data (issue 42): file columns confined to data.file_root, a damaged CSV cell, a line too long
to parse, a run storage inside the data. Each is one line, exit 2, and reads or writes nothing it should not."""

import hashlib
import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import pytest

from conftest import run_cli
from runs import OVERLAY
from stride.datasets import files, lines
from stride.errors import DataError
from stride.datasets.formats.csv import FORMAT as CSV
from stride.datasets.formats.jsonl import FORMAT as JSONL
from stride.datasets.frame import Frame
from stride.datasets.splits import open_split, read_layouts, split_spec
from stride.errors import UsageError
from stride.trainers.config_reader import build_config
from stride.trainers.launch.lifecycle import check_storage_outside_data

TORCHRUN = ["trainers/torchrun.py", "--config", "trainers/configs/tabular_mlp.yaml", *OVERLAY,
            "train.max_steps=2", "train.epochs=null"]


def one_line(r, *names: str) -> str:
    """A refusal: exit 2 and one stderr line, no traceback, naming each of `names`."""
    got = r.stderr.strip().splitlines()
    assert r.returncode == 2, (r.returncode, r.stdout[-1500:], r.stderr[-1500:])
    assert len(got) == 1 and "Traceback" not in r.stderr, r.stderr[-2000:]
    for name in names:
        assert name in got[0], got[0]
    return got[0]


def digests(folder: Path) -> dict[str, str]:
    return {str(p): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
            for p in sorted(folder.rglob("*"))}


@pytest.fixture(scope="module")
def tabular(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("hostile_data")
    r = run_cli(["datasets/prepare.py", "tabular", "--out", str(tmp / "data"), "--rows", "2000"], timeout=120)
    assert r.returncode == 0, r.stderr
    return tmp


# ---- finding 5: data.file_root confines the paths of file columns ----

@pytest.fixture
def corpus(tmp_path) -> Path:
    """corpus/ holds a manifest and its audio; a secret lies beside corpus/, and a link inside it points there."""
    (tmp_path / "corpus" / "audio").mkdir(parents=True)
    (tmp_path / "corpus" / "audio" / "a.wav").write_bytes(b"RIFF")
    (tmp_path / "secret").write_text("not for the model")
    (tmp_path / "corpus" / "audio" / "link.wav").symlink_to(tmp_path / "secret")
    return tmp_path


def manifest(tmp: Path, paths: list[str]):
    path = tmp / "corpus" / "train.jsonl"
    path.write_text("".join(json.dumps({"path": p, "label": 0}) + "\n" for p in paths))
    return open_split(SimpleNamespace(train_path=str(path)), "train")


@pytest.mark.parametrize("hostile", ["../secret", "{tmp}/secret", "audio/link.wav", "s3://bucket/a.wav"])
def test_a_file_column_path_outside_data_file_root_is_refused_by_its_row(corpus, monkeypatch, hostile):
    monkeypatch.chdir(corpus)
    split = manifest(corpus, ["audio/a.wav", hostile.format(tmp=corpus)])
    if "://" not in hostile:
        files.check_files(split, ("path",), 2)  # without a root, paths are read wherever they point (as before)
    cfg = build_config({"data": {"train_path": split.files[0], "val_path": None, "file_root": "corpus"}})
    assert cfg.data.file_root == corpus / "corpus"  # relative: against the working directory, like the data paths
    task = SimpleNamespace(columns=("path", "label"), file_columns=("path",))
    with pytest.raises(DataError) as e:
        split_spec(cfg, task, split)
    assert f"column path, row 2 of {corpus / 'corpus' / 'train.jsonl'}" in str(e.value)
    assert "outside data.file_root" in str(e.value) and "set data.file_root to a folder" in str(e.value)
    inside = manifest(corpus, ["audio/a.wav", str(corpus / "corpus" / "audio" / "a.wav")])
    assert split_spec(cfg, task, inside).file_root == str(corpus / "corpus")


def test_a_worker_reads_no_file_outside_data_file_root(corpus):
    # The driver's check covers the first CHECK_FILES references, and a link may change after it: each read checks.
    fetcher = files.FileFetcher(("path",), 2, lambda sid: f"row {sid + 1} of m.jsonl", corpus / "corpus")
    audio = corpus / "corpus" / "audio"
    try:
        fine = fetcher.fetch(Frame(("path",), (np.array([str(audio / "a.wav")], dtype=object),), np.arange(1)))
        assert fine.arrays[0][0] == b"RIFF"
        hostile = Frame(("path",), (np.array([str(audio / "a.wav"), str(audio / "link.wav")], dtype=object),),
                        np.arange(2))
        with pytest.raises(DataError, match=r"link.wav \(row 2 of m.jsonl\) is outside data.file_root"):
            fetcher.fetch(hostile)
    finally:
        fetcher.close()


# ---- finding 7: a damaged CSV cell is refused, not silently turned into a text column ----

def rows(start: int, stop: int, damaged: dict[int, str] | None = None) -> str:
    """CSV rows f0,f1,label for i in [start, stop); row i's f1 replaced by damaged[i]."""
    return "".join(f"{i}.5,{(damaged or {}).get(i, i * 2)},{i % 2}\n" for i in range(start, stop))


def test_a_damaged_csv_cell_is_refused_naming_file_line_and_column(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text("f0,f1,label\n" + rows(0, 5) + "\n" + rows(5, 10, {7: "4O"}))  # a blank line: lines != rows
    with pytest.raises(DataError) as e:
        CSV.layout(str(path), "data.train_path")
    text = str(e.value)
    assert text.startswith(f"data.train_path: {path} line 10 column 'f1' holds '4O'") and "fix that cell" in text
    assert path.read_text().splitlines()[9].split(",")[1] == "4O"  # the line the user opens holds that cell


def test_a_damaged_cell_in_a_later_block_is_found_too(tmp_path, monkeypatch):
    monkeypatch.setattr(lines, "PART_ROWS", 4)  # the first blocks are numbers, the fourth holds the text cell
    path = tmp_path / "t.csv"
    path.write_text("f0,f1,label\n" + rows(0, 20, {13: "n/a?"}))
    with pytest.raises(DataError, match=r"t.csv line 15 column 'f1' holds 'n/a\?'"):
        CSV.layout(str(path), "data.train_path")


def test_a_csv_file_whose_column_is_text_beside_files_of_numbers_is_refused(tmp_path):
    (tmp_path / "a.csv").write_text("f0,f1,label\n" + rows(0, 10))
    (tmp_path / "b.csv").write_text("f0,f1,label\n" + rows(0, 3, {0: "x", 1: "y", 2: "z"}))
    with pytest.raises(DataError, match=r"column 'f1' is string in .*b.csv but int64 in .*a.csv"):
        read_layouts([str(tmp_path / "a.csv"), str(tmp_path / "b.csv")], "data.train_path")


def test_a_text_column_stays_text_and_missing_values_are_not_text(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text("name,x\ncat,1\ndog,NA\n1984,\nowl,2.5\n")  # a number among words is a word; NA and "" missing
    schema = CSV.layout(str(path), "data.train_path").schema
    assert str(schema.field("name").type) == "string" and str(schema.field("x").type) == "double"


def test_the_cli_refuses_a_damaged_csv_cell_in_one_line(tabular):
    table = pq.read_table(tabular / "data" / "train").drop_columns(["sample_id"])
    csv_dir = tabular / "csv"
    csv_dir.mkdir(exist_ok=True)
    pacsv.write_csv(table, csv_dir / "train.csv", pacsv.WriteOptions(quoting_style="none"))
    text = (csv_dir / "train.csv").read_text().splitlines()
    cells = text[1500].split(",")
    cells[7] = "0.1.2"
    text[1500] = ",".join(cells)
    (csv_dir / "train.csv").write_text("\n".join(text) + "\n")
    before = digests(csv_dir)
    r = run_cli([*TORCHRUN, f"data.train_path={csv_dir}/train.csv", "data.val_path=null",
                 f"run.storage_path={tabular}/runs_csv"], timeout=300)
    one_line(r, "stride: error: data.train_path", "train.csv line 1501", f"column {table.column_names[7]!r}",
             "'0.1.2'")
    assert digests(csv_dir) == before


# ---- finding 8: a JSON Lines line longer than pyarrow can parse in one block ----

@pytest.mark.parametrize("fmt, suffix, header", [(JSONL, ".jsonl", ""), (CSV, ".csv", "a\n")])
def test_a_line_too_long_to_parse_is_refused_by_its_line(tmp_path, monkeypatch, fmt, suffix, header):
    # The real limit is pyarrow's 2 GiB block, far above a part's 8 MiB: a part over it is one line. So here too.
    monkeypatch.setattr(lines, "MAX_PART_BYTES", 1000)
    monkeypatch.setattr(lines, "PART_BYTES", 100)
    path = tmp_path / f"t{suffix}"
    line = '{"a": "x"}\n' if fmt is JSONL else "x\n"
    long = '{"a": "' + "x" * 2000 + '"}\n' if fmt is JSONL else "x" * 2000 + "\n"
    path.write_text(header + line * 2 + long + line)
    with pytest.raises(DataError, match=rf"t{suffix} line {3 + bool(header)} is 2,0\d\d bytes long, over the 1,000"):
        fmt.layout(str(path), "data.train_path")


def test_the_cli_refuses_a_2_gib_line_in_one_line(tabular):
    # A sparse file: the line is 2 GiB of zero bytes that take no disk, and the driver refuses it before reading it.
    path = tabular / "huge" / "train.jsonl"
    path.parent.mkdir(exist_ok=True)
    first = b'{"f0": 1.0, "label": 0}\n'
    path.write_bytes(first)
    size = (2 << 30) + 100
    with open(path, "r+b") as f:
        f.truncate(size)
    try:
        r = run_cli([*TORCHRUN, f"data.train_path={path}", "data.val_path=null",
                     f"run.storage_path={tabular}/runs_huge"], timeout=300)
        one_line(r, "stride: error: data.train_path", f"train.jsonl line 2 is {size - len(first):,} bytes long",
                 f"over the {lines.MAX_PART_BYTES:,}")
        assert path.stat().st_size == size
    finally:
        path.unlink()


# ---- finding 9: run.storage_path inside a data folder ----

@pytest.mark.parametrize("data, storage, refused", [
    ("d/train", "d/train/runs", True), ("d/train", "d/train", True), ("d/**/*.json", "d/runs", True),
    ("d/train/x.csv", "d/train/runs", False), ("d/train/*.csv", "d/train/runs", False), ("d/train", "runs", False),
])
def test_a_run_folder_a_data_path_would_read_is_refused(tmp_path, monkeypatch, data, storage, refused):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "d" / "train").mkdir(parents=True)
    (tmp_path / "d" / "train" / "x.csv").write_text("a\n1\n")
    cfg = build_config({"data": {"train_path": data, "val_path": None}, "run": {"storage_path": storage}})
    if not refused:
        check_storage_outside_data(cfg)
        return
    with pytest.raises(UsageError, match=rf"run.storage_path \({storage}\) puts the run folder .* inside "
                                         rf"data.train_path \({data.replace('*', '[*]')}\).*set run.storage_path="):
        check_storage_outside_data(cfg)


def test_the_cli_refuses_a_storage_path_inside_the_data_before_writing(tabular):
    before = digests(tabular / "data")
    r = run_cli([*TORCHRUN, f"data.train_path={tabular}/data/train", f"data.val_path={tabular}/data/val",
                 f"run.storage_path={tabular}/data/train/runs"], timeout=300)
    one_line(r, "stride: error: run.storage_path", f"inside data.train_path ({tabular}/data/train)")
    assert digests(tabular / "data") == before  # no run folder, no layout cache in the data
