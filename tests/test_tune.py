"""Sweeps (tune/): the space parser and sweep file (pure), then real sweeps through `python tune/main.py` on an
embedded Ray: two trials at a time on 2 CPUs, ASHA stopping bad trials, MLflow parent/child runs on a real
`mlflow server`, usage errors in seconds, and a SIGKILLed sweep that resumes without rerunning finished trials."""

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

from conftest import PYTHON, REPO, read_jsonl, run_cli
from tune_fixtures import events, max_overlap, stop_session, wait_for, write_sweep
from stride.trainers.config import ConfigError
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
    ({"optim.name": {"choice": ["adamw", "adam"]}}, ["space.optim.name", "'adam'", "adamw"]),
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
    pytest.importorskip("optuna")
    from ray.tune.search.optuna import OptunaSearch

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


def test_a_truncated_train_snapshot_is_repaired(tmp_path):
    # Ray Train rewrites checkpoint_manager_snapshot.json in place; a sweep killed mid-write leaves it empty and
    # the trial could never start again.
    from stride.tune.trial import SNAPSHOT, SNAPSHOT_COPY, repair_snapshot

    good = json.dumps({"ray_version": "2.60.0", "checkpoint_results": []})
    (tmp_path / SNAPSHOT).write_text(good)
    assert repair_snapshot(tmp_path) is None and (tmp_path / SNAPSHOT).read_text() == good
    (tmp_path / SNAPSHOT_COPY).write_text(good)
    (tmp_path / SNAPSHOT).write_text("")
    assert "restored" in repair_snapshot(tmp_path) and (tmp_path / SNAPSHOT).read_text() == good
    (tmp_path / SNAPSHOT_COPY).unlink()
    (tmp_path / SNAPSHOT).write_text('{"ray_vers')
    assert "starts over" in repair_snapshot(tmp_path)
    assert not (tmp_path / SNAPSHOT).exists() and list(tmp_path.glob(f"{SNAPSHOT}.unreadable-*"))


def test_a_repair_never_restores_a_copy_that_names_a_deleted_checkpoint(tmp_path):
    """The copy lags Ray by one checkpoint, and Ray may have deleted the oldest checkpoint it names by the time the
    sweep is killed (seen in CI): Ray Train would then refuse the run folder for good. The newer copy a kill left
    complete but not renamed is used instead; with neither usable, the trial starts over."""
    from stride.tune.trial import SNAPSHOT, SNAPSHOT_COPY, repair_snapshot

    def snapshot(*steps):
        return json.dumps({"ray_version": "2.60.0",
                           "checkpoint_results": [{"checkpoint_dir_name": f"checkpoint_{s:08d}"} for s in steps]})

    for s in (20, 30):
        (tmp_path / f"checkpoint_{s:08d}").mkdir()
    (tmp_path / SNAPSHOT_COPY).write_text(snapshot(10, 20))  # checkpoint 10 is gone
    (tmp_path / f".{SNAPSHOT_COPY}.tmp").write_text(snapshot(20, 30))
    (tmp_path / SNAPSHOT).write_text("")
    assert "restored" in repair_snapshot(tmp_path) and (tmp_path / SNAPSHOT).read_text() == snapshot(20, 30)

    (tmp_path / f".{SNAPSHOT_COPY}.tmp").write_text(snapshot(20, 30)[:-5])  # killed while writing the newer copy
    (tmp_path / SNAPSHOT).write_text("")
    assert "starts over" in repair_snapshot(tmp_path)


# ---------------------------------------------------------------------------------------------------------------
# 2. the driver: usage errors exit 2 in seconds, with one line
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
    proc = run_cli(["tune/main.py", "--config", str(cfg)], timeout=60)
    line = _one_line_error(proc)
    assert time.time() - t0 < 30
    assert "space.optim.lrr" in line and "optim.lr" in line


@pytest.mark.slow
@pytest.mark.parametrize("base,words", [
    ({"scaling.use_gpu": True}, ["base.scaling.use_gpu", "GPUs", "none"]),
    ({"scaling.num_workers": 3}, ["base.scaling.num_workers (3)", "3 CPUs", "2 CPUs"]),
    ({"scaling.num_workers": [1, 2]}, ["base.scaling.num_workers ([1, 2])", "elastic", "fixed"]),
], ids=["gpu", "cpu", "elastic"])
def test_infeasible_gang_exits_2_quickly(tmp_path, tabular_data, base, words):
    if base.get("scaling.num_workers") == 3 and (os.cpu_count() or 1) >= 3:
        pytest.skip("the embedded cluster has as many CPUs as this machine's cores; 3 workers fit here")
    cfg = write_sweep(tmp_path / "s.yaml", tabular_data, tmp_path / "runs", sweep={"name": "gang", "num_samples": 2},
                      base=base, space={"optim.lr": {"loguniform": [1e-4, 1e-1]}})
    t0 = time.time()
    proc = run_cli(["tune/main.py", "--config", str(cfg)], timeout=120)
    line = _one_line_error(proc)
    assert time.time() - t0 < 30, f"took {time.time() - t0:.0f} s"
    for w in words:
        assert w in line, line
    assert not list((tmp_path / "runs" / "gang").glob("*_0000*")), "no trial may start"


# ---------------------------------------------------------------------------------------------------------------
# 3. a real sweep: 4 trials, 2 at a time, ASHA, MLflow server
# ---------------------------------------------------------------------------------------------------------------

ASHA_STEPS = 300


@pytest.fixture(scope="module")
def asha_sweep(tmp_path_factory, tabular_data, mlflow_server):
    """One grid sweep shared by the tests below: lr 3e-2 learns, lr 1e-6..3e-6 cannot move the loss in 300 steps,
    so whichever bad trial reaches ASHA's first rung after the good one must be stopped there."""
    root = tmp_path_factory.mktemp("asha")
    experiment = f"tune-test-{uuid.uuid4().hex[:8]}"
    cfg = write_sweep(root / "asha.yaml", tabular_data, root / "runs",
                      sweep={"name": "asha", "search": "grid", "num_samples": 1, "scheduler": "asha",
                             "grace_period_steps": 10, "reduction_factor": 2},
                      base={"train.max_steps": ASHA_STEPS, "tracking.mlflow_uri": mlflow_server,
                            "tracking.experiment": experiment},
                      space={"optim.lr": {"grid": [3.0e-2, 1.0e-6, 2.0e-6, 3.0e-6]}})
    t0 = time.time()
    proc = run_cli(["tune/main.py", "--config", str(cfg)], timeout=480)
    wall = time.time() - t0
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    sweep_dir = root / "runs" / "asha"
    summary = json.loads((sweep_dir / "sweep_summary.json").read_text())
    return {"proc": proc, "summary": summary, "dir": sweep_dir, "uri": mlflow_server, "experiment": experiment,
            "config": cfg, "wall": wall}


@pytest.mark.slow
def test_sweep_runs_two_trials_at_a_time_on_two_cpus(asha_sweep):
    s = asha_sweep["summary"]
    assert s["max_concurrent_trials"] == 2 and s["workers_per_trial"] == 1
    trials = s["trials"]
    assert len(trials) == 4
    for t in trials:
        assert t["started_at"] and t["ended_at"] and t["started_at"] < t["ended_at"]
    # Tune never holds more than 2 trials at once ...
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
    good = [t for t in trials.values() if t["params"]["optim.lr"] == 3.0e-2]
    assert good[0]["status"] == "completed" and good[0]["steps"] == ASHA_STEPS


@pytest.mark.slow
def test_summary_best_trial_has_the_best_metric(asha_sweep):
    s = asha_sweep["summary"]
    assert s["metric"] == "val_loss" and s["mode"] == "min" and s["status"] == "completed"
    finished = [t for t in s["trials"] if t["status"] in ("completed", "early_stopped")]
    assert len(finished) == 4
    best = min(finished, key=lambda t: t["metric"])
    assert s["best_metric"] == best["metric"] and s["best_config"] == best["params"] == {"optim.lr": 3.0e-2}
    assert s["best_trial_id"] == best["trial_id"]
    # The number is the trial's own: its summary.json and the last evaluation in its metrics.jsonl.
    own = json.loads((Path(best["run_dir"]) / "summary.json").read_text())
    assert math.isclose(own["val_loss"], s["best_metric"], rel_tol=1e-9)
    evals = [r for r in read_jsonl(Path(best["run_dir"]) / "metrics.jsonl") if "val_loss" in r]
    assert evals[-1]["step"] == ASHA_STEPS and math.isclose(evals[-1]["val_loss"], s["best_metric"], rel_tol=1e-9)
    assert [t["metric"] for t in s["trials"]] == sorted(t["metric"] for t in s["trials"])
    for t in s["trials"]:
        assert set(t) >= {"trial_id", "params", "metric", "status", "steps", "mlflow_run_id"}


@pytest.mark.slow
def test_mlflow_server_has_one_parent_and_a_child_per_trial(asha_sweep):
    from mlflow.tracking import MlflowClient

    s = asha_sweep["summary"]
    client = MlflowClient(tracking_uri=asha_sweep["uri"])
    exp = client.get_experiment_by_name(asha_sweep["experiment"])
    runs = client.search_runs([exp.experiment_id], max_results=100)
    parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    children = [r for r in runs if "mlflow.parentRunId" in r.data.tags]
    assert len(parents) == 1 and len(children) == 4
    parent = parents[0]
    assert parent.info.run_id == s["mlflow_parent_run_id"] and parent.info.status == "FINISHED"
    assert parent.data.tags["mlflow.runName"] == "asha" and parent.data.tags["stride.sweep"] == "true"
    assert parent.data.params["sweep.metric"] == "val_loss" and parent.data.params["space.optim.lr"].startswith("grid")
    assert math.isclose(parent.data.metrics["best_val_loss"], s["best_metric"], rel_tol=1e-9)
    assert parent.data.params["best.optim.lr"] == "0.03"
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
    line = _one_line_error(run_cli(["tune/main.py", "--config", str(cfg)], timeout=60))
    assert time.time() - t0 < 30
    assert "different settings" in line and "space" in line and "new sweep.name" in line


# ---------------------------------------------------------------------------------------------------------------
# 4. an interrupted sweep resumes
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_killed_sweep_resumes_without_rerunning_finished_trials(tmp_path, tabular_data):
    """SIGKILL the driver while the second pair of trials trains (the first pair finished), run the same command
    again: the finished pair is not run again, the killed pair resumes from its checkpoints into the same MLflow
    child runs (one of them through a truncated Ray Train snapshot), and the sweep completes."""
    steps = 300
    # Run from the test folder with a relative storage_path, as a user runs from their project folder.
    cfg = write_sweep(tmp_path / "s.yaml", tabular_data, Path("runs"), sweep={"name": "res", "num_samples": 4},
                      base={"train.max_steps": steps}, space={"optim.lr": {"loguniform": [1.0e-3, 3.0e-2]}})
    sweep_dir = tmp_path / "runs" / "res"
    driver = str(REPO / "tune" / "main.py")
    log = open(tmp_path / "first.log", "w")
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.Popen([PYTHON, driver, "--config", str(cfg)], cwd=tmp_path, env=env, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        def second_pair_training():
            evs = events(sweep_dir)
            ended = {e["trial_id"] for e in evs if e["event"] == "end"}
            reporting = {e["trial_id"] for e in evs if e["event"] == "result"} - ended
            return (ended, reporting) if len(ended) >= 2 and reporting else None

        ended, reporting = wait_for(second_pair_training, timeout=360, proc=proc, what="a second-wave trial's result")
        finished_stamp = {t: (sweep_dir / t / "summary.json").stat().st_mtime_ns for t in ended}
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        stop_session(proc.pid)
        log.close()
    assert not (sweep_dir / "sweep_summary.json").exists()
    checkpointed = {t for t in reporting if list((sweep_dir / t).glob("checkpoint_*"))}
    assert checkpointed, "the killed trials had reported with a checkpoint"
    # A kill while Ray Train rewrites its snapshot leaves it empty (seen in this test): make sure it happened once.
    truncated = sorted(checkpointed)[0]
    (sweep_dir / truncated / "checkpoint_manager_snapshot.json").write_text("")

    proc2 = run_cli([driver, "--config", str(cfg)], timeout=420, cwd=tmp_path)
    assert proc2.returncode == 0, proc2.stdout[-4000:] + proc2.stderr[-4000:]
    assert "resuming" in proc2.stdout
    assert f"stride: trial {truncated}: " in (sweep_dir / "worker.log").read_text()
    s = json.loads((sweep_dir / "sweep_summary.json").read_text())
    assert len(s["trials"]) == 4 and all(t["status"] == "completed" for t in s["trials"]), s["trials"]
    for t in s["trials"]:  # every trial is a whole Stride run in its own folder under the sweep
        assert t["steps"] == steps and Path(t["run_dir"]).parent == sweep_dir
        assert json.loads((sweep_dir / t["trial_id"] / "summary.json").read_text())["global_step"] == steps
        assert read_jsonl(sweep_dir / t["trial_id"] / "metrics.jsonl")[-1]["step"] == steps
    starts = {}
    for e in events(sweep_dir):
        if e["event"] == "start":
            starts[e["trial_id"]] = starts.get(e["trial_id"], 0) + 1
    for t in ended:  # finished before the kill: never started again, summary untouched
        assert starts[t] == 1
        assert (sweep_dir / t / "summary.json").stat().st_mtime_ns == finished_stamp[t]
        assert f"stride: trial {t} started" not in proc2.stdout
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=s["mlflow_uri"])
    by_trial = {t["trial_id"]: t for t in s["trials"]}
    for t in checkpointed:  # resumed from a checkpoint: the loop continued the trial's MLflow child run
        assert starts[t] == 2
        own = json.loads((sweep_dir / t / "summary.json").read_text())
        assert own["restarts"] >= 1
        runs = client.search_runs([client.get_run(s["mlflow_parent_run_id"]).info.experiment_id],
                                  filter_string=f"tags.`mlflow.runName` = '{t}'")
        assert [r.info.run_id for r in runs] == [by_trial[t]["mlflow_run_id"]]
        assert runs[0].info.status == "FINISHED"
        assert runs[0].data.tags["mlflow.parentRunId"] == s["mlflow_parent_run_id"]
        history = [m.step for m in client.get_metric_history(runs[0].info.run_id, "val_loss")]
        assert max(history) == steps
    assert client.get_run(s["mlflow_parent_run_id"]).info.status == "FINISHED"
    state = json.loads((sweep_dir / "stride_sweep.json").read_text())
    assert state["mlflow_parent_run_id"] == s["mlflow_parent_run_id"]  # one parent across both runs
