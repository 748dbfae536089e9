"""Stride's training driver: one command for a laptop, a Ray cluster or SLURM.

    python trainers/main.py --config trainers/configs/char_gpt.yaml [section.field=value ...]
    python trainers/main.py --config trainers/configs/tabular_mlp.yaml scaling.num_workers=2 train.max_steps=300
    python trainers/main.py --config trainers/configs/char_gpt.yaml --print-config

On a cluster (RAY_ADDRESS set, or inside `ray job submit`) it joins that cluster; otherwise it starts an
embedded local Ray with token authentication and the dashboard on 127.0.0.1.

    RAY_AUTH_TOKEN_PATH=... ray job submit --address http://127.0.0.1:8265 --working-dir . -- \\
        python trainers/main.py --config trainers/configs/char_gpt.yaml

Exit codes: 0 success; 2 a problem you can fix (config, data, resources; one line on stderr); 1 training failed.
Results: <run.storage_path>/<run.name>/{summary.json, metrics.jsonl, checkpoint_*}.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

# Run as a script from anywhere (`python trainers/main.py`, or a Ray job's working dir without Stride
# installed): make the repo root importable and keep trainers/ itself off the path.
REPO_ROOT = Path(__file__).resolve().parent.parent
if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
    sys.path.pop(0)
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from datasets.parquet import DataError, inspect  # noqa: E402
from trainers.config import SECTIONS, Config, ConfigError, elastic_range, load_config, to_yaml  # noqa: E402
from trainers.checkpointing import atomic_write_text  # noqa: E402

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


class UsageError(Exception):
    """One line for the user; exit 2."""


def parse_args(argv: list[str] | None):
    sections = "\n".join(f"  {name:<11} {', '.join(cls.model_fields)}" for name, cls in SECTIONS.items())
    ap = argparse.ArgumentParser(
        prog="python trainers/main.py",
        description="Train a model with Stride (Ray Train + Ray Data).",
        epilog=f"Overrides are section.field=value (values parsed as YAML). Sections and fields:\n{sections}\n\n"
               "Full table with descriptions: README.md, 'Configuration'.",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=False, help="YAML config (e.g. trainers/configs/char_gpt.yaml)")
    ap.add_argument("--print-config", action="store_true", help="print the resolved config as YAML and exit")
    ap.add_argument("overrides", nargs="*", metavar="section.field=value")
    return ap.parse_args(argv)


def ensure_writable(folder: Path, key: str, value) -> Path:
    """Create `folder` and prove a file can be written there; else a UsageError naming the config key."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / f".write-test-{os.getpid()}"
        probe.write_text("ok")
        probe.unlink()
    except OSError as e:
        raise UsageError(f"{key} ({value}) is not writable ({e.strerror}); set {key}=<a folder you can write>") from None
    return folder


def check_storage(cfg: Config) -> Path:
    return ensure_writable(cfg.run_dir, "run.storage_path", cfg.run.storage_path)


# ---- Ray: connect or start, and check that the job can ever be scheduled ----

def _auth_env_for_embedded() -> None:
    """Token auth for the embedded cluster without Ray's world-readable ~/.ray/auth_token: a fresh token
    in a private 0600 file that lives as long as this process."""
    import secrets
    import tempfile

    if os.environ.get("RAY_AUTH_TOKEN") or os.environ.get("RAY_AUTH_TOKEN_PATH"):
        os.environ.setdefault("RAY_AUTH_MODE", "token")
        return
    folder = tempfile.mkdtemp(prefix="stride-auth-")
    path = Path(folder) / "token"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))
    os.environ["RAY_AUTH_MODE"] = "token"
    os.environ["RAY_AUTH_TOKEN_PATH"] = str(path)


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
    os.environ.setdefault("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", "0")
    os.environ.setdefault("RAY_TRAIN_ENABLE_PRINT_PATCH", "0")
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    _ignore_ray_data_shutdown_race()


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
    try:  # Ray 2.60: the env vars the Train controller copies to itself and to every worker
        from ray.train.v2._internal import constants

        constants.ENV_VARS_TO_PROPAGATE.add("RAY_ADDRESS")
    except (ImportError, AttributeError):
        pass


def init_ray(cfg: Config, log_to_driver: bool = True) -> bool:
    """Connect to RAY_ADDRESS or start an embedded local Ray. Returns True when embedded."""
    address = os.environ.get("RAY_ADDRESS")
    if not address:
        _auth_env_for_embedded()
    elif why := unreachable(address):
        raise UsageError(f"RAY_ADDRESS ({address}) is not reachable ({why}); start the cluster "
                         f"(python -m ray_cluster.local start) or unset RAY_ADDRESS to train on an embedded local Ray")
    elif os.environ.get("RAY_AUTH_TOKEN_PATH") or os.environ.get("RAY_AUTH_TOKEN"):
        os.environ.setdefault("RAY_AUTH_MODE", "token")  # a token given is a token meant to be sent
    import ray
    from ray._raylet import Config as RayletConfig

    RayletConfig.initialize("")  # re-read RAY_AUTH_MODE in case ray was imported before it was set
    env_vars = {k: os.environ[k] for k in ("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER",
                                           "RAY_TRAIN_ENABLE_PRINT_PATCH") if k in os.environ}
    in_job = bool(os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR"))
    # The workers import trainers/ from this checkout, and whatever the user's own PYTHONPATH holds.
    pythonpath = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH", "")) if p)
    runtime_env = None if in_job else {"env_vars": dict(env_vars, PYTHONPATH=pythonpath)}
    logging_config = ray.LoggingConfig(log_level="WARNING")
    if address:
        try:
            ray.init(address=address, runtime_env=runtime_env, logging_config=logging_config, log_to_driver=log_to_driver)
        except Exception as e:  # noqa: BLE001 - turn connection problems into one line
            # The port answered (checked above), so the cluster is there and refused us: in practice a missing or
            # wrong token (Ray says only "Failed to connect"), or a client of another Ray version.
            text = str(e).splitlines()[0] if str(e) else type(e).__name__
            token = os.environ.get("RAY_AUTH_TOKEN_PATH") or ("RAY_AUTH_TOKEN" if os.environ.get("RAY_AUTH_TOKEN") else "none")
            raise UsageError(f"RAY_ADDRESS ({address}) refused the connection ({text[:160]}; token: {token}); set "
                             f"RAY_AUTH_TOKEN_PATH to the cluster's token file (and check that the cluster runs "
                             f"ray=={ray.__version__})") from None
        _propagate_address()
        return False
    # The embedded cluster is this machine: as many CPUs as it has cores, so a gang that needs more is refused
    # (exit 2) instead of oversubscribing the cores.
    ctx = ray.init(num_cpus=os.cpu_count() or 1, include_dashboard=True, dashboard_host="127.0.0.1", runtime_env=runtime_env,
             logging_config=logging_config, configure_logging=True, log_to_driver=log_to_driver)
    _propagate_address()
    if ctx.dashboard_url:
        # stderr: stdout of tools that embed Ray this way (the doctor's table or JSON) stays theirs alone.
        print(f"stride: Ray dashboard http://{ctx.dashboard_url} (while this run lasts)", file=sys.stderr, flush=True)
    return True


def resolve_scaling(cfg: Config) -> tuple[int, bool, dict]:
    """num_workers/use_gpu 'auto' -> numbers, checked against what the cluster has. Raises UsageError."""
    import ray

    total = ray.cluster_resources()
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    cpus, gpus = total.get("CPU", 0.0), total.get("GPU", 0.0)
    use_gpu = cfg.scaling.use_gpu if cfg.scaling.use_gpu != "auto" else gpus > 0
    if cfg.scaling.num_workers == "auto":
        num_workers = int(gpus) if use_gpu else max(1, len(nodes))
    elif elastic_range(cfg):
        num_workers = elastic_range(cfg)[0]  # elastic: the minimum must fit; Ray starts as many as fit up to max
    else:
        num_workers = cfg.scaling.num_workers
    need_cpu = num_workers * cfg.scaling.cpus_per_worker
    if use_gpu and gpus < num_workers:
        raise UsageError(f"scaling.num_workers ({num_workers}) with scaling.use_gpu=true needs {num_workers} GPUs but the "
                         f"cluster has {gpus:g}; use scaling.num_workers={int(gpus)} or scaling.use_gpu=false"
                         if gpus else f"scaling.use_gpu (true) needs GPUs but the cluster has none; "
                         f"set scaling.use_gpu=false (or auto)")
    biggest = max((n["Resources"].get("CPU", 0.0) for n in nodes), default=0.0)
    if cfg.scaling.cpus_per_worker > biggest:
        raise UsageError(f"scaling.cpus_per_worker ({cfg.scaling.cpus_per_worker:g}) exceeds the largest node's "
                         f"{biggest:g} CPUs; use scaling.cpus_per_worker={biggest:g} or less")
    if need_cpu > cpus + 1e-9:
        fit = cpus / num_workers
        raise UsageError(f"scaling.num_workers ({num_workers}) x scaling.cpus_per_worker ({cfg.scaling.cpus_per_worker:g}) "
                         f"= {need_cpu:g} CPUs exceeds the cluster's {cpus:g} CPUs; use "
                         + (f"scaling.cpus_per_worker={fit:.2g}" if fit >= 0.1 else f"scaling.num_workers={max(1, int(cpus))}")
                         + " or a bigger cluster")
    return num_workers, bool(use_gpu), {"CPU": cpus, "GPU": gpus, "nodes": len(nodes)}


def check_multinode_paths(cfg: Config, nodes: int) -> None:
    if nodes <= 1:
        return
    for key in ("train_path", "val_path"):
        p = getattr(cfg.data, key)
        if p and "://" not in p and not os.environ.get("STRIDE_SHARED_FS"):
            # A local path is only safe on a shared filesystem; say so instead of failing on a remote node.
            raise UsageError(f"data.{key} ({p}) is a local path but the cluster has {nodes} nodes; put the data on "
                             f"shared storage and set STRIDE_SHARED_FS=1, or use an object-store URI (s3://, gs://)")


# Local splits up to this size are read by pyarrow in the driver; bigger ones (and remote URIs) by Ray Data's
# parallel read tasks. Every worker holds the whole split in memory either way (datasets/order.py).
DRIVER_READ_MAX_BYTES = 2 << 30
BLOCK_ROWS_TARGET_BYTES = 64 << 20


def read_datasets(specs: dict) -> dict:
    """Put each split's Parquet shards into the object store *before* any worker gang reserves CPUs: the reads
    then never starve behind the gang (a Parquet read waiting forever for a CPU), and the blocks are read once,
    not once per worker. Workers stream the blocks from the object store via get_dataset_shard.

    Local files are read with pyarrow right here and handed to `ray.data.from_arrow` (in ~64 MB blocks): no Ray
    Data read tasks, whose first run in a fresh cluster starts worker processes (about 9 s of a short job on
    2 cores). Remote URIs and local splits over 2 GiB go through `ray.data.read_parquet`."""
    import ray.data

    from datasets.parquet import read_local

    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False
    ctx.print_on_execution_start = False
    t0 = time.perf_counter()
    datasets, how = {}, set()
    for split, spec in specs.items():
        local = all("://" not in f for f in spec.files)
        if local and sum(os.path.getsize(f) for f in spec.files) <= DRIVER_READ_MAX_BYTES:
            table = read_local(spec)
            rows = max(1, BLOCK_ROWS_TARGET_BYTES * table.num_rows // max(table.nbytes, 1))
            datasets[split] = ray.data.from_arrow([table.slice(i, rows) for i in range(0, table.num_rows, rows)]
                                                  or [table])
            how.add("pyarrow")
        else:
            datasets[split] = ray.data.read_parquet(list(spec.files)).select_columns(list(spec.columns)).materialize()
            how.add("Ray Data")
    print(f"stride: read {', '.join(f'{k} {v.num_rows} rows' for k, v in specs.items())} with "
          f"{' and '.join(sorted(how))} in {time.perf_counter() - t0:.1f}s", flush=True)
    return datasets


def build_trainer(cfg: Config, specs: dict, datasets: dict, *, progress_bar: bool = False, callbacks=(),
                  runtime_extra: dict | None = None):
    """The TorchTrainer for one Stride run (the driver's and every Tune trial's). Returns (trainer, runtime)."""
    import ray.data
    from ray.train import CheckpointConfig, DataConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    from trainers.loop import train_loop_per_worker
    from trainers.tracking import default_uri

    num_workers, use_gpu, resources = resolve_scaling(cfg)
    check_multinode_paths(cfg, resources["nodes"])
    runtime = {
        "run_dir": str(cfg.run_dir), "train_spec": specs["train"], "val_spec": specs.get("val"),
        "num_classes": specs["train"].num_classes, "cpus_per_worker": cfg.scaling.cpus_per_worker,
        "mlflow_uri": cfg.tracking.mlflow_uri or default_uri(cfg.run.storage_path),
        "progress_bar": progress_bar, "sample_log": os.environ.get("STRIDE_SAMPLE_LOG"), "num_workers": num_workers, "use_gpu": use_gpu, "resources": resources,
        **(runtime_extra or {}),
    }
    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config={"cfg": cfg.to_dict(), "runtime": runtime},
        # A hung all-reduce fails the run after collective_timeout_s instead of the 30-minute default.
        torch_config=TorchConfig(timeout_s=int(cfg.train.collective_timeout_s)),
        # num_workers=auto on CPU means one worker per node: SPREAD places them so (PACK would stack them).
        scaling_config=ScalingConfig(num_workers=elastic_range(cfg) or num_workers, use_gpu=use_gpu,
                                     elastic_resize_monitor_interval_s=cfg.scaling.resize_check_s,
                                     resources_per_worker={"CPU": cfg.scaling.cpus_per_worker},
                                     placement_strategy="SPREAD" if cfg.scaling.num_workers == "auto" and not use_gpu
                                     else "PACK"),
        run_config=RunConfig(name=cfg.run.name, storage_path=str(cfg.run_dir.parent),
                             checkpoint_config=CheckpointConfig(num_to_keep=cfg.checkpoint.keep_last),
                             failure_config=FailureConfig(max_failures=cfg.scaling.max_failures),
                             callbacks=list(callbacks)),
        datasets=datasets,
        # Each worker streams the whole split once into memory; the sample order comes from datasets/order.py.
        dataset_config=DataConfig(datasets_to_split=[],
                                  execution_options=ray.data.ExecutionOptions(preserve_order=True)),
    )
    return trainer, runtime


def fit(cfg: Config, specs: dict, progress_bar: bool) -> tuple[int, dict]:
    import ray.train

    num_workers, use_gpu, _ = resolve_scaling(cfg)  # fail on impossible resources before reading any data
    if cfg.scaling.preflight:
        preflight(cfg, num_workers, use_gpu)
    trainer, runtime = build_trainer(cfg, specs, read_datasets(specs), progress_bar=progress_bar)
    res = runtime["resources"]
    workers = "{}-{}".format(*elastic_range(cfg)) if elastic_range(cfg) else runtime["num_workers"]
    print(f"stride: training {cfg.run.name} on {workers} {'GPU' if runtime['use_gpu'] else 'CPU'} "
          f"worker(s); cluster {res['CPU']:g} CPUs, {res['GPU']:g} GPUs, {res['nodes']} node(s)", flush=True)
    # Ray 2.60's fit() replaces the process's SIGINT handler with one that aborts the run at once, without
    # Stride's checkpoint: keep ours (Ctrl-C = checkpoint at the next step, exit 130; a second Ctrl-C stops now).
    trainer._register_sigint_handler = lambda controller: None
    try:
        result = trainer.fit()
    except ray.train.TrainingFailedError as e:
        return EXIT_FAILED, {"status": "failed", "error": _error_line(e), "world_size": runtime["num_workers"]}
    summary = dict(result.return_value or {})
    summary.setdefault("status", "completed")
    summary["checkpoint"] = result.checkpoint.path if result.checkpoint else None
    if summary.get("mlflow_run_id") and summary["checkpoint"]:
        from trainers.tracking import Tracker

        tracker = Tracker(runtime["mlflow_uri"], cfg.tracking.experiment, cfg.run.storage_path)
        tracker.run_id = summary["mlflow_run_id"]
        tracker.set_tag("final_checkpoint", summary["checkpoint"])
    return EXIT_OK, summary


def check_resume(cfg: Config, run_dir: Path, spec) -> None:
    """A run folder that holds a complete checkpoint is resumed from the newest one (the workers pick the same):
    refuse, before Ray starts and with the checkpoint left as it is, a model whose tensors do not match it
    (another model.* setting under the same run.name)."""
    import torch

    from trainers import checkpointing
    from trainers.step import build_model

    newest = checkpointing.newest_complete(run_dir)
    if newest is None:
        return
    with torch.device("meta"):  # shapes only: no memory for the weights
        model = build_model(cfg, len(spec.feature_columns or ()) or None, spec.num_classes)
    saved = torch.load(newest / checkpointing.STATE, map_location="cpu", mmap=True, weights_only=False)["model"]
    if mismatch := checkpointing.shape_mismatch(model.state_dict(), saved):
        raise UsageError(f"run.name ({cfg.run.name}) holds checkpoint {newest.name} of another model (the {mismatch}); "
                         f"use a new run.name, or the model.* settings it was trained with")
    print(f"stride: resuming {cfg.run.name} from {newest.name} (step {checkpointing.read_meta(newest)['step']})", flush=True)


def preflight(cfg: Config, num_workers: int, use_gpu: bool) -> None:
    """scaling.preflight: the doctor's quick checks on the gang this run is about to place. A failure stops the
    run before any data is read or checkpoint written (exit 2, naming the check, node and measured value)."""
    from ray_cluster.doctor import format_table, run_preflight

    t0 = time.perf_counter()
    rows = run_preflight(num_workers, use_gpu, str(cfg.run_dir.parent), cfg.scaling.cpus_per_worker, quick=True)
    failed = [r for r in rows if not r.ok]
    if failed:
        print(format_table(rows), file=sys.stderr)
        raise UsageError(f"scaling.preflight (true) failed: {failed[0].failure_line()}"
                         + (f" (+{len(failed) - 1} more above)" if len(failed) > 1 else "")
                         + "; fix the node or storage, or set scaling.preflight=false to train anyway")
    print(f"stride: preflight passed ({len(rows)} checks in {time.perf_counter() - t0:.1f}s)", flush=True)


def _error_line(e: BaseException) -> str:
    text = str(e)
    # Ray wraps the worker's exception; keep its last line ("ValueError: ...").
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return lines[-1][:500] if lines else type(e).__name__


def install_signal_handlers(run_dir: Path) -> list[int]:
    """SIGUSR1 (SLURM's warning before the time limit), SIGTERM (preemption, scancel) and SIGINT ask every rank
    to checkpoint at the next step boundary and stop; the exit code is then 128 + the signal. Under SLURM a
    SIGUSR1/SIGTERM means "you will be requeued" (status preempted), elsewhere SIGTERM/SIGINT mean interrupted."""
    import signal

    from trainers.loop import clear_stop_request, request_stop

    clear_stop_request(run_dir)
    received: list[int] = []

    def handler(signum, _frame):
        if received and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C: stop now
        received.append(signum)
        preempt = signum == signal.SIGUSR1 or (signum == signal.SIGTERM and os.environ.get("SLURM_JOB_ID"))
        request_stop(run_dir, "preempted" if preempt else "interrupted", signum)
        print(f"stride: received {signal.Signals(signum).name}: checkpointing at the next step, then exiting",
              file=sys.stderr, flush=True)

    for sig in (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, handler)
    return received


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t_start = time.time()
    try:
        if args.config is None and not args.overrides:
            raise UsageError("--config is required; e.g. --config trainers/configs/char_gpt.yaml")
        cfg = load_config(args.config, args.overrides)
        if args.print_config:
            print(to_yaml(cfg), end="")
            return EXIT_OK
        run_dir = check_storage(cfg)
        specs = {"train": inspect(cfg.data, cfg.model, "train")}
        if cfg.data.val_path:
            specs["val"] = inspect(cfg.data, cfg.model, "val")
        check_resume(cfg, run_dir, specs["train"])
        quiet_ray_env()
        embedded = init_ray(cfg)
        # After ray.init: Ray's core installs its own SIGTERM handler (which aborts); ours must replace it.
        signals = install_signal_handlers(run_dir)
        code, summary = fit(cfg, specs, progress_bar=sys.stdout.isatty())
    except (ConfigError, DataError, UsageError) as e:
        print(f"stride: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    if signals and summary.get("status") in ("preempted", "interrupted"):
        code = 128 + signals[-1]
    summary.update(wall_s=time.time() - t_start, config=cfg.to_dict())
    summary.setdefault("restarts", 0)
    atomic_write_text(run_dir / "summary.json", json.dumps(summary, indent=1, default=str) + "\n")
    report_paths(cfg, run_dir, summary, embedded)
    return code


def report_paths(cfg: Config, run_dir: Path, summary: dict, embedded: bool) -> None:
    from trainers.tracking import default_uri

    uri = cfg.tracking.mlflow_uri or default_uri(cfg.run.storage_path)
    fmt = lambda v: f"{v:.4f}" if isinstance(v, float) else str(v)  # noqa: E731
    print(f"stride: {summary['status']}: step {summary.get('global_step')} train_loss {fmt(summary.get('train_loss'))} "
          f"val_loss {fmt(summary.get('val_loss'))} (untrained {fmt(summary.get('initial_val_loss'))})"
          + (f" val_accuracy {fmt(summary.get('val_accuracy'))}" if summary.get("val_accuracy") is not None else ""))
    if summary.get("error"):
        print(f"stride: error: {summary['error']}", file=sys.stderr)
    print(f"stride: summary     {run_dir / 'summary.json'}")
    print(f"stride: metrics     {run_dir / 'metrics.jsonl'}")
    print(f"stride: checkpoint  {summary.get('checkpoint')}")
    print(f"stride: mlflow      run {summary.get('mlflow_run_id')} in {uri}  (view: mlflow ui --backend-store-uri {uri})")


if __name__ == "__main__":
    sys.exit(main())
