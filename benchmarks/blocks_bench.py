"""What train.activation_checkpointing and train.compile cost and save on CPU, side by side.

    python benchmarks/blocks_bench.py                      # the default char_gpt and a deeper one, 5 x 6 timed steps
    python benchmarks/blocks_bench.py --smoke --reps 1 --steps 3 --out blocks.json     # tiny models: a logic check

Each variant runs in a fresh process (so that its peak memory is its own): the char_gpt task's model from
trainers/configs/char_gpt.yaml (or a deeper one), the switches applied as the loop applies them (trainers/blocks.py),
then Stride's own optimizer step (stride.trainers.step.train_step with the task's loss and the config's optimizer) on
random byte sequences, one worker, one thread. Per variant: the median step time after warm-up (compilation happens
there and is reported apart) and the peak RSS above the RSS before the first step (activations, gradients,
optimizer state).

Memory is measured twice, in separate processes. With glibc's defaults (`peak_increase_bytes`: what `ps` shows),
freed blocks stay in the heap and the mmap threshold rises after the first large free, so the RSS peak depends on
the allocator's history as much as on what the step holds: the same code gave 0.56 to 0.74 for the deep model's
ratio. The ratio `ac_memory_ratio` is taken from a second run of the same variant with MALLOC_MMAP_THRESHOLD_=65536
(`allocated_peak_increase_bytes`): every block of 64 KiB or more is its own mapping, returned at free, so RSS
follows the tensors alive at each moment - on CPU what torch.cuda.max_memory_allocated is on a GPU (0.32, the same
in every run). Step times come from the default-allocator runs only. Variants, alternating order between
repetitions:

* default char_gpt (3 layers, width 128, context 64, 32 sequences), activation checkpointing off / on;
* a deeper one (12 layers, width 192, context 128, 16 sequences), off / on;
* the default char_gpt, torch.compile off / on (inductor, mode default).

`measure` returns the raw runs (one per variant and repetition) for benchmarks/run.py; benchmarks/figures.py turns
them into ac_memory_ratio, ac_step_time_ratio and compile_step_time_ratio, one sample per repetition (--reps, 5).
Alone, the script prints those figures and each variant's medians as JSON (--out adds the raw runs).
"""

from __future__ import annotations

import argparse
import json
import os
import runpy
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.append(str(REPO))  # appended: the repository's datasets/ must not hide Hugging Face's `datasets`

from benchmarks.procs import rss_bytes  # noqa: E402

MODELS = {  # overrides of trainers/configs/char_gpt.yaml
    "default": [],
    "deep": ["model.n_layers=12", "model.width=192", "model.n_heads=4", "model.context=128",
             "train.batch_size_per_worker=16"],
}
VARIANTS = {  # name: (model, overrides)
    "default": ("default", []),
    "default_ac": ("default", ["train.activation_checkpointing=true"]),
    "deep": ("deep", []),
    "deep_ac": ("deep", ["train.activation_checkpointing=true"]),
    "default_compiled": ("default", ["train.compile=true"]),
}




def one(variant: str, steps: int, warmup: int, smoke: bool) -> dict:
    """Runs in its own process: one variant's step times and peak memory."""
    import numpy as np
    import torch

    from stride.trainers import blocks
    from stride import load_config
    from stride.trainers.optim import build_optimizer
    from stride.trainers.step import Precision, train_step
    from stride.trainers.tasks import make_task

    torch.set_num_threads(1)
    model_name, extra = VARIANTS[variant]
    overrides = MODELS[model_name] + extra + (["model.n_layers=2", "model.width=32", "model.n_heads=2",
                                               "model.context=32", "train.batch_size_per_worker=4"] if smoke else [])
    cfg = load_config(str(REPO / "trainers/configs/char_gpt.yaml"), overrides)
    task = make_task(cfg, {})
    torch.manual_seed(0)
    model = task.build_model()
    units = task.blocks(model)
    if cfg.train.activation_checkpointing:
        blocks.checkpoint_activations(units, cfg.train.activation_checkpointing_every)
    if cfg.train.compile:
        blocks.compile_blocks(model, units, cfg.train.compile_mode)
    optimizer = build_optimizer(cfg, model, 1)
    precision = Precision.create("fp32", torch.device("cpu"))
    scaler = precision.grad_scaler()
    rng = np.random.default_rng(0)
    B, T = cfg.train.batch_size_per_worker, cfg.model.context

    def batch():
        return task.transform({"tokens": rng.integers(0, 256, size=(B, T + 1), dtype=np.int64)})

    batches = [{k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in batch().items()} for _ in range(4)]
    peak, base, stop = [0], rss_bytes(), threading.Event()

    def sample():
        while not stop.wait(0.002):
            peak[0] = max(peak[0], rss_bytes())

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    times = []
    t_first = time.perf_counter()
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        train_step(task.loss, model, optimizer, scaler, precision, [batches[i % len(batches)]], cfg.optim.grad_clip_norm)
        times.append(time.perf_counter() - t0)
    stop.set()
    sampler.join()
    return {"variant": variant, "model": model_name, "params": sum(p.numel() for p in model.parameters()),
            "batch": B, "context": T, "layers": cfg.model.n_layers, "width": cfg.model.width,
            "step_s": statistics.median(times[warmup:]), "warmup_s": sum(times[:warmup]),
            "first_steps_s": time.perf_counter() - t_first, "peak_increase_bytes": max(peak[0], rss_bytes()) - base}


def measure(reps: int = 5, steps: int = 6, warmup: int = 2, smoke: bool = False, timeout_s: float = 600) -> dict:
    """Every variant once per repetition, alternating the order; the memory variants once more with the mmap
    threshold. Returns the raw runs (one per variant and repetition): benchmarks/figures.py makes the figures."""
    runs: list[dict] = []
    names = list(VARIANTS)
    memory_names = [v for v in names if "compiled" not in v]
    with tempfile.TemporaryDirectory(prefix="stride-blocks-bench-") as tmp:

        def child(variant: str, rep: int, n_steps: int, n_warmup: int, env: dict) -> dict:
            out = Path(tmp) / f"{variant}_{rep}_{len(env)}.json"
            cmd = [sys.executable, str(Path(__file__).resolve()), "--one", variant, "--steps", str(n_steps),
                   "--warmup", str(n_warmup), "--result", str(out)] + (["--smoke"] if smoke else [])
            r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout_s,
                               env=dict(os.environ, OMP_NUM_THREADS="1", **env))
            if r.returncode != 0:
                raise RuntimeError(f"blocks_bench {variant} failed (exit {r.returncode}):\n{r.stderr[-3000:]}")
            return json.loads(out.read_text())

        for rep in range(reps):
            mine = {}
            for variant in (names if rep % 2 == 0 else names[::-1]):
                mine[variant] = dict(child(variant, rep, steps, warmup, {}), rep=rep)
            for variant in (memory_names if rep % 2 == 0 else memory_names[::-1]):  # two steps reach the peak
                mine[variant]["allocated_peak_increase_bytes"] = child(
                    variant, rep, 1, 1, {"MALLOC_MMAP_THRESHOLD_": "65536"})["peak_increase_bytes"]
            runs.extend(mine[v] for v in names)
    return {"runs": runs}


def report(raw: dict) -> dict:
    """A standalone run's figures, computed as make bench computes them (benchmarks/figures.py, run by path: the
    repository root is not on sys.path here)."""
    f = runpy.run_path(str(Path(__file__).with_name("figures.py")))
    figs = f["blocks_figures"]({"blocks": raw})
    return {"figures": figs, "goals": f["goals"](figs), "variants": f["blocks_medians"]({"blocks": raw})}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5, help="repetitions (samples); a verdict needs 5")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--smoke", action="store_true", help="tiny models (a logic check)")
    ap.add_argument("--out", help="also write the JSON here")
    ap.add_argument("--one", choices=list(VARIANTS), help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.one:
        Path(args.result).write_text(json.dumps(one(args.one, args.steps, args.warmup, args.smoke)))
        return 0
    raw = measure(args.reps, args.steps, args.warmup, args.smoke)
    out = report(raw)
    print(json.dumps(out, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps({"raw": raw, **out}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    if not __package__:  # run as a file from a checkout: import Stride as the `stride` package
        import runpy

        runpy.run_path(str(REPO / "stride" / "_checkout.py"))
    sys.exit(main())
