"""The embedded Ray's watchdog: when the driver that started a local Ray dies, by any signal, SIGKILL included, every
process of that Ray goes too, and its token folder with them.

Ray 2.60 ties only the processes the driver starts itself to its life (PR_SET_PDEATHSIG on the GCS, the raylet, the
dashboard): the raylet's own children outlive it. Its workers die within seconds, but a Train worker in the middle of a
checkpoint writes on meanwhile, and the dashboard and runtime-env agents hang for minutes, reporting the raylet's death
to a GCS that is gone. This process, started by ray_cluster/connect.py init_ray() with one end of a pipe as stdin,
waits for end-of-file (the driver's last descriptor of the pipe closed: it died or exited), then kills exactly the
processes of that Ray session: this user's processes whose command line or standard streams name the session's
folder (Ray starts each of them so). Nothing else is touched: no `ray stop`, no other session, no other user.

Standard library only, run by path with `python -I`: it must start in milliseconds and import nothing of the run's.

    python -I ray_cluster/watchdog.py <session dir> [<token folder>]   (stdin: the pipe)
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import time


def session_processes(session_dir: str) -> list[int]:
    """Pids of this user's processes (not this one) that belong to the Ray session in `session_dir`: its command line
    names the folder (GCS, raylet, dashboard, monitors), or it writes into it (every worker and agent logs there).
    Someone who only reads a log there (`tail -f`) is not Ray's."""
    own, uid, found = os.getpid(), os.getuid(), []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == own:
            continue
        try:
            if os.stat(f"/proc/{name}").st_uid != uid:
                continue
            with open(f"/proc/{name}/cmdline", "rb") as f:
                named = session_dir.encode() in f.read()
            if named or _writes_into(name, session_dir + os.sep):
                found.append(int(name))
        except OSError:  # gone meanwhile
            continue
    return found


def _writes_into(pid: str, folder: str) -> bool:
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            if not os.readlink(f"/proc/{pid}/fd/{fd}").startswith(folder):
                continue
            with open(f"/proc/{pid}/fdinfo/{fd}") as f:
                flags = next(int(line.split()[1], 8) for line in f if line.startswith("flags:"))
        except (OSError, StopIteration, ValueError):
            continue
        if flags & (os.O_WRONLY | os.O_RDWR):
            return True
    return False


def reap(session_dir: str, settle_s: float = 3.0) -> int:
    """SIGKILL the session's processes until none is left (a raylet may still start one as it dies); returns how many
    were killed."""
    killed, quiet, deadline = set(), 0, time.monotonic() + settle_s
    while quiet < 2 and time.monotonic() < deadline:
        pids = session_processes(session_dir)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
                killed.add(pid)
            except ProcessLookupError:
                pass
        quiet = 0 if pids else quiet + 1
        time.sleep(0.1)
    return len(killed)


def main(argv: list[str]) -> int:
    session_dir, token_dir = argv[0].rstrip(os.sep), (argv[1] if len(argv) > 1 else None)
    # The driver's Ctrl-C, a terminal hang-up or a job step's SIGTERM is for the driver: this one waits for it to end.
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    while sys.stdin.buffer.read(4096):
        pass
    reap(session_dir)
    if token_dir:
        shutil.rmtree(token_dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
