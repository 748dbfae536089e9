"""Run short Stride commands, each in its own forked process, paying Python's and torch's import once.

    python tests/forked_cli.py <cases.json> <results.json> [<folder to watch>]
    python tests/forked_cli.py --serve

cases.json: a list of argv lists (a script path, relative to the working directory, then its arguments), as
`python` would take them. Each case runs in a child forked from this process after the heavy imports: the script
runs as `__main__` (runpy), with its own stdout and stderr files and no stdin, then its threads and exit handlers
end as at a normal exit, and its exit status is what `python script ...` would return (SystemExit's code; 1 and a
traceback on stderr for an uncaught exception). results.json: one {"returncode", "stdout", "stderr", "seconds"} per
case, in order, plus "files": the sha256 of every file under the watched folder after the case (so that a case
that changed a file is named). The bad-input sweep uses this: ~100 commands that each fail in a fraction of a
second after seconds of imports (torch's above all).

--serve, a fork server (tests/conftest.py's run_cli_forked): the same imports, then one JSON request a line on
stdin, {"argv": [...], "env": {...}, "cwd": "...", "timeout": s, "id": any}, each answered by one JSON line on
stdout, {"returncode", "stdout", "stderr", "seconds", "timed_out", "id"}. The child runs in `cwd` with exactly
`env` as its environment and the sys.path a fresh `python` would build from it (the script's folder, or `cwd` for
-m, then PYTHONPATH); one still running at `timeout` is killed with its whole process group. The server ends at
the end of its input.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import os
import runpy
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parent.parent
CASE_TIMEOUT_S = 120


def import_shared() -> None:
    """The imports every command shares (torch, pyarrow, pydantic, Stride's config, driver and tasks), done once:
    torch is imported on the first config check (the task class), about 3 s of each case otherwise. Imports only, no
    torch op and no thread pool: the children are forked from this process and must be as safe as a fresh one."""
    # torch.optim's first optimizer imports torch._dynamo (the driver's config check builds one): 2 s of each.
    import torch._dynamo  # noqa: F401

    import stride.trainers.launch.ray  # noqa: F401
    import stride.trainers.main  # noqa: F401
    import stride.trainers.task  # noqa: F401
    import stride.trainers.tasks  # noqa: F401

    if threading.active_count() != 1:
        raise SystemExit(f"forked_cli: the shared imports started threads ({threading.enumerate()}): a child forked "
                         "now would hold their locks as they were")


def _child(argv: list[str], out: str, err: str, enter: Callable[[], None] | None = None) -> None:
    """In the forked child: become `python argv...`, in a process group of its own (`enter` first prepares the rest
    of what it needs), and never return."""
    code = 1
    try:
        os.setpgid(0, 0)
        for fd, path, flags in ((0, os.devnull, os.O_RDONLY), (1, out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
                                (2, err, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)):
            f = os.open(path, flags, 0o600)
            os.dup2(f, fd)
            os.close(f)
        sys.stdin = open(0, closefd=False)  # not the parent's, whose buffer may hold its own input
        sys.stdout = open(1, "w", buffering=1, closefd=False)
        sys.stderr = open(2, "w", buffering=1, closefd=False)
        sys.argv = list(argv)
        try:
            if enter is not None:
                enter()
            if argv[0] == "-m":
                sys.argv = argv[1:]
                runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
            else:
                runpy.run_path(argv[0], run_name="__main__")
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            if e.code is not None and not isinstance(e.code, int):
                print(e.code, file=sys.stderr)
        except BaseException:
            traceback.print_exc()
            code = 1
        _exit_as_python_does()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _exit_as_python_does() -> None:
    """What the interpreter does at a normal exit before flushing: wait for the command's non-daemon threads, then
    run its exit handlers (os._exit skips both). The handlers include those its imports registered in the parent,
    as a fresh interpreter's imports register them; the parent holds nothing else a handler would clean up."""
    threading._shutdown()
    atexit._run_exitfuncs()


def run(argv: list[str], tmp: Path, i: int, timeout: float = CASE_TIMEOUT_S,
        enter: Callable[[], None] | None = None) -> dict:
    """`argv` in a forked child (`enter` first prepares it), its own process group killed at `timeout`."""
    out, err = str(tmp / f"{i}.out"), str(tmp / f"{i}.err")
    pid = os.fork()
    if pid == 0:
        _child(argv, out, err, enter)
    try:
        os.setpgid(pid, pid)  # the child does it too: whichever runs first, the group exists before any kill
    except OSError:
        pass
    started = time.monotonic()
    deadline = started + timeout
    timed_out = False
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.killpg(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            timed_out = True
            break
        time.sleep(0.01)
    code = -9 if timed_out else os.waitstatus_to_exitcode(status)
    return {"returncode": code, "stdout": _read(out), "stderr": _read(err), "seconds": time.monotonic() - started,
            "timed_out": timed_out}


def _read(path: str) -> str:
    """A child's output file; empty if it was killed before it made it."""
    try:
        return Path(path).read_text(errors="replace")
    except FileNotFoundError:
        return ""


def digest(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and "__pycache__" not in p.parts}


def main(argv: list[str]) -> int:
    if argv == ["--serve"]:
        return serve()
    cases = json.loads(Path(argv[0]).read_text())
    import_shared()
    # mkdtemp, not TemporaryDirectory: the children run the exit handlers they inherit, and a TemporaryDirectory's
    # is one (weakref.finalize), which would remove the folder their output is in.
    tmp = Path(tempfile.mkdtemp(prefix="forked_cli-"))
    try:
        results = []
        for i, case in enumerate(cases):
            results.append(run(case, tmp, i))
            if len(argv) > 2:
                results[-1]["files"] = digest(Path(argv[2]))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    Path(argv[1]).write_text(json.dumps(results))
    return 0


# ---- --serve ---------------------------------------------------------------------------------------------------

def serve() -> int:
    """Answer each request line on stdin with one line on stdout, until stdin ends."""
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # what an import prints goes to stderr, never into the answers
    startup_path = _interpreter_path()
    import_shared()
    tmp = Path(tempfile.mkdtemp(prefix="forked_cli-"))
    try:
        for i, line in enumerate(sys.stdin):
            request = json.loads(line)
            result = run(request["argv"], tmp, i, timeout=request.get("timeout", CASE_TIMEOUT_S),
                         enter=lambda: _enter(request, startup_path, answers.fileno()))
            for name in (f"{i}.out", f"{i}.err"):
                (tmp / name).unlink(missing_ok=True)
            result["id"] = request.get("id")
            answers.write(json.dumps(result) + "\n")
            answers.flush()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


def _interpreter_path() -> list[str]:
    """This interpreter's sys.path without what `python tests/forked_cli.py` and PYTHONPATH put before it: what any
    fresh `python` on this machine starts from."""
    given = {os.path.abspath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p}
    return [p for p in sys.path[1:] if os.path.abspath(p) not in given]


def _enter(request: dict, startup_path: list[str], answers_fd: int) -> None:
    """In the forked child, before the command: the working directory, environment and sys.path `python argv` would
    have there, and none of the server's pipes."""
    os.close(answers_fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.path[:] = _fresh_path(request["argv"], request["env"], startup_path)
    sys.dont_write_bytecode = bool(request["env"].get("PYTHONDONTWRITEBYTECODE"))


def _fresh_path(argv: list[str], env: dict[str, str], startup_path: list[str]) -> list[str]:
    """The sys.path `python argv` starts with in the working directory: the script's folder (the working directory
    for -m), then PYTHONPATH's folders, then the interpreter's own."""
    if argv[0] == "-m":
        first = os.getcwd()
    else:
        script = os.path.realpath(argv[0]) if os.path.islink(argv[0]) else argv[0]
        first = os.path.dirname(os.path.abspath(script))
    return [first, *(os.path.abspath(p) for p in env.get("PYTHONPATH", "").split(os.pathsep) if p), *startup_path]


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
