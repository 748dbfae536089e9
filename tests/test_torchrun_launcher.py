"""The torchrun launcher's face (trainers/torchrun.py), in one process: the scaling.* settings it cannot honour are
refused in one line, an error found before the gang starts is shown once (rank 0) and named in torchrun's own
failure report, and a finished run ends with the Ray driver's lines (lifecycle.report_paths) after its preflight."""

from __future__ import annotations

import json
import time

import pytest

from runs import tiny


def tabular(data, storage, *extra: str) -> list[str]:
    return tiny(storage, data, 2, "train.eval_every_steps=2", "checkpoint.every_steps=2", "model.hidden_sizes=[8]",
                *extra)


def error_lines(capsys) -> list[str]:
    return [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]


@pytest.mark.parametrize("override, line", [
    ("scaling.max_failures=3", "scaling.max_failures (3) is a Ray setting that torchrun cannot honour; use torchrun's "
                               "--max-restarts, or run on Ray"),
    ("scaling.max_failures=-1", "scaling.max_failures (-1) is a Ray setting that torchrun cannot honour; use "
                                "torchrun's --max-restarts, or run on Ray"),
    ("scaling.resize_check_s=30", "scaling.resize_check_s (30) is a Ray setting that torchrun cannot honour; use "
                                  "torchrun's elastic --nnodes MIN:MAX, or run on Ray"),
    ("scaling.hang_detector=fail", "scaling.hang_detector (fail) is a Ray setting that torchrun cannot honour; use "
                                   "train.hang_timeout_s (Stride's own watchdog, on both launchers), or run on Ray"),
])
def test_a_ray_only_scaling_setting_is_refused_under_torchrun_naming_what_to_use(override, line, tmp_path, capsys):
    from stride.trainers.launch import torchrun

    # The refusal comes before the data is read: the data paths here do not exist.
    assert torchrun.main(tabular(tmp_path / "no-data", tmp_path / "runs", override)) == 2
    assert error_lines(capsys) == [f"stride: error: {line}"]
    assert not (tmp_path / "runs").exists()


def test_cpus_per_worker_must_fit_the_nodes_cores_and_the_defaults_pass():
    from stride.errors import UsageError
    from stride.trainers.config_reader import load_config
    from stride.trainers.launch.torchrun import check_scaling

    check_scaling(load_config(None, []), local_world_size=2, cores=2)  # the defaults: 1 CPU per rank
    check_scaling(load_config(None, ["scaling.cpus_per_worker=0.5", "scaling.max_failures=0"]), 4, 2)
    with pytest.raises(UsageError) as e:
        check_scaling(load_config(None, ["scaling.cpus_per_worker=2"]), 3, 4)
    assert str(e.value) == ("--nproc-per-node (3) x scaling.cpus_per_worker (2) = 6 CPUs exceeds this node's 4 CPUs; "
                            "use scaling.cpus_per_worker=1.33")
    with pytest.raises(UsageError, match=r"exceeds this node's 2 CPUs; use --nproc-per-node 2$"):
        check_scaling(load_config(None, []), 64, 2)


class Clock:
    """time, with sleep recorded instead of slept."""

    def __init__(self):
        self.slept: list[float] = []

    def sleep(self, s: float) -> None:
        self.slept.append(s)

    def __getattr__(self, name):
        return getattr(time, name)


@pytest.mark.parametrize("rank", [0, 1])
def test_an_error_before_the_gang_is_shown_by_rank_0_and_named_in_torchruns_report(rank, tmp_path, monkeypatch,
                                                                                   capsys):
    """Every rank finds a config error before the gang starts; rank 0 shows it at once, another rank holds it back
    long enough for torchrun to end it when rank 0 exits (so the user sees it once). Each rank's error file holds the
    line, and torchrun's ChildFailedError report shows it as the failure's cause."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from stride.trainers.launch import torchrun

    error_file = tmp_path / "error.json"
    for k, v in {"RANK": rank, "LOCAL_RANK": rank, "WORLD_SIZE": 2, "LOCAL_WORLD_SIZE": 2,
                 "TORCHELASTIC_RUN_ID": "test", "TORCHELASTIC_ERROR_FILE": error_file}.items():
        monkeypatch.setenv(k, str(v))
    clock = Clock()
    monkeypatch.setattr(torchrun, "time", clock)
    assert torchrun.main(tabular(tmp_path, tmp_path / "runs", "scaling.max_failures=2")) == 2
    line = ("stride: error: scaling.max_failures (2) is a Ray setting that torchrun cannot honour; use torchrun's "
            "--max-restarts, or run on Ray")
    assert error_lines(capsys) == [line]  # rank 1 too, if torchrun has not ended it by then
    assert clock.slept == ([] if rank == 0 else [torchrun.QUIET_RANK_WAIT_S])
    assert torchrun.QUIET_RANK_WAIT_S >= 5  # rank 0 reads the same config and data in about the same time

    report = ChildFailedError("stride", {rank: ProcessFailure(rank, 1234, 2, str(error_file))}).format_msg()
    assert f"traceback : {line}" in report and "To enable traceback" not in report, report
    assert json.loads(error_file.read_text())["message"]["message"] == line


def test_an_error_in_the_gang_is_every_ranks_line_at_once(monkeypatch, capsys):
    """A refusal the ranks agreed on in the gang (a run lock, a preflight) is each rank's own line, without waiting."""
    import torch.distributed as dist

    from stride.errors import UsageError
    from stride.trainers.launch import torchrun

    for k, v in {"RANK": 1, "WORLD_SIZE": 2, "TORCHELASTIC_RUN_ID": "test"}.items():
        monkeypatch.setenv(k, str(v))
    monkeypatch.delenv("TORCHELASTIC_ERROR_FILE", raising=False)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    clock = Clock()
    monkeypatch.setattr(torchrun, "time", clock)
    torchrun.show_error(UsageError("run.name (r) is locked"))
    assert error_lines(capsys) == ["stride: error: run.name (r) is locked"] and clock.slept == []


@pytest.mark.slow
def test_a_torchrun_run_runs_its_preflight_and_ends_with_the_ray_drivers_lines(tmp_path, tabular_data, capsys):
    """scaling.preflight under torchrun: the doctor's checks on the gang's own processes (a storage they cannot write
    stops the run, exit 2, naming the check), then a run that passes them ends with the same lines as the Ray
    driver's (one function: lifecycle.report_paths)."""
    from stride.trainers.launch import torchrun

    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder\n")
    assert torchrun.main(tabular(tabular_data, blocker / "runs", "scaling.preflight=true")) == 2
    err = error_lines(capsys)
    assert err[-1].startswith("stride: error: scaling.preflight (true) failed: storage failed on node ") \
        and "create folder failed" in err[-1] and err[-1].endswith("or set scaling.preflight=false to train anyway")
    assert err[0].startswith("CHECK") and not any(ln.startswith("Traceback") for ln in err)  # the table, on stderr

    runs = tmp_path / "runs"
    assert torchrun.main(tabular(tabular_data, runs, "scaling.preflight=true")) == 0
    out = capsys.readouterr().out.splitlines()
    assert any(ln.startswith("stride: preflight passed (") for ln in out), out
    run = runs / "r"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["runtime"] == "torchrun" and summary["status"] == "completed"
    end = [ln for ln in out if ln.startswith(("stride: completed:", "stride: summary", "stride: metrics",
                                              "stride: checkpoint"))]
    assert end == [f"stride: completed: step 2 train_loss {summary['train_loss']:.4f} val_loss "
                   f"{summary['val_loss']:.4f} (untrained {summary['initial_val_loss']:.4f}) val_accuracy "
                   f"{summary['val_accuracy']:.4f}",
                   f"stride: summary     {run / 'summary.json'}",
                   f"stride: metrics     {run / 'metrics.jsonl'}",
                   f"stride: checkpoint  {run / 'checkpoint_00000002'}"], out
