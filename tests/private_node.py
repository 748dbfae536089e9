"""A Ray worker node on this machine that shares no filesystem with the rest of the cluster where it matters: it runs
in a mount namespace of its own (`unshare --mount`) with a private tmpfs over /tmp and over each folder given (the
test's folders), so a file one node writes there is not on the other's disk, as on two machines.

    problem = namespace_problem()            # None when a private node can run here (root)
    add_private_node(head, state_dir, [tmp_root], num_cpus=2)
    in_node(state_dir, "find", folder, "-type", "f")     # a command inside its namespace (nsenter)
    local.stop_node(state_dir)               # by pid; the tmpfs goes with its last process

The node joins with the token's value (RAY_AUTH_TOKEN): the head's token file is under /tmp, which the node does not
see. Its processes are found and stopped as any node's (ray_cluster/node.py: the marker in their environment, their
session), from outside the namespace: the process ids are the machine's."""

from __future__ import annotations

import os
import subprocess
import tempfile
from pathlib import Path

from stride.ray_cluster import local, node

# In the new namespace, before `ray start` runs: nothing mounted there is seen outside (propagation private), and
# nothing mounted outside later is seen inside. The folders of STRIDE_KEEP_DIRS (the checkout and its .venv: the
# program a machine has installed) stay visible even where a private folder covers them (a clone under /tmp): each is
# opened before the tmpfs goes over it, then bound back from that open descriptor (not from its path, which the tmpfs
# now hides: hence --no-canonicalize). Descriptors 3 to 9: the shell (dash) takes one digit.
MOUNT_PRIVATE = ('IFS=:; i=3; for k in $STRIDE_KEEP_DIRS; do eval "exec $i<\\"\\$k\\"" || exit 96; i=$((i+1)); done; '
                 'for d in $STRIDE_PRIVATE_DIRS; do mkdir -p "$d" && mount -t tmpfs -o mode=1777 tmpfs "$d" '
                 '|| exit 97; done; '
                 'i=3; for k in $STRIDE_KEEP_DIRS; do mkdir -p "$k" && mount --no-canonicalize --bind /proc/self/fd/$i "$k" '
                 '|| exit 98; eval "exec $i<&-"; i=$((i+1)); done; unset IFS; exec "$@"')


def namespace_problem() -> str | None:
    """Why a node cannot get a mount namespace of its own here (None: it can). Only a user other than root is a
    reason: as root (CI), a missing unshare or a refused mount fails add_private_node."""
    if os.geteuid() != 0:
        return "a private mount namespace needs root (unshare --mount, mount -t tmpfs); CI runs the suite as root"
    return None


def kept_dirs() -> list[str]:
    """What a machine has installed and the node runs: the checkout and this interpreter's environment (.venv)."""
    import sys

    found = sorted({os.path.realpath(Path(__file__).resolve().parent.parent), os.path.realpath(sys.prefix)})
    return [d for d in found if not any(d.startswith(o + "/") for o in found)]  # a .venv inside the checkout: once


def private_dirs(folders: list[Path]) -> list[str]:
    """/tmp, the temporary directory, and the folders given, without those inside another (hidden by its tmpfs)."""
    out: list[str] = []
    for d in sorted({os.path.realpath(p) for p in ["/tmp", tempfile.gettempdir(), *map(str, folders)]}):
        if not any(d == o or d.startswith(o + "/") for o in out):
            out.append(d)
    return out


def add_private_node(head: local.Head, state_dir: Path, folders: list[Path], num_cpus: int) -> None:
    """Join a worker node to `head` in a mount namespace with a tmpfs over /tmp and `folders`; its state (for
    local.stop_node) in `state_dir`, outside the namespace. Raises RuntimeError when it does not start."""
    state_dir = node.private_dir(Path(os.path.abspath(state_dir)))
    dirs = private_dirs(folders)
    env = {k: v for k, v in local._node_env(head.token_path).items() if k != "RAY_AUTH_TOKEN_PATH"}
    keep = [k for k in kept_dirs() if any(k == d or k.startswith(d + "/") for d in dirs)]
    env.update(RAY_AUTH_TOKEN=head.token_path.read_text().strip(), STRIDE_PRIVATE_DIRS=":".join(dirs),
               STRIDE_KEEP_DIRS=":".join(keep))
    argv, _ = local._ray_start(state_dir, None, set(head.ports.values()), num_cpus)
    argv = ["unshare", "--mount", "--propagation", "private", "sh", "-c", MOUNT_PRIVATE, "sh", *argv,
            f"--address={head.address}"]
    node.start(state_dir, argv, env=env, quiet=True)


def node_pid(state_dir: Path) -> int:
    """A live process of the node (any: they share its namespace)."""
    pids = sorted(node.node_processes(node.read_state(Path(state_dir))))
    assert pids, f"the node of {state_dir} has no process"
    return pids[0]


def in_node(state_dir: Path, *command: str, input: str | None = None) -> subprocess.CompletedProcess:
    """`command` in the node's mount namespace (what its processes see as the filesystem)."""
    return subprocess.run(["nsenter", f"--target={node_pid(state_dir)}", "--mount", "--", *command], input=input,
                          capture_output=True, text=True, timeout=60)


def files_in_node(state_dir: Path, folder: Path) -> list[str]:
    """The files under `folder` as the node sees it ([] when it is not there)."""
    done = in_node(state_dir, "sh", "-c", 'test ! -e "$1" || find "$1" -type f', "sh", str(folder))
    assert done.returncode == 0, done.stderr
    return done.stdout.split()


def write_in_node(state_dir: Path, path: Path, text: str) -> None:
    """Put a file on the node's own disk (what a user installs on each machine: their code)."""
    done = in_node(state_dir, "sh", "-c", 'mkdir -p "$(dirname "$1")" && cat > "$1"', "sh", str(path), input=text)
    assert done.returncode == 0, done.stderr
