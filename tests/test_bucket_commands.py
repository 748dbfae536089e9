"""The commands over a trained run read a run on a bucket (issue 44): `stride eval`, `predict` (its --out a bucket
prefix too), `export` and `generate` take `--run s3://bucket/prefix/name`, and each gives what it gives on a copy of
the same run synced to a local folder. One tiny run trains on the suite's S3 server once (torchrun, 2 ranks); the
commands under torchrun run as one batch of cases (tests/torchrun_cases.py), eval once more on the shared Ray head
(the default launcher), and export, generate and the refusals in this process."""

from __future__ import annotations

import io
import json
import os
import tempfile
import uuid
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from conftest import REPO, run_cli, run_torchrun_cases, torchrun_case
from runs import launch, tiny
from s3_server import s3_server_fixture

pytestmark = pytest.mark.slow
s3_server = s3_server_fixture()


def put_object(s3, uri: str, data: bytes) -> None:
    with s3.filesystem().open_output_stream(uri.removeprefix("s3://")) as f:
        f.write(data)


def sync_down(s3, uri: str, folder: Path) -> Path:
    """The objects under `uri` as files under `folder` (as `aws s3 sync` makes them)."""
    from pyarrow import fs as pafs

    pafs.copy_files(uri.removeprefix("s3://"), str(folder), source_filesystem=s3.filesystem(),
                    destination_filesystem=pafs.LocalFileSystem())
    return folder


def parts(tables):
    """The parts of a prediction as one table, in sample_id order."""
    import pyarrow as pa

    return pa.concat_tables(tables).sort_by("sample_id")


@pytest.fixture(scope="module")
def trained(s3_server, tabular_data, tmp_path_factory):
    """A tiny run on the bucket (12 steps, checkpoints at 4, 8, 12), and its copy synced to a local folder."""
    bucket = f"b-{uuid.uuid4().hex[:12]}"
    s3_server.create_bucket(bucket)
    root = tmp_path_factory.mktemp("bucket_commands")
    r = launch.torchrun(tiny(f"s3://{bucket}/runs", tabular_data, 12, "checkpoint.every_steps=4",
                             f"checkpoint.staging_dir={root / 'staging'}", name="r1"), env=s3_server.child_env())
    assert r.returncode == 0, r.stderr[-3000:]
    uri = f"s3://{bucket}/runs/r1"
    return {"bucket": bucket, "uri": uri, "root": root, "local": sync_down(s3_server, uri, root / "copy" / "r1")}


@pytest.fixture(scope="module")
def commands(s3_server, trained, tabular_data):
    """eval and predict under torchrun on the bucket run and on its local copy, one launch of 2 ranks. Before it,
    --out's forced prefix holds an earlier prediction of other inputs and a part-notes.txt of the user's."""
    uri, local, root, bucket = trained["uri"], trained["local"], trained["root"], trained["bucket"]
    forced = f"s3://{bucket}/forced"
    put_object(s3_server, f"{forced}/.stride-predict.json", b'{"run": "another"}\n')
    put_object(s3_server, f"{forced}/part-000000.parquet", b"not this job's part")
    put_object(s3_server, f"{forced}/part-notes.txt", b"the user's notes\n")
    stride = lambda label, *args: {"label": label, "entry": "stride", "args": list(args)}  # noqa: E731
    data = f"{tabular_data}/val"
    cases = [
        stride("eval bucket", "eval", "--run-dir", uri),
        stride("eval local", "eval", "--run-dir", str(local)),
        stride("eval bucket step 8", "eval", "--run-dir", uri, "--checkpoint", "checkpoint_00000008"),
        stride("predict bucket", "predict", "--run-dir", uri, "--data", data, "--out", f"s3://{bucket}/preds"),
        stride("predict local", "predict", "--run-dir", str(local), "--data", data, "--out", str(root / "preds")),
        stride("predict forced", "predict", "--run-dir", uri, "--data", data, "--out", forced, "--force"),
    ]
    launched, ranks = run_torchrun_cases(cases, root / "results", REPO, env=s3_server.child_env())
    return {"launch": launched, "ranks": ranks, "forced": forced, **trained}


def test_eval_of_a_bucket_run_equals_eval_of_its_local_copy_and_lands_in_the_bucket(s3_server, commands):
    uri, local = commands["uri"], commands["local"]
    torchrun_case(commands, "eval bucket")
    torchrun_case(commands, "eval local")
    on_bucket = json.loads(s3_server.read(f"{uri}/eval/checkpoint_00000012.json"))
    on_folder = json.loads((local / "eval" / "checkpoint_00000012.json").read_text())
    assert on_bucket["metrics"] == on_folder["metrics"]  # bitwise: the same checkpoint, data and world size
    assert (on_bucket["checkpoint"], on_bucket["step"]) == (f"{uri}/checkpoint_00000012", 12)
    out = torchrun_case(commands, "eval bucket step 8")
    assert f"written to {uri}/eval/checkpoint_00000008.json" in out
    assert json.loads(s3_server.read(f"{uri}/eval/checkpoint_00000008.json"))["step"] == 8
    # The run's own objects are as training left them, plus eval/; nothing is left in the temporary folder
    assert {n.split("/")[0] for n in s3_server.objects(uri)} == {"checkpoint_00000008", "checkpoint_00000012",
                                                                 "metrics.jsonl", "summary.json", "eval"}


def test_predict_writes_to_a_bucket_what_it_writes_to_a_folder_and_force_keeps_the_users_files(s3_server, commands):
    bucket, root = commands["bucket"], commands["root"]
    for label in ("predict bucket", "predict local", "predict forced"):
        torchrun_case(commands, label)
    local = parts(pq.read_table(p) for p in sorted((root / "preds").glob("part-*.parquet")))
    for prefix in (f"s3://{bucket}/preds", commands["forced"]):
        names = s3_server.objects(prefix)
        assert sorted(n for n in names if n.startswith("part-") and n.endswith(".parquet")) == \
            sorted(p.name for p in (root / "preds").glob("part-*.parquet"))
        got = parts(pq.read_table(io.BytesIO(s3_server.read(f"{prefix}/{n}")))
                    for n in names if n.endswith(".parquet"))
        assert got.equals(local)
        manifest = json.loads(s3_server.read(f"{prefix}/_predict.json"))
        assert (manifest["run"], manifest["rows_written"]) == (commands["uri"], local.num_rows)
    # --force replaced the earlier prediction and left the user's object alone
    assert s3_server.read(f"{commands['forced']}/part-notes.txt") == b"the user's notes\n"


def test_predict_into_a_finished_bucket_prediction_is_refused_without_force(s3_server, commands, tabular_data,
                                                                            in_bucket_env, capsys):
    torchrun_case(commands, "predict bucket")
    out = f"s3://{commands['bucket']}/preds"
    before = s3_server.objects(out)
    line = refusal(capsys, "predict", "--run", commands["uri"], "--data", f"{tabular_data}/val", "--out", out)
    assert line == (f"stride: error: --out ({out}) holds a finished prediction; pass a new prefix, or --force to "
                    f"replace it")
    assert s3_server.objects(out) == before


@pytest.fixture
def in_bucket_env(s3_server, monkeypatch):
    """This process reaches the S3 server as a child through child_env() does; no Ray address (a refusal comes
    before any gang)."""
    for key, value in s3_server.child_env().items():
        if key.startswith("AWS_"):
            monkeypatch.setenv(key, value)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)


def refusal(capsys, *argv: str) -> str:
    """`stride <argv>` in this process: exit 2 with one line on stderr, which is returned."""
    from stride.commands import main

    capsys.readouterr()
    assert main(list(argv)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


def test_export_of_a_bucket_run_equals_export_of_its_local_copy(trained, in_bucket_env, tmp_path, capsys):
    from safetensors.torch import load_file

    from stride.commands import main

    assert main(["export", "--run", trained["uri"], "--out", str(tmp_path / "bucket.safetensors")]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert (shown["checkpoint"], shown["step"]) == (f"{trained['uri']}/checkpoint_00000012", "12")
    assert main(["export", "--run", str(trained["local"]), "--out", str(tmp_path / "local.safetensors")]) == 0
    a, b = load_file(tmp_path / "bucket.safetensors"), load_file(tmp_path / "local.safetensors")
    assert a.keys() == b.keys() and all(np.array_equal(a[k].numpy(), b[k].numpy()) for k in a)
    leftover = [p for p in Path(tempfile.gettempdir()).glob("stride-run-*")
                if p.stat().st_uid == os.getuid() and (p / "r1").exists()]
    assert not leftover  # the downloaded copy is removed


def test_bad_bucket_runs_exit_2_with_one_line(trained, in_bucket_env, capsys):
    bucket = trained["bucket"]
    line = refusal(capsys, "eval", "--run", "s3://no-such-bucket/x/r")
    assert line.startswith("stride: error: --run (s3://no-such-bucket/x/r): the bucket 'no-such-bucket' does not ")
    line = refusal(capsys, "eval", "--run", f"s3://{bucket}/missing-run")
    assert line.startswith(f"stride: error: --run (s3://{bucket}/missing-run) is not a run (no summary.json there)")
    line = refusal(capsys, "export", "--run", f"s3://{bucket}/missing-run", "--out", "/tmp/never.safetensors")
    assert "is not a run (no summary.json there)" in line
    line = refusal(capsys, "eval", "--run", "s3://key:secret@bucket/runs/r1")
    assert "secret" not in line
    assert line.startswith("stride: error: --run (s3://…@bucket/runs/r1) carries credentials")
    line = refusal(capsys, "eval", "--run", trained["uri"], "--checkpoint", "../other/checkpoint_00000004")
    assert "is not a checkpoint of --run" in line
    line = refusal(capsys, "predict", "--run", trained["uri"], "--data", "x", "--out", "s3://no-such-bucket/p")
    assert line.startswith("stride: error: --out (s3://no-such-bucket/p): the bucket 'no-such-bucket' does not exist")
    line = refusal(capsys, "generate", "--run", trained["uri"])
    assert line.startswith(f"stride: error: --run ({trained['uri']}) trained model.name=")


def test_eval_of_a_bucket_run_on_ray_equals_torchrun(s3_server, commands, ray_cluster):
    torchrun_case(commands, "eval bucket")
    uri = commands["uri"]
    reach = {k: v for k, v in s3_server.child_env().items() if k.startswith("AWS_") or k.lower() == "no_proxy"}
    r = run_cli(["-m", "stride", "eval", "--run", uri, "--name", "on-ray"], env={**reach, **ray_cluster})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    on_ray = json.loads(s3_server.read(f"{uri}/eval/on-ray.json"))
    under_torchrun = json.loads(s3_server.read(f"{uri}/eval/checkpoint_00000012.json"))
    assert (on_ray["runtime"], on_ray["world_size"]) == ("ray", 2)
    assert on_ray["metrics"] == under_torchrun["metrics"]
