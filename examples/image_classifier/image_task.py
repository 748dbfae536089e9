"""An image classification Task: PNG bytes from a Parquet binary column, decoded and augmented in `transform`
with Pillow and numpy, classified by a small CNN; reports val_accuracy.

`transform` runs on the CPU for every batch of rows (binary columns arrive as numpy object arrays of bytes) and
returns numeric arrays only: float32 images (N, 3, H, W) and int64 labels.
"""

from __future__ import annotations

import io

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from pydantic import Field

from stride import DataError, DataSplit, Task


class ImageClassifier(Task):
    class Config(Task.Config):  # the model.<field> keys of the YAML
        num_classes: int = Field(3, ge=2, description="Classes (labels 0..num_classes-1)")
        channels: int = Field(32, ge=1, description="Channels of the first conv stage (doubled at each stage)")
        image_size: int = Field(32, ge=8, description="Images are resized to image_size x image_size")
        max_shift: int = Field(3, ge=0, description="Augmentation: random shift of up to this many pixels")
        hflip: bool = Field(True, description="Augmentation: random horizontal flips")

    columns = ("image", "label")
    metric_names = ("accuracy",)

    def inspect(self, train: DataSplit, val: DataSplit | None) -> dict:
        import pyarrow as pa

        for split in (train, val) if val is not None else (train,):
            schema = split.schema
            if "image" not in schema.names or not pa.types.is_binary(schema.field("image").type):
                raise DataError(f"{split.key}: needs a binary 'image' column of encoded images (PNG/JPEG bytes); "
                                f"found {schema}")
            if "label" not in schema.names or not pa.types.is_integer(schema.field("label").type):
                raise DataError(f"{split.key}: needs an integer 'label' column (0..num_classes-1)")
            labels = split.read(["label"]).column("label").to_numpy()
            if labels.min() < 0 or labels.max() >= self.config.num_classes:
                raise DataError(f"{split.key}: labels range {labels.min()}..{labels.max()} but model.num_classes is "
                                f"{self.config.num_classes}; set model.num_classes={labels.max() + 1}")
        return {}

    # ---- data: decode, augment, normalise (numpy in, numpy out) ----

    def transform(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        s = self.config.image_size
        images = np.stack([self.decode(b, s) for b in batch["image"]])  # (N, H, W, 3) uint8
        if self.training:  # augment training batches only (False while Stride builds validation batches)
            images = self.augment(images)
        x = images.astype(np.float32).transpose(0, 3, 1, 2) / 127.5 - 1.0  # (N, 3, H, W) in [-1, 1]
        return {"x": np.ascontiguousarray(x), "y": batch["label"].astype(np.int64)}

    @staticmethod
    def decode(data: bytes, size: int) -> np.ndarray:
        with Image.open(io.BytesIO(data)) as img:
            img = img.convert("RGB")
            if img.size != (size, size):
                img = img.resize((size, size), Image.BILINEAR)
            return np.asarray(img)

    def augment(self, images: np.ndarray) -> np.ndarray:
        """Random horizontal flips and shifts (edge-padded), drawn with np.random: Stride reseeds it each step."""
        out = np.empty_like(images)
        n, h, w, _ = images.shape
        m = self.config.max_shift
        padded = np.pad(images, ((0, 0), (m, m), (m, m), (0, 0)), mode="edge")
        dy, dx = np.random.randint(0, 2 * m + 1, size=(2, n))
        flip = np.random.rand(n) < 0.5 if self.config.hflip else np.zeros(n, bool)
        for i in range(n):
            crop = padded[i, dy[i]:dy[i] + h, dx[i]:dx[i] + w]
            out[i] = crop[:, ::-1] if flip[i] else crop
        return out

    # ---- model, loss, metric ----

    def build_model(self) -> nn.Module:
        c = self.config.channels

        def stage(cin: int, cout: int) -> nn.Sequential:
            return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.ReLU(),
                                 nn.Conv2d(cout, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.ReLU(),
                                 nn.MaxPool2d(2))

        return nn.Sequential(stage(3, c), stage(c, 2 * c), stage(2 * c, 4 * c),
                             nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4 * c, self.config.num_classes))

    def loss(self, model, batch):
        return F.cross_entropy(model(batch["x"]).float(), batch["y"])

    def metrics(self, model, batch):
        return {"accuracy": (model(batch["x"]).argmax(-1) == batch["y"]).float()}

    def flops_per_sample(self, model) -> float:
        """Training FLOPs per image (forward + backward = 3 x forward), counted from the conv and linear layers."""
        s, flops = self.config.image_size, 0.0
        for m in model.modules():
            if isinstance(m, nn.Conv2d):
                flops += 2 * m.weight.numel() * s * s
            elif isinstance(m, nn.MaxPool2d):
                s //= 2
            elif isinstance(m, nn.Linear):
                flops += 2 * m.weight.numel()
        return 3 * flops
