"""Sweeps on a bucket (issue 44): `python tune/main.py --config s.yaml` with sweep.storage_path=s3://... on the suite's
S3 server and shared Ray head. Each trial is a run on the bucket at <storage_path>/<sweep>/<trial id>, Ray Tune keeps
its experiment state at <storage_path>/<sweep> (through pyarrow, which finds the server by AWS_ENDPOINT_URL), and the
driver's own files (its state, trial events, worker log, summary) reach the bucket too. A driver SIGKILLed while the
second trial trains, then rerun with nothing left on the machine's disk, resumes from the bucket alone: the finished
trial is not run again, the killed one continues from its checkpoint. Refusals of the sweep's storage are one line,
exit 2, before Ray starts."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import textwrap
import time
import uuid

import pytest

from conftest import PYTHON, REPO, run_cli, run_cli_forked
from runs import files_under
from s3_server import s3_server_fixture
from tune_fixtures import wait_for, write_sweep

s3_server = s3_server_fixture()

STEPS = 20
EVERY = 10
# Each step waits a little, so that the second trial is still training when the test sees its first checkpoint's
# meta.json in the bucket and kills the driver (the tabular model's own steps take milliseconds).
THROTTLE = textwrap.dedent("""
    import time
    from stride import Callback

    class Throttle(Callback):
        def on_step_end(self, state, metrics):
            time.sleep(0.5)
""")


@pytest.fixture
def bucket(s3_server):
    return s3_server.new_bucket()


def events(s3, sweep_uri: str) -> list[dict]:
    text = s3.read(f"{sweep_uri}/trial_events.jsonl").decode()
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def trials_in(s3, sweep_uri: str) -> tuple[set[str], set[str]]:
    """(trials with a summary.json, trials with a complete first checkpoint but no summary yet) in the bucket."""
    names = s3.objects(sweep_uri)
    ended = {n.split("/")[0] for n in names if n.endswith("/summary.json")}
    saved = {n.split("/")[0] for n in names if n.endswith(f"/checkpoint_{EVERY:08d}/meta.json")}
    return ended, saved - ended


@pytest.mark.slow
def test_a_sweep_on_a_bucket_keeps_everything_there_and_resumes_from_it_alone(s3_server, bucket, shared_ray_head,
                                                                               tabular_data, tmp_path):
    project = tmp_path / "project"  # the user's folder: the sweep file and their callback module
    project.mkdir()
    (project / "throttle.py").write_text(THROTTLE)
    staging = tmp_path / "staging"
    storage = f"s3://{bucket}/sweeps"
    sweep_uri = f"{storage}/bs"
    write_sweep(project / "sweep.yaml", tabular_data, storage,
                sweep={"name": "bs", "search": "grid", "num_samples": 1, "max_concurrent_trials": 1},
                base={"train.max_steps": STEPS, "train.eval_every_steps": EVERY, "train.log_every_steps": 1,
                      "checkpoint.every_steps": EVERY, "checkpoint.staging_dir": str(staging),
                      "tracking.mlflow": False, "train.callbacks": ["throttle:Throttle"]},
                space={"optim.lr": {"grid": [3.0e-2, 1.0e-2]}})
    env = {k: v for k, v in dict(s3_server.child_env(), **shared_ray_head.env()).items()
           if os.environ.get(k) != v}  # what run_cli adds to this process's environment
    command = [PYTHON, str(REPO / "tune" / "main.py"), "--config", "sweep.yaml"]
    assert not shared_ray_head.wait_idle(), "the test head is busy"

    log_path = tmp_path / "first.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(command, cwd=project, env=dict(os.environ, **env, PYTHONUNBUFFERED="1"), stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            def second_trial_checkpointed():
                ended, saved = trials_in(s3_server, sweep_uri)
                return (ended, saved) if ended and saved else None

            ended, killed = wait_for(second_trial_checkpointed, timeout=480, proc=proc,
                                     what="a checkpoint of the second trial in the bucket")
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=60)
    first = log_path.read_text()
    assert len(ended) == 1 and len(killed) == 1, first[-3000:]
    (finished_id,), (killed_id,) = ended, killed
    names = s3_server.objects(sweep_uri)
    # Tune's experiment state and the driver's own files were in the bucket while it ran.
    assert "tuner.pkl" in names and any(n.startswith("experiment_state-") for n in names), names
    assert {"stride_sweep.json", "trial_events.jsonl"} <= set(names), names
    assert "sweep_summary.json" not in names and f"{killed_id}/summary.json" not in names
    finished_stamp = s3_server.read(f"{sweep_uri}/{finished_id}/summary.json")
    assert not shared_ray_head.wait_idle(), "the killed sweep's trial stayed on the head"
    # Another machine: nothing of the sweep or its trials on this disk, only the bucket.
    shutil.rmtree(staging)

    second = run_cli(command[1:], timeout=480, env=env, cwd=project)
    out = second.stdout + second.stderr
    assert second.returncode == 0, first[-2000:] + out[-4000:]
    assert "resuming" in second.stdout, out[-3000:]
    assert f"trial {finished_id} started" not in second.stdout
    assert f"stride: summary     {sweep_uri}/sweep_summary.json" in second.stdout
    assert not shared_ray_head.wait_idle()

    summary = json.loads(s3_server.read(f"{sweep_uri}/sweep_summary.json"))
    assert summary["status"] == "completed" and len(summary["trials"]) == 2
    for t in summary["trials"]:
        run = f"{sweep_uri}/{t['trial_id']}"
        assert t["status"] == "completed" and t["steps"] == STEPS and t["run_dir"] == run, t
        own = json.loads(s3_server.read(f"{run}/summary.json"))
        assert own["status"] == "completed" and own["global_step"] == STEPS and own["params"] == t["params"]
        assert own["checkpoint"] == f"{run}/checkpoint_{STEPS:08d}"
        assert own["val_loss"] == pytest.approx(t["metric"])
        in_run = s3_server.objects(run)
        for step in (EVERY, STEPS):
            assert f"checkpoint_{step:08d}/meta.json" in in_run and f"checkpoint_{step:08d}/.metadata" in in_run
        assert "params.json" in in_run  # Tune's own trial files share the prefix, as they share a trial's folder
        lines = [json.loads(x) for x in s3_server.read(f"{run}/metrics.jsonl").decode().splitlines() if x.strip()]
        assert [r["step"] for r in lines if "train_loss" in r] == list(range(1, STEPS + 1))  # once each, in order
    best = min(summary["trials"], key=lambda t: t["metric"])
    assert summary["best_trial_id"] == best["trial_id"] and summary["best_metric"] == best["metric"]

    starts: dict[str, int] = {}
    for e in events(s3_server, sweep_uri):  # the first start's events came back from the bucket
        if e["event"] == "start":
            starts[e["trial_id"]] = starts.get(e["trial_id"], 0) + 1
    assert starts == {finished_id: 1, killed_id: 2}
    assert s3_server.read(f"{sweep_uri}/{finished_id}/summary.json") == finished_stamp  # not run again
    assert json.loads(s3_server.read(f"{sweep_uri}/{killed_id}/summary.json"))["restarts"] >= 1
    assert "worker.log" in s3_server.objects(sweep_uri)
    assert files_under(staging) == []  # the sweep's and the trials' working copies went with their ends


@pytest.mark.parametrize("storage, base, words", [
    ("s3://Not_A_Bucket/x", {"tracking.mlflow": False}, ["sweep.storage_path", "not a bucket name"]),
    ("s3://key:secret@bkt/x", {"tracking.mlflow": False}, ["sweep.storage_path", "credentials"]),
    ("s3://{missing}/x", {"tracking.mlflow": False}, ["sweep.storage_path", "{missing}"]),
    ("s3://{bucket}/x", {}, ["sweep.storage_path", "base.tracking.mlflow_uri", "base.tracking.mlflow=false"]),
], ids=["bad-name", "credentials", "missing-bucket", "mlflow-default"])
def test_a_sweep_storage_the_bucket_refuses_exits_2_in_one_line(s3_server, bucket, tabular_data, tmp_path,
                                                               storage, base, words):
    missing = f"none-{uuid.uuid4().hex[:12]}"
    storage = storage.format(bucket=bucket, missing=missing)
    cfg = write_sweep(tmp_path / "s.yaml", tabular_data, storage, sweep={"name": "bad", "num_samples": 2},
                      base=base, space={"optim.lr": {"loguniform": [1e-4, 1e-1]}})
    t0 = time.time()
    proc = run_cli_forked(["tune/main.py", "--config", str(cfg)], timeout=120, env=s3_server.child_env(),
                          inherit_env=False)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and "secret" not in proc.stdout + proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("stride: error:")]
    assert len(lines) == 1, proc.stderr[-3000:]
    for w in (w.format(missing=missing) for w in words):
        assert w in lines[0], lines[0]
    assert time.time() - t0 < 60
    assert s3_server.objects(f"s3://{bucket}") == []  # nothing written
