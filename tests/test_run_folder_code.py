"""No code a run folder names runs without the user's consent (issue 27, point 4), and smaller inputs of point 6 that
are checked function by function: a task module that exits at import, a Unicode run.name in Ray's metric tags,
damaged Parquet pages, a worker's DataError."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import PYTHON, run_cli, run_cli_forked
from stride.errors import ConfigError

PLANTED = "import pathlib\npathlib.Path({marker!r}).write_text('ran')\n"


def _tampered_run(tmp_path: Path, name: str = "planted:Task") -> tuple[Path, Path]:
    """A run folder whose summary.json names `name`, with planted.py beside it (the run folder's parent) and in
    the working directory the command runs in; returns (run folder, the file the module writes when it runs)."""
    marker = tmp_path / "pwned"
    run = tmp_path / "runs" / "victim"
    run.mkdir(parents=True)
    (run / "summary.json").write_text(json.dumps({"config": {"model": {"name": name}}, "facts": {}}))
    for folder in (tmp_path / "runs", tmp_path):
        (folder / "planted.py").write_text(PLANTED.format(marker=str(marker)))
    return run, marker


def _one_line(r, code: int = 2) -> str:
    lines = r.stderr.strip().splitlines()
    assert r.returncode == code and len(lines) == 1 and "Traceback" not in r.stderr, (r.returncode, r.stderr[-2000:])
    return lines[0]


@pytest.mark.slow
@pytest.mark.parametrize("how", ["executable", "module"])
def test_generate_imports_no_module_a_run_folder_names_without_consent(tmp_path, how):
    run, marker = _tampered_run(tmp_path)
    # `python -m` puts the working directory first on sys.path: here it holds planted.py, and so does the run's parent.
    cmd = ["-m", "stride", "generate"] if how == "module" else [str(Path(PYTHON).with_name("stride")), "generate"]
    for cwd in (tmp_path, tmp_path / "runs"):
        line = _one_line(run_cli([*cmd, "--run", str(run)], cwd=cwd, timeout=120))
        assert "model.name (planted:Task)" in line and "--task planted:Task" in line and "--trust-remote-code" in line
        assert str(run / "summary.json") in line
        assert not marker.exists(), "the planted module ran"
    # Consent to another task than the run's is no consent.
    line = _one_line(run_cli([*cmd, "--run", str(run), "--task", "mine:Task"], cwd=tmp_path, timeout=120))
    assert "--task (mine:Task) is not the task" in line and "model.name (planted:Task)" in line
    # With consent (the same name, or --trust-remote-code) the module is imported from PYTHONPATH, not the cwd: the
    # flags are what opened the gate.
    line = _one_line(run_cli([*cmd, "--run", str(run), "--task", "planted:Task"], cwd=tmp_path, timeout=120))
    assert "module planted is not importable" in line and "working directory" not in line and not marker.exists()
    line = _one_line(run_cli([*cmd, "--run", str(run), "--trust-remote-code"], cwd=tmp_path, timeout=120,
                             env={"PYTHONPATH": str(tmp_path / "runs")}))
    assert marker.exists() and "planted has no Task" in line


def test_generate_needs_no_consent_for_a_built_in_task(tmp_path):
    run, marker = _tampered_run(tmp_path, "mlp")
    line = _one_line(run_cli_forked(["-m", "stride", "generate", "--run", str(run)], timeout=120))
    assert "has no complete checkpoint" in line and not marker.exists()


def test_export_imports_no_task_module():
    r = run_cli(["-m", "stride", "export", "/nonexistent", "/tmp/x.safetensors"], timeout=120)
    assert r.returncode == 2, r.stderr
    r = run_cli(["-c", "import sys, stride.trainers.commands.export; print(sorted(m for m in sys.modules if m.startswith('stride.trainers.task')))"],
                timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "[]", (r.stdout, r.stderr)


@pytest.mark.parametrize("body, says", [
    ("import sys\nsys.exit(0)\n", "called sys.exit(0) while being imported"),
    ("raise SystemExit('bye')\n", "called sys.exit('bye') while being imported"),
    ("raise KeyboardInterrupt\n", "raised KeyboardInterrupt while being imported"),
])
def test_a_task_module_that_exits_at_import_is_a_config_error(tmp_path, monkeypatch, body, says):
    from stride.trainers.tasks import task_class

    name = f"exits_{abs(hash(body))}"
    (tmp_path / f"{name}.py").write_text(body)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError, match=rf"^model.name \({name}:Task\): module {name} " + says.replace("(", r"\(").replace(")", r"\)")):
        task_class(f"{name}:Task")


def test_unicode_run_name_is_a_metric_tag_ray_accepts():
    """Ray's gauges encode tag values as ASCII when they record (ray._raylet.Metric.record, no cluster needed)."""
    from urllib.parse import unquote

    from ray.util.metrics import Gauge

    from stride.trainers.telemetry import Gauges, tag_value

    name = "lauf-größe-日本 100%"
    assert tag_value(name).isascii() and unquote(tag_value(name)) == name and tag_value("plain_run-1") == "plain_run-1"
    with pytest.raises(UnicodeEncodeError):  # what failed every record before
        Gauge("stride_test_raw", tag_keys=("run",)).set(1.0, tags={"run": name})
    Gauges(name, 0).record({"train_loss": 1.0, "lr": 0.1})


def test_ray_trains_own_metrics_are_off_for_a_unicode_run_name(monkeypatch):
    """Ray Train tags its metrics with the run name: they would fail the same way, so the driver turns them off."""
    from ray._private.ray_constants import env_bool
    from ray.train.v2._internal.constants import METRICS_ENABLED_ENV_VAR
    from ray.train.v2._internal.metrics.controller import ControllerMetrics

    from stride.trainers.launch.ray import ray_train_metrics_for

    with pytest.raises(UnicodeEncodeError):
        metrics = ControllerMetrics.get_controller_metrics("lauf-größe-日本", "id")
        metrics[ControllerMetrics.WORKER_GROUP_START_TOTAL_TIME_S].record(1.0)
    monkeypatch.delenv(METRICS_ENABLED_ENV_VAR, raising=False)
    ray_train_metrics_for("ascii_run")
    assert env_bool(METRICS_ENABLED_ENV_VAR, True)
    ray_train_metrics_for("lauf-größe-日本")
    assert not env_bool(METRICS_ENABLED_ENV_VAR, True)


def corrupt_pages(path: Path) -> None:
    """Overwrite most of the first row group's column chunks: the footer still reads, the pages do not."""
    import pyarrow.parquet as pq

    group = pq.read_metadata(path).row_group(0)
    data = bytearray(path.read_bytes())
    for c in range(group.num_columns):
        col = group.column(c)
        start = col.dictionary_page_offset if col.has_dictionary_page else col.data_page_offset
        data[start + col.total_compressed_size // 4: start + col.total_compressed_size - 4] = \
            b"\xa5" * (col.total_compressed_size - 4 - col.total_compressed_size // 4)
    path.write_bytes(bytes(data))


def test_damaged_parquet_pages_are_a_data_error_naming_the_file(tmp_path):
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from stride.datasets.splits import open_split, read_files
    from stride.errors import DataError

    (tmp_path / "train").mkdir()
    f = tmp_path / "train" / "part-0.parquet"
    pq.write_table(pa.table({"x": np.arange(5000, dtype=np.float32), "label": np.arange(5000) % 3}), f)
    corrupt_pages(f)

    class Data:
        train_path = str(tmp_path / "train")

    split = open_split(Data, "train")  # the footer is fine: files, schema and row counts are read
    for read in (lambda: list(split.batches()), split.read, lambda: read_files([str(f)])):
        with pytest.raises(DataError, match=rf"{f} could not be read .*the file is damaged"):
            read()


def test_a_workers_data_error_is_recognised_through_rays_wrapping():
    from ray.exceptions import RayTaskError
    from ray.train import WorkerGroupError

    from stride.errors import DataError
    from stride.trainers.launch.ray import _worker_data_error

    try:
        raise DataError("data.train_path: f.parquet could not be read")
    except DataError as e:
        wrapped = RayTaskError("train_fn", "Traceback ...", e).as_instanceof_cause()
    assert _worker_data_error(WorkerGroupError("failed", {0: wrapped}))
    assert not _worker_data_error(WorkerGroupError("failed", {0: RuntimeError("boom")}))
