"""Failures cost nothing but the steps since the last checkpoint: a checkpoint Ray never registered, storage
errors, and resuming with a different number of workers. The Ray case joins the session's shared head
(tests/shared_ray.py); storage retries and 1 -> 2 workers are the loop's and run under torchrun. SIGTERM, Ctrl-C,
the driver's SIGKILL and a killed worker are tested once on Ray, and a resume from 2 workers to 1 under torchrun, on
a user's own task (tests/test_user_task.py), which asserts more (MLflow run, evaluations, final weights); the
mechanism is the same for the built-in tasks."""

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

from conftest import REPO, read_jsonl, run_cli, run_cli_forked, torchrun_launcher

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
    from stride.trainers.checkpointing import SNAPSHOT
    from stride.trainers.torchrun import main as torchrun_main

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


# Loaded by every Python process of the job (PYTHONPATH), Ray's workers included: rank 0's write of its checkpoint
# shard (the fsync DCP does after writing __0_0.distcp) fails with an I/O error the first FLAKY_FAILS times for each
# checkpoint folder.
FLAKY_STORAGE = """
import os

if os.environ.get("FLAKY_LOG"):
    _fsync, _calls = os.fsync, {}

    def fsync(fd):
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


def torchrun(args: list[str], env: dict, nproc: int = 2) -> subprocess.CompletedProcess:
    """trainers/torchrun.py with `nproc` processes instead of trainers/main.py on Ray (args as job_args gives them);
    one process is forked from the fork server, without a launcher."""
    if nproc == 1:
        return run_cli_forked(["trainers/torchrun.py", *args[1:]], env=env, timeout=600)
    cmd = [*torchrun_launcher(nproc), "trainers/torchrun.py", *args[1:]]
    return subprocess.run(cmd, cwd=REPO, env=dict(os.environ, PYTHONUNBUFFERED="1", **env), capture_output=True,
                          text=True, timeout=600)


def test_transient_storage_errors_on_two_ranks_are_retried(tmp_path, tabular_data):
    """The background writer goes through Stride's retries: a storage hiccup on one rank costs every rank another
    try (DCP reports it to all), not the run, and every checkpoint that lands is complete. Storage that stays broken
    ends the run with a message that names the path. The loop's own guarantee: 2 ranks under torchrun prove it
    (the Ray launcher runs the same loop)."""
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(FLAKY_STORAGE)
    log = tmp_path / "injected.txt"
    small = ["model.hidden_sizes=[32]", "checkpoint.every_steps=10", "train.log_every_steps=10", "checkpoint.keep_last=5"]
    env = {"PYTHONPATH": str(hooks), "FLAKY_LOG": str(log), "FLAKY_FAILS": "2"}
    r = torchrun(job_args(tabular_data, tmp_path, "flaky", *small, "train.max_steps=30"), env)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    injected = log.read_text().splitlines()
    from stride.trainers import checkpointing

    folders = sorted((c for c in (tmp_path / "flaky").glob("checkpoint_*") if c.is_dir()),
                     key=lambda c: checkpointing.read_meta(c)["step"])
    assert [checkpointing.read_meta(c)["step"] for c in folders] == [10, 20, 30]
    assert all(checkpointing.verify(c) is None for c in folders)
    # Each checkpoint's shard write failed twice, then the third try landed it.
    assert sorted(Path(d).name for d in injected) == sorted(c.name for c in folders for _ in range(2))
    rank0 = [ln for ln in (r.stdout + r.stderr).splitlines() if "[stride rank 0]" in ln]
    retries = [ln for ln in rank0 if "retry" in ln]
    assert len([ln for ln in retries if "retry 1/3" in ln]) == 3 and len([ln for ln in retries if "retry 2/3" in ln]) == 3
    assert not any("retry 3/3" in ln for ln in retries), retries
    assert json.loads((tmp_path / "flaky" / "summary.json").read_text())["status"] == "completed"

    # Storage that stays broken ends the run with the path and what to check; the run's earlier checkpoints stay.
    r = torchrun(job_args(tabular_data, tmp_path, "flaky", *small, "train.max_steps=40"), dict(env, FLAKY_FAILS="9"))
    assert r.returncode == 1, r.stdout[-2000:] + r.stderr[-2000:]
    assert re.search(r"stride: error: checkpoint checkpoint_\d+ could not be written \(\[Errno 5\] Input/output error; "
                     r"failed 4 times\); the last complete checkpoint is \S*/flaky/checkpoint_00000030: make "
                     r"run.storage_path \(\S+\) writable", r.stdout + r.stderr), r.stderr[-2000:]
    assert checkpointing.read_meta(checkpointing.newest_complete(tmp_path / "flaky"))["step"] == 30
    assert all(checkpointing.verify(c) is None for c in folders)


def _ids_once_per_epoch(log_dir, rows, global_batch):
    seen = []
    for f in log_dir.glob("rank*.jsonl"):
        seen += [(r["micro_step"], i) for r in read_jsonl(f) for i in r["sample_ids"]]
    per_epoch = rows // global_batch
    epoch0 = [i for m, i in seen if m < per_epoch]
    return epoch0


def _elastic(tabular_data, tmp_path, first, second):
    """Train part of an epoch with one world size (workers, batch per worker), resume with another (same global
    batch), both under torchrun."""
    import pyarrow.parquet as pq

    rows = pq.ParquetDataset(tabular_data / "train").read(columns=["sample_id"]).num_rows
    per_epoch = rows // 128
    log = tmp_path / "samples"
    for workers, batch, steps in (first + (10,), second + (per_epoch,)):
        extra = [f"train.batch_size_per_worker={batch}", f"train.max_steps={steps}", "checkpoint.every_steps=10",
                 "model.hidden_sizes=[32]"]
        r = torchrun(job_args(tabular_data, tmp_path, "elastic") + extra, {"STRIDE_SAMPLE_LOG": str(log)}, workers)
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    s = json.loads((tmp_path / "elastic" / "summary.json").read_text())
    assert s["restarts"] == 1 and s["world_size"] == second[0]
    epoch0 = _ids_once_per_epoch(log, rows, 128)
    assert len(epoch0) == len(set(epoch0)) == per_epoch * 128  # every sample once, across both world sizes
    assert rows - len(set(epoch0)) < 128


def test_elastic_resume_one_worker_to_two(tabular_data, tmp_path):
    _elastic(tabular_data, tmp_path, (1, 128), (2, 64))
