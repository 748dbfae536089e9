"""`make train` itself, on the embedded local Ray it starts (its guarantee is that cluster, so it does not join the
shared head). In `make test`: the plumbing on a short run (the data target, the printed result paths, the summary,
generate.py on the result), with the data set prepared under the test's folder, never in the checkout. The
quality of the 500-step default job (beats the untrained model by the stated margin, samples Python-looking text)
is the `system` tier: `make test-system`."""

import json
import re
import subprocess
from pathlib import Path

import pytest

from conftest import PYTHON, REPO, auth_folders

pytestmark = pytest.mark.slow


def make_train(tmp_path, *args: str) -> tuple[subprocess.CompletedProcess, dict]:
    r = subprocess.run(["make", "train", f"PY={PYTHON}", f"DATA={tmp_path / 'data'}",
                        f"ARGS=run.storage_path={tmp_path / 'runs'} {' '.join(args)}"], cwd=REPO,
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r, json.loads((tmp_path / "runs" / "char_gpt" / "summary.json").read_text())


def generate(tmp_path, tokens: int) -> str:
    g = subprocess.run([PYTHON, "-m", "stride", "generate", "--run", str(tmp_path / "runs" / "char_gpt"), "--prompt", "def ",
                        "--tokens", str(tokens)], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert g.returncode == 0, g.stderr
    return g.stdout


def test_make_train_prepares_its_data_trains_and_prints_where_the_results_are(tmp_path):
    before = auth_folders()
    r, s = make_train(tmp_path, "train.max_steps=20", "train.eval_every_steps=20", "checkpoint.every_steps=20")
    # The embedded Ray's private token folder goes with the run (it was left behind, one per run); a folder whose
    # driver still runs is another test's.
    assert not set(auth_folders(owner_alive=False)) - set(before)
    assert (tmp_path / "data" / "pystdlib" / "train").is_dir() and (tmp_path / "data" / "pystdlib" / "val").is_dir()
    assert s["status"] == "completed" and s["world_size"] == 2 and s["global_step"] == 20
    assert s["val_loss"] < s["initial_val_loss"]
    for what in ("summary", "metrics", "checkpoint", "mlflow"):
        assert re.search(rf"^stride: {what}\s+\S", r.stdout, re.M), what
    assert f"stride: summary     {tmp_path / 'runs' / 'char_gpt' / 'summary.json'}" in r.stdout
    assert "Sample:" in r.stdout and "stride generate --run" in r.stdout
    sample = generate(tmp_path, 100)
    assert sample.startswith("def ") and len(sample) >= 50


@pytest.mark.system
def test_make_train_default_job_learns_python(tmp_path):
    _, s = make_train(tmp_path)
    assert s["status"] == "completed" and s["world_size"] == 2 and s["global_step"] == 500
    assert s["val_loss"] <= 0.45 * s["initial_val_loss"], (s["val_loss"], s["initial_val_loss"])
    # The default job's training time (the goal: under 3 minutes on 2 cores; 165-186 s on this project's slow 2-vCPU
    # host) is a speed goal: printed here for the record, never asserted by a timed test.
    print(f"make train: {s['train_wall_s']:.0f} s of training")
    # 400 characters: one seeded sample of 200 judged the model by a few lines of docstring-like prose.
    sample = generate(tmp_path, 400)
    assert sample.startswith("def ") and len(sample) >= 150
    # Python-looking: indentation, and some of the keywords/punctuation of real code.
    assert re.search(r"\n {4}", sample)
    assert sum(tok in sample for tok in ("self", "return", "(", ")", ":", "=", "if ", "in ")) >= 4
