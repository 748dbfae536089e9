"""Connecting to Ray, shared by the training driver, sweeps and the doctor: start an embedded local Ray (token
auth, dashboard on 127.0.0.1) or join RAY_ADDRESS, quietly; resolve and check a worker gang against what the
cluster has. No trainer code here: a config object is read for its `scaling` section only.
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path


from stride.errors import UsageError  # noqa: E402
from stride.ray_cluster import ray_edge  # noqa: E402

__all__ = ["init_ray", "quiet_ray_env"]


def _auth_env_for_embedded() -> None:
    """Token auth for the embedded cluster without Ray's world-readable ~/.ray/auth_token: a fresh token
    in a private 0600 file that lives as long as this process."""
    import secrets
    import tempfile

    if os.environ.get("RAY_AUTH_TOKEN") or os.environ.get("RAY_AUTH_TOKEN_PATH"):
        os.environ.setdefault("RAY_AUTH_MODE", "token")
        return
    import atexit
    import shutil

    remove_orphaned_auth_folders()
    folder = tempfile.mkdtemp(prefix=AUTH_PREFIX)  # 0700
    # Registered before ray.init's own exit handler, so it runs after Ray has shut down (atexit is last-in first-out).
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    # Who made it, so that the next start can tell a folder whose driver was killed (atexit never ran) from a live one.
    _write_private(Path(folder) / AUTH_OWNER, f"{os.getpid()} {process_start(os.getpid())}")
    path = Path(folder) / "token"
    _write_private(path, secrets.token_hex(32))
    os.environ["RAY_AUTH_MODE"] = "token"
    os.environ["RAY_AUTH_TOKEN_PATH"] = str(path)


AUTH_PREFIX, AUTH_OWNER = "stride-auth-", "owner"


def _write_private(path: Path, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)


def process_start(pid: int) -> str | None:
    """A process's start time (clock ticks since boot, /proc/<pid>/stat): with the pid, it names one process even
    after the pid is reused. None when no such process is alive: a zombie (exited, not yet reaped by its parent,
    which a killed process may stay for a while) is not."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return None if fields[0] in ("Z", "X") else fields[19]
    except (OSError, IndexError):
        return None


def remove_orphaned_auth_folders(tmp: str | None = None) -> list[Path]:
    """Remove the embedded-Ray token folders of this user whose creating process is dead (a SIGKILLed driver never
    runs its exit handlers). A folder of a live process, of another user, a link, or one without a readable owner
    record (an older Stride's, or one being created this instant) is left alone. Returns the folders removed."""
    import shutil
    import stat
    import tempfile

    removed = []
    for folder in Path(tmp or tempfile.gettempdir()).glob(f"{AUTH_PREFIX}*"):
        try:
            st = os.lstat(folder)
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
                continue
            fd = os.open(folder / AUTH_OWNER, os.O_RDONLY | os.O_NOFOLLOW)
            with os.fdopen(fd) as f:
                pid, start = f.read(100).split()
        except (OSError, ValueError):
            continue
        if pid.isdigit() and process_start(int(pid)) != start:
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    return removed


def _ignore_ray_data_shutdown_race() -> None:
    """Ray 2.60's Ray Data file listing (dynamic_work_queue) can lose a race at shutdown: its "completion-signaler"
    thread, slower than the consumer on a loaded machine, puts a sentinel into a queue already interrupted and dies
    with InterruptedError after every result was delivered. Harmless, but Python prints a traceback into the
    user's output; drop exactly that one and keep every other thread error."""
    import threading

    default = threading.excepthook

    def hook(args):
        if args.exc_type is InterruptedError and args.thread is not None and args.thread.name.endswith("completion-signaler"):
            return
        default(args)

    threading.excepthook = hook


def quiet_ray_env() -> None:
    # The controller polls workers every 2 s by default, which makes every ray.train.report() slow.
    os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.1")
    # Ray Train's preemption watcher stays on (Ray's default): it tells the workers when a node of the gang is
    # drained for preemption, and Stride checkpoints at the next step (docs/fault-tolerance.md, Preemption). Its
    # one ERROR line per gang start is dropped on the driver (_drop_known_ray_noise).
    os.environ.setdefault("RAY_TRAIN_ENABLE_PRINT_PATCH", "0")
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    _ignore_ray_data_shutdown_race()


# Lines Ray forwards from its processes to the driver's stderr that say nothing to a Stride user and would break
# the one-line error of a run that fails: Ray 2.60 core's warning, logged at ERROR by the controller at every gang
# start, that the preemption watcher actor's constructor arguments live in the object store (ray#53727; harmless:
# the watcher is restarted with a fresh gang, never from those arguments).
KNOWN_RAY_NOISE = ("github.com/ray-project/ray/issues/53727",)


def _drop_known_ray_noise() -> None:
    """Filter KNOWN_RAY_NOISE out of the worker output Ray prints on this driver (every other line is kept)."""
    ray_edge.filter_worker_output(lambda line: not any(k in line for k in KNOWN_RAY_NOISE))


def unreachable(address: str, timeout_s: float = 5.0) -> str | None:
    """None when something listens at a host:port (or ray://host:port) address; else why not. ray.init() retries
    an unreachable GCS for minutes, so ask the socket first. Other forms (auto) are left to ray.init()."""
    import socket

    host, _, port = address.split("://", 1)[-1].rpartition(":")
    if not host or not port.isdigit():
        return None
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError as e:
        return e.strerror or type(e).__name__
    return None


def _propagate_address() -> None:
    """Every Train process must know *its* cluster. Ray code that looks the cluster up by itself (Train's
    PlacementGroupCleaner, via the state API) otherwise reads RAY_ADDRESS or /tmp/ray/ray_current_cluster, which
    on a host with several Rays (an embedded one beside a `ray start` head, SLURM jobs sharing a node) names
    another cluster: it then sees the controller as gone and removes the gang's placement group mid-run."""
    import ray

    os.environ["RAY_ADDRESS"] = ray.get_runtime_context().gcs_address
    ray_edge.propagate_env_var("RAY_ADDRESS")


def init_ray(log_to_driver: bool = True) -> bool:
    """Connect to RAY_ADDRESS or start an embedded local Ray. Returns True when embedded."""
    address = os.environ.get("RAY_ADDRESS")
    if not address:
        _auth_env_for_embedded()
    elif why := unreachable(address):
        raise UsageError(f"RAY_ADDRESS ({address}) is not reachable ({why}); start the cluster "
                         f"(python -m stride.ray_cluster.local start) or unset RAY_ADDRESS to train on an embedded local Ray")
    elif os.environ.get("RAY_AUTH_TOKEN_PATH") or os.environ.get("RAY_AUTH_TOKEN"):
        os.environ.setdefault("RAY_AUTH_MODE", "token")  # a token given is a token meant to be sent
    import ray

    ray_edge.reread_auth_mode()  # in case ray was imported before RAY_AUTH_MODE was set
    env_vars = {k: os.environ[k] for k in ("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER",
                                           "RAY_TRAIN_ENABLE_PRINT_PATCH") if k in os.environ}
    in_job = bool(os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR"))
    runtime_env = None if in_job else {"env_vars": dict(env_vars, **storage_env(), **worker_paths())}
    logging_config = ray.LoggingConfig(log_level="WARNING")
    if address:
        try:
            with _workers_without_working_directory():
                ray.init(address=address, runtime_env=runtime_env, logging_config=logging_config,
                         log_to_driver=log_to_driver)
        except Exception as e:  # noqa: BLE001 - turn connection problems into one line
            # The port answered (checked above), so the cluster is there and refused us: in practice a missing or
            # wrong token (Ray says only "Failed to connect"), or a client of another Ray version.
            text = str(e).splitlines()[0] if str(e) else type(e).__name__
            token = os.environ.get("RAY_AUTH_TOKEN_PATH") or ("RAY_AUTH_TOKEN" if os.environ.get("RAY_AUTH_TOKEN") else "none")
            raise UsageError(f"RAY_ADDRESS ({address}) refused the connection ({text[:160]}; token: {token}); set "
                             f"RAY_AUTH_TOKEN_PATH to the cluster's token file (and check that the cluster runs "
                             f"ray=={ray.__version__})") from None
        _propagate_address()
        _drop_known_ray_noise()
        return False
    # The embedded cluster is this machine: as many CPUs as it has cores, so a gang that needs more is refused
    # (exit 2) instead of oversubscribing the cores.
    with _workers_without_working_directory():
        ctx = ray.init(num_cpus=os.cpu_count() or 1, include_dashboard=True, dashboard_host="127.0.0.1",
                       runtime_env=runtime_env, logging_config=logging_config, configure_logging=True,
                       log_to_driver=log_to_driver)
    _start_watchdog(ctx.address_info["session_dir"])
    _propagate_address()
    _drop_known_ray_noise()
    if ctx.dashboard_url:
        # stderr: stdout of tools that embed Ray this way (the doctor's table or JSON) stays theirs alone.
        print(f"stride: Ray dashboard http://{ctx.dashboard_url} (while this run lasts)", file=sys.stderr, flush=True)
    return True


@contextlib.contextmanager
def _workers_without_working_directory():
    """ray.init run from the standard library's folder. Ray puts the driver's working directory first on every
    worker's sys.path (ray/_private/worker.py, SCRIPT_MODE): a numpy.py planted beside a run folder would be imported
    by every worker of `stride eval` run there. The standard library's folder is on the path anyway, and only its
    owner writes it, on every node; a user's own modules reach the workers through STRIDE_TASK_PATH, appended."""
    here = os.getcwd()
    os.chdir(os.path.dirname(os.__file__))
    try:
        yield
    finally:
        os.chdir(here)


_watchdogs: list = []  # the embedded Rays' watchdogs, and the pipe ends whose closing (this process's end) wakes them


def _start_watchdog(session_dir: str) -> None:
    """ray_cluster/watchdog.py: when this process dies, even by SIGKILL, it kills every process of the Ray session it
    started (Ray ties only the GCS, raylet and dashboard to this process) and removes the token folder."""
    import subprocess

    token = os.environ.get("RAY_AUTH_TOKEN_PATH", "")
    token_dir = str(Path(token).parent) if Path(token).parent.name.startswith(AUTH_PREFIX) else ""
    read_end, write_end = os.pipe()  # both close-on-exec: no process this one starts holds the write end
    watchdog = subprocess.Popen([sys.executable, "-I", str(Path(__file__).with_name("watchdog.py")), session_dir,
                                 *([token_dir] if token_dir else [])], stdin=read_end, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, start_new_session=True)  # outlives a group kill
    os.close(read_end)
    _watchdogs.append((watchdog, write_end))


# How the cloud libraries find a run's bucket (run.storage_path s3:// or gs://): the endpoint, region, profile,
# project, an emulator. A running head's workers do not inherit the driver's
# environment (an embedded Ray's do), and they upload the checkpoints, so the driver's settings go to them. Variables
# that name a file (AWS_*_FILE, GOOGLE_APPLICATION_CREDENTIALS) stay behind: the path is the driver machine's.
STORAGE_ENV = ("STORAGE_EMULATOR_HOST", "GOOGLE_CLOUD_PROJECT", "GCLOUD_PROJECT", "GCE_METADATA_HOST", "GCE_METADATA_IP",
               "NO_GCE_CHECK")


# Secrets never travel: a job's runtime_env is shown to whoever holds the cluster's token (the dashboard, `ray job
# list`), and a node's own identity (instance profile, workload identity, its own environment) is what should sign
# its requests. Only where to go and how goes with the job.
SECRET_ENV = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN")


def storage_env() -> dict[str, str]:
    """The driver's object-storage settings (endpoint, region, profile name, emulator, project; never a key or a
    token), for the workers of a cluster this process joins (in the runtime_env only: Ray keeps it with the job,
    Stride writes it nowhere)."""
    return {k: v for k, v in os.environ.items()
            if ((k.startswith("AWS_") and not k.endswith("_FILE")) or k in STORAGE_ENV) and k not in SECRET_ENV}


def worker_paths() -> dict[str, str]:
    """Environment for the workers of a cluster this process starts or joins (not a Ray job's: the job's working
    directory is theirs already). A user's task module is found where the driver finds it: its working directory and
    the folders on its PYTHONPATH (STRIDE_TASK_PATH, appended to the workers' sys.path; a running head's workers do
    not inherit the driver's PYTHONPATH, an embedded Ray's do). A checkout run without installing Stride
    (stride/_checkout.py) also gives the workers the checkout on PYTHONPATH; an installed Stride leaves the user's
    PYTHONPATH as it is."""
    import stride
    from stride.user_code import TASK_PATH_ENV, task_search_path

    python_path = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env = {TASK_PATH_ENV: os.pathsep.join(dict.fromkeys(task_search_path() + python_path))}
    checkout = getattr(stride, "_CHECKOUT_ROOT", None)
    if checkout:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (checkout, os.environ.get("PYTHONPATH", "")) if p)
    return env
