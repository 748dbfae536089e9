"""The fork server behind run_cli_forked (tests/forked_cli.py --serve): a command forked from it must see what
`python <script>` started by run_cli would see (its environment, working directory and sys.path) and give back what
that process would (exit status, both streams, after its threads and exit handlers), or the tests that use it
would check something else than the command a user runs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest

from conftest import run_cli_forked

COMMAND = """
import atexit, json, os, sys, threading, time
import helper  # from PYTHONPATH

atexit.register(lambda: print("exit handler ran", file=sys.stderr))
threading.Thread(target=lambda: (time.sleep(0.2), print("thread ended"))).start()
print(json.dumps({"env": dict(os.environ), "cwd": os.getcwd(), "path": sys.path[:2], "stdin": sys.stdin.read()}))
print("to stderr", file=sys.stderr)
sys.exit(int(sys.argv[1]))
"""

SPAWNS_AND_HANGS = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
open(sys.argv[1], "w").write(str(child.pid))
time.sleep(600)
"""


def test_a_command_sees_its_env_cwd_and_path_and_gives_back_status_streams_and_exit_handlers(tmp_path, monkeypatch):
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "cmd.py").write_text(COMMAND)
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "helper.py").write_text("")
    (tmp_path / "work").mkdir()
    env = {"PYTHONPATH": str(tmp_path / "lib"), "STRIDE_TEST_MARK": "é x"}
    assert run_cli_forked(["bin/cmd.py", "0"], env=env, cwd=tmp_path).returncode == 0  # the server has PATH and all
    monkeypatch.delenv("PATH")
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:1")  # dropped unless given, as run_cli drops it
    r = run_cli_forked(["../bin/cmd.py", "3"], env=env, cwd=tmp_path / "work")
    assert r.returncode == 3, r.stderr
    seen = json.loads(r.stdout.splitlines()[0])
    expected = dict(os.environ, PYTHONUNBUFFERED="1", **env)
    del expected["RAY_ADDRESS"]
    assert seen["env"] == expected and "PATH" not in seen["env"]
    assert seen["cwd"] == str(tmp_path / "work")
    assert seen["path"] == [str(tmp_path / "bin"), str(tmp_path / "lib")] and seen["stdin"] == ""
    assert r.stdout.splitlines()[1:] == ["thread ended"]
    assert r.stderr.splitlines() == ["to stderr", "exit handler ran"]


def test_a_command_past_its_timeout_is_killed_with_its_process_group(tmp_path):
    (tmp_path / "hang.py").write_text(SPAWNS_AND_HANGS)
    with pytest.raises(subprocess.TimeoutExpired):
        run_cli_forked(["hang.py", str(tmp_path / "pid")], timeout=2, cwd=tmp_path)
    pid = int((tmp_path / "pid").read_text())
    stat = Path(f"/proc/{pid}/stat")
    alive = stat.exists() and stat.read_text().rsplit(")", 1)[1].split()[0] not in "ZX"
    if alive:
        os.kill(pid, signal.SIGKILL)
    assert not alive, "the command's child lived on"


def test_what_only_a_fresh_interpreter_does_is_refused():
    """-c code, and settings Python reads once at its start: a test that needs them uses run_cli."""
    with pytest.raises(ValueError, match="use run_cli"):
        run_cli_forked(["-c", "pass"])
    with pytest.raises(ValueError, match=r"\['PYTHONHASHSEED'\] take effect when an interpreter starts"):
        run_cli_forked(["trainers/main.py", "--help"],
                       env={"PYTHONHASHSEED": os.environ.get("PYTHONHASHSEED", "") + "1"})
