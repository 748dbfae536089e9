"""Sweeps (tune/): the space parser, the sweep file and the cluster's resources (pure: the gangs a cluster can hold
are a function of what ray.nodes() answers), then real sweeps through the command on the session's test Ray head
(tests/shared_ray.py, 2 CPUs on any machine): two trials at a time, ASHA stopping a bad trial, MLflow parent/child
runs on a real `mlflow server`, usage errors in seconds, and a SIGKILLed sweep over a user's own task field that
resumes without rerunning its finished trial."""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import time
import uuid
from pathlib import Path

import pytest
import yaml

from conftest import PYTHON, REPO, descendants, kill_pids, read_jsonl, run_cli, run_cli_forked
from tune_fixtures import (USER_TASK, copy_user_project, events, fake_cluster, max_overlap, signal_param_bytes,
                           wait_for, write_sweep)
from stride.errors import ConfigError
from stride.tune.space import build_sweep, load_sweep, parse_space

SWEEP_CONFIGS = sorted((REPO / "tune" / "configs").glob("*.yaml"))


# ---------------------------------------------------------------------------------------------------------------
# 1. pure: the sweep file and the search space
# ---------------------------------------------------------------------------------------------------------------

def _raw(space: dict, base: dict | None = None, **sweep) -> dict:
    return {"sweep": {"name": "t", "base_config": "trainers/configs/tabular_mlp.yaml", **sweep},
            "base": base or {}, "space": space}


@pytest.mark.parametrize("path", SWEEP_CONFIGS, ids=lambda p: p.name)
def test_shipped_sweep_configs_load_and_state_their_command(path):
    sweep = load_sweep(path)
    assert sweep.dims and sweep.sweep.name == path.stem
    assert f"python tune/main.py --config tune/configs/{path.name}" in path.read_text().split("\nsweep:")[0]
    assert sweep.base_cfg().scaling.num_workers == 1  # small by design: trials run side by side


def test_shipped_configs_are_the_two_promised():
    assert {p.name for p in SWEEP_CONFIGS} >= {"lr_sweep.yaml", "char_gpt_sweep.yaml"}


def test_distributions_become_tune_domains():
    from ray.tune.search.sample import Categorical, Float, Integer

    dims = {d.key: d for d in parse_space({
        "optim.lr": {"loguniform": [1.0e-4, 1.0e-1]},
        "model.dropout": {"uniform": [0.0, 0.5]},
        "train.batch_size_per_worker": {"randint": [16, 65]},
        "optim.weight_decay": {"grid": [0.0, 0.01]},
        "train.grad_accum_steps": {"choice": [1, 2]},
    })}
    lr = dims["optim.lr"].tune_domain("random")
    assert isinstance(lr, Float) and (lr.lower, lr.upper) == (1e-4, 1e-1)
    assert isinstance(dims["model.dropout"].tune_domain("random"), Float)
    bs = dims["train.batch_size_per_worker"].tune_domain("random")
    assert isinstance(bs, Integer) and (bs.lower, bs.upper) == (16, 65)
    assert dims["train.batch_size_per_worker"].values_to_check() == [16, 64]  # randint's high is exclusive
    assert dims["optim.weight_decay"].tune_domain("random") == {"grid_search": [0.0, 0.01]}
    assert isinstance(dims["train.grad_accum_steps"].tune_domain("random"), Categorical)
    assert dims["train.grad_accum_steps"].tune_domain("grid") == {"grid_search": [1, 2]}


def test_yaml_exponent_without_dot_is_a_number():
    (d,) = parse_space({"optim.lr": {"loguniform": ["1e-4", "1e-1"]}})  # PyYAML reads 1e-4 as a string
    assert d.args == (1e-4, 1e-1)


def test_list_choices_travel_as_json_and_decode():
    sweep = build_sweep(_raw({"model.hidden_sizes": {"choice": [[64], [128, 64]]}}))
    (d,) = sweep.dims
    assert d.encoded and all(isinstance(v, str) for v in d.args)
    assert sweep.decode({"model.hidden_sizes": d.args[1]}) == {"model.hidden_sizes": [128, 64]}
    raw = sweep.trial_raw({"model.hidden_sizes": [128, 64]}, "abc_00001", "sqlite:///x.db")
    assert raw["model"]["hidden_sizes"] == [128, 64] and raw["run"]["name"] == "abc_00001"
    assert Path(raw["run"]["storage_path"]) == sweep.sweep_dir  # the trial's run folder is <sweep>/<trial id>


def test_relative_storage_path_is_resolved_where_the_sweep_is_read(tmp_path, monkeypatch):
    # Trials run in Tune's per-trial working directories: a relative path must not follow them there.
    monkeypatch.chdir(tmp_path)
    sweep = build_sweep(_raw({"optim.lr": {"loguniform": [1e-4, 1e-1]}}, storage_path="runs"))
    assert sweep.sweep_dir == tmp_path / "runs" / "t"
    monkeypatch.chdir(REPO)
    assert sweep.sweep_dir == tmp_path / "runs" / "t"
    raw = sweep.trial_raw({"optim.lr": 0.01}, "abc_00000", "sqlite:///x.db")
    assert raw["run"]["storage_path"] == str(tmp_path / "runs" / "t")


def test_a_relative_init_from_reaches_every_trial_resolved_where_the_sweep_is_read(tmp_path, monkeypatch):
    # The driver checked the right file, then each trial, in Tune's working directory, resolved it again there.
    monkeypatch.chdir(tmp_path)
    sweep = build_sweep(_raw({"optim.lr": {"loguniform": [1e-4, 1e-1]}}, base={"init.from": "w/model.safetensors"}))
    monkeypatch.chdir(REPO)  # a trial's working directory
    raw = sweep.trial_raw({"optim.lr": 0.01}, "abc_00000", "sqlite:///x.db")
    from stride.trainers.config_reader import build_config

    assert build_config(raw).init.from_ == str(tmp_path / "w" / "model.safetensors")


def test_a_nested_base_key_sets_one_key_of_a_section():
    sweep = build_sweep(_raw({"optim.lr": {"loguniform": [1e-4, 1e-1]}}, base={"train.early_stopping.patience": 2}))
    assert sweep.base_cfg().train.early_stopping.patience == 2


def test_trial_count():
    grid = build_sweep(_raw({"optim.lr": {"grid": [0.1, 0.01, 0.001]}, "train.batch_size_per_worker": {"choice": [32, 64]}},
                            search="grid", num_samples=1))
    assert grid.num_trials() == 6
    rnd = build_sweep(_raw({"optim.lr": {"grid": [0.1, 0.01]}, "model.dropout": {"uniform": [0.0, 0.2]}}, num_samples=3))
    assert rnd.num_trials() == 6  # random search enumerates grid entries num_samples times, as Tune does


@pytest.mark.parametrize("space,words", [
    ({"optim.lrr": {"loguniform": [1e-4, 1e-1]}}, ["space.optim.lrr", "did you mean optim.lr"]),
    ({"optimizer.lr": {"loguniform": [1e-4, 1e-1]}}, ["space.optimizer.lr", "no section 'optimizer'"]),
    ({"lr": {"loguniform": [1e-4, 1e-1]}}, ["space.lr", "section.field"]),
    ({"optim.lr": {"uniform": [0.0, 0.1]}}, ["space.optim.lr", "can give 0.0", "greater than 0"]),
    ({"optim.lr": {"loguniform": [0.0, 0.1]}}, ["space.optim.lr", "low > 0"]),
    ({"model.dropout": {"uniform": [0.0, 1.0]}}, ["space.model.dropout", "can give 1.0", "less than 1"]),
    ({"train.batch_size_per_worker": {"uniform": [16, 64]}}, ["space.train.batch_size_per_worker", "use randint"]),
    ({"train.batch_size_per_worker": {"choice": [32, 0]}}, ["space.train.batch_size_per_worker", "can give 0"]),
    ({"optim.name": {"choice": ["adamw", "adam2"]}}, ["space.optim.name", "'adam2'", "adamw"]),
    ({"optim.lr": {"normal": [0.1, 0.2]}}, ["space.optim.lr", "unknown distribution 'normal'"]),
    ({"optim.lr": 0.1}, ["space.optim.lr", "one distribution", "base"]),
    ({"optim.lr": {"uniform": [0.2, 0.1]}}, ["space.optim.lr", "low < high"]),
    ({"train.max_steps": {"randint": [10, 10]}}, ["space.train.max_steps", "high > low"]),
    ({"optim.lr": {"choice": [0.1, 0.1]}}, ["space.optim.lr", "repeats"]),
    ({"data.train_path": {"choice": ["a", "b"]}}, ["space.data.train_path", "fixed for a sweep"]),
    ({"scaling.num_workers": {"choice": [1, 2]}}, ["space.scaling.num_workers", "fixed for a sweep"]),
    ({"run.name": {"choice": ["a", "b"]}}, ["space.run.name", "cannot be searched"]),
    ({}, ["space must map"]),
])
def test_space_errors_name_the_entry(space, words):
    with pytest.raises(ConfigError) as e:
        build_sweep(_raw(space))
    msg = str(e.value)
    assert "\n" not in msg
    for w in words:
        assert w in msg, msg


def test_combinations_of_discrete_values_are_checked():
    # Each value is valid with the base (width 96, 4 heads), but width 128 with 3 heads is not.
    raw = _raw({"model.width": {"choice": [96, 128]}, "model.n_heads": {"choice": [4, 3]}},
               base={"model.width": 96}, base_config="trainers/configs/char_gpt.yaml")
    with pytest.raises(ConfigError, match=r"combination model.width=128, model.n_heads=3"):
        build_sweep(raw)


@pytest.mark.parametrize("raw_sweep,base,words", [
    ({"nme": "x"}, {}, ["sweep.nme", "did you mean sweep.name"]),
    ({"mode": "minimize"}, {}, ["sweep.mode", "'min'"]),
    ({"metric": "accuracy"}, {}, ["sweep.metric", "val_accuracy"]),
    ({"metric": "val_bpb"}, {}, ["sweep.metric (val_bpb)", "model.name (mlp)", "val_accuracy"]),
    ({"max_concurrent_trials": 0}, {}, ["sweep.max_concurrent_trials"]),
    ({"name": "a/b"}, {}, ["sweep.name"]),
    ({"base_config": "nope.yaml"}, {}, ["sweep.base_config (nope.yaml) does not exist"]),
    ({}, {"optim.lrr": 0.1}, ["base.optim.lrr", "did you mean optim.lr"]),
    ({}, {"run.storage_path": "/x"}, ["base.run.storage_path", "sweep.storage_path"]),
    ({}, {"train.max_steps": 0}, ["base", "train.max_steps (0)"]),
    ({}, {"data.val_path": None}, ["sweep.metric (val_loss) needs validation data"]),
    ({"scheduler": "asha"}, {"train.eval_every_steps": None}, ["sweep.scheduler (asha)", "base.train.eval_every_steps"]),
])
def test_sweep_file_errors(raw_sweep, base, words):
    raw = _raw({"optim.lr": {"loguniform": [1e-4, 1e-1]}}, base=base)
    raw["sweep"].update(raw_sweep)
    with pytest.raises(ConfigError) as e:
        build_sweep(raw)
    for w in words:
        assert w in str(e.value), str(e.value)


def test_search_algorithm_compatibility():
    with pytest.raises(ConfigError, match=r"space.optim.lr .*cannot be enumerated by sweep.search=grid"):
        build_sweep(_raw({"optim.lr": {"loguniform": [1e-4, 1e-1]}}, search="grid"))
    with pytest.raises(ConfigError, match=r"space.optim.lr uses grid, which sweep.search=optuna cannot sample"):
        build_sweep(_raw({"optim.lr": {"grid": [0.1, 0.01]}}, search="optuna"))


def test_optuna_samples_the_space_including_list_choices():
    from ray.tune.search.optuna import OptunaSearch  # optuna is an install dependency: no skip

    sweep = build_sweep(_raw({"optim.lr": {"loguniform": [1e-4, 1e-1]},
                              "model.hidden_sizes": {"choice": [[64], [128, 64]]}}, search="optuna"))
    searcher = OptunaSearch(space=sweep.param_space(), metric="val_loss", mode="min", seed=0)
    params = sweep.decode(searcher.suggest("t1"))
    assert 1e-4 <= params["optim.lr"] <= 1e-1 and params["model.hidden_sizes"] in ([64], [128, 64])


def test_command_line_overrides(tmp_path):
    from stride.tune.space import apply_sweep_overrides

    raw = apply_sweep_overrides(_raw({"optim.lr": {"loguniform": [1e-4, 1e-1]}}),
                                ["sweep.num_samples=3", "base.train.max_steps=50", "base.model.hidden_sizes=[16,8]"])
    sweep = build_sweep(raw)
    assert sweep.sweep.num_samples == 3 and sweep.base_cfg().train.max_steps == 50
    assert sweep.base_cfg().model.hidden_sizes == [16, 8]
    with pytest.raises(ConfigError, match="sweep.field=value or base.section.field=value"):
        apply_sweep_overrides(raw, ["optim.lr=0.1"])


def test_outcome_best_and_exit_codes():
    from stride.tune.main import exit_code, outcome

    trials = [  # sorted best first, as collect_trials returns them
        {"trial_id": "a", "status": "failed", "metric": 0.1},
        {"trial_id": "b", "status": "early_stopped", "metric": 0.5},
        {"trial_id": "c", "status": "completed", "metric": 0.7},
    ]
    best, complete = outcome(trials, expected=3)
    assert best["trial_id"] == "b" and complete and exit_code(trials, complete, []) == 0
    failed = [dict(t, status="failed") for t in trials]
    assert outcome(failed, 3) == (None, True) and exit_code(failed, True, []) == 1
    cut = trials[:2] + [dict(trials[2], status="interrupted")]
    assert outcome(cut, 3)[1] is False and exit_code(cut, False, []) == 130
    assert exit_code(cut, False, [signal.SIGTERM]) == 143
    assert outcome(trials[:2], expected=3)[1] is False  # trials not even created yet


# ---------------------------------------------------------------------------------------------------------------
# 2. the cluster's resources: trials at once, and the worker gangs refused (functions of what Ray reports)
# ---------------------------------------------------------------------------------------------------------------

def _concurrency(monkeypatch, nodes: list[dict], base: dict, **sweep) -> tuple[int, int, bool]:
    """tune/main.py's resolve_concurrency for a sweep with `base`, on a cluster of `nodes` (no Ray started)."""
    from stride.tune.main import resolve_concurrency

    fake_cluster(monkeypatch, *nodes)
    built = build_sweep(_raw({"optim.lr": {"loguniform": [1e-4, 1e-1]}}, base=base, **sweep))
    return resolve_concurrency(built, built.base_cfg())


@pytest.mark.parametrize("nodes,base,sweep,expected", [
    ([{"CPU": 2}], {"scaling.num_workers": 1}, {}, (2, 1, False)),  # the test head: two 1-worker trials at once
    ([{"CPU": 2}, {"CPU": 3}], {"scaling.num_workers": 2}, {}, (2, 2, False)),  # 5 one-CPU bundles: 2 gangs of 2
    ([{"CPU": 2}, {"CPU": 2}], {"scaling.num_workers": "auto"}, {}, (2, 2, False)),  # auto on CPU: one per node
    ([{"CPU": 4}], {"scaling.num_workers": 1, "scaling.cpus_per_worker": 1.5}, {}, (2, 1, False)),
    ([{"CPU": 8, "GPU": 1}, {"CPU": 8, "GPU": 2}], {"scaling.num_workers": 1, "scaling.use_gpu": True}, {},
     (3, 1, True)),  # the GPUs bound it, not the 16 CPUs
    ([{"CPU": 8, "GPU": 2}], {"scaling.num_workers": 1, "scaling.use_gpu": "auto"}, {}, (2, 1, True)),
    ([{"CPU": 2}], {"scaling.num_workers": 1}, {"max_concurrent_trials": 1}, (1, 1, False)),
], ids=["head", "two-nodes", "auto-workers", "fractional-cpus", "gpus-bound", "gpu-auto", "fixed"])
def test_trials_at_once_are_the_gangs_that_fit(monkeypatch, nodes, base, sweep, expected):
    assert _concurrency(monkeypatch, nodes, base, **sweep) == expected


def test_more_trials_at_once_than_fit_wait_for_resources(monkeypatch, capsys):
    assert _concurrency(monkeypatch, [{"CPU": 2}], {"scaling.num_workers": 1}, max_concurrent_trials=4) == (4, 1, False)
    assert "sweep.max_concurrent_trials (4) > the 2 trial gangs" in capsys.readouterr().out


@pytest.mark.parametrize("nodes,base,words", [
    ([{"CPU": 2}], {"scaling.use_gpu": True}, ["base.scaling.use_gpu", "GPUs", "none"]),
    ([{"CPU": 8, "GPU": 1}], {"scaling.num_workers": 2, "scaling.use_gpu": True},
     ["base.scaling.num_workers (2)", "needs 2 GPUs", "has 1"]),
    ([{"CPU": 2}], {"scaling.num_workers": 3}, ["base.scaling.num_workers (3)", "3 CPUs", "the cluster's 2 CPUs"]),
    ([{"CPU": 2}, {"CPU": 2}], {"scaling.num_workers": 1, "scaling.cpus_per_worker": 3},
     ["base.scaling.cpus_per_worker (3)", "largest node's 2 CPUs"]),
    # Enough CPUs in all, but no node holds two 1-CPU workers: the gang never fits.
    ([{"CPU": 1.5}, {"CPU": 1.5}], {"scaling.num_workers": 3},
     ["worker gang (3 worker(s) x 1 CPU) does not fit", "3 CPUs, 0 GPUs on 2 node(s)", "base.scaling.num_workers"]),
    ([{"CPU": 64}], {"scaling.num_workers": [1, 2]}, ["base.scaling.num_workers ([1, 2])", "elastic", "fixed"]),
], ids=["gpu-none", "gpu-short", "cpus", "cpus-per-worker", "fragmented", "elastic"])
def test_a_gang_the_cluster_cannot_hold_is_refused(monkeypatch, nodes, base, words):
    from stride.errors import UsageError

    with pytest.raises(UsageError) as e:
        _concurrency(monkeypatch, nodes, base)
    msg = str(e.value)
    assert "\n" not in msg
    for w in words:
        assert w in msg, msg


# ---------------------------------------------------------------------------------------------------------------
# 3. the driver: usage errors exit 2 in seconds, with one line
# ---------------------------------------------------------------------------------------------------------------

def _one_line_error(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("stride: error:")]
    assert len(lines) == 1, proc.stderr[-3000:]
    return lines[0]


def test_unknown_space_key_exits_2_quickly(tmp_path, tabular_data):
    cfg = write_sweep(tmp_path / "s.yaml", tabular_data, tmp_path / "runs", sweep={"name": "bad"},
                      space={"optim.lrr": {"loguniform": [1e-4, 1e-1]}})
    t0 = time.time()
    proc = run_cli_forked(["tune/main.py", "--config", str(cfg)], timeout=60)
    line = _one_line_error(proc)
    assert time.time() - t0 < 30
    assert "space.optim.lrr" in line and "optim.lr" in line


@pytest.mark.slow
def test_a_gang_bigger_than_the_cluster_exits_2_quickly(tmp_path, tabular_data, ray_cluster):
    """The one refusal of the cluster's resources through the command (the others are the function's, above):
    3 one-CPU workers against the test head's 2 CPUs, read from the cluster the driver joined."""
    cfg = write_sweep(tmp_path / "s.yaml", tabular_data, tmp_path / "runs", sweep={"name": "gang", "num_samples": 2},
                      base={"scaling.num_workers": 3}, space={"optim.lr": {"loguniform": [1e-4, 1e-1]}})
    t0 = time.time()
    line = _one_line_error(run_cli(["tune/main.py", "--config", str(cfg)], timeout=120, env=ray_cluster))
    assert time.time() - t0 < 30, f"took {time.time() - t0:.0f} s"
    for w in ("base.scaling.num_workers (3)", "3 CPUs", "the cluster's 2 CPUs"):
        assert w in line, line
    assert not list((tmp_path / "runs" / "gang").glob("*_0000*")), "no trial may start"


# ---------------------------------------------------------------------------------------------------------------
# 4. a real sweep on the test head: 3 trials, 2 at a time, ASHA, MLflow server
# ---------------------------------------------------------------------------------------------------------------

ASHA_STEPS = 150
GOOD_LR = 3.0e-2


def save_initial_weights(path: Path, data: Path) -> None:
    """A fresh tabular MLP's weights (write_sweep's model) as safetensors: what init.from loads into every trial."""
    from safetensors.torch import save_file

    from stride.trainers.config_reader import build_config
    from stride.trainers.launch.checks import prepare

    task, _ = prepare(build_config({"model": {"name": "mlp", "hidden_sizes": [32]},
                                    "data": {"train_path": str(data / "train"), "val_path": str(data / "val")}}))
    save_file({k: v.contiguous() for k, v in task.build_model().state_dict().items()}, str(path))


@pytest.fixture(scope="module")
def asha_sweep(tmp_path_factory, tabular_data, mlflow_server, shared_ray_head):
    """One grid sweep on the test head (2 CPUs), shared by the tests below: lr 3e-2 learns, lr 1e-6 and 2e-6 cannot
    move the loss in 150 steps. The first two trials train side by side; the third starts when one of them ends,
    after the good trial recorded ASHA's first rung (step 10), so that at the latest the third is stopped there."""
    root = tmp_path_factory.mktemp("asha")
    experiment = f"tune-test-{uuid.uuid4().hex[:8]}"
    cfg = write_sweep(root / "asha.yaml", tabular_data, root / "runs",
                      sweep={"name": "asha", "search": "grid", "num_samples": 1, "scheduler": "asha",
                             "grace_period_steps": 10, "reduction_factor": 2},
                      base={"train.max_steps": ASHA_STEPS, "tracking.mlflow_uri": mlflow_server,
                            "tracking.experiment": experiment, "init.from": "pretrained.safetensors"},
                      space={"optim.lr": {"grid": [GOOD_LR, 1.0e-6, 2.0e-6]}})
    # Every trial starts from these weights, named relative to the folder the sweep is started from (not a trial's).
    save_initial_weights(root / "pretrained.safetensors", tabular_data)
    left = shared_ray_head.wait_idle()
    assert not left, f"the test head is busy, the sweep would not get its 2 CPUs: {left}"
    t0 = time.time()
    proc = run_cli([str(REPO / "tune" / "main.py"), "--config", "asha.yaml"], timeout=480, env=shared_ray_head.env(),
                   cwd=root)
    wall = time.time() - t0
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    left = shared_ray_head.wait_idle()
    assert not left, f"the sweep left on the test head: {left}"
    sweep_dir = root / "runs" / "asha"
    summary = json.loads((sweep_dir / "sweep_summary.json").read_text())
    return {"proc": proc, "summary": summary, "dir": sweep_dir, "uri": mlflow_server, "experiment": experiment,
            "config": cfg, "wall": wall}


@pytest.mark.slow
def test_sweep_runs_two_trials_at_a_time_on_two_cpus(asha_sweep):
    s = asha_sweep["summary"]
    assert s["max_concurrent_trials"] == 2 and s["workers_per_trial"] == 1
    trials = s["trials"]
    assert len(trials) == 3
    for t in trials:
        assert t["started_at"] and t["ended_at"] and t["started_at"] < t["ended_at"]
    # Tune never holds more than 2 trials at once (3 were ready) ...
    assert max_overlap([(t["started_at"], t["ended_at"]) for t in trials]) == 2
    # ... and two worker gangs really trained side by side: a trial's first result came before the other ended.
    assert max_overlap([(t["first_result_at"], t["ended_at"]) for t in trials if t["first_result_at"]]) == 2


@pytest.mark.slow
def test_asha_stops_a_bad_trial_early(asha_sweep):
    trials = {t["trial_id"]: t for t in asha_sweep["summary"]["trials"]}
    stopped = [t for t in trials.values() if t["status"] == "early_stopped"]
    assert stopped, [(t["params"], t["status"], t["steps"]) for t in trials.values()]
    for t in stopped:
        assert t["steps"] < ASHA_STEPS and t["params"]["optim.lr"] < 1e-5
        run_dir = Path(t["run_dir"])
        assert not (run_dir / "summary.json").exists()  # killed mid-run
        logged = [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl")]
        assert max(logged) < ASHA_STEPS
    good = [t for t in trials.values() if t["params"]["optim.lr"] == GOOD_LR]
    assert good[0]["status"] == "completed" and good[0]["steps"] == ASHA_STEPS


@pytest.mark.slow
def test_summary_best_trial_has_the_best_metric(asha_sweep):
    s = asha_sweep["summary"]
    assert s["metric"] == "val_loss" and s["mode"] == "min" and s["status"] == "completed"
    finished = [t for t in s["trials"] if t["status"] in ("completed", "early_stopped")]
    assert len(finished) == 3
    best = min(finished, key=lambda t: t["metric"])
    assert s["best_metric"] == best["metric"] and s["best_config"] == best["params"] == {"optim.lr": GOOD_LR}
    assert s["best_trial_id"] == best["trial_id"]
    # The number is the trial's own: its summary.json and the last evaluation in its metrics.jsonl.
    own = json.loads((Path(best["run_dir"]) / "summary.json").read_text())
    assert math.isclose(own["val_loss"], s["best_metric"], rel_tol=1e-9)
    evals = [r for r in read_jsonl(Path(best["run_dir"]) / "metrics.jsonl") if "val_loss" in r]
    assert evals[-1]["step"] == ASHA_STEPS and math.isclose(evals[-1]["val_loss"], s["best_metric"], rel_tol=1e-9)
    assert [t["metric"] for t in s["trials"]] == sorted(t["metric"] for t in s["trials"])
    for t in s["trials"]:
        assert set(t) >= {"trial_id", "params", "metric", "status", "steps", "mlflow_run_id"}
    # The trial loaded init.from where the sweep was started (a relative path, resolved by the driver).
    assert own["config"]["init"]["from"] == str(asha_sweep["config"].parent / "pretrained.safetensors")


@pytest.mark.slow
def test_mlflow_server_has_one_parent_and_a_child_per_trial(asha_sweep):
    from mlflow.tracking import MlflowClient

    s = asha_sweep["summary"]
    client = MlflowClient(tracking_uri=asha_sweep["uri"])
    exp = client.get_experiment_by_name(asha_sweep["experiment"])
    runs = client.search_runs([exp.experiment_id], max_results=100)
    parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    children = [r for r in runs if "mlflow.parentRunId" in r.data.tags]
    assert len(parents) == 1 and len(children) == 3
    parent = parents[0]
    assert parent.info.run_id == s["mlflow_parent_run_id"] and parent.info.status == "FINISHED"
    assert parent.data.tags["mlflow.runName"] == "asha" and parent.data.tags["stride.sweep"] == "true"
    assert parent.data.params["sweep.metric"] == "val_loss" and parent.data.params["space.optim.lr"].startswith("grid")
    assert math.isclose(parent.data.metrics["best_val_loss"], s["best_metric"], rel_tol=1e-9)
    assert parent.data.params["best.optim.lr"] == str(GOOD_LR)
    by_trial = {t["trial_id"]: t for t in s["trials"]}
    for child in children:
        assert child.data.tags["mlflow.parentRunId"] == parent.info.run_id
        trial = by_trial[child.data.tags["mlflow.runName"]]
        assert trial["mlflow_run_id"] == child.info.run_id
        assert float(child.data.params["optim.lr"]) == trial["params"]["optim.lr"]
        history = client.get_metric_history(child.info.run_id, "val_loss")
        assert history and min(m.step for m in history) == 10
        assert child.info.status == ("FINISHED" if trial["status"] == "completed" else "KILLED")


@pytest.mark.slow
def test_console_is_one_line_per_trial_result(asha_sweep):
    out = asha_sweep["proc"].stdout
    for noise in ("Reporting training result", "Configuration for experiment", "Trial status", "[stride rank"):
        assert noise not in out, noise
    lines = out.splitlines()
    trials = asha_sweep["summary"]["trials"]
    for t in trials:
        assert sum(ln.startswith(f"stride: trial {t['trial_id']} started") for ln in lines) == 1
    results = [e for e in events(asha_sweep["dir"]) if e["event"] == "result"]
    assert sum(bool(re.match(r"stride: trial \S+ step \d+ val_loss ", ln)) for ln in lines) == len(results)
    ends = [ln for ln in lines if re.match(r"stride: trial \S+ (completed|stopped early) at step \d+", ln)]
    assert len(ends) == len(trials)
    table = [ln for ln in lines if ln.startswith("stride: trial ") and "status" in ln and "val_loss" in ln]
    assert len(table) == 1  # the final table's header
    assert (asha_sweep["dir"] / "worker.log").stat().st_size > 0  # the workers' logs went to the file


@pytest.mark.slow
def test_changed_sweep_refuses_to_resume(asha_sweep, tmp_path):
    doc = yaml.safe_load(asha_sweep["config"].read_text())
    doc["space"]["optim.lr"] = {"grid": [1.0e-1, 1.0e-2]}
    cfg = tmp_path / "changed.yaml"
    cfg.write_text(yaml.safe_dump(doc))
    t0 = time.time()
    line = _one_line_error(run_cli_forked([str(REPO / "tune" / "main.py"), "--config", str(cfg)], timeout=60,
                                          cwd=asha_sweep["config"].parent))  # refused before Ray starts
    assert time.time() - t0 < 30
    assert "different settings" in line and "space" in line and "new sweep.name" in line


# ---------------------------------------------------------------------------------------------------------------
# 5. a killed sweep over a user's own task resumes
# ---------------------------------------------------------------------------------------------------------------

SIGNAL_STEPS, SIGNAL_EVERY = 500, 50  # about 5 s of training after the first checkpoint: the kill lands there
USER_SWEEP = f"""\
# Sweep the task's own field model.channels: 2 trials of 1 worker each, one after the other.
# Launch:   python -m stride.tune.main --config sweep.yaml      (from this folder)
sweep:
  name: signal_sweep
  base_config: signal.yaml
  storage_path: ./runs
  metric: val_accuracy
  mode: max
  num_samples: 1
  search: grid
  scheduler: fifo
  max_concurrent_trials: 1
  seed: 0
base:
  scaling.num_workers: 1
  train.max_steps: {SIGNAL_STEPS}
  train.log_every_steps: {SIGNAL_EVERY}
  train.eval_every_steps: {SIGNAL_EVERY}
  checkpoint.every_steps: {SIGNAL_EVERY}
space:
  model.channels: {{choice: [8, 16]}}
"""


@pytest.mark.slow
def test_killed_sweep_of_a_users_task_resumes_without_rerunning_finished_trials(tmp_path, ray_cluster, shared_ray_head):
    """A sweep over a user's own task field (model.channels of tests/user_project's signal_task:SignalTask, a module
    found in the working directory), run as a user runs it: `python -m stride.tune.main` from their folder, with a
    relative storage_path. SIGKILL the driver while the second trial trains (the first finished) and run the same
    command again: the finished trial is not run again, the killed one resumes from its checkpoint (through a
    truncated Ray Train snapshot) into the same MLflow child run, and the sweep completes both trials of the task."""
    from stride.trainers.run.checkpointing import checkpoint_folder
    from stride.tune.trial import SNAPSHOT, SNAPSHOT_COPY

    project = copy_user_project(tmp_path / "signal_project")
    (project / "sweep.yaml").write_text(USER_SWEEP)
    sweep_dir = project / "runs" / "signal_sweep"
    command = ["-m", "stride.tune.main", "--config", "sweep.yaml"]
    log_path = tmp_path / "first.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([PYTHON, *command], cwd=project, stdout=log, stderr=subprocess.STDOUT,
                                env=dict(os.environ, PYTHONUNBUFFERED="1", **ray_cluster))
        try:
            def second_trial_checkpointed():
                # Read from the trial's folder, where its controller writes at once, not from the driver's events:
                # a driver slow to process results let the trial finish before the kill (seen in CI).
                ended = {e["trial_id"] for e in events(sweep_dir) if e["event"] == "end"}
                saved = {d.name for d in sweep_dir.glob("*/") if (d / SNAPSHOT_COPY).exists()} - ended
                return (ended, saved) if ended and saved else None

            ended, killed = wait_for(second_trial_checkpointed, timeout=480, proc=proc,
                                     what="a checkpoint of the second trial")
            finished_stamp = {t: (sweep_dir / t / "summary.json").stat().st_mtime_ns for t in ended}
        finally:
            tree = descendants(proc.pid)  # the driver's own processes only: the head's are not below it
            proc.kill()
            proc.wait(timeout=30)
            kill_pids(tree)
    first = log_path.read_text()
    assert len(ended) == 1 and len(killed) == 1, first[-3000:]
    (killed_id,) = killed
    assert not (sweep_dir / killed_id / "summary.json").exists(), "the second trial ended before the kill"
    assert not checkpoint_folder(sweep_dir / killed_id, SIGNAL_STEPS).exists(), "killed after its last checkpoint"
    assert not (sweep_dir / "sweep_summary.json").exists()
    left = shared_ray_head.wait_idle()  # the head removes a dead driver's actors, groups and CPUs by itself
    assert not left, f"the killed sweep's job left on the head: {left}"
    # A kill while Ray Train rewrites its snapshot leaves it empty (seen in CI): make sure it happened.
    (sweep_dir / killed_id / SNAPSHOT).write_text("")

    proc2 = run_cli(command, timeout=420, cwd=project, env=ray_cluster)
    assert proc2.returncode == 0, proc2.stdout[-4000:] + proc2.stderr[-4000:]
    assert "resuming" in proc2.stdout
    assert f"stride: trial {killed_id}: " in (sweep_dir / "worker.log").read_text()  # the snapshot was repaired
    s = json.loads((sweep_dir / "sweep_summary.json").read_text())
    assert s["status"] == "completed" and s["metric"] == "val_accuracy" and s["mode"] == "max"
    assert sorted(t["params"]["model.channels"] for t in s["trials"]) == [8, 16]
    for t in s["trials"]:  # each trial: a whole Stride run of the user's task in its own folder under the sweep
        run_dir = sweep_dir / t["trial_id"]
        channels = t["params"]["model.channels"]
        assert t["status"] == "completed" and t["steps"] == SIGNAL_STEPS and Path(t["run_dir"]) == run_dir, t
        own = json.loads((run_dir / "summary.json").read_text())
        assert own["status"] == "completed" and own["global_step"] == SIGNAL_STEPS and own["task"] == USER_TASK
        assert own["config"]["model"]["channels"] == channels
        assert own["param_bytes_per_worker"] == [signal_param_bytes(channels)]  # the trials really differ
        assert own["val_accuracy"] == pytest.approx(t["metric"])
        assert read_jsonl(run_dir / "metrics.jsonl")[-1]["step"] == SIGNAL_STEPS
    best = max(s["trials"], key=lambda t: t["metric"])
    assert s["best_trial_id"] == best["trial_id"] and s["best_metric"] == best["metric"]
    assert s["best_config"] == best["params"]

    starts: dict[str, int] = {}
    for e in events(sweep_dir):
        if e["event"] == "start":
            starts[e["trial_id"]] = starts.get(e["trial_id"], 0) + 1
    (finished_id,) = ended
    # Finished before the kill: never started again, its summary untouched.
    assert starts[finished_id] == 1 and f"stride: trial {finished_id} started" not in proc2.stdout
    assert (sweep_dir / finished_id / "summary.json").stat().st_mtime_ns == finished_stamp[finished_id]
    # Killed: started again, and continued from its checkpoint rather than from step 0.
    assert starts[killed_id] == 2
    assert json.loads((sweep_dir / killed_id / "summary.json").read_text())["restarts"] >= 1

    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=s["mlflow_uri"])  # the default store beside the sweep: runs/mlflow.db
    parent = client.get_run(s["mlflow_parent_run_id"])
    assert parent.info.status == "FINISHED"
    by_trial = {t["trial_id"]: t for t in s["trials"]}
    for trial_id, t in by_trial.items():  # one child run per trial, the killed one continued, not replaced
        runs = client.search_runs([parent.info.experiment_id], filter_string=f"tags.`mlflow.runName` = '{trial_id}'")
        assert [r.info.run_id for r in runs] == [t["mlflow_run_id"]]
        assert runs[0].info.status == "FINISHED" and runs[0].data.tags["mlflow.parentRunId"] == parent.info.run_id
        assert runs[0].data.params["model.channels"] == str(t["params"]["model.channels"])
        history = [m.step for m in client.get_metric_history(runs[0].info.run_id, "val_accuracy")]
        assert max(history) == SIGNAL_STEPS
    state = json.loads((sweep_dir / "stride_sweep.json").read_text())
    assert state["mlflow_parent_run_id"] == s["mlflow_parent_run_id"]  # one parent across both runs
