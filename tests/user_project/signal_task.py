"""A user's own Stride task, outside Stride's packages: a 1-D CNN that classifies fixed-length signals.

Each row of the Parquet data holds `signal` (fixed_size_list<float32>, one waveform) and `target` (int64, the class:
which of a few frequencies the waveform oscillates at, under random phase, offset, gain and noise). Select it with
`model.name: signal_task:SignalTask` and run from this folder (see signal.yaml).
"""

from __future__ import annotations

from pathlib import Path

import datasets  # Hugging Face `datasets`: Stride must never shadow it (its repository has a datasets/ folder)
import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from pydantic import Field

from stride import DataError, Task

assert hasattr(datasets, "load_dataset"), (
    f"`import datasets` found {getattr(datasets, '__file__', datasets)}, not Hugging Face datasets: something put "
    f"Stride's own datasets/ folder ahead of site-packages on sys.path")


class ConvBlock(nn.Module):
    """A residual conv block; the model stacks identical ones (FSDP's units, found by Task.blocks)."""

    def __init__(self, channels: int, dropout: float):
        super().__init__()
        self.conv = nn.Conv1d(channels, channels, kernel_size=3, padding=1)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(F.gelu(self.conv(x)))


class SignalCNN(nn.Module):
    def __init__(self, num_classes: int, channels: int, depth: int, dropout: float):
        super().__init__()
        self.stem = nn.Conv1d(1, channels, kernel_size=7, padding=3)
        self.blocks = nn.ModuleList(ConvBlock(channels, dropout) for _ in range(depth))
        self.head = nn.Linear(channels, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [batch, length]
        h = F.gelu(self.stem(x.unsqueeze(1)))
        for block in self.blocks:
            h = block(h)
        return self.head(h.mean(-1))  # global average pool: the class is the frequency, wherever the phase is


class SignalTask(Task):
    class Config(Task.Config):
        channels: int = Field(16, ge=2, description="Conv channels of every block")
        depth: int = Field(3, ge=2, description="Identical residual conv blocks")
        dropout: float = Field(0.0, ge=0.0, lt=1.0, description="Dropout in each block")
        max_shift: int = Field(8, ge=0, description="Augmentation: random circular shift of up to this many samples")
        # A file of the user's, named relative to where they run Stride: every worker must get it absolute, whatever
        # its own working directory (Ray workers run elsewhere).
        notes_path: Path | None = Field(None, description="A text file build_model reads (optional)")

    columns = ("signal", "target")
    metric_names = ("accuracy",)

    def inspect(self, train, val):
        import pyarrow as pa
        import pyarrow.compute as pc

        num_classes = 0
        for split in (train, val) if val is not None else (train,):
            for name in self.columns:
                if name not in split.schema.names:
                    raise DataError(f"{split.key}: no {name!r} column (found {split.schema.names}); "
                                    f"write the data with make_data.py")
            t = split.schema.field("signal").type
            if not (pa.types.is_fixed_size_list(t) and pa.types.is_floating(t.value_type)):
                raise DataError(f"{split.key}: column 'signal' is {t}, must be a fixed-size list of floats")
            hi = pc.max(split.read(["target"]).column("target")).as_py()
            num_classes = max(num_classes, hi + 1)
        return {"num_classes": int(num_classes), "signal_length": int(train.schema.field("signal").type.list_size)}

    def transform(self, batch):
        x = batch["signal"].astype(np.float32)
        # Per-sample standardisation removes each recording's offset and gain.
        x = (x - x.mean(1, keepdims=True)) / (x.std(1, keepdims=True) + 1e-6)
        if self.config.max_shift:
            # Augmentation: a random circular shift per sample (np.random, which Stride reseeds from the seed, rank
            # and step, so a resumed run draws the same shifts). The waveforms hold whole periods, so a circular
            # shift is only a phase change and keeps the class; validation batches may be shifted as well.
            shifts = np.random.randint(-self.config.max_shift, self.config.max_shift + 1, size=len(x))
            idx = (np.arange(x.shape[1])[None, :] - shifts[:, None]) % x.shape[1]
            x = np.take_along_axis(x, idx, axis=1)
        return {"x": x, "y": batch["target"].astype(np.int64)}

    def build_model(self):
        c, f = self.config, self.facts  # facts: what inspect found in the data, on every process
        if c.max_shift >= f["signal_length"]:
            raise DataError(f"model.max_shift ({c.max_shift}) must be below the signal length ({f['signal_length']})")
        if c.notes_path is not None:
            if not c.notes_path.is_absolute():
                raise DataError(f"model.notes_path ({c.notes_path}) reached this process relative")
            c.notes_path.read_text()  # FileNotFoundError on a worker that resolved it against its own folder
        return SignalCNN(f["num_classes"], c.channels, c.depth, c.dropout)

    def loss(self, model, batch):
        return F.cross_entropy(model(batch["x"]).float(), batch["y"])

    def metrics(self, model, batch):
        return {"accuracy": (model(batch["x"]).argmax(-1) == batch["y"]).float()}


def half_by_the_end(step: int, warmup_steps: int, total_steps: int, min_lr_ratio: float, decay_fraction: float) -> float:
    """An lr schedule of the project's own (optim.schedule: signal_task:half_by_the_end): the built-in warm-up, then
    linear from the peak to half of it at the last step."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    return 1.0 - 0.5 * min(step, total_steps) / total_steps
