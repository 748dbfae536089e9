"""Issue 23 point 6: paths a user writes are resolved where the user wrote them. A task's Config field typed Path
(or Path | None) is made absolute on the driver against its working directory, so workers whose working directory
differs (Ray, `ray job submit`) get the file the user meant; a relative run.storage_path inside a Ray job's uploaded
working directory is refused, since its results would be lost with the job's temporary copy."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from stride.errors import UsageError
from stride.trainers.config_reader import build_config, from_dict, load_config
from stride.trainers.launch.lifecycle import check_job_storage

TASK_MODULE = '''
from pathlib import Path
from stride.trainers.tasks.mlp import MLPTask


class PathTask(MLPTask):
    class Config(MLPTask.Config):
        encoder_path: Path | None = None
        vocab_path: Path = Path("vocab.txt")
'''


@pytest.fixture
def project(tmp_path, monkeypatch):
    (tmp_path / "path_task.py").write_text(TASK_MODULE)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    sys.modules.pop("path_task", None)


def test_relative_path_fields_become_absolute_against_the_load_directory(project):
    cfg = load_config(None, ["model.name=path_task:PathTask", "model.encoder_path=pretrained/enc.pt"])
    assert cfg.model.encoder_path == project / "pretrained" / "enc.pt"
    assert cfg.model.vocab_path == project / "vocab.txt"  # a relative default is the user's too


def test_absolute_and_none_paths_are_unchanged(project, tmp_path_factory):
    elsewhere = tmp_path_factory.mktemp("elsewhere") / "enc.pt"
    cfg = load_config(None, ["model.name=path_task:PathTask", f"model.encoder_path={elsewhere}"])
    assert cfg.model.encoder_path == elsewhere
    assert load_config(None, ["model.name=path_task:PathTask"]).model.encoder_path is None


def test_a_worker_elsewhere_keeps_the_drivers_absolute_path(project, tmp_path_factory, monkeypatch):
    d = build_config({"model": {"name": "path_task:PathTask", "encoder_path": "pretrained/enc.pt"}}).to_dict()
    monkeypatch.chdir(tmp_path_factory.mktemp("worker_cwd"))
    assert from_dict(d).model.encoder_path == project / "pretrained" / "enc.pt"


def _job(monkeypatch, runtime_env: dict) -> None:
    monkeypatch.setenv("RAY_JOB_CONFIG_JSON_ENV_VAR", json.dumps({"runtime_env": runtime_env}))


def test_a_relative_storage_path_in_a_ray_job_working_dir_is_refused(monkeypatch):
    _job(monkeypatch, {"working_dir": "gcs://_ray_pkg_abc.zip"})
    with pytest.raises(UsageError) as e:
        check_job_storage(build_config({"run": {"storage_path": "./runs"}}))
    msg = str(e.value)
    assert "\n" not in msg and "run.storage_path (./runs)" in msg and "absolute path on shared storage" in msg


def test_storage_path_allowed_when_absolute_or_not_in_an_uploaded_job(monkeypatch, tmp_path):
    _job(monkeypatch, {"working_dir": "gcs://_ray_pkg_abc.zip"})
    check_job_storage(build_config({"run": {"storage_path": str(tmp_path)}}))
    _job(monkeypatch, {"pip": ["x"]})  # a job without an uploaded folder runs where the user is
    check_job_storage(build_config({"run": {"storage_path": "./runs"}}))
    monkeypatch.delenv("RAY_JOB_CONFIG_JSON_ENV_VAR")
    check_job_storage(build_config({"run": {"storage_path": "./runs"}}))


def test_the_workers_search_the_drivers_working_directory_and_pythonpath(monkeypatch, tmp_path):
    """A running head's workers do not inherit the driver's PYTHONPATH (an embedded Ray's do): the folders the driver
    finds a user's module in reach every worker in STRIDE_TASK_PATH, working directory first, each once."""
    from stride.ray_cluster.connect import worker_paths
    from stride.user_code import TASK_PATH_ENV

    code, lib = tmp_path / "code", tmp_path / "lib"
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(TASK_PATH_ENV, raising=False)
    monkeypatch.setenv("PYTHONPATH", f"{code}:{lib}::{tmp_path}")
    assert worker_paths()[TASK_PATH_ENV].split(":") == [str(tmp_path), str(code), str(lib)]
