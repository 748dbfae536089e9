"""Files by reference (datasets/files.py): a JSON Lines manifest naming WAV files by relative path, read as the
examples/audio_clips task declares (`file_columns = ("path",)`), trains bitwise like the same rows as Parquet with the
bytes inline, under torchrun; a missing file is one line naming it and its manifest row, before training where it
is checked and at the step that reaches it otherwise.

The function-level tests cover resolution and the fetch; the torchrun cases run in one launch
(tests/torchrun_cases.py). The files are fetched by each worker's data stream, the same code under either launcher
(that Ray's workers train as torchrun's, bitwise, is tests/test_data_pipeline.py's), and the
example runs from its own folder with its relative manifests in tests/test_examples.py and tests/test_bucketing.py.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import PYTHON, REPO, read_jsonl, run_torchrun_cases
from runs import OVERLAY

from stride.datasets import files
from stride.datasets.order import Order
from stride.datasets.splits import DataSpec, open_split
from stride.errors import DataError
from stride.datasets.stream import TrainStream


EXAMPLE = REPO / "examples" / "audio_clips"
STEPS = 12
QUICK = [*OVERLAY, f"train.max_steps={STEPS}", "train.log_every_steps=1", "train.eval_every_steps=12",
         "checkpoint.every_steps=12", "train.batch_size_per_worker=8", "train.deterministic=true",
         "data.shuffle_window_rows=128"]


@pytest.fixture(scope="module")
def clips(tmp_path_factory) -> Path:
    """A copy of the example with 240 clips, and inline/{train,val}.parquet: the manifests' rows, in order, with
    the WAV bytes in the path column."""
    dst = tmp_path_factory.mktemp("clips") / "audio_clips"
    shutil.copytree(EXAMPLE, dst, ignore=shutil.ignore_patterns("__pycache__", "runs", "data"))
    subprocess.run([PYTHON, "prepare.py", "--clips", "240"], cwd=dst, check=True, capture_output=True, timeout=120)
    (dst / "inline").mkdir()
    for split in ("train", "val"):
        rows = [json.loads(line) for line in (dst / "data" / f"{split}.jsonl").read_text().splitlines()]
        table = pa.table({"path": pa.array([(dst / "data" / r["path"]).read_bytes() for r in rows], pa.binary()),
                          "label": [r["label"] for r in rows], "duration": [r["duration"] for r in rows]})
        pq.write_table(table, dst / "inline" / f"{split}.parquet")
    return dst


def split_spec(manifest: Path, name: str = "train") -> DataSpec:
    class Data:
        train_path = str(manifest)

    split = open_split(Data, "train")
    return DataSpec(("path", "label"), False, split.num_rows, split.layouts, split.blocks, name, ("path",), 4)


def test_relative_paths_resolve_against_the_manifests_folder_and_others_stay():
    table = pa.table({"path": ["audio/a.wav", "/abs/b.wav", "s3://bucket/c.wav", "../up/d.wav"]})
    got = files.resolve(table, ("path",), "/data/corpus/train.jsonl").column("path").to_pylist()
    assert got == ["/data/corpus/audio/a.wav", "/abs/b.wav", "s3://bucket/c.wav", "/data/corpus/../up/d.wav"]
    on_s3 = files.resolve(table.slice(0, 1), ("path",), "s3://bucket/corpus/train.jsonl").column("path").to_pylist()
    assert on_s3 == ["s3://bucket/corpus/audio/a.wav"]


def test_the_transform_gets_each_files_bytes_for_its_own_rows(clips):
    spec = split_spec(clips / "data" / "train.jsonl")
    order = Order(tuple(n for _, _, n in spec.blocks), 0, 8, 64)
    rows = [json.loads(line) for line in (clips / "data" / "train.jsonl").read_text().splitlines()]
    for rank in (0, 1):
        stream = TrainStream(spec, order, rank, 2, 0, 2, order.micro_steps_per_epoch)
        try:
            for _ in range(order.micro_steps_per_epoch):
                batch = stream.next()
                for sid, data, label in zip(batch.sample_id, batch.data["path"], batch.data["label"]):
                    assert data == (clips / "data" / rows[sid]["path"]).read_bytes() and label == rows[sid]["label"]
        finally:
            stream.close()


def test_a_missing_file_is_named_with_its_manifest_row_before_and_during_training(clips, tmp_path):
    data = tmp_path / "data"
    shutil.copytree(clips / "data", data)
    rows = (data / "train.jsonl").read_text().splitlines()
    victim = json.loads(rows[6])["path"]
    spec = split_spec(data / "train.jsonl")  # laid out while every file is there
    (data / victim).unlink()

    class Data:
        train_path = str(data / "train.jsonl")

    with pytest.raises(DataError, match=rf"data.train_path: {data / victim} \(column path, row 7 of "
                                        rf"{data / 'train.jsonl'}\) does not exist; restore it"):
        files.check_files(open_split(Data, "train"), ("path",), 4)

    # Past the check (a file deleted after it): the step that reaches the row fails with the same facts.
    order = Order(tuple(n for _, _, n in spec.blocks), 0, 8, 64)
    stream = TrainStream(spec, order, 0, 1, 0, 1, order.micro_steps_per_epoch)
    try:
        with pytest.raises(DataError, match=rf"path: {data / victim} \(row 7 of {data / 'train.jsonl'}\) could not be "
                                            rf"read .*; restore the file or remove its row from the manifest"):
            for _ in range(order.micro_steps_per_epoch):
                stream.next()
    finally:
        stream.close()


@pytest.fixture(scope="module")
def torchrun_runs(clips, tmp_path_factory):
    """One launch of 2 ranks: the manifest, the inline Parquet, and a manifest naming a missing file."""
    storage = tmp_path_factory.mktemp("clips_runs")
    broken = clips / "data" / "broken.jsonl"  # beside the others: its relative paths resolve as theirs
    broken.write_text((clips / "data" / "train.jsonl").read_text().replace("clip_00100.wav", "missing.wav"))
    base = ["--config", str(clips / "audio_clips.yaml"), f"run.storage_path={storage}", *QUICK]
    cases = [
        {"label": "jsonl", "args": [*base, "run.name=jsonl", f"data.train_path={clips}/data/train.jsonl",
                                    f"data.val_path={clips}/data/val.jsonl"]},
        {"label": "parquet", "args": [*base, "run.name=parquet", f"data.train_path={clips}/inline/train.parquet",
                                      f"data.val_path={clips}/inline/val.parquet"]},
        {"label": "missing", "args": [*base, "run.name=missing", f"data.train_path={broken}",
                                      f"data.val_path={clips}/data/val.jsonl"]},
    ]
    r, ranks = run_torchrun_cases(cases, tmp_path_factory.mktemp("clips_cases"), clips, {"PYTHONPATH": str(clips)})
    by_label = {c["label"]: c for c in ranks[0]}
    assert [c["code"] for c in ranks[0]] == [0, 0, 2], r.stdout[-3000:] + r.stderr[-3000:]
    return {"storage": storage, "cases": by_label, "broken": broken}


def outcome(run: Path) -> tuple:
    s = json.loads((run / "summary.json").read_text())
    losses = [(m["step"], m["train_loss"]) for m in read_jsonl(run / "metrics.jsonl") if "train_loss" in m]
    return s["param_checksums"], s["val_loss"], s["val_accuracy"], s["samples_seen"], losses


@pytest.mark.slow
def test_a_manifest_of_wav_files_trains_bitwise_like_parquet_with_the_bytes_inline(torchrun_runs):
    manifest, inline = (outcome(torchrun_runs["storage"] / name) for name in ("jsonl", "parquet"))
    assert len(manifest[4]) == STEPS and manifest == inline


@pytest.mark.slow
def test_a_manifest_naming_a_missing_file_exits_2_in_one_line_before_training(torchrun_runs):
    case, broken = torchrun_runs["cases"]["missing"], torchrun_runs["broken"]
    errors = [line for line in case["stderr"].splitlines() if line.startswith("stride: error:")]
    assert errors == [f"stride: error: data.train_path: {broken.parent / 'audio' / 'missing.wav'} (column path, row "
                      f"{_row_of(broken, 'missing.wav')} of {broken}) does not exist; restore it or remove its row "
                      f"from the manifest"], case["stderr"][-2000:]
    assert "Traceback" not in case["stderr"]
    assert not (torchrun_runs["storage"] / "missing" / "metrics.jsonl").exists()  # no step trained


def _row_of(manifest: Path, name: str) -> int:
    return next(i for i, line in enumerate(manifest.read_text().splitlines(), 1) if name in line)


@pytest.mark.slow
def test_the_manifests_index_is_cached_under_the_run_storage_never_beside_the_data(clips, torchrun_runs):
    assert not any(p.name.endswith(".json") for p in (clips / "data").iterdir())  # the user's folder: untouched
    assert any((torchrun_runs["storage"] / ".stride-cache" / "index").iterdir())


@pytest.mark.slow
def test_data_file_root_reaches_the_ray_workers_and_a_manifest_inside_it_trains_as_under_torchrun(
        clips, torchrun_runs, shared_ray_head, tmp_path):
    """data.file_root (issue 42) set on a Ray run: every worker rebuilds the config from the driver's dict (a key
    that failed validation there would fail the run) and checks each file it reads against the root; the manifest,
    inside it, trains on 2 Ray workers exactly as torchrun's 2 ranks did without it."""
    from conftest import run_cli

    r = run_cli(["-m", "stride", "--config", "audio_clips.yaml", f"run.storage_path={tmp_path}", *QUICK,
                 "run.name=jsonl", f"data.train_path={clips}/data/train.jsonl", f"data.val_path={clips}/data/val.jsonl",
                 f"data.file_root={clips}/data", "scaling.num_workers=2"],
                env={**shared_ray_head.env(), "PYTHONPATH": str(clips)}, cwd=clips, timeout=600)
    assert not shared_ray_head.wait_idle()
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    summary = json.loads((tmp_path / "jsonl" / "summary.json").read_text())
    assert summary["config"]["data"]["file_root"] == str(clips / "data") and summary["world_size"] == 2
    assert outcome(tmp_path / "jsonl") == outcome(torchrun_runs["storage"] / "jsonl")
