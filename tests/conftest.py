"""Shared fixtures. Tests run cheapest first: pure functions, one process, Ray workers, real servers."""

from __future__ import annotations

import json
import os
import select
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PYTHON = sys.executable

# One two-node SLURM cluster for the whole session (tests/slurm_cluster.py; skips where SLURM cannot start).
from slurm_cluster import slurm_cluster_fixture  # noqa: E402

slurm_cluster = slurm_cluster_fixture()

# One token-auth Ray head for the session (tests/shared_ray.py): `ray_cluster` gives a test its client environment.
from shared_ray import ray_cluster, shared_ray_head  # noqa: E402, F401

# Ray on a 2-core machine: never inherit a cluster address from the developer's shell.
os.environ.pop("RAY_ADDRESS", None)


# ---- the suite's cost, printed last (make test): wall time and CPU-seconds ---------------------------------

def _machine_cpu_s() -> float:
    """CPU-seconds every process of this machine used since boot (user, nice, system, irq, softirq)."""
    fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:8]
    user, nice, system, _idle, _iowait, irq, softirq = (int(x) for x in fields)
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


def _own_cpu_s() -> float:
    import resource

    return sum(r.ru_utime + r.ru_stime for r in (resource.getrusage(resource.RUSAGE_SELF),
                                                  resource.getrusage(resource.RUSAGE_CHILDREN)))


_START = (time.monotonic(), _own_cpu_s(), _machine_cpu_s())
_TEST_CPU: dict[str, float] = {}  # nodeid: the machine's CPU-seconds from its setup to its teardown
_PARALLEL = "PYTEST_XDIST_WORKER" in os.environ  # a pytest-xdist worker: another test runs beside this one


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Per test, the whole machine's CPU-seconds (a Ray worker, a raylet or slurmd it made busy counts): where the
    suite's CPU goes, which its wall-time table does not show (a test waiting on a drain costs time, not CPU).
    Only in a run of one stream (`-n 0`): beside another test the machine's CPU is not this test's."""
    before = _machine_cpu_s()
    yield
    if not _PARALLEL:
        _TEST_CPU[item.nodeid] = _machine_cpu_s() - before


# ---- make test runs two streams (pytest-xdist, -n 2 --dist loadgroup) -----------------------------------------
# On 2 cores one stream leaves a core idle about half the time: a Ray run waits on its gang, a drain, a checkpoint.
# The tests on the session's shared Ray head (or the SLURM cluster) are one stream, run one after another on one
# worker, in the order they had; every other slow test (its own Ray, torchrun, servers) is the other stream, on the
# other worker, also one after another; the fast tier goes to whichever worker is free. So no two tests of one kind
# ever share a cluster, a head's CPUs or the host's embedded-Ray state. A module fixture is built once per worker
# that runs a test of it: a module names in CLUSTER_STREAM_FIXTURES the costly ones that a test on the shared cluster
# also reads (test_fsdp's torchrun batch, which its torchrun-to-Ray resume continues), and every test of them joins
# the cluster's stream, so that the batch is built once.
SHARED_CLUSTER_FIXTURES = {"shared_ray_head", "slurm_cluster"}


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads the groups
def pytest_collection_modifyitems(config, items):
    for item in items:
        with_cluster = SHARED_CLUSTER_FIXTURES | getattr(item.module, "CLUSTER_STREAM_FIXTURES", set())
        if with_cluster & set(item.fixturenames):
            item.add_marker(pytest.mark.xdist_group("shared_cluster"))
        elif item.get_closest_marker("slow"):
            item.add_marker(pytest.mark.xdist_group("own_processes"))


@pytest.hookimpl(trylast=True)
def pytest_terminal_summary(terminalreporter):
    """After pytest's table of the slowest tests: what the suite cost. Ray's daemons (heads, raylets) are not
    pytest's children once they detach, so the machine's total is given too: on a machine that runs nothing
    else (CI), that is the suite's CPU-seconds, pytest and everything it started."""
    wall, own, machine = (now - then for now, then in zip((time.monotonic(), _own_cpu_s(), _machine_cpu_s()), _START))
    if _TEST_CPU:
        terminalreporter.write_sep("=", "costliest 25 tests in CPU-seconds (the machine's, setup to teardown)")
        for nodeid, cpu in sorted(_TEST_CPU.items(), key=lambda kv: -kv[1])[:25]:
            terminalreporter.write_line(f"{cpu:7.1f} s  {nodeid}")
    elif getattr(terminalreporter.config.option, "numprocesses", None):
        terminalreporter.write_line("(per-test CPU-seconds: run one stream, make test PYTEST_ARGS=\"-n 0\")")
    terminalreporter.write_sep("=", "suite cost")
    terminalreporter.write_line(f"wall {wall:.0f} s ({wall / 60:.1f} min); CPU {machine:.0f} s on this machine "
                                f"({os.cpu_count()} cores), of which {own:.0f} s in pytest and the processes it waited for")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# torchrun's per-launch folders (it makes a torchelastic_* folder in /tmp per launch and never removes it): one
# private folder for the session's launches, made at the first launch (not at import: Ray workers that unpickle a
# test's function import this module too) and removed at the session's end.
_TORCHRUN_LOGS: list[Path] = []


def torchrun_launcher(nproc: int) -> list[str]:
    """`torch.distributed.run` on this host. `--standalone` lets the rendezvous bind port 0 itself: a port picked
    free beforehand can be taken by another process before torchrun binds it (EADDRINUSE)."""
    if not _TORCHRUN_LOGS:
        _TORCHRUN_LOGS.append(Path(tempfile.mkdtemp(prefix="stride-tests-torchrun-")))
    return [PYTHON, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
            "--log-dir", str(_TORCHRUN_LOGS[0])]


def run_torchrun_cases(cases: list[dict], results: Path, cwd: Path, env: dict | None = None,
                       timeout: float = 600) -> tuple[subprocess.CompletedProcess, list[list[dict]]]:
    """`cases` (tests/torchrun_cases.py's list) under one launch of 2 ranks, from `cwd`; the launch and each rank's
    results (per case: label, exit code, stdout, stderr)."""
    results.mkdir(parents=True, exist_ok=True)
    (results / "cases.json").write_text(json.dumps(cases))
    r = subprocess.run([*torchrun_launcher(2), str(REPO / "tests" / "torchrun_cases.py"), str(results / "cases.json"),
                        str(results)], cwd=cwd, env=dict(os.environ, **(env or {})), capture_output=True, text=True,
                       timeout=timeout)
    ranks = [json.loads(f.read_text()) if (f := results / f"rank{k}.json").exists() else [] for k in (0, 1)]
    return r, ranks


def torchrun_case(batch: dict, label: str, code: int = 0) -> str:
    """Rank 0's output of one case of a run_torchrun_cases batch (`batch` holds its "launch" and "ranks"), once both
    ranks ended it with `code`; else the calling test fails alone, showing each rank's code and stderr."""
    cases = [{c["label"]: c for c in rank}.get(label) for rank in batch["ranks"]]
    assert all(c is not None and c["code"] == code for c in cases), \
        ([c and (c["code"], c["stderr"][-2000:]) for c in cases], batch["launch"].stderr[-3000:])
    return cases[0]["stdout"] + cases[0]["stderr"]


def run_cli(args: list[str], timeout: float = 600, env: dict | None = None, cwd: Path = REPO) -> subprocess.CompletedProcess:
    """Run a Stride command in a subprocess (the way a user does) and capture its output."""
    full_env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
    full_env.pop("RAY_ADDRESS", None) if "RAY_ADDRESS" not in (env or {}) else None
    return subprocess.run([PYTHON, *args], cwd=cwd, env=full_env, capture_output=True, text=True, timeout=timeout)


class ForkServer:
    """tests/forked_cli.py --serve, started on first use: it imports what the commands import once, then forks a
    child per command. Restarted once if it dies; stopped by pid at the session's end (pytest_sessionfinish)."""

    # Read by the interpreter at its start, so a forked child cannot take them from its env: the server applies
    # these three itself (sys.path, sys.dont_write_bytecode; output goes to files). Any other PYTHON* variable
    # must be the server's own.
    APPLIED = {"PYTHONPATH", "PYTHONDONTWRITEBYTECODE", "PYTHONUNBUFFERED"}

    def __init__(self):
        self.proc: subprocess.Popen | None = None
        self.env: dict[str, str] | None = None
        self.starts = 0
        self.asked = 0
        self.log = None
        self.buffer = b""
        self.lock = threading.Lock()

    def run(self, argv: list[str], env: dict[str, str], cwd: Path, timeout: float) -> dict:
        """One request's answer; a server that died on it is restarted once and asked again."""
        with self.lock:
            self.check_env(env)
            self.asked += 1
            request = json.dumps({"id": self.asked, "argv": argv, "env": env, "cwd": str(cwd), "timeout": timeout})
            while True:
                if self.proc is None:
                    self.start()
                answer = self.ask(request + "\n", self.asked, timeout + 60)
                if answer is not None:
                    return answer
                self.stop()

    def check_env(self, env: dict[str, str]) -> None:
        if self.env is None:
            self.env = dict(os.environ, PYTHONUNBUFFERED="1")
            self.env.pop("RAY_ADDRESS", None)
        differ = sorted(k for k in env.keys() | self.env.keys() if k.startswith("PYTHON") and k not in self.APPLIED
                        and env.get(k) != self.env.get(k))
        if differ:
            raise ValueError(f"{differ} take effect when an interpreter starts: use run_cli, not run_cli_forked")

    def start(self) -> None:
        if self.starts == 2:
            pytest.fail("the fork server (tests/forked_cli.py --serve) died twice; its stderr ends:\n" + self.tail())
        self.starts += 1
        self.log = tempfile.TemporaryFile("w+")
        self.buffer = b""
        self.proc = subprocess.Popen([PYTHON, str(REPO / "tests" / "forked_cli.py"), "--serve"], cwd=REPO, env=self.env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log)

    def ask(self, request: str, ident: int, timeout: float) -> dict | None:
        """The answer to request `ident`, or None if the server died first. Answers to earlier requests (a test
        interrupted while it waited) are passed over; a server silent past `timeout` is stopped, loudly."""
        try:
            self.proc.stdin.write(request.encode())
            self.proc.stdin.flush()
        except BrokenPipeError:
            return None
        deadline = time.monotonic() + timeout
        while True:
            line = self.read_line(deadline)
            if line is None:
                return None
            answer = json.loads(line)
            if answer["id"] == ident:
                return answer

    def read_line(self, deadline: float) -> bytes | None:
        while b"\n" not in self.buffer:
            left = deadline - time.monotonic()
            if left <= 0:
                self.stop()
                pytest.fail("the fork server gave no answer in time; its stderr ends:\n" + self.tail())
            if select.select([self.proc.stdout], [], [], left)[0]:
                chunk = os.read(self.proc.stdout.fileno(), 1 << 16)
                if not chunk:
                    return None
                self.buffer += chunk
        line, _, self.buffer = self.buffer.partition(b"\n")
        return line

    def tail(self) -> str:
        self.log.seek(0)
        return self.log.read()[-3000:]

    def stop(self) -> None:
        """Ends the server by its pid: its stdin closed (it exits at the end of its input), else SIGKILL."""
        if self.proc is None:
            return
        try:
            self.proc.stdin.close()
        except BrokenPipeError:
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc = None


FORK_SERVER = ForkServer()


def pytest_sessionfinish(session, exitstatus):
    FORK_SERVER.stop()
    for folder in _TORCHRUN_LOGS:
        shutil.rmtree(folder, ignore_errors=True)


def run_cli_forked(args: list[str], timeout: float = 120, env: dict | None = None,
                   cwd: Path = REPO, inherit_env: bool = True) -> subprocess.CompletedProcess:
    """run_cli, in a child forked from the fork server instead of a fresh interpreter: for a test whose claim is the
    command's output and exit status, not the interpreter's start (imports, sys.path, sys.modules). `args` is a
    script path (relative to `cwd`) or -m and a module, then its arguments. `env` is added to this process's
    environment, or with inherit_env=False is the child's whole environment."""
    if args[0].startswith("-") and args[0] != "-m":
        raise ValueError(f"run_cli_forked runs a script or -m MODULE, not {args[0]}: use run_cli")
    full_env = {**(os.environ if inherit_env else {}), "PYTHONUNBUFFERED": "1", **(env or {})}
    full_env.pop("RAY_ADDRESS", None) if "RAY_ADDRESS" not in (env or {}) else None
    answer = FORK_SERVER.run(list(args), full_env, Path(cwd).resolve(), timeout)
    if answer["timed_out"]:
        raise subprocess.TimeoutExpired([PYTHON, *args], timeout, answer["stdout"], answer["stderr"])
    return subprocess.CompletedProcess([PYTHON, *args], answer["returncode"], answer["stdout"], answer["stderr"])


def auth_folders(owner_alive: bool | None = None) -> dict[Path, int]:
    """The embedded Rays' private token folders in this host's temp folder (ray_cluster/connect.py), with the pid
    of the driver that made each; only those whose driver is alive (True) or gone (False) when asked. Another
    stream's embedded run may have one at the same moment (make test runs two)."""
    from stride.ray_cluster import connect

    found = {}
    for folder in Path(tempfile.gettempdir()).glob(f"{connect.AUTH_PREFIX}*"):
        try:
            pid, start = (folder / connect.AUTH_OWNER).read_text().split()
        except (OSError, ValueError):
            continue
        if owner_alive is None or (connect.process_start(int(pid)) == start) == owner_alive:
            found[folder] = int(pid)
    return found


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


@pytest.fixture(scope="session")
def tabular_data(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("data") / "tabular"
    subprocess.run([PYTHON, "datasets/prepare.py", "tabular", "--out", str(out), "--rows", "4000"], cwd=REPO, check=True,
                   capture_output=True)
    return out


@pytest.fixture(scope="session")
def full_tabular_data(tmp_path_factory) -> Path:
    """The tabular set at prepare.py's defaults (the accuracy goal is stated for it)."""
    out = tmp_path_factory.mktemp("data") / "tabular_full"
    subprocess.run([PYTHON, "datasets/prepare.py", "tabular", "--out", str(out)], cwd=REPO, check=True, capture_output=True)
    return out


@pytest.fixture(scope="session")
def text_data(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("data") / "pystdlib"
    subprocess.run([PYTHON, "datasets/prepare.py", "pystdlib", "--out", str(out)], cwd=REPO, check=True, capture_output=True)
    return out


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory):
    """A real `mlflow server` on a free localhost port; stopped by pid at the end."""
    root = tmp_path_factory.mktemp("mlflow")
    port = free_port()
    log = open(root / "server.log", "w")
    proc = subprocess.Popen(
        [str(Path(PYTHON).parent / "mlflow"), "server", "--host", "127.0.0.1", "--port", str(port),
         "--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}", "--default-artifact-root", str(root / "artifacts"),
         "--workers", "1"],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        # Without MLflow's job runner (GenAI evaluation jobs; Stride has none): its 8 huey consumers cost about
        # 20 CPU-seconds to start.
        env=dict(os.environ, MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false"))
    uri = f"http://127.0.0.1:{port}"
    import urllib.request

    deadline = time.time() + 120
    while time.time() < deadline:
        try:
            if urllib.request.urlopen(f"{uri}/health", timeout=2).status == 200:
                break
        except OSError:
            time.sleep(1)
        if proc.poll() is not None:
            pytest.fail(f"mlflow server exited: {(root / 'server.log').read_text()[-2000:]}")
    else:
        pytest.fail("mlflow server did not answer within 120 s")
    yield uri
    # The server forks gunicorn/uvicorn workers into its own session: stop that session's processes.
    import signal

    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        os.killpg(proc.pid, signal.SIGKILL)
    log.close()


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (read from /proc), so a test can stop exactly what it started."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def kill_pids(pids: list[int]) -> None:
    import signal

    for p in pids:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


def gone(pids: list[int], timeout: float = 30) -> None:
    """Wait until every one of `pids` has exited (zombies count as exited); fail naming those that have not."""
    from stride.ray_cluster import node

    deadline = time.monotonic() + timeout
    while (alive := set(pids) & node.processes().keys()) and time.monotonic() < deadline:  # live, not zombies
        time.sleep(0.1)
    assert not alive, f"still running after SIGKILL: {sorted(alive)}"


def wait_for_step(metrics: Path, step: int, proc: subprocess.Popen, timeout: float = 300) -> int:
    """Block until metrics.jsonl shows a logged step >= `step`; returns the newest logged step."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"the run ended (exit {proc.returncode}) before step {step}")
        if metrics.exists():
            steps = [json.loads(x)["step"] for x in metrics.read_text().splitlines() if '"train_loss"' in x]
            if steps and steps[-1] >= step:
                return steps[-1]
        time.sleep(0.2)
    raise AssertionError(f"no step {step} within {timeout} s")
