"""State folders of local heads and cluster nodes (/tmp/stride-ray, /tmp/stride-cluster): only a folder of this
user's own, private and not a symlink, is used; its JSON never names the files or URLs Stride then acts on."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import REPO, run_cli
from services import unavailable
from stride.ray_cluster import local, node

NODE_PY = str(REPO / "ray_cluster" / "node.py")


def _forged_head(folder, target, url):
    folder.mkdir(mode=0o700)
    (folder / local.HEAD_FILE).write_text(json.dumps({
        "temp_dir": "/", "address": "127.0.0.1:1", "dashboard_url": url, "token_path": str(target),
        "ports": {"dashboard": 1, "gcs": 1}}))


def test_a_heads_json_names_no_file_and_no_url(tmp_path):
    secret = tmp_path / "someone_elses_secret"
    secret.write_text("do not send or delete me")
    folder = tmp_path / "head"
    _forged_head(folder, secret, "http://attacker.example:80")
    head = local.load_head(folder)
    assert head.token_path == folder / "auth_token" and head.temp_dir == folder
    assert head.dashboard_url == "http://127.0.0.1:1"
    local.stop_head(head)  # no process of it runs: nothing to stop, and only the folder's own token may go
    assert secret.read_text() == "do not send or delete me"


@pytest.mark.parametrize("make, says", [
    (lambda p: (p.mkdir(), p.chmod(0o755)), "has mode 755"),
    (lambda p: (p.mkdir(mode=0o700), os.chown(p, 65534, 65534)), "belongs to uid 65534"),
    (lambda p: ((p.parent / "real").mkdir(mode=0o700), p.symlink_to(p.parent / "real")), "is a symlink"),
])
def test_a_folder_another_user_could_write_is_refused_in_one_line(tmp_path, make, says):
    if "uid" in says and os.getuid() != 0:
        unavailable("chown to another user needs root")
    folder = tmp_path / "state"
    make(folder)
    for cli in (["-m", "stride.ray_cluster.local", "status", "--temp-dir", str(folder)],
                ["-m", "stride.ray_cluster.local", "stop", "--temp-dir", str(folder)],
                [NODE_PY, "stop", str(folder)], [NODE_PY, "status", str(folder)]):
        r = run_cli(cli, timeout=60)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1 and "Traceback" not in r.stderr, (cli, r.stderr)
        assert f"state folder {folder} {says}" in lines[0] and "mode 700" in lines[0], lines[0]
    with pytest.raises(node.UnsafeStateDir, match=says):
        node.start(folder, [sys.executable, "-c", "pass"])


def test_a_forged_node_state_in_a_private_folder_of_someone_else_is_never_read(tmp_path):
    """The attack of the issue: another user's folder whose stride-node.json names an unrelated process."""
    if os.getuid() != 0:
        unavailable("chown to another user needs root")
    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        folder = tmp_path / "stride-cluster"
        folder.mkdir(mode=0o700)
        (folder / node.STATE_FILE).write_text(json.dumps({"id": "x", "sid": victim.pid, "started_at": 0, "argv": [],
                                                          "pids": {str(victim.pid): 0}}))
        os.chown(folder, 65534, 65534)
        r = run_cli([NODE_PY, "stop", str(folder)], timeout=60)
        assert r.returncode == 2 and victim.poll() is None
    finally:
        victim.kill()
        victim.wait()


def test_a_new_state_folder_is_created_private(tmp_path):
    folder = node.private_dir(tmp_path / "new")
    assert folder.is_dir() and (folder.stat().st_mode & 0o777) == 0o700
