"""Run many short Stride commands, each in its own forked process, paying Python's and torch's import once.

    python tests/forked_cli.py <cases.json> <results.json> [<folder to watch>]

cases.json: a list of argv lists (a script path relative to the repository, then its arguments), as `python` would
take them. Each case runs in a child forked from this process after the heavy imports: the script runs as
`__main__` (runpy), with its own stdout and stderr files, and its exit status is what `python script ...` would
return (SystemExit's code; 1 and a traceback on stderr for an uncaught exception). results.json: one
{"returncode", "stdout", "stderr", "seconds"} per case, in order, plus "files": the sha256 of every file under the
watched folder after the case (so that a case that changed a file is named). The bad-input sweep uses this: ~100
commands that each fail in a fraction of a second after seconds of imports (torch's above all).
"""

from __future__ import annotations

import hashlib
import json
import os
import runpy
import signal
import sys
import tempfile
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CASE_TIMEOUT_S = 120


def _child(argv: list[str], out: str, err: str) -> None:
    """In the forked child: become `python argv...` and never return."""
    code = 1
    try:
        for fd, path in ((1, out), (2, err)):
            f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            os.dup2(f, fd)
            os.close(f)
        sys.stdout = open(1, "w", buffering=1, closefd=False)
        sys.stderr = open(2, "w", buffering=1, closefd=False)
        sys.argv = list(argv)
        try:
            if argv[0] == "-m":
                sys.argv = argv[1:]
                runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
            else:
                runpy.run_path(str(REPO / argv[0]), run_name="__main__")
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            if e.code is not None and not isinstance(e.code, int):
                print(e.code, file=sys.stderr)
        except BaseException:
            traceback.print_exc()
            code = 1
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def run(argv: list[str], tmp: Path, i: int) -> dict:
    out, err = str(tmp / f"{i}.out"), str(tmp / f"{i}.err")
    pid = os.fork()
    if pid == 0:
        _child(argv, out, err)
    started = time.monotonic()
    deadline = started + CASE_TIMEOUT_S
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            status = -1
            break
        time.sleep(0.01)
    code = os.waitstatus_to_exitcode(status) if status != -1 else -9
    return {"returncode": code, "stdout": Path(out).read_text(errors="replace"),
            "stderr": Path(err).read_text(errors="replace"), "seconds": time.monotonic() - started}


def digest(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and "__pycache__" not in p.parts}


def main(argv: list[str]) -> int:
    cases = json.loads(Path(argv[0]).read_text())
    # The imports every command shares (torch, pyarrow, pydantic, Stride's config, driver and tasks), done once:
    # torch is imported on the first config check (the task class), about 3 s of each case otherwise.
    import stride.trainers.driver  # noqa: F401
    import stride.trainers.main  # noqa: F401
    import stride.trainers.task  # noqa: F401
    import stride.trainers.tasks  # noqa: F401

    with tempfile.TemporaryDirectory() as tmp:
        results = []
        for i, case in enumerate(cases):
            results.append(run(case, Path(tmp), i))
            if len(argv) > 2:
                results[-1]["files"] = digest(Path(argv[2]))
    Path(argv[1]).write_text(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
