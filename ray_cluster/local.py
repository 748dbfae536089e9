"""A Ray head on this machine with token auth; several can run side by side, each stopped on its own.

    python -m stride.ray_cluster.local start [--port 6379] [--dashboard-port 8265] [--temp-dir /tmp/stride-ray]
                                      [--metrics-export-port M] [--num-cpus N]
    python -m stride.ray_cluster.local status [--temp-dir /tmp/stride-ray]
    python -m stride.ray_cluster.local stop [--temp-dir /tmp/stride-ray]

`start` writes a fresh token (mode 0600) to TEMP_DIR/auth_token and runs `ray start --head` with
RAY_AUTH_MODE=token and RAY_AUTH_TOKEN_PATH set to it (Ray's ~/.ray/auth_token is never read or written), the
dashboard on 127.0.0.1, Ray's files in TEMP_DIR/ray and a port of its own for everything that listens (GCS,
dashboard, client server, node and object manager, agents, metrics, workers): the defaults of the last ones
collide between two heads. A second head needs another --temp-dir, --port and --dashboard-port. Then:

    export RAY_ADDRESS=<address> RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH=TEMP_DIR/auth_token
    python trainers/main.py --config trainers/configs/char_gpt.yaml
    ray job submit --address http://127.0.0.1:8265 --working-dir . -- python trainers/main.py --config ...

`stop` ends exactly this head's processes, by pid, and checks that none is left (ray_cluster/node.py says how);
it never runs `ray stop`, which would kill every Ray on the machine. A job's `python` is the first one on the
PATH of `ray start`: `start` puts this interpreter's bin/ first.

Python (tests): start_head(...) -> Head, load_head(temp_dir), head_status(head), stop_head(head),
add_node(head, temp_dir, num_cpus) and stop_node(temp_dir) for a worker node on the same machine.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import sys
import urllib.error
import urllib.request
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from pathlib import Path

from stride.errors import EXIT_FAILED, EXIT_USAGE, StrideError
from stride.cli import ArgumentParser, error_line
from stride.ray_cluster import node

__all__ = ["Head", "HeadError", "add_node", "head_status", "load_head", "start_head", "stop_head", "stop_node"]

DEFAULT_TEMP_DIR = Path("/tmp/stride-ray")
HEAD_FILE = "stride-head.json"
# Ray's unix sockets live in TEMP_DIR/ray/session_<41 chars>/sockets/plasma_store; Linux allows 107 bytes.
MAX_TEMP_DIR_CHARS = 40
WORKER_PORTS = 100  # one port per worker process; plenty for a head with a few CPUs
WORKER_PORT_RANGE = (20000, 24000)  # see _free_port_block


@dataclass
class Head:
    temp_dir: Path
    address: str  # GCS address, for RAY_ADDRESS
    dashboard_url: str  # for `ray job submit --address`
    token_path: Path
    ports: dict[str, int] = field(default_factory=dict)

    def client_env(self) -> dict[str, str]:
        """What a client (trainers/main.py, ray job submit, ray.init) needs to join this head."""
        return {"RAY_ADDRESS": self.address, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(self.token_path)}

    def pids(self) -> list[int]:
        state = node.read_state(self.temp_dir)
        return sorted(node.node_processes(state)) if state else []


class HeadError(StrideError):
    """One line for the user: a head that failed (exit 1)."""

    exit_code = EXIT_FAILED


class HeadUsageError(HeadError):
    """One line for the user: a request the user can fix (exit 2)."""

    exit_code = EXIT_USAGE


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as servers do: TIME_WAIT leftovers are no conflict
        try:
            s.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


def _free_ports(n: int, taken: set[int]) -> list[int]:
    """n free ports, none of them in taken (the ports given on the command line)."""
    with ExitStack() as stack:  # hold them all open so that the ports differ
        ports: list[int] = []
        while len(ports) < n:
            s = stack.enter_context(socket.socket())
            s.bind(("0.0.0.0", 0))
            if s.getsockname()[1] not in taken:
                ports.append(s.getsockname()[1])
        return ports


def _free_port_block(size: int, taken: set[int]) -> int:
    """size consecutive free ports for workers, in 20000-23999: above Ray's default worker ports (10002-19999,
    other Rays), below Stride's SLURM jobs (24000-32767, ray_cluster/slurm/ports.py) and the kernel's ephemeral
    ports (32768+, taken at random by outgoing connections); none in taken."""
    rng = secrets.SystemRandom()
    for _ in range(100):
        first = rng.randrange(WORKER_PORT_RANGE[0], WORKER_PORT_RANGE[1] - size + 1, size)
        block = set(range(first, first + size))
        if not taken & block and all(_port_free(p) for p in block):
            return first
    raise HeadError(f"found no {size} consecutive free ports for Ray workers in {WORKER_PORT_RANGE[0]}-"
                    f"{WORKER_PORT_RANGE[1] - 1}; stop a head you no longer need")


def _write_token(path: Path) -> None:
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))


def start_head(temp_dir: Path = DEFAULT_TEMP_DIR, port: int = 6379, dashboard_port: int = 8265,
               num_cpus: int | None = None, metrics_export_port: int | None = None) -> Head:
    temp_dir = Path(os.path.abspath(temp_dir))  # not resolve(): a symlinked folder is refused, not followed
    if len(str(temp_dir)) > MAX_TEMP_DIR_CHARS:
        raise HeadUsageError(f"--temp-dir ({temp_dir}) is longer than {MAX_TEMP_DIR_CHARS} characters, too long for "
                        f"Ray's unix sockets; use a short path such as /tmp/stride-ray-2")
    state = node.read_state(temp_dir)
    if state and node.node_processes(state):
        raise HeadUsageError(f"a Ray head from --temp-dir {temp_dir} is already running; stop it "
                        f"(python -m stride.ray_cluster.local stop --temp-dir {temp_dir}) or use another --temp-dir")
    for flag, value in (("--port", port), ("--dashboard-port", dashboard_port),
                        ("--metrics-export-port", metrics_export_port)):
        if value is not None and not _port_free(value):
            raise HeadUsageError(f"{flag} ({value}) is in use (another Ray head?); pass {flag} <a free port>")
    node.private_dir(temp_dir)  # holds the token and the state; Ray's own (world-writable) temp dir goes inside
    token_path = temp_dir / "auth_token"
    _write_token(token_path)

    given = {port, dashboard_port, metrics_export_port} - {None}

    def head_argv() -> tuple[list[str], dict[str, int]]:
        argv, ports = _ray_start(temp_dir, metrics_export_port, given, num_cpus)
        ports.update(gcs=port, dashboard=dashboard_port)
        (client,) = _free_ports(1, set(ports.values()))
        ports["ray_client_server"] = client
        return argv + ["--head", "--dashboard-host=127.0.0.1", "--include-dashboard=true", f"--port={port}",
                       f"--dashboard-port={dashboard_port}", f"--ray-client-server-port={client}"], ports

    ports = _start_node(temp_dir, head_argv, _node_env(token_path), "ray start")
    address = (temp_dir / "ray" / "ray_current_cluster").read_text().strip()
    head = Head(temp_dir, address, f"http://127.0.0.1:{dashboard_port}", token_path, ports)
    (temp_dir / HEAD_FILE).write_text(json.dumps(asdict(head), indent=1, default=str) + "\n")
    return head


def _ray_start(temp_dir: Path, metrics_export_port: int | None, taken: set[int],
               num_cpus: int | None) -> tuple[list[str], dict[str, int]]:
    """`ray start` with a port of its own for everything a node listens on (head or worker node)."""
    node_manager, object_manager, agent_http, agent_grpc, runtime_env_agent, metrics = _free_ports(6, taken)
    ports = {"node_manager": node_manager, "object_manager": object_manager, "dashboard_agent_listen": agent_http,
             "dashboard_agent_grpc": agent_grpc, "runtime_env_agent": runtime_env_agent,
             "metrics_export": metrics_export_port or metrics}
    ports["min_worker"] = _free_port_block(WORKER_PORTS, set(ports.values()) | taken)
    ports["max_worker"] = ports["min_worker"] + WORKER_PORTS - 1
    bin_dir = Path(sys.executable).parent
    argv = [str(bin_dir / "ray") if (bin_dir / "ray").exists() else "ray", "start",
            f"--temp-dir={temp_dir / 'ray'}", "--disable-usage-stats",
            f"--node-manager-port={node_manager}", f"--object-manager-port={object_manager}",
            f"--dashboard-agent-listen-port={agent_http}", f"--dashboard-agent-grpc-port={agent_grpc}",
            f"--runtime-env-agent-port={runtime_env_agent}", f"--metrics-export-port={ports['metrics_export']}",
            f"--min-worker-port={ports['min_worker']}", f"--max-worker-port={ports['max_worker']}"]
    if num_cpus is not None:
        argv.append(f"--num-cpus={num_cpus}")
    return argv, ports


def _node_env(token_path: Path) -> dict[str, str]:
    bin_dir = Path(sys.executable).parent
    env = {k: v for k, v in os.environ.items() if k != "RAY_AUTH_TOKEN"}
    env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(token_path),
               PATH=f"{bin_dir}{os.pathsep}{env.get('PATH', '')}")  # the `python` of every job on this node
    return env


def add_node(head: Head, temp_dir: Path, num_cpus: int | None = None) -> None:
    """Join a worker node on this machine to `head` (with the head's token); stop it with stop_node(temp_dir).
    A second node on one host gives a test what a real cluster does when it grows (elastic training)."""
    temp_dir = node.private_dir(Path(os.path.abspath(temp_dir)))

    def node_argv() -> tuple[list[str], dict[str, int]]:
        argv, ports = _ray_start(temp_dir, None, set(head.ports.values()), num_cpus)
        return argv + [f"--address={head.address}"], ports

    _start_node(temp_dir, node_argv, _node_env(head.token_path), "ray start (worker node)")


def _start_node(temp_dir: Path, make_argv, env: dict[str, str], what: str, attempts: int = 2) -> dict[str, int]:
    """`ray start` with the ports `make_argv` picks; a failed start is stopped and tried again once with ports
    picked afresh. A port seen free is bound by Ray only seconds later, and an outgoing connection of any process
    can take it in between (source ports come from the same range); a raylet that cannot bind never registers, and
    `ray start` fails after its 30 s wait (seen once in the test suite, with two heads starting at once)."""
    for attempt in range(attempts):
        argv, ports = make_argv()
        try:
            node.start(temp_dir, argv, env=env, quiet=True)
            return ports
        except RuntimeError as e:
            error = e
            if attempt + 1 < attempts:
                print(f"stride: {what} failed ({str(e).splitlines()[-1][:200]}); trying again with other ports",
                      file=sys.stderr)
    raise HeadError(f"{what} failed: {error}") from None


def stop_node(temp_dir: Path) -> list[int]:
    """Stop exactly the processes of the node started from temp_dir (add_node); returns their pids."""
    try:
        return node.stop(Path(os.path.abspath(temp_dir)))
    except RuntimeError as e:
        raise HeadError(str(e)) from None


def load_head(temp_dir: Path = DEFAULT_TEMP_DIR) -> Head:
    """The head started from temp_dir. Its folder must be private (node.private_dir), and the paths come from the
    folder, not from the JSON: the token is temp_dir/auth_token, the dashboard 127.0.0.1 on the recorded port."""
    folder = node.private_dir(Path(os.path.abspath(temp_dir)), create=False)
    path = folder / HEAD_FILE
    if not path.exists():
        raise HeadUsageError(f"no Ray head was started with --temp-dir {temp_dir} ({path} does not exist)")
    try:
        data = json.loads(path.read_text())
        ports = {str(k): int(v) for k, v in data["ports"].items()}
        address, dashboard = str(data["address"]), ports["dashboard"]
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise HeadUsageError(f"{path} is not a head's state file ({type(e).__name__}); stop the head's processes and "
                        f"remove {folder}") from None
    return Head(folder, address, f"http://127.0.0.1:{dashboard}", folder / "auth_token", ports)


def dashboard_status(head: Head, token: str | None = None) -> int:
    """HTTP status of an authenticated dashboard endpoint (/api/version): 200, 401 without a token, 403 wrong."""
    request = urllib.request.Request(f"{head.dashboard_url}/api/version")
    if token is not None:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return 0  # not listening


def head_status(head: Head) -> dict:
    token = head.token_path.read_text().strip() if head.token_path.exists() else None
    pids = head.pids()
    return {"running": bool(pids), "processes": len(pids), "address": head.address,
            "dashboard": head.dashboard_url, "dashboard_http": dashboard_status(head, token) if pids else 0,
            "token_path": str(head.token_path), "temp_dir": str(head.temp_dir)}


def stop_head(head: Head) -> list[int]:
    """Stop exactly this head's processes; returns their pids. Raises HeadError if any survives."""
    try:
        pids = node.stop(head.temp_dir)
    except RuntimeError as e:
        raise HeadError(str(e)) from None
    head.token_path.unlink(missing_ok=True)  # a dead cluster's secret has no use
    return pids


def main(argv: list[str] | None = None) -> int:
    ap = ArgumentParser(prog="python -m stride.ray_cluster.local", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    start = sub.add_parser("start", help="start a head with token auth")
    start.add_argument("--port", type=int, default=6379, help="GCS port (RAY_ADDRESS)")
    start.add_argument("--dashboard-port", type=int, default=8265, help="dashboard and job API port")
    start.add_argument("--metrics-export-port", type=int, default=None, help="Prometheus metrics port (default: free)")
    start.add_argument("--num-cpus", type=int, default=None, help="logical CPUs (default: Ray counts the cores)")
    for p in (start, sub.add_parser("status", help="is the head running"), sub.add_parser("stop", help="stop the head")):
        p.add_argument("--temp-dir", type=Path, default=DEFAULT_TEMP_DIR, help="state, token and Ray's files")
    args = ap.parse_args(argv)
    try:
        if args.command == "start":
            head = start_head(args.temp_dir, args.port, args.dashboard_port, args.num_cpus, args.metrics_export_port)
            print(f"stride: Ray head running with token auth ({len(head.pids())} processes)\n"
                  f"  address    {head.address}\n"
                  f"  dashboard  {head.dashboard_url}\n"
                  f"  token      {head.token_path}\n"
                  f"  state      {head.temp_dir / HEAD_FILE}\n"
                  f"use it:  export RAY_ADDRESS={head.address} RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH={head.token_path}\n"
                  f"stop it: python -m stride.ray_cluster.local stop --temp-dir {head.temp_dir}")
        elif args.command == "status":
            status = head_status(load_head(args.temp_dir))
            print("\n".join(f"{k:<15} {v}" for k, v in status.items()))
            return 0 if status["running"] else 1
        else:
            pids = stop_head(load_head(args.temp_dir))
            print(f"stride: stopped the Ray head in {args.temp_dir} ({len(pids)} processes); none is left")
    except (node.UnsafeStateDir, HeadUsageError) as e:
        error_line(e)
        return 2
    except HeadError as e:
        error_line(e)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
