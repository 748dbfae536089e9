"""Start and stop one Ray node so that stopping it ends its own processes and nothing else.

    python3 node.py start STATE_DIR -- ray start --head --temp-dir=STATE_DIR/ray ...
    python3 node.py stop STATE_DIR
    python3 node.py status STATE_DIR

Why: `ray stop` (and `ray down`, which runs it) kills every Ray process on the host, other users' clusters
included, and "by temp dir" misses processes whose command line does not name it (the Ray client server has
only --address=IP:GCS_PORT; workers are titled `ray::IDLE`). So `start` runs `ray start` in a session of its
own with a marker in its environment, STRIDE_RAY_NODE=<random id>, that every process of the node inherits
(GCS, raylet, dashboard, client server, workers, job drivers), and records the id, the session and the
process tree in STATE_DIR/stride-node.json. `stop` finds the node's processes (the marker, the recorded pids,
the session, the client server of its GCS port, and all their descendants, so also a job's driver in a
session of its own; pids are checked against start times, so a reused pid is never taken for ours), sends
them SIGTERM, SIGKILLs what is left after a grace period, and fails if anything of the node survives.

Standard library and Linux /proc only: `ray up` copies this file onto every node (see cluster.yaml), where
Stride itself is not installed. ray_cluster/local.py uses it for local heads.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

# Public: benchmarks/ read the process table as the cluster tools do (tests/test_bench_imports.py).
__all__ = ["processes"]

STATE_FILE = "stride-node.json"
MARKER = "STRIDE_RAY_NODE"
CLIENT_SERVER = "ray.util.client.server"


def _boot_time_s() -> float:
    for line in Path("/proc/stat").read_text().splitlines():
        if line.startswith("btime "):
            return float(line.split()[1])
    raise RuntimeError("no btime in /proc/stat")


_TICKS = os.sysconf("SC_CLK_TCK")


def processes() -> dict[int, dict]:
    """Every live (non-zombie) process: {pid: {ppid, sid, start_s, cmdline}}."""
    boot = _boot_time_s()
    procs = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # exited while we looked
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # the command name may contain spaces and parentheses
        if fields[0] in "ZX":
            continue
        procs[int(entry)] = {"ppid": int(fields[1]), "sid": int(fields[3]),
                             "start_s": boot + int(fields[19]) / _TICKS, "cmdline": cmdline.strip()}
    return procs


class UnsafeStateDir(RuntimeError):
    """A state folder someone else could have written: refused, never believed."""


def private_dir(path: Path, create: bool = True) -> Path:
    """A state folder this user alone controls: created mode 0700, or an existing real directory (no symlink) owned
    by this user with no group or other access. Anything else is refused: a folder in /tmp that another user made
    first could hold a forged state file or a symlink to one of ours."""
    path = Path(path)
    if create and not os.path.lexists(path):
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            pass
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return path
    problem = ("is a symlink" if stat.S_ISLNK(st.st_mode) else "is not a folder" if not stat.S_ISDIR(st.st_mode)
               else f"belongs to uid {st.st_uid}, not to you (uid {os.getuid()})" if st.st_uid != os.getuid()
               else f"has mode {st.st_mode & 0o777:o}: others can reach it" if st.st_mode & 0o077 else None)
    if problem:
        raise UnsafeStateDir(f"state folder {path} {problem}; it must be yours and private (mode 700): remove it, "
                             f"or use another folder")
    return path


def node_staging_dir(configured: str | None = None) -> Path:
    """This node's folder for a run's local files when the run lives in a bucket (checkpoint.staging_dir, default a
    folder of this user's under the temporary directory); callers make it private with private_dir."""
    import tempfile

    return Path(configured).expanduser() if configured else Path(tempfile.gettempdir()) / f"stride-{os.getuid()}"


def read_state(state_dir: Path) -> dict | None:
    path = private_dir(state_dir, create=False) / STATE_FILE
    return json.loads(path.read_text()) if path.exists() else None


def write_state(state_dir: Path, state: dict) -> None:
    path = Path(state_dir) / STATE_FILE
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(state, indent=1) + "\n")
    tmp.replace(path)


def _flag(argv: list[str], name: str) -> str | None:
    for i, arg in enumerate(argv):
        if arg.startswith(f"{name}="):
            return arg.split("=", 1)[1]
        if arg == name and i + 1 < len(argv):
            return argv[i + 1]
    return None


def _gcs_port(argv: list[str]) -> str:
    return _flag(argv, "--port") or "6379"


def cluster_address(argv: list[str]) -> str:
    """The GCS address of the cluster that `ray start` argv joins or creates. Ray resolves 127.0.0.1 to the
    node's own IP."""
    return _flag(argv, "--address") or f"127.0.0.1:{_gcs_port(argv)}"


def _has_marker(pid: int, marker: bytes) -> bool:
    try:
        return marker in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:  # gone, or another user's
        return False


def node_processes(state: dict, procs: dict[int, dict] | None = None) -> dict[int, dict]:
    """The node's live processes: those with its marker or a recorded pid (same start time), the rest of its
    session, the client server of its GCS port, and every descendant of those."""
    procs = processes() if procs is None else procs
    since = state["started_at"] - 60.0  # /proc start times are only as exact as the boot time (whole seconds)
    marker = f"{MARKER}={state['id']}".encode()
    recorded = {int(pid): start for pid, start in state.get("pids", {}).items()}
    anchors = {pid for pid, p in procs.items()
               if p["start_s"] >= since and (recorded.get(pid) == p["start_s"] or _has_marker(pid, marker))}
    # Processes that retitle themselves (ray::IDLE, ray-dashboard-*) overwrite their environment, marker
    # included; they are found by session. The session id is ours only while a process of the node lives:
    # once none does, Linux may give the number to another session.
    session = state["sid"] if anchors else None
    port = _gcs_port(state["argv"]) if "--head" in state["argv"] else None

    def belongs(pid: int, p: dict) -> bool:
        if pid in anchors or p["sid"] == session:
            return True
        # The client server daemonizes; its command line names the GCS address but not the temp dir.
        return p["start_s"] >= since and bool(port) and CLIENT_SERVER in p["cmdline"] and any(
            arg.startswith("--address=") and arg.endswith(f":{port}") for arg in p["cmdline"].split())

    found = {pid: p for pid, p in procs.items() if belongs(pid, p)}
    grew = True
    while grew:  # descendants, e.g. a job's driver in its own session, pip runs of the runtime-env agent
        kids = {pid: p for pid, p in procs.items() if p["ppid"] in found and pid not in found}
        found.update(kids)
        grew = bool(kids)
    return found


def start(state_dir: Path, argv: list[str], env: dict | None = None, quiet: bool = False) -> dict:
    """Run `ray start ...` (argv) in a new session, marked, and record the node. Raises RuntimeError if it fails."""
    state_dir = private_dir(Path(state_dir))
    old = read_state(state_dir)
    if old and node_processes(old):
        raise RuntimeError(f"a Ray node started from {state_dir} is still running; stop it first: "
                           f"python3 {Path(__file__).name} stop {state_dir}")
    env = dict(os.environ if env is None else env)
    # Every process of the node inherits it. Without it, Ray code that looks its cluster up (Train's
    # PlacementGroupCleaner) finds several on a shared host and fails ("Found multiple active Ray instances").
    env["RAY_ADDRESS"] = cluster_address(argv)
    node_id = secrets.token_hex(8)
    env[MARKER] = node_id
    started_at = time.time()
    # quiet: output to a file, not a pipe, which the daemons `ray start` leaves behind would hold open.
    log = open(state_dir / "ray-start.log", "w") if quiet else None
    proc = subprocess.Popen(argv, env=env, start_new_session=True, stdout=log, stderr=subprocess.STDOUT if quiet else None)
    # Recorded before waiting: a start that dies half-way is still stoppable.
    state = {"id": node_id, "sid": proc.pid, "started_at": started_at, "argv": argv, "pids": {}}
    write_state(state_dir, state)
    proc.wait()
    if log:
        log.close()
    state["pids"] = {str(pid): p["start_s"] for pid, p in node_processes(state).items()}
    write_state(state_dir, state)
    if proc.returncode != 0:
        stop(state_dir)
        tail = "\n".join((state_dir / "ray-start.log").read_text().splitlines()[-15:]) if quiet else ""
        raise RuntimeError(f"`{' '.join(argv[:3])} ...` exited with {proc.returncode}\n{tail}{_raylet_tail(argv)}")
    return state


def _raylet_tail(argv: list[str], lines: int = 5) -> str:
    """The end of the node's raylet log: `ray start` says only that the raylet never registered, not why."""
    temp_dir = _flag(argv, "--temp-dir")
    log = Path(temp_dir) / "session_latest" / "logs" / "raylet.out" if temp_dir else None
    if log is None or not log.exists():
        return ""
    return "\nraylet.out ends:\n" + "\n".join(log.read_text(errors="replace").splitlines()[-lines:])


def stop(state_dir: Path, grace_s: float = 5.0) -> list[int]:
    """SIGTERM the node's processes, SIGKILL what is left after grace_s. Returns the stopped pids; raises
    RuntimeError if any process of the node is still alive at the end."""
    # The GCS server and the autoscaler monitor ignore SIGTERM (seen alive 20 s later); `ray stop` itself
    # waits 16 s and then SIGKILLs. Everything else is gone within a few seconds.
    state = read_state(Path(state_dir))
    if state is None:
        return []
    known: dict[int, float] = {}  # pid -> start time of all ever found: an orphan whose parent died first stays ours
    signalled: set[int] = set()
    deadline = time.time() + grace_s
    sig = signal.SIGTERM
    while True:
        procs = processes()
        known.update({pid: p["start_s"] for pid, p in node_processes(state, procs).items()})
        alive = {pid: procs[pid] for pid, start in known.items() if pid in procs and procs[pid]["start_s"] == start}
        if not alive:
            return sorted(known)
        if time.time() > deadline:
            if sig == signal.SIGKILL:
                left = "; ".join(f"{pid} {p['cmdline'][:80]}" for pid, p in alive.items())
                raise RuntimeError(f"processes of the Ray node in {state_dir} survived SIGKILL: {left}")
            sig, deadline, signalled = signal.SIGKILL, time.time() + 10.0, set()
        for pid in alive.keys() - signalled:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
            signalled.add(pid)
        time.sleep(0.25)


def main(argv: list[str]) -> int:
    if len(argv) < 2 or argv[0] not in ("start", "stop", "status"):
        # One line, as every Stride command's usage errors (stride/cli.py; this file runs without Stride).
        print(f"node.py: error: expected start|stop|status STATE_DIR, got {' '.join(argv)[:200]!r}; "
              f"see the top of {__file__}", file=sys.stderr)
        return 2
    cmd, state_dir = argv[0], Path(os.path.expanduser(argv[1]))
    try:
        if cmd == "start":
            if argv[2:3] != ["--"] or len(argv) < 4:
                print("node.py: error: start needs STATE_DIR -- ray start ...; see the top of " + __file__,
                      file=sys.stderr)
                return 2
            start(state_dir, argv[3:])
        elif cmd == "stop":
            pids = stop(state_dir)
            print(f"stride node: stopped {len(pids)} process(es) of the Ray node in {state_dir}")
        else:
            state = read_state(state_dir)
            alive = node_processes(state) if state else {}
            print(f"stride node: {len(alive)} process(es) of the Ray node in {state_dir} running")
            return 0 if alive else 1
    except UnsafeStateDir as e:
        print(f"stride node: error: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:
        print(f"stride node: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
