"""Bring a `ray up` cluster of your own machines up, and down again without `ray down`.

    python -m stride.ray_cluster.updown up cluster.yaml [ray up options, e.g. -y --no-config-cache]
    python -m stride.ray_cluster.updown down cluster.yaml

Why not `ray down`: it runs a bare `ray stop` on the head, and `ray stop` kills every Ray process on the
machine: another user's cluster, a colleague's `ray.init()`, a second cluster of yours. On the cloud that is
harmless (the VMs are the cluster's own, and `ray down` deletes them anyway); on shared on-premise machines
(the `local` provider) it is not. So the cluster YAMLs start Ray through ray_cluster/node.py, which records
the session of each node's `ray start`, and the first start command of each node kind is the node's own
stop (`python3 ~/stride_ray/node.py stop STATE_DIR`). `down` runs exactly that command over SSH on the head,
then on every worker (head first, so that its autoscaler does not restart the workers), and then marks the
nodes terminated in Ray's cluster state file, as `ray down` does, so that the next `ray up` starts afresh.

`up` creates the cluster's token file (the local side of the `~/stride_ray/auth_token` file mount, mode 0600)
if it does not exist yet, then runs `ray up`. Run both from the repository root (the YAMLs mount
./ray_cluster/node.py) on a machine that reaches every node by SSH.
"""

from __future__ import annotations

import os
import secrets
import shlex
import subprocess
import sys
from pathlib import Path


from stride.cli import reports_errors
from stride.errors import EXIT_FAILED, UsageError

TOKEN_MOUNT = "~/stride_ray/auth_token"


class UpDownError(UsageError):
    """A cluster file or token the user can fix: one line, exit 2."""


class StopFailed(UpDownError):
    """Ray could not be stopped on some nodes: one line, exit 1."""

    exit_code = EXIT_FAILED


def load(config_path: str) -> dict:
    from stride.safe_yaml import read_mapping

    return read_mapping(config_path, "cluster config", "cluster.yaml", UpDownError)


def ensure_token(config: dict) -> Path:
    """The local token file named by the YAML's file mount: created (0600) if missing, refused if others can read it."""
    local = config.get("file_mounts", {}).get(TOKEN_MOUNT)
    if not local:
        raise UpDownError(f"file_mounts has no {TOKEN_MOUNT} entry; the nodes would start without the cluster's token")
    path = Path(os.path.expanduser(local))
    if not path.exists():
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32))
    elif path.stat().st_mode & 0o077:
        raise UpDownError(f"token file ({path}) is readable by others (mode {path.stat().st_mode & 0o777:o}); "
                          f"chmod 600 {path}")
    return path


def stop_commands(config: dict) -> tuple[str, str]:
    """The (head, worker) stop commands: the first start command of each node kind."""
    head, worker = config["head_start_ray_commands"][0], config["worker_start_ray_commands"][0]
    for name, cmd in (("head_start_ray_commands", head), ("worker_start_ray_commands", worker)):
        if "node.py stop" not in cmd:
            raise UpDownError(f"{name}[0] ({cmd!r}) is not a node.py stop command; start from cluster.yaml, whose "
                              f"first start command stops only that cluster's Ray")
    return head, worker


def ssh_options(auth: dict, known_hosts: Path) -> list[str]:
    """The YAML's user, key and proxy; host keys pinned on first contact in the cluster's own known_hosts (beside its
    token, 0700 folder): a node whose key changes afterwards is refused, not trusted."""
    options = ["-o", "StrictHostKeyChecking=accept-new", "-o", f"UserKnownHostsFile={known_hosts}",
               "-o", "IdentitiesOnly=yes", "-o", "BatchMode=yes", "-o", "ConnectTimeout=30", "-o", "LogLevel=ERROR"]
    if auth.get("ssh_private_key"):
        options += ["-i", os.path.expanduser(auth["ssh_private_key"])]
    if auth.get("ssh_proxy_command"):
        options += ["-o", f"ProxyCommand={auth['ssh_proxy_command']}"]
    return options


def ssh(config: dict, ip: str, command: str) -> subprocess.CompletedProcess:
    """Run command on ip as `ray up` would, in a login shell."""
    auth = config["auth"]
    options = ssh_options(auth, ensure_token(config).parent / "known_hosts")
    return subprocess.run(["ssh", *options, f"{auth['ssh_user']}@{ip}", f"bash --login -c {shlex.quote(command)}"],
                          capture_output=True, text=True, timeout=120)


def down(config_path: str) -> None:
    config = load(config_path)
    provider = config["provider"]
    if provider["type"] != "local":
        raise UpDownError(f"provider.type is {provider['type']}: its nodes are this cluster's own VMs, so "
                          f"`ray down {config_path}` is safe there (and deletes them)")
    head_stop, worker_stop = stop_commands(config)
    failed = []
    for ip, command in [(provider["head_ip"], head_stop)] + [(ip, worker_stop) for ip in provider["worker_ips"]]:
        result = ssh(config, ip, command)
        print(f"{ip}: {result.stdout.strip() or '(no output)'}", flush=True)
        if result.returncode != 0:
            print(result.stderr.strip(), file=sys.stderr, flush=True)
            failed.append(ip)
    if failed:
        raise StopFailed(f"stopping Ray failed on {', '.join(failed)} (output above); the nodes stay marked "
                          f"running; fix and run down again")
    # As `ray down` does: mark the nodes terminated in the cluster state file of the local provider.
    from stride.ray_cluster.ray_edge import node_provider as provider_of

    node_provider = provider_of(provider, config["cluster_name"])
    node_provider.terminate_nodes(node_provider.non_terminated_nodes({}))


def up(config_path: str, ray_up_args: list[str]) -> int:
    config = load(config_path)
    stop_commands(config)
    token = ensure_token(config)
    print(f"stride: cluster token {token}; clients: RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH={token}", flush=True)
    ray = Path(sys.executable).parent / "ray"
    return subprocess.call([str(ray) if ray.exists() else "ray", "up", config_path, *ray_up_args])


@reports_errors
def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) < 2 or argv[0] not in ("up", "down"):
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    if argv[0] == "up":
        return up(argv[1], argv[2:])
    down(argv[1])
    print(f"stride: stopped the Ray processes of {argv[1]} on every node; nothing else was touched")
    return 0


if __name__ == "__main__":
    sys.exit(main())
