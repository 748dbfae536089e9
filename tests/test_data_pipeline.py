"""data.pipeline=ray_data: Ray Data tasks read and transform the training rows, and the run is the same run as with
the worker's own thread (data.pipeline=thread), augmentation included. The thread pipeline's reference runs under
torchrun, without MLflow: the Ray run is also the suite's proof that the two launchers, MLflow on or off, train
alike bitwise; the thread pipeline on Ray against torchrun is the default path's proof. Without CPUs beside the gang ray_data is refused before any worker starts: a function of the
cluster's resources (tests/test_bad_inputs.py::test_ray_data_needs_cpus_beside_the_gang), whose end-to-end refusal
is the gang's, once for the command (tests/test_bad_inputs.py)."""

from __future__ import annotations

import json

import pytest

from runs import OVERLAY, launch
from test_examples import check, example, read_jsonl

pytestmark = pytest.mark.slow


ARGS = ["--config", "image_classifier.yaml", "train.max_steps=12", "train.log_every_steps=1",
        "train.eval_every_steps=12", "checkpoint.every_steps=12", "train.batch_size_per_worker=16",
        "train.grad_accum_steps=2", "scaling.num_workers=2", "scaling.cpus_per_worker=0.5"]


def train(folder, name, ray_env, *overrides):
    """2 workers from the example's folder: on Ray with `ray_env`, else 2 ranks under torchrun."""
    if ray_env is None:
        proc = launch.torchrun([*ARGS, f"run.name={name}", *overrides], nproc=2, cwd=folder)
    else:
        proc = launch.ray([*ARGS, f"run.name={name}", *overrides], ray_env, cwd=folder)
    check(proc, name)
    run_dir = folder / "runs" / name
    return proc.stdout, json.loads((run_dir / "summary.json").read_text()), read_jsonl(run_dir / "metrics.jsonl")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The image example and its thread-pipeline run under torchrun, MLflow off: what both Ray runs must equal."""
    folder = example("image_classifier", tmp_path_factory.mktemp("pipeline"), "--train", "800", "--val", "200")
    return folder, *train(folder, "thread", None, "data.pipeline=thread", *OVERLAY)


def test_ray_data_pipeline_trains_bitwise_like_the_thread_pipeline(reference, ray_cluster):
    # The image example decodes PNGs and augments them with np.random in transform: the stream that moves into
    # Ray Data tasks must draw exactly what the training thread draws, micro-batch after micro-batch.
    folder, out_t, thread, lines_t = reference
    # MLflow records the Ray run (its default store beside the runs) and not the torchrun one: it changes nothing.
    out_r, ray_data, lines_r = train(folder, "ray_data", ray_cluster, "data.pipeline=ray_data")
    assert "data pipeline ray_data" in out_r  # the Ray driver's line naming the cluster and the pipeline
    assert thread["config"]["data"]["pipeline"] == "thread" and ray_data["config"]["data"]["pipeline"] == "ray_data"
    assert thread["status"] == ray_data["status"] == "completed"
    losses = lambda lines: [(x["step"], x["train_loss"]) for x in lines if "train_loss" in x]  # noqa: E731
    assert losses(lines_t) == losses(lines_r) and len(losses(lines_t)) == 12
    assert thread["param_checksums"] == ray_data["param_checksums"]
    assert thread["val_loss"] == ray_data["val_loss"]
    assert thread["mlflow_run_id"] is None and ray_data["mlflow_run_id"]


def test_the_thread_pipeline_on_ray_trains_bitwise_like_torchrun(reference, ray_cluster):
    # The default pipeline on the product's main path: each Ray worker rebuilds the config from the driver's dict and
    # reads its own rows, as each torchrun rank does from the YAML. Nothing may differ, augmentation included.
    folder, _, torchrun, lines_t = reference
    out_r, ray, lines_r = train(folder, "ray", ray_cluster, "data.pipeline=thread", *OVERLAY)
    assert "data pipeline thread" in out_r
    losses = lambda lines: [(x["step"], x["train_loss"]) for x in lines if "train_loss" in x]  # noqa: E731
    assert losses(lines_t) == losses(lines_r) and len(losses(lines_t)) == 12
    assert torchrun["param_checksums"] == ray["param_checksums"] and torchrun["val_loss"] == ray["val_loss"]
