"""ray_cluster/slurm/stride.sbatch with a run on a bucket (issue 44): a two-node job on the suite's SLURM cluster
(tests/slurm_cluster.py) trains with run.storage_path=s3://... on the suite's S3 server, whose settings reach the job
through sbatch's environment. SIGUSR1 mid-run checkpoints into the bucket; the batch script reads the run's status
from the bucket's summary.json (the driver's working copy is gone by then), requeues the job, and the requeued run
resumes from the bucket and completes: its checkpoints, metrics and summary are in the bucket, nothing stays in the
nodes' staging folder. The launcher's run-dir and status commands on a bucket are tested first, without SLURM."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from conftest import PYTHON, REPO  # noqa: E402
from s3_server import s3_server_fixture  # noqa: E402
from test_slurm import FINISHED, assert_job_cleaned_up, output, sbatch, work  # noqa: E402,F401 - `work`: a fixture

s3_server = s3_server_fixture()
LAUNCH = str(REPO / "ray_cluster" / "slurm" / "launch.py")
STEPS, LOG_EVERY = 400, 10  # long enough that the preemption lands mid-run on a slow, loaded machine


@pytest.fixture
def bucket(s3_server):
    return s3_server.new_bucket()


def read(s3, uri: str) -> bytes | None:
    try:
        with s3.filesystem().open_input_stream(uri.removeprefix("s3://")) as f:
            return f.read()
    except FileNotFoundError:
        return None


def logged_steps(s3, uri: str) -> list[int]:
    text = (read(s3, uri) or b"").decode()
    return [r["step"] for r in map(json.loads, filter(str.strip, text.splitlines())) if "train_loss" in r]


def launch(args: list[str], env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([PYTHON, LAUNCH, *args], env=env, capture_output=True, text=True, timeout=120)


def test_the_launcher_names_a_bucket_run_by_its_uri_and_reads_its_status_there(s3_server, bucket, tabular_data,
                                                                               tmp_path):
    """What the batch script asks before and after the driver: where the run lives (its URI: the driver's working
    copy on the head node is removed at the run's end) and the status of a summary written since the start."""
    env = s3_server.child_env()
    run = f"s3://{bucket}/runs/B"
    where = launch(["run-dir", "--", "--config", "trainers/configs/tabular_mlp.yaml",
                    f"run.storage_path=s3://{bucket}/runs/", "run.name=B", "tracking.mlflow=false"], env)
    assert where.returncode == 0 and where.stdout.strip() == run, where.stdout + where.stderr
    t0 = time.time() - 1  # S3 keeps whole seconds
    assert launch(["status", "--run-dir", run, "--since", str(t0)], env).stdout.strip() == "none"
    s3_server.filesystem().create_dir(f"{bucket}/runs/B")
    with s3_server.filesystem().open_output_stream(f"{bucket}/runs/B/summary.json") as f:
        f.write(json.dumps({"status": "preempted"}).encode())
    assert launch(["status", "--run-dir", run, "--since", str(t0)], env).stdout.strip() == "preempted"
    # An earlier run's summary (a requeued job's first run) is not this run's.
    assert launch(["status", "--run-dir", run, "--since", str(time.time() + 60)], env).stdout.strip() == "none"


@pytest.mark.slow
@pytest.mark.slurm
def test_a_slurm_job_on_a_bucket_is_preempted_requeued_and_completes_there(slurm_cluster, work, s3_server, bucket):
    root, data = work["root"], work["data"]
    storage = f"s3://{bucket}/runs"
    run = f"{storage}/B"
    staging = root / "staging-B"
    # The user's shell: the bucket's endpoint and keys, which sbatch passes on to the job and its steps.
    storage_env = {k: v for k, v in s3_server.child_env(work["env"]).items()
                   if k.startswith("AWS_") or k.lower() == "no_proxy"}
    job = sbatch(slurm_cluster, work, "B", ["--nodes=2", "--cpus-per-task=1"],
                 ["--config", "trainers/configs/tabular_mlp.yaml", f"data.train_path={data}/train",
                  f"data.val_path={data}/val", f"run.storage_path={storage}", "run.name=B", "train.epochs=null",
                  f"train.max_steps={STEPS}", f"train.log_every_steps={LOG_EVERY}", "checkpoint.every_steps=1000",
                  "train.eval_every_steps=1000", "tracking.mlflow=false", "scaling.num_workers=auto",
                  f"checkpoint.staging_dir={staging}"],
                 STRIDE_CPUS_PER_NODE="2", **storage_env)
    signalled_after = None
    deadline = time.time() + 900
    state = None
    while time.time() < deadline:
        state = slurm_cluster.job(job).get("JobState")
        if signalled_after is None:
            if state not in ("PENDING", "RUNNING", "CONFIGURING", None):
                pytest.fail(f"B ended before it trained ({state}): {output(work, 'B')[-4000:]}")
            if seen := logged_steps(s3_server, f"{run}/metrics.jsonl"):
                signalled_after = seen[-1]
                r = slurm_cluster.run(["scancel", "--signal=USR1", "--batch", job])
                assert r.returncode == 0, r.stderr
        elif state in FINISHED:
            break
        time.sleep(1)
    else:
        pytest.fail(f"B not done within 900 s ({state}, signalled after step {signalled_after})\n"
                    f"{output(work, 'B')[-4000:]}")
    info, out = slurm_cluster.job(job), output(work, "B")
    assert info["JobState"] == "COMPLETED" and int(info["Restarts"]) >= 1, (info, out[-5000:])
    assert "stride: preempted: step" in out and "summary status: preempted" in out, out[-5000:]
    assert f"preempted: requeueing job {job}" in out
    m = re.search(r"resumed from \S+ at step (\d+)", out)
    assert m, out[-5000:]
    ckpt_step = int(m.group(1))  # the preemption's checkpoint, in the bucket
    assert signalled_after <= ckpt_step < STEPS

    summary = json.loads(read(s3_server, f"{run}/summary.json"))
    assert summary["status"] == "completed" and summary["global_step"] == STEPS and summary["world_size"] == 2
    assert summary["restarts"] >= 1 and summary["checkpoint"] == f"{run}/checkpoint_{STEPS:08d}"
    assert len(summary["worker_nodes"]) == 2 and summary["worker_nodes"][0] != summary["worker_nodes"][1]
    names = [p.removeprefix(f"{bucket}/runs/B/") for p in s3_server.list(run)]
    for name in (f"checkpoint_{STEPS:08d}/meta.json", f"checkpoint_{STEPS:08d}/.metadata",
                 f"checkpoint_{ckpt_step:08d}/meta.json"):
        assert name in names, names
    assert {n for n in names if n.startswith(f"checkpoint_{STEPS:08d}/__")} >= {
        f"checkpoint_{STEPS:08d}/__0_0.distcp", f"checkpoint_{STEPS:08d}/__1_0.distcp"}  # both nodes' shards
    # Every log step once across the requeue, and the step the preemption checkpointed (logged as it stopped).
    logged = logged_steps(s3_server, f"{run}/metrics.jsonl")
    assert logged == sorted({*range(LOG_EVERY, STEPS + 1, LOG_EVERY), ckpt_step}), logged
    assert [p for p in staging.rglob("*") if p.is_file()] == [], "a node's working copy was left behind"
    assert f"{run}/summary.json" in out  # the driver's report names the summary where it is
    assert_job_cleaned_up(work, job)
