"""ray_cluster/slurm/stride.sbatch on a real two-node SLURM cluster (tests/slurm_cluster.py). Two 2-node jobs train,
at once on the same nodes: the user's project folder (tests/user_project) submitted from that folder, with one
worker per node, and the built-in tabular task, which a SIGUSR1 mid-run checkpoints, requeues and resumes. They
prove together that jobs sharing the nodes take apart ports (one of them moving off a port a stranger holds), that
tokens and node folders are private, that each node's Ray is stopped by its own launcher and nothing of it is left,
and that the session's shared Ray head, which is not the jobs', survives every job. Two more jobs fail before
training: a node that cannot start, nodes that do not join in time. The port scheme and the script's checks are
tested first, without SLURM."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from conftest import PYTHON, REPO, read_jsonl  # noqa: E402
from runs import OVERLAY

from stride.ray_cluster.slurm.ports import PortError, PortScheme, expand_cpus_per_node, local_indices  # noqa: E402
from test_user_task import TASK, assert_reports_accuracy, copy_project, summary  # noqa: E402

SBATCH = "ray_cluster/slurm/stride.sbatch"
slurm = [pytest.mark.slow, pytest.mark.slurm]


# ---- the port scheme and the script, without SLURM ----------------------------------------------------

def all_ports(p: dict[str, int]) -> set[int]:
    fixed = {v for k, v in p.items() if k not in ("min_worker_port", "max_worker_port")}
    return fixed | set(range(p["min_worker_port"], p["max_worker_port"] + 1))


def test_ports_of_jobs_sharing_a_host_never_overlap():
    scheme = PortScheme()
    seen: dict[int, tuple[int, int]] = {}
    # Any `slots` consecutive job ids, each with up to nodes_per_host nodes on one host.
    for job_id in range(7000, 7000 + scheme.slots):
        for local in range(scheme.nodes_per_host):
            ports = all_ports(scheme.node(job_id, local))
            assert len(ports) == scheme.node_ports - 1  # offset 9 is spare
            assert min(ports) >= scheme.base and max(ports) <= scheme.max_port < 32768  # below Linux ephemeral ports
            for port in ports:
                assert port not in seen, f"job {job_id} node {local} reuses port {port} of {seen[port]}"
                seen[port] = (job_id, local)
    # A requeued job (same id; a new process, maybe on another host) gets the same ports back: they follow from the
    # job id alone, here slot 7001 % 34 = 31 of 256 ports from 24000, and in it the second node's block of 128.
    assert (scheme.node(7001, 1)["gcs"], scheme.node(7001, 1)["max_worker_port"]) == (32064, 32191)


def test_port_settings_that_cannot_work_name_their_knob():
    with pytest.raises(PortError, match="STRIDE_NODE_PORTS"):
        PortScheme(node_ports=12)
    with pytest.raises(PortError, match="STRIDE_NODES_PER_HOST=3"):
        PortScheme().node(5, local_index=2)
    with pytest.raises(PortError, match="widen the range"):
        PortScheme(base=30000, max_port=30100)


def test_node_layout_helpers():
    assert local_indices(["127.0.0.1", "127.0.0.1", "10.0.0.2", "127.0.0.1"]) == [0, 1, 0, 2]
    assert expand_cpus_per_node("2(x3),1", 4) == [2, 2, 2, 1]
    with pytest.raises(PortError, match="STRIDE_CPUS_PER_NODE"):
        expand_cpus_per_node("4", 2)


def test_sbatch_script_header_and_refusal_outside_slurm():
    text = (REPO / SBATCH).read_text()
    for line in ("#SBATCH --signal=B:USR1@120", "#SBATCH --requeue", "#SBATCH --open-mode=append", "#SBATCH --nodes=",
                 "#SBATCH --gpus-per-node=", "#SBATCH --time="):
        assert line in text
    assert not re.search(r"^\s*ray (stop|down)\b", text, re.M), "the script must never run a bare ray stop/down"
    assert subprocess.run(["bash", "-n", SBATCH], cwd=REPO).returncode == 0
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    r = subprocess.run(["bash", SBATCH, "--config", "trainers/configs/tabular_mlp.yaml"], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 1 and "submit this script with sbatch" in r.stderr


# ---- helpers for the SLURM tests ----------------------------------------------------------------------

FINISHED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE",
            "PREEMPTED")


def proc_cmdlines() -> dict[int, str]:
    out = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                out[int(entry)] = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                pass
    return out


def start_time(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


class OutsideHead:
    """The session's shared Ray head (tests/shared_ray.py: token auth, ports outside the SLURM jobs' 24000-32767)
    runs on this host outside SLURM: every job's clean-up must leave it alone. Its daemons (GCS, raylet, dashboard,
    agents; not its workers, which Ray starts and reaps as it likes) are remembered by pid and start time."""

    def __init__(self, shared_ray_head):
        self.head = shared_ray_head.head
        cmdlines = proc_cmdlines()
        self.pids = {p: start_time(p) for p in self.head.pids()
                     if not re.search(r"default_worker\.py|ray::|setup_worker", cmdlines.get(p, "ray::"))}
        assert len(self.pids) >= 4, f"the shared Ray head has only {len(self.pids)} daemon processes: {self.pids}"

    def assert_alive(self) -> None:
        dead = [p for p, t in self.pids.items() if start_time(p) != t]
        assert not dead, f"processes of the Ray head outside SLURM died: {dead}"
        assert set(self.pids) <= set(self.head.pids()), "the Ray head outside SLURM lost processes"
        host, port = self.head.address.rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=5):
            pass  # the GCS still answers


@pytest.fixture(scope="module")
def outside_head(slurm_cluster, shared_ray_head):
    head = OutsideHead(shared_ray_head)
    yield head
    head.assert_alive()


@pytest.fixture(scope="module")
def work(slurm_cluster, tabular_data):
    """Short folders for the jobs (Ray's sockets live under STRIDE_RAY_TMP) and the sbatch environment."""
    root = Path(tempfile.mkdtemp(prefix="sr-sl-", dir="/tmp"))
    (root / "r").mkdir()
    env = dict(slurm_cluster.env, STRIDE_PYTHON=PYTHON, STRIDE_REPO=str(REPO), STRIDE_RAY_TMP=str(root / "r"),
               STRIDE_OBJECT_STORE_BYTES="200000000", PYTHONUNBUFFERED="1")
    for key in [k for k in env if k.startswith("RAY_")]:
        del env[key]
    yield {"root": root, "env": env, "data": tabular_data}
    if not os.environ.get("STRIDE_TEST_KEEP"):  # STRIDE_TEST_KEEP=1 keeps the jobs' outputs and logs
        shutil.rmtree(root, ignore_errors=True)


def sbatch(cluster, work, name: str, sbatch_args: list[str], driver_args: list[str], cwd: Path = REPO,
           **knobs: str) -> str:
    """stride.sbatch (by its path in the checkout) submitted from `cwd`, its output in <root>/<name>.out."""
    env = dict(work["env"], STRIDE_JOB_DIR=str(work["root"] / "jobs" / name), **knobs)
    return cluster.sbatch([f"--job-name={name}", f"--output={work['root'] / (name + '.out')}", *sbatch_args,
                           str(REPO / SBATCH), *driver_args], env=env, cwd=cwd)


def submit(cluster, work, name: str, sbatch_args: list[str], driver_args: list[str], **knobs: str) -> str:
    """A job of the built-in tabular task, from the checkout."""
    data = work["data"]
    return sbatch(cluster, work, name, sbatch_args,
                  ["--config", "trainers/configs/tabular_mlp.yaml", f"data.train_path={data}/train",
                   f"data.val_path={data}/val", f"run.storage_path={run_dir(work, name).parent}", f"run.name={name}",
                   "train.epochs=null", "tracking.mlflow_uri=null", "scaling.num_workers=auto", *driver_args], **knobs)


def run_dir(work, name: str) -> Path:
    # A storage path per job: jobs running at once must not create one MLflow sqlite store together.
    return work["root"] / "runs" / name / name


def output(work, name: str) -> str:
    path = work["root"] / f"{name}.out"
    return path.read_text(errors="replace") if path.exists() else ""


def assert_job_cleaned_up(work, job_id: str, temp_dirs_kept: bool = False) -> None:
    """No process of the job's Ray is left, and (unless kept on purpose) its node temp dirs are gone."""
    marker = f"{work['root'] / 'r'}/stride-{job_id}-"
    deadline = time.time() + 30
    while (left := {p: c for p, c in proc_cmdlines().items() if marker in c}) and time.time() < deadline:
        time.sleep(1)
    assert not left, f"job {job_id} left Ray processes behind: {left}"
    folders = list((work["root"] / "r").glob(f"stride-{job_id}-*"))
    if temp_dirs_kept:
        assert sorted(f.name for f in folders) == [f"stride-{job_id}-n1", f"stride-{job_id}-n2"], folders
    else:
        assert not folders, "a node's Ray temp dir was not removed"


def assert_ray_stopped_by_usr2(work, name: str) -> None:
    """Each node's Ray was stopped by its own launcher (SIGUSR2 through srun), not killed with the step."""
    for node in ("n1", "n2"):
        log = (work["root"] / "jobs" / name / f"ray-{node}.log").read_text()
        assert f"node {node}: SIGUSR2: stopping Ray" in log, log[-2000:]
        assert "still alive after SIGKILL" not in log


def wait_done(cluster, job_id: str, work, name: str, timeout_s: float) -> dict:
    try:
        return cluster.wait_job(job_id, timeout_s)
    except TimeoutError as e:
        pytest.fail(f"{e}\n--- {name}.out ---\n{output(work, name)[-4000:]}")


def logged_steps(metrics: Path, while_written: bool = False) -> list[int]:
    """The steps with a train_loss line in metrics.jsonl; while_written: the file is still being written, and a
    last line not yet complete is not read."""
    if not metrics.exists():
        return []
    if while_written:
        lines = metrics.read_text().split("\n")[:-1]  # only lines that end with a newline
        return [r["step"] for r in map(json.loads, filter(str.strip, lines)) if "train_loss" in r]
    return [r["step"] for r in read_jsonl(metrics) if "train_loss" in r]


# ---- the two jobs that train, at once on both nodes ------------------------------------------------------
#
# U: the user's project folder (tests/user_project) submitted from that folder, 1 SLURM CPU per node but
#    STRIDE_CPUS_PER_NODE=2 (Ray gets 2 per node, so num_workers=auto could pack both workers on one node: it must
#    not), STRIDE_KEEP_RAY_TMP=1 (its nodes' Ray logs show where the workers ran).
# P: the built-in tabular task, 400 steps, SIGUSR1 after its first logged steps: checkpoint, requeue, resume. It is
#    held until a socket that is not Ray holds one of its n2's worker ports: that node must move to a free block.
# Both jobs' Ray heads run on n1 and both their second Ray nodes on n2, at once; their ids differ by one (adjacent
# port slots).

P_STEPS, P_LOG_EVERY = 400, 5


@pytest.fixture(scope="module")
def user_project(work) -> Path:
    return copy_project(work["root"] / "p")


@pytest.fixture(scope="module")
def pair(slurm_cluster, work, user_project, outside_head):
    cluster, root = slurm_cluster, work["root"]
    common = ["--nodes=2", "--cpus-per-task=1"]
    ids = {"U": sbatch(cluster, work, "U", common,
                       ["--config", "signal.yaml", f"run.storage_path={root / 'runs' / 'U'}",
                        "scaling.num_workers=auto", *OVERLAY, "train.max_steps=20",
                        "train.eval_every_steps=10"],
                       cwd=user_project, STRIDE_CPUS_PER_NODE="2", STRIDE_KEEP_RAY_TMP="1")}
    ids["P"] = submit(cluster, work, "P", [*common, "--hold"],
                      [f"train.max_steps={P_STEPS}", f"train.log_every_steps={P_LOG_EVERY}",
                       "checkpoint.every_steps=1000", "train.eval_every_steps=1000"], STRIDE_CPUS_PER_NODE="2")
    # Something that is not Ray holds one of the ports P's n2 would get: n2 must move to a free block.
    taken = PortScheme().node(int(ids["P"]), local_index=1)["min_worker_port"] + 3
    blocker = socket.socket()
    blocker.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    blocker.bind(("0.0.0.0", taken))
    blocker.listen()
    metrics = run_dir(work, "P") / "metrics.jsonl"
    last_seen = None  # P's last logged step when it got SIGUSR1
    both_running = False
    states: dict[str, str | None] = {}
    try:
        assert cluster.run(["scontrol", "release", ids["P"]]).returncode == 0
        deadline, polled = time.time() + 1500, 0.0
        while time.time() < deadline:
            if time.time() - polled >= 1:
                polled = time.time()
                states = {k: cluster.job(j).get("JobState") for k, j in ids.items()}
                both_running |= all(s == "RUNNING" for s in states.values())
                if last_seen is None and states["P"] not in ("PENDING", "RUNNING", "CONFIGURING", None):
                    pytest.fail(f"P ended before it trained ({states['P']}): {output(work, 'P')[-4000:]}")
                if last_seen is not None and all(s in FINISHED for s in states.values()):
                    break
            if last_seen is None and len(seen := logged_steps(metrics, while_written=True)) >= 2:
                last_seen = seen[-1]
                r = cluster.run(["scancel", "--signal=USR1", "--batch", ids["P"]])
                assert r.returncode == 0, r.stderr
            time.sleep(0.2)
        else:
            pytest.fail(f"jobs not done within 1500 s ({states}, P signalled after step {last_seen})\n"
                        f"--- U.out ---\n{output(work, 'U')[-3000:]}\n--- P.out ---\n{output(work, 'P')[-3000:]}")
    finally:
        blocker.close()
    info = {k: wait_done(cluster, j, work, k, 30) for k, j in ids.items()}
    yield {"ids": ids, "info": info, "both_running": both_running, "last_seen": last_seen, "taken": taken}
    for node in ("n1", "n2"):
        shutil.rmtree(root / "r" / f"stride-{ids['U']}-{node}", ignore_errors=True)


@pytest.mark.slow
@pytest.mark.slurm
def test_sbatch_from_the_project_folder_trains_the_users_task(pair, work, outside_head):
    """sbatch runs the batch script in the submit directory and starts the driver there (SLURM_SUBMIT_DIR): the
    user's task module and the relative data paths of signal.yaml are found in the user's folder. The 2-node job
    trains with one worker per node, its token and node folders are private, and each node's Ray is stopped by
    its own launcher."""
    job, out = pair["ids"]["U"], output(work, "U")
    assert pair["info"]["U"]["JobState"] == "COMPLETED", out[-4000:]
    run = work["root"] / "runs" / "U" / "signal"
    s = summary(run)
    assert s["status"] == "completed" and s["global_step"] == 20 and s["world_size"] == 2 and s["task"] == TASK
    assert_reports_accuracy(run, s)
    assert "training signal on 2 CPU worker(s); cluster 4 CPUs, 0 GPUs, 2 node(s)" in out, out[-3000:]
    assert "all 2 node(s) joined: n1 n2" in out
    assert_ray_stopped_by_usr2(work, "U")
    token = work["root"] / "jobs" / "U" / "ray_token"
    assert stat.S_IMODE(token.stat().st_mode) == 0o600
    assert stat.S_IMODE(token.parent.stat().st_mode) == 0o700
    for node in ("n1", "n2"):  # kept (keep_tmp): each node's folder is private, Ray's world-writable one inside it
        folder = work["root"] / "r" / f"stride-{job}-{node}"
        assert stat.S_IMODE(folder.lstat().st_mode) == 0o700 and (folder / "ray").is_dir()
    assert_job_cleaned_up(work, job, temp_dirs_kept=True)
    outside_head.assert_alive()


@pytest.mark.slow
@pytest.mark.slurm
def test_auto_workers_run_one_per_node(pair, work):
    """scaling.num_workers=auto on CPU nodes means one worker per node, although Ray has 2 CPUs on each: summary.json
    names the Ray node of each rank, and the two must differ (PACK would stack both workers on one node)."""
    out = output(work, "U")
    path = re.search(r"stride: summary +(\S+)", out)
    assert path, out[-3000:]
    nodes = json.loads(Path(path.group(1)).read_text())["worker_nodes"]
    assert len(nodes) == 2 and all(nodes), nodes
    assert nodes[0] != nodes[1], f"both training workers ran on node {nodes[0]}: Ray Train packed them onto one node"


@pytest.mark.slow
@pytest.mark.slurm
def test_two_jobs_share_the_nodes_without_port_clashes(pair, work, outside_head):
    ids = pair["ids"]
    assert pair["both_running"], "the two jobs never ran at the same time"
    for name, job in ids.items():
        assert pair["info"][name]["JobState"] == "COMPLETED", output(work, name)[-4000:]
        assert pair["info"][name]["NodeList"] == "n[1-2]"
    plans = {k: json.loads((work["root"] / "jobs" / k / "plan.json").read_text()) for k in ids}
    ports = {k: set().union(*(all_ports(n["ports"]) for n in p["nodes"])) for k, p in plans.items()}
    assert not ports["U"] & ports["P"]
    # Both of a job's nodes live on 127.0.0.1: they took different port blocks.
    for plan in plans.values():
        assert [(n["name"], n["local_index"]) for n in plan["nodes"]] == [("n1", 0), ("n2", 1)], plan["nodes"]
    # P's n2 found one of its ports taken by a stranger and moved to the block of another slot (in both runs).
    log = (work["root"] / "jobs" / "P" / "ray-n2.log").read_text()
    assert f"worker port {pair['taken']}" in log and "using the block of port slot" in log, log[-2000:]
    outside_head.assert_alive()


# ---- preemption: USR1 -> checkpoint -> requeue -> resume -> completion ----------------------------------

@pytest.mark.slow
@pytest.mark.slurm
def test_usr1_checkpoints_requeues_and_resumes(pair, work, outside_head):
    job, out, info = pair["ids"]["P"], output(work, "P"), pair["info"]["P"]
    assert info["JobState"] == "COMPLETED", out[-5000:]
    assert int(info["Restarts"]) >= 1, info
    assert "received SIGUSR1: forwarding it to the driver" in out
    assert "stride: preempted: step" in out and "preempted: requeueing job" in out, out[-5000:]
    m = re.search(r"resumed from \S+ at step (\d+)", out)
    assert m, out[-5000:]
    ckpt_step = int(m.group(1))
    # The checkpoint holds every step logged before the signal (at most the step in flight is redone).
    assert pair["last_seen"] <= ckpt_step < P_STEPS, (pair["last_seen"], ckpt_step)
    # The requeued run (same job id) got the same head ports back.
    slots = re.findall(rf"job {job}: head n1, 2 node\(s\) \[n1 n2\]; GCS \S+, dashboard \S+ \(port slot \d+ of \d+\)",
                       out)
    assert len(slots) == 2 and slots[0] == slots[1], slots
    assert out.count("training P on 2 CPU worker(s); cluster 4 CPUs, 0 GPUs, 2 node(s)") == 2, out[-5000:]

    done = summary(run_dir(work, "P"))
    assert done["status"] == "completed" and done["global_step"] == P_STEPS and done["world_size"] == 2
    assert done["restarts"] >= 1
    logged = logged_steps(run_dir(work, "P") / "metrics.jsonl")
    assert logged == sorted(set(logged)), "metrics.jsonl repeats or reorders steps after the resume"
    assert ckpt_step in logged and logged[-1] == P_STEPS
    after = [s for s in logged if s > ckpt_step]
    first_after = (ckpt_step // P_LOG_EVERY + 1) * P_LOG_EVERY
    assert after == list(range(first_after, P_STEPS + 1, P_LOG_EVERY)), after[:5]
    assert_ray_stopped_by_usr2(work, "P")
    assert_job_cleaned_up(work, job)  # not kept: each node's temp dir is removed
    outside_head.assert_alive()


# ---- jobs that fail before training: a node that cannot start, nodes that do not join in time ----------

@pytest.mark.slow
@pytest.mark.slurm
def test_a_node_that_cannot_start_fails_the_job_naming_it(slurm_cluster, work, outside_head):
    """n2's node-manager port is taken in every port slot before the job starts: n2's launcher cannot start Ray,
    and the job ends with exit 1 and an error naming n2 and the port, instead of waiting for it or training
    without it."""
    scheme = PortScheme()
    blockers = []
    try:
        for slot in range(scheme.slots):
            b = socket.socket()
            b.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            b.bind(("0.0.0.0", scheme.node_at_slot(slot, local_index=1)["node_manager"]))
            b.listen()
            blockers.append(b)
        job = submit(slurm_cluster, work, "X", ["--nodes=2", "--cpus-per-task=1"], ["train.max_steps=10"],
                     STRIDE_JOIN_TIMEOUT_S="120")
        t0 = time.time()
        info = wait_done(slurm_cluster, job, work, "X", 300)
        took = time.time() - t0
    finally:
        for b in blockers:
            b.close()
    port = scheme.node(int(job), local_index=1)["node_manager"]
    out = output(work, "X")
    assert info["JobState"] == "FAILED" and info["ExitCode"].startswith("1:"), (info, out[-3000:])
    assert "node n2" in out and f"node_manager {port}" in out, out[-3000:]
    assert "node n2's launcher" in out and re.search(r"nodes missing: (n1, )?n2 ", out), out[-3000:]
    assert "starting the driver" not in out
    assert took < 120, f"the job took {took:.0f}s to notice n2 was gone"
    assert_job_cleaned_up(work, job)
    outside_head.assert_alive()


@pytest.mark.slow
@pytest.mark.slurm
def test_nodes_that_do_not_join_in_time_fail_the_job_naming_them(slurm_cluster, work, outside_head):
    job = submit(slurm_cluster, work, "T", ["--nodes=2", "--cpus-per-task=1"], ["train.max_steps=10"],
                 STRIDE_JOIN_TIMEOUT_S="3")
    info = wait_done(slurm_cluster, job, work, "T", 300)
    out = output(work, "T")
    assert info["JobState"] == "FAILED" and info["ExitCode"].startswith("1:"), (info, out[-3000:])
    assert re.search(r"not in the Ray cluster after 3s .*nodes missing: (n1, )?n2 ", out), out[-3000:]
    assert "raise STRIDE_JOIN_TIMEOUT_S" in out and "starting the driver" not in out
    assert_job_cleaned_up(work, job)  # Ray stopped mid-start-up leaves nothing behind either
    outside_head.assert_alive()
