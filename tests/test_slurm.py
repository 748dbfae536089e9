"""ray_cluster/slurm/stride.sbatch on a real two-node SLURM cluster (tests/slurm_cluster.py): a 2-node job trains
with one worker per node; a SIGUSR1 mid-run checkpoints, requeues and resumes; two jobs share the nodes at once;
a Ray head that is not the job's survives every job's clean-up. The port scheme and the script's checks are
tested first, without SLURM."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
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

from stride.ray_cluster.slurm.ports import PortError, PortScheme, expand_cpus_per_node, local_indices  # noqa: E402

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
    # A requeued job (same id) gets the same ports back.
    assert scheme.node(7001, 1) == scheme.node(7001, 1)


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
    """A Ray head started by the test outside SLURM (explicit ports below the jobs' range, own temp dir and
    token): every job's clean-up must leave it alone. Stopped by pid at the end."""

    def __init__(self):
        self.root = Path(tempfile.mkdtemp(prefix="sr-out-", dir="/tmp"))
        token = self.root / "token"
        fd = os.open(token, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(os.urandom(32).hex())
        ports = free_ports(9)
        self.gcs_port = ports[0]
        workers = free_block(10002, 19900, 60)  # Ray's default worker band: outside the SLURM jobs' 24000-32767
        argv = [str(Path(PYTHON).parent / "ray"), "start", "--head", "--block", "--disable-usage-stats",
                f"--temp-dir={self.root / 'ray'}", "--num-cpus=1", "--include-dashboard=true",
                "--dashboard-host=127.0.0.1", f"--port={ports[0]}", f"--dashboard-port={ports[1]}",
                f"--ray-client-server-port={ports[2]}", f"--node-manager-port={ports[3]}",
                f"--object-manager-port={ports[4]}", f"--metrics-export-port={ports[5]}",
                f"--dashboard-agent-listen-port={ports[6]}", f"--dashboard-agent-grpc-port={ports[7]}",
                f"--runtime-env-agent-port={ports[8]}", f"--min-worker-port={workers}",
                f"--max-worker-port={workers + 59}", "--object-store-memory=100000000"]
        env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "SLURM_"))}
        env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(token))
        self.log = open(self.root / "head.log", "w")
        self.proc = subprocess.Popen(argv, env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.time() + 240
        while not self.gcs_answers():
            if self.proc.poll() is not None or time.time() > deadline:
                self.stop()
                pytest.fail(f"the outside Ray head did not start: {(self.root / 'head.log').read_text()[-1500:]}")
            time.sleep(1)
        time.sleep(5)  # let the raylet and agents come up, then remember every process of the head
        self.pids = {p: start_time(p) for p in [self.proc.pid, *descendants(self.proc.pid)]}
        assert len(self.pids) >= 4, f"the outside head has only {len(self.pids)} processes"

    def gcs_answers(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.gcs_port), timeout=2):
                return True
        except OSError:
            return False

    def assert_alive(self) -> None:
        dead = [p for p, t in self.pids.items() if start_time(p) != t]
        assert not dead, f"processes of the Ray head outside SLURM died: {dead}"
        assert self.gcs_answers(), "the Ray head outside SLURM stopped answering"

    def stop(self) -> None:
        tree = [self.proc.pid, *descendants(self.proc.pid)]
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # `ray start --block` stops its own processes
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                pass
        for pid in tree + list(getattr(self, "pids", {})):
            if start_time(pid) is not None and pid != os.getpid():
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        if self.proc.poll() is None:
            self.proc.wait()
        self.log.close()
        shutil.rmtree(self.root, ignore_errors=True)


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def free_block(lo: int, hi: int, size: int) -> int:
    import random

    for _ in range(100):
        first = random.randrange(lo, hi - size)
        ok = True
        for port in range(first, first + size):
            with socket.socket() as s:
                try:
                    s.bind(("", port))
                except OSError:
                    ok = False
                    break
        if ok:
            return first
    raise RuntimeError(f"no {size} free ports in {lo}..{hi}")


def descendants(pid: int) -> list[int]:
    parent = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                parent[int(entry)] = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    out, frontier = [], {pid}
    while frontier:
        frontier = {p for p, pp in parent.items() if pp in frontier}
        out.extend(frontier)
    return out


@pytest.fixture(scope="module")
def outside_head(slurm_cluster):
    head = OutsideHead()
    yield head
    head.assert_alive()
    head.stop()


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


def submit(cluster, work, name: str, sbatch_args: list[str], driver_args: list[str], **knobs: str) -> str:
    env = dict(work["env"], STRIDE_JOB_DIR=str(work["root"] / "jobs" / name), **knobs)
    data = work["data"]
    return cluster.sbatch([f"--job-name={name}", f"--output={work['root'] / (name + '.out')}", *sbatch_args, SBATCH,
                           "--config", "trainers/configs/tabular_mlp.yaml", f"data.train_path={data}/train",
                           f"data.val_path={data}/val", f"run.storage_path={run_dir(work, name).parent}", f"run.name={name}",
                           "train.epochs=null", "tracking.mlflow_uri=null", "scaling.num_workers=auto", *driver_args],
                          env=env, cwd=REPO)


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
    if not temp_dirs_kept:
        assert not list((work["root"] / "r").glob(f"stride-{job_id}-*")), "a node's Ray temp dir was not removed"


def wait_done(cluster, job_id: str, work, name: str, timeout_s: float) -> dict:
    try:
        return cluster.wait_job(job_id, timeout_s)
    except TimeoutError as e:
        pytest.fail(f"{e}\n--- {name}.out ---\n{output(work, name)[-4000:]}")


# ---- two jobs at once, each on both nodes (the 2-node run is one of them) ------------------------------

@pytest.fixture(scope="module")
def two_jobs(slurm_cluster, work, outside_head):
    """Jobs A and B, 1 CPU per node each, on n1+n2 at the same time: both heads on n1, both workers on n2.
    A keeps its Ray temp dirs so that the test can see where the training workers ran."""
    t0 = time.time()
    common = ["--nodes=2", "--cpus-per-task=1"]
    args = ["train.max_steps=40", "train.log_every_steps=10"]
    ids = {"A": submit(slurm_cluster, work, "A", common, args, STRIDE_CPUS_PER_NODE="2", STRIDE_KEEP_RAY_TMP="1"),
           "B": submit(slurm_cluster, work, "B", [*common, "--hold"], args, STRIDE_CPUS_PER_NODE="2")}
    # Something that is not Ray holds one of the ports B's n2 would get: n2 must move to a free block.
    taken = PortScheme().node(int(ids["B"]), local_index=1)["min_worker_port"] + 3
    blocker = socket.socket()
    blocker.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    blocker.bind(("0.0.0.0", taken))
    blocker.listen()
    assert slurm_cluster.run(["scontrol", "release", ids["B"]]).returncode == 0
    both_running = False
    deadline = time.time() + 600
    while time.time() < deadline:
        states = {k: slurm_cluster.job(j).get("JobState") for k, j in ids.items()}
        both_running |= all(s == "RUNNING" for s in states.values())
        if all(s not in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING", None) for s in states.values()):
            break
        time.sleep(1)
    blocker.close()
    info = {k: wait_done(slurm_cluster, j, work, k, 5) for k, j in ids.items()}
    yield {"ids": ids, "info": info, "both_running": both_running, "wall_s": time.time() - t0, "taken": taken}
    shutil.rmtree(work["root"] / "r" / f"stride-{ids['A']}-n1", ignore_errors=True)
    shutil.rmtree(work["root"] / "r" / f"stride-{ids['A']}-n2", ignore_errors=True)


@pytest.mark.slow
@pytest.mark.slurm
def test_two_node_job_trains_and_completes(two_jobs, work, outside_head):
    job = two_jobs["ids"]["A"]
    out = output(work, "A")
    assert two_jobs["info"]["A"]["JobState"] == "COMPLETED", out[-4000:]
    summary = json.loads((run_dir(work, "A") / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["global_step"] == 40
    assert summary["world_size"] == 2
    assert "training A on 2 CPU worker(s); cluster 4 CPUs, 0 GPUs, 2 node(s)" in out
    assert "all 2 node(s) joined: n1 n2" in out
    # Each node's Ray was stopped by its own launcher (SIGUSR2 through srun), not killed with the step.
    for node in ("n1", "n2"):
        log = (work["root"] / "jobs" / "A" / f"ray-{node}.log").read_text()
        assert f"node {node}: SIGUSR2: stopping Ray" in log, log[-2000:]
        assert "still alive after SIGKILL" not in log
    token = work["root"] / "jobs" / "A" / "ray_token"
    assert stat.S_IMODE(token.stat().st_mode) == 0o600
    assert stat.S_IMODE(token.parent.stat().st_mode) == 0o700
    for node in ("n1", "n2"):  # kept (keep_tmp): each node's folder is private, Ray's world-writable one inside it
        folder = work["root"] / "r" / f"stride-{job}-{node}"
        assert stat.S_IMODE(folder.lstat().st_mode) == 0o700 and (folder / "ray").is_dir()
    assert_job_cleaned_up(work, job, temp_dirs_kept=True)
    outside_head.assert_alive()


@pytest.mark.slow
@pytest.mark.slurm
def test_auto_workers_run_one_per_node(two_jobs, work):
    """scaling.num_workers=auto on CPU nodes means one worker per node: the two training workers' pids (from the
    driver's output) must be Ray workers of different nodes (each node's Ray logs are kept for job A)."""
    job = two_jobs["ids"]["A"]
    pids = re.findall(r"\(ip=[^,]+, pid=(\d+)\) world_rank=\d", output(work, "A"))
    assert len(pids) == 2, output(work, "A")[-3000:]
    where = {}
    for pid in pids:
        hits = list((work["root"] / "r").glob(f"stride-{job}-*/ray/session_*/logs/python-core-worker-*_{pid}.log"))
        where[pid] = {h.parts[len((work["root"] / "r").parts)] for h in hits}
    nodes = [n.pop() for n in where.values() if len(n) == 1]
    assert len(nodes) == 2, where
    assert nodes[0] != nodes[1], f"both training workers ran on {nodes[0]}: Ray Train packed them onto one node"


@pytest.mark.slow
@pytest.mark.slurm
def test_two_jobs_share_the_nodes_without_port_clashes(two_jobs, work, outside_head):
    ids = two_jobs["ids"]
    assert two_jobs["both_running"], "the two jobs never ran at the same time"
    for name, job in ids.items():
        assert two_jobs["info"][name]["JobState"] == "COMPLETED", output(work, name)[-4000:]
        assert two_jobs["info"][name]["NodeList"] == "n[1-2]"
        summary = json.loads((run_dir(work, name) / "summary.json").read_text())
        assert summary["status"] == "completed" and summary["global_step"] == 40
        assert_job_cleaned_up(work, job, temp_dirs_kept=name == "A")
    plans = {k: json.loads((work["root"] / "jobs" / k / "plan.json").read_text()) for k in ids}
    ports = {k: set().union(*(all_ports(n["ports"]) for n in p["nodes"])) for k, p in plans.items()}
    assert not ports["A"] & ports["B"]
    # Both of a job's nodes live on 127.0.0.1: they took different port blocks.
    assert [n["local_index"] for n in plans["A"]["nodes"]] == [0, 1]
    # B's n2 found one of its ports taken by a stranger and moved to the block of another slot.
    log = (work["root"] / "jobs" / "B" / "ray-n2.log").read_text()
    assert f"worker port {two_jobs['taken']}" in log and "using the block of port slot" in log, log[-2000:]
    outside_head.assert_alive()


# ---- a node that cannot start: the job fails at once and names it -------------------------------------

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
def test_nodes_that_do_not_join_in_time_fail_the_job_naming_them(slurm_cluster, work):
    job = submit(slurm_cluster, work, "T", ["--nodes=2", "--cpus-per-task=1"], ["train.max_steps=10"],
                 STRIDE_JOIN_TIMEOUT_S="3")
    info = wait_done(slurm_cluster, job, work, "T", 300)
    out = output(work, "T")
    assert info["JobState"] == "FAILED" and info["ExitCode"].startswith("1:"), (info, out[-3000:])
    assert re.search(r"not in the Ray cluster after 3s .*nodes missing: (n1, )?n2 ", out), out[-3000:]
    assert "raise STRIDE_JOIN_TIMEOUT_S" in out and "starting the driver" not in out
    assert_job_cleaned_up(work, job)  # Ray stopped mid-start-up leaves nothing behind either


# ---- preemption: USR1 -> checkpoint -> requeue -> resume -> completion ----------------------------------

@pytest.mark.slow
@pytest.mark.slurm
def test_usr1_checkpoints_requeues_and_resumes(slurm_cluster, work, outside_head):
    steps, log_every = 400, 5
    job = submit(slurm_cluster, work, "P", ["--nodes=2", "--cpus-per-task=2"],
                 [f"train.max_steps={steps}", f"train.log_every_steps={log_every}", "checkpoint.every_steps=1000",
                  "train.eval_every_steps=1000"])
    metrics = run_dir(work, "P") / "metrics.jsonl"
    deadline = time.time() + 600
    seen: list[int] = []
    while time.time() < deadline:
        if metrics.exists():
            seen = [r["step"] for r in read_jsonl(metrics) if "train_loss" in r]
            if len(seen) >= 2:
                break
        if slurm_cluster.job(job).get("JobState") not in ("PENDING", "RUNNING", "CONFIGURING"):
            pytest.fail(f"job ended before it trained: {output(work, 'P')[-4000:]}")
        time.sleep(0.2)
    else:
        pytest.fail(f"no training steps within 600 s: {output(work, 'P')[-4000:]}")
    last_seen = seen[-1]
    r = slurm_cluster.run(["scancel", "--signal=USR1", "--batch", job])
    assert r.returncode == 0, r.stderr

    info = wait_done(slurm_cluster, job, work, "P", 900)
    out = output(work, "P")
    assert info["JobState"] == "COMPLETED", out[-5000:]
    assert int(info["Restarts"]) >= 1, info
    assert "received SIGUSR1: forwarding it to the driver" in out
    assert "stride: preempted: step" in out and "preempted: requeueing job" in out, out[-5000:]
    m = re.search(r"resumed from \S+ at step (\d+)", out)
    assert m, out[-5000:]
    ckpt_step = int(m.group(1))
    # The checkpoint holds every step logged before the signal (at most the step in flight is redone).
    assert last_seen <= ckpt_step < steps, (last_seen, ckpt_step)

    summary = json.loads((run_dir(work, "P") / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["global_step"] == steps
    assert summary["restarts"] >= 1
    logged = [r["step"] for r in read_jsonl(metrics) if "train_loss" in r]
    assert logged == sorted(set(logged)), "metrics.jsonl repeats or reorders steps after the resume"
    assert ckpt_step in logged and logged[-1] == steps
    after = [s for s in logged if s > ckpt_step]
    first_after = (ckpt_step // log_every + 1) * log_every
    assert after == list(range(first_after, steps + 1, log_every)), after[:5]
    assert_job_cleaned_up(work, job)
    outside_head.assert_alive()
