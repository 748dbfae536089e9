"""A real two-node SLURM cluster (n1, n2) on this one machine, for tests of ray_cluster/slurm/stride.sbatch.

    from slurm_cluster import slurm_cluster_fixture
    slurm_cluster = slurm_cluster_fixture()          # once, in tests/conftest.py (session-scoped)

    def test_x(slurm_cluster):
        job_id = slurm_cluster.sbatch(["--nodes=2", "script.sbatch", ...])
        slurm_cluster.wait_job(job_id, timeout_s=300)

Everything lives in a private state folder: its own munged (own key, own socket: slurm.conf's
`AuthInfo=socket=...`), slurm.conf read through SLURM_CONF, spool, logs and pid files. Nothing global is
written or stopped; /etc/munge and /etc/slurm are never touched. Teardown cancels this cluster's jobs and
then stops exactly the pids it started (and the slurmstepd processes those slurmd's forked).

Standalone, for poking at it by hand:  python tests/slurm_cluster.py   (Ctrl-C stops it)
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

NODES = ("n1", "n2")
CPUS_PER_NODE = 2  # two 1-CPU jobs can then share a node
MEMORY_PER_NODE_MB = 4000
DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "sinfo", "squeue", "scontrol", "scancel", "srun")


class SlurmUnavailable(RuntimeError):
    """The daemons are missing, crashed or did not start: the tests that need them fail with this reason under CI
    (CI=true, where make test has installed them) and skip with it elsewhere (tests/services.py)."""


def _free_ports(n: int) -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _which(name: str) -> str | None:
    return shutil.which(name) or next((p for p in (f"/usr/sbin/{name}", f"/usr/bin/{name}") if os.access(p, os.X_OK)), None)


def _descendants(pids: list[int]) -> list[int]:
    """All processes below `pids` (from /proc), children before grandchildren."""
    parent_of: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        # comm may contain spaces and parentheses: the ppid is the 2nd field after the last ')'.
        parent_of[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
    out, frontier = [], list(pids)
    while frontier:
        children = [p for p, pp in parent_of.items() if pp in frontier and p not in out]
        out.extend(children)
        frontier = children
    return out


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); it is dead for our purposes.
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _stop_pids(pids: list[int], grace_s: float = 15.0) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.time() + grace_s
    while time.time() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.2)
    for pid in pids:
        if _alive(pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


class SlurmCluster:
    """Start with `start()`, stop with `stop()`. `env` is what a SLURM client command needs (SLURM_CONF)."""

    def __init__(self, state_dir: Path):
        self.dir = Path(state_dir)
        self.host = socket.gethostname().split(".")[0]
        self.procs: dict[str, subprocess.Popen] = {}
        self.conf = self.dir / "slurm.conf"
        self.munge_socket: Path | None = None
        self.env = dict(os.environ, SLURM_CONF=str(self.conf))
        for key in [k for k in self.env if k.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_")) and k != "SLURM_CONF"]:
            del self.env[key]  # never inherit an outer job's settings
        self._logs: list = []

    # ---- bring-up ----

    def start(self, timeout_s: float = 60.0) -> "SlurmCluster":
        missing = [d for d in DAEMONS if _which(d) is None]
        if missing:
            raise SlurmUnavailable(f"SLURM/munge programs missing ({', '.join(missing)}); run `bash tests/setup_services.sh` "
                                   f"as root (installs slurm-wlm and munge)")
        if os.geteuid() != 0:
            raise SlurmUnavailable("slurmd must run as root to launch jobs; run the SLURM tests as root")
        self.dir.mkdir(parents=True, exist_ok=True)
        for sub in ("munge", "log", "ctld", "spool"):
            (self.dir / sub).mkdir(exist_ok=True)
        os.chmod(self.dir / "munge", 0o700)  # munged refuses a key in a folder others can read
        try:
            self._start_munged()
            self._write_conf()
            self._spawn("slurmctld", [_which("slurmctld"), "-D", "-c", "-f", str(self.conf)])
            for node in NODES:
                (self.dir / "spool" / node).mkdir(exist_ok=True)
                self._spawn(f"slurmd-{node}", [_which("slurmd"), "-D", "-N", node, "-f", str(self.conf)])
            self._wait_idle(timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def _spawn(self, name: str, argv: list[str]) -> None:
        log = open(self.dir / "log" / f"{name}.out", "w")
        self._logs.append(log)
        # Own session: a Ctrl-C in the test runner's terminal must not reach the daemons before teardown does.
        self.procs[name] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                            start_new_session=True)

    def _start_munged(self) -> None:
        key = self.dir / "munge" / "munge.key"
        if not key.exists():
            fd = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o400)
            with os.fdopen(fd, "wb") as f:
                f.write(os.urandom(1024))
        m = self.dir / "munge"
        # munged wants every folder above its socket searchable by all, which pytest's 0700 tmp folders are
        # not: the socket gets its own folder in /tmp (removed at teardown).
        sock_dir = Path(tempfile.mkdtemp(prefix="stride-munge-"))
        os.chmod(sock_dir, 0o755)
        self.munge_socket = sock_dir / "munge.socket"
        self._spawn("munged", [_which("munged"), "-F", f"--socket={self.munge_socket}", f"--key-file={key}",
                               f"--pid-file={m / 'munged.pid'}", f"--log-file={m / 'munged.log'}",
                               f"--seed-file={m / 'munged.seed'}"])
        deadline = time.time() + 15
        while not self.munge_socket.exists():
            if self.procs["munged"].poll() is not None or time.time() > deadline:
                raise SlurmUnavailable(f"munged did not start: {self._tail('munged')}")
            time.sleep(0.1)

    def _write_conf(self) -> None:
        ctld_port, *node_ports = _free_ports(1 + len(NODES))
        d = self.dir
        nodes = "\n".join(
            f"NodeName={n} NodeHostname={self.host} NodeAddr=127.0.0.1 Port={p} CPUs={CPUS_PER_NODE} "
            f"RealMemory={MEMORY_PER_NODE_MB} State=UNKNOWN" for n, p in zip(NODES, node_ports))
        self.conf.write_text(f"""\
# Written by tests/slurm_cluster.py for one test session; every path is under {d}.
ClusterName=stride{os.getpid()}
# Job ids pick Ray port slots in stride.sbatch: start them apart from another harness's on this machine.
FirstJobId={1000 + (os.getpid() * 37) % 90000}
SlurmctldHost={self.host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmUser=root
AuthType=auth/munge
CredType=cred/munge
# cred_expire also sets how long a requeued job waits before it may start again (default 120 s).
AuthInfo=socket={self.munge_socket},cred_expire=10
StateSaveLocation={d / 'ctld'}
SlurmdSpoolDir={d / 'spool'}/%n
SlurmctldPidFile={d / 'slurmctld.pid'}
SlurmdPidFile={d}/slurmd-%n.pid
SlurmctldLogFile={d / 'log' / 'slurmctld.log'}
SlurmdLogFile={d / 'log'}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
ReturnToService=2
MpiDefault=none
MailProg=/bin/true
KillWait=10
MinJobAge=300
# Quick scheduling: tests wait on it.
SchedulerParameters=sched_interval=2
{nodes}
PartitionName=debug Nodes={','.join(NODES)} Default=YES MaxTime=INFINITE State=UP
""")

    def _wait_idle(self, timeout_s: float) -> None:
        deadline = time.time() + timeout_s
        states = ""
        while time.time() < deadline:
            for name, p in self.procs.items():
                if p.poll() is not None:
                    raise SlurmUnavailable(f"{name} exited with {p.returncode}: {self._tail(name)}")
            r = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %T"], env=self.env, capture_output=True, text=True)
            states = r.stdout.strip()
            if r.returncode == 0 and sorted(states.split("\n")) == sorted(f"{n} idle" for n in NODES):
                return
            time.sleep(0.5)
        raise SlurmUnavailable(f"nodes not idle after {timeout_s:.0f}s (sinfo: {states!r}); "
                               f"slurmctld log: {self._tail('slurmctld', self.dir / 'log' / 'slurmctld.log')}")

    def _tail(self, name: str, path: Path | None = None, chars: int = 1500) -> str:
        path = path or self.dir / "log" / f"{name}.out"
        try:
            return path.read_text(errors="replace")[-chars:].strip()
        except OSError:
            return "(no log)"

    # ---- use ----

    def run(self, argv: list[str], **kw) -> subprocess.CompletedProcess:
        return subprocess.run(argv, env=kw.pop("env", self.env), capture_output=True, text=True, **kw)

    def sbatch(self, args: list[str], env: dict | None = None, cwd: str | Path | None = None) -> str:
        r = self.run(["sbatch", "--parsable", *args], env=env or self.env, cwd=cwd)
        if r.returncode != 0:
            raise RuntimeError(f"sbatch failed ({r.returncode}): {r.stderr.strip()}")
        return r.stdout.strip().split(";")[0]

    def job(self, job_id: str) -> dict[str, str]:
        """`scontrol show job` as a dict ({} once the job is gone)."""
        r = self.run(["scontrol", "show", "job", "-o", job_id])
        if r.returncode != 0:
            return {}
        fields: dict[str, str] = {}
        for item in r.stdout.split():
            k, _, v = item.partition("=")
            fields.setdefault(k, v)
        return fields

    def wait_job(self, job_id: str, timeout_s: float, states: tuple[str, ...] = ("COMPLETED", "FAILED", "CANCELLED",
                 "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE", "PREEMPTED")) -> dict[str, str]:
        deadline = time.time() + timeout_s
        info: dict[str, str] = {}
        while time.time() < deadline:
            info = self.job(job_id)
            if info.get("JobState") in states:
                return info
            time.sleep(1)
        raise TimeoutError(f"job {job_id} not in {states} after {timeout_s:.0f}s: {info.get('JobState')} "
                           f"({info.get('Reason')})")

    # ---- teardown ----

    def stop(self) -> None:
        if "slurmctld" in self.procs and self.procs["slurmctld"].poll() is None:
            # Cancel this cluster's jobs first so their scripts run their own clean-up.
            self.run(["scancel", "--full", "--partition=debug"], timeout=30)
            deadline = time.time() + 60
            while time.time() < deadline:
                r = self.run(["squeue", "-h", "-o", "%i"], timeout=30)
                if r.returncode != 0 or not r.stdout.strip():
                    break
                time.sleep(1)
        slurmds = [p.pid for n, p in self.procs.items() if n.startswith("slurmd-") and p.poll() is None]
        stepds = _descendants(slurmds)  # slurmstepd's outlive their slurmd by design: stop them too
        for name in [n for n in self.procs if n.startswith("slurmd-")] + ["slurmctld", "munged"]:
            p = self.procs.get(name)
            if p is not None and p.poll() is None:
                _stop_pids([p.pid])
                p.wait()
        _stop_pids([p for p in stepds if _alive(p)], grace_s=5)
        for log in self._logs:
            log.close()
        self._logs.clear()
        if self.munge_socket is not None:
            shutil.rmtree(self.munge_socket.parent, ignore_errors=True)


def slurm_cluster_fixture():
    """A session-scoped pytest fixture `slurm_cluster` (import it into a test module or conftest.py). Where the
    cluster cannot start, its tests fail under CI=true and skip elsewhere, with the reason."""
    import pytest

    @pytest.fixture(scope="session")
    def slurm_cluster(tmp_path_factory):
        from services import unavailable  # tests/services.py: fails under CI=true, skips elsewhere

        cluster = SlurmCluster(Path(tmp_path_factory.mktemp("slurm")))
        try:
            cluster.start()
        except SlurmUnavailable as e:
            unavailable(f"no local SLURM cluster: {e}")
        yield cluster
        cluster.stop()

    return slurm_cluster


if __name__ == "__main__":
    c = SlurmCluster(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.mkdtemp(prefix="slurm-")))
    c.start()
    print(f"export SLURM_CONF={c.conf}\n# two idle nodes; Ctrl-C (or SIGTERM to {os.getpid()}) stops the cluster",
          flush=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    signal.signal(signal.SIGINT, signal.default_int_handler)  # background shells start us with SIGINT ignored
    try:
        signal.pause()
    except (KeyboardInterrupt, SystemExit):
        pass
    finally:
        c.stop()
