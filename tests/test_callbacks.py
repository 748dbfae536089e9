"""stride.Callback: a user's callbacks from the user's own folder run on every rank, keep their state across a resume
(at another world size), stop the run at a step they pick for good, and fail in one line naming themselves.

Under torchrun and in one process. On Ray, this file's Counter runs on every worker of tests/test_train_ray.py's run
(started from a folder holding this module, with TensorBoard beside MLflow); a stop is rank 0's summary status, which
the Ray driver passes on as it passes "completed". A failing callback's line is the loop's, the same under both
launchers; that a worker's one-line error reaches the Ray driver's stderr alone is proven once for every error by
tests/test_disk_full.py's run on Ray."""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import subprocess
import textwrap
import time
from pathlib import Path

import pytest

from conftest import REPO, read_jsonl, run_cli_forked, run_torchrun_cases, torchrun_case, torchrun_launcher
from runs import OVERLAY

pytestmark = pytest.mark.slow

CALLBACKS = '''
import json
from pathlib import Path

import torch.nn.functional as F

from stride import Callback, LossOutput
from stride.trainers.tasks.mlp import MLPTask


class Counter(Callback):
    """Counts the steps it sees on each rank, across resumes (its state)."""

    def __init__(self):
        self.steps, self.starts = 0, 0

    def on_fit_start(self, state):
        self.starts += 1

    def on_step_end(self, state, metrics):
        self.steps += 1
        assert metrics["step"] == state.step

    def on_fit_end(self, state, summary):
        Path(state.run_dir, f"counter_rank{state.rank}.json").write_text(json.dumps(
            {"steps": self.steps, "starts": self.starts, "step": state.step, "world_size": state.world_size}))

    def state_dict(self):
        return {"steps": self.steps, "starts": self.starts}

    def load_state_dict(self, state):
        self.steps, self.starts = state["steps"], state["starts"]


class StopAt(Callback):
    def __init__(self, step):
        self.at = step

    def on_step_end(self, state, metrics):
        if state.step == self.at:
            state.request_stop()


class Boom(Callback):
    def on_step_end(self, state, metrics):
        if state.step == 15:
            raise RuntimeError("boom at step 15")


class MetricMLP(MLPTask):
    """Training metrics on the forward's own outputs (LossOutput), no second forward."""

    def loss(self, model, batch):
        logits = model(batch["x"])
        return LossOutput(F.cross_entropy(logits.float(), batch["y"]), outputs=logits)

    def train_metrics(self, model, batch, outputs):
        assert outputs is not None and outputs.shape[0] == batch["y"].shape[0]
        return {"label": batch["y"].float(), "accuracy": (outputs.argmax(-1) == batch["y"]).float()}


class ParamLog(Callback):
    """Every step's full parameters (FSDP: gathered), saved by rank 0 at the end of each attempt."""

    def __init__(self):
        self.steps = {}

    def _log(self, state):
        full = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p.detach()).clone()
                for n, p in state.model.named_parameters()}
        if state.rank == 0:
            self.steps[state.step] = full

    def on_fit_start(self, state):
        self._log(state)

    def on_step_end(self, state, metrics):
        self._log(state)

    def on_fit_end(self, state, summary):
        if state.rank == 0:
            import torch
            torch.save(self.steps, Path(state.run_dir, f"params_{min(self.steps)}.pt"))


class Mark(Callback):
    """Appends its name to the run's hooks.log at each hook it sees (one process): the order callbacks run in."""

    def __init__(self, name):
        self.name = name

    def _mark(self, state, hook):
        with open(Path(state.run_dir, "hooks.log"), "a") as f:
            f.write(f"{hook} {self.name}\\n")

    def on_fit_start(self, state):
        self._mark(state, "on_fit_start")

    def on_step_end(self, state, metrics):
        self._mark(state, f"on_step_end {state.step}")


class CountingMLP(MLPTask):
    """A task that brings its own callbacks."""

    def callbacks(self):
        return [Counter(), Mark("task")]
'''


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("cb_project")
    (folder / "my_callbacks.py").write_text(textwrap.dedent(CALLBACKS))
    return folder


def run_args(project: Path, data: Path, *extra: str) -> list[str]:
    """trainers/torchrun.py's arguments for a small tabular run in the user's folder."""
    return ["--config", str(REPO / "trainers/configs/tabular_mlp.yaml"), f"data.train_path={data}/train",
            f"data.val_path={data}/val", f"run.storage_path={project}/runs", "train.epochs=null",
            "train.log_every_steps=5", "train.eval_every_steps=10", "checkpoint.every_steps=10",
            "model.hidden_sizes=[32]", *OVERLAY, *extra]


def train(project: Path, data: Path, *extra: str) -> subprocess.CompletedProcess:
    """trainers/torchrun.py from the user's folder (their callbacks module is found there), one process forked from
    the fork server (its own output and exit status, without an interpreter's and torch's start-up per run)."""
    return run_cli_forked([str(REPO / "trainers" / "torchrun.py"), *run_args(project, data, *extra)], cwd=project,
                          env={"PYTHONPATH": str(project)}, timeout=300)


COUNTER = "train.callbacks=[my_callbacks:Counter]"
STOP_AT_30 = "train.callbacks=[my_callbacks:Counter, {my_callbacks:StopAt: {step: 30}}]"
EMA = ["run.name=ema", "train.ema={decay: 0.9, eval: both}", "train.callbacks=[my_callbacks:ParamLog]",
       "train.strategy=fsdp"]


@pytest.fixture(scope="module")
def two_ranks(project, tabular_data, tmp_path_factory) -> dict:
    """This file's 2-rank runs under ONE torchrun launch (tests/torchrun_cases.py), each a run of its own: the
    Counter run resumed from a 1-process run (made first, its counters kept for the test), the EMA run under FSDP,
    and a task's training metrics with the sample log. A test reads its case with `torchrun_case()`."""
    first = train(project, tabular_data, "run.name=cb", "train.max_steps=20", COUNTER)
    assert first.returncode == 0, first.stderr[-3000:]
    cb_after_first = counters(project / "runs" / "cb")
    log = project / "samples_metric"
    cases = [
        {"label": "cb", "args": run_args(project, tabular_data, "run.name=cb", "train.max_steps=40", STOP_AT_30)},
        {"label": "ema", "args": run_args(project, tabular_data, "train.max_steps=25", "train.batch_size_per_worker=64",
                                          *EMA)},
        {"label": "metric", "env": {"STRIDE_SAMPLE_LOG": str(log)},
         "args": run_args(project, tabular_data, "run.name=metric", "model.name=my_callbacks:MetricMLP",
                          "train.max_steps=12", "train.log_every_steps=4", "train.grad_accum_steps=2",
                          "train.batch_size_per_worker=16")},
    ]
    r, ranks = run_torchrun_cases(cases, tmp_path_factory.mktemp("callbacks_cases"), project,
                                  {"PYTHONPATH": str(project)}, timeout=400)
    return {"launch": r, "ranks": ranks, "cb_after_first": cb_after_first, "sample_log": log}


def export(run: Path, out: Path, *flags: str) -> None:
    """trainers/commands/export.py RUN OUT [flags], in this process."""
    from stride.trainers.commands.export import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert main([str(run), str(out), *flags]) == 0, err.getvalue()


def counters(run: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(run.glob("counter_rank*.json"))]


def test_a_users_callbacks_count_on_every_rank_resume_their_state_and_stop_the_run_for_good(project, tabular_data,
                                                                                            two_ranks):
    run = project / "runs" / "cb"
    assert two_ranks["cb_after_first"] == [{"steps": 20, "starts": 1, "step": 20, "world_size": 1}]

    # Resumed on 2 ranks: each rank's Counter starts from the checkpoint's state; StopAt ends the run at step 30.
    torchrun_case(two_ranks, "cb")
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "stopped" and summary["global_step"] == 30 and summary["world_size"] == 2
    assert counters(run) == [{"steps": 30, "starts": 2, "step": 30, "world_size": 2}] * 2
    assert sorted(p.name for p in run.glob("checkpoint_*")) == ["checkpoint_00000020", "checkpoint_00000030"]
    assert [r["step"] for r in read_jsonl(run / "metrics.jsonl") if "train_loss" in r] == [5, 10, 15, 20, 25, 30]

    # The same command again trains nothing: the callback ended the run.
    third = train(project, tabular_data, "run.name=cb", "train.max_steps=40", STOP_AT_30)
    assert third.returncode == 0, third.stderr[-3000:]
    again = json.loads((run / "summary.json").read_text())
    assert again["status"] == "stopped" and again["global_step"] == 30 and again["restarts"] == summary["restarts"]
    assert counters(run)[0]["steps"] == 30  # no step ran


def test_a_tasks_own_callbacks_run_after_the_configs(project, tabular_data):
    r = train(project, tabular_data, "run.name=task_cb", "train.max_steps=10",
              "model.name=my_callbacks:CountingMLP", "train.callbacks=[{my_callbacks:Mark: {name: config}}]")
    assert r.returncode == 0, r.stderr[-3000:]
    run = project / "runs" / "task_cb"
    assert counters(run) == [{"steps": 10, "starts": 1, "step": 10, "world_size": 1}]
    hooks = [f"on_fit_start {who}" for who in ("config", "task")] + [
        f"on_step_end {step} {who}" for step in range(1, 11) for who in ("config", "task")]
    assert (run / "hooks.log").read_text().splitlines() == hooks


def test_a_failing_callback_ends_the_run_in_one_line_naming_it_and_keeps_the_checkpoint(project, tabular_data):
    from stride.trainers.run import checkpointing

    r = train(project, tabular_data, "run.name=boom", "train.max_steps=40", "train.callbacks=[my_callbacks:Boom]")
    assert r.returncode == 1
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("stride: error:")]
    assert errors == ["stride: error: callback my_callbacks:Boom failed in on_step_end: RuntimeError: boom at step 15"]
    assert "Traceback" not in r.stderr
    run = project / "runs" / "boom"
    assert [p.name for p in run.glob("checkpoint_*")] == ["checkpoint_00000010"]
    assert checkpointing.verify(run / "checkpoint_00000010") is None


def test_early_stopping_ends_the_run_where_its_rule_says_and_a_rerun_trains_no_further(project, tabular_data):
    # mode max on val_loss, which falls as the model learns: from the second evaluation on, nothing improves
    es = "train.early_stopping={metric: val_loss, mode: max, patience: 2}"
    r = train(project, tabular_data, "run.name=es", "train.max_steps=200", es)
    assert r.returncode == 0, r.stderr[-3000:]
    run = project / "runs" / "es"
    evals = [(x["step"], x["val_loss"]) for x in read_jsonl(run / "metrics.jsonl") if "val_loss" in x]
    best, bad, expected = None, 0, None
    for step, value in evals:  # the rule, applied to what the run logged
        if best is None or value > best:
            best, bad = value, 0
        else:
            bad += 1
            if bad == 2:
                expected = step
                break
    assert expected is not None and evals[-1][0] == expected < 200
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "stopped_early" and summary["global_step"] == expected and summary["final"]
    assert (run / f"checkpoint_{expected:08d}").is_dir()
    again = train(project, tabular_data, "run.name=es", "train.max_steps=200", es)
    assert again.returncode == 0, again.stderr[-3000:]
    rerun = json.loads((run / "summary.json").read_text())
    assert rerun["status"] == "stopped_early" and rerun["global_step"] == expected
    assert [x["step"] for x in read_jsonl(run / "metrics.jsonl") if "val_loss" in x][-1] == expected


def test_a_tasks_training_metrics_are_averaged_over_the_interval_and_the_ranks(project, tabular_data, two_ranks):
    import pyarrow.parquet as pq

    torchrun_case(two_ranks, "metric")
    log = two_ranks["sample_log"]
    table = pq.read_table(tabular_data / "train", columns=["sample_id", "label"])
    label = dict(zip(table["sample_id"].to_pylist(), table["label"].to_pylist()))
    ids: dict[int, list[int]] = {}  # log interval -> every sample any rank trained on in it
    for f in log.glob("rank*.jsonl"):
        for rec in read_jsonl(f):
            ids.setdefault(rec["step"] // 4, []).extend(rec["sample_ids"])
    lines = [x for x in read_jsonl(project / "runs" / "metric" / "metrics.jsonl") if "train_loss" in x]
    assert [x["step"] for x in lines] == [4, 8, 12]
    for k, line in enumerate(lines):
        seen = ids[k]
        assert len(seen) == 4 * 2 * 2 * 16  # steps x micro-batches x ranks x rows
        assert line["train_label"] == pytest.approx(sum(label[i] for i in seen) / len(seen), rel=1e-12)
        assert 0.0 <= line["train_accuracy"] <= 1.0


@pytest.mark.parametrize("mode", ["min", "max"])  # val_loss falls as the MLP learns: max keeps the first ones
def test_keep_best_keeps_the_best_val_loss_checkpoints_across_a_resume_and_export_takes_the_best(project, tabular_data,
                                                                                                 mode):
    from safetensors import safe_open

    keep = [f"run.name=best_{mode}", "train.eval_every_steps=5", "checkpoint.every_steps=5", "checkpoint.keep_last=1",
            f"checkpoint.keep_best={{metric: val_loss, mode: {mode}, k: 2}}"]
    for steps in (20, 40):  # the second run resumes the first at step 20
        r = train(project, tabular_data, f"train.max_steps={steps}", *keep)
        assert r.returncode == 0, r.stderr[-3000:]
    run = project / "runs" / f"best_{mode}"
    evals = sorted(((x["val_loss"] if mode == "min" else -x["val_loss"], x["step"])
                    for x in read_jsonl(run / "metrics.jsonl") if "val_loss" in x))
    assert len(evals) == 8
    want = [step for _, step in evals[:2]]  # every evaluation step had a checkpoint: the best two are kept
    summary = json.loads((run / "summary.json").read_text())
    assert [b["step"] for b in summary["best_checkpoints"]] == want
    assert sorted(p.name for p in (run / "best").iterdir()) == sorted(f"checkpoint_{s:08d}" for s in want)
    assert [p.name for p in run.glob("checkpoint_*")] == ["checkpoint_00000040"]  # keep_last as before
    out = project / f"best_{mode}.safetensors"
    export(run, out, "--best")
    with safe_open(str(out), "pt") as f:
        assert f.metadata()["step"] == str(want[0])


def test_ema_under_fsdp_resumes_on_one_rank_and_equals_bitwise_the_average_of_the_logged_weights(project, tabular_data,
                                                                                                 two_ranks):
    import shutil

    import torch
    from safetensors.torch import load_file

    torchrun_case(two_ranks, "ema")  # 25 steps on 2 FSDP ranks
    run = project / "runs" / "ema"
    shutil.rmtree(run / "checkpoint_00000025")  # killed after step 20's checkpoint: what follows is lost
    second = train(project, tabular_data, "train.max_steps=40", "train.batch_size_per_worker=128", *EMA)
    assert second.returncode == 0, second.stderr[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["global_step"] == 40 and summary["world_size"] == 1 and summary["restarts"] == 1
    evals = [x for x in read_jsonl(run / "metrics.jsonl") if "val_loss" in x]
    assert [x["step"] for x in evals] == [10, 20, 30, 40] and all("val_loss_ema" in x for x in evals)

    params = torch.load(run / "params_0.pt", weights_only=True)  # steps 0..25 on 2 ranks
    params.update({k: v for k, v in torch.load(run / "params_20.pt", weights_only=True).items()})  # 20..40, 1 rank
    reference = dict(params[0])
    for step in range(1, 41):
        reference = {n: torch.lerp(reference[n], params[step][n], 1.0 - 0.9) for n in reference}
    out = project / "ema.safetensors"
    export(run, out, "--ema")
    exported = load_file(str(out))
    for name, value in reference.items():
        assert torch.equal(exported[name], value), name  # bitwise: elementwise lerp, whatever the sharding
    assert not torch.equal(exported[name], params[40][name])  # an average, not the weights


def complete_step(run: Path) -> float:
    """The step of the run's newest complete checkpoint; -inf while there is none (or it is being pruned)."""
    from stride.trainers.run import checkpointing

    try:
        done = checkpointing.newest_complete(run)
        return checkpointing.read_meta(done)["step"] if done is not None else -math.inf
    except OSError:
        return -math.inf


def test_a_sigkilled_fsdp_run_with_ema_resumes_on_one_rank_as_an_uninterrupted_run_from_its_checkpoint(project,
                                                                                                        tabular_data):
    """Killed (SIGKILL) on 2 FSDP ranks after a checkpoint and a few more logged steps, resumed on 1 rank: its EMA and
    weights end bitwise those of a 1-rank run started from a copy of the same checkpoint, and TensorBoard's reader
    sees every train_loss step once (the killed attempt logged past the checkpoint)."""
    import shutil

    import torch
    from safetensors.torch import load_file

    from conftest import descendants, gone, kill_pids, wait_for_step
    from stride.trainers.run import checkpointing
    from test_sinks import scalars

    common = ["train.ema={decay: 0.9, eval: both}", "train.strategy=fsdp", "tracking.sinks=[tensorboard]",
              "checkpoint.every_steps=40", "train.eval_every_steps=20"]
    run = project / "runs" / "ema_kill"
    cmd = [*torchrun_launcher(2), str(REPO / "trainers" / "torchrun.py"), "--config",
           str(REPO / "trainers/configs/tabular_mlp.yaml"), f"data.train_path={tabular_data}/train",
           f"data.val_path={tabular_data}/val", f"run.storage_path={project}/runs", "run.name=ema_kill",
           "train.epochs=null", "train.max_steps=100000", "train.log_every_steps=5", "model.hidden_sizes=[32]",
           *OVERLAY, "train.batch_size_per_worker=64", *common]
    proc = subprocess.Popen(cmd, cwd=project, env=dict(os.environ, PYTHONPATH=str(project)),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        # Killed 10 to 20 logged steps past its newest complete checkpoint (every 40 steps), so the attempt has
        # logged past it and the next has not begun, whatever the machine's pace: a fixed sleep after a logged step
        # once landed right after a checkpoint and before the next log, and on a busy machine the background write
        # of step 40 was still running at step 50.
        while not 10 <= wait_for_step(run / "metrics.jsonl", 45, proc) - complete_step(run) <= 20:
            time.sleep(0.01)
        time.sleep(0.05)  # TensorBoard's writer (the sinks' thread) takes the step metrics.jsonl already shows
    finally:
        tree = [*descendants(proc.pid), proc.pid]
        kill_pids(tree)
        proc.wait()
        gone(tree)  # the ranks too (torchrun starts each in a session of its own): none holds the run's lock
    k = checkpointing.read_meta(checkpointing.newest_complete(run))["step"]
    assert max(s for s, _ in scalars(run / "tensorboard", "train_loss")) > k  # logged past its last checkpoint
    twin = project / "runs" / "ema_twin"
    twin.mkdir()
    shutil.copytree(run / f"checkpoint_{k:08d}", twin / f"checkpoint_{k:08d}")

    end = k + 20
    for name in ("ema_kill", "ema_twin"):
        r = train(project, tabular_data, f"run.name={name}", f"train.max_steps={end}", "train.log_every_steps=5",
                  "train.batch_size_per_worker=128", *common)
        assert r.returncode == 0, r.stderr[-3000:]
    outs = {}
    for name in ("ema_kill", "ema_twin"):
        for part in ("", "--ema"):
            out = project / f"{name}{part}.safetensors"
            export(project / "runs" / name, out, *([part] if part else []))
            outs[name, part] = load_file(str(out))
    for part in ("", "--ema"):
        a, b = outs["ema_kill", part], outs["ema_twin", part]
        assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a), part
    assert not all(torch.equal(outs["ema_kill", ""][n], outs["ema_kill", "--ema"][n]) for n in a)
    logged = [x["step"] for x in read_jsonl(run / "metrics.jsonl") if "train_loss" in x]
    assert logged == list(range(5, end + 1, 5))
    assert [s for s, _ in scalars(run / "tensorboard", "train_loss")] == logged  # each step once
