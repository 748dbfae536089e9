"""Two CPU workers under Ray Train (gloo) on the built-in task: loss falls, replicas agree, every row once, an MLflow
server records the run. The run compiles the model with its loss (train.compile=model, after Ray's DDP wraps the
model on each worker) and logs the step's gradient figures. The run is started from a user's folder that holds
their callbacks module (tests/test_callbacks.py's), with TensorBoard beside MLflow: the callbacks run on every Ray
worker and TensorBoard records the run. Resume on Ray (the step, the same MLflow run, no second one) is the run
stopped four ways in tests/test_user_task.py; that torchrun and Ray train alike, bitwise, with MLflow on in the Ray run
only, is tests/test_data_pipeline.py's."""

import json
import os
import textwrap

import pytest
from mlflow.tracking import MlflowClient

from conftest import REPO, read_jsonl, run_cli
from test_callbacks import CALLBACKS, counters
from test_sinks import scalars

pytestmark = pytest.mark.slow

STEPS = 40


def tiny_args(data, storage, name, steps=STEPS, *extra):
    return ["--config", str(REPO / "trainers/configs/tabular_mlp.yaml"), f"data.train_path={data}/train", f"data.val_path={data}/val",
            f"run.storage_path={storage}", f"run.name={name}", "train.epochs=null", f"train.max_steps={steps}",
            "train.log_every_steps=5", "train.eval_every_steps=20", "checkpoint.every_steps=20",
            "scaling.num_workers=2", "model.hidden_sizes=[64, 64]", *extra]


def losses(run_dir):
    return [r["train_loss"] for r in read_jsonl(run_dir / "metrics.jsonl") if "train_loss" in r]


@pytest.fixture(scope="module")
def ray_runs(tmp_path_factory, tabular_data, mlflow_server, shared_ray_head):
    storage = tmp_path_factory.mktemp("ray_runs")
    project = tmp_path_factory.mktemp("user_folder")  # the user's callbacks module, found where they run from
    (project / "my_callbacks.py").write_text(textwrap.dedent(CALLBACKS))
    mlflow = f"tracking.mlflow_uri={mlflow_server}"
    ray = shared_ray_head.env()
    a = run_cli([str(REPO / "trainers/main.py"), *tiny_args(tabular_data, storage, "a", STEPS, mlflow),
                 "tracking.sinks=[mlflow, tensorboard]", "train.callbacks=[my_callbacks:Counter]",
                 "train.compile=model", "train.spike={metric: grad_norm, action: skip}"],
                env={**ray, "STRIDE_SAMPLE_LOG": str(storage / "samples_a")}, cwd=project)
    assert not shared_ray_head.wait_idle()
    return {"storage": storage, "a": a, "mlflow": mlflow_server, "ray": ray}


def test_two_workers_train_and_agree(ray_runs):
    a = ray_runs["a"]
    assert a.returncode == 0, a.stdout[-3000:] + a.stderr[-3000:]
    assert "Traceback" not in a.stderr
    run = ray_runs["storage"] / "a"
    s = json.loads((run / "summary.json").read_text())
    assert s["status"] == "completed" and s["world_size"] == 2 and s["global_step"] == STEPS
    assert s["samples_seen"] == STEPS * 64 * 2
    assert s["val_loss"] < 0.8 * s["initial_val_loss"]
    curve = losses(run)
    assert curve[-1] < 0.7 * curve[0]  # the loss falls
    c = s["param_checksums"]
    assert len(c) == 2 and c[0] == c[1]  # DDP replicas hold identical weights after training
    # Each worker's peak resident memory: a Ray worker with torch loaded holds well over 100 MB, and less than this
    # machine has.
    badput = sum(v for k, v in s.items() if k.startswith("badput/"))
    assert 0 < s["goodput"] < 1 and s["productive_s"] + badput == pytest.approx(s["goodput_wall_s"], rel=0.01)
    assert len(s["peak_rss_bytes_per_worker"]) == 2
    assert all(100e6 < m < os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") for m in s["peak_rss_bytes_per_worker"])
    for key in ("status", "world_size", "global_step", "epochs_completed", "samples_seen", "rows_dropped", "train_loss",
                "val_loss", "initial_val_loss", "val_accuracy", "samples_per_second", "wall_s", "checkpoint",
                "mlflow_run_id", "restarts", "config"):
        assert key in s, key
    assert s["checkpoint"] and os.path.isdir(s["checkpoint"])
    assert "stride: summary" in a.stdout and "stride: mlflow" in a.stdout
    assert s["compiled_modules"] == 1  # train.compile=model reached both workers from the driver's dict
    assert s["spikes"] == s["spikes_skipped"] and s["spikes"] >= 0  # train.spike reached them too (a healthy run)
    logged = [r for r in read_jsonl(run / "metrics.jsonl") if "train_loss" in r]
    assert all(r["grad_norm"] > 0 and 0 <= r["clipped"] <= 1 and r["straggler_ratio"] >= 1 for r in logged), logged[0]


def test_the_users_callbacks_run_on_every_ray_worker_and_tensorboard_records_the_run(ray_runs):
    run = ray_runs["storage"] / "a"
    assert counters(run) == [{"steps": STEPS, "starts": 1, "step": STEPS, "world_size": 2}] * 2  # one per rank
    assert [step for step, _ in scalars(run / "tensorboard", "train_loss")] == list(range(5, STEPS + 1, 5))
    assert f"stride: tensorboard {run / 'tensorboard'}" in ray_runs["a"].stdout


def test_every_training_row_once_per_epoch(ray_runs, tabular_data):
    import pyarrow.parquet as pq

    records = []
    for f in (ray_runs["storage"] / "samples_a").glob("rank*.jsonl"):
        records += read_jsonl(f)
    train_ids = set(pq.ParquetDataset(tabular_data / "train").read(columns=["sample_id"])["sample_id"].to_pylist())
    per_epoch = len(train_ids) // 128
    epoch0 = [i for r in records if r["micro_step"] < per_epoch for i in r["sample_ids"]]
    assert {r["rank"] for r in records} == {0, 1}
    assert len(epoch0) == len(set(epoch0))  # no row twice
    assert set(epoch0) <= train_ids and len(train_ids) - len(set(epoch0)) < 128  # the documented drop only
    summary = json.loads((ray_runs["storage"] / "a" / "summary.json").read_text())
    assert summary["rows_dropped"] == len(train_ids) - len(set(epoch0))


def test_mlflow_records_params_and_metrics(ray_runs):
    s = json.loads((ray_runs["storage"] / "a" / "summary.json").read_text())
    client = MlflowClient(ray_runs["mlflow"])
    run = client.get_run(s["mlflow_run_id"])
    assert run.data.params["optim.lr"] == "0.003" and run.data.params["model.name"] == "mlp"
    hist = client.get_metric_history(run.info.run_id, "train_loss")
    assert sorted(m.step for m in hist) == list(range(5, STEPS + 1, 5))
    assert [m.step for m in client.get_metric_history(run.info.run_id, "val_loss")] == [20, 40]
    assert run.data.tags.get("final_checkpoint") == s["checkpoint"]
    assert run.info.status == "FINISHED"
