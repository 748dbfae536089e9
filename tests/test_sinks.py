"""Metric sinks (trainers/sinks): metrics.jsonl and the console always, and the trackers tracking.sinks names
(MLflow, TensorBoard, W&B), each one module behind `Sink`. A resumed run continues each tracker's record; a tracker
that fails warns once and training goes on; a tracker whose package is missing is refused before the run."""

from __future__ import annotations

import json
import logging
import os
import re
import struct
import subprocess
from pathlib import Path

import pytest

from conftest import REPO, read_jsonl, run_cli_forked

# An API key as W&B's would look: it must never reach a file of the run folder.
SECRET = "stride-test-secret-" + "0123456789abcdef" * 2


def scalars(folder: Path, tag: str) -> list[tuple[int, float]]:
    """(step, value) of every `tag` event TensorBoard's own reader keeps (it applies purge_step)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder), size_guidance={"scalars": 0})
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def wandb_records(path: Path):
    """The records of a W&B run file (`run-<id>.wandb`, LevelDB's log format: 32 KiB blocks of chunks with a
    7-byte header), parsed with W&B's own protobuf schema."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, block = path.read_bytes(), 32768
    assert data[:4] == b":W&B", path
    pos, pending = 7, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        _, size, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if left < 7 or (size == 0 and kind == 0):  # the rest of a block is padding
            pos += left
            continue
        pending += data[pos + 7:pos + 7 + size]
        pos += 7 + size
        if kind in (1, 4):  # a whole record, or a record's last chunk
            record = pb.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def wandb_history(run_file: Path) -> tuple[str, list[dict]]:
    run_id, rows = None, []
    for record in wandb_records(run_file):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run_id = record.run.run_id
        elif kind == "history":
            rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                         for item in record.history.item})
    return run_id, rows


# ---- functions: the fan-out, the resume of a TensorBoard log, the pre-flight ------------------------------------

def _run_info(tmp_path: Path, resume_step: int | None):
    from stride.trainers.sinks.base import RunInfo

    return RunInfo(cfg=None, run_dir=tmp_path, resume_step=resume_step)


def test_a_resumed_tensorboard_log_drops_what_the_killed_attempt_logged_past_the_checkpoint(tmp_path):
    from stride.trainers.sinks.tensorboard_sink import FOLDER, TensorBoardSink

    first = TensorBoardSink()
    first.open(_run_info(tmp_path, None))
    for step in range(5, 35, 5):
        first.step(step, {"train_loss": 1.0})
    first.writer.flush()  # on disk, then killed: no close; the checkpoint it resumes from is step 20
    second = TensorBoardSink()
    second.open(_run_info(tmp_path, 20))
    for step in range(25, 45, 5):
        second.step(step, {"train_loss": 2.0})
    second.close("completed")
    assert len(list((tmp_path / FOLDER).iterdir())) == 2  # one event file per attempt, in the same log
    assert scalars(tmp_path / FOLDER, "train_loss") == [(s, 1.0) for s in (5, 10, 15, 20)] + [
        (s, 2.0) for s in (25, 30, 35, 40)]  # every step once, the resumed attempt's where both logged it


class _Failing:
    name, every_rank, essential, summary_fields = "flaky", False, False, ("flaky_run_id",)
    background = True  # as the trackers: on the sinks' thread

    def __init__(self):
        self.calls = 0

    def step(self, step, metrics):
        self.calls += 1
        raise OSError(28, "No space left on device")

    def state_dict(self):
        return {"run_id": "r1"}

    def summary(self):
        return {"flaky_run_id": "r1"}


class _Recorder(_Failing):
    name = "recorder"

    def step(self, step, metrics):
        self.calls += 1
        self.seen = [*getattr(self, "seen", []), step]


def test_a_failing_tracker_warns_once_in_one_line_and_the_others_go_on(caplog):
    from stride.trainers.sinks import Sinks

    flaky, other = _Failing(), _Recorder()
    sinks = Sinks([flaky, other])
    with caplog.at_level(logging.WARNING, logger="stride"):
        for step in (1, 2, 3):
            sinks.step(step, {"step": step, "train_loss": 1.0})
        sinks.flush()  # the trackers' thread has made every record handed to it
    assert flaky.calls == 1 and other.calls == 3 and other.seen == [1, 2, 3]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == ["sink flaky failed in step (OSError: [Errno 28] No space left on device); training "
                        "continues without it"]
    # its run id still reaches the checkpoint and summary.json: a resume continues the same record
    assert sinks.state_dict()["flaky"] == {"run_id": "r1"} and sinks.summary()["flaky_run_id"] == "r1"


def test_a_failing_essential_sink_ends_the_run():
    from stride.trainers.sinks import Sinks

    flaky = _Failing()
    flaky.essential, flaky.background = True, False  # metrics.jsonl: the run's own record, in the step
    with pytest.raises(OSError):
        Sinks([flaky]).step(1, {"train_loss": 1.0})


@pytest.mark.parametrize("name", ["tensorboard", "wandb"])
def test_a_tracker_whose_package_is_missing_is_refused_before_the_run(name, monkeypatch):
    import importlib.util

    from stride.trainers import sinks
    from stride.errors import ConfigError
    from stride.trainers.config_reader import build_config

    cfg = build_config({"tracking": {"sinks": ["mlflow", name]}}, origin="test")
    sinks.preflight(cfg)  # installed here (the test extra)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda mod, *a: None if mod == name else real(mod, *a))
    with pytest.raises(ConfigError) as e:
        sinks.preflight(cfg)
    assert str(e.value) == (f"tracking.sinks[1] ({name}): the {name} package is not installed; pip install "
                            f"'stride[{name}]' or take it out")


def test_tracking_mlflow_false_leaves_mlflow_out_and_its_summary_field_null(tmp_path):
    from stride.trainers.config_reader import build_config
    from stride.trainers.sinks import Sinks
    from stride.trainers.sinks.base import RunInfo

    cfg = build_config({"tracking": {"sinks": ["mlflow", "tensorboard"], "mlflow": False}}, origin="test")
    assert cfg.tracking.active_sinks() == ["tensorboard"]
    sinks = Sinks.open(RunInfo(cfg, tmp_path, None), rank0=True)
    assert [s.name for s in sinks.sinks] == ["metrics.jsonl", "console", "prometheus", "tensorboard"]
    sinks.close("completed")
    assert sinks.summary() == {"mlflow_run_id": None, "wandb_run_id": None}  # the trackers this run does not use


def test_the_launcher_says_where_each_record_is_and_how_to_view_it(tmp_path, monkeypatch):
    from stride.trainers import sinks
    from stride.trainers.config_reader import build_config

    monkeypatch.setenv("WANDB_MODE", "offline")
    cfg = build_config({"run": {"storage_path": str(tmp_path), "name": "r"},
                        "tracking": {"sinks": ["mlflow", "tensorboard", "wandb"]}}, origin="test")
    run = tmp_path / "r"
    assert sinks.where(cfg, {"mlflow_run_id": "m1", "wandb_run_id": "w1"}) == [
        f"mlflow      run m1 in sqlite:///{tmp_path}/mlflow.db  (view: mlflow ui --backend-store-uri "
        f"sqlite:///{tmp_path}/mlflow.db)",
        f"tensorboard {run}/tensorboard  (view: tensorboard --logdir {run}/tensorboard)",
        f"wandb       run w1 (offline) in {run}/wandb  (upload: wandb sync {run}/wandb/offline-run-*)"]


def test_the_loop_and_the_launchers_name_no_sink():
    """A sink is one module behind Sink: the code that runs a training names none of them."""
    names = re.compile(r"mlflow|tensorboard|wandb", re.IGNORECASE)
    for path in ("trainers/loop.py", "trainers/launch/ray.py", "trainers/main.py", "trainers/torchrun.py",
                 "trainers/launch/ray_worker.py", "trainers/telemetry.py", "trainers/step.py"):
        hits = [ln for ln in (REPO / path).read_text().splitlines() if names.search(ln)]
        assert not hits, (path, hits)


# ---- one process: a run with TensorBoard and W&B offline, resumed ---------------------------------------------

def _train(tmp_path: Path, data: Path, steps: int, *extra: str) -> subprocess.CompletedProcess:
    env = dict(WANDB_MODE="offline", WANDB_API_KEY=SECRET, WANDB_DIR=str(tmp_path / "wandb-home"),
               WANDB_CONFIG_DIR=str(tmp_path / "wandb-config"), WANDB_CACHE_DIR=str(tmp_path / "wandb-cache"))
    return run_cli_forked(
        ["trainers/torchrun.py", "--config", "trainers/configs/tabular_mlp.yaml",
         f"data.train_path={data}/train", f"data.val_path={data}/val", f"run.storage_path={tmp_path}/runs",
         "train.epochs=null", f"train.max_steps={steps}", "train.log_every_steps=5", "train.eval_every_steps=10",
         "checkpoint.every_steps=10", "model.hidden_sizes=[32]", *extra], env=env, timeout=300)


@pytest.mark.slow
def test_tensorboard_and_wandb_offline_continue_one_record_across_a_resume(tmp_path, tabular_data):
    sinks = "tracking.sinks=[mlflow,tensorboard,wandb]"
    first = _train(tmp_path, tabular_data, 20, sinks, "tracking.wandb_tags=[smoke]")
    assert first.returncode == 0, first.stderr[-3000:]
    run = tmp_path / "runs" / "tabular_mlp"
    run_id = json.loads((run / "summary.json").read_text())["wandb_run_id"]
    second = _train(tmp_path, tabular_data, 40, sinks, "tracking.wandb_tags=[smoke]")
    assert second.returncode == 0, second.stderr[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["restarts"] == 1 and summary["global_step"] == 40 and summary["mlflow_run_id"]
    assert summary["wandb_run_id"] == run_id  # the same W&B run, continued
    assert f"stride: wandb       run {run_id} (offline) in {run / 'wandb'}" in second.stdout

    logged = [r["step"] for r in read_jsonl(run / "metrics.jsonl") if "train_loss" in r]
    assert logged == list(range(5, 45, 5))
    assert [s for s, _ in scalars(run / "tensorboard", "train_loss")] == logged
    assert [s for s, _ in scalars(run / "tensorboard", "val_loss")] == [10, 20, 30, 40]

    attempts = sorted((run / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(attempts) == 2
    steps = []
    for path in attempts:
        rid, rows = wandb_history(path)
        assert rid == run_id
        steps += [r["_step"] for r in rows if "train_loss" in r]
    assert steps == logged
    # The key W&B reads from the environment is nowhere in the run folder.
    for path in run.rglob("*"):
        if path.is_file() and not path.is_symlink():
            assert SECRET.encode() not in path.read_bytes(), path


@pytest.mark.slow
def test_an_unwritable_tensorboard_folder_warns_once_and_the_run_completes(tmp_path, tabular_data):
    run = tmp_path / "runs" / "tabular_mlp"
    run.mkdir(parents=True)
    (run / "tensorboard").write_text("a file where the event folder goes")
    r = _train(tmp_path, tabular_data, 10, "tracking.sinks=[tensorboard]")
    assert r.returncode == 0, r.stderr[-3000:]
    warned = [ln for ln in (r.stdout + r.stderr).splitlines() if "sink tensorboard failed" in ln]
    assert len(warned) == 1 and "training continues without it" in warned[0], warned
    assert [x["step"] for x in read_jsonl(run / "metrics.jsonl") if "train_loss" in x] == [5, 10]
