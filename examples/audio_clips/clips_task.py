"""An audio classifier over WAV files named in a JSON Lines manifest: the files are read by reference.

What it shows: `file_columns = ("path",)` makes Stride read each referenced file (relative paths resolve against the
manifest's folder) ahead of training, in its reader threads, and hand `transform` the bytes; `transform` decodes the
WAV and pads or cuts it to a fixed length. A Parquet file whose "path" column holds the WAV bytes themselves trains
the same way (a binary file column is passed through), bitwise equal.
"""

from __future__ import annotations

import io
import wave

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from pydantic import Field

from stride import DataError, DataSplit, Task


def decode(data: bytes, samples: int) -> np.ndarray:
    """16-bit mono PCM WAV bytes -> float32 in [-1, 1], zero-padded or cut to `samples`."""
    with wave.open(io.BytesIO(data)) as w:
        if w.getsampwidth() != 2 or w.getnchannels() != 1:
            raise ValueError("expected 16-bit mono WAV")
        pcm = np.frombuffer(w.readframes(samples), dtype="<i2").astype(np.float32) / 32768.0
    out = np.zeros(samples, np.float32)
    out[:len(pcm)] = pcm
    return out


class Clips(Task):
    class Config(Task.Config):
        samples: int = Field(4000, ge=64, description="Samples per clip after padding or cutting (8 kHz: 0.5 s)")
        classes: int = Field(4, ge=2, description="Number of labels")
        channels: int = Field(32, ge=1, description="Width of the convolutions")

    columns = ("path", "label")
    file_columns = ("path",)
    metric_names = ("accuracy",)

    def inspect(self, train: DataSplit, val: DataSplit | None) -> dict:
        labels = train.read(["label"]).column("label").to_numpy()
        if labels.min() < 0 or labels.max() >= self.config.classes:
            raise DataError(f"{train.key}: labels span {labels.min()}..{labels.max()}; set model.classes to cover them")
        return {}

    def transform(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        audio = np.stack([decode(b, self.config.samples) for b in batch["path"]])
        return {"audio": audio, "label": batch["label"].astype(np.int64)}

    def build_model(self) -> nn.Module:
        c = self.config.channels
        return nn.Sequential(
            nn.Conv1d(1, c, 64, stride=8), nn.GELU(), nn.Conv1d(c, c, 8, stride=4), nn.GELU(),
            nn.AdaptiveAvgPool1d(1), nn.Flatten(), nn.Linear(c, self.config.classes))

    def loss(self, model, batch):
        return F.cross_entropy(model(batch["audio"].unsqueeze(1)).float(), batch["label"])

    def metrics(self, model, batch):
        return {"accuracy": (model(batch["audio"].unsqueeze(1)).argmax(-1) == batch["label"]).float()}
