"""`make train` itself: the default job trains a char_gpt that beats the untrained model by the stated margin,
within the time goal, prints where its results are, and generate.py samples Python-looking text from it."""

import json
import re
import subprocess

import pytest

from conftest import PYTHON, REPO

pytestmark = pytest.mark.slow


def test_make_train_default_job(tmp_path):
    r = subprocess.run(["make", "train", f"PY={PYTHON}", f"ARGS=run.storage_path={tmp_path}"], cwd=REPO,
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    run = tmp_path / "char_gpt"
    s = json.loads((run / "summary.json").read_text())
    assert s["status"] == "completed" and s["world_size"] == 2
    assert s["val_loss"] <= 0.45 * s["initial_val_loss"], (s["val_loss"], s["initial_val_loss"])
    # The default job's training time (the goal: under 3 minutes on 2 cores; 165-186 s on this project's slow 2-vCPU
    # host) is a speed goal: printed here for the record, never asserted by a timed test.
    print(f"make train: {s['train_wall_s']:.0f} s of training")
    for what in ("summary", "metrics", "checkpoint", "mlflow"):
        assert re.search(rf"^stride: {what}\s+\S", r.stdout, re.M), what
    # 400 characters: one seeded sample of 200 judged the model by a few lines of docstring-like prose.
    g = subprocess.run([PYTHON, "trainers/generate.py", "--run", str(run), "--prompt", "def ", "--tokens", "400"],
                       cwd=REPO, capture_output=True, text=True, timeout=120)
    assert g.returncode == 0, g.stderr
    sample = g.stdout
    assert sample.startswith("def ") and len(sample) >= 150
    # Python-looking: indentation, and some of the keywords/punctuation of real code.
    assert re.search(r"\n {4}", sample)
    assert sum(tok in sample for tok in ("self", "return", "(", ")", ":", "=", "if ", "in ")) >= 4
