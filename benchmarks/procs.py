"""The benchmarks' process helpers, in one place: launching a job and timing it, finding and
stopping what a job left behind (by pid and start time, never by name), a process's and a process tree's memory, the
machine's memory, free ports and JSON Lines logs.

Standard library, and of Stride's only the cluster tools' /proc process table (ray_cluster/node.py, standard library
itself): every benchmark may import it (run.py, stream_memory.py, commands_bench.py, ...), and it imports no
benchmark, so there is no cycle through it.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from stride.ray_cluster.node import processes  # the process table, as the cluster tools read it

REPO = Path(__file__).resolve().parent.parent
def descendants(pid: int) -> dict[int, float]:
    """Every process below `pid` with its start time (so a pid reused later is never killed by mistake)."""
    procs = processes()
    children: dict[int, list[int]] = {}
    for child, info in procs.items():
        children.setdefault(info["ppid"], []).append(child)
    out, todo = {}, [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out[child] = procs[child]["start_s"]
            todo.append(child)
    return out


def tree(root: int, procs: dict[int, dict]) -> set[int]:
    """The root and its live descendants, plus anything else in its session (the run starts in a session of its
    own): a process whose parent has exited is re-parented out of the tree but keeps the session."""
    children: dict[int, list[int]] = {}
    for pid, info in procs.items():
        children.setdefault(info["ppid"], []).append(pid)
    out, todo = set(), [root]
    while todo:
        pid = todo.pop()
        if pid in procs and pid not in out:
            out.add(pid)
            todo.extend(children.get(pid, []))
    out.update(pid for pid, info in procs.items() if info["sid"] == root)
    return out


def alive(procs: dict[int, float]) -> list[int]:
    """Those of `procs` still running as the same process (same pid and start time)."""
    now = processes()
    return [pid for pid, started in procs.items() if pid in now and now[pid]["start_s"] == started]


def kill_exact(procs: dict[int, float]) -> int:
    """SIGKILL the processes we started that are still alive. Returns how many."""
    n = 0
    for pid in alive(procs):
        try:
            os.kill(pid, signal.SIGKILL)
            n += 1
        except ProcessLookupError:
            pass
    return n


# ---------------------------------------------------------------- launching

def clean_env() -> dict:
    """This environment without a Ray address, token or sample log inherited from the caller, unbuffered."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    for k in ("RAY_ADDRESS", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "RAY_AUTH_MODE", "STRIDE_SAMPLE_LOG"):
        env.pop(k, None)
    return env


def run_checked(cmd: list[str], env: dict, timeout_s: float, who: str, cwd: Path = REPO) -> float:
    """Run `cmd` to its end; its wall seconds. A non-zero exit raises RuntimeError naming `who`, the command's tail
    and the end of its output."""
    t0 = time.perf_counter()
    r = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout_s)
    if r.returncode != 0:
        raise RuntimeError(f"{who}: {' '.join(map(str, cmd[-6:]))} exited {r.returncode}: "
                           f"{r.stdout[-1500:]} {r.stderr[-1500:]}")
    return time.perf_counter() - t0


@dataclass
class Launch:
    rc: int
    wall_s: float
    first_step_s: float | None
    leftovers_killed: int
    log: str
    lines: list


def launch(cmd: list[str], log_path: Path, timeout_s: float, sample_log: Path | None = None, env: dict | None = None) -> Launch:
    """Run one job in its own session, from launch to exit. While it runs, poll (20 ms) for the end of its first
    optimizer step: rank 0's sample log (STRIDE_SAMPLE_LOG, one line per micro-step, written as the step's batch is
    built) gets its second line when step 2 starts, i.e. when step 1 has ended. Both runtimes write it the same way.
    Afterwards, every process of the tree still alive (Ray daemons) is stopped by pid."""
    env = dict(env or clean_env())
    if sample_log is not None:
        env["STRIDE_SAMPLE_LOG"] = str(sample_log)
    rank0 = sample_log / "rank0.jsonl" if sample_log is not None else None
    seen: dict[int, str | None] = {}
    with open(log_path, "w") as logf:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                start_new_session=True)
        # Every output line goes to the log prefixed with its arrival time since launch: the startup phases.
        stamped: list[tuple[float, str]] = []

        def pump():
            for raw in proc.stdout:
                t = time.perf_counter() - t0
                line = raw.decode(errors="replace").rstrip("\n")
                stamped.append((t, line))
                logf.write(f"{t:9.3f} {line}\n")

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        first = None
        next_scan = t0 + 1.0
        timed_out = False
        while proc.poll() is None:
            now = time.perf_counter()
            if first is None and rank0 is not None:
                try:
                    if rank0.stat().st_size and rank0.read_bytes().count(b"\n") >= 2:
                        first = now - t0
                except OSError:
                    pass
            if now >= next_scan:
                seen.update(descendants(proc.pid))
                next_scan = now + 2.0
            if now - t0 > timeout_s:
                timed_out = True
                seen.update(descendants(proc.pid))
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                kill_exact(seen)
                proc.wait()
                break
            time.sleep(0.02 if first is None else 0.1)
        wall = time.perf_counter() - t0
        reader.join(timeout=15)
    # Ray's daemons exit on their own after the driver; give them a moment, then stop what is left of ours.
    deadline = time.time() + 10
    while time.time() < deadline and alive(seen):
        time.sleep(0.25)
    left = kill_exact(seen)
    return Launch(124 if timed_out else proc.returncode, wall, first, left, str(log_path), stamped)


# ---------------------------------------------------------------- ports and logs

def free_port(host: str = "127.0.0.1") -> int:
    """A port free on `host` now (the kernel's pick)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def free_ports(n: int, host: str = "0.0.0.0") -> list[int]:
    """`n` distinct ports free on `host` now: all held open together while they are picked."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind((host, 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def read_jsonl(path: Path, skip_partial: bool = False) -> list[dict]:
    """The objects of a JSON Lines file ([] when there is none). `skip_partial`: a line that does not parse (one
    being written) is left out instead of raising."""
    path = Path(path)
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        try:
            out.append(json.loads(line))
        except ValueError:
            if not skip_partial:
                raise
    return out


# ---------------------------------------------------------------- memory

def rss_bytes() -> int:
    """This process's resident memory (/proc/self/statm)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def rollup(pid: int) -> tuple[int, int] | None:
    """(PSS, RSS) of one process in bytes, or None if it has exited or cannot be read."""
    found = {}
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith(("Pss:", "Rss:")):
                    found[line[:3]] = int(line.split()[1]) * 1024
    except (OSError, ValueError):
        return None
    return (found["Pss"], found["Rss"]) if len(found) == 2 else None


def meminfo() -> dict[str, int]:
    """/proc/meminfo in bytes."""
    out = {}
    with open("/proc/meminfo") as f:
        for line in f:
            key, value = line.split(":", 1)
            out[key] = int(value.split()[0]) * 1024
    return out


def system_used_bytes() -> int:
    """Memory in use on the whole machine (MemTotal - MemAvailable): unlike PSS it also sees shared memory that no
    process maps any more (a /dev/shm file), but also everything else running on the machine."""
    m = meminfo()
    return m["MemTotal"] - m["MemAvailable"]
