"""The loop in one process (no Ray, no process group): trains, writes metrics, checkpoints and resumes."""

import json

from conftest import REPO, read_jsonl
from trainers import checkpointing
from trainers.torchrun import complete_checkpoints, main as torchrun_main


def test_one_process_loop_trains_checkpoints_and_resumes(tmp_path, tabular_data):
    args = ["--config", str(REPO / "trainers/configs/tabular_mlp.yaml"), f"data.train_path={tabular_data}/train",
            f"data.val_path={tabular_data}/val", f"run.storage_path={tmp_path}", "run.name=one", "train.epochs=null",
            "train.max_steps=30", "train.log_every_steps=5", "train.eval_every_steps=15", "checkpoint.every_steps=10",
            "checkpoint.keep_last=2", "tracking.mlflow_uri=null"]
    assert torchrun_main(args) == 0
    run = tmp_path / "one"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["global_step"] == 30 and summary["world_size"] == 1
    assert summary["val_loss"] < summary["initial_val_loss"]
    logs = [r for r in read_jsonl(run / "metrics.jsonl") if "train_loss" in r]
    assert [r["step"] for r in logs] == [5, 10, 15, 20, 25, 30]
    assert set(logs[0]) == {"step", "epoch", "samples_seen", "train_loss", "lr", "samples_per_second"}
    evals = [r for r in read_jsonl(run / "metrics.jsonl") if "val_loss" in r]
    assert [r["step"] for r in evals] == [15, 30] and evals[0]["val_accuracy"] is not None
    ckpts = complete_checkpoints(run)
    assert [checkpointing.read_meta(c)["step"] for c in ckpts] == [20, 30]  # keep_last=2
    assert all(checkpointing.verify(c) is None for c in ckpts)

    # Same run name, higher max_steps: resumes at step 30 and continues metrics.jsonl from there.
    assert torchrun_main(args[:-6] + ["train.max_steps=40", "train.log_every_steps=5", "train.eval_every_steps=15",
                                      "checkpoint.every_steps=10", "checkpoint.keep_last=2", "tracking.mlflow_uri=null"]) == 0
    summary = json.loads((run / "summary.json").read_text())
    assert summary["global_step"] == 40 and summary["restarts"] == 1
    steps = [r["step"] for r in read_jsonl(run / "metrics.jsonl") if "train_loss" in r]
    assert steps == [5, 10, 15, 20, 25, 30, 35, 40]
