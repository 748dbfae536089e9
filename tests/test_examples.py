"""The user-facing examples (examples/*): each one's data step, training to a stated quality bar, run from a copy
of its folder the way a user runs it (the task module imported from the working directory).

torchrun.py (one process, no Ray). An example's folder on Ray workers (`python -m stride`, 2 workers) is
tests/test_data_pipeline.py's image classifier, trained there with both data pipelines.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from conftest import REPO, read_jsonl, run_cli_forked
from runs import OVERLAY

EXAMPLES = REPO / "examples"
TORCHRUN = str(REPO / "trainers" / "torchrun.py")


def example(name: str, tmp_path: Path, *prepare_args: str) -> Path:
    """A copy of examples/<name> (without any data/ or runs/ of a local try) with its data step run in it."""
    folder = tmp_path / name
    shutil.copytree(EXAMPLES / name, folder, ignore=shutil.ignore_patterns("data", "runs", "__pycache__"))
    check(run_cli_forked(["prepare.py", *prepare_args], timeout=300, cwd=folder), "prepare.py")
    return folder


def check(proc, what: str) -> None:
    assert proc.returncode == 0, f"{what} exited {proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"


def train(folder: Path, *overrides: str, timeout: float = 300) -> dict:
    """Train the example's YAML in its folder in one process; returns summary.json."""
    proc = run_cli_forked([TORCHRUN, "--config", f"{folder.name}.yaml", *OVERLAY, *overrides],
                   timeout=timeout, cwd=folder)
    check(proc, TORCHRUN)
    run_dir = folder / "runs" / folder.name
    assert read_jsonl(run_dir / "metrics.jsonl"), "no metrics were written"
    return json.loads((run_dir / "summary.json").read_text())


@pytest.mark.parametrize("name", ["audio_clips", "hf_causal_lm", "image_classifier", "regression"])
def test_example_yaml_loads_and_states_its_commands(name):
    folder = EXAMPLES / name
    proc = run_cli_forked(["-m", "stride", "--config", f"{name}.yaml", "--print-config"], timeout=120, cwd=folder,
                          env={"PYTHONDONTWRITEBYTECODE": "1"})  # runs in the repository: leave no __pycache__ there
    check(proc, "--print-config")
    assert f"name: {name}" in proc.stdout
    head = (folder / f"{name}.yaml").read_text().split("\nrun:")[0]
    assert "python prepare.py" in head and f"python -m stride --config {name}.yaml" in head
    assert (folder / "README.md").is_file() and (folder / "prepare.py").is_file()


@pytest.mark.slow  # trains for tens of seconds: make test, not make test-fast
def test_regression_example_reaches_5_percent_of_its_initial_loss(tmp_path):
    s = train(example("regression", tmp_path))
    assert s["status"] == "completed" and s["global_step"] == 400
    # Huber loss on the standardised target: 0.43 untrained, about 0.006 after 400 steps (noise floor ~0.002).
    assert s["val_loss"] <= 0.05 * s["initial_val_loss"], s
    assert s["val_abs_error"] <= 0.25, s  # in y's units (y's std is 1.6, the noise's 0.1)


@pytest.mark.slow  # trains for tens of seconds: make test, not make test-fast
def test_image_classifier_example_reaches_95_percent(tmp_path):
    s = train(example("image_classifier", tmp_path), "train.max_steps=150", "train.eval_every_steps=150")
    assert s["status"] == "completed"
    assert s["val_accuracy"] >= 0.95, s  # chance: 1/3; about 1.0 after 150 steps


@pytest.mark.slow  # trains for seconds, in a process: make test, not make test-fast
def test_audio_clips_example_reaches_95_percent_from_its_manifests(tmp_path):
    folder = example("audio_clips", tmp_path)
    s = train(folder)
    assert s["status"] == "completed" and s["global_step"] == 150
    assert s["val_accuracy"] >= 0.95 and s["val_loss"] <= 0.05 * s["initial_val_loss"], s  # chance: 1/4
    # data.length_column: duration buckets the clips; every log line says what padding is left (durations 0.1-0.5 s:
    # about 0.4 of a batch's cells without bucketing)
    logged = [r["padding_fraction"] for r in read_jsonl(folder / "runs" / "audio_clips" / "metrics.jsonl")
              if "train_loss" in r]
    assert logged and all(0.0 <= p < 0.1 for p in logged), logged


@pytest.mark.slow  # trains for tens of seconds: make test, not make test-fast
def test_hf_causal_lm_example_learns_and_generates(tmp_path):
    folder = example("hf_causal_lm", tmp_path)
    s = train(folder, "train.max_steps=150", "train.eval_every_steps=150")
    assert s["status"] == "completed"
    assert len(s["facts"]["tokenizer"]) > 1000 and s["facts"]["vocab_size"] == 1024
    # ln(1024) = 6.95 untrained; about 4.7 (0.68 of it) after 150 steps.
    assert s["val_loss"] <= 0.75 * s["initial_val_loss"], s
    # A task of the user's own: generate.py imports it only when named (--task), from PYTHONPATH (issue 27).
    proc = run_cli_forked(["-m", "stride", "generate", "--run", "runs/hf_causal_lm", "--prompt", "def ",
                    "--tokens", "30", "--temperature", "0.8", "--task", "hf_lm_task:HFCausalLM"], timeout=120, cwd=folder,
                   env={"PYTHONPATH": str(folder)})
    check(proc, "generate.py")
    assert proc.stdout.startswith("def ") and len(proc.stdout.strip()) > len("def ") + 10, proc.stdout
