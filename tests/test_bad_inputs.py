"""What a user gets wrong, and what the driver does about it: exit 2 with one line naming the key, the value and
the fix, before anything is written or destroyed; or, for problems training can live with, train and warn once."""

from __future__ import annotations

from stride.errors import UnsafeCheckpointError
import hashlib
import math
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import free_port, run_cli, run_cli_forked
from runs import tiny

TABULAR = ["trainers/main.py", "--config", "trainers/configs/tabular_mlp.yaml"]
TINY = ["train.max_steps=6", "train.epochs=null", "train.log_every_steps=2", "train.eval_every_steps=6",
        "scaling.num_workers=1"]


def _one_line_usage_error(r, *must_name: str) -> str:
    err = r.stderr.strip().splitlines()
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-3000:]
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    assert err and err[-1].startswith("stride: error: "), r.stderr[-2000:]
    for text in must_name:
        assert text in err[-1], err[-1]
    return err[-1]


def _digest(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.rglob("*")) if p.is_file()}


def _nan_data(tmp_path: Path) -> Path:
    import numpy as np

    rng = np.random.default_rng(0)
    x = rng.normal(size=(400, 4))
    y = (x[:, 0] > 0).astype("int64")
    x[::7, 2] = np.nan  # 58 missing values in one column
    for split in ("train", "val"):
        (tmp_path / split).mkdir(parents=True)
        pq.write_table(pa.table({"a": x[:, 0], "b": x[:, 1], "c": x[:, 2], "d": x[:, 3], "label": y}),
                       tmp_path / split / "part-0.parquet")
    return tmp_path


# ---- refused before Ray starts (seconds) ----------------------------------------------------------------

def test_missing_validation_path_names_the_key(tmp_path, tabular_data):
    r = run_cli_forked([*TABULAR, f"data.train_path={tabular_data}/train", f"data.val_path={tmp_path}/no-val",
                        f"run.storage_path={tmp_path}/runs"], timeout=60)
    _one_line_usage_error(r, "data.val_path", str(tmp_path / "no-val"))


@pytest.mark.parametrize("overrides, workers", [(["scaling.num_workers=2"], 2), (["scaling.num_workers=[1,3]"], 3)])
def test_a_batch_larger_than_the_split_is_refused_before_ray_starts(tmp_path, tabular_data, overrides, workers):
    t0 = time.time()
    r = run_cli_forked([*TABULAR, f"data.train_path={tabular_data}/train", f"data.val_path={tabular_data}/val",
                        f"run.storage_path={tmp_path}/runs", "train.batch_size_per_worker=100000", *overrides],
                       timeout=60)
    line = _one_line_usage_error(r, "train.batch_size_per_worker (100000)", f"x {workers} worker(s)",
                                 "use train.batch_size_per_worker=")
    assert time.time() - t0 < 30 and not (tmp_path / "runs").exists(), line  # no Ray, no run folder


def test_nan_features_are_refused_by_default_naming_the_column_and_the_fix(tmp_path):
    data = _nan_data(tmp_path / "data")
    r = run_cli_forked([*TABULAR, f"data.train_path={data}/train", f"data.val_path={data}/val",
                        f"run.storage_path={tmp_path}/runs"], timeout=60)
    line = _one_line_usage_error(r, "'c'", "58", "model.nan_policy=impute")
    assert "'a'" not in line


def test_unwritable_storage_path_names_the_key(tmp_path, tabular_data):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    r = run_cli_forked([*TABULAR, f"data.train_path={tabular_data}/train", f"data.val_path={tabular_data}/val",
                        f"run.storage_path={blocker}/runs"], timeout=60)
    _one_line_usage_error(r, "run.storage_path", str(blocker))
    assert blocker.read_text() == "not a folder"


def test_checkpoint_of_another_model_is_refused_and_left_intact(tmp_path, tabular_data):
    """Resuming run.name with other model.* settings names the tensor that differs; the checkpoint survives."""
    from stride.trainers.run import checkpointing
    from stride.trainers.config_reader import load_config
    from stride.trainers.models import MLP

    storage = tmp_path / "runs"
    cfg = load_config("trainers/configs/tabular_mlp.yaml", [f"run.storage_path={storage}", "model.hidden_sizes=[32]"])
    model = MLP(16, [32], 4)
    ckpt = checkpointing.CheckpointWriter(0).save(storage / cfg.run.name / "checkpoint_000010", {
        "model": model.state_dict()}, {"step": 10, "epoch": 0, "epoch_offset_samples": 0, "samples_seen": 0}).result()
    before = _digest(ckpt)
    r = run_cli_forked([*TABULAR, f"data.train_path={tabular_data}/train", f"data.val_path={tabular_data}/val",
                        f"run.storage_path={storage}", "model.hidden_sizes=[64]"], timeout=60)
    _one_line_usage_error(r, "run.name (tabular_mlp)", "checkpoint_000010", "net.0.weight", "(32, 16)", "(64, 16)")
    assert _digest(ckpt) == before
    assert not (storage / cfg.run.name / "summary.json").exists()


def test_unreachable_ray_address_fails_in_seconds(tmp_path, tabular_data):
    port = free_port()  # nothing listens there
    t0 = time.time()
    r = run_cli_forked([*TABULAR, f"data.train_path={tabular_data}/train", f"data.val_path={tabular_data}/val",
                        f"run.storage_path={tmp_path}/runs"], env={"RAY_ADDRESS": f"127.0.0.1:{port}"}, timeout=120)
    _one_line_usage_error(r, f"RAY_ADDRESS (127.0.0.1:{port}) is not reachable", "unset RAY_ADDRESS")
    assert time.time() - t0 < 60


# ---- refused after connecting: the cluster cannot run the gang ----------------------------------------------
# The refusals are functions of the config and the cluster's resources (connect.plan_scaling,
# driver.choose_pipeline): tested as functions, and once end to end on the shared 2-CPU head.

def _node(cpus: float, gpus: float = 0.0) -> dict:
    return {"Alive": True, "Resources": {"CPU": cpus, "GPU": gpus}}


def _scaling_cfg(*overrides: str):
    from stride.trainers.config_reader import load_config

    return load_config("trainers/configs/tabular_mlp.yaml", list(overrides))


@pytest.mark.parametrize("overrides, nodes, must_name", [
    (["scaling.num_workers=3"], [_node(2)], ["scaling.num_workers (3)", "exceeds the cluster's 2 CPUs",
                                             "scaling.cpus_per_worker=0.67"]),
    (["scaling.num_workers=30"], [_node(2)], ["scaling.num_workers (30)", "use scaling.num_workers=2"]),
    (["scaling.use_gpu=true"], [_node(2)], ["scaling.use_gpu (true) needs GPUs but the cluster has none",
                                            "scaling.use_gpu=false"]),
    (["scaling.use_gpu=true", "scaling.num_workers=4"], [_node(8, 2)], ["scaling.num_workers (4)", "needs 4 GPUs",
                                                                         "has 2", "scaling.num_workers=2"]),
    (["scaling.cpus_per_worker=8"], [_node(2), _node(4)], ["scaling.cpus_per_worker (8)", "largest node's 4 CPUs",
                                                           "scaling.cpus_per_worker=4"]),
    (["scaling.num_workers=[3,4]", "train.batch_size_per_worker=60"], [_node(2)], ["scaling.num_workers (3)", "the cluster's 2 CPUs"]),  # elastic min
])
def test_a_gang_the_cluster_cannot_hold_is_refused_naming_the_fix(overrides, nodes, must_name):
    from stride.errors import UsageError
    from stride.trainers.launch.scaling import plan_scaling

    total = {"CPU": sum(n["Resources"]["CPU"] for n in nodes), "GPU": sum(n["Resources"]["GPU"] for n in nodes)}
    with pytest.raises(UsageError) as e:
        plan_scaling(_scaling_cfg(*overrides), total, nodes)
    assert "\n" not in str(e.value)
    for text in must_name:
        assert text in str(e.value), str(e.value)


def test_a_gang_that_fits_is_planned_and_auto_takes_what_the_cluster_has():
    from stride.trainers.launch.scaling import plan_scaling

    assert plan_scaling(_scaling_cfg("scaling.num_workers=2"), {"CPU": 2.0}, [_node(2)])[:2] == (2, False)
    assert plan_scaling(_scaling_cfg("scaling.num_workers=[1,4]", "train.batch_size_per_worker=60"), {"CPU": 2.0}, [_node(2)])[:2] == (1, False)
    two_gpu_nodes = [_node(8, 1), _node(8, 1)]
    assert plan_scaling(_scaling_cfg("scaling.num_workers=auto", "scaling.use_gpu=auto"), {"CPU": 16.0, "GPU": 2.0},
                        two_gpu_nodes)[:2] == (2, True)
    assert plan_scaling(_scaling_cfg("scaling.num_workers=auto", "scaling.use_gpu=auto"), {"CPU": 16.0},
                        [_node(8), _node(8)])[:2] == (2, False)  # one CPU worker per node


def test_ray_data_needs_cpus_beside_the_gang():
    from stride.errors import UsageError
    from stride.trainers.launch.ray import choose_pipeline

    cfg = _scaling_cfg("data.pipeline=ray_data", "scaling.num_workers=2")
    with pytest.raises(UsageError, match=r"data.pipeline \(ray_data\) needs CPUs beside the worker gang.*"
                                         r"data.pipeline=thread"):
        choose_pipeline(cfg, 2, False, {"CPU": 2.0})
    assert choose_pipeline(cfg, 2, False, {"CPU": 3.0}) == ("ray_data", 0.5)
    auto = _scaling_cfg("data.pipeline=auto", "scaling.num_workers=2")
    assert choose_pipeline(auto, 2, False, {"CPU": 8.0})[0] == "thread"  # CPU workers keep their own thread
    assert choose_pipeline(auto, 2, True, {"CPU": 8.0, "GPU": 2.0})[0] == "ray_data"


@pytest.mark.slow
def test_a_gang_the_cluster_cannot_hold_is_refused_in_seconds_end_to_end(tmp_path, tabular_data, ray_cluster):
    t0 = time.time()
    r = run_cli([*TABULAR, f"data.train_path={tabular_data}/train", f"data.val_path={tabular_data}/val",
                 f"run.storage_path={tmp_path}/runs", "scaling.num_workers=3"], env=ray_cluster, timeout=180)
    _one_line_usage_error(r, "scaling.num_workers (3)", "the cluster's 2 CPUs")
    assert time.time() - t0 < 120  # refused, not left PENDING
    assert not list((tmp_path / "runs").glob("*/checkpoint_*"))


@pytest.mark.slow
def test_wrong_token_is_refused_naming_the_token_file(tmp_path, tabular_data, shared_ray_head):
    head = shared_ray_head.head
    wrong = tmp_path / "wrong_token"
    wrong.write_text("0" * 64)
    wrong.chmod(0o600)
    env = dict(head.client_env(), RAY_AUTH_TOKEN_PATH=str(wrong))
    r = run_cli([*TABULAR, f"data.train_path={tabular_data}/train", f"data.val_path={tabular_data}/val",
                 f"run.storage_path={tmp_path}/runs", *TINY], env=env, timeout=240)
    _one_line_usage_error(r, f"RAY_ADDRESS ({head.address}) refused the connection", "RAY_AUTH_TOKEN_PATH")


# ---- problems training can live with ---------------------------------------------------------------------

@pytest.mark.slow
def test_impute_unreachable_mlflow_and_cpu_bf16_train_and_warn_once(tmp_path, ray_cluster):
    data = _nan_data(tmp_path / "data")
    dead = f"http://127.0.0.1:{free_port()}"
    r = run_cli([*TABULAR, f"data.train_path={data}/train", f"data.val_path={data}/val", "model.nan_policy=impute",
                 f"run.storage_path={tmp_path}/runs", f"tracking.mlflow_uri={dead}", "train.precision=bf16", "scaling.preflight=true", *TINY],
                env=ray_cluster, timeout=300)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    assert out.count("training continues without MLflow") == 1, out[-4000:]
    assert "train.precision=bf16 on CPU" in out
    assert "stride: preflight passed" in out  # scaling.preflight ran the doctor's checks on the gang first
    import json

    summary = json.loads((tmp_path / "runs" / "tabular_mlp" / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["global_step"] == 6
    assert summary["mlflow_run_id"] is None
    assert math.isfinite(summary["val_loss"])  # imputed features give a finite loss, not NaN


class _Payload:
    """Unpickling this runs a shell command: what a planted checkpoint would do with an unrestricted unpickler."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        import os

        return os.system, (f"touch {self.marker}",)


def _plant(folder: Path, marker: Path) -> tuple[Path, str]:
    """A checkpoint that carries a pickle payload, with the digests in its meta.json forged to match: DCP's
    `.metadata` replaced. Returns it and its file."""
    import pickle

    from stride.trainers.run import checkpointing
    from stride.trainers.models import MLP

    meta = {"step": 10, "epoch": 0, "epoch_offset_samples": 0, "samples_seen": 0}
    folder.mkdir(parents=True)
    checkpointing.CheckpointWriter(0).save(folder, {"model": MLP(16, [32], 4).state_dict()}, meta).result()
    evil = folder / checkpointing.DCP_METADATA
    evil.write_bytes(pickle.dumps(_Payload(marker)))
    checkpointing.write_marker(folder, meta)
    # The digests match; verify() reads DCP's .metadata through the allow-list and so finds it.
    assert checkpointing.verify(folder) is not None
    pickle.loads(evil.read_bytes())
    assert marker.exists()  # what an unrestricted unpickler does with it: the payload runs
    marker.unlink()
    return folder, evil.name


def test_a_planted_checkpoint_runs_no_code_when_resumed_sampled_or_exported(tmp_path):
    from stride.trainers.run import checkpointing

    marker = tmp_path / "pwned"
    storage = tmp_path / "runs"
    ckpt, evil = _plant(storage / "tabular_mlp" / "checkpoint_000010", marker)
    says = f"{evil} holds more than tensors"
    before = _digest(ckpt)
    # DCP's .metadata fails verify() (the allow-list reads it): a resume skips it like any unusable checkpoint,
    # with a warning naming it, and loads nothing of it (proven here without training a run: no Ray in this tier).
    warnings: list[str] = []
    assert checkpointing.newest_complete(storage / "tabular_mlp", warnings.append) is None
    assert len(warnings) == 1 and says in warnings[0], warnings
    # generate.py and export.py, named this checkpoint, refuse it in one line.
    (storage / "tabular_mlp" / "summary.json").write_text(
        __import__("json").dumps({"config": {"model": {"name": "mlp", "hidden_sizes": [32]}},
                                  "facts": {"feature_columns": [f"f{i}" for i in range(16)], "label_column": "label",
                                            "num_classes": 4}, "checkpoint": str(ckpt)}))
    for cli in (["-m", "stride", "generate", "--run", str(storage / "tabular_mlp")],
                ["-m", "stride", "export", str(ckpt), str(tmp_path / "out.safetensors")]):
        r = run_cli_forked(cli, timeout=120)
        assert r.returncode == 2 and says in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]
        assert len(r.stderr.strip().splitlines()) == 1
    assert not marker.exists() and not (tmp_path / "out.safetensors").exists() and _digest(ckpt) == before


def test_a_pickled_object_inside_a_dcp_shard_is_refused(tmp_path):
    """DCP stores non-tensor items (the optimizer's hyperparameters) as torch.save'd bytes inside the .distcp files,
    and its default planner loads them with weights_only=False; Stride's planner with weights_only=True."""
    import torch.distributed.checkpoint as dcp

    from stride.trainers.run import checkpointing

    marker = tmp_path / "pwned"
    dcp.save({"optim": {"lr": _Payload(marker)}}, storage_writer=dcp.FileSystemWriter(tmp_path / "ckpt"), no_dist=True)
    with pytest.raises(UnsafeCheckpointError, match="holds more than tensors"):
        checkpointing.load_sharded(tmp_path / "ckpt", {"optim": {"lr": 0.1}})
    assert not marker.exists()
