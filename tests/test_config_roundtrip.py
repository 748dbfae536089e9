"""The config the workers rebuild equals the driver's, key for key and in what the user set.

The driver sends every Ray worker, Tune trial and eval/predict gang `cfg.to_dict()`; each rebuilds it with
`from_dict`. A validator that asks "did the user set this key?" (data.train beside data.train_path) must answer
there as it did on the driver: once it did not, and every mixture failed on every Ray worker.
"""

import re
import sys

import pytest
import yaml
from pydantic import BaseModel

from conftest import REPO
from stride.trainers.config import Config
from stride.trainers.config_reader import build_config, from_dict, load_config, to_yaml

TRAINING_CONFIGS = sorted((REPO / "trainers" / "configs").glob("*.yaml"))
EXAMPLE_CONFIGS = sorted((REPO / "examples").glob("*/*.yaml"))
SWEEPS = sorted((REPO / "tune" / "configs").glob("*.yaml"))

# Every documented key at a value other than its default. Two configs hold them all: one training source (with a
# token budget, which a mixture cannot have) and a mixture; each with one of the built-in tasks.
ONE_SOURCE = {
    "run": {"name": "every_key", "storage_path": "some/runs", "seed": 7, "lock_stale_s": 30.0},
    "data": {"train_path": "d/train", "val_path": "d/val", "shuffle_window_rows": 1000, "read_ahead_windows": 3,
             "pipeline": "thread", "pipeline_timeout_s": 60.0, "length_column": "n",
             "shuffle_window_bytes": 1 << 21, "file_read_threads": 4, "file_root": "d/files"},
    "init": {"from": "weights/model.safetensors", "strict": False, "include": ["^blocks"], "exclude": ["head"],
             "rename": [["^", "m."]]},
    "model": {"name": "char_gpt", "n_layers": 2, "n_heads": 2, "width": 32, "context": 16, "vocab_size": 128,
              "dropout": 0.1},
    "optim": {"name": "sgd", "kwargs": {"nesterov": True}, "lr": 0.05, "weight_decay": 0.0, "betas": [0.8, 0.9],
              "momentum": 0.5, "lr_scaling": "sqrt", "reference_batch_size": 32, "schedule": "wsd",
              "implementation": "for_loop",
              "warmup_steps": 5, "min_lr_ratio": 0.2, "decay_fraction": 0.3, "grad_clip_norm": None,
              "groups": [{"match": "^blocks", "name": "blocks", "lr_scale": 0.5, "weight_decay": 0.1,
                          "unfreeze_at_step": 3}]},
    "train": {"ema": {"decay": 0.99, "eval": "both"}, "callbacks": ["my_callbacks:Stop", {"my_callbacks:At": {"n": 3}}],
              "early_stopping": {"metric": "val_acc", "mode": "max", "patience": 2, "min_delta": 0.01},
              "batch_size_per_worker": 8, "tokens_per_micro_batch": 512, "grad_accum_steps": 2, "max_steps": 40,
              "epochs": None, "precision": "fp32", "eval_every_steps": 10, "log_every_steps": 5, "deterministic": True,
              "num_threads": 1, "nonfinite": "stop", "max_nonfinite_steps": 2, "gc_every_steps": 10,
              "collective_timeout_s": 60.0, "straggler_warn_ratio": 1.5, "hang_timeout_s": 900.0,
              "spike": {"metric": "grad_norm", "window": 50, "factor": 4.0, "action": "skip"},
              "peak_flops": 1e12, "profile_steps": [2, 3], "strategy": "fsdp", "compile": "model",
              "compile_mode": "max-autotune", "activation_checkpointing": True, "activation_checkpointing_every": 2,
              "fsdp": {"shard_size": 2, "offload": "cpu"}},
    "scaling": {"num_workers": 4, "use_gpu": False, "cpus_per_worker": 0.5, "max_failures": 2, "preflight": True,
                "resize_check_s": 5.0, "hang_detector": "observe"},
    "checkpoint": {"keep_best": {"metric": "val_acc", "mode": "max", "k": 2}, "every_steps": 10, "keep_last": 3,
                   "trainable_only": True, "staging_dir": "/var/tmp/stride-staging", "upload": "sync",
                   "max_upload_failures": 5},
    "tracking": {"sinks": ["tensorboard", "wandb"], "mlflow": False, "mlflow_uri": "http://u:secret@127.0.0.1:5000",
                 "experiment": "e", "wandb_project": "p", "wandb_entity": "t", "wandb_tags": ["a"],
                 "wandb_mode": "offline"},
}
MIXTURE = {
    "data": {"train": [{"name": "speech", "path": "d/speech", "weight": 0.7}, {"name": "music", "path": "d/music"}],
             "val": [{"name": "speech", "path": "d/speech_val"}, {"name": "music", "path": "d/music_val"}]},
    "model": {"name": "mlp", "hidden_sizes": [8], "num_classes": 3, "dropout": 0.2, "label_column": "y",
              "feature_columns": ["a", "b"], "standardize": True, "nan_policy": "impute"},
    "scaling": {"num_workers": [1, 2]},
}


def assert_same(rebuilt: BaseModel, original: BaseModel, where: str = "config") -> None:
    """Equal values (pydantic's ==) and, section by section, the same keys set by the user."""
    assert rebuilt == original, where
    assert rebuilt.model_fields_set == original.model_fields_set, f"{where}: keys set"
    for name in type(original).model_fields:
        a, b = getattr(rebuilt, name), getattr(original, name)
        for i, (x, y) in enumerate(zip(a, b) if isinstance(a, (list, tuple)) else [(a, b)]):
            if isinstance(y, BaseModel):
                assert_same(x, y, f"{where}.{name}" + (f"[{i}]" if isinstance(a, (list, tuple)) else ""))


def round_trip(cfg: Config) -> None:
    assert_same(from_dict(cfg.to_dict()), cfg)


@pytest.mark.parametrize("path", TRAINING_CONFIGS, ids=lambda p: p.name)
def test_shipped_training_configs_survive_the_trip_to_the_workers(path):
    round_trip(load_config(path))


@pytest.mark.parametrize("path", EXAMPLE_CONFIGS, ids=lambda p: p.parent.name)
def test_example_configs_survive_the_trip_to_the_workers(path, monkeypatch):
    monkeypatch.chdir(path.parent)  # their tasks are modules beside the YAML, found from the working directory
    before = set(sys.modules)
    try:
        round_trip(load_config(path))
    finally:  # other tests in this process check that a refused command imports no task of an example
        for name in set(sys.modules) - before:
            if str(getattr(sys.modules[name], "__file__", "") or "").startswith(str(REPO / "examples")):
                del sys.modules[name]


@pytest.mark.parametrize("path", SWEEPS, ids=lambda p: p.name)
def test_sweep_base_configs_survive_the_trip_to_the_trials(path):
    from stride.tune.space import load_sweep

    round_trip(load_sweep(path).base_cfg())


def documented_keys() -> set[str]:
    return set(re.findall(r"^\| `([a-z_]+\.[a-z_]+)` \|", (REPO / "docs" / "configuration.md").read_text(), re.M))


def test_every_documented_key_at_a_value_of_its_own_survives_the_trip():
    covered = {f"{s}.{k}" for raw in (ONE_SOURCE, MIXTURE) for s, body in raw.items() for k in body}
    assert documented_keys() <= covered, f"give these keys a value here: {sorted(documented_keys() - covered)}"
    for raw in ONE_SOURCE, MIXTURE:
        cfg = build_config(raw)
        for section, body in raw.items():
            for key, value in body.items():
                field = type(getattr(cfg, section)).model_fields[key.replace("from", "from_")]
                default = field.get_default(call_default_factory=True)
                assert value != default or key == "name", f"{section}.{key} is at its default: the trip would not test it"
        round_trip(cfg)


def test_a_mixture_and_its_validation_sources_rebuild_on_the_workers():
    # The bug: the full dump held the default data.train_path beside data.train ("both are set").
    cfg = build_config({"data": MIXTURE["data"], "model": {"name": "mlp"}})
    assert cfg.data.train_path is None and cfg.data.val_path is None
    round_trip(cfg)
    # A full dump (summary.json, which eval and predict rebuild) rebuilds too.
    assert from_dict(cfg.full_dict()) == cfg


def test_a_path_resolved_on_the_driver_reaches_a_worker_elsewhere(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    sent = build_config({"init": {"from": "w/model.safetensors"}}).to_dict()
    monkeypatch.chdir("/")
    assert from_dict(sent).init.from_ == str(tmp_path / "w" / "model.safetensors")


def test_print_config_shows_every_key():
    dumped = yaml.safe_load(to_yaml(build_config({})))
    assert dumped["train"]["batch_size_per_worker"] == 32 and dumped["checkpoint"]["keep_last"] == 2
