"""Evidence behind the figures of `make bench`: where Stride's extra time goes. Not part of `make bench`.

    python benchmarks/evidence.py [--only costs,costs_big,ingest,driver,cluster,stacks] [--out benchmarks/results]

* costs  (one embedded Ray, a 2-worker TorchTrainer with the default job's model, DDP and AdamW state): seconds per
  call of what the loop does on a log step and on a checkpoint, each repeated and interleaved:
  `ray.train.report(metrics)` (Stride's per-log-step report) vs `dist.barrier()` (torchrun's report) vs a
  1-element all_reduce; and a checkpoint's blocking parts as trainers/loop.py and trainers/ray_worker.py do them
  (checkpointing.stage, ray.train.report(..., ASYNC) returning) vs its whole write
  (checkpointing.save + persist, in Ray's upload thread). costs_big: the same with a ~7M-parameter char_gpt.
* stacks (py-spy): rank 0 of `python trainers/main.py` and of `torchrun ... trainers/torchrun.py` (same job as
  make bench, longer), sampled during steady-state training; the share of samples by activity.
  Also the cores used by every process of the job's tree (Ray's daemons and actors included) and by the whole
  machine; with --stride-env KEY=VALUE a third, variant Stride run.
* ingest (cProfile): one epoch of the loop's stream (datasets/stream.py TrainStream) over a generated tabular set,
  top functions by cumulative time.
* driver (py-spy, idle included): a whole `python trainers/main.py` run, the driver's wall time by phase.
* cluster: the make-bench job on an already running local head (stride.ray_cluster.local) vs embedded Ray vs
  torchrun.

Writes <out>/evidence-<YYYY-MM-DDTHHMM>.json and prints a summary. Temporary storage only.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
    sys.path.pop(0)
sys.path.insert(0, str(REPO))
sys.path.insert(1, str(REPO / "benchmarks"))

PY = sys.executable
CONFIG = "trainers/configs/char_gpt.yaml"


# ------------------------------------------------------------------ costs

def _by_value() -> None:
    """The loops below run on Ray workers, which cannot import this file: ship them by value."""
    import ray.cloudpickle

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


def costs_loop(config: dict) -> dict:
    import tempfile as tf

    import ray.train
    import ray.train.torch
    import torch
    import torch.distributed as dist
    from ray.train import CheckpointUploadMode

    from stride.trainers import checkpointing
    from stride.trainers.config import from_dict
    from stride.trainers.step import Precision, build_optimizer, train_step
    from stride.trainers.tasks import make_task

    cfg = from_dict(config["cfg"])
    torch.set_num_threads(1)
    rank = ray.train.get_context().get_world_rank()
    W = ray.train.get_context().get_world_size()
    torch.manual_seed(0)
    task = make_task(cfg)  # char_gpt: needs no facts from the data
    model = ray.train.torch.prepare_model(task.build_model())
    raw = model.module
    opt = build_optimizer(cfg, raw, W)
    prec = Precision.create("fp32", torch.device("cpu"))
    scaler = prec.grad_scaler()
    tokens = torch.randint(0, 256, (cfg.train.batch_size_per_worker, cfg.model.context + 1))
    # One micro-batch as the loop builds it: the task's transform of the rows, as tensors.
    batch = {k: torch.from_numpy(v) for k, v in task.transform({"tokens": tokens.numpy()}).items()}
    for _ in range(2):  # AdamW state exists, as in a real checkpoint
        train_step(task.loss, model, opt, scaler, prec, [batch], 1.0)
    n = config["n"]
    t = collections.defaultdict(list)

    def timed(key, fn):
        t0 = time.perf_counter()
        r = fn()
        t[key].append(time.perf_counter() - t0)
        return r

    def step():
        train_step(task.loss, model, opt, scaler, prec, [batch], 1.0)

    for i in range(n):
        # A training step before each call, as in the loop: Ray's result queue holds one report and the controller
        # drains it every RAY_TRAIN_HEALTH_CHECK_INTERVAL_S, so back-to-back reports would measure that poll.
        step()
        timed("report_metrics_s", lambda: ray.train.report({"step": i, "train_loss": 1.0}))
        step()
        timed("gloo_barrier_s", lambda: dist.barrier())
        step()
        one = torch.zeros(4, dtype=torch.float64)
        timed("all_reduce_4_floats_s", lambda: dist.all_reduce(one))
    for i in range(n):  # back to back: the poll interval shows
        timed("report_metrics_back_to_back_s", lambda: ray.train.report({"step": 100 + i, "train_loss": 1.0}))
    storage = ray.train.get_context().get_storage()
    writes: list[float] = []
    for i in range(config["checkpoints"]):
        dist.barrier()
        t0 = time.perf_counter()
        if rank == 0:
            folder = Path(tf.mkdtemp(prefix="stride-prof-ckpt-"))
            state = timed("ckpt_stage_s", lambda: checkpointing.stage(
                {"model": raw.state_dict(), "optimizer": opt.state_dict()}))
            meta = {"step": i}

            def upload(checkpoint, dir_name, state=state, folder=folder, meta=meta):
                w0 = time.perf_counter()
                checkpointing.save(folder, state, meta)
                persisted = storage.persist_current_checkpoint(checkpoint, dir_name)
                writes.append(time.perf_counter() - w0)
                return persisted

            timed("ckpt_report_call_s", lambda: ray.train.report(
                {"step": 1000 + i}, checkpoint=ray.train.Checkpoint.from_directory(str(folder)),
                checkpoint_upload_mode=CheckpointUploadMode.ASYNC, delete_local_checkpoint_after_upload=True,
                checkpoint_upload_fn=upload))
        else:
            timed("ckpt_report_call_s", lambda: ray.train.report({"step": 1000 + i}))
        t["ckpt_blocked_s"].append(time.perf_counter() - t0)
        # Let the write finish before the next one, and time how long a step takes while it runs.
        s0 = time.perf_counter()
        train_step(task.loss, model, opt, scaler, prec, [batch], 1.0)
        t["step_during_write_s"].append(time.perf_counter() - s0)
        deadline = time.time() + 60
        while rank == 0 and len(writes) < i + 1 and time.time() < deadline:
            time.sleep(0.01)
        s0 = time.perf_counter()
        train_step(task.loss, model, opt, scaler, prec, [batch], 1.0)
        t["step_quiet_s"].append(time.perf_counter() - s0)
    if rank == 0:
        t["ckpt_write_s"] = writes
    return {"rank": rank, "seconds": dict(t)} if rank == 0 else {}


def run_costs_big(tmp: Path) -> dict:
    """The same, with a bigger char_gpt (width 384, 4 layers: ~7M parameters, an ~85 MB checkpoint)."""
    return run_costs(tmp, ["model.width=384", "model.n_layers=4"], name="costs_big")


def run_costs(tmp: Path, overrides: list[str] | None = None, name: str = "costs") -> dict:
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from stride.ray_cluster.connect import init_ray, quiet_ray_env
    from stride.trainers.config import load_config

    cfg = load_config(CONFIG, overrides or [])
    _by_value()
    quiet_ray_env()
    init_ray(log_to_driver=False)
    trainer = TorchTrainer(costs_loop, train_loop_config={"cfg": cfg.to_dict(), "n": 15, "checkpoints": 5},
                           scaling_config=ScalingConfig(num_workers=2, resources_per_worker={"CPU": 1.0}),
                           run_config=RunConfig(name=name, storage_path=str(tmp / name)))
    out = trainer.fit().return_value["seconds"]
    import ray

    ray.shutdown()
    return {k: {"median": statistics.median(v), "min": min(v), "max": max(v), "n": len(v)} for k, v in out.items() if v}


# ------------------------------------------------------------------ stacks

CATEGORIES = [  # first match wins, tested against the whole collapsed stack (outermost first)
    # Trainer.checkpoint (trainers/loop.py) stages the state; Ray's upload thread writes it (checkpointing.save)
    ("checkpoint", re.compile(r"save_checkpoint|checkpointing\.py|_upload_checkpoint|\bcheckpoint \(")),
    ("report (ray.train.report / torchrun barrier)", re.compile(r"\breport \(|train_fn_utils|_sync_checkpoint_dir_name|torchrun\.py\)?;?.*barrier")),
    ("metrics (MLflow, all-reduce of figures, jsonl)", re.compile(r"log_metrics|tracking\.py|all_reduce_mean_many|MetricsFile|record_metrics|sinks\.py|log_figures \(")),
    ("stop check (all-reduce per step)", re.compile(r"requested \(")),
    ("optimizer step", re.compile(r"optimizer\.step|adamw|_multi_tensor_adam|_single_tensor_adam|clip_grad_norm")),
    ("backward + DDP all-reduce", re.compile(r"backward|_engine_run_backward")),
    ("forward", re.compile(r"forward|loss_fn|\bloss \(")),  # Task.loss: the model's forward and the loss
    ("batch (data)", re.compile(r"_to_batch|order\.py|rows \(|micro_batches \(|to_device \(|transform \(")),
    ("train_step other", re.compile(r"train_step")),
]


def _label(pid: int) -> str:
    try:
        argv = [a.decode(errors="replace") for a in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0") if a]
    except OSError:
        return "?"
    if not argv:
        return "?"
    if argv[0].startswith("ray::"):
        return argv[0].split()[0]
    if argv[0].startswith("ray-dashboard-") or "multiprocessing.forkserver" in " ".join(argv):
        return "dashboard head modules"
    if not Path(argv[0]).name.startswith("python"):
        return Path(argv[0]).name.split()[0]  # raylet, gcs_server, torchrun
    for i, a in enumerate(argv[1:], 1):
        if a == "-m" and i + 1 < len(argv):
            return argv[i + 1]
        if a == "-c":
            return "python -c"
        if a.endswith(".py"):
            return Path(a).name
    return "python"


def _cpu_seconds(pids) -> dict[int, float]:
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for pid in pids:
        try:
            f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            out[pid] = (int(f[11]) + int(f[12])) / tick
        except (OSError, IndexError, ValueError):
            pass
    return out


def _machine_busy() -> tuple[float, float]:
    f = [float(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = f[3] + f[4]
    return sum(f) - idle, sum(f)


def tree_cpu(root: int, seconds: float) -> dict[str, float]:
    """Cores used by each kind of process in the tree below `root` (and root) over `seconds`, and by the whole
    machine (every process, other users' included)."""
    from run import descendants

    pids = [root, *descendants(root)]
    labels = {p: _label(p) for p in pids}
    a, ma = _cpu_seconds(pids), _machine_busy()
    time.sleep(seconds)
    b, mb = _cpu_seconds(pids), _machine_busy()
    by = collections.Counter()
    for p in a:
        if p in b:
            by[labels[p]] += (b[p] - a[p]) / seconds
    out = {k: round(v, 3) for k, v in by.most_common() if v > 0}
    out["(this job, total)"] = round(sum(by.values()), 3)
    out["(whole machine)"] = round((mb[0] - ma[0]) / (mb[1] - ma[1]) * (os.cpu_count() or 1), 3)
    return out


def rank0_pid(sample_log: Path) -> int | None:
    """The process that holds rank 0's sample log open (works for both runtimes)."""
    target = str(sample_log / "rank0.jsonl")
    for fd_dir in Path("/proc").glob("[0-9]*/fd"):
        try:
            for fd in fd_dir.iterdir():
                try:
                    if os.readlink(fd) == target:
                        return int(fd_dir.parent.name)
                except OSError:
                    continue
        except OSError:
            continue
    return None


def sample_stacks(runtime: str, tmp: Path, steps: int, duration_s: int, extra_env: dict | None = None,
                  tag: str | None = None) -> dict:
    from run import clean_env, descendants, free_port, kill_exact

    tag = tag or runtime
    storage = tmp / f"stacks_{tag}"
    storage.mkdir(parents=True)
    over = [f"run.name=p", f"run.storage_path={storage}", f"train.max_steps={steps}", "train.log_every_steps=5",
            f"train.eval_every_steps={steps}", f"checkpoint.every_steps={steps}", "data.val_path=null",
            f"tracking.mlflow_uri=sqlite:///{storage / 'mlflow.db'}"]
    if runtime == "stride":
        cmd = [PY, "trainers/main.py", "--config", CONFIG, *over]
    else:
        cmd = [str(Path(PY).parent / "torchrun"), "--nproc-per-node", "2", "--master-port", str(free_port()),
               "trainers/torchrun.py", "--config", CONFIG, *over]
    env = dict(clean_env(), **(extra_env or {}))
    env["STRIDE_SAMPLE_LOG"] = str(storage / "samples")
    log = open(tmp / f"stacks_{tag}.log", "w")
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    seen = {}
    try:
        # Wait for 15 steps (past warm-up), then sample rank 0.
        samples = storage / "samples" / "rank0.jsonl"
        deadline = time.time() + 600
        while time.time() < deadline and proc.poll() is None:
            seen.update(descendants(proc.pid))
            if samples.exists() and samples.read_bytes().count(b"\n") >= 15:
                break
            time.sleep(0.5)
        pid = rank0_pid(storage / "samples")
        if pid is None:
            raise RuntimeError(f"no rank 0 process found for {runtime}")
        raw = tmp / f"stacks_{tag}.txt"
        spy = str(Path(PY).parent / "py-spy")
        cores = tree_cpu(proc.pid, 8.0)  # before py-spy, so its own sampling is not counted against anyone
        subprocess.run([spy, "record", "--pid", str(pid), "--duration", str(duration_s), "--rate", "100", "--format", "raw",
                        "--output", str(raw), "--nonblocking"], check=True, capture_output=True, timeout=duration_s + 60)
        proc.wait(timeout=600)
    finally:
        seen.update(descendants(proc.pid))
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
        time.sleep(2)
        kill_exact(seen)
        log.close()
    counts = collections.Counter()
    top = collections.Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if not n.isdigit():
            continue
        n = int(n)
        if "run (" not in stack and "loop.py" not in stack:
            continue  # other threads (Ray's, upload): counted apart
        total += n
        cat = next((name for name, rx in CATEGORIES if rx.search(stack)), "other")
        counts[cat] += n
        leaf = stack.split(";")[-1]
        top[leaf] += n
    lines = [json.loads(x) for x in (storage / "p" / "metrics.jsonl").read_text().splitlines() if '"train_loss"' in x]
    steady = [x["step_time_s"] for x in lines if x["step"] > 15 and x["step"] < steps]
    return {"steady_step_time_s": statistics.median(steady) if steady else None,
            "pid_sampled": "rank 0", "cores_by_process_during_training": cores,
            "samples_in_training_thread": total,
            # py-spy leaves out samples where the thread sleeps (a collective waiting for the other rank, I/O)
            "training_thread_active_fraction": total / (duration_s * 100),
            "share": {k: v / total for k, v in counts.most_common()} if total else {},
            "top_leaf_frames": [(k, v / total) for k, v in top.most_common(12)] if total else []}


# ------------------------------------------------------------------ ingest

def run_ingest(tmp: Path, rows: int) -> dict:
    """cProfile of one epoch of the loop's stream (datasets/stream.py) over a generated tabular set, one worker."""
    import cProfile
    import io
    import pstats

    from stride.datasets.order import Order
    from stride.datasets.stream import TrainStream
    from stride.trainers.config import load_config
    from stride.trainers.driver import prepare

    data = tmp / "ingest_tabular"
    subprocess.run([PY, "datasets/prepare.py", "tabular", "--out", str(data), "--rows", str(rows), "--features", "32",
                    "--classes", "4", "--seed", "0"], cwd=REPO, check=True, capture_output=True)
    cfg = load_config(REPO / "trainers/configs/tabular_mlp.yaml", [f"data.train_path={data / 'train'}", "data.val_path=null"])
    spec = prepare(cfg)[1]["train"]
    order = Order(tuple(n for _, _, n in spec.blocks), 0, cfg.train.batch_size_per_worker, cfg.data.shuffle_window_rows)
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    stream = TrainStream(spec, order, 0, 1, 0, cfg.data.read_ahead_windows, end_micro_step=order.micro_steps_per_epoch)
    n = sum(len(stream.next()) for _ in range(order.micro_steps_per_epoch))
    stream.close()
    prof.disable()
    wall = time.perf_counter() - t0
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(25)
    return {"rows": n, "batches": order.micro_steps_per_epoch, "wall_s": wall, "cprofile_top25_cumulative": text.getvalue()}


# ------------------------------------------------------------------ driver (startup and shutdown)

DRIVER_PHASES = [  # first match wins, against the main thread's stack (outermost first)
    ("ray.init (embedded cluster start)", re.compile(r"init_ray \(")),
    # train_on_ray (trainers/driver.py) is what trainers/main.py's fit was: build the trainer, fit, the summary
    ("trainer.fit (controller, worker group, training)", re.compile(r"\bfit \(ray/train|fit \(trainers/main.py|train_on_ray \(")),
    ("building the trainer", re.compile(r"build_trainer \(")),
    ("config, data check, checkpoint check", re.compile(r"load_config|prepare \(|inspect \(|check_resume|check_storage")),
    ("imports", re.compile(r"<module> \(|_find_and_load")),
]


def run_driver(tmp: Path, steps: int = 20) -> dict:
    """py-spy (idle included, so waiting counts) over a whole `python trainers/main.py` run: where the driver's
    wall time goes, by phase. Also times the driver's Ray Data read against pyarrow + ray.data.from_arrow."""
    from run import clean_env, descendants, kill_exact

    storage = tmp / "driver"
    storage.mkdir(parents=True)
    raw = tmp / "driver_stacks.txt"
    spy = str(Path(PY).parent / "py-spy")
    over = ["run.name=d", f"run.storage_path={storage}", f"train.max_steps={steps}", "train.log_every_steps=5",
            f"train.eval_every_steps={steps}", f"checkpoint.every_steps={steps}", "data.val_path=null",
            f"tracking.mlflow_uri=sqlite:///{storage / 'mlflow.db'}"]
    t0 = time.perf_counter()
    proc = subprocess.Popen([spy, "record", "--idle", "--rate", "50", "--format", "raw", "--output", str(raw), "--",
                             PY, "trainers/main.py", "--config", CONFIG, *over], cwd=REPO, env=clean_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    seen = {}
    while proc.poll() is None:
        seen.update(descendants(proc.pid))
        time.sleep(1)
    wall = time.perf_counter() - t0
    kill_exact(seen)
    counts = collections.Counter()
    for line in raw.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if not n.isdigit() or "Thread._bootstrap" in stack:
            continue  # other threads
        if not stack.startswith("<module> (trainers/main.py"):
            # after main() returned: atexit handlers (ray.shutdown, MLflow's) and joining non-daemon threads
            leaf = stack.split(";")[0]
            counts[f"interpreter exit: {leaf.split(' (')[0]}"] += int(n)
            continue
        counts[next((name for name, rx in DRIVER_PHASES if rx.search(stack)), "other")] += int(n)
    total = sum(counts.values())
    return {"wall_s": wall, "seconds_by_phase": {k: round(v / 50, 2) for k, v in counts.most_common()},
            "main_thread_samples": total}


def run_cluster(tmp: Path, reps: int = 2) -> dict:
    """The make-bench job (quick) on an already running local head (stride.ray_cluster.local, token auth) vs embedded
    Ray vs torchrun, alternating: how much of Stride's wall time is starting and stopping Ray itself."""
    from run import MODES, free_port, launch, phases, read_jsonl, steady
    from run import job_overrides as over

    from stride.ray_cluster.local import start_head, stop_head

    mode = MODES["quick"]
    head_dir = Path(tempfile.mkdtemp(prefix="sb-", dir="/tmp"))
    head = start_head(head_dir, port=free_port(), dashboard_port=free_port())
    out: dict = {"runs": []}
    try:
        from run import clean_env

        for rep in range(reps):
            for kind in ("torchrun", "stride_on_running_head", "stride_embedded"):
                storage = tmp / f"cl_{kind}_{rep}"
                storage.mkdir(parents=True)
                env = clean_env()
                if kind == "torchrun":
                    cmd = [str(Path(PY).parent / "torchrun"), "--nproc-per-node", "2", "--master-port", str(free_port()),
                           "trainers/torchrun.py", "--config", CONFIG, *over(mode, storage, "bench")]
                else:
                    cmd = [PY, "trainers/main.py", "--config", CONFIG, *over(mode, storage, "bench")]
                    if kind == "stride_on_running_head":
                        env.update(head.client_env())
                r = launch(cmd, tmp / f"cl_{kind}_{rep}.log", mode.timeout_s, sample_log=storage / "samples", env=env)
                lines = read_jsonl(storage / "bench" / "metrics.jsonl")
                st = steady(lines, mode.warmup_steps, [mode.ckpt_every])
                out["runs"].append({"kind": kind, "rep": rep, "rc": r.rc, "wall_s": r.wall_s,
                                    "time_to_first_step_s": r.first_step_s,
                                    "phases_s": phases("torchrun" if kind == "torchrun" else "stride", r.lines,
                                                       r.first_step_s, r.wall_s, mode.steps),
                                    "step_time_s": statistics.median([x["step_time_s"] for x in st]) if st else None})
    finally:
        stop_head(head)
        shutil.rmtree(head_dir, ignore_errors=True)
    for kind in ("torchrun", "stride_on_running_head", "stride_embedded"):
        runs = [r for r in out["runs"] if r["kind"] == kind]
        out[kind] = {k: statistics.median([r[k] for r in runs if r[k] is not None])
                     for k in ("wall_s", "time_to_first_step_s", "step_time_s")}
        out[kind]["phases_s"] = {k: statistics.median([r["phases_s"][k] for r in runs if r["phases_s"].get(k) is not None]
                                                      or [float("nan")]) for k in runs[0]["phases_s"]}
    return out


def summary(result: dict) -> str:
    out = [f"load average {result['loadavg_start'][0]:.2f} -> {result['loadavg_end'][0]:.2f} on {result['cpu_count']} CPUs"]
    for part in ("costs", "costs_big"):
        if part in result:
            out.append(f"{part} (ms, median [min..max]):")
            out += [f"  {k:32s} {v['median'] * 1e3:9.2f} [{v['min'] * 1e3:.2f}..{v['max'] * 1e3:.2f}] n={v['n']}"
                    for k, v in result[part].items()]
    if "driver" in result:
        out.append(f"driver wall {result['driver']['wall_s']:.1f}s by phase: " + ", ".join(
            f"{k} {v:.1f}" for k, v in result["driver"]["seconds_by_phase"].items()))
    if "ingest" in result:
        i = result["ingest"]
        out.append(f"ingest: one epoch of the stream {i['wall_s']:.3f}s for {i['rows']} rows in {i['batches']} batch(es)")
        out.append(i["cprofile_top25_cumulative"])
    if "cluster" in result:
        for kind in ("torchrun", "stride_on_running_head", "stride_embedded"):
            v = result["cluster"][kind]
            out.append(f"cluster {kind}: wall {v['wall_s']:.1f}s, first step {v['time_to_first_step_s']:.1f}s, "
                       f"steady step {v['step_time_s']:.3f}s; phases ended at " + ", ".join(
                           f"{k} {t:.1f}" for k, t in v["phases_s"].items() if t == t))
    for rt, st in result.get("stacks", {}).items():
        out.append(f"stacks {rt}: steady step {st['steady_step_time_s']}; training thread active "
                   f"{st['training_thread_active_fraction']:.2f}")
        out.append("  cores: " + ", ".join(f"{k} {v}" for k, v in st["cores_by_process_during_training"].items()))
        out.append("  share: " + ", ".join(f"{k} {v:.3f}" for k, v in st["share"].items()))
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default="costs,costs_big,ingest,driver,cluster,stacks")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    ap.add_argument("--steps", type=int, default=200, help="steps of the sampled runs (stacks)")
    ap.add_argument("--duration", type=int, default=20, help="py-spy seconds per runtime (stacks)")
    ap.add_argument("--ingest-rows", type=int, default=400_000)
    ap.add_argument("--stride-env", action="append", default=[], metavar="KEY=VALUE",
                    help="stacks: also sample a Stride run with this environment (e.g. RAY_TRAIN_HEALTH_CHECK_INTERVAL_S=1)")
    args = ap.parse_args()
    only = set(args.only.split(","))
    tmp = Path(tempfile.mkdtemp(prefix="stride-profile-"))
    started = datetime.now()
    result: dict = {"started": started.isoformat(timespec="seconds"), "cpu_count": os.cpu_count(),
                    "loadavg_start": os.getloadavg()}
    try:
        # Each part in its own process, so that every embedded Ray starts and ends cleanly.
        for part in ("costs", "costs_big", "ingest", "driver", "cluster", "stacks"):
            if part not in only:
                continue
            if part == "stacks":
                result["stacks"] = {rt: sample_stacks(rt, tmp, args.steps, args.duration) for rt in ("torchrun", "stride")}
                if args.stride_env:
                    extra = dict(kv.split("=", 1) for kv in args.stride_env)
                    result["stacks"]["stride " + " ".join(args.stride_env)] = sample_stacks(
                        "stride", tmp, args.steps, args.duration, extra, tag="stride_variant")
            else:
                out = tmp / f"{part}.json"
                code = (f"import json,sys; sys.argv=['x']; import evidence as p; from pathlib import Path; "
                        f"r = p.run_{part}(Path({str(tmp)!r})" + (f", {args.ingest_rows})" if part == "ingest" else ")")
                        + f"; Path({str(out)!r}).write_text(json.dumps(r, default=str))")
                env = dict(os.environ, PYTHONPATH=f"{REPO}:{REPO / 'benchmarks'}")
                env.pop("RAY_ADDRESS", None)
                r = subprocess.run([PY, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=1200)
                if r.returncode != 0:
                    raise RuntimeError(f"{part} failed:\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}")
                result[part] = json.loads(out.read_text())
            print(f"evidence: {part} done", flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    result["loadavg_end"] = os.getloadavg()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"evidence-{started.strftime('%Y-%m-%dT%H%M')}.json"
    path.write_text(json.dumps(result, indent=1, default=str) + "\n")
    print(summary(result))
    print(f"evidence: wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
