"""Sinks as plugins (trainers/sinks): `tracking.sinks` takes a user's own `stride.Sink` as "module:Class" (or
{"module:Class": {its settings}}), found as a user's task or callback is: the working directory, PYTHONPATH, and on
Ray workers the launcher's folders (STRIDE_TASK_PATH). A mistake is one line naming tracking.sinks[i], before any
worker starts. A sweep asks each of its trackers to open the sweep's record: a sweep without MLflow opens no MLflow
run."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import REPO, read_jsonl, run_cli, run_cli_forked
from stride.errors import ConfigError

# The user's module: records every step it is handed, and where it ran, in a file its settings name.
USER_SINK = '''
import json
import os
import sys

from pydantic import Field

from stride import Sink
from stride.trainers.sinks import SinkSettings


class RecorderSettings(SinkSettings):
    file: str = Field("recorded.jsonl", description="where, in the run folder, the steps go")
    tag: str = "x"


class StepRecorder(Sink):
    Settings = RecorderSettings

    def open(self, run):
        self.out = open(run.run_dir / self.settings.file, "a")
        self._write({"event": "open", "name": self.name, "tag": self.settings.tag, "pid": os.getpid(),
                     "task_path": os.environ.get("STRIDE_TASK_PATH", ""), "module": __file__})

    def _write(self, record):
        self.out.write(json.dumps(record) + "\\n")
        self.out.flush()

    def step(self, step, metrics):
        self._write({"step": step, "keys": sorted(metrics)})

    def close(self, status):
        self._write({"event": "close", "status": status})
        self.out.close()


class NotASink:
    pass
'''


@pytest.fixture
def user_folder(tmp_path, monkeypatch):
    """The user's folder, holding my_sinks.py, as the working directory; its module forgotten afterwards."""
    folder = tmp_path / "project"
    folder.mkdir()
    (folder / "my_sinks.py").write_text(USER_SINK)
    monkeypatch.chdir(folder)
    yield folder
    sys.modules.pop("my_sinks", None)
    if str(folder) in sys.path:
        sys.path.remove(str(folder))


def _cfg(*sinks, **tracking):
    from stride.trainers.config_reader import build_config

    return build_config({"tracking": {"sinks": list(sinks), **tracking}}, origin="test")


def _refusal(cfg) -> str:
    from stride.trainers import sinks

    with pytest.raises(ConfigError) as e:
        sinks.preflight(cfg)
    assert "\n" not in str(e.value)
    return str(e.value)


# ---- functions: the refusals, each one line naming tracking.sinks[i] --------------------------------------------

def test_a_module_that_is_not_importable_is_refused_naming_the_entry(user_folder):
    assert _refusal(_cfg("mlflow", "no_such_sinks:Recorder")).startswith(
        "tracking.sinks[1] (no_such_sinks:Recorder): module no_such_sinks is not importable; put no_such_sinks.py "
        "in the working directory")


def test_a_class_the_module_lacks_is_refused(user_folder):
    assert _refusal(_cfg("my_sinks:Missing")).startswith(
        "tracking.sinks[0] (my_sinks:Missing): module my_sinks has no Missing")


def test_a_class_that_is_not_a_sink_is_refused(user_folder):
    assert _refusal(_cfg("tensorboard", "my_sinks:NotASink")) == (
        "tracking.sinks[1] (my_sinks:NotASink): NotASink is not a stride.Sink; name a subclass of stride.Sink")


def test_a_sink_listed_twice_is_refused(user_folder):
    # the same words twice: the config refuses it
    from stride.trainers.config_reader import build_config

    with pytest.raises(ConfigError, match=r"names a sink twice: tracking.sinks\[2\] \(my_sinks:StepRecorder\) "
                                          r"repeats tracking.sinks\[0\]"):
        build_config({"tracking": {"sinks": ["my_sinks:StepRecorder", "mlflow", {"my_sinks:StepRecorder": None}]}})
    # the same class under two names: the pre-flight check refuses it
    assert _refusal(_cfg("wandb", "stride.trainers.sinks.wandb_sink:WandbSink")) == (
        "tracking.sinks[1] (stride.trainers.sinks.wandb_sink:WandbSink) is the sink tracking.sinks[0] (wandb) names "
        "already; list each sink once")


def test_an_entry_neither_built_in_nor_module_class_is_refused_by_the_config():
    from stride.trainers.config_reader import build_config

    with pytest.raises(ConfigError, match=r"^tracking.sinks \(\['mlflow', 'my sinks'\]\) must be one of 'mlflow', "
                                          r"'tensorboard' or 'wandb', or \"module:Class\""):
        build_config({"tracking": {"sinks": ["mlflow", "my sinks"]}})
    with pytest.raises(ConfigError, match=r"gives settings to the built-in sink wandb \(tracking.sinks\[0\]\); set "
                                          r"its tracking.\* keys instead"):
        build_config({"tracking": {"sinks": [{"wandb": {"wandb_mode": "offline"}}]}})


def test_a_users_sink_settings_are_checked_against_its_own_settings(user_folder):
    assert _refusal(_cfg({"my_sinks:StepRecorder": {"colour": "red"}})) == (
        "tracking.sinks[0] (my_sinks:StepRecorder): colour is not a setting of StepRecorder (its settings: file, "
        "tag); give only those")
    assert _refusal(_cfg({"my_sinks:StepRecorder": {"file": ["a"]}})) == (
        "tracking.sinks[0] (my_sinks:StepRecorder): file (['a']) Input should be a valid string")


def test_a_users_sink_gets_its_settings_and_its_entry_as_its_name(user_folder, tmp_path):
    from stride.trainers.sinks import Sinks
    from stride.trainers.sinks.base import RunInfo

    cfg = _cfg("tensorboard", {"my_sinks:StepRecorder": {"file": "mine.jsonl", "tag": "t1"}})
    from stride.trainers import sinks as run_sinks

    run_sinks.preflight(cfg)
    opened = Sinks.open(RunInfo(cfg, tmp_path, None), rank0=True)
    assert [s.name for s in opened.sinks] == ["metrics.jsonl", "console", "prometheus", "tensorboard",
                                               "my_sinks:StepRecorder"]
    for step in (5, 10):
        opened.step(step, {"step": step, "train_loss": 1.0})
    opened.close("completed")
    records = read_jsonl(tmp_path / "mine.jsonl")
    assert records[0]["tag"] == "t1" and records[0]["name"] == "my_sinks:StepRecorder"
    assert [r["step"] for r in records if "step" in r] == [5, 10] and records[-1] == {"event": "close",
                                                                                      "status": "completed"}
    # the built-in trackers this run does not use still fill their summary fields with None
    assert opened.summary() == {"mlflow_run_id": None, "wandb_run_id": None}


def test_each_built_in_trackers_settings_are_its_own_and_keep_their_keys():
    from stride.trainers.config import TrackingSection
    from stride.trainers.sinks import builtin

    assert list(builtin()) == ["mlflow", "tensorboard", "wandb"]
    assert list(builtin()["mlflow"].Settings.model_fields) == ["mlflow", "mlflow_uri", "experiment"]
    assert list(builtin()["wandb"].Settings.model_fields) == ["wandb_project", "wandb_entity", "wandb_tags",
                                                              "wandb_mode"]
    assert list(TrackingSection.model_fields) == ["sinks", "mlflow", "mlflow_uri", "experiment", "wandb_project",
                                                  "wandb_entity", "wandb_tags", "wandb_mode"]


def test_a_bad_sink_exits_2_in_one_line_before_any_worker_starts(tmp_path, tabular_data):
    r = run_cli_forked(["-m", "stride", "--config", str(REPO / "trainers" / "configs" / "tabular_mlp.yaml"),
                        f"data.train_path={tabular_data}/train", f"data.val_path={tabular_data}/val",
                        f"run.storage_path={tmp_path}/runs", "tracking.sinks=[mlflow, 'no_such_sinks:Recorder']"],
                       cwd=tmp_path, timeout=120)
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "tracking.sinks[1] (no_such_sinks:Recorder): module no_such_sinks is not " \
                               "importable" in lines[0], r.stderr
    assert not (tmp_path / "runs" / "tabular_mlp" / "metrics.jsonl").exists()


# ---- 2 Ray workers: the user's sink, found on the workers through STRIDE_TASK_PATH --------------------------------

@pytest.mark.slow
def test_a_users_sink_receives_every_logged_step_on_two_ray_workers(tmp_path, tabular_data, ray_cluster):
    project = tmp_path / "project"
    project.mkdir()
    (project / "my_sinks.py").write_text(USER_SINK)
    # No PYTHONPATH: the module is in the launcher's working directory only, which the workers get as STRIDE_TASK_PATH.
    env = {k: v for k, v in ray_cluster.items() if k != "PYTHONPATH"}
    r = run_cli(["-m", "stride", "--config", str(REPO / "trainers" / "configs" / "tabular_mlp.yaml"),
                 f"data.train_path={tabular_data}/train", f"data.val_path={tabular_data}/val",
                 f"run.storage_path={tmp_path}/runs", "train.epochs=null", "train.max_steps=20",
                 "train.log_every_steps=5", "train.eval_every_steps=10", "checkpoint.every_steps=10",
                 "model.hidden_sizes=[32]", "scaling.num_workers=2",
                 'tracking.sinks=[{"my_sinks:StepRecorder": {file: got.jsonl, tag: ray}}]'],
                env=env, cwd=project, timeout=480)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    run = tmp_path / "runs" / "tabular_mlp"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["world_size"] == 2 and summary["global_step"] == 20
    assert "mlflow_run_id" in summary and summary["mlflow_run_id"] is None  # MLflow is not in tracking.sinks
    assert not (tmp_path / "runs" / "mlflow.db").exists()

    got = read_jsonl(run / "got.jsonl")
    opened = [x for x in got if x.get("event") == "open"]
    assert len(opened) == 1, opened  # rank 0's copy only (a tracker is not every_rank)
    assert opened[0]["tag"] == "ray" and opened[0]["name"] == "my_sinks:StepRecorder"
    assert str(project) in opened[0]["task_path"].split(":")  # a Ray worker, finding the module through it
    assert Path(opened[0]["module"]).resolve() == (project / "my_sinks.py").resolve()
    # metrics.jsonl has a line for the training figures and one for an evaluation; a sink gets each step once
    logged = list(dict.fromkeys(x["step"] for x in read_jsonl(run / "metrics.jsonl") if "step" in x))
    assert logged == [5, 10, 15, 20] and [x["step"] for x in got if "step" in x] == logged
    keys = {x["step"]: set(x["keys"]) for x in got if "step" in x}
    assert all("train_loss" in keys[s] for s in logged) and {s for s in logged if "val_loss" in keys[s]} == {10, 20}
    assert got[-1] == {"event": "close", "status": "completed"}


# ---- a sweep without MLflow opens no MLflow run ------------------------------------------------------------------

@pytest.mark.slow
def test_a_sweep_without_mlflow_opens_no_mlflow_run(tmp_path, tabular_data, ray_cluster):
    from tune_fixtures import write_sweep

    storage = tmp_path / "runs"
    write_sweep(tmp_path / "tb.yaml", tabular_data, storage,
                sweep={"name": "tb", "search": "grid", "num_samples": 1, "scheduler": "fifo"},
                base={"train.max_steps": 10, "tracking.sinks": ["tensorboard"]},
                space={"optim.lr": {"grid": [0.03]}})
    r = run_cli([str(REPO / "tune" / "main.py"), "--config", "tb.yaml"], timeout=480, env=ray_cluster, cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    sweep_dir = storage / "tb"
    summary = json.loads((sweep_dir / "sweep_summary.json").read_text())
    (trial,) = summary["trials"]
    assert summary["status"] == "completed" and trial["status"] == "completed" and trial["steps"] == 10
    assert (sweep_dir / trial["trial_id"] / "tensorboard").is_dir()  # the trial recorded to its tracker
    # No MLflow store, parent run or child run anywhere; nothing says there is one.
    assert not [p for p in tmp_path.rglob("*") if "mlflow" in p.name or p.name == "mlartifacts"]
    state = json.loads((sweep_dir / "stride_sweep.json").read_text())
    for record in (summary, state, trial):
        assert not [k for k in record if "mlflow" in k], record.keys()
    assert not [ln for ln in r.stdout.splitlines() if ln.startswith("stride: mlflow")]
    assert json.loads((sweep_dir / trial["trial_id"] / "summary.json").read_text())["mlflow_run_id"] is None


def test_the_sweep_driver_names_no_sink():
    """The sweep's record is its trackers' business: tune/main.py opens, closes and prints none by name."""
    text = textwrap.dedent((REPO / "tune" / "main.py").read_text())
    code = [ln for ln in text.splitlines() if not ln.lstrip().startswith("#")]
    assert not [ln for ln in code if "import mlflow" in ln or "mlflow_sink" in ln or "MlflowClient" in ln]
