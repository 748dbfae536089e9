"""What a step costs: step time, data wait, checkpoint blocking, throughput, MFU, and where the figures go.

The loop measures on every rank; each log step the figures go to the sinks (trainers/sinks: metrics.jsonl and the
trackers on rank 0, averaged over ranks) and, on Ray, to Prometheus through `ray.util.metrics` gauges tagged with
the run and the rank.
No Ray import here: the same code runs under torchrun.
"""

from __future__ import annotations

import re
import time
from typing import Any

import torch

__all__ = ["PEAK_FLOPS", "peak_flops", "peak_table"]

# Dense peak FLOP/s per dtype from NVIDIA's datasheets (the sparse figures halved). `tf32` is what fp32 matmuls
# get with --allow-tf32; `fp32` is plain fp32 (no tensor cores). None: the GPU has no such tensor-core path.
# First match wins, so specific names come before the names they contain.
_H100_SXM = {"bf16": 989e12, "fp16": 989e12, "tf32": 494e12, "fp32": 67e12}
PEAK_FLOPS = [
    (r"H100.*PCIe", "H100 PCIe", {"bf16": 756e12, "fp16": 756e12, "tf32": 378e12, "fp32": 51e12}),
    (r"H100 NVL", "H100 NVL", {"bf16": 835e12, "fp16": 835e12, "tf32": 418e12, "fp32": 60e12}),
    (r"H100", "H100 SXM", _H100_SXM),
    (r"H200", "H200", _H100_SXM),
    (r"A100", "A100", {"bf16": 312e12, "fp16": 312e12, "tf32": 156e12, "fp32": 19.5e12}),
    (r"L40S", "L40S", {"bf16": 362e12, "fp16": 362e12, "tf32": 183e12, "fp32": 91.6e12}),
    (r"\bL4\b", "L4", {"bf16": 121e12, "fp16": 121e12, "tf32": 60e12, "fp32": 30.3e12}),
    (r"\bA10G?\b", "A10G/A10", {"bf16": 125e12, "fp16": 125e12, "tf32": 62.5e12, "fp32": 31.2e12}),
    (r"V100", "V100", {"bf16": None, "fp16": 125e12, "tf32": None, "fp32": 15.7e12}),
    (r"\bT4\b", "T4", {"bf16": None, "fp16": 65e12, "tf32": None, "fp32": 8.1e12}),
]



def peak_table(name: str, override: float | None) -> tuple[str | None, dict[str, float | None]]:
    if override is not None:
        return "--peak-flops", {k: override for k in ("bf16", "fp16", "tf32", "fp32")}
    for pattern, label, peaks in PEAK_FLOPS:
        if re.search(pattern, name):
            return f"table: {label}", dict(peaks)
    return None, {}


# Names under which the gauges are recorded (Ray's Prometheus export prefixes them with `ray_`).
GAUGES = {
    "samples_per_second": ("stride_samples_per_second", "Training samples per second (all ranks)"),
    "tokens_per_second": ("stride_tokens_per_second", "Training tokens per second (all ranks; text models)"),
    "step_time_s": ("stride_step_time_seconds", "Seconds per optimizer step on this rank (eval and checkpoints excluded)"),
    "data_wait_s": ("stride_data_wait_seconds", "Seconds per optimizer step this rank waited for its next batch"),
    "data_wait_fraction": ("stride_data_wait_fraction", "Share of step time this rank waited for data"),
    "checkpoint_blocked_s": ("stride_checkpoint_blocked_seconds", "Seconds the last checkpoint blocked training"),
    "train_loss": ("stride_train_loss", "Training loss averaged over ranks"),
    "lr": ("stride_learning_rate", "Learning rate"),
    "mfu": ("stride_mfu", "Model FLOPs utilisation of this rank's device (0..1)"),
    "gpu_memory_bytes": ("stride_gpu_memory_bytes", "Peak GPU memory allocated by this rank since the last log step"),
    "goodput": ("stride_goodput", "Share of the wall time since the run first started that trained (0..1)"),
}


def peak_flops(device: torch.device, precision: str, configured: float | None) -> float | None:
    """Peak FLOP/s of one worker's device: train.peak_flops if set, else the GPU table, else unknown (None)."""
    if configured:
        return float(configured)
    if device.type != "cuda":
        return None
    fp32 = "tf32" if torch.backends.cuda.matmul.allow_tf32 else "fp32"
    return peak_table(torch.cuda.get_device_name(device), None)[1].get(precision if precision != "fp32" else fp32)


class Profiler:
    """train.profile_steps [start, end]: a torch.profiler trace of those optimizer steps on every rank, written to
    profile/rank<k>.json (Chrome trace: Perfetto, chrome://tracing); rank 0 hands the traces it can see to the
    sinks (a tracker keeps them with its record; all of them when the run folder is shared)."""

    def __init__(self, steps: list[int] | None, run_dir, env):
        self.steps, self.run_dir, self.env = steps, run_dir, env
        self.profiler = None

    def before_step(self, step: int) -> None:
        if self.steps and step + 1 == self.steps[0]:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.env.device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.profiler = torch.profiler.profile(activities=activities, record_shapes=True)
            self.profiler.start()

    def after_step(self, step: int, sinks) -> None:
        if self.profiler is not None and step == self.steps[1]:
            self.close(sinks)

    def close(self, sinks) -> None:
        """Stop and write the trace (also when the run ends or stops inside the profiled range)."""
        if self.profiler is None:
            return
        import logging

        self.profiler.stop()
        out = self.run_dir / "profile"
        trace = out / f"rank{self.env.world_rank}.json"
        self._write_trace(out, trace)
        self.profiler = None
        logging.getLogger("stride").info("profile trace written to %s", trace)
        if self.env.world_size > 1:
            torch.distributed.barrier()
        for path in sorted(out.glob("rank*.json")):
            if path.is_file() and not path.is_symlink():  # a planted link must not upload what it points at
                sinks.artifact(path, "profile")


    def _write_trace(self, out, trace) -> None:
        """torch's exporter opens its path as it finds it, links included: it writes into a private temporary
        folder, and the trace goes into the run folder as every file Stride writes there (trainers/run/folder.py),
        in a profile/ folder that is a real folder, never a link."""
        import tempfile
        from pathlib import Path

        from stride.trainers.run import folder as runfolder

        runfolder.make_folder(Path(out))
        with tempfile.TemporaryDirectory(prefix="stride-profile-") as private:
            local = Path(private) / trace.name
            self.profiler.export_chrome_trace(str(local))
            runfolder.atomic_write_bytes(Path(trace), local.read_bytes())


class StepClock:
    """Per-rank timing between two log steps: time per step and data wait, with evaluation and checkpoints
    (measured on their own) kept out of the step time."""

    def __init__(self):
        self.reset()
        self.checkpoint_blocked_s: float | None = None

    def reset(self) -> None:
        self.start = time.perf_counter()
        self.steps = 0
        self.data_wait = 0.0
        self.excluded = 0.0

    def figures(self) -> dict[str, float]:
        busy = max(time.perf_counter() - self.start - self.excluded, 1e-9)
        steps = max(self.steps, 1)
        return {"step_time_s": busy / steps, "data_wait_s": self.data_wait / steps,
                "data_wait_fraction": min(self.data_wait / busy, 1.0)}


class Goodput:
    """Where the wall time since the run first started went (MaxText's goodput): training steps (`productive`), and
    `badput` by cause: restarts (from a checkpoint to the attempt that resumed it: the steps trained since and lost,
    and the time down), startup (an attempt's start to its first step: set-up, loading, the untrained evaluation),
    data_wait, evaluation and checkpoint (what training waited for). Each attempt adds to the parts its checkpoint
    saved (`state`, in meta.json), so the parts always sum to the wall time since the first start."""

    BADPUT = ("restarts", "startup", "data_wait", "evaluation", "checkpoint")

    def __init__(self, attempt_start: float | None = None):
        self.attempt_start = attempt_start or time.time()
        self.first_start = self.attempt_start
        self.before = dict.fromkeys(("productive", *self.BADPUT), 0.0)  # earlier attempts, to their checkpoint
        self.waited = dict.fromkeys(("data_wait", "evaluation", "checkpoint"), 0.0)  # this attempt's
        self.first_step: float | None = None

    def resume(self, saved: dict[str, Any] | None) -> None:
        """The parts a checkpoint saved (meta.json's "goodput"); the time since it was written is a restart's."""
        if not saved:
            return
        self.first_start = saved["first_start"]
        self.before.update({k: float(v) for k, v in saved["parts"].items() if k in self.before})
        self.before["restarts"] += max(0.0, self.attempt_start - saved["at"])

    def training(self) -> None:
        """The first step starts: the attempt's start-up ends."""
        self.first_step = time.time()

    def waited_for(self, cause: str, seconds: float) -> None:
        self.waited[cause] += seconds

    def parts(self, now: float | None = None) -> dict[str, float]:
        now = now or time.time()
        first = self.first_step or now
        here = {"startup": first - self.attempt_start, **self.waited,
                "productive": now - first - sum(self.waited.values())}
        return {k: self.before[k] + here.get(k, 0.0) for k in self.before}

    def state(self) -> dict[str, Any]:
        now = time.time()
        return {"first_start": self.first_start, "at": now, "parts": self.parts(now)}

    def figures(self) -> dict[str, float]:
        """goodput (productive over wall) and badput/<cause> in seconds, with the wall time they split."""
        now = time.time()
        parts, wall = self.parts(now), max(now - self.first_start, 1e-9)
        return {"goodput": parts["productive"] / wall, "goodput_wall_s": wall, "productive_s": parts["productive"],
                **{f"badput/{k}": parts[k] for k in self.BADPUT}}


class ForwardClock:
    """This rank's forward time between log steps (Task.loss: the model's forward and the loss), the part of a step
    that only this rank's speed sets. On a GPU it is timed with CUDA events, read at the log step, when the step's
    figures are read anyway: no wait of its own."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.host_s, self.events = 0.0, []

    def timed(self, loss_fn):
        def forward(model, batch):
            if self.cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                out = loss_fn(model, batch)
                end.record()
                self.events.append((start, end))
                return out
            t0 = time.perf_counter()
            out = loss_fn(model, batch)
            self.host_s += time.perf_counter() - t0
            return out
        return forward

    def take(self) -> float:
        """Seconds of forward since the last take."""
        seconds = self.host_s + sum(start.elapsed_time(end) for start, end in self.events) / 1000.0
        self.host_s, self.events = 0.0, []
        return seconds


def tag_value(text: str) -> str:
    """`text` as a metric tag value Ray accepts: Ray encodes tag values as ASCII (a Unicode run.name failed every
    record), so other characters are percent-encoded as UTF-8 bytes, and so is "%" itself, which keeps the value
    unambiguous: urllib.parse.unquote gives the run name back ("lauf-größe" -> "lauf-gr%C3%B6%C3%9Fe")."""
    from urllib.parse import quote

    return quote(text, safe="".join(chr(c) for c in range(32, 127) if chr(c) != "%"))


class Gauges:
    """ray.util.metrics gauges for one worker, tagged {run, rank}. Recording never fails training."""

    def __init__(self, run: str, rank: int):
        from ray.util.metrics import Gauge

        self.tags = {"run": tag_value(run), "rank": str(rank)}
        self.gauges = {key: Gauge(name, description=desc, tag_keys=("run", "rank")) for key, (name, desc) in GAUGES.items()}

    def record(self, figures: dict[str, Any]) -> None:
        for key, gauge in self.gauges.items():
            value = figures.get(key)
            if isinstance(value, (int, float)) and value == value:
                gauge.set(float(value), tags=self.tags)
