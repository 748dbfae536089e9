"""A regression Task: an MLP predicting a float target from numeric columns, trained with the Huber loss.

What it shows: `inspect` computes the training split's feature and target statistics once, on the driver; every
worker gets them as `self.facts` and standardises in `transform`. The model learns the standardised target; the
metric `abs_error` is reported in the target's own units (val_abs_error: mean |prediction - y| over the
validation split).
"""

from __future__ import annotations

import numpy as np
import torch.nn as nn
import torch.nn.functional as F
from pydantic import Field

from stride import DataError, DataSplit, Task


class Regression(Task):
    class Config(Task.Config):  # the model.<field> keys of the YAML
        features: list[str] = Field(default_factory=lambda: ["x1", "x2", "x3", "x4"], description="Input columns")
        target: str = Field("y", description="The float column to predict")
        hidden: int = Field(128, ge=1, description="Width of the hidden layers")
        layers: int = Field(3, ge=1, description="Hidden layers")
        huber_delta: float = Field(1.0, gt=0, description="Huber loss: quadratic below this error (standardised units)")

    metric_names = ("abs_error",)

    @property
    def columns(self) -> tuple[str, ...]:
        return (*self.config.features, self.config.target)

    def inspect(self, train: DataSplit, val: DataSplit | None) -> dict:
        for split in (train, val) if val is not None else (train,):
            missing = [c for c in self.columns if c not in split.schema.names]
            if missing:
                raise DataError(f"{split.key}: no column {missing[0]!r} (found {split.schema.names}); set "
                                f"model.features / model.target to your column names")
        table = train.read(self.columns)
        x = np.stack([table.column(c).to_numpy().astype(np.float64) for c in self.config.features], axis=1)
        y = table.column(self.config.target).to_numpy().astype(np.float64)
        if not (np.isfinite(x).all() and np.isfinite(y).all()):
            raise DataError(f"{train.key}: NaN or inf in {list(self.columns)}; clean the data first")
        return {"x_mean": x.mean(0).tolist(), "x_std": np.maximum(x.std(0), 1e-12).tolist(),
                "y_mean": float(y.mean()), "y_std": float(max(y.std(), 1e-12))}

    def transform(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        f = self.facts
        x = np.stack([batch[c] for c in self.config.features], axis=1).astype(np.float32)
        x = (x - np.asarray(f["x_mean"], np.float32)) / np.asarray(f["x_std"], np.float32)
        if self.config.target not in batch:  # stride predict reads the features only
            return {"x": x}
        y = (batch[self.config.target].astype(np.float32) - f["y_mean"]) / f["y_std"]
        return {"x": x, "y": y.astype(np.float32)}

    def build_model(self) -> nn.Module:
        c, layers, width = self.config, [], len(self.config.features)
        for _ in range(c.layers):
            layers += [nn.Linear(width, c.hidden), nn.SiLU()]
            width = c.hidden
        return nn.Sequential(*layers, nn.Linear(width, 1))

    def loss(self, model, batch):
        return F.huber_loss(model(batch["x"]).squeeze(-1).float(), batch["y"], delta=self.config.huber_delta)

    def metrics(self, model, batch):
        error = model(batch["x"]).squeeze(-1).float() - batch["y"]
        return {"abs_error": error.abs() * self.facts["y_std"]}  # back in the target's units

    @property
    def predict_columns(self) -> tuple[str, ...]:  # stride predict: the features; no target needed
        return tuple(self.config.features)

    def predict(self, model, batch):
        """stride predict: each row's prediction in the target's units."""
        return {"prediction": model(batch["x"]).squeeze(-1).float() * self.facts["y_std"] + self.facts["y_mean"]}
