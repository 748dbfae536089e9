"""Failures cost nothing but the steps since the last checkpoint: a checkpoint Ray never registered, storage
errors, and resuming with a different number of workers. The Ray case joins the session's shared head
(tests/shared_ray.py); storage retries and 1 -> 2 workers are the loop's and run under torchrun. SIGTERM, Ctrl-C,
the driver's SIGKILL and a killed worker are tested once on Ray, and a resume from 2 workers to 1 under torchrun, on
a user's own task (tests/test_user_task.py), which asserts more (MLflow run, evaluations, final weights); the
mechanism is the same for the built-in tasks."""

import json
import re
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from conftest import REPO, read_jsonl, run_cli, run_cli_forked, run_torchrun_cases, torchrun_case

pytestmark = pytest.mark.slow

STEPS = 300


def job_args(data, storage, name, *extra):
    return ["trainers/main.py", "--config", "trainers/configs/tabular_mlp.yaml", f"data.train_path={data}/train",
            f"data.val_path={data}/val", f"run.storage_path={storage}", f"run.name={name}", "train.epochs=null",
            f"train.max_steps={STEPS}", "train.log_every_steps=10", "train.eval_every_steps=1000",
            "checkpoint.every_steps=100", "model.hidden_sizes=[32]", "train.batch_size_per_worker=256",
            "tracking.mlflow_uri=null", *extra]


def test_a_checkpoint_ray_never_registered_is_resumed_from(tmp_path, tabular_data, ray_cluster):
    """A driver killed between a checkpoint's write and Ray's registration of it leaves a complete checkpoint that
    Ray's own pointer misses. Here every checkpoint of the run folder is one Ray never saw (written by the torchrun
    launcher), and Ray Train's own record of them is the empty file a full disk leaves (tests/test_disk_full.py):
    the Ray run starts anyway and resumes from the newest, at the same global batch on 2 workers instead of 1."""
    from stride.trainers.launch.ray import SNAPSHOT
    from stride.trainers.launch.torchrun import main as torchrun_main

    small = ["model.hidden_sizes=[32]", "checkpoint.every_steps=10", "train.log_every_steps=10"]
    assert torchrun_main(job_args(tabular_data, tmp_path, "unregistered", *small, "train.max_steps=20",
                                  "train.batch_size_per_worker=128")[1:]) == 0
    (tmp_path / "unregistered" / SNAPSHOT).write_text("")  # Ray Train refuses such a folder unless it is moved aside
    r = run_cli(job_args(tabular_data, tmp_path, "unregistered", *small, "train.max_steps=30",
                         "train.batch_size_per_worker=64"), env=ray_cluster)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "resuming unregistered from checkpoint_00000020 (step 20)" in r.stdout and "at step 20" in r.stdout
    s = json.loads((tmp_path / "unregistered" / "summary.json").read_text())
    assert s["status"] == "completed" and s["global_step"] == 30 and s["restarts"] == 1 and s["world_size"] == 2
    assert [r["step"] for r in read_jsonl(tmp_path / "unregistered" / "metrics.jsonl")
            if "train_loss" in r] == [10, 20, 30]
    assert list((tmp_path / "unregistered").glob(f"{SNAPSHOT}.unreadable-*"))  # moved aside, not deleted


# Loaded by every Python process of the launch (PYTHONPATH): while a run's environment has FLAKY_LOG, rank 0's write
# of its checkpoint shard (the fsync DCP does after writing __0_0.distcp) fails with an I/O error the first FLAKY_FAILS
# times for each checkpoint folder. Read at each call: the launch's cases each set their own environment.
FLAKY_STORAGE = """
import os

_fsync, _calls = os.fsync, {}


def fsync(fd):
    if os.environ.get("FLAKY_LOG"):
        try:
            path = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            path = ""
        if "checkpoint_" in path and path.endswith("__0_0.distcp"):
            folder = os.path.dirname(path)
            _calls[folder] = _calls.get(folder, 0) + 1
            if _calls[folder] <= int(os.environ["FLAKY_FAILS"]):
                with open(os.environ["FLAKY_LOG"], "a") as f:
                    f.write(f"{folder}\\n")
                raise OSError(5, "Input/output error")
    return _fsync(fd)


os.fsync = fsync
"""
SMALL = ["model.hidden_sizes=[32]", "checkpoint.every_steps=10", "train.log_every_steps=10", "checkpoint.keep_last=5"]


@pytest.fixture(scope="module")
def two_ranks(tabular_data, tmp_path_factory) -> dict:
    """This file's 2-rank runs under ONE torchrun launch (tests/torchrun_cases.py), with the flaky storage on the
    launch's PYTHONPATH: a run whose checkpoint writes fail twice each, the same run resumed on storage that stays
    broken, and the 1 -> 2 workers resume (its 1-worker half runs first, forked). A test reads its case with torchrun_case()."""
    root = tmp_path_factory.mktemp("reliability")
    hooks = root / "hooks"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(FLAKY_STORAGE)
    storage, log, samples = root / "runs", root / "injected.txt", root / "samples"
    rows = pq.ParquetDataset(tabular_data / "train").read(columns=["sample_id"]).num_rows
    elastic = [*job_args(tabular_data, storage, "elastic")[1:], "checkpoint.every_steps=10", "model.hidden_sizes=[32]"]
    r = run_cli_forked(["trainers/torchrun.py", *elastic, "train.batch_size_per_worker=128", "train.max_steps=10"],
                       env={"STRIDE_SAMPLE_LOG": str(samples)}, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    flaky = {"FLAKY_LOG": str(log), "FLAKY_FAILS": "2"}
    cases = [
        {"label": "flaky", "env": flaky, "args": [*job_args(tabular_data, storage, "flaky", *SMALL)[1:],
                                                  "train.max_steps=30"]},
        {"label": "broken", "env": dict(flaky, FLAKY_FAILS="9"),
         "args": [*job_args(tabular_data, storage, "flaky", *SMALL)[1:], "train.max_steps=40"]},
        {"label": "elastic", "env": {"STRIDE_SAMPLE_LOG": str(samples)},
         "args": [*elastic, "train.batch_size_per_worker=64", f"train.max_steps={rows // 128}"]},
    ]
    launch, ranks = run_torchrun_cases(cases, root / "cases", REPO, {"PYTHONPATH": str(hooks)})
    return {"launch": launch, "ranks": ranks, "storage": storage, "injected": log, "samples": samples, "rows": rows}


def test_transient_storage_errors_on_two_ranks_are_retried(two_ranks):
    """The background writer goes through Stride's retries: a storage hiccup on one rank costs every rank another
    try (DCP reports it to all), not the run, and every checkpoint that lands is complete. Storage that stays broken
    ends the run with a message that names the path. The loop's own guarantee: 2 ranks under torchrun prove it
    (the Ray launcher runs the same loop)."""
    from stride.trainers.run import checkpointing

    out, run = torchrun_case(two_ranks, "flaky"), two_ranks["storage"] / "flaky"
    injected = two_ranks["injected"].read_text().splitlines()
    # Every checkpoint the flaky run wrote is complete (the broken run's step 40 never was).
    folders = [run / f"checkpoint_{step:08d}" for step in (10, 20, 30)]
    assert [checkpointing.read_meta(c)["step"] for c in folders] == [10, 20, 30]
    assert all(checkpointing.verify(c) is None for c in folders)
    assert sorted(c for c in run.glob("checkpoint_*") if c.is_dir() and checkpointing.verify(c) is None) == folders
    # Each checkpoint's shard write failed twice, then the third try landed it (the broken run's 40 never did).
    failed = [Path(d).name for d in injected]
    assert sorted(n for n in failed if n != "checkpoint_00000040") == sorted(f"checkpoint_{s:08d}" for s in (10, 20, 30)
                                                                         for _ in range(2))
    retries = [ln for ln in out.splitlines() if "[stride rank 0]" in ln and "retry" in ln]
    assert len([ln for ln in retries if "retry 1/3" in ln]) == 3 and len([ln for ln in retries if "retry 2/3" in ln]) == 3
    assert not any("retry 3/3" in ln for ln in retries), retries

    # Storage that stays broken ends the run with the path and what to check; the run's earlier checkpoints stay.
    out = torchrun_case(two_ranks, "broken", code=1)
    assert re.search(r"stride: error: checkpoint checkpoint_\d+ could not be written \(\[Errno 5\] Input/output error; "
                     r"failed 4 times\); the last complete checkpoint is \S*/flaky/checkpoint_00000030: make "
                     r"run.storage_path \(\S+\) writable", out), out[-2000:]
    assert checkpointing.read_meta(checkpointing.newest_complete(run))["step"] == 30
    assert all(checkpointing.verify(c) is None for c in folders)


def test_elastic_resume_one_worker_to_two(two_ranks):
    """10 steps on 1 worker x 128 rows, then resumed on 2 workers x 64 (the same global batch) to the end of the
    epoch: every training row once in epoch 0, across both world sizes."""
    out = torchrun_case(two_ranks, "elastic")
    assert "at step 10" in out
    s = json.loads((two_ranks["storage"] / "elastic" / "summary.json").read_text())
    assert s["restarts"] == 1 and s["world_size"] == 2
    rows, per_epoch = two_ranks["rows"], two_ranks["rows"] // 128
    seen = [(r["micro_step"], i) for f in two_ranks["samples"].glob("rank*.jsonl") for r in read_jsonl(f)
            for i in r["sample_ids"]]
    epoch0 = [i for m, i in seen if m < per_epoch]
    assert len(epoch0) == len(set(epoch0)) == per_epoch * 128  # every sample once, across both world sizes
    assert rows - len(set(epoch0)) < 128
