"""`ray up` of cluster.yaml for real (local provider, over a private sshd on 127.0.0.1), a job on it, and the
safe stop (`python -m stride.ray_cluster.updown down`), which must leave another Ray head on the machine running."""

from __future__ import annotations

import contextlib
import getpass
import hashlib
import secrets
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from cluster_fixtures import (  # noqa: F401
    PYTHON, RAY, REPO, VENV_BIN, alive, clean_env, free_ports, head_factory, head_pids, run, short_tmp, sshd)
from stride.ray_cluster import local, node

pytestmark = [pytest.mark.slow, pytest.mark.sshd]


def replace_all(text: str, old: str, new: str) -> str:
    assert old in text, f"cluster.yaml no longer contains {old!r}; update this test's rendering"
    return text.replace(old, new)


def render_cluster_yaml(out: Path, server, state_dir: Path, token: Path, ports: dict[str, str]) -> dict:
    """cluster.yaml for this machine: head 127.0.0.1 through the private sshd, this venv as the nodes' Python
    (no setup commands), and ports and a state folder of its own so that it can run beside other Rays."""
    text = (REPO / "cluster.yaml").read_text()
    text = replace_all(text, '"$HOME/stride-venv/bin', f'"{VENV_BIN}')
    text = replace_all(text, "/tmp/stride-cluster", str(state_dir))
    for old, new in ports.items():
        text = replace_all(text, old, new)
    text = replace_all(text, "--head --port=", "--head --num-cpus=2 --port=")
    config = yaml.safe_load(text)
    config["cluster_name"] = f"stride-test-{secrets.token_hex(4)}"
    config["provider"].update(head_ip="127.0.0.1", worker_ips=[])
    config["auth"] = {"ssh_user": "root", "ssh_private_key": str(server.key), "ssh_proxy_command": server.proxy_command}
    config["file_mounts"] = {"~/stride_ray/auth_token": str(token), "~/stride_ray/node.py": str(REPO / "ray_cluster" / "node.py")}
    config["setup_commands"] = []
    out.write_text(yaml.safe_dump(config, sort_keys=False))
    return config


def close_ssh_masters(cluster_name: str) -> None:
    """ray up's SSH ControlMaster connections (ControlPersist 10 s) for this cluster, closed now."""
    folder = Path("/tmp") / f"ray_ssh_{hashlib.sha256(getpass.getuser().encode()).hexdigest()[:10]}" \
        / hashlib.sha256(cluster_name.encode()).hexdigest()[:10]
    for socket_path in folder.glob("*") if folder.exists() else []:
        subprocess.run(["ssh", "-o", f"ControlPath={socket_path}", "-O", "exit", "127.0.0.1"], capture_output=True, timeout=30)
    shutil.rmtree(folder, ignore_errors=True)
    with contextlib.suppress(OSError):
        folder.parent.rmdir()  # only if no other cluster of this user uses it


def test_ray_up_job_and_safe_down_beside_another_head(sshd, head_factory, tmp_path):  # noqa: F811
    (bystander,) = head_factory(1)  # another Ray on the same machine: must survive the cluster's down
    bystander_pids = head_pids(bystander)

    state_dir = short_tmp("stc-up-")
    gcs_port, dashboard_port, client, node_manager, object_manager, agent = free_ports(6)
    block = local._free_port_block(100, {gcs_port, dashboard_port, client, node_manager, object_manager, agent})
    ports = {"--port=6379": f"--port={gcs_port}", "$RAY_HEAD_IP:6379": f"$RAY_HEAD_IP:{gcs_port}",
             "--dashboard-port=8265": f"--dashboard-port={dashboard_port}",
             "--ray-client-server-port=10001": f"--ray-client-server-port={client}",
             "--node-manager-port=8076": f"--node-manager-port={node_manager}",
             "--object-manager-port=8077": f"--object-manager-port={object_manager}",
             "--dashboard-agent-listen-port=52365": f"--dashboard-agent-listen-port={agent}",
             "--min-worker-port=10002": f"--min-worker-port={block}", "--max-worker-port=19999": f"--max-worker-port={block + 99}"}
    token = tmp_path / "token"
    config_path = tmp_path / "cluster.yaml"
    config = render_cluster_yaml(config_path, sshd, state_dir, token, ports)
    cluster_state = Path("/tmp/ray") / f"cluster-{config['cluster_name']}.state"
    env = clean_env()
    try:
        up = run([PYTHON, "-m", "stride.ray_cluster.updown", "up", str(config_path), "-y", "--no-config-cache"],
                 env=env, timeout=300)
        assert up.returncode == 0, (up.stdout + up.stderr)[-5000:]
        assert oct(token.stat().st_mode & 0o777) == "0o600"
        node_token = sshd.home / "stride_ray" / "auth_token"  # the file mount, on the node
        assert node_token.read_text() == token.read_text() and oct(node_token.stat().st_mode & 0o777) == "0o600"

        state = node.read_state(state_dir)
        assert state and node.node_processes(state), "ray up returned but no Ray runs from the cluster's state dir"
        cluster_pids = {pid: p["start_s"] for pid, p in node.node_processes(state).items()}
        (dashboard_cmd,) = [p["cmdline"] for p in node.node_processes(state).values() if "dashboard/dashboard.py" in p["cmdline"]]
        assert "--host=127.0.0.1" in dashboard_cmd

        dashboard = f"http://127.0.0.1:{dashboard_port}"
        job_env = clean_env(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(token))
        job = run([RAY, "job", "submit", "--address", dashboard, "--submission-id", "stride-up", "--", "python", "-c",
                   "import ray; ray.init(); print('stride-cluster-cpus', ray.cluster_resources()['CPU'])"],
                  env=job_env, timeout=180)
        output = job.stdout + job.stderr
        assert job.returncode == 0 and "Job 'stride-up' succeeded" in output, output[-3000:]
        assert "stride-cluster-cpus 2.0" in output
        refused = run([RAY, "job", "submit", "--address", dashboard, "--", "echo", "no"],
                      env=clean_env(HOME=str(tmp_path)), timeout=120)
        assert refused.returncode != 0

        down = run([PYTHON, "-m", "stride.ray_cluster.updown", "down", str(config_path)], env=env, timeout=180)
        assert down.returncode == 0, (down.stdout + down.stderr)[-3000:]
        assert alive(cluster_pids) == [] and not node.node_processes(state), "processes of the cluster are left"
        assert sorted(alive(bystander_pids)) == sorted(bystander_pids), "down killed another head's processes"
        assert local.dashboard_status(bystander, bystander.token_path.read_text().strip()) == 200
        assert '"state": "terminated"' in cluster_state.read_text()

        # down pinned the node's host key in the cluster's own known_hosts (beside its token); a node whose key
        # then changes is refused, never trusted.
        known = token.parent / "known_hosts"
        host, _, _ = known.read_text().splitlines()[0].partition(" ")
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp_path / "other")], check=True)
        known.write_text(f"{host} {(tmp_path / 'other.pub').read_text().split(' ', 2)[0]} "
                         f"{(tmp_path / 'other.pub').read_text().split(' ', 2)[1]}\n")
        again = run([PYTHON, "-m", "stride.ray_cluster.updown", "down", str(config_path)], env=env, timeout=180)
        assert again.returncode != 0 and "Host key verification failed" in again.stdout + again.stderr, \
            (again.stdout + again.stderr)[-2000:]
    finally:
        if node.read_state(state_dir):
            node.stop(state_dir)  # only if the test failed half-way: the cluster's own processes, by pid
        close_ssh_masters(config["cluster_name"])
        cluster_state.unlink(missing_ok=True)
        Path(str(cluster_state).replace(".state", ".lock")).unlink(missing_ok=True)
        shutil.rmtree(state_dir, ignore_errors=True)
