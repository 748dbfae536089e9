"""Runs on a bucket (`run.storage_path: s3://...`, issue 44), trained under torchrun against the suite's S3 server:
the checkpoint commit (meta.json last), a kill and resume that ends bitwise as a run never stopped, metrics.jsonl with
every step once, staging left empty, and the lock on conditional writes. torchrun is the cheapest level that has a
gang (the commit gathers every rank's shards); the Ray path is tests/test_bucket_ray.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import textwrap
import time

import pytest

from conftest import REPO, torchrun_launcher
from runs import TORCHRUN_PY, files_under, launch, tiny
from s3_server import s3_server_fixture

pytestmark = pytest.mark.slow
s3_server = s3_server_fixture()

# SIGKILLs rank 0 once the checkpoint of KILL_AT_STEP is complete in the bucket (the writer calls
# on_checkpoint_complete after meta.json is there, while training has gone on meanwhile); torchrun then stops the rest.
KILLER = textwrap.dedent("""
    import os, signal
    from stride import Callback

    class KillAfterCheckpoint(Callback):
        def on_checkpoint_complete(self, state, folder):
            if os.environ.get("KILL_AT_STEP") and folder.name.endswith(os.environ["KILL_AT_STEP"].zfill(8)):
                os.kill(os.getpid(), signal.SIGKILL)
""")


@pytest.fixture
def bucket(s3_server):
    return s3_server.new_bucket()


def metrics(s3, run_uri: str) -> list[dict]:
    return [json.loads(line) for line in s3.read(f"{run_uri}/metrics.jsonl").decode().splitlines() if line]


def trained(s3, run_uri: str) -> bool:
    return "metrics.jsonl" in s3.objects(run_uri) and any("train_loss" in r for r in metrics(s3, run_uri))


def args(data, bucket, name, steps, staging, *extra):
    return tiny(f"s3://{bucket}/runs", data, steps, "checkpoint.every_steps=6", "train.log_every_steps=1",
                f"checkpoint.staging_dir={staging}", *extra, name=name)


def test_a_killed_bucket_run_resumes_bitwise_with_every_step_logged_once_and_nothing_left_on_disk(
        s3_server, bucket, tabular_data, tmp_path):
    env = s3_server.child_env()
    staging = tmp_path / "staging"
    ref = launch.torchrun(args(tabular_data, bucket, "ref", 30, staging), env=env)
    assert ref.returncode == 0, ref.stderr[-3000:]
    ref_uri = f"s3://{bucket}/runs/ref"
    listed = s3_server.objects(ref_uri)
    # keep_last=2 in the bucket; every complete checkpoint has both ranks' shards, DCP's metadata and meta.json last
    assert sorted({n.split("/")[0] for n in listed if n.startswith("checkpoint_")}) == ["checkpoint_00000024",
                                                                                       "checkpoint_00000030"]
    meta = json.loads(s3_server.read(f"{ref_uri}/checkpoint_00000030/meta.json"))
    assert sorted(meta["files"]) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert "summary.json" in listed and "stride.lock" not in listed
    assert files_under(staging) == []  # the working copy and the staged shards are gone

    (tmp_path / "killer.py").write_text(KILLER)
    cut_args = args(tabular_data, bucket, "cut", 30, staging, "train.callbacks=[killer:KillAfterCheckpoint]")
    killed = subprocess.run([*torchrun_launcher(2), TORCHRUN_PY, *cut_args], cwd=REPO, capture_output=True,
                            text=True, env=dict(os.environ, **env, KILL_AT_STEP="12", STRIDE_TASK_PATH=str(tmp_path)),
                            timeout=600, start_new_session=True)
    assert killed.returncode == 1 and "exitcode: -9" in killed.stderr, killed.stderr[-3000:]
    cut_uri = f"s3://{bucket}/runs/cut"
    assert "summary.json" not in s3_server.objects(cut_uri)
    # The resume takes over the lock the killed run left: same host, its pid dead.
    resumed = launch.torchrun(cut_args, env=dict(env, STRIDE_TASK_PATH=str(tmp_path)))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming cut from checkpoint_00000012" in resumed.stdout, resumed.stdout[-2000:]

    want = {r["step"]: r["train_loss"] for r in metrics(s3_server, ref_uri) if "train_loss" in r}
    lines = [r for r in metrics(s3_server, cut_uri) if "train_loss" in r]
    assert [r["step"] for r in lines] == list(range(1, 31))  # every step once, in order, across the kill
    assert {r["step"]: r["train_loss"] for r in lines} == want  # bitwise
    assert files_under(staging) == []


def test_a_second_run_of_the_same_name_exits_2_naming_the_holder_and_the_first_logs_every_step_once(
        s3_server, bucket, tabular_data, tmp_path):
    env = s3_server.child_env()
    first = subprocess.Popen([*torchrun_launcher(1), TORCHRUN_PY,
                              *args(tabular_data, bucket, "one", 400, tmp_path / "a", "train.log_every_steps=10")],
                             cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env=dict(os.environ, **env), start_new_session=True)
    try:
        deadline = time.time() + 120
        while "stride.lock" not in s3_server.objects(f"s3://{bucket}/runs/one") and time.time() < deadline:
            assert first.poll() is None, first.communicate()[1][-3000:]
            time.sleep(0.2)
        second = launch.forked(args(tabular_data, bucket, "one", 400, tmp_path / "b"), env=env)
        assert second.returncode == 2, second.stderr
        lines = [ln for ln in second.stderr.splitlines() if ln.strip()]
        assert len(lines) == 1 and "run.name (one)" in lines[0] and "s3://" in lines[0] and "in use by another run" \
            in lines[0] and "pid" in lines[0], lines
        out, err = first.communicate(timeout=600)
        assert first.returncode == 0, err[-3000:]
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
    steps = [r["step"] for r in metrics(s3_server, f"s3://{bucket}/runs/one") if "train_loss" in r]
    assert steps == list(range(10, 401, 10))


def test_a_stale_lock_is_taken_over_with_one_warning(s3_server, bucket, tabular_data, tmp_path):
    stale = {"token": "x" * 32, "fence": 4, "host": "elsewhere", "pid": 1, "started": time.time() - 3600}
    _put(s3_server, f"{bucket}/runs/st/stride.lock", json.dumps(stale).encode())  # another host's, long silent
    # run.lock_stale_s=6: the lock's heartbeat is older than that on the server's clock. (Not less: the run's own
    # heartbeat must never look stale to its fence on a loaded machine, where a beat can be seconds late.)
    time.sleep(6.5)
    done = launch.forked(args(tabular_data, bucket, "st", 4, tmp_path / "s", "run.lock_stale_s=6"),
                         env=s3_server.child_env())
    assert done.returncode == 0, done.stderr[-3000:]
    warnings = [ln for ln in done.stderr.splitlines() if "taking over the run lock" in ln]
    assert len(warnings) == 1 and "host elsewhere" in warnings[0] and "stale heartbeat" in warnings[0], done.stderr


def _put(s3, path: str, data: bytes) -> None:
    with s3.filesystem().open_output_stream(path) as f:
        f.write(data)


@pytest.mark.parametrize("storage, words", [
    ("hdfs://nn/runs", "scheme 'hdfs'"),
    ("s3://bucket-x/runs/../other", "'..' segment"),
    ("s3://AKIAFAKE:sekrit@bucket-x/runs", "carries credentials"),
])
def test_bad_storage_uris_exit_2_with_one_line(storage, words, tmp_path, tabular_data):
    done = launch.forked(tiny(storage, tabular_data, 2))
    lines = [ln for ln in done.stderr.splitlines() if ln.strip()]
    assert done.returncode == 2 and len(lines) == 1, done.stderr
    assert "run.storage_path" in lines[0] and words in lines[0]
    assert "sekrit" not in done.stdout + done.stderr


def test_a_missing_bucket_and_missing_credentials_exit_2_naming_the_key_and_no_secret(s3_server, bucket, tabular_data,
                                                                                      tmp_path):
    env = s3_server.child_env()
    missing = launch.forked(tiny("s3://no-such-bucket-42/runs", tabular_data, 2), env=env)
    lines = [ln for ln in missing.stderr.splitlines() if ln.strip()]
    assert missing.returncode == 2 and len(lines) == 1, missing.stderr
    assert "run.storage_path (s3://no-such-bucket-42/runs)" in lines[0] and "does not exist" in lines[0]

    no_creds = {k: v for k, v in env.items() if k not in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")}
    nocred = launch.forked(tiny(f"s3://{bucket}/runs", tabular_data, 2), env=no_creds)
    lines = [ln for ln in nocred.stderr.splitlines() if ln.strip()]
    assert nocred.returncode == 2 and len(lines) == 1, nocred.stderr
    assert "no credentials" in lines[0]
    for secret in (env["AWS_SECRET_ACCESS_KEY"],):
        assert f"={secret}" not in missing.stdout + missing.stderr + nocred.stdout + nocred.stderr


def test_a_prefix_holding_another_models_run_exits_2_before_training(s3_server, bucket, tabular_data, tmp_path):
    env = s3_server.child_env()
    first = launch.forked(args(tabular_data, bucket, "m", 6, tmp_path / "s"), env=env)
    assert first.returncode == 0, first.stderr[-3000:]
    before = {n: s3_server.read(f"s3://{bucket}/runs/m/{n}") for n in s3_server.objects(f"s3://{bucket}/runs/m")}
    other = launch.forked(args(tabular_data, bucket, "m", 6, tmp_path / "s", "model.hidden_sizes=[16]"), env=env)
    lines = [ln for ln in other.stderr.splitlines() if ln.strip()]
    assert other.returncode == 2 and len(lines) == 1 and "of another model" in lines[0], other.stderr
    after = {n: s3_server.read(f"s3://{bucket}/runs/m/{n}") for n in s3_server.objects(f"s3://{bucket}/runs/m")}
    assert after == before  # nothing of the run was touched


def test_keep_best_keeps_its_copies_in_the_bucket_beside_keep_last(s3_server, bucket, tabular_data, tmp_path):
    """checkpoint.keep_best on a bucket: best/ is a prefix of server-side copies (no hard links there) that keep_last's
    pruning never takes, ranked from the bucket's own meta.json files, and summary.json names them by URI."""
    env = s3_server.child_env()
    done = launch.forked(args(tabular_data, bucket, "kb", 24, tmp_path / "s", "train.eval_every_steps=6",
                              "checkpoint.keep_last=1", "checkpoint.keep_best={k: 2}"), env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    run = f"s3://{bucket}/runs/kb"
    listed = s3_server.objects(run)
    assert sorted({n.split("/")[0] for n in listed if n.startswith("checkpoint_")}) == ["checkpoint_00000024"]
    val = {r["step"]: r["val_loss"] for r in metrics(s3_server, run) if "val_loss" in r and r["step"] > 0}
    best = sorted(val, key=lambda s: (val[s], s))[:2]
    kept = sorted({n.split("/")[1] for n in listed if n.startswith("best/")})
    assert kept == sorted(f"checkpoint_{s:08d}" for s in best)
    for name in kept:  # each copy is whole: its meta.json names files that are all there
        meta = json.loads(s3_server.read(f"{run}/best/{name}/meta.json"))
        assert {f"best/{name}/{f}" for f in meta["files"]} <= set(listed)
    summary = json.loads(s3_server.read(f"{run}/summary.json"))
    assert sorted(b["checkpoint"] for b in summary["best_checkpoints"]) == [f"{run}/best/{n}" for n in kept]


def test_tensorboard_files_reach_the_bucket_and_leave_no_local_copy(s3_server, bucket, tabular_data, tmp_path):
    """A tracker's local files (TensorBoard's events) are written in the working copy and synced under the run's
    prefix at checkpoints and at the end; the working copy is gone afterwards."""
    env = s3_server.child_env()
    done = launch.forked(args(tabular_data, bucket, "tb", 12, tmp_path / "s", "tracking.sinks=[tensorboard]"), env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    events = [n for n in s3_server.objects(f"s3://{bucket}/runs/tb") if n.startswith("tensorboard/")]
    assert events and all("tfevents" in n for n in events), events
    assert files_under(tmp_path / "s") == []


# The storage goes away (the proxy in front of the S3 server resets every connection) from the step before
# OUTAGE_AT's checkpoint until that checkpoint's upload has been given up (its staging is removed), then comes back;
# with KILL_AFTER_OUTAGE the process is SIGKILLed right then, before any later checkpoint.
OUTAGE = textwrap.dedent("""
    import os, signal, time
    from pathlib import Path
    from stride import Callback

    class Outage(Callback):
        def on_step_end(self, state, metrics):
            at, switch = int(os.environ["OUTAGE_AT"]), Path(os.environ["OUTAGE_SWITCH"])
            if state.step == at - 1:
                while any(Path(state.run_dir).glob("checkpoint_*")):  # the one before is up: nothing in flight
                    time.sleep(0.05)
                switch.touch()
            if state.step == at + 1 and switch.exists() and not os.environ.get("OUTAGE_FOREVER"):
                staged = Path(state.run_dir) / f"checkpoint_{at:08d}"
                deadline = time.time() + 300
                while staged.exists() and time.time() < deadline:  # training went on; the upload is retrying
                    time.sleep(0.2)
                switch.unlink()
                if os.environ.get("KILL_AFTER_OUTAGE"):
                    os.kill(os.getpid(), signal.SIGKILL)
""")


@pytest.fixture
def outage(s3_server, tmp_path):
    from tcp_proxy import CuttableProxy

    proxy = CuttableProxy(s3_server.port, tmp_path / "switch")
    env = dict(s3_server.child_env(), AWS_ENDPOINT_URL=proxy.endpoint, AWS_ENDPOINT_URL_S3=proxy.endpoint,
               OUTAGE_SWITCH=str(tmp_path / "switch"), STRIDE_TASK_PATH=str(tmp_path))
    (tmp_path / "outage.py").write_text(OUTAGE)
    yield env
    proxy.close()


def test_an_upload_cut_off_never_commits_training_goes_on_and_a_resume_takes_the_last_complete(
        s3_server, bucket, tabular_data, tmp_path, outage):
    run_args = args(tabular_data, bucket, "cut", 24, tmp_path / "s", "train.callbacks=[outage:Outage]")
    first = launch.forked(run_args, env=dict(outage, OUTAGE_AT="12", KILL_AFTER_OUTAGE="1"), timeout=600)
    assert first.returncode == -signal.SIGKILL, first.stderr[-3000:]
    warned = [ln for ln in (first.stdout + first.stderr).splitlines() if "checkpoint checkpoint_00000012 could not be uploaded" in ln]
    assert len(warned) == 1 and "1 in a row" in warned[0] and "previous checkpoint stays the newest" in warned[0], \
        first.stdout[-3000:] + first.stderr[-3000:]
    assert "step 13/24" in first.stderr + first.stdout  # the step after the checkpoint trained while it uploaded
    listed = s3_server.objects(f"s3://{bucket}/runs/cut")
    assert "checkpoint_00000006/meta.json" in listed and "checkpoint_00000012/meta.json" not in listed

    resumed = launch.forked(run_args, env=dict(outage, OUTAGE_AT="0"), timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming cut from checkpoint_00000006" in resumed.stdout
    steps = [r["step"] for r in metrics(s3_server, f"s3://{bucket}/runs/cut") if "train_loss" in r]
    assert steps == list(range(1, 25))
    assert files_under(tmp_path / "s") == []


def test_uploads_failing_max_upload_failures_times_in_a_row_fail_the_run_with_one_line(
        s3_server, bucket, tabular_data, tmp_path, outage):
    run_args = args(tabular_data, bucket, "down", 30, tmp_path / "s", "checkpoint.max_upload_failures=2",
                    "checkpoint.every_steps=2", "train.callbacks=[outage:Outage]")
    (tmp_path / "switch").touch()  # unreachable before the start: refused before anything is written
    early = launch.forked(run_args, env=dict(outage, OUTAGE_AT="0"), timeout=600)
    lines = [ln for ln in early.stderr.splitlines() if ln.strip()]
    assert early.returncode == 2 and len(lines) == 1 and "run.storage_path (s3://" in lines[0], early.stderr
    (tmp_path / "switch").unlink()
    # Down from step 1 on, for good: the checkpoints of steps 2 and 4 fail to upload, and the run ends at the second.
    done = launch.forked(run_args, env=dict(outage, OUTAGE_AT="2", OUTAGE_FOREVER="1"), timeout=600)
    assert done.returncode == 1, done.stderr[-3000:]
    last = [ln for ln in done.stderr.splitlines() if ln.strip()][-1]
    assert "could not be uploaded" in last and "2 in a row (checkpoint.max_upload_failures=2)" in last, last
    (tmp_path / "switch").unlink()
    assert not [n for n in s3_server.objects(f"s3://{bucket}/runs/down") if n.endswith("meta.json")]


def test_a_resume_reads_only_the_byte_ranges_of_the_tensors_each_rank_holds(s3_server, bucket, tabular_data, tmp_path):
    """FSDP at 2 ranks: each rank holds half of every parameter, so a resume from the bucket reads about one copy of
    the shards in all (DCP's resharding over ranged reads), where downloading the checkpoint on each rank would read
    two. Measured as the bytes the S3 server sends through a proxy while the resumed run starts and trains 1 step."""
    from tcp_proxy import CuttableProxy

    proxy = CuttableProxy(s3_server.port, tmp_path / "never")
    env = dict(s3_server.child_env(), AWS_ENDPOINT_URL=proxy.endpoint, AWS_ENDPOINT_URL_S3=proxy.endpoint)
    big = ("model.hidden_sizes=[768,768]", "train.strategy=fsdp", "checkpoint.every_steps=4", "checkpoint.keep_last=1")
    try:
        first = launch.torchrun(args(tabular_data, bucket, "fs", 4, tmp_path / "s", *big), env=env)
        assert first.returncode == 0, first.stderr[-3000:]
        shards = sum(size for name, size in s3_server_sizes(s3_server, f"s3://{bucket}/runs/fs/checkpoint_00000004")
                     if name.endswith(".distcp"))
        before = proxy.bytes_down
        resumed = launch.torchrun(args(tabular_data, bucket, "fs", 5, tmp_path / "s", *big), env=env)
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        assert "resuming fs from checkpoint_00000004" in resumed.stdout
        read = proxy.bytes_down - before
    finally:
        proxy.close()
    assert shards > 4_000_000  # the shards dominate everything else the resume reads (meta, metrics, lock)
    assert read < 1.4 * shards, f"the resume read {read} bytes of {shards} in shards: whole files on each rank?" + resumed.stdout[-3000:]


def s3_server_sizes(s3, uri: str) -> list[tuple[str, int]]:
    from pyarrow import fs as pafs

    infos = s3.filesystem().get_file_info(pafs.FileSelector(uri.removeprefix("s3://"), recursive=True))
    return [(i.path, i.size) for i in infos if i.type == pafs.FileType.File]


def test_a_lock_replaced_while_a_run_trains_fences_it_exit_1_and_it_writes_nothing_more(
        s3_server, bucket, tabular_data, tmp_path):
    env = s3_server.child_env()
    run = f"s3://{bucket}/runs/fenced"
    proc = subprocess.Popen([*torchrun_launcher(1), TORCHRUN_PY,
                             *args(tabular_data, bucket, "fenced", 3000, tmp_path / "s", "train.log_every_steps=10")],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, **env), start_new_session=True)
    try:
        deadline = time.time() + 120
        while not trained(s3_server, run) and time.time() < deadline:  # a logged step, not just the run's header
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            time.sleep(0.2)
        other = {"token": "f" * 32, "fence": 99, "host": "another-host", "pid": 7, "started": time.time()}
        _put(s3_server, f"{bucket}/runs/fenced/stride.lock", json.dumps(other).encode())  # another run took it
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 1, err[-3000:]
    assert "is no longer this run's" in err and "host another-host" in err
    after = {n: s3_server.read(f"{run}/{n}") for n in s3_server.objects(run)}
    time.sleep(2)  # anything still writing in the background would land now
    assert {n: s3_server.read(f"{run}/{n}") for n in s3_server.objects(run)} == after
    assert json.loads(after["stride.lock"])["token"] == "f" * 32  # the other run's lock, left alone
    assert "summary.json" not in after  # the fenced run records nothing over the other run's folder
    steps = [r["step"] for r in metrics(s3_server, run) if "train_loss" in r]
    assert steps and steps[-1] < 3000


@pytest.mark.parametrize("first", ["bucket", "folder"])
def test_a_run_copied_between_a_bucket_and_a_folder_resumes_on_the_other_side(
        first, s3_server, bucket, tabular_data, tmp_path):
    """The names under <storage_path>/<run.name>/ are the same in a folder and a bucket: a run copied with the
    cloud's own sync tool resumes from the copy, and ends bitwise as a run never moved."""
    from pyarrow import fs as pafs

    env = s3_server.child_env()
    folder, uri = tmp_path / "runs", f"s3://{bucket}/runs"
    ref = launch.forked(tiny(tmp_path / "ref", tabular_data, 12, "checkpoint.every_steps=6", "train.log_every_steps=1",
                             name="m"), env=env)
    (tmp_path / "killer.py").write_text(KILLER)
    assert ref.returncode == 0, ref.stderr[-3000:]
    here, there = (uri, folder) if first == "bucket" else (folder, uri)
    part = launch.forked(tiny(here, tabular_data, 12, "checkpoint.every_steps=6", "train.log_every_steps=1",
                              "train.callbacks=[killer:KillAfterCheckpoint]", f"checkpoint.staging_dir={tmp_path / 's'}",
                              name="m"), env=dict(env, KILL_AT_STEP="6", STRIDE_TASK_PATH=str(tmp_path)))
    assert part.returncode == -signal.SIGKILL, part.stderr[-3000:]
    # `aws s3 sync` either way: every object of the run, as files (or the other way round)
    local, s3fs_ = pafs.LocalFileSystem(), s3_server.filesystem()
    (folder / "m").mkdir(parents=True, exist_ok=True)
    if first == "bucket":
        pafs.copy_files(f"{bucket}/runs/m", str(folder / "m"), source_filesystem=s3fs_, destination_filesystem=local)
    else:
        pafs.copy_files(str(folder / "m"), f"{bucket}/runs/m", source_filesystem=local, destination_filesystem=s3fs_)
    resumed = launch.forked(tiny(there, tabular_data, 12, "checkpoint.every_steps=6", "train.log_every_steps=1",
                                 "train.callbacks=[killer:KillAfterCheckpoint]", f"checkpoint.staging_dir={tmp_path / 's'}",
                                 name="m"), env=dict(env, STRIDE_TASK_PATH=str(tmp_path)))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming m from checkpoint_00000006" in resumed.stdout
    want = {r["step"]: r["train_loss"] for r in map(json.loads, (tmp_path / "ref" / "m" / "metrics.jsonl")
                                                    .read_text().splitlines()) if "train_loss" in r}
    got_lines = (metrics(s3_server, f"{uri}/m") if first == "folder" else
                 [json.loads(ln) for ln in (folder / "m" / "metrics.jsonl").read_text().splitlines() if ln])
    got = {r["step"]: r["train_loss"] for r in got_lines if "train_loss" in r}
    assert got == want


def test_ema_and_the_data_position_come_back_from_the_bucket_exactly(s3_server, bucket, tabular_data, tmp_path):
    """A callback's tensor state (train.ema's average) and the data position are in the bucket's checkpoint: a run
    killed after its checkpoint and resumed from the bucket evaluates its average as a run never stopped, bit for
    bit."""
    env = dict(s3_server.child_env(), STRIDE_TASK_PATH=str(tmp_path))
    (tmp_path / "killer.py").write_text(KILLER)
    ema = ("train.ema={decay: 0.9, eval: both}", "train.eval_every_steps=12", "model.dropout=0.1",
           "train.callbacks=[killer:KillAfterCheckpoint]")
    ref = launch.forked(args(tabular_data, bucket, "eref", 12, tmp_path / "s", *ema), env=env)
    assert ref.returncode == 0, ref.stderr[-3000:]
    cut = launch.forked(args(tabular_data, bucket, "ecut", 12, tmp_path / "s", *ema), env=dict(env, KILL_AT_STEP="6"))
    assert cut.returncode == -signal.SIGKILL, cut.stderr[-3000:]
    resumed = launch.forked(args(tabular_data, bucket, "ecut", 12, tmp_path / "s", *ema), env=env)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming ecut from checkpoint_00000006" in resumed.stdout
    last = lambda run: [r for r in metrics(s3_server, f"s3://{bucket}/runs/{run}") if "val_loss" in r][-1]  # noqa: E731
    want, got = last("eref"), last("ecut")
    assert any(k.endswith("_ema") for k in want), want  # the average was evaluated beside the raw weights
    assert got == want
