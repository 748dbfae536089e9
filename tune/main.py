"""Stride's sweep driver: many Stride training runs (Ray Tune trials) over a search space, one command.

    python tune/main.py --config tune/configs/lr_sweep.yaml
    python tune/main.py --config tune/configs/lr_sweep.yaml sweep.num_samples=4 base.train.max_steps=100
    python tune/main.py --config tune/configs/char_gpt_sweep.yaml sweep.scheduler=fifo
    python tune/main.py --config tune/configs/lr_sweep.yaml --print-space     # check the file, start nothing

Every trial is a full Stride run (the same loop, checkpoints and metrics.jsonl) in <storage_path>/<name>/<trial id>/,
with the trial's overrides applied on top of `sweep.base_config` and `base`. Run the same command again after an
interruption (Ctrl-C, SIGTERM, a killed driver) and the sweep continues: finished trials are not run again,
unfinished ones resume from their last checkpoint (--retry-failed also reruns failed ones).

On a bucket (`sweep.storage_path=s3://bucket/prefix`, gs://): every trial is a run on the bucket, Tune keeps its
experiment state there, and the files below reach it too (tune/sweep_files.py), so the rerun resumes from the bucket
on any machine. MLflow's default store cannot live there: set base.tracking.mlflow_uri, or base.tracking.mlflow=false.

On a cluster (RAY_ADDRESS set) it joins that cluster; otherwise it starts an embedded local Ray with token
authentication, as trainers/main.py does. `max_concurrent_trials: auto` runs as many trials at once as worker
gangs fit in the cluster.

Exit codes: 0 at least one trial finished; 1 every trial failed; 2 a problem you can fix (sweep file, space, data,
resources; one line on stderr); 130/143 interrupted by SIGINT/SIGTERM (rerun to resume).
Results: <storage_path>/<name>/sweep_summary.json, and each tracker of the base config's tracking.sinks records the
sweep its own way (trainers/sinks: `Sink.open_sweep`/`close_sweep`; MLflow: a parent run with a child run per trial).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

if not __package__:  # run as a file from a checkout: import Stride as the `stride` package (stride/_checkout.py)
    import runpy

    runpy.run_path(str(Path(__file__).resolve().parents[1] / "stride" / "_checkout.py"))

from stride.cli import ArgumentParser, error_line  # noqa: E402
from stride.errors import StrideError  # noqa: E402
from stride.errors import ConfigError  # noqa: E402
from stride.trainers.config import Config, check_batch_fits  # noqa: E402
from stride.trainers.config_reader import build_config  # noqa: E402
from stride.tune.space import Sweep, load_sweep, with_values  # noqa: E402
from stride.tune.sweep_files import EVENTS  # noqa: E402

# torch and Ray take seconds to import (minutes on a loaded machine): a mistake in the sweep file is answered
# before either is imported, so trainers.main, trainers.checkpointing and tune.trial are imported where used.

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
WORKER_LOG = "worker.log"
STATE = "stride_sweep.json"          # the sweep's identity and its trackers' fields, written at the first start
SUMMARY = "sweep_summary.json"
# A trial's own actor only waits on its TorchTrainer: no CPU (the gang reserves those, so N gangs fit on N x gang
# CPUs), and a token of memory because Tune needs a non-empty resource bundle to place it.
TRIAL_RESOURCES = {"cpu": 0, "memory": 32 * 1024 * 1024}


def parse_args(argv: list[str] | None):
    ap = ArgumentParser(
        prog="python tune/main.py",
        description="Run a hyperparameter sweep of Stride training runs (Ray Tune).",
        epilog="Overrides: sweep.field=value, base.section.field=value (values parsed as YAML).\n"
               "Rerun the same command to resume an interrupted sweep. See README.md, 'Hyperparameter sweeps'.",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True, help="sweep YAML (e.g. tune/configs/lr_sweep.yaml)")
    ap.add_argument("--print-space", action="store_true", help="check the sweep file, print its space, start nothing")
    ap.add_argument("--retry-failed", action="store_true", help="on resume, also rerun trials that failed")
    ap.add_argument("--verbose", action="store_true", help="show the workers' logs on the console (default: <sweep>/worker.log)")
    ap.add_argument("overrides", nargs="*", metavar="sweep.field=value | base.section.field=value")
    return ap.parse_args(argv)


# ---- checks that need the data or the cluster (everything else is checked in tune/space.py) ----

def check_storage(sweep: Sweep) -> Path:
    """The folder the driver writes the sweep's files in, created and proven writable. On a bucket: the bucket is
    writable with these credentials, and the working copy holds the bucket's copies of the driver's files from an
    earlier start (a rerun resumes from the bucket, on any machine)."""
    from stride.trainers.launch.lifecycle import ensure_writable
    from stride.trainers.run.storage import ObjectStore, location_of

    location = location_of(sweep.files.root)
    if location is None:
        return ensure_writable(sweep.sweep_dir, "sweep.storage_path", sweep.sweep.storage_path)
    ObjectStore(location).check_writable("sweep.storage_path")
    ensure_writable(sweep.sweep_dir, "base.checkpoint.staging_dir", sweep.sweep_dir.parent)
    sweep.files.pull(STATE, EVENTS, WORKER_LOG)
    return sweep.sweep_dir


def inspect_data(cfg: Config, sweep: Sweep) -> tuple[dict, dict]:
    """The base config's data checks and facts (Task.inspect), once for the sweep; a task may also refuse model.*
    values against the data (char_gpt: a context longer than the token rows), so the extremes of every model.*
    dimension are checked too, before any trial starts."""
    from stride.trainers.launch.checks import prepare

    task, specs = prepare(cfg)
    for d in sweep.dims:
        if d.key.startswith("model.") and d.key != "model.name":
            values = d.values_to_check()
            if all(isinstance(v, (int, float)) for v in values):
                values = [min(values), max(values)]
            for v in values:
                prepare(build_config(with_values(sweep.base_raw, {d.key: v})))
    return specs, task.facts


def check_batches(sweep: Sweep, cfg: Config, train_rows: int, num_workers: int) -> None:
    from stride.errors import UsageError

    for d in sweep.dims:
        if d.key == "train.batch_size_per_worker":
            biggest = max(d.values_to_check())
            if biggest * num_workers > train_rows:
                raise UsageError(f"space.{d.key} ({d.describe()}) can give {biggest}, and {biggest} x {num_workers} "
                                 f"workers exceeds the {train_rows} training rows; lower its upper end")
    if "train.batch_size_per_worker" not in {d.key for d in sweep.dims}:
        check_batch_fits(cfg, train_rows, num_workers)  # every trial's: the same check and line as a run's


def gangs_that_fit(num_workers: int, cpus_per_worker: float, use_gpu: bool) -> tuple[int, str]:
    """How many trial worker gangs the cluster holds at once: each worker's bundle must fit on one node."""
    import ray

    nodes = [n["Resources"] for n in ray.nodes() if n.get("Alive")]
    bundles = 0
    for res in nodes:
        per_node = math.floor(res.get("CPU", 0.0) / cpus_per_worker + 1e-9)
        if use_gpu:
            per_node = min(per_node, math.floor(res.get("GPU", 0.0) + 1e-9))
        bundles += per_node
    cpus = sum(r.get("CPU", 0.0) for r in nodes)
    gpus = sum(r.get("GPU", 0.0) for r in nodes)
    have = f"{cpus:g} CPUs, {gpus:g} GPUs on {len(nodes)} node(s)"
    return bundles // num_workers, have


def resolve_concurrency(sweep: Sweep, cfg: Config) -> tuple[int, int, bool]:
    """(max concurrent trials, workers per trial, use_gpu); raises UsageError for a gang that can never run."""
    from stride.trainers.config import elastic_range
    from stride.errors import UsageError
    from stride.trainers.launch.scaling import resolve_scaling

    if elastic_range(cfg):
        raise UsageError(f"base.scaling.num_workers ({list(elastic_range(cfg))}) is elastic, which sweeps do not "
                         f"support (trials would resize each other); use a fixed base.scaling.num_workers")
    try:
        num_workers, use_gpu, _ = resolve_scaling(cfg)
    except UsageError as e:
        raise UsageError("base: " + str(e).replace("scaling.", "base.scaling.")) from None
    fit, have = gangs_that_fit(num_workers, cfg.scaling.cpus_per_worker, use_gpu)
    gang = f"{num_workers} worker(s) x {cfg.scaling.cpus_per_worker:g} CPU" + (" + 1 GPU" if use_gpu else "")
    if fit < 1:
        raise UsageError(f"one trial's worker gang ({gang}) does not fit in the cluster ({have}); "
                         f"lower base.scaling.num_workers or base.scaling.cpus_per_worker")
    want = sweep.sweep.max_concurrent_trials
    if want == "auto":
        n = fit
    else:
        n = want
        if want > fit:
            print(f"stride: note: sweep.max_concurrent_trials ({want}) > the {fit} trial gangs ({gang}) that fit now "
                  f"({have}); the others wait for resources", flush=True)
    return n, num_workers, use_gpu


# ---- the sweep's identity, its trackers' record ----

def read_state(sweep_dir: Path) -> dict[str, Any] | None:
    try:
        return json.loads((sweep_dir / STATE).read_text())
    except (OSError, ValueError):
        return None


def first_difference(a: Any, b: Any, path: str = "") -> str | None:
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b), key=str):
            diff = first_difference(a.get(k), b.get(k), f"{path}.{k}" if path else str(k))
            if diff:
                return diff
        return None
    return None if a == b else f"{path} ({b!r} before, {a!r} now)"


def sweep_info(sweep: Sweep, cfg: Config):
    from stride.trainers.sinks.base import SweepInfo

    return SweepInfo(name=sweep.sweep.name, sweep_dir=sweep.sweep_dir, cfg=cfg, params=sweep.to_params(),
                     metric=sweep.sweep.metric, mode=sweep.sweep.mode)


# ---- Tune ----

def build_tuner(sweep: Sweep, trainable, concurrency: int, max_t: int, restore: bool, retry_failed: bool):
    """The Tuner of a new sweep, or of an earlier start restored from its storage (a folder, or the bucket: Tune
    reaches it through pyarrow's filesystems, with the same endpoint and credentials variables)."""
    from ray import tune
    from ray.tune.schedulers import ASHAScheduler, FIFOScheduler
    from ray.tune.search.basic_variant import BasicVariantGenerator

    from stride.tune.trial import ConsoleCallback, trial_dirname

    s = sweep.sweep
    if restore:
        # The search algorithm, scheduler and trial list come back from the sweep folder.
        return tune.Tuner.restore(sweep.storage, trainable=trainable, resume_unfinished=True,
                                  resume_errored=retry_failed)
    if s.search == "optuna":
        from ray.tune.search.optuna import OptunaSearch

        search_alg = OptunaSearch(seed=s.seed)
    else:
        # An explicit generator ignores TuneConfig.max_concurrent_trials: it must carry the limit itself.
        search_alg = BasicVariantGenerator(max_concurrent=concurrency, random_state=s.seed,
                                           constant_grid_search=s.search == "grid")
    if s.scheduler == "asha":
        base = sweep.base_cfg()
        grace = s.grace_period_steps or (base.train.eval_every_steps if s.metric.startswith("val_")
                                         else base.train.log_every_steps)
        # time_attr is Stride's optimizer step, so rungs mean the same for every batch size; max_t one past the
        # last step so ASHA never "stops" a trial at its final step before it writes its summary.
        scheduler = ASHAScheduler(time_attr="step", max_t=max_t + 1, grace_period=grace,
                                  reduction_factor=s.reduction_factor)
    else:
        scheduler = FIFOScheduler()
    return tune.Tuner(
        trainable,
        param_space=sweep.param_space(),
        tune_config=tune.TuneConfig(metric=s.metric, mode=s.mode, search_alg=search_alg, scheduler=scheduler,
                                    num_samples=s.num_samples, max_concurrent_trials=concurrency,
                                    trial_dirname_creator=trial_dirname, reuse_actors=False),
        run_config=tune.RunConfig(name=s.name, storage_path=sweep.files.root, verbose=0,
                                  callbacks=[ConsoleCallback(sweep.files, s.metric)],
                                  failure_config=tune.FailureConfig(max_failures=s.max_failures)),
    )


def max_steps_of_sweep(sweep: Sweep, train_rows: int, num_workers: int) -> int:
    """The most steps any trial can take (ASHA's max_t): the extreme values of the step-shaping fields."""
    from stride.tune.trial import planned_steps

    candidates: dict[str, list] = {}
    for d in sweep.dims:
        if d.key in ("train.max_steps", "train.epochs", "train.batch_size_per_worker", "train.grad_accum_steps"):
            candidates[d.key] = d.values_to_check()
    most = 1
    keys = list(candidates)
    for combo in itertools.product(*(candidates[k] for k in keys)) if keys else [()]:
        cfg = build_config(with_values(sweep.base_raw, dict(zip(keys, combo))))
        most = max(most, planned_steps(cfg, train_rows, num_workers))
    return most


# ---- results ----

def trial_events(sweep_dir: Path) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    try:
        lines = (sweep_dir / EVENTS).read_text().splitlines()
    except OSError:
        lines = []
    for ln in lines:
        try:
            ev = json.loads(ln)
        except ValueError:
            continue  # a line cut short by a killed driver
        t = out.setdefault(ev["trial_id"], {"started_at": None, "first_result_at": None, "ended_at": None, "last": None})
        if ev["event"] == "start":
            t["started_at"] = t["started_at"] or ev["time"]
            t["last"] = "start"
        elif ev["event"] == "result":
            t["first_result_at"] = t["first_result_at"] or ev["time"]
        else:
            t["ended_at"] = ev["time"]
            t["last"] = ev["event"]
    return out


def collect_trials(sweep: Sweep, results, train_rows: int, num_workers: int) -> list[dict[str, Any]]:
    from stride.tune.trial import planned_steps, read_summary, trial_raw

    events = trial_events(sweep.sweep_dir)
    base = sweep.base_cfg()
    metric = sweep.sweep.metric
    trials = []
    for r in results:
        trial_id = Path(r.path).name
        params = sweep.decode(r.config or {})
        ev = events.get(trial_id, {})
        run_dir = sweep.files.trial(trial_id)  # its folder, or its URI on a bucket
        own = read_summary(run_dir) or {}
        m = r.metrics or {}
        steps = m.get("step")
        planned = planned_steps(build_config(trial_raw(sweep, params, trial_id, base)), train_rows, num_workers)
        if r.error is not None or ev.get("last") == "error":
            status = "failed"
        elif ev.get("last") == "end":
            status = "completed" if own.get("status") == "completed" or (steps or 0) >= planned else "early_stopped"
        elif ev.get("last") == "start":
            status = "interrupted"
        else:
            status = "pending"
        value = m.get(metric)
        trials.append({
            "trial_id": trial_id, "params": params,
            "metric": value if isinstance(value, (int, float)) and math.isfinite(value) else None,
            "status": status, "steps": steps, "planned_steps": planned,
            "started_at": ev.get("started_at"), "first_result_at": ev.get("first_result_at"),
            "ended_at": ev.get("ended_at"), "run_dir": run_dir,
            "error": (own.get("error") or str(r.error).strip().splitlines()[-1][:300]) if status == "failed" else None,
        })
    sign = 1 if sweep.sweep.mode == "min" else -1
    trials.sort(key=lambda t: (t["metric"] is None, sign * (t["metric"] or 0.0), t["trial_id"]))
    return trials


FINISHED = ("completed", "early_stopped")


def outcome(trials: list[dict], expected: int) -> tuple[dict | None, bool]:
    """(best trial, sweep complete). `trials` is sorted best first; the best is the best metric among trials that
    finished (ran to the end or were stopped early by the scheduler), as Tune's scope='last' picks it."""
    complete = len(trials) >= expected and not any(t["status"] in ("interrupted", "pending") for t in trials)
    ranked = [t for t in trials if t["status"] in FINISHED and t["metric"] is not None]
    return (ranked[0] if ranked else None), complete


def exit_code(trials: list[dict], complete: bool, signals: list[int]) -> int:
    if not complete:
        return 128 + (signals[-1] if signals else signal.SIGINT)
    return EXIT_OK if any(t["status"] in FINISHED for t in trials) else EXIT_FAILED


def print_table(trials: list[dict], metric: str) -> None:
    keys = sorted({k for t in trials for k in t["params"]})
    fmt = lambda v: f"{v:.4g}" if isinstance(v, float) else ("-" if v is None else str(v))  # noqa: E731
    rows = [["trial", "status", "steps", metric] + keys]
    rows += [[t["trial_id"], t["status"], fmt(t["steps"]), fmt(t["metric"])] + [fmt(t["params"].get(k)) for k in keys]
             for t in trials]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("stride: " + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())


def route_worker_logs(path: Path) -> None:
    """Every trial's workers print Stride's per-step log lines and Ray Train's own; with several trials at once
    that floods the console. They go to <sweep>/worker.log instead; the console gets one line per trial result."""
    from stride.ray_cluster.ray_edge import RAY_PRINT_LOGS, route_worker_output

    out = open(path, "a", buffering=1)

    def write(data: dict) -> None:
        prefix = f"({data.get('actor_name') or data.get('task_name') or 'worker'} pid={data.get('pid')})"
        out.write("".join(f"{prefix} {line}\n" for line in data.get("lines", [])))

    route_worker_output("stride_sweep_log", write, replace=RAY_PRINT_LOGS)


def install_sigterm() -> list[int]:
    """SIGTERM (scancel, preemption) stops the sweep as Ctrl-C does: Tune saves its state and the trials stop."""
    received: list[int] = []

    def handler(signum, _frame):
        received.append(signum)
        os.kill(os.getpid(), signal.SIGINT)

    signal.signal(signal.SIGTERM, handler)
    return received


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t_start = time.time()
    try:
        sweep = load_sweep(args.config, args.overrides)
        cfg = sweep.base_cfg()
    except ConfigError as e:
        error_line(e)
        return EXIT_USAGE
    if args.print_space:
        print(json.dumps({"sweep": sweep.sweep.model_dump(mode="json"), "base": sweep.base,
                          "space": {d.key: d.describe() for d in sweep.dims}, "trials": sweep.num_trials()}, indent=1))
        return EXIT_OK

    from stride.ray_cluster.connect import init_ray, quiet_ray_env

    try:
        sweep_dir = check_storage(sweep)
        specs, facts = inspect_data(cfg, sweep)
        state = check_resumable(sweep, sweep_dir)
        quiet_ray_env()
        os.environ.setdefault("TUNE_GLOBAL_CHECKPOINT_S", "2")  # a killed driver loses at most 2 s of sweep state
        # The legacy reporter honours verbose=0 completely (the new one still prints a config box and TensorBoard hints).
        os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")
        init_ray()
        concurrency, num_workers, use_gpu = resolve_concurrency(sweep, cfg)
        check_batches(sweep, cfg, specs["train"].num_rows, num_workers)
    except StrideError as e:
        error_line(e)
        return e.exit_code
    except KeyboardInterrupt:
        print("stride: interrupted before any trial started", file=sys.stderr)
        return 128 + signal.SIGINT
    return run_sweep(sweep, cfg, specs, facts, state, concurrency, num_workers, use_gpu, args.retry_failed, args.verbose, t_start)


def check_resumable(sweep: Sweep, sweep_dir: Path) -> dict[str, Any] | None:
    """The state of an earlier start of this sweep, if any; a restorable sweep started with other settings is
    refused (Tune would resume the old trials and silently ignore the new space)."""
    from ray.tune import Tuner

    from stride.errors import UsageError

    state = read_state(sweep_dir)
    identity = json.loads(json.dumps(sweep.identity()))  # as it reads back from the state file
    if state is None or state.get("identity") == identity:
        return state
    if Tuner.can_restore(sweep.storage):
        diff = first_difference(identity, state.get("identity") or {})
        raise UsageError(f"{sweep.storage} holds a sweep started with different settings: {diff}; rerun with the "
                         f"original settings to resume it, or use a new sweep.name")
    return None  # never got as far as a Tune experiment: start afresh


def run_sweep(sweep: Sweep, cfg: Config, specs: dict, facts: dict, state: dict | None, concurrency: int, num_workers: int,
              use_gpu: bool, retry_failed: bool, verbose: bool, t_start: float) -> int:
    import logging

    from ray import tune

    from stride.trainers import sinks
    from stride.trainers.run.folder import atomic_write_text
    from stride.tune.trial import run_trial

    # Study creation lines are noise next to one line per trial result (a tracker quiets its own: open_sweep).
    if sweep.sweep.search == "optuna":
        import optuna

        optuna.logging.set_verbosity(optuna.logging.WARNING)
    sweep_dir = sweep.sweep_dir
    restore = tune.Tuner.can_restore(sweep.storage)
    info = sweep_info(sweep, cfg)
    # Each tracker opens the sweep's record (MLflow: the parent run, the same one on a resume); the others none.
    tracked, sink_options = sinks.open_sweep(info, state or {})
    atomic_write_text(sweep_dir / STATE, json.dumps({"identity": sweep.identity(), **tracked}, indent=1) + "\n")
    sweep.files.push(STATE)
    train_rows = specs["train"].num_rows
    max_t = max_steps_of_sweep(sweep, train_rows, num_workers)
    print(f"stride: sweep {sweep.sweep.name}: {sweep.num_trials()} trial(s), {min(concurrency, sweep.num_trials())} at a time "
          f"({num_workers} {'GPU' if use_gpu else 'CPU'} worker(s) each), search {sweep.sweep.search}, "
          f"scheduler {sweep.sweep.scheduler}, {sweep.sweep.mode} {sweep.sweep.metric}"
          + (" - resuming" if restore else ""), flush=True)
    trainable = tune.with_resources(
        tune.with_parameters(run_trial, sweep=sweep, specs=specs, facts=facts, sink_options=sink_options),
        TRIAL_RESOURCES)
    logging.getLogger("ray.tune").setLevel(logging.ERROR)  # Stride prints the trials; Tune's tables are off
    if not verbose:
        route_worker_logs(sweep_dir / WORKER_LOG)
    signals = install_sigterm()
    tuner = build_tuner(sweep, trainable, concurrency, max_t, restore, retry_failed)
    try:
        results = tuner.fit()
    finally:  # the events of an interrupted sweep reach the bucket too
        sweep.files.flush()
        sweep.files.push(EVENTS)

    trials = collect_trials(sweep, results, train_rows, num_workers)
    best, complete = outcome(trials, sweep.num_trials())
    where = sinks.close_sweep(info, tracked, trials, best, complete)  # their fields join the trials' rows
    summary = {
        "sweep": sweep.sweep.name, "status": "completed" if complete else "interrupted",
        "metric": sweep.sweep.metric, "mode": sweep.sweep.mode,
        "best_trial_id": best["trial_id"] if best else None, "best_config": best["params"] if best else None,
        "best_metric": best["metric"] if best else None,
        **tracked,
        "max_concurrent_trials": concurrency, "workers_per_trial": num_workers, "wall_s": time.time() - t_start,
        "config": {"sweep": sweep.sweep.model_dump(mode="json"), "base": sweep.base,
                   "space": {d.key: d.describe() for d in sweep.dims}, "base_config": str(sweep.base_config_path)},
        "trials": trials,
    }
    atomic_write_text(sweep_dir / SUMMARY, json.dumps(summary, indent=1, default=str) + "\n")
    for name in (WORKER_LOG, SUMMARY):  # the summary last: the sweep's own record
        sweep.files.push(name)
    sweep.files.drop_local()

    print_table(trials, sweep.sweep.metric)
    counts = ", ".join(f"{sum(t['status'] == s for t in trials)} {s}" for s in
                       ("completed", "early_stopped", "failed", "interrupted", "pending") if any(t["status"] == s for t in trials))
    print(f"stride: {len(trials)} trial(s): {counts}")
    if best:
        shown = " ".join(f"{k}={json.dumps(v) if isinstance(v, (list, dict)) else v}" for k, v in best["params"].items())
        print(f"stride: best {sweep.sweep.metric} {best['metric']:.4g} (trial {best['trial_id']}): {shown}")
    print(f"stride: summary     {sweep.files.describe(SUMMARY)}")
    for line in where:
        print(f"stride: {line}")
    if not complete:
        print("stride: interrupted; run the same command again to resume the sweep", file=sys.stderr)
    return exit_code(trials, complete, signals)

if __name__ == "__main__":
    sys.exit(main())
