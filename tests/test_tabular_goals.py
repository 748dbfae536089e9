"""tabular_mlp.yaml at its defaults, 2 workers: >= 95% on prepare.py's tabular set, and sound enough to train
well on another small real labelled Parquet set with only the data paths changed."""

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import run_cli

pytestmark = pytest.mark.slow


def train_defaults(train, val, storage, ray_env):
    r = run_cli(["trainers/main.py", "--config", "trainers/configs/tabular_mlp.yaml", f"data.train_path={train}",
                 f"data.val_path={val}", f"run.storage_path={storage}"], env=ray_env, timeout=900)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    return json.loads((storage / "tabular_mlp" / "summary.json").read_text())


def test_tabular_defaults_reach_95_percent(full_tabular_data, tmp_path, ray_cluster):
    s = train_defaults(full_tabular_data / "train", full_tabular_data / "val", tmp_path, ray_cluster)
    assert s["world_size"] == 2 and s["epochs_completed"] >= 19.9
    assert s["val_accuracy"] >= 0.95, s["val_accuracy"]


def test_tabular_defaults_train_well_on_real_digits(tmp_path, ray_cluster):
    # scikit-learn ships the UCI handwritten digits (1797 images, 8x8 pixels, 10 classes) inside the package.
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    rng = np.random.default_rng(0)
    is_val = rng.random(len(y)) < 0.2
    for split, mask in (("train", ~is_val), ("val", is_val)):
        (tmp_path / split).mkdir()
        cols = {f"pixel{i}": x[mask, i].astype(np.float64) for i in range(x.shape[1])}  # no sample_id column
        pq.write_table(pa.table({**cols, "label": y[mask].astype(np.int64)}), tmp_path / split / "digits.parquet")
    s = train_defaults(tmp_path / "train", tmp_path / "val", tmp_path / "runs", ray_cluster)
    assert s["val_accuracy"] >= 0.93, s["val_accuracy"]
