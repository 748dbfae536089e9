"""tabular_mlp.yaml at its defaults, 2 workers: >= 95% on prepare.py's tabular set, and sound enough to train
well on another small real labelled Parquet set with only the data paths changed.

Quality is the loop's, not the launcher's: both runs are cases of one torchrun launch of 2 ranks (the same
per-worker loop Ray runs; tests/torchrun_cases.py), which saves two Ray gang starts."""

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import REPO, run_torchrun_cases

pytestmark = pytest.mark.slow


def _digits(folder):
    # scikit-learn ships the UCI handwritten digits (1797 images, 8x8 pixels, 10 classes) inside the package.
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    rng = np.random.default_rng(0)
    is_val = rng.random(len(y)) < 0.2
    for split, mask in (("train", ~is_val), ("val", is_val)):
        (folder / split).mkdir(parents=True)
        cols = {f"pixel{i}": x[mask, i].astype(np.float64) for i in range(x.shape[1])}  # no sample_id column
        pq.write_table(pa.table({**cols, "label": y[mask].astype(np.int64)}), folder / split / "digits.parquet")
    return folder


@pytest.fixture(scope="module")
def runs(full_tabular_data, tmp_path_factory):
    """Both runs at the config's defaults, only the data paths (and where results go) given."""
    root = tmp_path_factory.mktemp("goals")
    digits = _digits(root / "digits")
    cases = [{"label": name, "args": ["--config", str(REPO / "trainers/configs/tabular_mlp.yaml"),
                                      f"data.train_path={data}/train", f"data.val_path={data}/val",
                                      f"run.storage_path={root / name}"]}
             for name, data in (("tabular", full_tabular_data), ("digits", digits))]
    r, ranks = run_torchrun_cases(cases, root / "results", cwd=root, timeout=1200)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    return {name: json.loads((root / name / "tabular_mlp" / "summary.json").read_text()) for name in ("tabular", "digits")}


def test_tabular_defaults_reach_95_percent(runs):
    s = runs["tabular"]
    assert s["world_size"] == 2 and s["epochs_completed"] >= 19.9
    assert s["val_accuracy"] >= 0.95, s["val_accuracy"]


def test_tabular_defaults_train_well_on_real_digits(runs):
    s = runs["digits"]
    assert s["world_size"] == 2 and s["val_accuracy"] >= 0.93, s["val_accuracy"]
