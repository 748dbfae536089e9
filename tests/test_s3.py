"""Training on Parquet in an S3-compatible object store: a real local S3 server (moto_server, tests/s3_server.py),
the data uploaded to it, and Stride's own commands reading `s3://bucket/prefix` through pyarrow.

What a user relies on: a job reading the object store sees exactly the data of the local copy, in the same order,
so it trains to the bitwise-same loss; and a path that is not in the bucket is one line naming the key, exit 2.
The server is reached through AWS_ENDPOINT_URL (pyarrow's AWS SDK honours it), so the config holds plain
s3:// URIs, as it would for AWS."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from conftest import PYTHON, REPO, read_jsonl, run_cli_forked
from runs import OVERLAY
from s3_server import s3_server_fixture

pytestmark = pytest.mark.slow  # starts a server (make test-fast leaves it out)

s3_server = s3_server_fixture()

BUCKET = "stride-data"
CONFIG = "trainers/configs/tabular_mlp.yaml"
STEPS = 20
# One process (torchrun.py without WORLD_SIZE: one worker, no Ray), a short run, no MLflow.
QUICK = [f"train.max_steps={STEPS}", "train.epochs=null", "train.log_every_steps=5", f"train.eval_every_steps={STEPS}",
         f"checkpoint.every_steps={STEPS}", *OVERLAY]


def run_job(s3, *overrides: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """trainers/torchrun.py as a user runs it, with the environment that points s3:// at the local server."""
    return run_cli_forked(["trainers/torchrun.py", "--config", CONFIG, *overrides], env=s3_env(s3), timeout=timeout,
                          inherit_env=False)


def s3_env(s3, **extra: str) -> dict[str, str]:
    """The server's client environment for a child of this process, as a user's shell would have it: no torchrun
    or Ray variables."""
    env = dict(s3.child_env(), **extra)
    for k in ("RAY_ADDRESS", "WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    return env


@pytest.fixture(scope="module")
def tab_on_s3(s3_server, tmp_path_factory):
    """The tabular set prepared locally and uploaded to s3://stride-data/tab; (local folder, its URI)."""
    local = tmp_path_factory.mktemp("s3data") / "tab"
    r = subprocess.run([PYTHON, "datasets/prepare.py", "tabular", "--out", str(local), "--rows", "2000",
                        "--features", "8", "--classes", "4", "--seed", "0"], cwd=REPO, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    uri = s3_server.upload(local, BUCKET, "tab")
    expect = sorted(f"{BUCKET}/tab/{p.relative_to(local).as_posix()}" for p in local.rglob("*") if p.is_file())
    assert s3_server.list(uri) == expect and any("/train/" in k for k in expect) and any("/val/" in k for k in expect)
    return local, uri


def _summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def test_trains_from_s3_exactly_as_from_the_local_copy(s3_server, tab_on_s3, tmp_path):
    local, uri = tab_on_s3
    log_before = s3_server.log_path.stat().st_size

    r = run_job(s3_server, f"data.train_path={uri}/train", f"data.val_path={uri}/val",
                f"run.storage_path={tmp_path}/runs", "run.name=s3run", *QUICK)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    s3 = _summary(tmp_path / "runs" / "s3run")
    assert s3["status"] == "completed" and s3["global_step"] == STEPS, s3

    # The job read every Parquet file from the server (moto_server logs each request it answers).
    requests = s3_server.log_path.read_text(errors="replace")[log_before:]
    for f in sorted(local.rglob("*.parquet")):
        key = f"/{BUCKET}/tab/{f.relative_to(local).as_posix()}"
        assert f"GET {key} " in requests, f"{key} was never read from the S3 server"

    # The same job on the local copy (another run folder, same name so nothing but the data path differs).
    l = run_job(s3_server, f"data.train_path={local}/train", f"data.val_path={local}/val",
                f"run.storage_path={tmp_path}/local_runs", "run.name=s3run", *QUICK)
    assert l.returncode == 0, l.stdout[-3000:] + l.stderr[-3000:]
    loc = _summary(tmp_path / "local_runs" / "s3run")
    assert loc["status"] == "completed" and loc["global_step"] == STEPS, loc

    # Same data in the same order: bitwise-equal losses (JSON keeps a float's every bit), logged and final.
    assert isinstance(s3["train_loss"], float) and s3["train_loss"] == loc["train_loss"], (s3["train_loss"], loc["train_loss"])
    for k in ("val_loss", "val_accuracy", "initial_val_loss", "param_checksums", "samples_seen", "rows_dropped",
              "train_rows_read", "facts"):
        assert s3.get(k) == loc.get(k), (k, s3.get(k), loc.get(k))

    def losses(run_dir: Path) -> list[tuple[int, float]]:
        return [(m["step"], m["train_loss"]) for m in read_jsonl(run_dir / "metrics.jsonl") if "train_loss" in m]

    logged = losses(tmp_path / "runs" / "s3run")
    assert logged and logged == losses(tmp_path / "local_runs" / "s3run")


@pytest.mark.parametrize("missing", [f"s3://{BUCKET}/nope", f"s3://{BUCKET}/tab/nope", "s3://no-such-bucket/tab"])
def test_a_missing_s3_path_is_one_line_naming_the_key(s3_server, tab_on_s3, tmp_path, missing):
    _, uri = tab_on_s3
    r = run_job(s3_server, f"data.train_path={missing}", f"data.val_path={uri}/val",
                f"run.storage_path={tmp_path}/runs", "run.name=missing", *QUICK, timeout=120)
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-3000:]
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("stride: error: "), r.stderr[-3000:]
    assert "data.train_path" in lines[0] and missing in lines[0], lines[0]
    assert not list((tmp_path / "runs").glob("missing/checkpoint_*"))


def test_init_from_an_s3_uri_loads_what_the_local_file_loads(s3_server, tab_on_s3, tmp_path):
    """init.from takes an object-store URI where data paths do: a run starting from s3://.../mlp.safetensors starts
    from exactly the weights of the same file on disk (the same untrained loss and sha256)."""
    local, _ = tab_on_s3
    data = [f"data.train_path={local}/train", f"data.val_path={local}/val", "train.max_steps=2", "train.epochs=null",
            *OVERLAY, "checkpoint.every_steps=2"]
    r = run_job(s3_server, *data, f"run.storage_path={tmp_path}/runs", "run.name=src")
    assert r.returncode == 0, r.stderr[-3000:]
    weights = tmp_path / "weights"
    weights.mkdir()
    e = run_cli_forked(["-m", "stride", "export", str(tmp_path / "runs" / "src"), str(weights / "mlp.safetensors")])
    assert e.returncode == 0, e.stderr[-3000:]
    uri = s3_server.upload(weights, BUCKET, "init")
    summaries = []
    for name, source in (("from_s3", f"{uri}/mlp.safetensors"), ("from_disk", str(weights / "mlp.safetensors"))):
        r = run_job(s3_server, *data, f"run.storage_path={tmp_path}/runs", f"run.name={name}", f"init.from={source}")
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        summaries.append(_summary(tmp_path / "runs" / name))
    s3, disk = summaries
    assert s3["init"]["from"] == f"{uri}/mlp.safetensors" and s3["init"]["loaded"] == disk["init"]["loaded"] == 6
    assert s3["init"]["sha256"] == disk["init"]["sha256"] and s3["initial_val_loss"] == disk["initial_val_loss"]


def test_a_manifest_and_its_files_on_s3_train_as_the_local_copy(s3_server, tmp_path):
    """examples/audio_clips' JSON Lines manifests and WAV files uploaded as they are: the manifest's relative paths
    resolve against its s3:// folder, every clip is read from the server, and the run equals the local one bitwise."""
    import shutil

    project = tmp_path / "audio_clips"
    shutil.copytree(REPO / "examples" / "audio_clips", project, ignore=shutil.ignore_patterns("data", "runs"))
    subprocess.run([PYTHON, "prepare.py", "--clips", "120"], cwd=project, check=True, capture_output=True, timeout=120)
    uri = s3_server.upload(project / "data", BUCKET, "clips")
    log_before = s3_server.log_path.stat().st_size
    quick = ["--config", str(project / "audio_clips.yaml"), *OVERLAY, "train.max_steps=6",
             "train.eval_every_steps=6", "checkpoint.every_steps=6", "train.batch_size_per_worker=8"]
    outcomes = []
    for name, root in (("s3", uri), ("local", str(project / "data"))):
        r = run_cli_forked([str(REPO / "trainers" / "torchrun.py"), *quick, f"run.storage_path={tmp_path}/{name}",
                            f"data.train_path={root}/train.jsonl", f"data.val_path={root}/val.jsonl"], cwd=project,
                           env=s3_env(s3_server, PYTHONPATH=str(project)), timeout=300, inherit_env=False)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        s = _summary(tmp_path / name / "audio_clips")
        outcomes.append((s["param_checksums"], s["val_loss"], s["val_accuracy"], s["samples_seen"]))
    requests = s3_server.log_path.read_text(errors="replace")[log_before:]
    assert f"GET /{BUCKET}/clips/train.jsonl " in requests and f"GET /{BUCKET}/clips/audio/clip_00119.wav " in requests
    assert outcomes[0] == outcomes[1]
