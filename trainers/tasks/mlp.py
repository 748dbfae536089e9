"""mlp: a tabular classifier over numeric Parquet columns and an integer label (python datasets/prepare.py tabular).

Which columns, the class count and the feature statistics (standardisation, NaN imputation) come from the data
on the driver (`inspect`); the workers get them as facts and apply them in `transform`.
"""

from __future__ import annotations

import os
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import Field

from stride.datasets.splits import SAMPLE_ID
from stride.errors import DataError
from stride.trainers.models import MLP
from stride.trainers.task import Task
from stride.datasets.splits import DataSplit


def _is_numeric(t) -> bool:
    import pyarrow as pa

    return pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t)


class MLPTask(Task):
    class Config(Task.Config):
        hidden_sizes: list[int] = Field(default_factory=lambda: [256, 256], description="Hidden layer widths")
        num_classes: int | None = Field(None, ge=2, description="Number of classes (null: inferred from the labels)")
        dropout: float = Field(0.0, ge=0.0, lt=1.0, description="Dropout probability")
        label_column: str = Field("label", description="The integer class column")
        feature_columns: list[str] = Field(default_factory=list, description="Input columns (empty: every numeric "
                                           "column but the label and sample_id)")
        standardize: bool = Field(False, description="Scale features by the mean/std of the training split")
        nan_policy: Literal["error", "impute"] = Field("error", description="NaN in features is an error, or imputed "
                                                       "with the training mean")

    metric_names = ("accuracy",)

    @property
    def columns(self) -> tuple[str, ...] | None:  # known once inspect found the feature columns
        f = self.facts
        return (*f["feature_columns"], f["label_column"]) if f else None

    @property
    def predict_columns(self) -> tuple[str, ...] | None:  # stride predict: the features; a label is not needed
        return tuple(self.facts["feature_columns"]) if self.facts else None

    # ---- driver: which columns, how many classes, the statistics of the training features ----

    def inspect(self, train: DataSplit, val: DataSplit | None) -> dict:
        d = self.config
        feats = self._feature_columns(train)
        splits = (train, val) if val is not None else (train,)
        for split in splits[1:]:
            missing = [c for c in (*feats, d.label_column) if c not in split.schema.names]
            if missing:
                raise DataError(f"{split.key}: column {missing[0]!r} is missing (it is in {train.key}); give both "
                                f"splits the same columns")
        # One pass over each split in batches (the driver never holds a split): labels, NaNs, feature statistics.
        stats = {s.name: _SplitStats(s, feats, d.label_column) for s in splits}
        num_classes = self._check_labels(splits, stats)
        facts = {"feature_columns": list(feats), "label_column": d.label_column, "num_classes": num_classes}
        train_stats = stats["train"]
        if d.nan_policy == "error":
            for split in splits:
                stats[split.name].refuse_nan()
        else:
            facts["fill"] = np.nan_to_num(train_stats.mean).tolist()
        if d.standardize:
            # Constant columns get std 1 so they map to 0, never NaN or inf.
            std = np.sqrt(train_stats.var)
            std[~np.isfinite(std) | (std < 1e-12)] = 1.0
            facts["mean"], facts["std"] = train_stats.mean.tolist(), std.tolist()
        return facts

    def _feature_columns(self, train: DataSplit) -> tuple[str, ...]:
        d, schema = self.config, train.schema
        if d.label_column not in schema.names:
            raise DataError(f"model.label_column ({d.label_column}) is not a column of {train.key} (columns: "
                            f"{schema.names}); set model.label_column=<name>")
        import pyarrow as pa

        if not pa.types.is_integer(schema.field(d.label_column).type):
            raise DataError(f"model.label_column ({d.label_column}) has type {schema.field(d.label_column).type}; "
                            f"labels must be integers 0..C-1")
        if d.feature_columns:
            missing = [c for c in d.feature_columns if c not in schema.names]
            if missing:
                raise DataError(f"model.feature_columns ({missing}) are not columns of {train.key} (columns: "
                                f"{schema.names}); fix the names or leave model.feature_columns empty to use every "
                                f"numeric column")
            non_numeric = [c for c in d.feature_columns if not _is_numeric(schema.field(c).type)]
            if non_numeric:
                raise DataError(f"model.feature_columns ({non_numeric}) are not numeric; remove them from "
                                f"model.feature_columns")
            return tuple(d.feature_columns)
        feats = tuple(n for n in schema.names if n not in (d.label_column, SAMPLE_ID) and _is_numeric(schema.field(n).type))
        if not feats:
            raise DataError(f"{train.key}: no numeric feature columns besides '{d.label_column}'; set model.feature_columns")
        return feats

    def _check_labels(self, splits, stats) -> int:
        label = self.config.label_column
        num_classes = self.config.num_classes
        for split in splits:
            st = stats[split.name]
            if st.label_nulls:
                raise DataError(f"model.label_column ({label}) has {st.label_nulls} missing values in {split.key}; "
                                f"drop those rows")
            lo, hi = st.label_min, st.label_max
            num_classes = num_classes or hi + 1
            if lo < 0:
                raise DataError(f"model.label_column ({label}) has negative labels in {split.key} (min {lo}); labels "
                                f"must be 0..num_classes-1: relabel them")
            if hi >= num_classes:
                raise DataError(f"model.num_classes ({num_classes}) does not cover the labels in {split.key} (range "
                                f"{lo}..{hi}); labels must be 0..num_classes-1: set model.num_classes={hi + 1} or relabel")
        return num_classes

    # ---- workers ----

    def transform(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        f = self.facts
        x = np.stack([batch[c].astype(np.float32) for c in f["feature_columns"]], axis=1)
        if "fill" in f:
            bad = np.isnan(x)
            if bad.any():
                x[bad] = np.take(np.asarray(f["fill"], np.float32), np.nonzero(bad)[1])
        if "mean" in f:
            x = (x - np.asarray(f["mean"], np.float32)) / np.asarray(f["std"], np.float32)
        out = {"x": x}
        if f["label_column"] in batch:  # stride predict reads the features only
            out["y"] = batch[f["label_column"]].astype(np.int64)
        return out

    def build_model(self) -> MLP:
        c = self.config
        return MLP(len(self.facts["feature_columns"]), list(c.hidden_sizes), c.num_classes or self.facts["num_classes"],
                   c.dropout)

    def loss(self, model, batch):
        return F.cross_entropy(model(batch["x"]).float(), batch["y"])

    def metrics(self, model, batch):
        return {"accuracy": (model(batch["x"]).argmax(-1) == batch["y"]).float()}

    def predict(self, model, batch):
        probs = torch.softmax(model(batch["x"]).float(), dim=-1)
        return {"label": probs.argmax(-1), "probs": probs}


class _SplitStats:
    """One pass over a split in batches: the label range and nulls, NaN/missing counts per feature, and the
    features' mean and variance (NaNs left out), merged batch by batch (Chan et al.)."""

    def __init__(self, split: DataSplit, feats: tuple[str, ...], label: str):
        import pyarrow.compute as pc

        self.split, self.feats = split, feats
        k = len(feats)
        self.count, self.mean, self.m2 = np.zeros(k), np.zeros(k), np.zeros(k)
        self.missing = np.zeros(k, dtype=np.int64)
        self.label_nulls, self.label_min, self.label_max = 0, None, None
        for table in split.batches([*feats, label]):
            labels = table.column(label)
            self.label_nulls += labels.null_count
            lo, hi = (v.as_py() for v in (pc.min(labels), pc.max(labels)))
            if lo is not None:
                self.label_min = lo if self.label_min is None else min(self.label_min, lo)
                self.label_max = hi if self.label_max is None else max(self.label_max, hi)
            self._add(_features(table, feats))
        self.label_min = self.label_min or 0
        self.label_max = self.label_max if self.label_max is not None else -1

    def _add(self, x: np.ndarray) -> None:
        ok = ~np.isnan(x)
        self.missing += (~ok).sum(axis=0)
        n = ok.sum(axis=0).astype(np.float64)
        with np.errstate(invalid="ignore", divide="ignore"):
            mean = np.where(n > 0, np.nansum(x, axis=0) / np.maximum(n, 1), 0.0)
            m2 = np.nansum((x - mean) ** 2, axis=0)
            total = self.count + n
            delta = mean - self.mean
            self.mean = np.where(total > 0, self.mean + delta * n / np.maximum(total, 1), 0.0)
            self.m2 = self.m2 + m2 + delta ** 2 * self.count * n / np.maximum(total, 1)
        self.count = total

    @property
    def var(self) -> np.ndarray:
        return np.where(self.count > 0, self.m2 / np.maximum(self.count, 1), np.nan)

    def refuse_nan(self) -> None:
        """Never train on NaN silently: missing values per feature column are refused before any worker starts."""
        for name, bad in zip(self.feats, self.missing):
            if bad:
                split = self.split
                where = os.path.basename(split.files[0]) if len(split.files) == 1 else f"{len(split.files)} files"
                raise DataError(f"{split.key}: feature column '{name}' has {bad} NaN/missing values in {where}; clean "
                                f"the data or set model.nan_policy=impute (training mean)")


def _features(table, feats) -> np.ndarray:
    """The features as float64 (rows, features), nulls as NaN."""
    x = np.empty((table.num_rows, len(feats)), dtype=np.float64)
    for i, c in enumerate(feats):
        x[:, i] = table.column(c).to_numpy(zero_copy_only=False)
    return x
