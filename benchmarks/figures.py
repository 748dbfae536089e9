"""Every figure of `make bench`, its verdict and its table, computed from the raw runs alone.

    figures(raw) -> {name: figure}          median, spread (min..max), n and samples of each figure
    goals(figs) -> {name: verdict}          pass/fail on the median of at least MIN_SAMPLES samples
    table(figs, verdicts) -> str            what benchmarks/run.py prints
    replay(raw) -> {figures, goals, table}  the three, as benchmarks/run.py stores them beside the raw runs
    markdown(result, stale), headline(result, stale)   the generated blocks of benchmarks/README.md and README.md;
                                            stale: {part: why its figures are stale, or None}, which git says:
                                            report.stale_parts(part_headers(result), PARTS) at HEAD

Pure functions of JSON data, standard library only: benchmarks/run.py measures and stores `raw`, and
tests/test_bench.py replays benchmarks/results/latest.json's raw runs through these functions in milliseconds.

`raw` (what run.py stores under "raw"; every list holds one entry per run or repetition):
    settings      the mode: reps, steps, ckpt_every, warmup_steps, scale_warmup_steps, ingest_features, ...
    headers       {part: run header} (benchmarks/report.py run_header: started, mode, machine, commit, dirty,
                   dirty_paths, loadavg_start, loadavg_end, duration_s), one per part of PARTS (or absent: a result
                   from before headers, whose figures are then of unknown provenance)
    pairs         [{runtime: stride|torchrun, rep, wall_s, time_to_first_step_s, phases_s, metrics: [log lines]}]
    ingest        {threads: {pyarrow, stream_read_threads, ...}, sets: {name: {rows, seconds, files, format, driver,
                   copy}}}: tabular (Parquet), tabular_jsonl (its JSON Lines copy), pystdlib
    scaling       [{workers, rep, metrics: [log lines]}]: Stride's trainer with 1 and 2 workers
    memory        {sets: {small, large, small_jsonl, large_jsonl: {raw_bytes, ...}},
                   reps: [{rep, small, large, small_jsonl, large_jsonl: {peak_pss_bytes, aborted}}]}
    checkpoint    {model, params, runs: [{method: gather|dcp, rep, rank, peak_increase_bytes, blocked_s, complete_s}]}
    blocks        {runs: [{variant, rep, step_s, peak_increase_bytes, allocated_peak_increase_bytes, warmup_s}]}
    lock          {log_every, heartbeat_s, runs: [{variant: lock|none, rep, chunk_s: [...], chunk_steps}]} (or absent)
    finetune      {model, memory: {runs: [{strategy: fsdp|ddp, rep, rank, peak_increase_bytes, full_bytes, ...}]},
                   step: {chunk_steps, runs: [{variant: frozen|trainable, rep, rank, chunk_s: [...]}]},
                   load: {runs: [{variant: init_model|load_file_read|..., rep, seconds}]}} (or absent)
    file_read     {files, file_bytes, threads, window_rows, small_window_rows, runs: [{variant: stride|threadpool|
                   stride_small_window, rep, pair, seconds, rows, bytes}]} (or absent)
    bucketing     {rows, batch, model, runs: [{variant: bucketed|unbucketed, rep, epoch_s, compute_s,
                   padding_fraction, stride_padding_fraction, tokens, padded_tokens, val_loss}]} (or absent)
    bucket        {hidden, steps, ckpt_every, warmup, runs: [{variant: folder|bucket, phase: train|resume, rep,
                   wall_s, first_step_s, resumed_line_s, checkpoint_bytes, summary, metrics: [log lines]}]} (or absent)
    hsdp          {model, params, param_bytes, world_size, shard_size, groups, steps, runs: [{strategy: ddp|fsdp|hsdp,
                   step, rank, loss, param_bytes, grad_bytes, optim_bytes, held_bytes, sent_bytes, cross_group_bytes,
                   collectives: {op: {calls, groups, tensor_bytes, sent_bytes, cross_group_bytes}}}]} (or absent)
"""

from __future__ import annotations

import math
import statistics

MIN_SAMPLES = 5  # a figure passes or fails on the median of at least this many samples; fewer give no verdict

# The goals, figure: (operator, threshold), all judged by the same rule (verdict()) and shown in the tables' goal and
# result columns; grouped by where they come from. The first issues' figures (thresholds partly this project's own):
CORE_GOALS = {
    "step_time_ratio": ("<=", 1.02),
    "wall_ratio": ("<=", 1.5),
    "ingest_ratio": (">=", 1.0),
    "data_wait_fraction": ("<", 0.02),
    "ckpt_blocked_fraction": ("<=", 0.2),
    "memory_growth_ratio": ("<=", 0.35),
    "checkpoint_rank0_memory_ratio": ("<=", 0.5),
    "checkpoint_blocked_ratio": ("<", 1.0),
    "ac_memory_ratio": ("<=", 0.6),
    "ac_step_time_ratio": ("<=", 1.5),
    "compile_step_time_ratio": ("<=", 1.0),
    "lock_overhead_ratio": ("<=", 1.005),
    "init_peak_memory_ratio": ("<=", 0.6),
    "frozen_step_time_ratio": ("<=", 0.8),
    "init_load_ratio": ("<=", 1.5),
}
# The data-format issue's for JSON Lines ingest; the Parquet figure's for JSON Lines memory:
FORMAT_GOALS = {"jsonl_ingest_ratio": (">=", 0.8), "jsonl_memory_growth_ratio": ("<=", 0.35)}
# The data-path issue's (files by reference, length bucketing):
DATA_GOALS = {"file_read_ratio": (">=", 0.8), "bucketing_padding_ratio": ("<=", 0.33),
              "bucketing_step_time_ratio": ("<=", 0.6)}
# The callbacks-and-sinks issue's:
SINK_GOALS = {"sink_overhead_ratio": ("<=", 1.01), "ema_step_time_ratio": ("<=", 1.05)}
# The commands issue's (predict, a run's start, preemption):
COMMAND_GOALS = {"predict_throughput_ratio": (">=", 0.9), "time_to_first_step_ratio": ("<=", 2.0),
                 "preemption_steps_lost": ("<=", 0)}
# The runs-on-object-storage issue's (a run on s3:// beside the same in a folder):
BUCKET_GOALS = {"bucket_checkpoint_blocked_ratio": ("<=", 1.1), "bucket_step_time_ratio": ("<=", 1.01),
                "bucket_resume_ratio": ("<=", 1.3)}
# The many-nodes sharding issue's (hsdp beside ddp and fsdp on 4 CPU ranks):
HSDP_GOALS = {"hsdp_param_memory_ratio": ("<=", 0.55), "hsdp_cross_group_bytes_ratio": ("<=", 0.35)}
GOALS = {**CORE_GOALS, **FORMAT_GOALS, **DATA_GOALS, **SINK_GOALS, **COMMAND_GOALS, **BUCKET_GOALS, **HSDP_GOALS}

# The benchmark parts: which figures each gives, and the code it measures (files or folders of the repository). A
# part's run header (raw["headers"][part], report.run_header) says at which commit it ran; a figure is stale when
# that code changed since (report.stale_reason). The harness that runs a part counts as code it measures; figures.py
# does not (tests/test_bench.py replays the figures through the current one).
RUNTIME = ["trainers/", "datasets/", "ray_cluster/", "stride/"]  # a whole training job: Stride's every module
PARTS = {
    "pairs": {"figures": ("step_time_ratio", "wall_ratio", "time_to_first_step_s (stride)",
                          "time_to_first_step_s (torchrun)", "data_wait_fraction", "ckpt_blocked_fraction"),
              "paths": [*RUNTIME, "benchmarks/run.py"]},
    "ingest": {"figures": ("ingest_ratio", "jsonl_ingest_ratio"),
               "paths": [*RUNTIME, "benchmarks/run.py", "benchmarks/ray_bench.py", "benchmarks/jsonl_copy.py"]},
    "scaling": {"figures": ("scaling_2_over_1",),
                "paths": [*RUNTIME, "benchmarks/run.py", "benchmarks/ray_bench.py"]},
    "memory": {"figures": ("memory_growth_ratio", "jsonl_memory_growth_ratio"),
               "paths": [*RUNTIME, "benchmarks/stream_memory.py", "benchmarks/jsonl_copy.py"]},
    "checkpoint": {"figures": ("checkpoint_rank0_memory_ratio", "checkpoint_blocked_ratio"),
                   "paths": ["trainers/run/checkpointing.py", "trainers/fsdp.py", "trainers/models.py",
                             "trainers/run/folder.py", "benchmarks/checkpoint_bench.py"]},
    "blocks": {"figures": ("ac_memory_ratio", "ac_step_time_ratio", "compile_step_time_ratio"),
               "paths": ["trainers/blocks.py", "trainers/step.py", "trainers/models.py", "trainers/tasks/",
                         "trainers/configs/char_gpt.yaml", "benchmarks/blocks_bench.py"]},
    "lock": {"figures": ("lock_overhead_ratio",), "paths": ["trainers/run/lock.py", "benchmarks/lock_bench.py"]},
    "finetune": {"figures": ("init_peak_memory_ratio", "init_peak_memory_ratio_ddp", "frozen_step_time_ratio",
                             "init_load_ratio"),
                 "paths": ["trainers/", "datasets/splits.py", "benchmarks/finetune_bench.py"]},
    "file_read": {"figures": ("file_read_ratio",), "paths": ["datasets/", "benchmarks/file_read_bench.py"]},
    "bucketing": {"figures": ("bucketing_padding_ratio", "bucketing_step_time_ratio"),
                  "paths": ["datasets/", "benchmarks/bucketing_bench.py"]},
    "sinks": {"figures": ("sink_overhead_ratio", "ema_step_time_ratio"),
              "paths": ["trainers/", "datasets/", "benchmarks/sinks_bench.py"]},
    "commands": {"figures": ("predict_throughput_ratio", "time_to_first_step_ratio",
                             "time_to_first_step_on_head_ratio", "preemption_steps_lost"),
                 "paths": [*RUNTIME, "benchmarks/commands_bench.py", "benchmarks/preemption_bench.py"]},
    # under torchrun (no Ray); the local S3 server is part of what it measures
    "bucket": {"figures": ("bucket_checkpoint_blocked_ratio", "bucket_step_time_ratio", "bucket_resume_ratio"),
               "paths": ["trainers/", "datasets/", "stride/", "benchmarks/bucket_bench.py", "tests/s3_server.py"]},
    # Stride's sharding of its char_gpt, trained in the bench's own loop (no Trainer): torch's FSDP2 and DDP do the rest
    "hsdp": {"figures": ("hsdp_param_memory_ratio", "hsdp_cross_group_bytes_ratio"),
             "paths": ["trainers/fsdp.py", "trainers/models.py", "benchmarks/hsdp_bench.py"]},
}
FIGURE_PART = {name: part for part, p in PARTS.items() for name in p["figures"]}

# One line per figure for the tables of the READMEs; the JSON's "what" says more.
LABELS = {
    "step_time_ratio": "steady-state step time, Stride on Ray Train / torchrun",
    "wall_ratio": "wall time of a short job, launch to exit, Stride / torchrun",
    "time_to_first_step_s (stride)": "launch to the end of the first optimizer step, Stride",
    "time_to_first_step_s (torchrun)": "the same, torchrun",
    "ingest_ratio": "rows/s from the files in one Ray worker, Stride's stream / pyarrow",
    "jsonl_ingest_ratio": "the same from a JSON Lines copy of the files, Stride's stream / pyarrow.json.read_json",
    "data_wait_fraction": "share of step time a worker waits for its next batch",
    "scaling_2_over_1": "samples/s, 2 workers / 1 worker, same per-worker batch",
    "ckpt_blocked_fraction": "time a checkpoint blocks training / its whole write time",
    "memory_growth_ratio": "peak memory growth, one epoch on ~1 GB vs ~50 MB of Parquet / 1 GB",
    "jsonl_memory_growth_ratio": "the same on JSON Lines copies of those sets",
    "checkpoint_rank0_memory_ratio": "rank 0's memory rise during an FSDP checkpoint, DCP / rank-0 gather",
    "checkpoint_blocked_ratio": "time that checkpoint blocks training, DCP / rank-0 gather",
    "ac_memory_ratio": "a step's peak live memory, activation checkpointing on / off (12 layers)",
    "ac_step_time_ratio": "step time, activation checkpointing on / off (12 layers)",
    "compile_step_time_ratio": "step time, train.compile on / off (default char_gpt)",
    "lock_overhead_ratio": "step time, run lock's fence and heartbeat on / off (tabular_mlp, one thread)",
    "init_peak_memory_ratio": "largest rank's memory rise building a model from init.from under FSDP / its fp32 size",
    "init_peak_memory_ratio_ddp": "the same under DDP (every rank builds the whole model and reads the whole file)",
    "frozen_step_time_ratio": "step time, half the blocks frozen (optim.groups) / all trainable, 2 DDP ranks",
    "init_load_ratio": "init.from's load on a worker (pretrained.init_model, the driver's sha256) / safetensors load_file with its tensors read",
    "file_read_ratio": "rows/s of referenced files (20k x 16 KiB, warm), Stride's stream / a 16-thread pool, same threads",
    "bucketing_padding_ratio": "padding fraction, data.length_column bucketing on / off (lengths log-uniform 10..1000)",
    "bucketing_step_time_ratio": "epoch time of a small transformer, bucketing on / off, batches padded to their longest",
    "sink_overhead_ratio": "time per step, metrics.jsonl + MLflow + TensorBoard + W&B offline / metrics.jsonl alone",
    "ema_step_time_ratio": "step time, train.ema on / off, FSDP on 2 CPU ranks",
    "predict_throughput_ratio": "rows/s, stride predict on 2 CPU workers / a hand-written no_grad loop on 2 processes",
    "time_to_first_step_ratio": "launch to the first step, stride train with an embedded Ray / torchrun",
    "time_to_first_step_on_head_ratio": "the same, stride train joining a running head (RAY_ADDRESS) / torchrun",
    "preemption_steps_lost": "steps trained after the last checkpoint before a node's preemption and lost",
    "bucket_checkpoint_blocked_ratio": "seconds checkpoints block training, run on s3:// (local S3 server) / in a folder",
    "bucket_step_time_ratio": "steady-state step time, run on s3:// (uploads in the background) / in a folder",
    "bucket_resume_ratio": "launch to the first step of a resume, from s3:// / from a folder",
    "hsdp_param_memory_ratio": "per-rank parameter + gradient + AdamW bytes, hsdp (2 groups of 2) / ddp, 4 CPU ranks",
    "hsdp_cross_group_bytes_ratio": "bytes a rank sends outside its shard group per step, hsdp / fsdp on the same 4 ranks",
}


# ---------------------------------------------------------------- samples and their summary

def finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def ratio(a, b) -> float | None:
    return a / b if finite(a) and finite(b) and b != 0 else None


def summary(samples: list) -> dict:
    """Median and spread of the finite samples; a missing sample (None) is kept in `samples` but not counted."""
    xs = [x for x in samples if finite(x)]
    if not xs:
        return {"median": None, "min": None, "max": None, "n": 0, "samples": list(samples)}
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs), "samples": list(samples)}


def figure(samples: list, unit: str, what: str, lower_bound: bool = False, notes: list | None = None, **extra) -> dict:
    return {**summary(samples), "unit": unit, "what": what, "lower_bound": lower_bound, "notes": notes or [], **extra}


def by_rep(runs: list[dict], **match) -> dict[int, dict]:
    """{rep: run} of the runs whose fields equal `match` (runtime="stride", workers=1, ...)."""
    return {r["rep"]: r for r in runs if all(r.get(k) == v for k, v in match.items())}


# ---------------------------------------------------------------- a training run's metrics.jsonl lines

def ckpt_steps(settings: dict) -> list[int]:
    """The mid-run checkpoints of a paired job (the final one is after the last log line)."""
    return list(range(settings["ckpt_every"], settings["steps"], settings["ckpt_every"]))


def steady(lines: list[dict], warmup_steps: int, ckpts: list[int]) -> list[dict]:
    """Log lines of steady-state training: after warm-up, and not touched by a checkpoint (the line after each
    mid-run checkpoint, and further ones until the line that reports the checkpoint's write as finished)."""
    train = [x for x in lines if "train_loss" in x]
    touched: set[int] = set()
    for c in ckpts:
        after = [x for x in train if x["step"] > c]
        if not after:
            continue
        done = next((i for i, x in enumerate(after) if "checkpoint_write_s" in x), 0)
        touched.update(x["step"] for x in after[:done + 1])
    return [x for x in train if x["step"] > warmup_steps and x["step"] not in touched]


def median_of(lines: list[dict], key: str) -> float | None:
    xs = [x[key] for x in lines if finite(x.get(key))]
    return statistics.median(xs) if xs else None


def checkpoint_costs(lines: list[dict], ckpts: list[int]) -> list[dict]:
    """Per mid-run checkpoint: seconds it blocked training (first log line after it) and its total write time
    (the first line after it that reports a finished write)."""
    train = [x for x in lines if "train_loss" in x]
    out = []
    for c in ckpts:
        after = [x for x in train if x["step"] > c]
        blocked = next((x["checkpoint_blocked_s"] for x in after if "checkpoint_blocked_s" in x), None)
        write = next((x["checkpoint_write_s"] for x in after if "checkpoint_write_s" in x), None)
        out.append({"step": c, "blocked_s": blocked, "write_s": write, "fraction": ratio(blocked, write)})
    return out


def run_stats(lines: list[dict], warmup_steps: int, ckpts: list[int]) -> dict:
    """A run's steady-state medians (step time, throughput, data wait) and its mid-run checkpoints' costs."""
    st = steady(lines, warmup_steps, ckpts)
    return {"steady_steps": [x["step"] for x in st], "step_time_s": median_of(st, "step_time_s"),
            "samples_per_second": median_of(st, "samples_per_second"),
            "data_wait_fraction": median_of(st, "data_wait_fraction"), "data_wait_s": median_of(st, "data_wait_s"),
            "checkpoints": checkpoint_costs(lines, ckpts)}


# ---------------------------------------------------------------- the figures, one function per benchmark

def pair_figures(raw: dict) -> dict:
    """Stride beside torchrun, the same job, `reps` pairs: each sample compares the two runs of one pair."""
    settings = raw["settings"]
    ckpts = ckpt_steps(settings)
    stride, torch_ = by_rep(raw["pairs"], runtime="stride"), by_rep(raw["pairs"], runtime="torchrun")
    reps = sorted(stride.keys() & torch_.keys())
    s = [run_stats(stride[i]["metrics"], settings["warmup_steps"], ckpts) for i in reps]
    t = [run_stats(torch_[i]["metrics"], settings["warmup_steps"], ckpts) for i in reps]
    sw, tw = [stride[i]["wall_s"] for i in reps], [torch_[i]["wall_s"] for i in reps]
    ck = [c for x in s for c in x["checkpoints"]]
    job = (f"char_gpt, {settings['steps']} steps, no validation, checkpoints every {settings['ckpt_every']} steps "
           f"and at the end")
    first = {rt: [runs[i]["time_to_first_step_s"] for i in reps]
             for rt, runs in (("stride", stride), ("torchrun", torch_))}
    return {
        "step_time_ratio": figure(
            [ratio(a["step_time_s"], b["step_time_s"]) for a, b in zip(s, t)], "ratio",
            "median steady-state step time, Stride on Ray Train / torchrun (same loop, data, config), per pair",
            stride_step_time_s=summary([a["step_time_s"] for a in s]),
            torchrun_step_time_s=summary([b["step_time_s"] for b in t])),
        "wall_ratio": figure([ratio(a, b) for a, b in zip(sw, tw)], "ratio",
                             "wall time launch to exit of the same short job, Stride / torchrun, per pair",
                             stride_wall_s=summary(sw), torchrun_wall_s=summary(tw), job=job),
        "time_to_first_step_s (stride)": figure(first["stride"], "s",
                                                "launch to the end of rank 0's first optimizer step, Stride"),
        "time_to_first_step_s (torchrun)": figure(first["torchrun"], "s",
                                                  "launch to the end of rank 0's first optimizer step, torchrun"),
        "data_wait_fraction": figure([a["data_wait_fraction"] for a in s], "fraction",
                                     "share of step time a worker spends waiting for its next batch (Stride)",
                                     torchrun=summary([b["data_wait_fraction"] for b in t]),
                                     stride_data_wait_s=summary([a["data_wait_s"] for a in s])),
        "ckpt_blocked_fraction": figure(
            [c["fraction"] for c in ck], "fraction",
            "training time blocked by a mid-run checkpoint / that checkpoint's total write time (Stride), per "
            "checkpoint",
            blocked_s=summary([c["blocked_s"] for c in ck]), write_s=summary([c["write_s"] for c in ck]),
            torchrun=summary([c["fraction"] for x in t for c in x["checkpoints"]])),
    }


def phases(raw: dict) -> dict:
    """Median seconds since launch at which each phase of a paired job ended, per runtime (the phases a runtime
    never reported are left out)."""
    out = {}
    for rt in ("stride", "torchrun"):
        runs = [p for p in raw["pairs"] if p["runtime"] == rt]
        names = [k for k in runs[0]["phases_s"]] if runs else []
        out[rt] = {k: m for k in names if (m := summary([r["phases_s"].get(k) for r in runs])["median"]) is not None}
    return out


def ingest_figure(raw: dict) -> dict:
    """One Ray Train worker alternates Stride's stream and pyarrow over the same files: a sample per pass."""
    ing, features = raw["ingest"], raw["settings"]["ingest_features"]

    def rows_per_s(block: dict, reader: str) -> list:
        return [ratio(block["rows"][reader], x) for x in block["seconds"][reader]]

    def pass_ratios(block: dict) -> list:
        return [ratio(a, b) for a, b in zip(rows_per_s(block, "stride"), rows_per_s(block, "pyarrow"))]

    tab, txt = ing["sets"]["tabular"], ing["sets"]["pystdlib"]
    threads = ing["threads"]
    pa_threads, stream_threads = threads.get("pyarrow"), threads.get("stream_read_threads")
    notes, unequal = [], None
    if pa_threads != stream_threads:  # the comparison the goal is about was not made: no verdict either way
        unequal = "not the same threads"
        notes.append(f"not the same threads: pyarrow read on {pa_threads} thread{'' if pa_threads == 1 else 's'}, "
                     f"the stream with {stream_threads} read threads: no verdict")
    return figure(
        pass_ratios(tab), "ratio",
        "rows/s from the files, Stride's streaming path on one worker (row groups in the epoch's order, window "
        "shuffle, micro-batches of arrays) / pyarrow's read_table of the same files in that process, per pass",
        notes=notes, no_verdict=unequal, threads=threads,
        data=f"tabular Parquet, {tab['rows']['pyarrow']} rows x {features} float32 features + label + sample_id "
             f"({len(tab['files'])} files), one worker, from the files (nothing pre-loaded)",
        stride_rows_per_s=summary(rows_per_s(tab, "stride")), pyarrow_rows_per_s=summary(rows_per_s(tab, "pyarrow")),
        default_job_data={"data": f"the default job's data, {txt['rows']['pyarrow']} rows of tokens + sample_id",
                          "ingest_ratio": summary(pass_ratios(txt))})


def jsonl_ingest_figure(raw: dict) -> dict:
    """The ingest worker's JSON Lines set, read in the same passes as the Parquet one: a sample per pass."""
    ing = raw.get("ingest") or {}
    block = (ing.get("sets") or {}).get("tabular_jsonl")
    what = ("rows/s from a JSON Lines copy of ingest_ratio's set (the same rows, one object per line), Stride's "
            "streaming path on one worker (4,096-line parts in the epoch's order, window shuffle, micro-batches of "
            "arrays) / pyarrow.json.read_json of the same files (the task's columns, to numpy) in that process, per "
            "pass; the line index is made on the driver before timing")
    if not block:
        return figure([], "ratio", what, notes=["not measured in this result: python benchmarks/run.py --only ingest"])

    def rows_per_s(reader: str) -> list:
        return [ratio(block["rows"][reader], x) for x in block["seconds"][reader]]

    copy = block.get("copy") or {}
    fig = figure([ratio(a, b) for a, b in zip(rows_per_s("stride"), rows_per_s("pyarrow"))], "ratio", what,
                 threads=ing.get("threads"),
                 data=f"{block['rows']['pyarrow']} rows in {len(block['files'])} JSON Lines files, one worker, from "
                      f"the files (the copy, train and val: {copy.get('jsonl_bytes', 0) / 2**20:.0f} MiB of JSON Lines "
                      f"for {copy.get('parquet_bytes', 0) / 2**20:.0f} MiB of Parquet)",
                 stride_rows_per_s=summary(rows_per_s("stride")), pyarrow_rows_per_s=summary(rows_per_s("pyarrow")),
                 driver=block.get("driver"))
    return fig


def scaling_figure(raw: dict) -> dict:
    """Stride's trainer with 1 and with 2 workers, fitted one after the other in each repetition: a sample per
    repetition that has both."""
    warmup = raw["settings"]["scale_warmup_steps"]
    sps = {w: {rep: median_of(steady(r["metrics"], warmup, []), "samples_per_second")
               for rep, r in by_rep(raw["scaling"], workers=w).items()} for w in (1, 2)}
    reps = sorted(sps[1].keys() & sps[2].keys())
    notes = [] if reps else ["no 2-worker fits beside the 1-worker ones in this run: not measured side by side"]
    return figure([ratio(sps[2][i], sps[1][i]) for i in reps], "ratio",
                  "Stride throughput (samples/s), 2 workers / 1 worker at the same per-worker batch, fitted side by "
                  "side in one Ray (stride.trainers.driver.build_trainer), per repetition",
                  notes=notes, ideal=2.0, samples_per_second_1=summary([sps[1][i] for i in reps]),
                  samples_per_second_2=summary([sps[2][i] for i in reps]))


def memory_figure(raw: dict, small_set: str = "small", large_set: str = "large",
                  what: str = "(peak PSS of the whole process tree, one epoch on the large set - on the small set) / "
                              "raw bytes of the large set; 2 CPU workers (benchmarks/stream_memory.py), per "
                              "repetition") -> dict:
    """One epoch on the small and on the large set per repetition. A stopped (aborted) large run's peak is a lower
    bound, and so is that sample; a stopped small run leaves nothing to compare with (no sample)."""
    mem = raw["memory"]
    large_raw = mem["sets"][large_set]["raw_bytes"]
    samples, bounded = [], []
    for r in mem["reps"]:
        small, large = r.get(small_set), r.get(large_set)
        if not small or not large or small.get("aborted"):
            samples.append(None)
            continue
        samples.append(ratio(large["peak_pss_bytes"] - small["peak_pss_bytes"], large_raw))
        if large.get("aborted"):
            bounded.append(r["rep"])
    notes = [f"the large run was stopped in repetition(s) {bounded}: those samples are lower bounds"] if bounded else []
    sets = (small_set, large_set)
    return figure(samples, "ratio", what, lower_bound=bool(bounded), notes=notes, lower_bound_reps=bounded,
                  raw_bytes={k: s["raw_bytes"] for k, s in mem["sets"].items() if k in sets},
                  peak_pss_bytes={k: summary([r.get(k, {}).get("peak_pss_bytes") for r in mem["reps"]])
                                  for k in sets})


def jsonl_memory_figure(raw: dict) -> dict:
    """memory_figure over the JSON Lines copies of the same two sets, run in the same repetitions."""
    what = ("(peak PSS of the whole process tree, one epoch on the large set's JSON Lines copy - on the small set's) "
            "/ raw bytes of the large set; 2 CPU workers, the line index made before the runs (benchmarks/"
            "stream_memory.py), per repetition")
    if "large_jsonl" not in raw["memory"].get("sets", {}):
        return figure([], "ratio", what, notes=["not measured in this result: python benchmarks/run.py --only memory"])
    return memory_figure(raw, "small_jsonl", "large_jsonl", what)


def checkpoint_medians(raw: dict) -> dict:
    """{method: {rank: medians over repetitions}} of the checkpoint benchmark's per-rank costs."""
    out: dict = {}
    for r in raw["checkpoint"]["runs"]:
        out.setdefault(r["method"], {}).setdefault(str(r["rank"]), []).append(r)
    keys = ("peak_increase_bytes", "peak_rss_bytes", "blocked_s", "complete_s")
    return {m: {rank: {k: summary([x[k] for x in rs])["median"] for k in keys} for rank, rs in sorted(ranks.items())}
            for m, ranks in sorted(out.items())}


def checkpoint_figures(raw: dict) -> dict:
    """The rank-0 gather and DCP in fresh process pairs, alternating: a sample per repetition."""
    ck = raw["checkpoint"]
    per = {m: {} for m in ("gather", "dcp")}
    for r in ck["runs"]:
        per[r["method"]].setdefault(r["rep"], {})[r["rank"]] = r
    reps = sorted(per["gather"].keys() & per["dcp"].keys())

    def worst(ranks: dict, key: str) -> float:  # the slowest (or largest) rank: what the job waits for
        return max(x[key] for x in ranks.values())

    g, d = [per["gather"][i] for i in reps], [per["dcp"][i] for i in reps]
    model = f"{ck['model']} ({ck['params'] / 1e6:.1f}M parameters), {ck['world_size']} FSDP workers"
    return {
        "checkpoint_rank0_memory_ratio": figure(
            [ratio(b[0]["peak_increase_bytes"], a[0]["peak_increase_bytes"]) for a, b in zip(g, d)], "ratio",
            "rank 0's peak memory rise during a checkpoint, DCP shards / the earlier rank-0 gather "
            "(benchmarks/checkpoint_bench.py), per repetition", model=model,
            max_rank_memory_ratio=summary([ratio(worst(b, "peak_increase_bytes"), worst(a, "peak_increase_bytes"))
                                           for a, b in zip(g, d)])),
        "checkpoint_blocked_ratio": figure(
            [ratio(worst(b, "blocked_s"), worst(a, "blocked_s")) for a, b in zip(g, d)], "ratio",
            "training time blocked by that checkpoint (the slowest rank), DCP shards / rank-0 gather, per repetition",
            model=model, complete_ratio=summary([ratio(worst(b, "complete_s"), worst(a, "complete_s"))
                                                 for a, b in zip(g, d)])),
    }


def blocks_medians(raw: dict) -> dict:
    """{variant: medians over repetitions} of the activation-checkpointing and compile benchmark."""
    out: dict = {}
    for r in raw["blocks"]["runs"]:
        out.setdefault(r["variant"], []).append(r)
    keys = ("step_s", "peak_increase_bytes", "allocated_peak_increase_bytes", "warmup_s")
    return {v: {"layers": rs[0]["layers"], "width": rs[0]["width"], "context": rs[0]["context"],
                "batch": rs[0]["batch"], "params": rs[0]["params"],
                **{k: summary([x.get(k) for x in rs])["median"] for k in keys}} for v, rs in out.items()}


def blocks_figures(raw: dict) -> dict:
    """Each variant in a fresh process, all variants once per repetition: a sample per repetition."""
    runs = raw["blocks"]["runs"]
    reps = sorted({r["rep"] for r in runs})
    v = {name: by_rep(runs, variant=name) for name in {r["variant"] for r in runs}}

    def per_rep(on: str, off: str, key: str) -> list:
        return [ratio(v[on][i].get(key), v[off][i].get(key)) for i in reps if i in v[on] and i in v[off]]

    return {
        "ac_memory_ratio": figure(
            per_rep("deep_ac", "deep", "allocated_peak_increase_bytes"), "ratio",
            "peak memory rise of a training step, train.activation_checkpointing on / off, a 12-layer char_gpt on "
            "one CPU worker, RSS with MALLOC_MMAP_THRESHOLD_=65536 so that it follows the live tensors "
            "(benchmarks/blocks_bench.py), per repetition",
            default_model=summary(per_rep("default_ac", "default", "allocated_peak_increase_bytes")),
            rss_ratio_glibc_defaults=summary(per_rep("deep_ac", "deep", "peak_increase_bytes"))),
        "ac_step_time_ratio": figure(
            per_rep("deep_ac", "deep", "step_s"), "ratio",
            "step time, train.activation_checkpointing on / off, the same 12-layer char_gpt, per repetition",
            default_model=summary(per_rep("default_ac", "default", "step_s"))),
        "compile_step_time_ratio": figure(
            per_rep("default_compiled", "default", "step_s"), "ratio",
            "step time, train.compile on / off (inductor), the default char_gpt on one CPU worker, per repetition",
            compile_warmup_s=summary([r.get("warmup_s") for r in v.get("default_compiled", {}).values()])),
    }


def lock_figure(raw: dict) -> dict:
    """benchmarks/lock_bench.py: one sample per repetition, the median over its interleaved chunk pairs of the time
    with the run lock / without."""
    lock = raw.get("lock") or {"runs": []}
    with_lock, without = by_rep(lock["runs"], variant="lock"), by_rep(lock["runs"], variant="none")
    samples = [summary([ratio(a, b) for a, b in zip(with_lock[i]["chunk_s"], without[i]["chunk_s"])])["median"]
               for i in sorted(with_lock) if i in without]
    return figure(samples, "ratio", "step time of the same in-process loop (tabular_mlp.yaml's model and batch, one "
                  f"thread) with the run lock held, its fence checked every {lock.get('log_every')} steps and a "
                  f"heartbeat every {lock.get('heartbeat_s')} s / without, the median of interleaved chunk pairs per "
                  "repetition (benchmarks/lock_bench.py)",
                  notes=[] if samples else ["not measured in this result: python benchmarks/run.py --only lock"])


def finetune_parts(raw: dict) -> dict:
    """benchmarks/finetune_bench.py's raw runs by part and repetition: memory {strategy: {rep: [ranks]}}, step
    {variant: {rep: chunk times, each the slowest rank's}}, load {variant: {rep: seconds}}."""
    ft = raw.get("finetune") or {}
    memory: dict = {}
    for r in (ft.get("memory") or {}).get("runs", []):
        memory.setdefault(r["strategy"], {}).setdefault(r["rep"], []).append(r)
    per_rank: dict = {}
    for r in (ft.get("step") or {}).get("runs", []):
        per_rank.setdefault(r["variant"], {}).setdefault(r["rep"], []).append(r["chunk_s"])
    step = {v: {rep: [max(ranks) for ranks in zip(*chunks)] for rep, chunks in reps.items()}
            for v, reps in per_rank.items()}
    load: dict = {}
    for r in (ft.get("load") or {}).get("runs", []):
        load.setdefault(r["variant"], {})[r["rep"]] = r["seconds"]
    return {"memory": memory, "step": step, "load": load}


def finetune_figures(raw: dict) -> dict:
    """benchmarks/finetune_bench.py, a sample per repetition each: the largest rank's memory rise while it builds
    the model from init.from / the model's fp32 size (FSDP, and DDP for comparison); the median over interleaved
    chunk pairs of the step time with half the blocks frozen / all trainable; init_model given the digest / load_file (+ read)."""
    ft = raw.get("finetune") or {}
    parts = finetune_parts(raw)
    missing = [] if ft else ["not measured in this result: python benchmarks/run.py --only finetune"]
    m = ft.get("model") or {}
    model = (f"{m['params'] / 1e6:.1f}M parameters ({m['blocks']} blocks of {m['width']} -> {m['hidden']} -> "
             f"{m['width']}), init.from a {m['file_bytes'] / 1e9:.2f} GB safetensors file, 2 ranks" if m else None)

    def memory(strategy: str, key: str) -> list:  # the largest rank's; None where a rank has no figure
        per = parts["memory"].get(strategy, {})
        largest = [[r.get(key) for r in per[i]] for i in sorted(per)]
        return [ratio(max(xs) if all(finite(x) for x in xs) else None, per[i][0]["full_bytes"])
                for i, xs in zip(sorted(per), largest)]

    def memory_figure(strategy: str, what: str) -> dict:
        devices = sorted({r["device"] for ranks in parts["memory"].get(strategy, {}).values() for r in ranks})
        return figure(memory(strategy, "peak_increase_bytes"), "ratio", what, notes=missing, model=model,
                      devices=devices, rss_ratio=summary(memory(strategy, "peak_rss_increase_bytes")))

    counted = ("the largest rank's peak memory rise during Trainer.build_model (building the model and loading "
               "init.from, up to the optimizer) / the model's full fp32 size, per repetition: on CPU the rank's "
               "anonymous resident memory (RssAnon; rss_ratio counts the file's mmap'd pages too), on CUDA "
               "max_memory_allocated (benchmarks/finetune_bench.py)")
    frozen, trainable = parts["step"].get("frozen", {}), parts["step"].get("trainable", {})
    reps = sorted(frozen.keys() & trainable.keys())
    st = ft.get("step") or {}
    per_step = st.get("chunk_steps") or 1
    load = parts["load"]

    def load_ratio(a: str, b: str) -> list:
        x, y = load.get(a, {}), load.get(b, {})
        return [ratio(x[i], y[i]) for i in sorted(x.keys() & y.keys())]

    return {
        "init_peak_memory_ratio": memory_figure("fsdp", f"train.strategy=fsdp: {counted}"),
        "init_peak_memory_ratio_ddp": memory_figure("ddp", f"train.strategy=ddp: {counted}"),
        "frozen_step_time_ratio": figure(
            [summary([ratio(a, b) for a, b in zip(frozen[i], trainable[i])])["median"] for i in reps], "ratio",
            "step time (Trainer.step) with optim.groups freezing the first half of the blocks / all trainable, the "
            "same model on 2 DDP ranks, the median of interleaved chunk pairs per repetition "
            "(benchmarks/finetune_bench.py)", notes=missing,
            model=(f"{st['params'] / 1e6:.1f}M parameters, {st['trainable_params']['frozen'] / 1e6:.1f}M trainable "
                   f"when frozen, {st['batch_per_rank']} rows per rank, {st['world_size']} ranks" if st else None),
            frozen_step_s=summary([summary(frozen[i])["median"] / per_step for i in reps]),
            trainable_step_s=summary([summary(trainable[i])["median"] / per_step for i in reps])),
        "init_load_ratio": figure(
            load_ratio("init_model_given_sha256", "load_file_read"), "ratio",
            "time to load the init.from file into a built model as a worker does (stride.trainers.pretrained."
            "init_model with the driver's sha256, RunPlan.init_sha256) / safetensors.torch.load_file of the same file "
            "with every tensor it returns read into memory (.clone(); load_file alone maps the file and reads "
            "nothing), one process, warm page cache, per repetition",
            notes=missing, model=model, lazy_ratio=summary(load_ratio("init_model_given_sha256", "load_file")),
            # init_model hashing the file itself: only where the load part cleared the process's digests first
            # ("digest": "cold"); before, its init_model variant reused the digest computed before timing.
            hashing_ratio=(summary(load_ratio("init_model", "load_file_read"))
                           if (ft.get("load") or {}).get("digest") == "cold" else None),
            **{f"{v}_s": summary(list(load.get(v, {}).values()))
               for v in ("init_model", "init_model_given_sha256", "load_file_read", "load_file")}),
    }


def file_read_rates(raw: dict) -> dict:
    """benchmarks/file_read_bench.py's rows/s {variant: {rep: [per pair]}}."""
    out: dict = {}
    for r in (raw.get("file_read") or {}).get("runs", []):
        out.setdefault(r["variant"], {}).setdefault(r["rep"], []).append(ratio(r["rows"], r["seconds"]))
    return out


def file_read_figure(raw: dict) -> dict:
    """Stride's stream and a thread pool over the same referenced files, alternating: a sample per repetition, the
    median over its pairs of the stream's rows/s / the pool's."""
    fr = raw.get("file_read") or {}
    what = ("rows/s of one epoch reading the files a JSON Lines manifest names, Stride's TrainStream (world size 1, "
            "file_columns=(\"path\",), data.file_read_threads threads, the config's default window, every "
            "micro-batch's bytes touched) / a concurrent.futures.ThreadPoolExecutor of as many threads reading the same "
            "files in the same order (open/read), warm page cache, the median over alternating pairs per repetition "
            "(benchmarks/file_read_bench.py)")
    if not fr:
        return figure([], "ratio", what,
                      notes=["not measured in this result: python benchmarks/run.py --only file_read"])
    rates = file_read_rates(raw)
    stride, pool, small = (rates.get(v, {}) for v in ("stride", "threadpool", "stride_small_window"))
    reps = sorted(stride.keys() & pool.keys())

    def per_rep(a: dict) -> list:
        return [summary([ratio(x, y) for x, y in zip(a[i], pool[i])])["median"] for i in reps if i in a]

    fig = figure(per_rep(stride), "ratio", what,
                 data=f"{fr['files']} files of {fr['file_bytes']} random bytes, {fr['threads']} threads both sides, "
                      f"micro-batches of {fr['batch']}, a window of {fr['window_rows']} rows"
                      f"{' (the whole epoch)' if fr['window_rows'] >= fr['files'] else ''}",
                 stride_rows_per_s=summary([summary(stride[i])["median"] for i in reps]),
                 threadpool_rows_per_s=summary([summary(pool[i])["median"] for i in reps]),
                 small_window_ratio=summary(per_rep(small)),
                 small_window_rows_per_s=summary([summary(small[i])["median"] for i in reps if i in small]),
                 small_window_rows=fr.get("small_window_rows"), started=fr.get("started"),
                 loadavg=summary([r.get("loadavg") for r in fr["runs"]]))
    return fig


def bucketing_parts(raw: dict) -> dict:
    """benchmarks/bucketing_bench.py's runs {variant: {rep: run}}."""
    out: dict = {}
    for r in (raw.get("bucketing") or {}).get("runs", []):
        out.setdefault(r["variant"], {})[r["rep"]] = r
    return out


def bucketing_figures(raw: dict) -> dict:
    """One epoch of the same model and data with data.length_column bucketing and without, alternating: a sample per
    repetition (each repetition its own seed, the same for both sides)."""
    bk = raw.get("bucketing") or {}
    missing = [] if bk else ["not measured in this result: python benchmarks/run.py --only bucketing"]
    parts = bucketing_parts(raw)
    on, off = parts.get("bucketed", {}), parts.get("unbucketed", {})
    reps = sorted(on.keys() & off.keys())
    m = bk.get("model") or {}
    model = (f"{m['layers']} layers, d_model {m['d_model']}, {m['heads']} heads, {m['params'] / 1e6:.2f}M parameters, "
             f"{bk['rows']} rows of lengths {bk['min_length']}..{bk['max_length']} (log-uniform), global batch "
             f"{bk['batch']}, {bk['threads']} torch thread" if m else None)

    def sample(key: str) -> list:
        return [ratio(on[i][key], off[i][key]) for i in reps]

    def side(d: dict, key: str) -> dict:
        return summary([d[i][key] for i in reps])

    return {
        "bucketing_padding_ratio": figure(
            sample("padding_fraction"), "ratio",
            "share of a micro-batch's cells that padding to its longest row fills, over one epoch (datasets/bucketing."
            "Padding over every micro-batch's lengths), data.length_column bucketing on / off, same rows, seed and "
            "global batch, per repetition (benchmarks/bucketing_bench.py)", notes=list(missing), model=model,
            bucketed=side(on, "padding_fraction"), unbucketed=side(off, "padding_fraction"),
            stride_reported=side(on, "stride_padding_fraction")),
        "bucketing_step_time_ratio": figure(
            sample("epoch_s"), "ratio",
            "time of one training epoch (TrainStream's micro-batches padded to their longest row, forward, backward, "
            "AdamW; each side's own time, the two epochs interleaved step by step in one process) of a small causal "
            "transformer, bucketing on / off, same rows, seed and global batch, per repetition "
            "(benchmarks/bucketing_bench.py)", notes=list(missing), model=model,
            bucketed_epoch_s=side(on, "epoch_s"), unbucketed_epoch_s=side(off, "epoch_s"),
            padded_tokens_ratio=summary(sample("padded_tokens")),
            compute_ratio=summary(sample("compute_s")), started=bk.get("started"),
            loadavg=summary([r.get(k) for r in bk.get("runs", []) for k in ("loadavg_before", "loadavg_after")])),
    }


def sinks_figures(raw: dict) -> dict:
    """benchmarks/sinks_bench.py's alternating runs: a sample per repetition, one side over the other."""
    sk = raw.get("sinks") or {}
    missing = [] if sk else ["not measured in this result: python benchmarks/run.py --only sinks"]
    sinks, alone = by_rep(sk.get("runs", []), variant="all"), by_rep(sk.get("runs", []), variant="alone")
    on, off = by_rep(sk.get("ema_runs", []), variant="on"), by_rep(sk.get("ema_runs", []), variant="off")
    pairs, ema_pairs = sorted(sinks.keys() & alone.keys()), sorted(on.keys() & off.keys())
    return {
        "sink_overhead_ratio": figure(
            [ratio(sinks[i]["s_per_step"], alone[i]["s_per_step"]) for i in pairs], "ratio",
            f"seconds per step of the training loop (summary.json's train_wall_s / steps) of tabular_mlp with hidden "
            f"sizes {sk.get('hidden')} in one process (one torch thread), "
            f"{sk.get('steps')} steps logged every {sk.get('log_every')}, tracking.sinks [mlflow, tensorboard, wandb] "
            f"(W&B offline; MLflow's sqlite store) / tracking.sinks [] (metrics.jsonl and the console only), "
            f"alternating, per repetition (benchmarks/sinks_bench.py)", notes=list(missing),
            all_on_ms_per_step=summary([sinks[i]["s_per_step"] * 1e3 for i in pairs]),
            alone_ms_per_step=summary([alone[i]["s_per_step"] * 1e3 for i in pairs]),
            added_ms_per_step=summary([(sinks[i]["s_per_step"] - alone[i]["s_per_step"]) * 1e3 for i in pairs]),
            started=sk.get("started")),
        "ema_step_time_ratio": figure(
            [ratio(on[i]["step_time_s"], off[i]["step_time_s"]) for i in ema_pairs], "ratio",
            f"median step_time_s past step {sk.get('warmup')} of an MLP {sk.get('hidden')} under FSDP on 2 CPU "
            f"ranks (torch.distributed.run), train.ema on / off, {sk.get('ema_steps')} steps, alternating, per "
            f"repetition (benchmarks/sinks_bench.py)", notes=list(missing),
            on_ms=summary([on[i]["step_time_s"] * 1e3 for i in ema_pairs]),
            off_ms=summary([off[i]["step_time_s"] * 1e3 for i in ema_pairs])),
    }


def commands_figures(raw: dict) -> dict:
    """benchmarks/commands_bench.py's alternating runs: a sample per repetition, one side over the other."""
    cm = raw.get("commands") or {}
    missing = [] if cm else ["not measured in this result: python benchmarks/run.py --only commands"]
    stride, hand = by_rep(cm.get("predict_runs", []), variant="stride"), by_rep(cm.get("predict_runs", []), variant="hand")
    firsts = {v: by_rep(cm.get("first_step_runs", []), variant=v) for v in ("embedded", "head", "torchrun")}
    pairs = sorted(stride.keys() & hand.keys())

    def first_ratio(side: str) -> list:
        reps = sorted(firsts[side].keys() & firsts["torchrun"].keys())
        return [ratio(firsts[side][i]["first_step_s"], firsts["torchrun"][i]["first_step_s"]) for i in reps]

    def seconds(side: str) -> dict:
        return summary([r["first_step_s"] for r in firsts[side].values()])

    lost = [r["steps_lost"] for r in cm.get("preemption_runs", []) if r.get("steps_lost") is not None]
    first_what = ("seconds from the launch to the first training line of metrics.jsonl (tabular_mlp, hidden sizes "
                  f"{cm.get('hidden')}, 2 CPU workers), alternating, per repetition (benchmarks/commands_bench.py)")
    return {
        "predict_throughput_ratio": figure(
            [ratio(stride[i]["rows_per_s"], hand[i]["rows_per_s"]) for i in pairs], "ratio",
            f"rows per second, launch to exit, over {cm.get('predict_rows')} rows in {cm.get('row_groups')} row "
            f"groups of an MLP {cm.get('hidden')}: `stride predict` on 2 CPU workers (torchrun) / a hand-written "
            f"torch.no_grad() loop on 2 processes writing the same Parquet, alternating, per repetition "
            f"(benchmarks/commands_bench.py)", notes=list(missing),
            stride_rows_per_s=summary([stride[i]["rows_per_s"] for i in pairs]),
            hand_rows_per_s=summary([hand[i]["rows_per_s"] for i in pairs]), started=cm.get("started")),
        "time_to_first_step_ratio": figure(
            first_ratio("embedded"), "ratio", f"`stride train` with an embedded Ray / torchrun: {first_what}",
            notes=list(missing), stride_s=seconds("embedded"), torchrun_s=seconds("torchrun")),
        "preemption_steps_lost": figure(
            lost, "steps",
            "optimizer steps trained after the last checkpoint before a node's preemption and trained again by the "
            "restarted gang, per repetition (benchmarks/preemption_bench.py: a two-node cluster on this machine, ray "
            "drain-node --reason DRAIN_NODE_REASON_PREEMPTION under a 2-worker elastic run)",
            notes=list(missing), worst=max(lost, default=None),
            resumed_after_deadline_s=summary([r["resumed_after_deadline_s"] for r in cm.get("preemption_runs", [])
                                              if r.get("resumed_after_deadline_s") is not None])),
        "time_to_first_step_on_head_ratio": figure(
            first_ratio("head"), "ratio", f"`stride train` joining a running head (RAY_ADDRESS) / torchrun: {first_what}",
            notes=list(missing), stride_s=seconds("head"), torchrun_s=seconds("torchrun")),
    }


def bucket_runs(raw: dict) -> dict:
    """benchmarks/bucket_bench.py's launches {(variant, phase): {rep: run}}."""
    out: dict = {}
    for r in (raw.get("bucket") or {}).get("runs", []):
        out.setdefault((r["variant"], r["phase"]), {})[r["rep"]] = r
    return out


def bucket_run_stats(run: dict, warmup: int) -> dict:
    """One training launch's checkpoint blocking (summed over its log lines: every mid-run checkpoint's), its
    checkpoints' write times (to complete on storage, uploads included) and its median step time past the warm-up."""
    train = [x for x in run["metrics"] if "train_loss" in x]
    blocked = [x["checkpoint_blocked_s"] for x in train if finite(x.get("checkpoint_blocked_s"))]
    summ = run.get("summary") or {}
    return {"blocked_s": sum(blocked) if blocked else None, "checkpoints": len(blocked),
            "write_s": median_of(train, "checkpoint_write_s"),
            "step_time_s": median_of([x for x in train if x["step"] > warmup], "step_time_s"),
            "s_per_step": ratio(summ.get("train_wall_s"), summ.get("global_step"))}


def bucket_figures(raw: dict) -> dict:
    """The same run on the local S3 server and in a folder, alternating which goes first: a sample per repetition,
    the bucket's over the folder's."""
    bk = raw.get("bucket") or {}
    missing = [] if bk else ["not measured in this result: python benchmarks/run.py --only bucket"]
    runs = bucket_runs(raw)
    warmup = bk.get("warmup", 0)
    stats = {v: {i: bucket_run_stats(r, warmup) for i, r in runs.get((v, "train"), {}).items()}
             for v in ("bucket", "folder")}
    reps = sorted(stats["bucket"].keys() & stats["folder"].keys())
    ckpt = [r["checkpoint_bytes"] for r in runs.get(("folder", "train"), {}).values() if finite(r.get("checkpoint_bytes"))]
    job = (f"tabular_mlp, hidden sizes {bk.get('hidden')}, {bk.get('world_size')} CPU ranks of one thread under "
           f"torchrun, {bk.get('steps')} steps, a checkpoint every {bk.get('ckpt_every')} (~{statistics.median(ckpt) / 2**20:.0f} "
           f"MiB) and at the end, checkpoint.upload={bk.get('upload')}, the S3 server (moto_server) on the same CPUs"
           if bk and ckpt else None)

    def sample(key: str) -> list:
        return [ratio(stats["bucket"][i][key], stats["folder"][i][key]) for i in reps]

    def side(v: str, key: str) -> dict:
        return summary([stats[v][i][key] for i in reps])

    def launch_s(phase: str, v: str, key: str) -> dict:
        return summary([r.get(key) for r in runs.get((v, phase), {}).values()])

    def first(phase: str) -> list:
        a, b = runs.get(("bucket", phase), {}), runs.get(("folder", phase), {})
        return [ratio(a[i]["first_step_s"], b[i]["first_step_s"]) for i in sorted(a.keys() & b.keys())]

    return {
        "bucket_checkpoint_blocked_ratio": figure(
            sample("blocked_s"), "ratio",
            "seconds of training blocked by the run's mid-run checkpoints (checkpoint_blocked_s of metrics.jsonl, "
            "summed: each checkpoint's staging and any wait for the previous one's write and upload), run.storage_path "
            "s3:// on a local S3-compatible server / a local folder, the same job and cadence, alternating, per "
            "repetition (benchmarks/bucket_bench.py)", notes=list(missing), job=job,
            bucket_blocked_s=side("bucket", "blocked_s"), folder_blocked_s=side("folder", "blocked_s"),
            bucket_write_s=side("bucket", "write_s"), folder_write_s=side("folder", "write_s")),
        "bucket_step_time_ratio": figure(
            sample("step_time_s"), "ratio",
            f"median step_time_s of metrics.jsonl past step {warmup} (checkpoints' uploads going on in the background "
            "included), run on s3:// / in a folder, the same job, alternating, per repetition "
            "(benchmarks/bucket_bench.py)", notes=list(missing), job=job,
            bucket_step_time_s=side("bucket", "step_time_s"), folder_step_time_s=side("folder", "step_time_s"),
            s_per_step_ratio=summary(sample("s_per_step"))),
        "bucket_resume_ratio": figure(
            first("resume"), "ratio",
            f"seconds from the launch to the end of the first optimizer step of a resume ({bk.get('resume_steps')} "
            "more steps of the run just trained, from its final checkpoint: downloaded and verified from the bucket, "
            "or read from the folder), s3:// / folder, alternating, per repetition (benchmarks/bucket_bench.py)",
            notes=list(missing), job=job, bucket_first_step_s=launch_s("resume", "bucket", "first_step_s"),
            folder_first_step_s=launch_s("resume", "folder", "first_step_s"),
            bucket_resumed_line_s=launch_s("resume", "bucket", "resumed_line_s"),
            folder_resumed_line_s=launch_s("resume", "folder", "resumed_line_s"),
            fresh_start_ratio=summary(first("train"))),
    }


def hsdp_runs(raw: dict) -> dict:
    """benchmarks/hsdp_bench.py's records {strategy: {step: [one per rank]}}."""
    out: dict = {}
    for r in (raw.get("hsdp") or {}).get("runs", []):
        out.setdefault(r["strategy"], {}).setdefault(r["step"], []).append(r)
    return out


def hsdp_largest(raw: dict, strategy: str, key: str) -> dict:
    """{step: the largest rank's `key`} of one strategy's measured steps: what the busiest machine holds or sends."""
    return {step: max(r[key] for r in ranks) for step, ranks in hsdp_runs(raw).get(strategy, {}).items()}


def hsdp_collectives(raw: dict) -> dict:
    """{strategy: {op: calls per step}}, rank 0's first measured step: which collectives the wrapper saw."""
    out = {}
    for strategy, steps in hsdp_runs(raw).items():
        first = min(steps[min(steps)], key=lambda r: r["rank"])
        out[strategy] = {op: c["calls"] for op, c in first["collectives"].items()}
    return out


def hsdp_figures(raw: dict) -> dict:
    """ddp, fsdp and hsdp in one launch of 4 ranks: a sample per measured step, the largest rank's bytes under hsdp
    over the largest rank's under the other strategy at the same step."""
    hs = raw.get("hsdp") or {}
    missing = [] if hs else ["not measured in this result: python benchmarks/run.py --only hsdp"]
    p = hs.get("param_bytes")

    def sample(key: str, base: str) -> list:
        a, b = hsdp_largest(raw, "hsdp", key), hsdp_largest(raw, base, key)
        return [ratio(a[i], b[i]) for i in sorted(a.keys() & b.keys())]

    def per_strategy(key: str, strategies: tuple) -> dict:
        """The largest rank's bytes per strategy, and the same in units of P (the model's fp32 parameter bytes)."""
        return {s: {"bytes": summary(list(hsdp_largest(raw, s, key).values())),
                    "of_param_bytes": summary([ratio(x, p) for x in hsdp_largest(raw, s, key).values()])}
                for s in strategies if s in hsdp_runs(raw)}

    m = hs.get("model") or {}
    model = (f"char_gpt {m.get('layers')} layers x width {m.get('width')}, context {m.get('context')} "
             f"({hs['params'] / 1e6:.1f}M parameters, fp32), AdamW, {hs.get('world_size')} CPU ranks of one thread "
             f"(gloo), batch {hs.get('batch')} x {m.get('context')} tokens per rank; hsdp's shard groups "
             f"{hs.get('groups')}" if hs else None)
    shape = (f"shard size {hs['shard_size']}, {hs['world_size'] // hs['shard_size']} replicas" if hs else
             "shard size 2, 2 replicas")
    counted = (f"; {hs.get('steps')} measured steps after {hs.get('warmup_steps')} warm-up per strategy, in one "
               f"torch.distributed.run launch (benchmarks/hsdp_bench.py): byte counts, the same at every steady step"
               if hs else "")
    return {
        "hsdp_param_memory_ratio": figure(
            sample("held_bytes", "ddp"), "ratio",
            "bytes of a rank's parameters (local shards), their gradients and AdamW's state after a step (tensor "
            "sizes: DDP's buckets, FSDP's gathered units and activations not counted), train.strategy hsdp "
            f"({shape}) / ddp, the largest rank, per measured step{counted}", notes=list(missing), model=model,
            held=per_strategy("held_bytes", ("ddp", "fsdp", "hsdp"))),
        "hsdp_cross_group_bytes_ratio": figure(
            sample("cross_group_bytes", "fsdp"), "ratio",
            "bytes a rank sends per step to the ranks outside its hsdp shard group, hsdp / fsdp (one flat mesh over "
            "the same ranks), the largest rank, per measured step: torch.distributed's collectives wrapped, each "
            "call's bytes to each other member of its group modelled independently of the algorithm (all-gather "
            f"of b bytes: b to each; reduce-scatter of N: N/n to each; all-reduce of N: 2N/n to each){counted}",
            notes=list(missing), model=model,
            cross_group=per_strategy("cross_group_bytes", ("fsdp", "hsdp")),
            sent=per_strategy("sent_bytes", ("fsdp", "hsdp")), collectives_per_step=hsdp_collectives(raw)),
    }


ORDER = ("step_time_ratio", "wall_ratio", "time_to_first_step_s (stride)", "time_to_first_step_s (torchrun)",
         "ingest_ratio", "jsonl_ingest_ratio", "data_wait_fraction", "scaling_2_over_1", "ckpt_blocked_fraction",
         "memory_growth_ratio", "jsonl_memory_growth_ratio", "checkpoint_rank0_memory_ratio",
         "checkpoint_blocked_ratio", "ac_memory_ratio", "ac_step_time_ratio", "compile_step_time_ratio",
         "lock_overhead_ratio", "init_peak_memory_ratio", "init_peak_memory_ratio_ddp", "frozen_step_time_ratio",
         "init_load_ratio", "file_read_ratio", "bucketing_padding_ratio", "bucketing_step_time_ratio",
         "sink_overhead_ratio", "ema_step_time_ratio", "predict_throughput_ratio", "time_to_first_step_ratio",
         "time_to_first_step_on_head_ratio", "preemption_steps_lost", "bucket_checkpoint_blocked_ratio",
         "bucket_step_time_ratio", "bucket_resume_ratio", "hsdp_param_memory_ratio", "hsdp_cross_group_bytes_ratio")


def figures(raw: dict) -> dict:
    """Every figure, in the table's order."""
    figs = {**pair_figures(raw), "ingest_ratio": ingest_figure(raw), "jsonl_ingest_ratio": jsonl_ingest_figure(raw),
            "scaling_2_over_1": scaling_figure(raw), "memory_growth_ratio": memory_figure(raw),
            "jsonl_memory_growth_ratio": jsonl_memory_figure(raw), **checkpoint_figures(raw), **blocks_figures(raw),
            "lock_overhead_ratio": lock_figure(raw), **finetune_figures(raw), "file_read_ratio": file_read_figure(raw),
            **bucketing_figures(raw), **sinks_figures(raw), **commands_figures(raw), **bucket_figures(raw),
            **hsdp_figures(raw)}
    headers = raw.get("headers") or {}  # {part: run header}: when, where, at what commit each part was measured
    return {name: {**figs[name], "part": FIGURE_PART[name], "run": headers.get(FIGURE_PART[name])} for name in ORDER}


# ---------------------------------------------------------------- verdicts

def met(value: float, op: str, threshold: float) -> bool:
    return {"<=": value <= threshold, "<": value < threshold, ">=": value >= threshold, ">": value > threshold}[op]


def verdict(fig: dict, goal: tuple[str, float] | None) -> dict:
    """PASS or FAIL on the median of at least MIN_SAMPLES samples; fewer give no verdict, and so does a figure whose
    `no_verdict` says it was not measured as its goal asks. A median that includes lower bounds (samples of stopped
    runs) can only fail an upper limit it is already over, since the true median is at least as high; within the
    limit it gives no verdict."""
    if goal is None:
        return {"goal": None, "pass": None, "verdict": "-"}
    op, thr = goal
    out = {"goal": f"{op} {thr:g}", "pass": None}
    if fig.get("no_verdict"):  # measured, but not as the goal asks (ingest_ratio at unequal threads)
        return {**out, "verdict": f"no verdict ({fig['no_verdict']})"}
    if fig["n"] < MIN_SAMPLES:
        return {**out, "verdict": f"no verdict (n={fig['n']} < {MIN_SAMPLES})"}
    ok = met(fig["median"], op, thr)
    if fig["lower_bound"]:
        if op in ("<=", "<") and not ok:
            return {**out, "pass": False, "verdict": "FAIL (a lower bound over the goal)"}
        return {**out, "verdict": "no verdict (a lower bound within the goal)"}
    return {**out, "pass": ok, "verdict": "PASS" if ok else "FAIL"}


def goals(figs: dict) -> dict:
    return {name: verdict(f, GOALS.get(name)) for name, f in figs.items()}


# ---------------------------------------------------------------- tables

def fmt(x, unit: str) -> str:
    if x is None:
        return "-"
    return f"{x:.1f} s" if unit == "s" else f"{x:.3f}"


def spread(f: dict) -> str:
    """min..max: the spread printed beside every median."""
    return "-" if f["n"] == 0 else f"{fmt(f['min'], f['unit'])}..{fmt(f['max'], f['unit'])}"


def notes(figs: dict) -> list[str]:
    return [f"{name}: {note}" for name, f in figs.items() for note in f["notes"]]


def table(figs: dict, verdicts: dict) -> str:
    """The plain-text table run.py prints: median, spread, n, goal and verdict of every figure, then the notes."""
    rows = [("figure", "median", "spread (min..max)", "n", "goal", "result")]
    for name, f in figs.items():
        v = verdicts[name]
        rows.append((name, fmt(f["median"], f["unit"]), spread(f), str(f["n"]), v["goal"] or "-", v["verdict"]))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines + [f"* {n}" for n in notes(figs)])


def replay(raw: dict) -> dict:
    """What run.py stores beside the raw runs, and what the test recomputes from them."""
    figs = figures(raw)
    verdicts = goals(figs)
    return {"figures": figs, "goals": verdicts, "table": table(figs, verdicts)}


def md_table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + ["| " + " | ".join(r) + " |" for r in rows]


def when(iso: str | None) -> str:
    """2026-11-25T12:18:42 -> 2026-11-25 12:18."""
    return iso[:16].replace("T", " ") if iso else "unknown"


def cpus(m: dict) -> str:
    return f"{m.get('cpu_model') or 'unknown CPU'}, {m.get('cpu_count') or '?'} CPUs"


def commit_of(h: dict) -> str:
    sha = h.get("commit")
    if not sha:
        return "commit unknown"
    return f"`{sha[:10]}`" + (" + uncommitted changes" if h.get("dirty") else "")


def about(result: dict) -> str:
    """One sentence: the last full run (latest.json's own header), on what machine, under what load."""
    m = result["machine"]
    commit = f", {commit_of(result)}" if "commit" in result else ""
    return (f"`benchmarks/run.py --{result['mode']}` started {result['started']} on {m['cpu_count']} CPUs "
            f"({m.get('cpu_model', '?')}, {m.get('mem_gib', '?')} GiB), torch {m.get('torch', '?')}, Ray "
            f"{m.get('ray', '?')}{commit}; load average {result['loadavg_start'][0]:.1f} at the start, "
            f"{result['loadavg_end'][0]:.1f} at the end; {result['duration_s'] / 60:.0f} minutes.")


GIB = 2**30


def part_headers(result: dict) -> dict:
    """{part: its run header, or None} (report.run_header; a result written before headers has none)."""
    headers = result["raw"].get("headers") or {}
    return {part: headers.get(part) for part in PARTS}


def legacy_header(raw: dict, part: str) -> dict | None:
    """What a part measured before run headers kept of its own run, where it kept anything: its start, its CPU and
    the load averages its runs recorded."""
    x = raw.get(part)
    if not isinstance(x, dict) or not x.get("started"):
        return None
    loads = [v[0] if isinstance(v, list) else v for r in x.get("runs", []) for k, v in r.items()
             if k.startswith("loadavg") and (finite(v) or (isinstance(v, list) and v and finite(v[0])))]
    return {"started": x["started"], "machine": {"cpu_count": x.get("cpu_count"), "cpu_model": x.get("cpu_model")},
            "loads": [min(loads), max(loads)] if loads else None}


def measured(result: dict, part: str, stale: dict) -> str:
    """Where and when a part was measured, at what commit, and **stale** when its code changed since (or nobody
    knows): the `measured` column of the tables."""
    h = part_headers(result)[part] or legacy_header(result["raw"], part)
    text = f"{when(h['started'])}, {cpus(h['machine'])}, {commit_of(h)}" if h else "unknown"
    return text + (", **stale**" if stale.get(part) else "")


def runs_table(result: dict, stale: dict) -> list[str]:
    """One row per benchmark part: its own run header, and whether the code it measures changed since."""
    rows = []
    for part, h in part_headers(result).items():
        old = h or legacy_header(result["raw"], part) or {}
        m = old.get("machine") or {}
        machine = cpus(m) if old else "unknown"
        if h:
            machine += (f", {m.get('mem_gib', '?')} GiB; torch {m.get('torch', '?')}, Ray {m.get('ray', '?')}")
        load = (f"{h['loadavg_start'][0]:.1f}, {h['loadavg_end'][0]:.1f}" if h and h.get("loadavg_end") else
                f"{old['loads'][0]:.1f}..{old['loads'][1]:.1f} over its runs" if old.get("loads") else "-")
        minutes = f"{h['duration_s'] / 60:.1f} min" if h and finite(h.get("duration_s")) else "-"
        state = f"**stale**: {stale[part]}" if stale.get(part) else "current"
        rows.append([f"`{part}`", ", ".join(f"`{n}`" for n in PARTS[part]["figures"]),
                     f"{when(old.get('started'))}{f' (`--{mode}`)' if h and (mode := h.get('mode')) else ''}",
                     machine, commit_of(old) if old else "commit unknown", load, minutes, state])
    return md_table(["part", "figures", "started", "machine", "commit", "load average (start, end)", "duration",
                     "state"], rows)


def goal_counts(result: dict, stale: dict) -> str:
    """The verdicts of every goal figure in one sentence, the FAILs named, and how many figures are stale."""
    verdicts = result["goals"]
    names = [n for n in ORDER if n in GOALS]
    passed = [n for n in names if verdicts[n]["pass"] is True]
    failed = [n for n in names if verdicts[n]["pass"] is False]
    stale_figures = [n for n in ORDER if stale.get(FIGURE_PART[n])]
    fails = f" ({', '.join(f'`{n}`' for n in failed)})" if failed else ""
    return (f"{len(names)} goals: {len(passed)} PASS, {len(failed)} FAIL{fails}, "
            f"{len(names) - len(passed) - len(failed)} without a verdict; {len(stale_figures)} of {len(ORDER)} "
            f"figures stale.")


def last_run(result: dict) -> str:
    """latest.json's own header: the last full `make bench` (a result from before per-part headers kept only this
    one, and did not say which of its figures that run measured)."""
    if "commit" in result:
        return f"latest.json's last full run: {about(result)}"
    return (f"latest.json's top-level header, from before per-part headers (it does not say which figures that run "
            f"measured; `--only` runs since kept it): {about(result)}")


def shown(v: dict) -> str:
    """A verdict as the READMEs' tables show it: a FAIL in bold."""
    return f"**{v['verdict']}**" if v["pass"] is False else v["verdict"]


PROVENANCE = ("Each figure has its own run (`make bench` measures every part; `--only` one part again): the "
              "`measured` column says when, on what CPU and at what commit; **stale**: the code the figure measures "
              "(`PARTS` in `benchmarks/figures.py`) changed since that commit, or the commit is unknown.")


def markdown(result: dict, stale: dict) -> str:
    """The results block of benchmarks/README.md, generated from a stored result (latest.json) and `stale`
    ({part: why its figures are stale, or None}: report.stale_reason at this checkout's HEAD)."""
    figs, verdicts, raw = result["figures"], result["goals"], result["raw"]
    out = [f"{PROVENANCE} {goal_counts(result, stale)}", ""]
    out += md_table(["figure", "what", "median", "spread (min..max)", "n", "goal", "result", "measured"],
                    [[f"`{name}`", LABELS[name], fmt(f["median"], f["unit"]), spread(f), str(f["n"]),
                      verdicts[name]["goal"] or "-", shown(verdicts[name]), measured(result, f["part"], stale)]
                     for name, f in figs.items()])
    extra = notes(figs) + result.get("converted", {}).get("notes", [])
    if extra:
        out += ["", "Notes:", ""] + [f"- {n}" for n in extra]
    out += ["", "Each part's run (its header in latest.json's `raw.headers`; a figure carries its part's as `run`):", ""]
    out += runs_table(result, stale)
    out += ["", last_run(result)]
    ph = phases(raw)
    names = list(dict.fromkeys(k for rt in ph.values() for k in rt))
    out += ["", "Seconds since launch at which each phase of the paired job ended (median over its runs; "
            f"{measured(result, 'pairs', stale)}):", ""]
    out += md_table(["phase", "Stride", "torchrun"],
                    [[f"`{k}`", fmt(ph["stride"].get(k), "s"), fmt(ph["torchrun"].get(k), "s")] for k in names])
    med = checkpoint_medians(raw)
    model = figs["checkpoint_blocked_ratio"]["model"]
    out += ["", f"The checkpoint benchmark per rank, median over repetitions ({model}; "
            f"{measured(result, 'checkpoint', stale)}):", ""]
    out += md_table(["method", "rank", "memory rise", "peak memory", "blocked", "until complete"],
                    [[m, rank, f"{x['peak_increase_bytes'] / GIB:.2f} GiB", f"{x['peak_rss_bytes'] / GIB:.2f} GiB",
                      fmt(x["blocked_s"], "s"), fmt(x["complete_s"], "s")]
                     for m in ("gather", "dcp") for rank, x in med.get(m, {}).items()])
    out += ["", "The activation-checkpointing and compile benchmark per variant, median over repetitions (memory: a "
            f"step's peak rise, live tensors / RSS with glibc's defaults; {measured(result, 'blocks', stale)}):", ""]
    out += md_table(["variant", "model", "step time", "live memory", "RSS"],
                    [[f"`{v}`", f"{x['layers']} layers, width {x['width']}, context {x['context']}, batch {x['batch']}",
                      f"{x['step_s']:.3f} s",
                      "-" if x["allocated_peak_increase_bytes"] is None else
                      f"{x['allocated_peak_increase_bytes'] / 2**20:.1f} MiB",
                      f"{x['peak_increase_bytes'] / 2**20:.1f} MiB"] for v, x in blocks_medians(raw).items()])
    ft = finetune_parts(raw)
    if ft["memory"]:
        model = figs["init_peak_memory_ratio"]["model"]
        out += ["", f"The fine-tuning benchmark's set-up per path, the largest rank, median over repetitions ({model}; "
                "own memory: anonymous RSS on CPU, allocated memory on CUDA; with the file's pages: the RSS, which "
                f"also counts the pages of the mmap'd file the rank read; {measured(result, 'finetune', stale)}):", ""]
        rows = []
        for strategy, per in ft["memory"].items():
            worst = [max(ranks, key=lambda r: r.get("peak_increase_bytes") or 0) for ranks in per.values()]
            med = {k: summary([r.get(k) for r in worst])["median"]
                   for k in ("peak_increase_bytes", "peak_rss_increase_bytes", "full_bytes", "build_s")}
            gib = {k: "-" if v is None else f"{v / GIB:.2f} GiB" for k, v in med.items()}
            rows.append([f"`{strategy}`", gib["full_bytes"], gib["peak_increase_bytes"],
                         gib["peak_rss_increase_bytes"], fmt(med["build_s"], "s")])
        out += md_table(["train.strategy", "model (fp32)", "own memory rise", "with the file's pages",
                         "build_model"], rows)
    if ft["load"]:
        cold = (raw.get("finetune", {}).get("load") or {}).get("digest") == "cold"
        out += ["", "init.from's load, seconds, median over repetitions (one process, one thread, warm page cache"
                f"{'' if cold else '; this run did not time the hashing: its init_model reused a cached digest'}; "
                f"{measured(result, 'finetune', stale)}):", ""]
        out += md_table(["`init_model` hashing the file", "`init_model` given the sha256", "`load_file` + read",
                         "`load_file` alone"],
                        [["-" if v == "init_model" and not cold else
                          f"{summary(list(ft['load'].get(v, {}).values()))['median'] or 0:.3f} s"
                          for v in ("init_model", "init_model_given_sha256", "load_file_read", "load_file")]])
    rates = file_read_rates(raw)
    if rates:
        fr = raw["file_read"]
        out += ["", f"Files by reference, rows/s, median over repetitions ({fr['files']} files of "
                f"{fr['file_bytes'] // 1024} KiB, {fr['threads']} threads, warm page cache; "
                f"{measured(result, 'file_read', stale)}):", ""]
        out += md_table(["Stride's stream (default window)", "thread pool", f"Stride, {fr['small_window_rows']}-row "
                         "windows"],
                        [[f"{summary([summary(x)['median'] for x in rates.get(v, {}).values()])['median'] or 0:,.0f}"
                          for v in ("stride", "threadpool", "stride_small_window")]])
    bk = bucketing_parts(raw)
    if bk:
        model = figs["bucketing_step_time_ratio"]["model"]
        out += ["", f"Length bucketing per side, median over repetitions ({model}; {measured(result, 'bucketing', stale)}):",
                ""]
        rows = []
        for v in ("bucketed", "unbucketed"):
            med = {k: summary([r.get(k) for r in bk.get(v, {}).values()])["median"]
                   for k in ("epoch_s", "compute_s", "padding_fraction", "tokens", "padded_tokens", "val_loss")}
            rows.append([f"`{v}`", fmt(med["epoch_s"], "s"), fmt(med["compute_s"], "s"),
                         fmt(med["padding_fraction"], ""), f"{med['padded_tokens'] or 0:,.0f} for {med['tokens'] or 0:,.0f}",
                         fmt(med["val_loss"], "")])
        out += md_table(["side", "epoch", "forward, backward, AdamW", "padding fraction", "cells (padded) for tokens",
                         "held-out loss"], rows)
    out += bucket_table(result, stale)
    out += hsdp_table(result, stale)
    return "\n".join(out)


def bucket_table(result: dict, stale: dict) -> list[str]:
    """benchmarks/bucket_bench.py per storage, medians over repetitions ([] where the result has no such runs)."""
    runs, bk = bucket_runs(result["raw"]), result["raw"].get("bucket") or {}
    if not runs:
        return []

    def sec(x) -> str:
        return "-" if x is None else f"{x:.2f} s"

    rows = []
    for v in ("folder", "bucket"):
        st = [bucket_run_stats(r, bk["warmup"]) for r in runs.get((v, "train"), {}).values()]
        med = {k: summary([x[k] for x in st])["median"] for k in ("blocked_s", "checkpoints", "write_s", "step_time_s")}
        first = {p: summary([r["first_step_s"] for r in runs.get((v, p), {}).values()])["median"]
                 for p in ("train", "resume")}
        rows.append([f"`{v}`", f"{sec(med['blocked_s'])} ({med['checkpoints'] or 0:.0f} checkpoints)",
                     sec(med["write_s"]), "-" if med["step_time_s"] is None else f"{med['step_time_s'] * 1e3:.1f} ms",
                     sec(first["train"]), sec(first["resume"])])
    return ["", f"Runs on a bucket beside a folder, median over repetitions "
            f"({result['figures']['bucket_step_time_ratio']['job']}; {measured(result, 'bucket', stale)}):", ""] + \
        md_table(["run.storage_path", "blocked by checkpoints (sum)", "a checkpoint's write, until complete on storage",
                  "step time", "launch to first step, fresh", "launch to first step, resume"], rows)


def hsdp_table(result: dict, stale: dict) -> list[str]:
    """benchmarks/hsdp_bench.py per strategy, the largest rank, medians over measured steps ([] where the result has
    no such runs)."""
    raw = result["raw"]
    hs = raw.get("hsdp") or {}
    if not hsdp_runs(raw):
        return []
    p = hs["param_bytes"]

    def size(strategy: str, key: str) -> str:
        x = summary(list(hsdp_largest(raw, strategy, key).values()))["median"]
        return "-" if x is None else f"{x / 2**20:.1f} MiB ({x / p:.3f} P)"

    calls = hsdp_collectives(raw)
    unseen = ["not counted (DDP's reducer, C++)"] * 3  # its all-reduces never pass through torch.distributed's Python
    rows = [[f"`{s}`"] + [size(s, k) for k in ("param_bytes", "grad_bytes", "optim_bytes", "held_bytes")]
            + (unseen if s == "ddp" else [size(s, "sent_bytes"), size(s, "cross_group_bytes"),
                                          ", ".join(f"`{op}` {n}" for op, n in calls.get(s, {}).items())])
            for s in hs["strategies"]]
    return ["", f"Hybrid sharding per strategy, the largest rank, median over measured steps (P: the model's fp32 "
            f"parameter bytes, {p / 2**20:.1f} MiB; {result['figures']['hsdp_param_memory_ratio']['model']}; "
            f"{measured(result, 'hsdp', stale)}):", ""] + \
        md_table(["train.strategy", "parameters", "gradients", "AdamW state", "held", "sent to the other ranks",
                  "sent outside the shard group", "collectives per step (rank 0)"], rows)


def headline(result: dict, stale: dict) -> str:
    """README.md's Performance section: every figure that has a goal, with its verdict, FAILs included, generated
    from a stored result (latest.json) and `stale` (as for markdown())."""
    figs, verdicts = result["figures"], result["goals"]
    rows = [[f"`{name}`", LABELS[name], f"{fmt(f['median'], f['unit'])} ({spread(f)}, n={f['n']})",
             verdicts[name]["goal"], shown(verdicts[name]), measured(result, f["part"], stale)]
            for name, f in figs.items() if name in GOALS]
    return "\n".join([f"{goal_counts(result, stale)} {PROVENANCE}", ""]
                     + md_table(["figure", "what", "median (min..max, n)", "goal", "result", "measured"], rows)
                     + ["", f"{last_run(result)} The figures without a goal, every figure's notes, each part's "
                        "run and the per-part tables: [benchmarks/README.md](benchmarks/README.md#results)."])


# ---------------------------------------------------------------- the generated blocks of the READMEs

def block_markers(name: str) -> tuple[str, str]:
    return f"<!-- {name}: generated from benchmarks/results/latest.json by benchmarks/run.py --render -->", \
        f"<!-- end of {name} -->"


def block(text: str, name: str) -> str | None:
    """The generated block `name` of a README's text (between its markers), or None if it has none."""
    start, end = block_markers(name)
    if start not in text or end not in text:
        return None
    return text.split(start, 1)[1].split(end, 1)[0].strip("\n")


def with_block(text: str, name: str, content: str) -> str:
    """The README's text with block `name` replaced by `content` (the markers must be there already)."""
    start, end = block_markers(name)
    head, rest = text.split(start, 1)
    return f"{head}{start}\n{content}\n{end}{rest.split(end, 1)[1]}"


# README path -> (block name, make(result, stale) -> the block's text)
BLOCKS = {"benchmarks/README.md": ("bench-results", markdown), "README.md": ("bench-headline", headline)}
