"""`make bench`: Stride beside torchrun, ingest, scaling, checkpoints, memory, activation checkpointing, compile,
fine-tuning, files by reference, length bucketing, metric sinks and EMA, the commands, runs on a bucket, hybrid
sharding.

    python benchmarks/run.py --quick            # make bench: 5 repetitions of every measurement
    python benchmarks/run.py --full             # 5 repetitions of longer jobs and a bigger ingest set
    python benchmarks/run.py --smoke --out DIR  # one tiny repetition: a check that every part runs (no verdicts)
    python benchmarks/run.py --render           # rewrite the READMEs' generated blocks from results/latest.json
    python benchmarks/run.py --only lock        # measure one part again, into results/latest.json's other figures
    python benchmarks/run.py --only finetune    # the same, the fine-tuning part
    python benchmarks/run.py --only ingest      # the same, ingest (Parquet and JSON Lines; no scaling fits)
    python benchmarks/run.py --only memory      # the same, stream_memory.py (Parquet and JSON Lines)
    python benchmarks/run.py --only file_read   # the same, file_read_bench.py (files by reference)
    python benchmarks/run.py --only bucketing   # the same, bucketing_bench.py (data.length_column)
    python benchmarks/run.py --only sinks       # the same, sinks_bench.py (tracking.sinks, train.ema)
    python benchmarks/run.py --only commands    # the same, commands_bench.py (stride predict, time to the first step)
    python benchmarks/run.py --only bucket      # the same, bucket_bench.py (a run on s3:// beside one in a folder)
    python benchmarks/run.py --only hsdp        # the same, hsdp_bench.py (train.strategy hsdp beside ddp and fsdp)

Every figure is a ratio (or a time) measured side by side, in one process tree on this machine, and repeated. The
JSON holds the raw runs ("raw": every run's metrics.jsonl lines, times, memory peaks), and the figures, verdicts
and table that benchmarks/figures.py computes from them alone (tests/test_bench.py recomputes them from the
stored raw runs). A figure passes or fails on the median of at least 5 samples. Results: <out>/latest.json
(default out: benchmarks/results; earlier runs are in git's history), and with the default out the generated
blocks of benchmarks/README.md and README.md are rewritten from it. Every part records its own run header
(benchmarks/report.py run_header: start, machine, CPU, commit and uncommitted paths, load averages, duration) in
raw["headers"]; --only replaces only its part's. The READMEs show each figure's, and mark it stale where the code
its part measures (benchmarks/figures.py PARTS) changed since its commit (git, at --render).

What runs (each launch is a fresh process tree; temporary storage only, never the repo's runs/ or data/):
1. pairs, `reps` times, order alternating: `torchrun --nproc-per-node 2 trainers/torchrun.py` and
   `python trainers/main.py` (embedded Ray, 2 CPU workers), same config, same data, same loop:
   -> step_time_ratio, wall_ratio, time_to_first_step_s, data_wait_fraction, ckpt_blocked_fraction
2. benchmarks/ray_bench.py (one embedded Ray): ingest from the files through Stride's streaming path vs pyarrow,
   with the same number of threads, of a Parquet set and of its JSON Lines copy (benchmarks/jsonl_copy.py)
   (-> ingest_ratio, jsonl_ingest_ratio), then Stride fits with 1 and 2 workers, alternating, `reps` times
   (-> scaling_2_over_1).
3. benchmarks/stream_memory.py: peak memory of one epoch over ~1 GB vs ~50 MB of Parquet, and over JSON Lines
   copies of the same sets, `reps` times (-> memory_growth_ratio, jsonl_memory_growth_ratio).
4. benchmarks/checkpoint_bench.py: a 2-worker FSDP char_gpt checkpointed with the earlier rank-0 gather and with DCP
   shards, alternating, `reps` times (-> checkpoint_rank0_memory_ratio, checkpoint_blocked_ratio).
5. benchmarks/blocks_bench.py: train.activation_checkpointing and train.compile on and off, one CPU worker, `reps`
   times (-> ac_memory_ratio, ac_step_time_ratio, compile_step_time_ratio).
6. benchmarks/lock_bench.py: a training loop in this process with the run lock's fence and heartbeat and without,
   interleaved, `reps` times (-> lock_overhead_ratio).
7. benchmarks/finetune_bench.py: init.from of a 302M-parameter safetensors file into 2 FSDP and 2 DDP ranks (fresh
   process pairs, alternating), a step with half the blocks frozen and all trainable (2 DDP ranks, interleaved), and
   init.from's load beside safetensors' load_file (one process, alternating), `reps` times (-> init_peak_memory_ratio,
   init_peak_memory_ratio_ddp, frozen_step_time_ratio, init_load_ratio).
8. benchmarks/file_read_bench.py: one epoch of Stride's stream over 20,000 files named in a JSON Lines manifest beside
   a thread pool reading the same files, 16 threads each, warm page cache, alternating, `reps` times
   (-> file_read_ratio).
9. benchmarks/bucketing_bench.py: one epoch of a small transformer over sequences of log-uniform lengths with
   data.length_column bucketing and without, alternating, `reps` times (-> bucketing_padding_ratio,
   bucketing_step_time_ratio).
10. benchmarks/sinks_bench.py: tabular_mlp with every tracker on (MLflow, TensorBoard, W&B offline) and with
   metrics.jsonl alone, and an MLP under FSDP on 2 ranks with train.ema on and off, alternating, `reps` times
   (-> sink_overhead_ratio, ema_step_time_ratio).
11. benchmarks/commands_bench.py: `stride predict` on 2 CPU workers beside a hand-written no_grad loop on 2
   processes over the same Parquet, and the seconds from the launch to the first step of `stride train` (embedded
   Ray; joining a running head) and of torchrun, alternating, `reps` times (-> predict_throughput_ratio,
   time_to_first_step_ratio, time_to_first_step_on_head_ratio).
12. benchmarks/bucket_bench.py: the same torchrun job (tabular_mlp made wide, 2 CPU ranks) with run.storage_path a
   folder and s3:// on a local S3-compatible server (tests/s3_server.py's moto_server), trained and then resumed,
   alternating, `reps` times (-> bucket_checkpoint_blocked_ratio, bucket_step_time_ratio, bucket_resume_ratio).
13. benchmarks/hsdp_bench.py: a 50.6M-parameter char_gpt on 4 CPU ranks (one torchrun launch) under ddp, fsdp and
   hsdp (shard groups {0, 1} and {2, 3}), `reps` measured steps each: the bytes each rank holds, and those its
   collectives send outside its shard group (-> hsdp_param_memory_ratio, hsdp_cross_group_bytes_ratio).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # `python benchmarks/run.py` puts only benchmarks/ on the path
PY = sys.executable

from benchmarks.figures import BLOCKS, PARTS, block, ckpt_steps, part_headers, replay, run_stats, with_block  # noqa: E402
from benchmarks.report import changed_since, run_header, stale_parts  # noqa: E402
from benchmarks.procs import launch, read_jsonl  # noqa: E402

CONFIG = "trainers/configs/char_gpt.yaml"
RESULTS = REPO / "benchmarks" / "results"
# stream_memory.py's runs may take this many times a mode's timeout_s: the large set's JSON Lines run parses ~4 GB of
# JSON on the driver (the task's checks) and in each worker (442 s once here, under load): a run stopped by the
# timeout would leave a lower bound, not a sample.
MEMORY_TIMEOUT_FACTOR = 3


@dataclass(frozen=True)
class Mode:
    reps: int  # repetitions of every measurement: the samples of each figure (a verdict needs 5)
    steps: int  # optimizer steps of the paired job
    log_every: int
    ckpt_every: int  # one or more checkpoints inside the run (plus the final one)
    warmup_steps: int  # log lines at or below this step are warm-up, dropped
    scale_steps: int
    scale_log_every: int
    scale_warmup_steps: int
    ingest_rows: int  # rows of the generated tabular ingest set
    ingest_features: int
    ingest_passes: int
    timeout_s: int  # per launch
    stream_rows: tuple = (200_000, 4_000_000)  # small / large set of benchmarks/stream_memory.py (~50 MB / ~1 GB raw)
    # benchmarks/checkpoint_bench.py's char_gpt (layers, width, heads): the largest that trains on 2 CPU workers here
    # under FSDP (docs/fsdp.md#memory), 302.6M parameters
    ckpt_model: tuple = (24, 1024, 16)
    blocks_steps: int = 6  # benchmarks/blocks_bench.py: timed steps and warm-up steps per variant
    blocks_warmup: int = 2
    tiny_models: bool = False  # blocks_bench's tiny models (a check that it runs)
    lock_chunks: int = 200  # benchmarks/lock_bench.py: interleaved chunk pairs per repetition
    file_read_files: int = 20_000  # benchmarks/file_read_bench.py: referenced files of 16 KiB
    file_read_pairs: int = 3  # alternating pairs of epochs per repetition


MODES = {
    "smoke": Mode(reps=1, steps=12, log_every=3, ckpt_every=6, warmup_steps=3, scale_steps=8, scale_log_every=2,
                  scale_warmup_steps=2, ingest_rows=20_000, ingest_features=16, ingest_passes=3, timeout_s=300,
                  stream_rows=(20_000, 200_000), ckpt_model=(2, 256, 4), blocks_steps=3, blocks_warmup=1,
                  tiny_models=True, lock_chunks=4, file_read_files=512, file_read_pairs=1),
    "quick": Mode(reps=5, steps=40, log_every=5, ckpt_every=20, warmup_steps=10, scale_steps=25, scale_log_every=5,
                  scale_warmup_steps=5, ingest_rows=400_000, ingest_features=32, ingest_passes=9, timeout_s=420),
    "full": Mode(reps=5, steps=200, log_every=10, ckpt_every=100, warmup_steps=20, scale_steps=100, scale_log_every=10,
                 scale_warmup_steps=20, ingest_rows=2_000_000, ingest_features=32, ingest_passes=9, timeout_s=900),
}


# ---------------------------------------------------------------- jobs

PHASES = {  # marker in the job's output -> phase that has ended when it appears (first occurrence)
    "stride": [("ray_init", "stride: Ray dashboard"), ("driver_ready", "stride: training "),
               ("worker_group_started", "Started training worker group"), ("worker_data_loaded", "INFO data: "),
               ("first_log_step", " INFO step ")],
    "torchrun": [("worker_data_loaded", "INFO data: "), ("first_log_step", " INFO step ")],
}


def phase_times(runtime: str, stamped: list[tuple[float, str]], first_step: float | None, wall: float, steps: int) -> dict:
    """Seconds since launch at which each phase ended, from the job's own output lines (first occurrence)."""
    out: dict = {}
    for name, marker in PHASES[runtime]:
        out[name] = next((t for t, line in stamped if marker in line), None)
    out["first_step_done"] = first_step
    out["last_step_logged"] = next((t for t, line in stamped if f" INFO step {steps}/{steps} " in line), None)
    if runtime == "stride":
        out["fit_returned"] = next((t for t, line in stamped if line.startswith("stride: completed")), None)
    out["exit"] = wall
    return out


def default_job_data(tmp: Path) -> Path:
    """The default job's data: the checkout's data/pystdlib if `make train` or `make data` built it (read only),
    else built under `tmp`: a benchmark writes nothing into the checkout but its results."""
    built = REPO / "data" / "pystdlib"
    if (built / "train").exists():
        return built
    print("bench: building the default job's data (datasets/prepare.py pystdlib) in the temporary folder", flush=True)
    subprocess.run([PY, "datasets/prepare.py", "pystdlib", "--out", str(tmp / "pystdlib")], cwd=REPO, check=True,
                   capture_output=True)
    return tmp / "pystdlib"


# ---------------------------------------------------------------- the paired runs

def job_overrides(mode: Mode, storage: Path, name: str, data: Path) -> list[str]:
    # The default job (char_gpt.yaml: 3 layers, width 128, context 64, 32 sequences per worker, AdamW, fp32), shortened;
    # validation off (it would add the same eval time to both sides), MLflow on for both, into the run's own store.
    return [f"run.name={name}", f"run.storage_path={storage}", f"train.max_steps={mode.steps}",
            f"train.log_every_steps={mode.log_every}", f"train.eval_every_steps={mode.steps}",
            f"checkpoint.every_steps={mode.ckpt_every}", f"data.train_path={data / 'train'}", "data.val_path=null",
            f"tracking.mlflow_uri=sqlite:///{storage / 'mlflow.db'}"]


def run_pair_member(runtime: str, rep: int, mode: Mode, tmp: Path, data: Path) -> dict:
    """One run of the pair: its raw record (times, phases, every metrics.jsonl line)."""
    storage = tmp / f"{runtime}_r{rep}"
    storage.mkdir(parents=True)
    name = "bench"
    over = job_overrides(mode, storage, name, data)
    if runtime == "stride":
        cmd = [PY, "trainers/main.py", "--config", CONFIG, *over]
    else:
        torchrun = str(Path(PY).parent / "torchrun")
        cmd = [torchrun, "--standalone", "--nproc-per-node", "2", "trainers/torchrun.py",
               "--config", CONFIG, *over]
    load_before = os.getloadavg()
    r = launch(cmd, tmp / f"{runtime}_r{rep}.log", mode.timeout_s, sample_log=storage / "samples")
    run_dir = storage / name
    summary = json.loads((run_dir / "summary.json").read_text()) if (run_dir / "summary.json").exists() else {}
    out = {"runtime": runtime, "rep": rep, "rc": r.rc, "wall_s": r.wall_s, "time_to_first_step_s": r.first_step_s,
           "phases_s": phase_times(runtime, r.lines, r.first_step_s, r.wall_s, mode.steps),
           "summary": {k: summary.get(k) for k in ("train_wall_s", "wall_s", "status")},
           "loadavg_before": load_before, "loadavg_after": os.getloadavg(), "leftovers_killed": r.leftovers_killed,
           "metrics": read_jsonl(run_dir / "metrics.jsonl")}
    if r.rc != 0:
        out["log_tail"] = Path(r.log).read_text()[-3000:]
    return out


def run_pairs(mode: Mode, tmp: Path, data: Path) -> list[dict]:
    pairs = []
    for rep in range(mode.reps):
        for runtime in (("torchrun", "stride") if rep % 2 == 0 else ("stride", "torchrun")):
            p = run_pair_member(runtime, rep, mode, tmp, data)
            pairs.append(p)
            st = run_stats(p["metrics"], mode.warmup_steps, ckpt_steps(asdict(mode)))
            print(f"bench: rep {rep + 1}/{mode.reps} {runtime:8s} exit {p['rc']} wall {p['wall_s']:.1f}s first step "
                  f"{p['time_to_first_step_s'] or float('nan'):.1f}s steady step {st['step_time_s'] or float('nan'):.3f}s "
                  f"(load {p['loadavg_after'][0]:.1f})", flush=True)
            if p["rc"] != 0:
                raise RuntimeError(f"{runtime} run failed (exit {p['rc']}):\n{p.get('log_tail', '')}")
    return pairs


# ---------------------------------------------------------------- ray_bench (ingest, scaling)

def ingest_sets(mode: Mode, tmp: Path, data: Path) -> tuple[dict, dict]:
    """The ingest sets ray_bench.py reads (generated under `tmp`), and how the JSON Lines copy was made."""
    from benchmarks.jsonl_copy import jsonl_copy

    ingest_dir, jsonl_dir = tmp / "ingest_tabular", tmp / "ingest_tabular_jsonl"
    subprocess.run([PY, "datasets/prepare.py", "tabular", "--out", str(ingest_dir), "--rows", str(mode.ingest_rows),
                    "--features", str(mode.ingest_features), "--classes", "4", "--seed", "0"],
                   cwd=REPO, check=True, capture_output=True)
    copy = jsonl_copy(ingest_dir, jsonl_dir)  # the same rows, one JSON object per line (benchmarks/jsonl_copy.py)
    sets = {
        "tabular": {"config": "trainers/configs/tabular_mlp.yaml",
                    "overrides": [f"data.train_path={ingest_dir / 'train'}", f"data.val_path={ingest_dir / 'val'}"]},
        # run.storage_path: where the driver caches the text files' layouts (never the checkout's runs/)
        "tabular_jsonl": {"config": "trainers/configs/tabular_mlp.yaml",
                          "overrides": [f"data.train_path={jsonl_dir / 'train'}", f"data.val_path={jsonl_dir / 'val'}",
                                        f"run.storage_path={tmp / 'ray_bench' / 'ingest_storage'}"]},
        "pystdlib": {"config": CONFIG, "overrides": [f"data.train_path={data / 'train'}", "data.val_path=null"]},
    }
    return sets, copy


def run_ray_bench(mode: Mode, tmp: Path, data: Path, scaling: bool = True) -> dict:
    sets, copy = ingest_sets(mode, tmp, data)
    scale_over = [f"train.max_steps={mode.scale_steps}", f"train.log_every_steps={mode.scale_log_every}",
                  f"train.eval_every_steps={mode.scale_steps}", f"checkpoint.every_steps={mode.scale_steps}",
                  f"data.train_path={data / 'train'}", "data.val_path=null"]
    spec = {
        "storage": str(tmp / "ray_bench"), "passes": mode.ingest_passes, "ingest_sets": sets,
        # 1 and 2 workers alternating in every repetition: scaling_2_over_1 compares fits taken side by side
        "scaling": {"config": CONFIG, "reps": mode.reps, "overrides": scale_over, "workers": [1, 2]} if scaling else None,
    }
    spec_path, out_path = tmp / "ray_bench_spec.json", tmp / "ray_bench_out.json"
    spec_path.write_text(json.dumps(spec))
    timeout = mode.timeout_s * (2 * mode.reps + 1)
    r = launch([PY, "benchmarks/ray_bench.py", str(spec_path), str(out_path)], tmp / "ray_bench.log", timeout)
    if r.rc != 0 or not out_path.exists():
        raise RuntimeError(f"benchmarks/ray_bench.py failed (exit {r.rc}); log {r.log}:\n"
                           + Path(r.log).read_text()[-3000:])
    out = json.loads(out_path.read_text())
    out["ingest"]["sets"]["tabular_jsonl"]["copy"] = copy
    fits = [{"rep": x["rep"], "workers": x["workers"], "fit_s": x["fit_s"], "summary": x["summary"],
             "loadavg": x["loadavg"], "metrics": read_jsonl(Path(x["run_dir"]) / "metrics.jsonl")}
            for x in out.get("scaling", {}).get("runs", [])]
    return {"ingest": out["ingest"], "scaling": fits,
            "ray_bench": {"ray_init_s": out["ray_init_s"], "wall_s": r.wall_s}}


# ---------------------------------------------------------------- the whole run

def measure(mode: Mode, tmp: Path, mode_name: str) -> dict:
    """Every benchmark, one after the other: the raw runs figures.py computes the figures from, and each part's run
    header (raw["headers"][part]: report.run_header around that part alone)."""
    data = default_job_data(tmp)
    raw: dict = {"settings": asdict(mode), "headers": {}}
    headers = raw["headers"]
    with run_header(mode_name) as headers["pairs"]:
        raw["pairs"] = run_pairs(mode, tmp, data)
    print("bench: ingest and scaling (benchmarks/ray_bench.py)", flush=True)
    with run_header(mode_name) as header:  # one launch, one Ray: ingest, then the scaling fits
        raw.update(run_ray_bench(mode, tmp, data))
    headers["ingest"] = headers["scaling"] = header
    print(f"bench: ray_bench done in {raw['ray_bench']['wall_s']:.1f}s", flush=True)
    # Imported here, not at the top: they import this module's helpers.
    from benchmarks.blocks_bench import measure as blocks_bench
    from benchmarks.checkpoint_bench import measure as checkpoint_bench
    from benchmarks.stream_memory import measure as stream_memory

    print("bench: memory growth with the data set (benchmarks/stream_memory.py)", flush=True)
    with run_header(mode_name) as headers["memory"]:
        raw["memory"] = stream_memory(*mode.stream_rows, tmp / "stream_memory", reps=mode.reps,
                                      timeout_s=MEMORY_TIMEOUT_FACTOR * mode.timeout_s)
    print("bench: checkpoint cost per rank, rank-0 gather vs DCP (benchmarks/checkpoint_bench.py)", flush=True)
    with run_header(mode_name) as headers["checkpoint"]:
        raw["checkpoint"] = checkpoint_bench(*mode.ckpt_model, reps=mode.reps, tmp=tmp / "checkpoint_bench",
                                             timeout_s=mode.timeout_s * 2)
    print("bench: activation checkpointing and torch.compile on CPU (benchmarks/blocks_bench.py)", flush=True)
    with run_header(mode_name) as headers["blocks"]:
        raw["blocks"] = blocks_bench(reps=mode.reps, steps=mode.blocks_steps, warmup=mode.blocks_warmup,
                                     smoke=mode.tiny_models, timeout_s=mode.timeout_s)
    for name in ("lock", "finetune", "file_read", "bucketing", "sinks", "commands", "bucket", "hsdp"):
        key, measure_part = ONLY[name]
        with run_header(mode_name) as headers[key]:
            raw[key] = measure_part(mode)
    return raw


def measure_ingest(mode: Mode) -> dict:
    """ray_bench.py's ingest alone (no scaling fits), in a temporary folder of its own."""
    tmp = Path(tempfile.mkdtemp(prefix="stride-bench-ingest-"))
    try:
        data = default_job_data(tmp)
        print("bench: ingest, Parquet and JSON Lines (benchmarks/ray_bench.py)", flush=True)
        return run_ray_bench(mode, tmp, data, scaling=False)["ingest"]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def measure_memory(mode: Mode) -> dict:
    """stream_memory.py alone (Parquet and JSON Lines), in a temporary folder of its own."""
    from benchmarks.stream_memory import measure as stream_memory

    tmp = Path(tempfile.mkdtemp(prefix="stride-bench-memory-"))
    try:
        print("bench: memory growth with the data set (benchmarks/stream_memory.py)", flush=True)
        return stream_memory(*mode.stream_rows, tmp, reps=mode.reps, timeout_s=MEMORY_TIMEOUT_FACTOR * mode.timeout_s)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def measure_lock(mode: Mode) -> dict:
    from benchmarks.lock_bench import measure as lock_bench

    print("bench: the run lock's cost per step (benchmarks/lock_bench.py)", flush=True)
    return lock_bench(reps=mode.reps, chunks=mode.lock_chunks)


def measure_finetune(mode: Mode) -> dict:
    from benchmarks.finetune_bench import measure as finetune_bench

    print("bench: fine-tuning's set-up memory, frozen step and load (benchmarks/finetune_bench.py)", flush=True)
    return finetune_bench(reps=mode.reps, smoke=mode.tiny_models, timeout_s=mode.timeout_s)


def measure_file_read(mode: Mode) -> dict:
    from benchmarks.file_read_bench import measure as file_read_bench

    print("bench: files by reference, Stride's stream beside a thread pool (benchmarks/file_read_bench.py)", flush=True)
    return file_read_bench(reps=mode.reps, files=mode.file_read_files, pairs=mode.file_read_pairs)


def measure_bucketing(mode: Mode) -> dict:
    from benchmarks.bucketing_bench import measure as bucketing_bench

    print("bench: length bucketing's padding and epoch time (benchmarks/bucketing_bench.py)", flush=True)
    return bucketing_bench(reps=mode.reps, smoke=mode.tiny_models)


def measure_sinks(mode: Mode) -> dict:
    from benchmarks.sinks_bench import measure as sinks_bench

    print("bench: metric sinks and train.ema per step (benchmarks/sinks_bench.py)", flush=True)
    return sinks_bench(reps=mode.reps, smoke=mode.tiny_models, timeout_s=mode.timeout_s)


def measure_commands(mode: Mode) -> dict:
    from benchmarks.commands_bench import measure as commands_bench

    print("bench: stride predict and the time to the first step (benchmarks/commands_bench.py)", flush=True)
    return commands_bench(reps=mode.reps, smoke=mode.tiny_models, timeout_s=mode.timeout_s)


def measure_bucket(mode: Mode) -> dict:
    from benchmarks.bucket_bench import measure as bucket_bench

    print("bench: a run on s3:// beside one in a folder (benchmarks/bucket_bench.py)", flush=True)
    return bucket_bench(reps=mode.reps, smoke=mode.tiny_models, timeout_s=mode.timeout_s)


def measure_hsdp(mode: Mode) -> dict:
    from benchmarks.hsdp_bench import measure as hsdp_bench

    print("bench: train.strategy hsdp beside ddp and fsdp, held and cross-group bytes (benchmarks/hsdp_bench.py)",
          flush=True)
    return hsdp_bench(reps=mode.reps, smoke=mode.tiny_models, timeout_s=mode.timeout_s)


# --only NAME: raw[key] = measure(mode)

ONLY = {"lock": ("lock", measure_lock), "finetune": ("finetune", measure_finetune),
        "ingest": ("ingest", measure_ingest), "memory": ("memory", measure_memory),
        "file_read": ("file_read", measure_file_read), "bucketing": ("bucketing", measure_bucketing),
        "sinks": ("sinks", measure_sinks), "commands": ("commands", measure_commands),
        "bucket": ("bucket", measure_bucket), "hsdp": ("hsdp", measure_hsdp)}


def measure_only(name: str, mode: Mode, mode_name: str, latest: Path) -> dict:
    """One part measured again, its raw runs and its own run header put into an earlier result's (the other parts
    keep theirs, and the result's top-level header stays the last full run's), every figure replayed from them."""
    if not latest.exists():
        raise SystemExit(f"bench: --only {name} adds to {latest}, which does not exist; run `make bench` first")
    result = json.loads(latest.read_text())
    key, measure_part = ONLY[name]
    with run_header(mode_name) as header:
        part = measure_part(mode)
    result["raw"][key] = json.loads(json.dumps(part, default=str))
    result["raw"].setdefault("headers", {})[key] = header
    return {**result, **replay(result["raw"])}


def render(result_path: Path) -> list[str]:
    """Rewrite the generated blocks of benchmarks/README.md and README.md from a stored result, each figure marked
    stale where the code it measures changed since its run's commit. Returns the files that changed."""
    result = json.loads(result_path.read_text())
    stale = stale_parts(part_headers(result), PARTS)
    for part, reason in stale.items():
        if reason:
            h = part_headers(result)[part] or {}
            files = changed_since(h["commit"], PARTS[part]["paths"]) if h.get("commit") else []
            print(f"bench: {part} is stale: {reason}{': ' + ', '.join(files[:8]) if files else ''}"
                  f"{' ...' if len(files) > 8 else ''}")
    changed = []
    for rel, (name, make) in BLOCKS.items():
        path = REPO / rel
        text = path.read_text()
        if block(text, name) is None:
            raise SystemExit(f"bench: {rel} has no generated block {name!r}")
        new = with_block(text, name, make(result, stale))
        if new != text:
            path.write_text(new)
            changed.append(rel)
    return changed


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python benchmarks/run.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--quick", dest="mode", action="store_const", const="quick", help="5 repetitions (default)")
    g.add_argument("--full", dest="mode", action="store_const", const="full", help="5 repetitions, longer runs")
    g.add_argument("--smoke", dest="mode", action="store_const", const="smoke", help="1 tiny repetition, no verdicts")
    g.add_argument("--render", nargs="?", const=str(RESULTS / "latest.json"), metavar="RESULT",
                   help="measure nothing: rewrite the READMEs' generated blocks from RESULT (default: latest.json)")
    ap.add_argument("--only", choices=sorted(ONLY),
                    help="measure only this part and replace its raw runs in <out>/latest.json")
    ap.add_argument("--out", default=str(RESULTS), help="folder for latest.json")
    ap.add_argument("--keep-tmp", action="store_true", help="keep the temporary run folders and logs")
    args = ap.parse_args(argv)
    if args.render:
        print(f"bench: rewrote {', '.join(render(Path(args.render))) or 'nothing (up to date)'}")
        return 0
    mode_name = args.mode or "quick"
    mode = MODES[mode_name]
    out_dir = Path(args.out)
    if args.only:
        latest = out_dir / "latest.json"
        result = measure_only(args.only, mode, mode_name, latest)
        latest.write_text(json.dumps(result, indent=1) + "\n")
        print(result["table"])
        print(f"bench: measured {args.only} again into {latest}")
        if out_dir.resolve() == RESULTS.resolve():
            print(f"bench: rewrote {', '.join(render(latest)) or 'nothing'}")
        return 0
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="stride-bench-"))
    try:
        with run_header(mode_name) as header:  # the whole run's; each part records its own in raw["headers"]
            print(f"bench: {mode_name}: {mode.reps} repetition(s); temporary runs in {tmp}; load average "
                  f"{header['loadavg_start'][0]:.2f} on {os.cpu_count()} CPUs; commit {header['commit']}"
                  f"{' with uncommitted changes' if header['dirty'] else ''}", flush=True)
            raw = measure(mode, tmp, mode_name)
    finally:
        if not args.keep_tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    raw = json.loads(json.dumps(raw, default=str))  # the figures come from the raw runs exactly as stored
    load_start = header["loadavg_start"]
    result = {
        **header,  # mode, started, duration_s, machine, commit, dirty, dirty_paths, loadavg_start, loadavg_end
        "workload": {"model": "char_gpt (trainers/configs/char_gpt.yaml): 3 layers, width 128, 4 heads, context 64, "
                              "fp32, AdamW; 32 sequences per worker, 2 CPU workers of 1 CPU (1 torch thread) each",
                     "data": "the default job's data, datasets/prepare.py pystdlib (91k rows of 65 bytes)",
                     "why": "the default job; a step is ~0.1-0.5 s of forward/backward on one core, so Ray's "
                            "per-step and per-report costs show against real compute, not against an empty loop"},
        "raw": raw,
        **replay(raw),
    }
    latest = out_dir / "latest.json"
    latest.write_text(json.dumps(result, indent=1) + "\n")
    print()
    print(result["table"])
    print(f"\nbench: {mode_name} took {result['duration_s']:.0f}s; load average {load_start[0]:.2f} -> "
          f"{result['loadavg_end'][0]:.2f} on {os.cpu_count()} CPUs; wrote {latest}")
    if out_dir.resolve() == RESULTS.resolve():  # the checkout's results: its READMEs quote them
        print(f"bench: rewrote {', '.join(render(latest)) or 'nothing'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
