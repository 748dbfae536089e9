"""Runs on a bucket through Ray (issue 44): `python -m stride` with run.storage_path=s3://... (and gs://) on the
suite's shared head, whose workers do not share the driver's environment: the driver's storage settings reach them,
the secret stays out of every run file and output; a driver SIGKILLed after a checkpoint is rerun and resumes from the
bucket, ending bitwise as a run never stopped, every step logged once, nothing left in staging; the same run on the
GCS emulator. Then two machines without a shared disk (tests/private_node.py: a second node in a mount namespace of
its own, a tmpfs over /tmp and the test's folders; root only, as CI): one worker on each, the driver killed, the second
machine gone, the resume on the head alone ends bitwise as the run never stopped, and neither disk keeps a run file.
The kill and resume at the torchrun level, the lock and the bad inputs: tests/test_bucket_runs.py."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import textwrap
import time
import uuid
from pathlib import Path

import pytest

from cluster_fixtures import free_ports, short_tmp
from conftest import PYTHON, REPO
from gcs_server import gcs_server_fixture
from private_node import add_private_node, files_in_node, in_node, namespace_problem, write_in_node
from runs import files_under, launch, tiny
from s3_server import environment, node_identity, s3_server_fixture
from shared_ray import SharedHead
from stride.ray_cluster import local

pytestmark = pytest.mark.slow
s3_server = s3_server_fixture()
gcs_server = gcs_server_fixture()

STEPS = 40
EVERY = 10
# Each step waits a little on every rank, so that the driver is still training when the test sees the first
# checkpoint's meta.json in the bucket and kills it (the tabular model's own steps take milliseconds).
THROTTLE = textwrap.dedent("""
    import time
    from stride import Callback

    class Throttle(Callback):
        def on_step_end(self, state, metrics):
            time.sleep(0.2)
""")
SLOW = "train.callbacks=[throttle:Throttle]"


def run_args(data, storage, name, staging, *extra):
    return tiny(storage, data, STEPS, f"checkpoint.every_steps={EVERY}", "train.log_every_steps=1",
                f"train.eval_every_steps={STEPS}", f"checkpoint.staging_dir={staging}", "scaling.num_workers=2",
                *extra, name=name)


def user_env(storage_env: dict, ray_env: dict, project: Path) -> dict:
    """A user's shell (as differs from this process's environment): the storage's settings and its secret, the
    cluster's address, their callbacks' folder."""
    (project / "throttle.py").write_text(THROTTLE)
    python_path = os.pathsep.join(p for p in (str(project), os.environ.get("PYTHONPATH", "")) if p)
    env = dict(storage_env, **ray_env, PYTHONPATH=python_path)
    return {k: v for k, v in env.items() if os.environ.get(k) != v}  # what differs from this process's (launch adds)


def train_losses(text: str) -> list[tuple[int, float]]:
    """(step, train_loss) of every line of a metrics.jsonl that has one, in file order."""
    return [(r["step"], r["train_loss"]) for r in map(json.loads, filter(str.strip, text.splitlines()))
            if "train_loss" in r]


def kill_after_first_checkpoint(args: list[str], env: dict, meta_appeared, timeout_s: float = 300) -> str:
    """Start `python -m stride args`, SIGKILL its process group once meta_appeared() (the bucket holds a complete
    checkpoint); returns its output. Fails when it ends by itself first."""
    proc = subprocess.Popen([PYTHON, "-m", "stride", *args], cwd=REPO, env=dict(os.environ, **env),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + timeout_s
        while not meta_appeared():
            assert proc.poll() is None, "the run ended before its first checkpoint was complete:\n" + \
                proc.communicate()[0][-4000:]
            assert time.monotonic() < deadline, "no complete checkpoint within the time"
            time.sleep(0.2)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return proc.communicate(timeout=60)[0]


@pytest.fixture
def bucket(s3_server):
    return s3_server.new_bucket()


def test_a_driver_killed_on_the_shared_head_resumes_from_the_bucket_bitwise_and_leaves_nothing_behind(
        s3_server, bucket, ray_cluster, shared_ray_head, tabular_data, tmp_path):
    secret = f"sekrit-{uuid.uuid4().hex}"  # moto takes any key: one that can be searched for
    env = user_env(dict(s3_server.child_env(), AWS_SECRET_ACCESS_KEY=secret), ray_cluster, tmp_path)
    staging = tmp_path / "staging"
    runs = f"s3://{bucket}/runs"

    ref = launch.ray(run_args(tabular_data, runs, "ref", staging, SLOW), env)
    assert ref.returncode == 0, ref.stdout[-3000:] + ref.stderr[-3000:]
    summary = json.loads(s3_server.read(f"{runs}/ref/summary.json"))
    assert summary["status"] == "completed" and summary["world_size"] == 2 and summary["global_step"] == STEPS
    assert files_under(staging) == []
    assert not shared_ray_head.wait_idle()

    args = run_args(tabular_data, runs, "cut", staging, SLOW)
    first_meta = f"{bucket}/runs/cut/checkpoint_{EVERY:08d}/meta.json"
    killed = kill_after_first_checkpoint(args, env, lambda: first_meta in s3_server.list(f"{runs}/cut"))
    assert "summary.json" not in s3_server.objects(f"{runs}/cut"), killed[-3000:]
    assert not shared_ray_head.wait_idle()  # the GCS removed the killed driver's gang

    resumed = launch.ray(args, env)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "resuming cut from checkpoint_" in resumed.stdout, resumed.stdout[-3000:]

    want = train_losses(s3_server.read(f"{runs}/ref/metrics.jsonl").decode())
    got = train_losses(s3_server.read(f"{runs}/cut/metrics.jsonl").decode())
    assert [step for step, _ in got] == list(range(1, STEPS + 1))  # every step once, in order, across the kill
    assert got == want  # bitwise
    assert files_under(staging) == []

    # The key reached the workers (they uploaded the shards) through the job's runtime_env, and nowhere else.
    for name in ("ref", "cut"):
        for key in s3_server.objects(f"{runs}/{name}"):
            assert secret.encode() not in s3_server.read(f"{runs}/{name}/{key}"), key
    for out in (ref.stdout + ref.stderr, killed, resumed.stdout + resumed.stderr):
        assert secret not in out


def test_two_workers_on_the_shared_head_train_to_a_gcs_bucket(gcs_server, ray_cluster, tabular_data, tmp_path):
    bucket = f"b-{uuid.uuid4().hex[:12]}"
    gcs_server.make_bucket(bucket)
    staging = tmp_path / "staging"
    run = f"gs://{bucket}/runs/g"

    # The bucket's keys, optim.implementation and train.gc_every_steps, rebuilt by the Ray workers from the driver's
    # dict.
    keys = ("checkpoint.upload=sync", "checkpoint.max_upload_failures=2", "optim.implementation=for_loop",
            "train.gc_every_steps=7")
    done = launch.ray(run_args(tabular_data, f"gs://{bucket}/runs", "g", staging, *keys),
                      user_env(gcs_server.child_env(), ray_cluster, tmp_path))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    fs = gcs_server.filesystem()
    listed = [p.removeprefix(f"{bucket}/runs/g/") for p in gcs_server.list(run)]
    summary = json.loads(fs.cat_file(f"{bucket}/runs/g/summary.json"))
    assert summary["status"] == "completed" and summary["world_size"] == 2 and summary["global_step"] == STEPS
    assert (summary["config"]["checkpoint"]["upload"], summary["config"]["optim"]["implementation"],
            summary["config"]["train"]["gc_every_steps"]) == ("sync", "for_loop", 7)
    # keep_last's newest checkpoints, each with both workers' shards and meta.json, which rank 0 writes last
    newest = sorted({n.split("/")[0] for n in listed if n.startswith("checkpoint_")})[-1]
    assert newest == f"checkpoint_{STEPS:08d}"
    meta = json.loads(fs.cat_file(f"{bucket}/runs/g/{newest}/meta.json"))
    assert sorted(meta["files"]) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert {f"{newest}/{f}" for f in meta["files"]} <= set(listed)
    steps = [step for step, _ in train_losses(fs.cat_file(f"{bucket}/runs/g/metrics.jsonl").decode())]
    assert steps == list(range(1, STEPS + 1)) and "stride.lock" not in listed
    assert files_under(staging) == []


@pytest.fixture(scope="module")
def two_machines(s3_server, tabular_data, tmp_path_factory):
    """A head (2 CPUs) and a second node (2 CPUs) in a mount namespace of its own, a tmpfs over its /tmp and the
    test's folders: two machines that share no disk, only the network (the cluster, the bucket). The data is in the
    bucket, as a multi-node run's must be."""
    if problem := namespace_problem():
        pytest.skip(problem)
    bucket = f"b-{uuid.uuid4().hex[:12]}"
    data = s3_server.upload(tabular_data, bucket, "tab")
    head_dir, node_dir = short_tmp("stc-head-"), short_tmp("stc-node-")
    gcs, dashboard = free_ports(2)
    with environment(node_identity()):  # each node's own credentials, as a real node's instance profile
        head = local.start_head(head_dir, port=gcs, dashboard_port=dashboard, num_cpus=2)
    try:
        with environment(node_identity()):
            add_private_node(head, node_dir, [tmp_path_factory.getbasetemp()], num_cpus=2)
        # What it sees is its own: a fresh tmpfs, without this machine's files there.
        assert in_node(node_dir, "findmnt", "-n", "-o", "FSTYPE", "/tmp").stdout.split() == ["tmpfs"]
        assert in_node(node_dir, "test", "-e", str(tabular_data)).returncode == 1 and tabular_data.exists()
        yield {"head": head, "node_dir": node_dir, "bucket": bucket, "data": data}
    finally:
        local.stop_node(node_dir)  # by pid: its tmpfs goes with its last process
        local.stop_head(head)
        for folder in (head_dir, node_dir):
            shutil.rmtree(folder, ignore_errors=True)


def test_two_machines_without_a_shared_disk_resume_from_the_bucket_on_one_bitwise_and_keep_no_run_file(
        two_machines, s3_server, tmp_path):
    head, node_dir, bucket = two_machines["head"], two_machines["node_dir"], two_machines["bucket"]
    runs = f"s3://{bucket}/runs"
    staging = tmp_path / "staging"
    env = user_env(s3_server.child_env(), head.client_env(), tmp_path)
    write_in_node(node_dir, tmp_path / "throttle.py", THROTTLE)  # the user's code, installed on each machine
    # 2 CPUs a worker: one worker per node. One torch thread, whatever the CPUs, so that the resume on one node
    # computes as the two did.
    one_per_node = (SLOW, "scaling.cpus_per_worker=2", "train.num_threads=1")
    idle = SharedHead(head)

    ref = launch.ray(run_args(two_machines["data"], runs, "ref", staging, *one_per_node), env)
    assert ref.returncode == 0, ref.stdout[-3000:] + ref.stderr[-3000:]
    assert "2 node(s)" in ref.stdout and json.loads(s3_server.read(f"{runs}/ref/summary.json"))["world_size"] == 2
    # Rank 1 worked on the second machine's own disk (its staging root exists only there), and left no file on it.
    assert in_node(node_dir, "test", "-d", str(staging)).returncode == 0
    assert files_in_node(node_dir, staging) == [] and files_under(staging) == []
    assert not idle.wait_idle()

    # eval on both machines: the driver downloads the run on the head; the worker on the second machine fetches its
    # own copy to the same path (its disk has none), and removes it after.
    evaluated = launch.ray(["eval", "--run", f"{runs}/ref", "--name", "two-nodes", "scaling.num_workers=2",
                            "scaling.cpus_per_worker=2", "train.num_threads=1"], env, entry=("-m", "stride"))
    assert evaluated.returncode == 0, evaluated.stdout[-3000:] + evaluated.stderr[-3000:]
    assert "2 node(s)" in evaluated.stdout
    record = json.loads(s3_server.read(f"{runs}/ref/eval/two-nodes.json"))
    final = json.loads(s3_server.read(f"{runs}/ref/summary.json"))
    assert record["val_loss"] == pytest.approx(final["val_loss"], rel=1e-6), (record, final)
    assert in_node(node_dir, "sh", "-c", "ls -d /tmp/stride-run-* 2>/dev/null").stdout.strip() == ""
    assert not idle.wait_idle()

    args = run_args(two_machines["data"], runs, "cut", staging, *one_per_node)
    first_meta = f"{bucket}/runs/cut/checkpoint_{EVERY:08d}/meta.json"
    killed = kill_after_first_checkpoint(args, env, lambda: first_meta in s3_server.list(f"{runs}/cut"))
    assert "summary.json" not in s3_server.objects(f"{runs}/cut"), killed[-3000:]
    assert not idle.wait_idle()
    local.stop_node(node_dir)  # the second machine is gone, its disk (rank 1's working copy) with it

    resumed = launch.ray(run_args(two_machines["data"], runs, "cut", staging, SLOW, "scaling.cpus_per_worker=1",
                                  "train.num_threads=1"), env)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "1 node(s)" in resumed.stdout and "resuming cut from checkpoint_" in resumed.stdout, resumed.stdout[-3000:]
    want = train_losses(s3_server.read(f"{runs}/ref/metrics.jsonl").decode())
    got = train_losses(s3_server.read(f"{runs}/cut/metrics.jsonl").decode())
    assert [step for step, _ in got] == list(range(1, STEPS + 1))  # every step once, in order, across the kill
    assert got == want  # bitwise: rank 1's shard came from the bucket, not from the disk it was written on
    assert files_under(staging) == []
    assert not idle.wait_idle()
