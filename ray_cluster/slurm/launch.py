"""Helpers for ray_cluster/slurm/stride.sbatch: one Ray cluster per SLURM job, started and stopped by pid.

The batch script calls these as `$PYTHON ray_cluster/slurm/launch.py <command> ...`:

    token   --out FILE              a fresh auth token, mode 0600 (one per job run)
    plan    --job-dir DIR ...       node list, host-sharing, CPUs/GPUs and ports of every node -> DIR/plan.json,
                                    and shell assignments (HEAD_NODE, GCS_ADDRESS, ...) on stdout
    node    --plan P --name N       run on node N (under srun): `ray start --block` with N's ports and temp dir;
                                    on SIGTERM/SIGINT/SIGUSR2 stop it and everything it started, then exit
    wait    --plan P --timeout S    until every node of the plan has joined; else name the missing ones, exit 1
    run-dir -- ARGS                 where the driver's run will live for these driver arguments: its folder, or
                                    its URI (s3://bucket/prefix/<run.name>) for a run on a bucket
    status  --run-dir D --since T   the summary.json status written since T ("none" if there is none); D a folder
                                    or a run's URI

Never `ray stop`: it stops every Ray process on the host, other jobs' and other users' clusters included.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

if not __package__:  # run as a file from a checkout: import Stride as the `stride` package (stride/_checkout.py)
    import runpy

    runpy.run_path(str(Path(__file__).resolve().parents[2] / "stride" / "_checkout.py"))

from stride.ray_cluster.node import UnsafeStateDir, private_dir  # noqa: E402
from stride.ray_cluster.slurm.ports import PortError, PortScheme, expand_cpus_per_node, local_indices  # noqa: E402
from stride.errors import EXIT_FAILED, StrideError  # noqa: E402

LABEL = "stride-slurm-node"   # Ray node label holding the SLURM node name
AF_UNIX_PATH_MAX = 107
SESSION_SOCKET_SUFFIX = len("/session_2026-01-01_00-00-00_000000_4194304/sockets/plasma_store")


class LaunchError(StrideError):
    """One line for the person who submitted the job (exit 1: the job failed)."""

    exit_code = EXIT_FAILED


def log(msg: str) -> None:
    print(f"stride-slurm: {msg}", file=sys.stderr, flush=True)


def scontrol(*args: str) -> str:
    r = subprocess.run(["scontrol", *args], capture_output=True, text=True)
    if r.returncode != 0:
        raise LaunchError(f"scontrol {' '.join(args)} failed: {r.stderr.strip()}")
    return r.stdout


# ---- token ----

def cmd_token(a) -> None:
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    out.unlink(missing_ok=True)  # a requeued run gets a new token, never the last run's
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))


# ---- plan ----

def node_addresses(names: list[str]) -> dict[str, str]:
    """SLURM NodeAddr of each node: nodes with the same address share a host (and need different ports)."""
    addrs: dict[str, str] = {}
    for line in scontrol("show", "node", "-o", ",".join(names)).splitlines():
        fields = dict(item.split("=", 1) for item in line.split() if "=" in item)
        if fields.get("NodeName") in names:
            addrs[fields["NodeName"]] = fields.get("NodeAddr") or fields["NodeName"]
    return {n: addrs.get(n, n) for n in names}


def cmd_plan(a) -> None:
    job_id = os.environ.get("SLURM_JOB_ID")
    nodelist = os.environ.get("SLURM_JOB_NODELIST")
    if not job_id or not nodelist:
        raise LaunchError("SLURM_JOB_ID/SLURM_JOB_NODELIST are not set: submit with sbatch, not bash")
    listed = scontrol("show", "hostnames", nodelist).split()
    names = list(listed)
    if os.environ.get("SLURM_NNODES") and int(os.environ["SLURM_NNODES"]) != len(names):
        raise LaunchError(f"SLURM_NNODES ({os.environ['SLURM_NNODES']}) != {len(names)} nodes in {nodelist}")
    # The head must be the node this batch script runs on: the driver attaches to a raylet on its own host.
    here = os.environ.get("SLURMD_NODENAME", names[0])
    head = here if here in names else names[0]
    names = [head] + [n for n in names if n != head]
    addrs = node_addresses(names)
    scheme = PortScheme(a.port_base, a.port_max, a.node_ports, a.nodes_per_host)
    # SLURM_JOB_CPUS_PER_NODE ("2(x3),1") follows the order of the node list, not ours.
    allocated = dict(zip(listed, expand_cpus_per_node(os.environ.get("SLURM_JOB_CPUS_PER_NODE", ""), len(listed))))
    # The head's ports must be fixed now (every node and the driver need them): this script runs on the head's
    # host, so take the derived slot, or the next one whose head block nothing else holds.
    derived = scheme.slot_of(int(job_id))
    slot = next((s for s in scheme.slot_order(derived) if not ports_in_use(scheme.node_at_slot(s, 0), is_head=True)),
                None)
    if slot is None:
        raise LaunchError(f"no free block of {scheme.node_ports} ports for the head on {head} in "
                          f"{scheme.base}..{scheme.max_port}; set STRIDE_PORT_BASE/STRIDE_PORT_MAX to a free range")
    if slot != derived:
        log(f"the head's ports of slot {derived} are in use on {head}; using slot {slot}")
    ray_tmp = Path(a.ray_tmp)
    nodes = []
    for name, local in zip(names, local_indices([addrs[n] for n in names])):
        # The node's own private folder (0700), and Ray's temp dir inside it: Ray makes its temp dir and session
        # folders world-writable (0777, no sticky bit), so they must not sit directly in a shared /tmp.
        folder = ray_tmp / f"stride-{job_id}-{name}"
        temp_dir = folder / "ray"
        if len(str(temp_dir)) + SESSION_SOCKET_SUFFIX > AF_UNIX_PATH_MAX:
            raise LaunchError(f"STRIDE_RAY_TMP ({a.ray_tmp}) is too long for Ray's socket paths (at most "
                              f"{AF_UNIX_PATH_MAX} bytes); use a short node-local folder such as /tmp")
        nodes.append({"name": name, "addr": addrs[name], "local_index": local, "slurm_cpus": allocated[name],
                      "cpus": int(a.cpus_per_node) if a.cpus_per_node else allocated[name], "gpus": a.gpus_per_node,
                      "dir": str(folder), "temp_dir": str(temp_dir), "ports": scheme.node_at_slot(slot, local)})
    head_ip = socket.gethostbyname(addrs[head])
    plan = {
        "job_id": job_id, "head": head, "nodes": nodes,
        "gcs_address": f"{head_ip}:{nodes[0]['ports']['gcs']}",
        "dashboard_url": f"http://127.0.0.1:{nodes[0]['ports']['dashboard']}",
        "object_store_bytes": a.object_store_bytes or None,
        "ray": [str(Path(sys.executable).parent / "ray")] if (Path(sys.executable).parent / "ray").exists()
               else [sys.executable, "-m", "ray.scripts.scripts"],
        "port_scheme": {"base": scheme.base, "max_port": scheme.max_port, "node_ports": scheme.node_ports,
                        "nodes_per_host": scheme.nodes_per_host},
        "port_slots": scheme.slots, "slot": slot,
    }
    job_dir = Path(a.job_dir)
    (job_dir / "plan.json").write_text(json.dumps(plan, indent=1) + "\n")
    shell = {"HEAD_NODE": head, "WORKER_NODES": " ".join(names[1:]), "GCS_ADDRESS": plan["gcs_address"],
             "DASHBOARD_URL": plan["dashboard_url"]}
    print("\n".join(f"{k}={shlex.quote(v)}" for k, v in shell.items()))
    print("declare -A NODE_CPUS=(" + " ".join(f"[{shlex.quote(n['name'])}]={n['slurm_cpus']}" for n in nodes) + ")")
    log(f"job {job_id}: head {head}, {len(names)} node(s) [{' '.join(names)}]; GCS {plan['gcs_address']}, "
        f"dashboard {plan['dashboard_url']} (port slot {slot} of {scheme.slots})")


def load_plan(path: str) -> dict:
    return json.loads(Path(path).read_text())


# ---- node: run one Ray node, stop exactly what it started ----

def ports_in_use(ports: dict[str, int], is_head: bool) -> list[str]:
    """Names of this node's ports that something on the host already listens on (or holds)."""
    wanted = {k: v for k, v in ports.items() if k not in ("min_worker_port", "max_worker_port")}
    if not is_head:
        for k in ("gcs", "dashboard", "ray_client_server"):
            wanted.pop(k)
    wanted.update({f"worker port {p}": p for p in range(ports["min_worker_port"], ports["max_worker_port"] + 1)})
    busy = []
    for name, port in wanted.items():
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the servers do: TIME_WAIT is no clash
            try:
                s.bind(("", port))
            except OSError:
                busy.append(f"{name} {port}")
    return busy


def free_node_ports(plan: dict, node: dict, is_head: bool) -> dict[str, int]:
    """The node's planned ports, or (not for the head, whose ports everyone already knows) the same block of the
    next slot where none is taken. Raises LaunchError naming the busy ports when there is none."""
    busy = ports_in_use(node["ports"], is_head)
    if not busy:
        return node["ports"]
    what = f"{', '.join(busy[:4])}{' ...' if len(busy) > 4 else ''}"
    if not is_head:
        scheme = PortScheme(**plan["port_scheme"])
        for slot in scheme.slot_order(plan["slot"])[1:]:
            ports = scheme.node_at_slot(slot, node["local_index"])
            if not ports_in_use(ports, is_head=False):
                log(f"node {node['name']}: ports in use: {what}; using the block of port slot {slot}")
                return ports
    raise LaunchError(f"node {node['name']} ({socket.gethostname()}): ports already in use: {what}"
                      + ("" if is_head else " (and in every other port slot)")
                      + "; set STRIDE_PORT_BASE/STRIDE_PORT_MAX to a free range")


def ray_start_argv(plan: dict, node: dict, is_head: bool) -> list[str]:
    p = node["ports"]
    argv = [*plan["ray"], "start", "--block", "--disable-usage-stats",
            f"--temp-dir={node['temp_dir']}", f"--num-cpus={node['cpus']}", f"--num-gpus={node['gpus']}",
            f"--labels={LABEL}={node['name']}",
            f"--node-manager-port={p['node_manager']}", f"--object-manager-port={p['object_manager']}",
            f"--metrics-export-port={p['metrics_export']}", f"--dashboard-agent-listen-port={p['dashboard_agent_listen']}",
            f"--dashboard-agent-grpc-port={p['dashboard_agent_grpc']}", f"--runtime-env-agent-port={p['runtime_env_agent']}",
            f"--min-worker-port={p['min_worker_port']}", f"--max-worker-port={p['max_worker_port']}"]
    if plan.get("object_store_bytes"):
        argv.append(f"--object-store-memory={plan['object_store_bytes']}")
    if is_head:
        argv += ["--head", f"--port={p['gcs']}", "--include-dashboard=true", "--dashboard-host=127.0.0.1",
                 f"--dashboard-port={p['dashboard']}", f"--ray-client-server-port={p['ray_client_server']}"]
    else:
        argv.append(f"--address={plan['gcs_address']}")
    return argv


def _proc_table() -> dict[int, tuple[int, str]]:
    """pid -> (ppid, state) for every process, from /proc."""
    out = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                # comm may hold spaces and parentheses: the fields after the last ')' are state, ppid, ...
                fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
                out[int(entry)] = (int(fields[1]), fields[0])
            except (OSError, IndexError, ValueError):
                pass
    return out


def descendants(pid: int) -> list[int]:
    """Live (non-zombie) processes below `pid`."""
    table = _proc_table()
    out, frontier = [], {pid}
    while frontier:
        frontier = {p for p, (pp, _) in table.items() if pp in frontier}
        out.extend(sorted(p for p in frontier if table[p][1] != "Z"))
    return out


def reap(keep: int) -> None:
    """Collect our exited children except `keep` (its Popen collects it). As a subreaper we inherit Ray's
    orphans, and they must not stay zombies."""
    me = os.getpid()
    for pid, (ppid, st) in _proc_table().items():
        if ppid == me and st == "Z" and pid != keep:
            try:
                os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                pass


def wait_for_port(host: str, port: int, timeout_s: float, give_up=lambda: False) -> bool:
    deadline = time.time() + timeout_s
    while time.time() < deadline and not give_up():
        try:
            with socket.create_connection((host, port), timeout=2):
                return True
        except OSError:
            time.sleep(1)
    return False


START_ATTEMPTS = 3
START_WINDOW_S = 180  # a `ray start --block` that fails later than this failed while running, not starting


def cmd_node(a) -> int:
    plan = load_plan(a.plan)
    node = next((n for n in plan["nodes"] if n["name"] == a.name), None)
    if node is None:
        raise LaunchError(f"node {a.name} is not in {a.plan}")
    is_head = a.name == plan["head"]
    # Become a subreaper: processes Ray daemonizes (or orphans) are re-parented to us, not to init, so "everything
    # this node started" is exactly our process tree and we can stop it by pid.
    PR_SET_CHILD_SUBREAPER = 36
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)

    stop_requested: list[int] = []

    def on_signal(signum, _frame):
        stop_requested.append(signum)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR2, signal.SIGHUP):
        signal.signal(sig, on_signal)

    node["ports"] = free_node_ports(plan, node, is_head)
    if not is_head:
        host, port = plan["gcs_address"].rsplit(":", 1)
        if not wait_for_port(host, int(port), a.head_timeout, give_up=lambda: bool(stop_requested)):
            if stop_requested:
                log(f"node {a.name}: stopped before the head answered")
                return 0
            raise LaunchError(f"node {a.name}: the head's GCS {plan['gcs_address']} did not answer within "
                              f"{a.head_timeout:.0f}s; see the head node's log")
    try:
        folder = private_dir(Path(node["dir"]))  # refused if another user made it first, or it is a symlink
    except UnsafeStateDir as e:
        raise LaunchError(f"node {a.name}: {e}") from None
    env = {k: v for k, v in os.environ.items() if k != "RAY_AUTH_TOKEN"}
    # Every Ray process of this node (and each worker and actor it starts) inherits this: code that looks a
    # cluster up without an address (Ray Train's internal state-API calls do) finds this job's cluster, never
    # another one on the same host.
    env["RAY_ADDRESS"] = plan["gcs_address"]
    argv = ray_start_argv(plan, node, is_head)
    for attempt in range(1, START_ATTEMPTS + 1):
        log(f"node {a.name}: {' '.join(shlex.quote(x) for x in argv)}")
        started = time.time()
        ray_proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL)
        (folder / "stride-node.pid").write_text(f"{os.getpid()}\n")  # who owns this node, for people
        while ray_proc.poll() is None and not stop_requested:
            time.sleep(0.5)
            reap(keep=ray_proc.pid)
        # Ray gives a starting node a fixed 30 s; on a loaded machine the start can fail: try again.
        if (stop_requested or ray_proc.returncode == 0 or attempt == START_ATTEMPTS
                or time.time() - started > START_WINDOW_S):
            break
        log(f"node {a.name}: ray start failed while starting (exit {ray_proc.returncode}, attempt {attempt} of "
            f"{START_ATTEMPTS}); stopping what it left and starting again")
        stop_tree(ray_proc, a.stop_timeout)
    if stop_requested:
        log(f"node {a.name}: {signal.Signals(stop_requested[0]).name}: stopping Ray (pid {ray_proc.pid})")
        code = 0
    else:
        log(f"node {a.name}: ray start exited with {ray_proc.returncode}; stopping what is left")
        code = 1
    stop_tree(ray_proc, a.stop_timeout)
    if not a.keep_tmp:
        shutil.rmtree(folder, ignore_errors=True)
    return code


def stop_tree(ray_proc: subprocess.Popen, timeout_s: float) -> None:
    """SIGTERM `ray start --block` (it drains and stops its node's processes), then SIGTERM/SIGKILL whatever of
    our process tree is still there. Only our own descendants are ever signalled."""
    if ray_proc.poll() is None:
        ray_proc.send_signal(signal.SIGTERM)
        try:
            ray_proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            log(f"ray start (pid {ray_proc.pid}) did not stop within {timeout_s:.0f}s; killing it")
    for sig, grace in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
        left = descendants(os.getpid())
        if not left:
            break
        log(f"stopping {len(left)} leftover process(es) with {sig.name}: {left}")
        for pid in left:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.time() + grace
        while time.time() < deadline and descendants(os.getpid()):
            reap(keep=0)
            time.sleep(0.2)
    reap(keep=0)
    left = descendants(os.getpid())
    if left:
        log(f"processes still alive after SIGKILL: {left}")


# ---- wait for the nodes to join ----

def cmd_wait(a) -> None:
    plan = load_plan(a.plan)
    expected = [n["name"] for n in plan["nodes"]]
    watch = dict(item.split("=", 1) for item in a.pids.split(",") if item) if a.pids else {}
    host, port = plan["gcs_address"].rsplit(":", 1)
    hint = a.log_hint or "the node logs"
    deadline = time.time() + a.timeout
    state = None
    joined: set[str] = set()
    while True:
        for name, pid in watch.items():
            if not Path(f"/proc/{pid}").exists():
                raise LaunchError(f"node {name}'s launcher (srun pid {pid}) exited before the cluster was up; "
                                  f"nodes missing: {', '.join(n for n in expected if n not in joined)} (see {hint})")
        if state is None and wait_for_port(host, int(port), 1):
            import ray.util.state as state  # the import alone takes seconds: only once the head answers
        if state is not None:
            try:
                alive = state.list_nodes(address=plan["dashboard_url"], filters=[("state", "=", "ALIVE")],
                                         raise_on_missing_output=False)
                joined = {n.labels.get(LABEL) for n in alive if n.labels} & set(expected)
            except Exception:  # noqa: BLE001 - the dashboard may still be starting: poll until the deadline
                pass
        if len(joined) == len(expected):
            log(f"all {len(expected)} node(s) joined: {' '.join(expected)}")
            return
        if time.time() > deadline:
            missing = [n for n in expected if n not in joined]
            why = f"the head's GCS {plan['gcs_address']} never answered" if state is None else "they never joined"
            raise LaunchError(f"{len(missing)} of {len(expected)} node(s) not in the Ray cluster after "
                              f"{a.timeout:.0f}s ({why}): nodes missing: {', '.join(missing)} (see {hint}); "
                              f"raise STRIDE_JOIN_TIMEOUT_S or check those nodes")
        time.sleep(1)


# ---- driver bookkeeping ----

def cmd_run_dir(a) -> None:
    from stride.errors import ConfigError
    from stride.trainers.config_reader import load_config

    ap = argparse.ArgumentParser(add_help=False)
    ap.add_argument("--config")
    ap.add_argument("--print-config", action="store_true")
    known, overrides = ap.parse_known_args(a.args)
    try:
        cfg = load_config(known.config, overrides)
    except ConfigError as e:
        raise LaunchError(str(e)) from None
    # Not cfg.run_dir: a run on a bucket keeps its summary there, and its working copy on the driver's node is
    # removed at its end.
    print(cfg.run_location)


def cmd_status(a) -> None:
    from stride.trainers.run.storage import open_store

    store = open_store(a.run_dir)
    try:
        # The storage's clock for a bucket's object, as close to the driver's start as this host's can say: the
        # summary of an earlier run of the job (a requeue) was written before this run's Ray even started.
        modified = store.modified("summary.json")
        if modified is not None and modified >= a.since:
            print(json.loads(store.read("summary.json") or b"{}").get("status", "none"))
            return
    except (OSError, ValueError, StrideError):  # unreadable, torn, or not a file Stride wrote (a link)
        pass
    print("none")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="launch.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("token")
    p.add_argument("--out", required=True)
    p = sub.add_parser("plan")
    p.add_argument("--job-dir", required=True)
    p.add_argument("--port-base", type=int, required=True)
    p.add_argument("--port-max", type=int, required=True)
    p.add_argument("--node-ports", type=int, required=True)
    p.add_argument("--nodes-per-host", type=int, required=True)
    p.add_argument("--cpus-per-node", default="", help="empty: what SLURM allocated on each node")
    p.add_argument("--gpus-per-node", type=int, required=True)
    p.add_argument("--ray-tmp", required=True)
    p.add_argument("--object-store-bytes", default="")
    p = sub.add_parser("node")
    p.add_argument("--plan", required=True)
    p.add_argument("--name", required=True)
    p.add_argument("--head-timeout", type=float, default=180)
    p.add_argument("--stop-timeout", type=float, default=60)
    p.add_argument("--keep-tmp", action="store_true")
    p = sub.add_parser("wait")
    p.add_argument("--plan", required=True)
    p.add_argument("--timeout", type=float, required=True)
    p.add_argument("--pids", default="", help="name=pid,... of the node launchers: fail early when one exits")
    p.add_argument("--log-hint", default="")
    p = sub.add_parser("run-dir")
    p.add_argument("args", nargs=argparse.REMAINDER)
    p = sub.add_parser("status")
    p.add_argument("--run-dir", required=True)
    p.add_argument("--since", type=float, required=True)
    a = ap.parse_args(argv)
    if a.cmd == "run-dir" and a.args[:1] == ["--"]:
        a.args = a.args[1:]
    try:
        return {"token": cmd_token, "plan": cmd_plan, "node": cmd_node, "wait": cmd_wait, "run-dir": cmd_run_dir,
                "status": cmd_status}[a.cmd](a) or 0
    except (LaunchError, PortError) as e:
        log(f"error: {e}")
        return 1


if __name__ == "__main__":
    sys.exit(main())
