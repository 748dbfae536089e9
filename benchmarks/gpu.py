"""GPU benchmark: Stride's training step against hand-written PyTorch loops, tokens/s and MFU for char_gpt.

    torchrun --nproc-per-node 1 benchmarks/gpu.py                        # S, M, L x fp32, bf16, fp16 x compile off/on
                                                                         # x activation checkpointing off/on
    torchrun --nproc-per-node 1 benchmarks/gpu.py --shapes L --modes bf16 --compile on --profile /tmp/traces
    torchrun --nproc-per-node 8 benchmarks/gpu.py --shapes M,L           # DDP: every rank measures, rank 0 writes
    python benchmarks/gpu.py --device cpu                                # tiny shape: a logic check, not a benchmark

It imports only torch, the standard library and Stride's plain-PyTorch core (stride.trainers.models,
stride.trainers.step, stride.trainers.optim's kernel choice, stride.trainers.telemetry's peak table), so it runs on a
GPU machine without Ray, pydantic or a network. For every shape, precision and compile setting it builds three loops
on the same weights and random on-device data, and times them in turn:

- stride: `stride.trainers.step.train_step` with `Precision` and its GradScaler, exactly what the Ray and torchrun
  loops call, with the char_gpt task's loss (CharGPTTask.loss, copied: the task module needs pydantic), AdamW with
  the kernel `optim.implementation=auto` picks (fused on CUDA), clipping at 1.0; compile on is `train.compile=auto` without FSDP
  (stride.trainers.blocks.compile_loss: the task's loss with the model in it, one function, after DDP wraps it);
- nanogpt (the judged reference, `--reference`): what a nanoGPT user writes: fused AdamW, clipping at 1.0, the
  whole model and the loss in one torch.compile'd module (compile on), the loss read on the host every 10 steps;
- minimal: autocast forward, cross-entropy, `scaler.scale(loss).backward()`, `scaler.step`, `zero_grad`, foreach
  AdamW, no clipping; compile on is `torch.compile(model)` (the reference of the first GPU figures).

Activation checkpointing on (`--ac`) recomputes every block in every loop (stride.trainers.blocks, as
`train.activation_checkpointing` does); the MFU goal is judged with it off (recomputation is work MFU does not count).

Each loop is warmed up (compilation included, not timed), then the loops take turns, `--reps` times, in ABBA order
(A B, B A, A B, ...), `--steps` steps each turn: a step's time is the CUDA-event interval between consecutive steps
(torch.cuda.synchronize before and after each turn, none inside, so each loop keeps whatever host syncs it has of its
own). Per loop: p50, p90 and max of every timed step, the SM clock and power draw sampled during its turns
(torch.cuda's NVML readings, else nvidia-smi), and its memory. `--profile DIR` writes a trace (torch.profiler,
Chrome format) of 3 steps per loop after the timed turns. Writes benchmarks/results/gpu-<device>.json and prints one
table.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import gc
import json
import math
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # `torchrun benchmarks/gpu.py` puts only benchmarks/ on the path

from stride.trainers import blocks  # noqa: E402 - train.compile and train.activation_checkpointing, as the loop does
from stride.trainers.models import CharGPT  # noqa: E402
from stride.trainers.optim import implementation, kernel_kwargs  # noqa: E402 - optim.implementation=auto
from stride.trainers.step import Precision, train_step  # noqa: E402
from stride.trainers.telemetry import peak_table  # noqa: E402,F401 - the one GPU peak table (also MFU in training)

VOCAB_SIZE = 256  # char_gpt reads bytes
# (layers, width, heads, context, batch per GPU)
SHAPES = {
    "S": (6, 384, 6, 256, 64),
    "M": (12, 768, 12, 1024, 16),
    "L": (24, 1024, 16, 1024, 16),
    "tiny": (2, 64, 2, 32, 4),  # CPU logic checks
}
MODES = ("fp32", "bf16", "fp16")
REFERENCES = ("nanogpt", "minimal")
NANOGPT_LOSS_EVERY = 10  # nanoGPT reads the loss on the host at its log steps only
# Stride's defaults (stride.trainers.config), copied because importing the config needs pydantic.
LR, BETAS, WEIGHT_DECAY, GRAD_CLIP_NORM = 1e-3, (0.9, 0.95), 0.01, 1.0
FLOPS_FORMULA = ("6*N + 12*layers*width*context per token (nanoGPT/PaLM MFU estimate, forward + backward; N = "
                 "parameters without the position embedding, the tied head counted once): CharGPT.flops_per_token()")

class UsageError(Exception):
    """A bad option: one line on stderr, exit 2."""


class Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse's own errors: one line too, not usage + error
        raise UsageError(message)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = Parser(prog="benchmarks/gpu.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default=None, help="comma-separated of S,M,L,tiny (default S,M,L on cuda, tiny on cpu)")
    p.add_argument("--modes", default="fp32,bf16,fp16", help="comma-separated of fp32,bf16,fp16 (fp16 uses GradScaler)")
    p.add_argument("--compile", default="both", help="torch.compile: both|on|off")
    p.add_argument("--ac", default=None, help="activation checkpointing of every block: both|on|off (default both on "
                                              "cuda, off on cpu)")
    p.add_argument("--reference", default=",".join(REFERENCES),
                   help="comma-separated of nanogpt,minimal; the first is the judged one (default nanogpt,minimal)")
    p.add_argument("--reps", type=int, default=3, help="turns per loop, in ABBA order (default 3)")
    p.add_argument("--profile", default=None, metavar="DIR", help="write a trace of 3 steps per loop into DIR")
    p.add_argument("--steps", type=int, default=20, help="timed steps per loop and turn")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps first (compilation happens here)")
    p.add_argument("--device", default="cuda", help="cuda|cpu")
    p.add_argument("--peak-flops", type=float, default=None, help="peak FLOP/s per GPU for MFU, all modes (default: table)")
    p.add_argument("--allow-tf32", action="store_true", help="let fp32 matmuls use TF32 (MFU then against the TF32 peak)")
    p.add_argument("--out", default=None, help="JSON path (default benchmarks/results/gpu-<device>.json)")
    p.add_argument("--offload", default=None, metavar="SHAPE",
                   help="first, train.fsdp.offload=cpu's peak GPU memory over without, for one rank at SHAPE (issue "
                        "47: L; goal <= 0.5), recorded in the JSON's notes")
    p.add_argument("--sync-check", action="store_true",
                   help="first, Stride's step (eager, fused AdamW) under torch.cuda.set_sync_debug_mode('error') in "
                        "every mode: host syncs between log steps, recorded in the JSON's notes")
    a = p.parse_args(argv)

    if a.device not in ("cuda", "cpu"):
        raise UsageError(f"--device ({a.device}) must be cuda or cpu; use --device cuda or --device cpu")
    a.shapes = split_list("--shapes", a.shapes or ("S,M,L" if a.device == "cuda" else "tiny"), list(SHAPES))
    a.modes = split_list("--modes", a.modes, list(MODES))
    if a.offload is not None and a.offload not in SHAPES:
        raise UsageError(f"--offload ({a.offload}) is not a shape; use one of {', '.join(SHAPES)}, e.g. --offload L")
    if a.compile not in ("both", "on", "off"):
        raise UsageError(f"--compile ({a.compile}) must be both, on or off; use e.g. --compile off")
    a.ac = a.ac or ("both" if a.device == "cuda" else "off")
    if a.ac not in ("both", "on", "off"):
        raise UsageError(f"--ac ({a.ac}) must be both, on or off; use e.g. --ac off")
    a.reference = split_list("--reference", a.reference, list(REFERENCES))
    if a.reps < 1:
        raise UsageError(f"--reps ({a.reps}) must be at least 1; use e.g. --reps 3")
    if a.steps < 1:
        raise UsageError(f"--steps ({a.steps}) must be at least 1; use e.g. --steps 20")
    if a.warmup < 0:
        raise UsageError(f"--warmup ({a.warmup}) must be 0 or more; use e.g. --warmup 5")
    if a.peak_flops is not None and not (math.isfinite(a.peak_flops) and a.peak_flops > 0):
        raise UsageError(f"--peak-flops ({a.peak_flops:g}) must be a positive FLOP/s figure; use e.g. --peak-flops 989e12")
    if a.device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device (cuda) needs a CUDA GPU but torch.cuda.is_available() is False; use --device cpu")
    return a


def split_list(flag: str, value: str, allowed: list[str]) -> list[str]:
    items = [v.strip() for v in value.split(",") if v.strip()]
    bad = [v for v in items if v not in allowed]
    if bad or not items:
        raise UsageError(f"{flag} ({value}) must be a comma-separated list of {', '.join(allowed)}; "
                         f"use e.g. {flag} {','.join(allowed[:2])}")
    return list(dict.fromkeys(items))


# ---- the environment ----

def slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


@functools.lru_cache(maxsize=None)
def fp16_works_on_cpu() -> bool:
    """CPU autocast to fp16 and a CPU GradScaler exist only in newer torch; probe instead of guessing versions."""
    try:
        x = torch.ones(2, 2, requires_grad=True)
        with torch.autocast("cpu", dtype=torch.float16):
            y = (x @ x).sum()
        scaler = torch.amp.GradScaler("cpu")
        scaler.scale(y).backward()
        return True
    except (RuntimeError, ValueError, TypeError):
        return False


def compile_unsupported(device: torch.device) -> str | None:
    """Why torch.compile cannot run here, or None."""
    import importlib.util

    if device.type == "cuda":
        if torch.cuda.get_device_capability(device) < (7, 0):
            return "torch.compile (Triton) needs a GPU of compute capability 7.0 or newer"
        if importlib.util.find_spec("triton") is None:
            return "torch.compile needs the triton package, which this torch install lacks"
        return None
    if not any(shutil.which(c) for c in (os.environ.get("CXX", ""), "g++", "c++", "clang++") if c):
        return "torch.compile on CPU needs a C++ compiler (g++ or clang++) on PATH"
    return None


def mode_unsupported(mode: str, device: torch.device) -> str | None:
    if device.type == "cuda" and mode == "bf16" and torch.cuda.get_device_capability(device) < (8, 0):
        return "bf16 needs compute capability 8.0 (Ampere) or newer"
    if device.type == "cpu" and mode == "fp16" and not fp16_works_on_cpu():
        return f"fp16 autocast/GradScaler on CPU is not supported by torch {torch.__version__}"
    return None


# ---- one measured loop ----

def char_gpt_loss(model, batch: dict) -> torch.Tensor:
    """The char_gpt task's loss (trainers/tasks/char_gpt.py, CharGPTTask.loss), copied because importing the task
    needs pydantic: the mean cross-entropy of the next byte, in fp32."""
    logits = model(batch["inputs"])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), batch["targets"].reshape(-1))


def fresh_model(shape: tuple[int, ...], device: torch.device, ac: bool) -> CharGPT:
    layers, width, heads, context, _ = shape
    torch.manual_seed(0)  # every loop starts from the same weights
    raw = CharGPT(VOCAB_SIZE, context, layers, heads, width, dropout=0.0).to(device)
    if ac:  # train.activation_checkpointing (stride.trainers.blocks), in every loop: the same recomputation
        blocks.checkpoint_activations(list(raw.blocks))
    return raw


def adamw(raw: torch.nn.Module, **kernel) -> torch.optim.Optimizer:
    """AdamW over the same parameter groups as stride.trainers.optim.build_optimizer (which needs the config)."""
    decay = [p for p in raw.parameters() if p.dim() >= 2]
    no_decay = [p for p in raw.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": WEIGHT_DECAY},
                              {"params": no_decay, "weight_decay": 0.0}], lr=LR, betas=BETAS, **kernel)


def wrap_ddp(raw: torch.nn.Module, device: torch.device, ddp: bool) -> torch.nn.Module:
    if not ddp:
        return raw
    from torch.nn.parallel import DistributedDataParallel as DDP

    return DDP(raw, device_ids=[device.index] if device.type == "cuda" else None)


class WithLoss(torch.nn.Module):
    """nanoGPT's forward: the model and the loss, one module (so one compiled graph)."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = self.model(x)
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), y.reshape(-1))


def build_loop(loop: str, shape: tuple[int, ...], mode: str, compiled: bool, ac: bool, device: torch.device,
               ddp: bool):
    """(the raw model, one training step: (inputs, targets) -> the loss, a tensor left on the device)."""
    raw = fresh_model(shape, device, ac)
    precision = Precision.create(mode, device)
    amp_dtype = precision.dtype
    if loop == "stride":
        optimizer = adamw(raw, **kernel_kwargs(implementation("adamw", "auto", device)))
        model, scaler = wrap_ddp(raw, device, ddp), precision.grad_scaler()
        # train.compile=auto under DDP (=model): the task's loss with the model in it, one function, after DDP wraps
        loss_fn = blocks.compile_loss(char_gpt_loss, "default") if compiled else char_gpt_loss

        def step(x, y):
            batch = {"inputs": x, "targets": y}
            return train_step(loss_fn, model, optimizer, scaler, precision, [batch], GRAD_CLIP_NORM).loss
        return raw, step
    scaler = torch.amp.GradScaler(device.type, enabled=mode == "fp16")
    autocast = functools.partial(torch.autocast, device.type, dtype=amp_dtype or torch.float32,
                                 enabled=amp_dtype is not None)
    if loop == "nanogpt":
        optimizer = adamw(raw, fused=True)
        forward = WithLoss(wrap_ddp(raw, device, ddp))
        forward = torch.compile(forward) if compiled else forward
        count = [0]

        def step(x, y):
            with autocast():
                loss = forward(x, y)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(raw.parameters(), GRAD_CLIP_NORM)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            count[0] += 1
            if count[0] % NANOGPT_LOSS_EVERY == 0:
                loss.item()  # its log line
            return loss.detach()
        return raw, step
    optimizer = adamw(raw)
    model = wrap_ddp(raw, device, ddp)
    model = torch.compile(model) if compiled else model  # compile(DDP(m)): DDPOptimizer splits at buckets

    def step(x, y):
        with autocast():
            logits = model(x)
            loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()
    return raw, step


def random_batches(shape: tuple[int, ...], device: torch.device, seed: int, n: int = 4):
    _, _, _, context, batch = shape
    g = torch.Generator(device=device).manual_seed(seed)
    out = []
    for _ in range(n):
        t = torch.randint(0, VOCAB_SIZE, (batch, context + 1), device=device, generator=g)
        out.append((t[:, :-1].contiguous(), t[:, 1:].contiguous()))
    return out


class GpuSampler:
    """The SM clock (MHz) and power draw (W) of one GPU, sampled every 0.2 s while `with` is open: torch.cuda's
    NVML readings where pynvml is installed, else nvidia-smi, else nothing (the figures are then null)."""

    def __init__(self, device: torch.device):
        self.device, self.samples, self._stop = device, [], threading.Event()
        self.read = self._reader() if device.type == "cuda" else None

    def _reader(self):
        try:
            torch.cuda.clock_rate(self.device), torch.cuda.power_draw(self.device)
            return lambda: (float(torch.cuda.clock_rate(self.device)), torch.cuda.power_draw(self.device) / 1e3)
        except Exception:  # noqa: BLE001 - no pynvml: nvidia-smi, if there is one
            pass
        smi = shutil.which("nvidia-smi")
        if smi is None:
            return None
        index = os.environ.get("CUDA_VISIBLE_DEVICES", str(self.device.index or 0)).split(",")[self.device.index or 0]

        def read():
            out = subprocess.run([smi, "-i", index, "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits"],
                                 capture_output=True, text=True, timeout=5).stdout
            clock, power = (float(v) for v in out.strip().split(",")[:2])
            return clock, power
        return read

    def __enter__(self):
        if self.read is not None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._loop, daemon=True)
            self._thread.start()
        return self

    def _loop(self):
        while not self._stop.wait(0.2):
            try:
                self.samples.append(self.read())
            except Exception:  # noqa: BLE001 - a reading that failed is one sample fewer
                pass

    def __exit__(self, *exc):
        if self.read is not None:
            self._stop.set()
            self._thread.join()

    def figures(self) -> dict:
        if not self.samples:
            return {"sm_clock_mhz_mean": None, "power_w_mean": None, "power_w_max": None}
        return {"sm_clock_mhz_mean": statistics.fmean(c for c, _ in self.samples),
                "power_w_mean": statistics.fmean(p for _, p in self.samples),
                "power_w_max": max(p for _, p in self.samples)}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_turn(step, batches, steps: int, first: int, device: torch.device) -> tuple[list[float], float]:
    """Seconds of each of `steps` steps (CUDA events; wall clock on CPU), and the loss of the last."""
    cuda = device.type == "cuda"
    sync(device)
    if cuda:
        marks = [torch.cuda.Event(enable_timing=True) for _ in range(steps + 1)]
        marks[0].record()
    stamps = [time.perf_counter()]
    loss = None
    for i in range(steps):
        loss = step(*batches[(first + i) % len(batches)])
        if cuda:
            marks[i + 1].record()
        else:
            stamps.append(time.perf_counter())
    sync(device)
    if cuda:
        return [marks[i].elapsed_time(marks[i + 1]) / 1e3 for i in range(steps)], float(loss)
    return [b - a for a, b in zip(stamps, stamps[1:])], float(loss)


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def run_setting(shape: tuple[int, ...], mode: str, compiled: bool, ac: bool, device: torch.device, args, rank: int,
                ddp: bool, label: str) -> dict:
    """Every loop at one shape/precision/compile/checkpointing setting: built and warmed up, then timed in turns
    (ABBA); this rank's figures per loop."""
    loops = ["stride", *args.reference]
    batches = random_batches(shape, device, seed=1000 + rank)
    built, resident = {}, {}
    if compiled:
        # A fresh cache per setting: every shape/dtype recompiles the same forward, and past dynamo's recompile
        # limit it would silently fall back to eager and time the wrong thing.
        torch._dynamo.reset()
    for loop in loops:
        before = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
        raw, step = build_loop(loop, shape, mode, compiled, ac, device, ddp)
        for i in range(args.warmup):
            step(*batches[i % len(batches)])
        sync(device)
        built[loop] = (raw, step)
        resident[loop] = (torch.cuda.memory_allocated(device) - before) / 1e9 if device.type == "cuda" else None
    times = {loop: [] for loop in loops}
    peaks = {loop: 0.0 for loop in loops}
    samplers = {loop: GpuSampler(device) for loop in loops}
    last = {}
    for rep in range(args.reps):
        for loop in (loops if rep % 2 == 0 else loops[::-1]):
            if device.type == "cuda":
                base = torch.cuda.memory_allocated(device)
                torch.cuda.reset_peak_memory_stats(device)
            with samplers[loop]:
                turn, last[loop] = timed_turn(built[loop][1], batches, args.steps, args.warmup + rep * args.steps,
                                              device)
            times[loop] += turn
            if device.type == "cuda":
                peaks[loop] = max(peaks[loop], (torch.cuda.max_memory_allocated(device) - base) / 1e9)
    if args.profile:
        profile(built, batches, device, Path(args.profile), f"{label}-rank{rank}")
    out = {}
    for loop in loops:
        raw = built[loop][0]
        out[loop] = {"step_s_median": statistics.median(times[loop]), "step_s_p90": quantile(times[loop], 0.9),
                     "step_s_max": max(times[loop]), "step_s_mean": statistics.fmean(times[loop]),
                     "steps_timed": len(times[loop]), "resident_memory_gb": resident[loop],
                     "step_peak_memory_gb": peaks[loop] if device.type == "cuda" else None,
                     "last_loss": last[loop], **samplers[loop].figures()}
        out["params"], out["flops_per_token"] = sum(p.numel() for p in raw.parameters()), raw.flops_per_token()
    del built
    return out


def profile(built: dict, batches, device: torch.device, folder: Path, label: str) -> None:
    """A Chrome trace of 3 steps of each loop: <folder>/<setting>-<loop>.json."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    folder.mkdir(parents=True, exist_ok=True)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    for loop, (_, step) in built.items():
        sync(device)
        with torch_profile(activities=activities) as prof:
            for i in range(3):
                step(*batches[i % len(batches)])
            sync(device)
        prof.export_chrome_trace(str(folder / f"{label}-{loop}.json"))


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ---- results ----

def summarize(name: str, per_rank: list[dict], shape: tuple[int, ...], world_size: int, peak: float | None,
              peak_reason: str | None) -> dict:
    """Global tokens/s from the slowest rank's median step; MFU per GPU; the step's p90 and max, the clock and power
    draw (rank 0's), and the memory (the most of any rank)."""
    _, _, _, context, batch = shape
    tokens_per_step = batch * context
    step_s = max(r[name]["step_s_median"] for r in per_rank)
    per_gpu = tokens_per_step / step_s
    mfu = per_gpu * per_rank[0]["flops_per_token"] / peak if peak else None
    mine = per_rank[0][name]

    def most(key: str) -> float | None:
        values = [r[name].get(key) for r in per_rank if r[name].get(key) is not None]
        return max(values) if values else None
    return {"tokens_per_second": per_gpu * world_size, "tokens_per_second_per_gpu": per_gpu,
            "step_ms_median": step_s * 1e3, "step_ms_p90": max(r[name]["step_s_p90"] for r in per_rank) * 1e3,
            "step_ms_max": max(r[name]["step_s_max"] for r in per_rank) * 1e3,
            "step_ms_mean": mine["step_s_mean"] * 1e3, "steps_timed": mine["steps_timed"],
            "mfu": mfu, "mfu_reason": None if mfu is not None else peak_reason,
            "resident_memory_gb": most("resident_memory_gb"), "step_peak_memory_gb": most("step_peak_memory_gb"),
            "sm_clock_mhz_mean": mine["sm_clock_mhz_mean"], "power_w_mean": mine["power_w_mean"],
            "power_w_max": mine["power_w_max"], "last_loss": mine["last_loss"]}


def fmt_rate(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v / 1e6:.2f}M" if v >= 1e6 else f"{v / 1e3:.1f}k" if v >= 1e3 else f"{v:.0f}"


def fmt_pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.1f}%"


def table(results: list[dict], skipped: list[dict]) -> str:
    head = ("shape", "mode", "compile", "ac", "ref tok/s", "Stride tok/s", "Stride/ref", "Stride/minimal", "ref MFU",
            "Stride MFU", "p90 ms ref/Stride", "note")
    rows = []
    for r in results:
        s, ref = r["stride"], r["reference"]
        minimal = r["stride_over"].get("minimal")
        rows.append((r["shape"], r["mode"], "on" if r["compile"] else "off", "on" if r["ac"] else "off",
                     fmt_rate(ref["tokens_per_second"]), fmt_rate(s["tokens_per_second"]),
                     f"{r['stride_over_reference']:.3f}", "-" if minimal is None else f"{minimal:.3f}",
                     fmt_pct(ref["mfu"]), fmt_pct(s["mfu"]), f"{ref['step_ms_p90']:.1f}/{s['step_ms_p90']:.1f}",
                     s["mfu_reason"] or ""))
    for k in skipped:
        rows.append((k["shape"], k["mode"], "on" if k["compile"] else "off", "on" if k["ac"] else "off", "-", "-",
                     "-", "-", "-", "-", "-", "skipped: " + k["reason"]))
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
    line = lambda cells: "  ".join(str(c).ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    return "\n".join([line(head), line(["-" * w for w in widths])] + [line(r) for r in rows])


def goals(results: list[dict], on_gpu: bool) -> list[dict]:
    """The issue's targets; judged only on a GPU (a CPU run checks the logic, its speeds mean nothing)."""
    ratio = min((r["stride_over_reference"] for r in results), default=None)
    l_bf16 = [r["stride"]["mfu"] for r in results
              if r["shape"] == "L" and r["mode"] == "bf16" and r["compile"] and not r["ac"]]
    mfu = l_bf16[0] if l_bf16 else None
    return [
        {"goal": "Stride tokens/s >= the judged reference's at every measured shape and mode", "value": ratio,
         "met": ratio >= 1.0 if on_gpu and ratio is not None else None},
        {"goal": "Stride MFU >= 45% at L, bf16, torch.compile", "value": mfu,
         "met": mfu >= 0.45 if on_gpu and mfu is not None else None},
    ]


def write_report(args, results: list[dict], skipped: list[dict], device: torch.device, name: str, world_size: int,
                 peak_source: str | None, peaks: dict, notes: list[str]) -> Path:
    out = Path(args.out) if args.out else REPO / "benchmarks" / "results" / f"gpu-{slug(name)}.json"
    report = {
        "benchmark": "benchmarks/gpu.py: Stride train_step vs hand-written PyTorch loops, char_gpt",
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": {"type": device.type, "name": name, "world_size": world_size,
                   "capability": ".".join(map(str, torch.cuda.get_device_capability(device)))
                   if device.type == "cuda" else None},
        "software": {"torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version()},
        "settings": {"steps_per_turn": args.steps, "reps": args.reps, "warmup": args.warmup,
                     "allow_tf32": args.allow_tf32, "references": args.reference, "judged_reference": args.reference[0],
                     "vocab_size": VOCAB_SIZE, "dropout": 0.0, "data": "random tokens generated on the device",
                     "optimizer": f"AdamW lr {LR} betas {BETAS} weight decay {WEIGHT_DECAY} (2-d parameters only)",
                     "stride_loop": f"stride.trainers.step.train_step with CharGPTTask's loss, Precision, "
                                    f"grad_clip_norm {GRAD_CLIP_NORM}, AdamW's kernel by optim.implementation=auto, "
                                    f"train.compile as per-block compile",
                     "nanogpt_loop": f"fused AdamW, clip_grad_norm_ {GRAD_CLIP_NORM}, model + loss in one "
                                     f"torch.compile'd module, the loss read every {NANOGPT_LOSS_EVERY} steps",
                     "minimal_loop": "autocast forward + cross_entropy, scaler.scale(loss).backward(), scaler.step, "
                                     "scaler.update, zero_grad(set_to_none=True); foreach AdamW; no clipping",
                     "timing": "CUDA-event intervals between consecutive steps (wall clock on CPU), loops in turns "
                               "(ABBA) of steps_per_turn steps, reps turns each; synchronize around each turn; "
                               "warm-up (and compilation) not timed; p50 (median), p90, max over every timed step",
                     "tokens_per_second": "global: batch_per_gpu * context * world_size / slowest rank's "
                                          "median step; MFU per GPU",
                     "clock_and_power": "sampled every 0.2 s during each loop's turns (NVML via torch.cuda, else "
                                        "nvidia-smi); null where neither is available",
                     "memory": "resident: allocated by building and warming the loop; step peak: the most "
                               "allocated above that during its turns"},
        "flops_per_token_formula": FLOPS_FORMULA,
        "peak_flops": {"source": peak_source, "per_dtype": peaks or None},
        "notes": notes,
        "results": results,
        "skipped": skipped,
        "goals": goals(results, device.type == "cuda"),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    return out


def offload_peak(shape: tuple[int, ...], device: torch.device, offload: bool, steps: int = 3) -> float | None:
    """Peak device memory of `steps` bf16 steps of one rank's FSDP2 model (stride.trainers.fsdp.shard_model over a
    1-rank mesh, as train.strategy=fsdp builds it), with train.fsdp.offload=cpu or without; None on CPU."""
    from stride.trainers import fsdp

    free_memory(device)
    torch.manual_seed(0)
    layers, width, heads, context, batch = shape
    model = CharGPT(VOCAB_SIZE, context, layers, heads, width, dropout=0.0)
    if not offload:
        model = model.to(device)
    model = fsdp.shard_model(model, list(model.blocks), device, fsdp.Mesh.flat(1), torch.bfloat16, offload=offload)
    opt = adamw(model)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for x, y in random_batches(shape, device, seed=0)[:steps]:
        loss = char_gpt_loss(model, {"inputs": x, "targets": y})
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    sync(device)
    peak = float(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else None
    del model, opt
    free_memory(device)
    return peak


def offload_check(shape_name: str, device: torch.device) -> list[str]:
    """train.fsdp.offload=cpu against the same FSDP2 model without it, one rank (a process group of one)."""
    own_group = not dist.is_initialized()
    if own_group:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=dist.HashStore(), rank=0,
                                world_size=1)
    try:
        without, with_offload = (offload_peak(SHAPES[shape_name], device, off) for off in (False, True))
    finally:
        if own_group:
            dist.destroy_process_group()
    if without is None or with_offload is None:
        return [f"offload check at {shape_name}: ran on {device.type}, no device memory to compare"]
    return [f"offload check at {shape_name}, one rank, bf16: peak GPU memory {with_offload / 2**30:.2f} GiB with "
            f"train.fsdp.offload=cpu against {without / 2**30:.2f} GiB without: ratio {with_offload / without:.3f} "
            f"(goal <= 0.5)"]


def sync_check(modes: list[str], device: torch.device, ddp: bool) -> list[str]:
    """Stride's step between log steps may not wait for the GPU (issue 45): 3 steps of each mode under
    torch.cuda.set_sync_debug_mode("error"), after 2 untimed ones. One note per mode."""
    notes = []
    for mode in modes:
        _, step = build_loop("stride", SHAPES["tiny"], mode, False, False, device, ddp)
        batches = random_batches(SHAPES["tiny"], device, seed=0)
        for x, y in batches[:2]:
            step(x, y)
        torch.cuda.synchronize(device)
        try:
            torch.cuda.set_sync_debug_mode("error")
            for x, y in batches[:3]:
                step(x, y)
            verdict = "0 host syncs"
        except RuntimeError as e:
            verdict = f"a host sync: {str(e).splitlines()[0][:200]}"
        finally:
            torch.cuda.set_sync_debug_mode(0)
        notes.append(f"sync check, {mode}: {verdict} in 3 of Stride's steps (eager, fused AdamW, clipping; "
                     f"torch.cuda.set_sync_debug_mode('error'))")
    return notes


def main(argv: list[str]) -> int:
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    try:
        args = parse_args(argv)
    except UsageError as e:
        if rank == 0:
            print(f"benchmarks/gpu.py: error: {e}", file=sys.stderr)
        return 2

    ddp = world_size > 1
    if args.device == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if ddp:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    # fp32 means IEEE fp32 unless asked: TF32 would make "fp32" a different precision on Ampere and newer.
    torch.set_float32_matmul_precision("high" if args.allow_tf32 else "highest")
    torch.backends.cudnn.allow_tf32 = args.allow_tf32

    name = device_name(device)
    peak_source, peaks = peak_table(name, args.peak_flops)
    notes = []
    if device.type == "cpu":
        notes.append("CPU run: a logic check of the benchmark, not a performance figure")
    compile_settings = {"both": [False, True], "on": [True], "off": [False]}[args.compile]
    ac_settings = {"both": [False, True], "on": [True], "off": [False]}[args.ac]
    compile_reason = compile_unsupported(device) if any(compile_settings) else None
    if compile_reason:
        notes.append(f"torch.compile skipped: {compile_reason}")

    if args.offload and rank == 0 and not ddp:
        notes += offload_check(args.offload, device)
        print(notes[-1], file=sys.stderr, flush=True)
    if args.sync_check and device.type == "cuda":
        notes += sync_check(args.modes, device, ddp)
        print("\n".join(notes[-len(args.modes):]), file=sys.stderr, flush=True)
    results, skipped = [], []
    for shape_name in args.shapes:
        shape = SHAPES[shape_name]
        for mode in args.modes:
            mode_reason = mode_unsupported(mode, device)
            for compiled, ac in [(c, a) for c in compile_settings for a in ac_settings]:
                reason = mode_reason or (compile_reason if compiled else None)
                if reason:
                    skipped.append({"shape": shape_name, "mode": mode, "compile": compiled, "ac": ac,
                                    "reason": reason})
                    continue
                if rank == 0:
                    print(f"[gpu.py] {shape_name} {mode} compile={'on' if compiled else 'off'} "
                          f"ac={'on' if ac else 'off'} ...", file=sys.stderr, flush=True)
                try:
                    label = f"{shape_name}-{mode}-compile_{'on' if compiled else 'off'}-ac_{'on' if ac else 'off'}"
                    mine = run_setting(shape, mode, compiled, ac, device, args, rank, ddp, label)
                except torch.cuda.OutOfMemoryError:
                    if ddp:
                        raise  # the other ranks are inside a collective: stop them all (torchrun does)
                    mine = None
                if mine is None:  # outside the except block, so the traceback no longer holds the tensors
                    free_memory(device)
                    skipped.append({"shape": shape_name, "mode": mode, "compile": compiled, "ac": ac,
                                    "reason": f"out of memory at batch {shape[4]} on {name}"})
                    continue
                per_rank = [None] * world_size
                if ddp:
                    dist.all_gather_object(per_rank, mine)
                else:
                    per_rank = [mine]
                peak_key = "tf32" if mode == "fp32" and args.allow_tf32 else mode
                peak = peaks.get(peak_key)
                if peak_source is None:
                    why = f"no peak FLOP/s known for {name}; pass --peak-flops"
                elif peak is None:
                    why = f"{name} has no {peak_key} peak in the table ({peak_source}); pass --peak-flops"
                else:
                    why = None
                entry = {"shape": shape_name, "layers": shape[0], "width": shape[1], "heads": shape[2],
                         "context": shape[3], "batch_per_gpu": shape[4], "params": mine["params"],
                         "flops_per_token": mine["flops_per_token"], "mode": mode, "compile": compiled, "ac": ac,
                         "peak_flops": peak}
                entry["stride"] = summarize("stride", per_rank, shape, world_size, peak, why)
                entry["references"] = {ref: summarize(ref, per_rank, shape, world_size, peak, why)
                                       for ref in args.reference}
                entry["stride_over"] = {ref: entry["stride"]["tokens_per_second"] / fig["tokens_per_second"]
                                        for ref, fig in entry["references"].items()}
                entry["judged_reference"] = args.reference[0]
                entry["reference"] = entry["references"][args.reference[0]]
                entry["stride_over_reference"] = entry["stride_over"][args.reference[0]]
                if rank == 0:  # what is measured so far survives a run cut short
                    write_report(args, results + [entry], skipped, device, name, world_size, peak_source, peaks,
                                 notes)
                results.append(entry)

    if rank == 0:
        out = write_report(args, results, skipped, device, name, world_size, peak_source, peaks, notes)
        print(table(results, skipped))
        print(f"wrote {out}")
    if ddp:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
