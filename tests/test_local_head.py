"""ray_cluster.local and ray_cluster.node: heads with token auth side by side, each stopped on its own."""

from __future__ import annotations

import os
import socket
import stat
import shutil
import subprocess
import time

import pytest

from cluster_fixtures import PYTHON, alive, clean_env, head_factory, head_pids, run, short_tmp  # noqa: F401
from stride.ray_cluster import local, node

# ---- node.py without Ray: the stop logic on a fake node ------------------------------------------------

# Behaves like `ray start`: leaves daemons behind and exits. One ignores SIGTERM (like the GCS server); one
# starts a child in a session of its own (like a job's driver); one starts such a child and exits, orphaning it.
FAKE_RAY_START = """
import subprocess, sys
py = sys.executable
sleep = [py, "-c", "import time; time.sleep(600)"]
subprocess.Popen(sleep)
subprocess.Popen([py, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"])
subprocess.Popen([py, "-c", f"import subprocess, time; subprocess.Popen({sleep!r}, start_new_session=True); time.sleep(600)"])
subprocess.Popen([py, "-c", f"import subprocess; subprocess.Popen({sleep!r}, start_new_session=True)"]).wait()
"""


def test_node_stop_ends_the_nodes_processes_and_nothing_else(tmp_path):
    bystander = subprocess.Popen([PYTHON, "-c", "import time; time.sleep(600)"])  # not part of the node
    try:
        state = node.start(tmp_path, [PYTHON, "-c", FAKE_RAY_START], quiet=True)

        def settled(procs: dict) -> bool:
            # What `ray start` leaves once it has exited: five processes, two in sessions of their own, one of them
            # an orphan. Counting five alone could stop early (the fake `ray start` and its fourth child still up
            # before the last two children exist, or a child not yet out of its parent's session: setsid runs after
            # the fork).
            others = [p for p in procs.values() if p["sid"] != state["sid"]]
            return len(procs) == 5 and len(others) == 2 and any(p["ppid"] not in procs for p in others)

        deadline = time.time() + 10
        while not settled(node.node_processes(state)) and time.time() < deadline:
            time.sleep(0.1)
        procs = node.node_processes(state)
        found = {pid: p["start_s"] for pid, p in procs.items()}
        assert len(found) == 5, procs
        assert sum(p["sid"] != state["sid"] for p in procs.values()) == 2  # the driver-like ones
        assert any(p["ppid"] not in procs and p["sid"] != state["sid"] for p in procs.values()), "no orphan found"
        assert bystander.pid not in found

        t0 = time.time()
        stopped = node.stop(tmp_path, grace_s=1.0)
        assert set(found) <= set(stopped)
        assert alive(found) == []
        assert time.time() - t0 < 15
        assert bystander.poll() is None, "stop touched a process that is not the node's"
        assert node.stop(tmp_path) == []  # idempotent
    finally:
        bystander.kill()
        bystander.wait()


def test_node_refuses_to_start_twice_from_one_state_dir(tmp_path):
    node.start(tmp_path, [PYTHON, "-c", "import subprocess, sys; "
                                        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])"],
               quiet=True)
    try:
        with pytest.raises(RuntimeError, match="still running"):
            node.start(tmp_path, [PYTHON, "-c", "pass"], quiet=True)
    finally:
        node.stop(tmp_path)


def test_a_failed_ray_start_is_stopped_and_tried_once_more_with_ports_picked_again(tmp_path):
    picked = []

    def argv(*codes):
        def make():
            picked.append(len(picked))
            return [PYTHON, "-c", codes[min(len(picked), len(codes)) - 1]], {"node_manager": picked[-1]}
        return make

    # The first start fails (as a raylet that lost its port to another process does), the second, with new ports, runs.
    assert local._start_node(tmp_path, argv("import sys; sys.exit(1)", "pass"), clean_env(), "ray start") == \
        {"node_manager": 1}
    picked.clear()
    with pytest.raises(local.HeadError, match="ray start failed: .* exited with 3"):
        local._start_node(tmp_path, argv("import sys; sys.exit(3)"), clean_env(), "ray start")
    assert picked == [0, 1]  # twice, not more


# ---- local heads: errors a user can act on (no Ray started) ---------------------------------------------

def test_start_refuses_a_port_in_use_and_names_the_flag():
    folder = short_tmp("stc-head-")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        result = run([PYTHON, "-m", "stride.ray_cluster.local", "start", "--temp-dir", str(folder), "--port", str(port)],
                     env=clean_env(), timeout=60)
    shutil.rmtree(folder)
    assert result.returncode == 2  # the user can fix it: another port
    assert f"--port ({port}) is in use" in result.stderr
    assert "Traceback" not in result.stderr


def test_start_refuses_a_temp_dir_too_long_for_ray_sockets(tmp_path):
    long_dir = tmp_path / ("x" * 60)
    with pytest.raises(local.HeadError, match="--temp-dir .* too long"):
        local.start_head(long_dir)


# ---- two real heads ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def two_heads(head_factory):  # noqa: F811
    home_token = os.path.expanduser("~/.ray/auth_token")
    existed = os.path.exists(home_token)
    heads = head_factory(2)
    return heads, existed, home_token


@pytest.mark.slow
def test_two_heads_run_at_once_on_their_own_ports(two_heads):
    (a, b), _, _ = two_heads
    assert a.address != b.address
    for key in ("gcs", "dashboard", "ray_client_server", "node_manager", "object_manager", "dashboard_agent_listen",
                "metrics_export"):
        assert a.ports[key] != b.ports[key], key
    for head in (a, b):
        result = run([PYTHON, "-m", "stride.ray_cluster.local", "status", "--temp-dir", str(head.temp_dir)], env=clean_env(),
                     timeout=60)
        assert result.returncode == 0, result.stdout + result.stderr
        assert "running         True" in result.stdout and head.dashboard_url in result.stdout
        assert "dashboard_http  200" in result.stdout


@pytest.mark.slow
def test_each_head_has_its_own_private_token_and_none_in_home(two_heads):
    (a, b), existed, home_token = two_heads
    for head in (a, b):
        assert stat.S_IMODE(head.token_path.stat().st_mode) == 0o600
        assert stat.S_IMODE(head.temp_dir.stat().st_mode) == 0o700
    assert a.token_path.read_text() != b.token_path.read_text()
    if not existed:
        assert not os.path.exists(home_token), "starting a head created ~/.ray/auth_token"


@pytest.mark.slow
def test_dashboard_requires_the_heads_token(two_heads):
    (a, b), _, _ = two_heads
    token_a, token_b = a.token_path.read_text().strip(), b.token_path.read_text().strip()
    assert local.dashboard_status(a) == 401
    assert local.dashboard_status(a, "not-the-token") == 403
    assert local.dashboard_status(a, token_b) == 403
    assert local.dashboard_status(a, token_a) == 200
    assert local.dashboard_status(b, token_b) == 200


@pytest.mark.slow
def test_a_client_joins_with_the_token_and_is_refused_without(two_heads):
    (a, _), _, _ = two_heads
    probe = "import ray; ray.init(); print('cpus', ray.cluster_resources()['CPU']); ray.shutdown()"
    ok = run([PYTHON, "-c", probe], env=clean_env(**a.client_env()), timeout=120)
    assert ok.returncode == 0 and "cpus 2.0" in ok.stdout, ok.stdout + ok.stderr[-2000:]
    # Without the token the GCS answers Unauthenticated; ray.init retries that for ~20 s, so stop at the first one.
    refused = subprocess.Popen([PYTHON, "-c", probe], env=clean_env(RAY_ADDRESS=a.address, HOME=str(a.temp_dir)),
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        lines = []
        for line in refused.stdout:
            lines.append(line)
            if "InvalidAuthToken" in line or "cpus" in line:
                break
        assert lines and "InvalidAuthToken" in lines[-1], "".join(lines)[-2000:]
    finally:
        refused.kill()
        refused.wait()


@pytest.mark.slow
def test_stopping_one_head_leaves_the_other_and_nothing_of_itself(two_heads):
    (a, b), _, _ = two_heads
    pids_a, pids_b = head_pids(a), head_pids(b)
    assert len(pids_a) >= 8 and len(pids_b) >= 8  # gcs, raylet, dashboard, client server, monitor, agents ...
    client_server = [pid for pid, p in node.processes().items()
                     if "ray.util.client.server" in p["cmdline"] and f"--port={a.ports['ray_client_server']}" in p["cmdline"]]
    assert client_server and set(client_server) <= set(pids_a)

    result = run([PYTHON, "-m", "stride.ray_cluster.local", "stop", "--temp-dir", str(a.temp_dir)], env=clean_env(), timeout=120)
    assert result.returncode == 0, result.stderr
    assert alive(pids_a) == [], "processes of the stopped head are left"
    assert not a.token_path.exists()
    status = run([PYTHON, "-m", "stride.ray_cluster.local", "status", "--temp-dir", str(a.temp_dir)], env=clean_env(), timeout=60)
    assert status.returncode == 1 and "running         False" in status.stdout

    assert sorted(alive(pids_b)) == sorted(pids_b), "stopping one head killed processes of the other"
    assert local.dashboard_status(b, b.token_path.read_text().strip()) == 200
    assert local.head_status(b)["running"]
