"""The loop in one process (no Ray, no process group): trains, writes metrics, checkpoints and resumes."""

import json

import pytest

from conftest import read_jsonl
from runs import launch, losses, tiny
from stride.trainers.run import checkpointing
from stride.trainers.run.retention import complete_checkpoints


def test_one_process_loop_trains_checkpoints_and_resumes(tmp_path, tabular_data):
    cadence = ["train.log_every_steps=5", "train.eval_every_steps=15", "checkpoint.every_steps=10",
               "checkpoint.keep_last=2"]
    assert launch.in_process(tiny(tmp_path, tabular_data, 30, *cadence, name="one")) == 0
    run = tmp_path / "one"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["global_step"] == 30 and summary["world_size"] == 1
    assert summary["val_loss"] < summary["initial_val_loss"]
    logs = [r for r in read_jsonl(run / "metrics.jsonl") if "train_loss" in r]
    assert [r["step"] for r in logs] == [5, 10, 15, 20, 25, 30]
    timing = {"step_time_s", "data_wait_s", "data_wait_fraction"}
    assert set(logs[0]) == {"step", "epoch", "samples_seen", "train_loss", "lr", "samples_per_second", "grad_norm",
                            "clipped", "straggler_ratio", "goodput"} | timing
    assert all(r["grad_norm"] > 0 and 0 <= r["clipped"] <= 1 for r in logs)
    assert all(r["straggler_ratio"] == 1.0 for r in logs)  # one rank: it is its own median
    assert all(0 < r["goodput"] < 1 for r in logs)
    for r in logs:
        assert r["step_time_s"] > 0 and 0 < r["data_wait_s"] < r["step_time_s"] and 0 < r["data_wait_fraction"] < 1
        assert "mfu" not in r and "tokens_per_second" not in r  # CPU without train.peak_flops; tabular
    # A checkpoint's blocking time appears on the first log line after it (checkpoints at 10, 20, 30).
    assert [r["step"] for r in logs if "checkpoint_blocked_s" in r] == [15, 25]
    assert all(r["checkpoint_blocked_s"] > 0 for r in logs if "checkpoint_blocked_s" in r)
    evals = [r for r in read_jsonl(run / "metrics.jsonl") if "val_loss" in r]
    assert [r["step"] for r in evals] == [15, 30] and evals[0]["val_accuracy"] is not None
    ckpts = complete_checkpoints(run)
    assert [checkpointing.read_meta(c)["step"] for c in ckpts] == [20, 30]  # keep_last=2
    assert all(checkpointing.verify(c) is None for c in ckpts)

    # Same run name, higher max_steps: resumes at step 30 and continues metrics.jsonl from there.
    assert launch.in_process(tiny(tmp_path, tabular_data, 40, *cadence, name="one")) == 0
    summary = json.loads((run / "summary.json").read_text())
    assert summary["global_step"] == 40 and summary["restarts"] == 1
    steps = [r["step"] for r in read_jsonl(run / "metrics.jsonl") if "train_loss" in r]
    assert steps == [5, 10, 15, 20, 25, 30, 35, 40]


def _args(tmp_path, data, steps, *extra):
    return tiny(tmp_path, data, steps, "train.log_every_steps=5", "train.eval_every_steps=100",
                "checkpoint.every_steps=10", "checkpoint.keep_last=3", *extra)


def test_torn_newest_checkpoint_falls_back_to_the_previous_one(tmp_path, tabular_data, capsys):
    assert launch.in_process(_args(tmp_path, tabular_data, 30)) == 0
    newest = complete_checkpoints(tmp_path / "r")[-1]
    assert checkpointing.read_meta(newest)["step"] == 30
    state = newest / "__0_0.distcp"
    state.write_bytes(state.read_bytes()[: state.stat().st_size // 2])  # a torn write
    assert "digest" in checkpointing.verify(newest)
    capsys.readouterr()
    assert launch.in_process(_args(tmp_path, tabular_data, 40)) == 0
    warnings = [ln for ln in capsys.readouterr().out.splitlines() if "unusable" in ln]
    assert len(warnings) == 1 and warnings[0].startswith("stride: warning: "), warnings  # one line, naming both folders
    assert f"checkpoint {newest.name} (__0_0.distcp does not match the digest" in warnings[0]
    assert "resuming from checkpoint_00000020 instead" in warnings[0]
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert summary["global_step"] == 40 and summary["restarts"] == 1
    steps = [r["step"] for r in read_jsonl(tmp_path / "r" / "metrics.jsonl") if "train_loss" in r]
    assert steps == [5, 10, 15, 20, 25, 30, 35, 40]  # resumed at 20: 25 and 30 were rewritten, not duplicated


def _error_line(capsys) -> str:
    """The one line a failed run leaves on stderr (exit 1), without a traceback."""
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    lines = [ln for ln in err.splitlines() if ln.startswith("stride: error: ")]
    assert len(lines) == 1, err
    return lines[0]


def test_out_of_memory_names_the_fixes(tmp_path, tabular_data, monkeypatch, capsys):
    import torch

    import stride.trainers.loop as loop

    def oom(*_a, **_k):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(loop, "train_step", oom)
    capsys.readouterr()
    assert launch.in_process(_args(tmp_path, tabular_data, 10)) == 1
    msg = _error_line(capsys)
    assert "out of memory at step 1" in msg
    for fix in ("train.batch_size_per_worker", "train.grad_accum_steps", "bf16", "fsdp"):
        assert fix in msg


def test_non_finite_steps_stop_the_run_and_keep_the_last_good_checkpoint(tmp_path, tabular_data, monkeypatch, capsys):
    import re

    import stride.trainers.loop as loop
    import torch

    from stride.trainers.step import StepResult

    real = loop.train_step
    calls = {"n": 0}

    def nan_after_12(*a, **k):
        calls["n"] += 1
        r = real(*a, **k)
        return r if calls["n"] <= 12 else StepResult(torch.tensor(float("nan")), torch.tensor(float("nan")),
                                                      torch.tensor(False))

    monkeypatch.setattr(loop, "train_step", nan_after_12)
    capsys.readouterr()
    assert launch.in_process(_args(tmp_path, tabular_data, 40, "train.max_nonfinite_steps=3")) == 1
    assert re.search("non-finite .* at step 15.*3 in a row", _error_line(capsys))
    ckpts = complete_checkpoints(tmp_path / "r")
    assert [checkpointing.read_meta(c)["step"] for c in ckpts] == [10]
    assert checkpointing.verify(ckpts[0]) is None

    calls["n"] = 0
    assert launch.in_process(_args(tmp_path, tabular_data, 40, "train.nonfinite=stop", "run.name=s")) == 1
    assert re.search(r"at step 13 .*, 1 in a row", _error_line(capsys))


def test_profile_steps_write_a_chrome_trace_with_the_step_ops_and_mfu_with_known_peak(tmp_path, tabular_data):
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    assert launch.in_process(_args(tmp_path, tabular_data, 10, "train.profile_steps=[3,4]", "train.peak_flops=1e11",
                                   "tracking.mlflow=true", f"tracking.mlflow_uri={uri}")) == 0
    from mlflow.tracking import MlflowClient

    run_id = json.loads((tmp_path / "r" / "summary.json").read_text())["mlflow_run_id"]
    assert [a.path for a in MlflowClient(uri).list_artifacts(run_id, "profile")] == ["profile/rank0.json"]
    trace = json.loads((tmp_path / "r" / "profile" / "rank0.json").read_text())
    names = {e.get("name") for e in trace["traceEvents"]}
    assert {"aten::addmm", "Optimizer.step#AdamW.step"} <= names, sorted(n for n in names if n)[:50]
    logs = [r for r in read_jsonl(tmp_path / "r" / "metrics.jsonl") if "train_loss" in r]
    assert all(0 < r["mfu"] < 1 for r in logs)


def test_transient_storage_errors_are_retried_and_a_broken_storage_names_the_path(tmp_path, tabular_data, monkeypatch,
                                                                                 capsys):
    import re

    from torch.distributed.checkpoint import FileSystemWriter

    real_write, calls = FileSystemWriter.write_data, []

    def flaky(self, plan, planner):  # the first two attempts at each checkpoint's files hit a storage error
        calls.append(self.path)
        if len(calls) % 3 != 0:
            raise OSError(5, "Input/output error")
        return real_write(self, plan, planner)

    monkeypatch.setattr(FileSystemWriter, "write_data", flaky)
    monkeypatch.setattr("time.sleep", lambda s: None)  # the backoff itself is not under test
    assert launch.in_process(_args(tmp_path, tabular_data, 20)) == 0
    assert [checkpointing.read_meta(c)["step"] for c in complete_checkpoints(tmp_path / "r")] == [10, 20]
    assert len(calls) == 6

    def broken(self, plan, planner):
        calls.append(self.path)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(FileSystemWriter, "write_data", broken)
    calls.clear()
    capsys.readouterr()
    assert launch.in_process(_args(tmp_path, tabular_data, 40)) == 1
    # A full disk is not retried (it stays full): one attempt, and the line says what the rerun resumes from.
    assert re.search(r"checkpoint checkpoint_00000030 could not be written \(No space left on device\); the last "
                     r"complete checkpoint is \S+/r/checkpoint_00000020: free space and rerun", _error_line(capsys))
    assert len(calls) == 1
    # The checkpoints written before are still there and intact.
    assert all(checkpointing.verify(c) is None for c in complete_checkpoints(tmp_path / "r"))


def test_dropout_resumes_bitwise_without_saved_rng_state(tmp_path, tabular_data, monkeypatch):
    """Dropout draws from a stream reseeded at every step from (seed, rank, step): a run stopped between two
    checkpoints and resumed draws the same masks as one never stopped, so every later loss is bitwise equal."""
    from stride.trainers import policies

    dropout = ["model.dropout=0.3", "train.deterministic=true"]
    assert launch.in_process(_args(tmp_path / "ref", tabular_data, 30, *dropout)) == 0
    assert launch.in_process(_args(tmp_path / "nodrop", tabular_data, 30, "train.deterministic=true")) == 0
    assert losses(tmp_path / "ref" / "r")[30] != losses(tmp_path / "nodrop" / "r")[30]  # the masks matter

    calls = {"n": 0}
    requested = policies.StopRequest.requested

    def sigterm_at_step_17(self):  # what the driver's SIGTERM handler does, at a known step
        calls["n"] += 1
        if calls["n"] == 17:
            policies.request_stop(tmp_path / "cut" / "r", "interrupted", 15)
        return requested(self)

    monkeypatch.setattr(policies.StopRequest, "requested", sigterm_at_step_17)
    assert launch.in_process(_args(tmp_path / "cut", tabular_data, 30, *dropout)) == 143
    cut = json.loads((tmp_path / "cut" / "r" / "summary.json").read_text())
    assert cut["status"] == "interrupted" and cut["global_step"] == 17
    monkeypatch.setattr(policies.StopRequest, "requested", requested)
    # The same command resumes (the spent stop request does not stop it again) and completes.
    assert launch.in_process(_args(tmp_path / "cut", tabular_data, 30, *dropout)) == 0
    ref, cut = losses(tmp_path / "ref" / "r"), losses(tmp_path / "cut" / "r")
    assert {s: cut[s] for s in (20, 25, 30)} == {s: ref[s] for s in (20, 25, 30)}


def test_an_mlflow_password_never_reaches_params_summary_or_the_console(tmp_path, tabular_data, monkeypatch, capsys):
    from stride.trainers.sinks import mlflow_sink as tracking

    seen = {}

    def start(self, run_name, run_id, params, parent_run_id=None):
        seen.update(params)
        return None

    monkeypatch.setattr(tracking.Tracker, "start", start)
    uri = "http://alice:s3cr3t@127.0.0.1:9/"
    assert launch.in_process(_args(tmp_path, tabular_data, 5, "tracking.mlflow=true", f"tracking.mlflow_uri={uri}")) == 0
    assert seen["tracking"]["mlflow_uri"] == "http://alice:***@127.0.0.1:9/"
    out = capsys.readouterr()
    assert "s3cr3t" not in out.out + out.err
    assert "s3cr3t" not in (tmp_path / "r" / "summary.json").read_text()


def test_a_torn_metrics_line_does_not_block_resume_and_a_fresh_start_keeps_history(tmp_path, tabular_data, capsys):
    assert launch.in_process(_args(tmp_path, tabular_data, 20)) == 0
    metrics = tmp_path / "r" / "metrics.jsonl"
    with open(metrics, "a") as f:
        f.write('{"step": 21, "train_lo')  # a kill in the middle of a write
    capsys.readouterr()
    assert launch.in_process(_args(tmp_path, tabular_data, 30)) == 0  # was: JSONDecodeError on every resume
    assert "dropped 1 unreadable line" in capsys.readouterr().out
    assert [r["step"] for r in read_jsonl(metrics) if "train_loss" in r] == [5, 10, 15, 20, 25, 30]
    history = metrics.read_text()
    for ckpt in complete_checkpoints(tmp_path / "r"):  # no checkpoint left to continue from: a fresh start
        __import__("shutil").rmtree(ckpt)
    assert launch.in_process(_args(tmp_path, tabular_data, 10)) == 0
    kept = [p for p in metrics.parent.glob("metrics.jsonl.*")]
    assert len(kept) == 1 and kept[0].read_text() == history  # the earlier run's metrics are kept, not truncated
    assert [r["step"] for r in read_jsonl(metrics) if "train_loss" in r] == [5, 10]


def test_rerunning_a_finished_run_keeps_its_results_and_a_failed_rerun_never_replaces_them(tmp_path, tabular_data):
    assert launch.in_process(_args(tmp_path, tabular_data, 30)) == 0
    summary = tmp_path / "r" / "summary.json"
    done = json.loads(summary.read_text())
    assert launch.in_process(_args(tmp_path, tabular_data, 30)) == 0  # the same command again: nothing left to train
    again = json.loads(summary.read_text())
    for key in ("status", "global_step", "train_loss", "val_loss", "val_accuracy", "restarts"):
        assert again[key] == done[key], key  # was: train_loss/val_loss/val_accuracy null and restarts 1

    # What the Ray driver writes for a rerun that fails (status failed) goes beside the completed record.
    from stride.trainers.launch.lifecycle import write_summary

    path = write_summary(tmp_path / "r", {"status": "failed", "error": "the storage is gone"})
    assert path.name == "summary.failed.json" and json.loads(summary.read_text()) == again
    assert write_summary(tmp_path / "r", dict(again, global_step=40)) == summary  # a completed one replaces it


def test_a_resume_with_nothing_left_to_train_reports_the_runs_last_figures(tmp_path, tabular_data, monkeypatch):
    """What Ray Train and Tune read is the last report: a sweep killed after a trial's final checkpoint resumes it with
    nothing left to train, and that attempt must still report the final step and metric (CI once saw a completed
    trial recorded at step 950 of 1000)."""
    import dataclasses

    from stride.trainers.launch import torchrun

    reports, real_run = [], torchrun.run

    def spying(cfg, env, plan):
        def report(metrics, written):
            reports.append(metrics)
            env.report(metrics, written)
        return real_run(cfg, dataclasses.replace(env, report=report), plan)

    monkeypatch.setattr(torchrun, "run", spying)
    args = _args(tmp_path, tabular_data, 30, "train.eval_every_steps=30")
    assert launch.in_process(args) == 0
    last = reports[-1]
    assert last["step"] == 30 and "val_accuracy" in last
    reports.clear()
    assert launch.in_process(args) == 0  # resumes at step 30: nothing to train
    assert reports == [last]


def test_a_resume_at_90_percent_of_an_epoch_reads_about_10_percent_and_ends_bitwise_equal(tmp_path):
    import shutil

    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(0)
    for split, files, n in (("train", 5, 10_000), ("val", 1, 1_000)):
        (tmp_path / split).mkdir()
        for i in range(files):
            x = rng.normal(size=(n, 4)).astype(np.float32)
            cols = {f"f{j}": x[:, j] for j in range(4)} | {"label": (x[:, 0] > 0).astype(np.int64),
                                                         "sample_id": np.arange(i * n, (i + 1) * n)}
            pq.write_table(pa.table(cols), tmp_path / split / f"part-{i}.parquet", row_group_size=500)
    args = tiny(tmp_path / "runs", tmp_path, None, "train.epochs=1", "train.max_steps=null",
                "train.batch_size_per_worker=100", "data.shuffle_window_rows=2000", "model.hidden_sizes=[16]",
                "train.log_every_steps=50", "train.eval_every_steps=null", "checkpoint.every_steps=450",
                "checkpoint.keep_last=5")
    assert launch.in_process(args) == 0
    run = tmp_path / "runs" / "r"
    full = json.loads((run / "summary.json").read_text())
    assert full["global_step"] == 500 and full["train_rows_read"] == 50_000  # one epoch, each row group once

    # Lose the end of the epoch: the same command resumes at step 450, 90 % into it.
    shutil.rmtree(run / "checkpoint_00000500")
    (run / "summary.json").unlink()
    assert launch.in_process(args) == 0
    resumed = json.loads((run / "summary.json").read_text())
    assert resumed["global_step"] == 500 and resumed["restarts"] == 1
    # It read the last 10 % (5,000 rows) plus at most the window it starts in and a row group on each side of it.
    assert 5_000 <= resumed["train_rows_read"] <= 5_000 + 2_000 + 2 * 500
    assert resumed["param_checksums"] == full["param_checksums"] and resumed["train_loss"] == full["train_loss"]


def test_pruning_keeps_what_it_did_not_write_and_survives_an_unreadable_meta(tmp_path, tabular_data):
    """keep_last prunes only this launcher's own verified checkpoints: a Ray checkpoint in the same run folder, a
    folder with an unreadable meta.json and a torn one stay as they were, and none of them crashes the run."""
    run = tmp_path / "r"
    run.mkdir()
    ray_ckpt = run / "checkpoint_2026-11-24_10-00-00.000000"
    unreadable = run / "checkpoint_00000001"
    for folder, meta in ((ray_ckpt, '{"step": 1}'), (unreadable, "{not json")):
        folder.mkdir()
        (folder / checkpointing.META).write_text(meta)
        (folder / "state.pt").write_bytes(b"x")
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    assert launch.in_process(_args(tmp_path, tabular_data, 50, "checkpoint.keep_last=2")) == 0
    assert [p.name for p in complete_checkpoints(run)] == ["checkpoint_00000040", "checkpoint_00000050"]
    assert {p: p.read_bytes() for p in before} == before  # untouched
    assert not (run / "checkpoint_00000010").exists() and not (run / "checkpoint_00000030").exists()


def test_a_run_that_fails_while_a_checkpoint_is_written_leaves_that_checkpoint_complete(tmp_path, tabular_data,
                                                                                         monkeypatch):
    """A failure a few steps after a checkpoint began (a callback, a bad batch) must not tear the checkpoint still
    being written in the background: the process's exit would cut the write off and leave nothing newer to resume
    from. The write is slowed here, as a loaded machine or slow storage slows it (a fresh-clone CI run once tore
    test_callbacks' step-10 checkpoint this way)."""
    import time

    from stride.trainers import policies

    write = checkpointing.CheckpointWriter._write

    def slow_write(self, folder, staged, meta):
        time.sleep(1.5)
        return write(self, folder, staged, meta)

    calls, requested = {"n": 0}, policies.StopRequest.requested

    def boom_at_step_12(self):  # once per step, after the step's checkpoint (if due) began
        calls["n"] += 1
        if calls["n"] == 12:
            raise RuntimeError("boom at step 12")
        return requested(self)

    monkeypatch.setattr(checkpointing.CheckpointWriter, "_write", slow_write)
    monkeypatch.setattr(policies.StopRequest, "requested", boom_at_step_12)
    with pytest.raises(RuntimeError, match="boom at step 12"):
        launch.in_process(_args(tmp_path, tabular_data, 30))
    assert checkpointing.verify(tmp_path / "r" / "checkpoint_00000010") is None
    assert [c.name for c in complete_checkpoints(tmp_path / "r")] == ["checkpoint_00000010"]
