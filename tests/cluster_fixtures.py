"""Helpers and fixtures for the cluster tests (local heads, job submission, ray up over a private sshd).

Everything here starts processes of its own and stops exactly those, by pid; nothing runs `ray stop` or
`ray down`. Import what a test module needs: `from cluster_fixtures import head_factory, ...`.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PYTHON = sys.executable
VENV_BIN = Path(PYTHON).parent
RAY = str(VENV_BIN / "ray")
from stride.ray_cluster import local, node  # noqa: E402
from services import unavailable  # noqa: E402

TINY_JOB = ["train.max_steps=20", "train.epochs=null", "scaling.num_workers=1"]


def free_ports(n: int) -> list[int]:
    """n different free ports (all held open while picking, so none repeats)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("0.0.0.0", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def short_tmp(prefix: str) -> Path:
    """A folder directly under /tmp: Ray's unix socket paths under a pytest tmp_path are too long."""
    return Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without any Ray address or token, plus extra."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RAY_ADDRESS", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")}
    env.update(PYTHONUNBUFFERED="1", **extra)
    return env


def run(args: list[str], env: dict, timeout: float = 300, cwd: Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def alive(pids: dict[int, float]) -> list[int]:
    """The pids (with their start times) that are still the same live processes."""
    procs = node.processes()
    return [pid for pid, start in pids.items() if pid in procs and procs[pid]["start_s"] == start]


def head_pids(head: local.Head) -> dict[int, float]:
    state = node.read_state(head.temp_dir)
    return {pid: p["start_s"] for pid, p in node.node_processes(state).items()}


@pytest.fixture(scope="module")
def head_factory():
    """start(n) -> n local heads started at once (2 CPUs each, own ports and temp dirs); all stopped at the end."""
    started: list[local.Head] = []
    folders: list[Path] = []

    def start(n: int = 1) -> list[local.Head]:
        dirs = [short_tmp("stc-head-") for _ in range(n)]
        folders.extend(dirs)
        ports = free_ports(2 * n)
        with ThreadPoolExecutor(n) as pool:
            futures = [pool.submit(local.start_head, dirs[i], port=ports[2 * i], dashboard_port=ports[2 * i + 1],
                                   num_cpus=2) for i in range(n)]
        # Every head that started is stopped at the end, also when another one failed to start.
        started.extend(f.result() for f in futures if f.exception() is None)
        return [f.result() for f in futures]

    yield start
    for head in started:
        local.stop_head(head)  # raises if anything of it survives
    for folder in folders:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="module")
def cluster_tabular_data() -> Path:
    out = short_tmp("stc-data-")
    subprocess.run([PYTHON, "datasets/prepare.py", "tabular", "--out", str(out / "tabular"), "--rows", "4000"],
                   cwd=REPO, check=True, capture_output=True)
    yield out / "tabular"
    shutil.rmtree(out, ignore_errors=True)


# ---- a private sshd for `ray up` --------------------------------------------------------------------

# ssh has no port option in Ray's cluster config; the YAML's ssh_proxy_command runs this relay instead.
RELAY = """import os, socket, sys, threading
s = socket.create_connection((sys.argv[1], int(sys.argv[2])))
def up():
    while data := os.read(0, 65536):
        s.sendall(data)
    s.shutdown(socket.SHUT_WR)
threading.Thread(target=up, daemon=True).start()
while data := s.recv(65536):
    os.write(1, data)
"""


class Sshd:
    def __init__(self, root: Path, port: int, key: Path, home: Path, proc: subprocess.Popen):
        self.root, self.port, self.key, self.home, self.proc = root, port, key, home, proc

    @property
    def proxy_command(self) -> str:
        return f"{PYTHON} {self.root / 'relay.py'} %h {self.port}"

    def ssh(self, command: str) -> subprocess.CompletedProcess:
        return subprocess.run(["ssh", "-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null",
                               "-o", "BatchMode=yes", "-o", "IdentitiesOnly=yes", "-i", str(self.key),
                               "-o", f"ProxyCommand={self.proxy_command}", "root@127.0.0.1", command],
                              capture_output=True, text=True, timeout=60)


def _sshd_binary() -> str | None:
    return shutil.which("sshd") or ("/usr/sbin/sshd" if os.access("/usr/sbin/sshd", os.X_OK) else None)


@pytest.fixture(scope="module")
def sshd():
    """sshd on a free 127.0.0.1 port with its own host key, config and authorized key (for root), and HOME set
    to a folder of its own so that `ray up` writes nothing into root's real home. Stopped by pid."""
    binary = _sshd_binary()
    if binary is None or shutil.which("ssh") is None or shutil.which("rsync") is None:
        unavailable("sshd, ssh or rsync is not installed (tests/setup_services.sh installs openssh-server and "
                    "rsync when run as root with apt-get)")
    root = short_tmp("stc-sshd-")
    home = root / "home"
    home.mkdir(mode=0o700)
    (home / ".bashrc").write_text("")  # ray up sources it
    for name in ("hostkey", "id"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(root / name)], check=True)
    shutil.copy(root / "id.pub", root / "authorized_keys")
    (root / "relay.py").write_text(RELAY)
    (port,) = free_ports(1)
    (root / "sshd_config").write_text(
        f"Port {port}\nListenAddress 127.0.0.1\nHostKey {root / 'hostkey'}\nPidFile {root / 'sshd.pid'}\n"
        f"AuthorizedKeysFile {root / 'authorized_keys'}\nStrictModes no\nPasswordAuthentication no\n"
        f"KbdInteractiveAuthentication no\nPermitRootLogin prohibit-password\nUsePAM no\n"
        f"SetEnv HOME={home}\n")
    os.makedirs("/run/sshd", exist_ok=True)  # sshd's privilege separation folder (Debian's package makes it at boot)
    log = open(root / "sshd.log", "w")
    proc = subprocess.Popen([binary, "-D", "-e", "-f", str(root / "sshd_config")], stdout=log, stderr=subprocess.STDOUT)
    server = Sshd(root, port, root / "id", home, proc)
    deadline = time.time() + 30
    while server.ssh("true").returncode != 0:
        if proc.poll() is not None or time.time() > deadline:
            proc.kill()
            unavailable(f"sshd did not start: {(root / 'sshd.log').read_text()[-1000:]}")
        time.sleep(0.5)
    yield server
    proc.terminate()
    proc.wait(timeout=30)
    log.close()
    shutil.rmtree(root, ignore_errors=True)
