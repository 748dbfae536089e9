"""A callback's tensor state lives in the checkpoint (DCP) beside the model: train.ema's average and a user's own
callback resume exactly, and checkpoint.keep_best (a built-in callback too) ranks across the resume.

Each run trains 20 steps with train.ema, checkpoint.keep_best (k 2) and the user's ParamSum (a sum over steps of
every parameter, held as the parameters are: FSDP shards; and a plain step count). A stopped run (SIGTERM at step
12, after the step-10 checkpoint: it checkpoints at 12 and exits 143) resumed by the same command must end bitwise
as the uninterrupted one: the figures it logs, the average, the sum, and best/'s ranking and tensors. On 1 rank, on
2 FSDP ranks, and resumed at another world size (2 ranks, then 1), where the average and the sum must equal, bitwise,
those computed from the weights every step logged (ParamLog). On 2 Ray workers too, which rebuild the config from
its dict: a run stopped under torchrun resumed there.
"""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
import textwrap
from pathlib import Path

import pytest

from conftest import REPO, read_jsonl, run_cli, run_cli_forked, run_torchrun_cases, torchrun_case
from runs import OVERLAY

pytestmark = pytest.mark.slow
CLUSTER_STREAM_FIXTURES = {"two_ranks"}  # the Ray test resumes a run of the torchrun batch

CALLBACKS = '''
import os
import signal
from pathlib import Path

import torch

from stride import Callback


def full(t):
    return (t.full_tensor() if hasattr(t, "full_tensor") else t.detach()).clone()


class ParamSum(Callback):
    """The sum over optimizer steps of every parameter (shaped and sharded as it is) and a count: tensor state."""

    def __init__(self):
        self.sums, self.count, self.loaded = None, torch.zeros((), dtype=torch.float64), False

    def _sums(self, state):
        if self.sums is None:
            self.sums = {n: torch.zeros_like(p.detach()) for n, p in state.model.named_parameters()}
        return self.sums

    def state_tensors(self, state):
        return {"count": self.count, **{f"sum.{n}": t for n, t in self._sums(state).items()}}

    def load_state_tensors(self, state, tensors):
        self.loaded = True

    def on_optimizer_step(self, state):
        with torch.no_grad():
            for n, p in state.model.named_parameters():
                self._sums(state)[n].add_(p.detach())
        self.count += 1

    def on_fit_end(self, state, summary):
        sums = {n: full(t) for n, t in self._sums(state).items()}
        if state.rank == 0:
            torch.save({"count": self.count.item(), "loaded": self.loaded, "sums": sums},
                       Path(state.run_dir, f"param_sum_{state.step}.pt"))


class ParamLog(Callback):
    """Every step's full parameters (FSDP: gathered), saved by rank 0 at the end of each attempt."""

    def __init__(self):
        self.steps = {}

    def _log(self, state):
        params = {n: full(p) for n, p in state.model.named_parameters()}
        if state.rank == 0:
            self.steps[state.step] = params

    def on_fit_start(self, state):
        self._log(state)

    def on_step_end(self, state, metrics):
        self._log(state)

    def on_fit_end(self, state, summary):
        if state.rank == 0:
            torch.save(self.steps, Path(state.run_dir, f"params_{min(self.steps)}.pt"))


class TermAt(Callback):
    """SIGTERM to this process at `step` (every rank): the run checkpoints at that step and exits 143."""

    def __init__(self, step):
        self.at = step

    def on_step_end(self, state, metrics):
        if state.step == self.at:
            os.kill(os.getpid(), signal.SIGTERM)
'''

STEPS, STOP, DECAY = 20, 12, 0.9
LOGGED = "train.callbacks=[my_state:ParamSum, my_state:ParamLog]"
STOPPED = f"train.callbacks=[my_state:ParamSum, my_state:ParamLog, {{my_state:TermAt: {{step: {STOP}}}}}]"
FSDP = ["train.strategy=fsdp", "train.batch_size_per_worker=64"]  # x 2 ranks: 1 rank's 128


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("cb_state")
    (folder / "my_state.py").write_text(textwrap.dedent(CALLBACKS))
    return folder


def overrides(project: Path, data: Path, name: str, *extra: str) -> list[str]:
    return [f"data.train_path={data}/train", f"data.val_path={data}/val", f"run.storage_path={project}/runs",
            f"run.name={name}", "train.epochs=null", f"train.max_steps={STEPS}", "train.log_every_steps=5",
            "train.eval_every_steps=5", "checkpoint.every_steps=5", "checkpoint.keep_last=1", "model.hidden_sizes=[32]",
            *OVERLAY, f"train.ema={{decay: {DECAY}, eval: both}}",
            "checkpoint.keep_best={metric: val_loss, mode: min, k: 2}", *extra]


def run_args(project: Path, data: Path, name: str, *extra: str) -> list[str]:
    return ["--config", str(REPO / "trainers/configs/tabular_mlp.yaml"), *overrides(project, data, name, *extra)]


def train(project: Path, data: Path, name: str, *extra: str) -> subprocess.CompletedProcess:
    """trainers/torchrun.py, one process, from the user's folder."""
    return run_cli_forked([str(REPO / "trainers" / "torchrun.py"), *run_args(project, data, name, *extra)],
                          cwd=project, env={"PYTHONPATH": str(project)}, timeout=300)


@pytest.fixture(scope="module")
def two_ranks(project, tabular_data, tmp_path_factory) -> dict:
    """The 2-rank runs under one torchrun launch: uninterrupted; stopped and resumed; and two stopped ones (one
    resumed later on 1 rank, one on Ray)."""
    args = lambda name, *extra: run_args(project, tabular_data, name, *FSDP, *extra)  # noqa: E731
    cases = [{"label": "whole2", "args": args("whole2", LOGGED)},
             {"label": "stop2", "args": args("stop2", STOPPED)},
             {"label": "resume2", "args": args("stop2", STOPPED)},
             {"label": "stop2to1", "args": args("stop2to1", STOPPED)},
             {"label": "stop2ray", "args": args("stop2ray", STOPPED)}]
    r, ranks = run_torchrun_cases(cases, tmp_path_factory.mktemp("cb_state_cases"), project,
                                  {"PYTHONPATH": str(project)}, timeout=400)
    return {"launch": r, "ranks": ranks, "args": {c["label"]: c["args"] for c in cases}}


def export(source: Path, out: Path, *flags: str) -> dict:
    from safetensors.torch import load_file

    from stride.trainers.commands.export import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert main([str(source), str(out), "--force", *flags]) == 0, err.getvalue()
    return load_file(str(out))


def figures(run: Path) -> dict[int, dict]:
    """Each logged step's training and validation figures (no timings), at the steps an uninterrupted run logs."""
    keep = ("train_loss", "lr", "val_loss", "val_accuracy", "val_loss_ema", "val_accuracy_ema")
    out: dict[int, dict] = {}
    for x in read_jsonl(run / "metrics.jsonl"):  # a step's training line, then its evaluation's
        if x["step"] % 5 == 0:
            out.setdefault(x["step"], {}).update({k: x[k] for k in keep if k in x})
    assert all(len(v) == len(keep) for v in out.values()), out
    return out


def best(run: Path) -> list[tuple[int, float]]:
    summary = json.loads((run / "summary.json").read_text())
    kept = [(b["step"], b["val_loss"]) for b in summary["best_checkpoints"]]
    assert sorted(p.name for p in (run / "best").iterdir()) == sorted(f"checkpoint_{s:08d}" for s, _ in kept)
    return kept


def state(run: Path):
    import torch

    return torch.load(run / f"param_sum_{STEPS}.pt", weights_only=True)


def assert_same_run(a: Path, b: Path, tmp: Path) -> None:
    """Bitwise: the figures, the sum, the weights and the average, and best/'s ranking and tensors."""
    import torch

    from stride.trainers.run import checkpointing

    assert figures(a) == figures(b) and sorted(figures(a)) == [5, 10, 15, 20]
    sa, sb = state(a), state(b)
    assert sa["count"] == sb["count"] == STEPS and not sa["loaded"] and sb["loaded"]
    assert all(torch.equal(sa["sums"][n], sb["sums"][n]) for n in sa["sums"])
    for flags in ((), ("--ema",)):
        wa, wb = export(a, tmp / f"{a.name}.st", *flags), export(b, tmp / f"{b.name}.st", *flags)
        assert wa.keys() == wb.keys() and all(torch.equal(wa[n], wb[n]) for n in wa), flags
    assert best(a) == best(b) and len(best(a)) == 2
    for step, _ in best(a):
        for part in ("model", "ema"):
            ta, tb = (checkpointing.load_model_state(r / "best" / f"checkpoint_{step:08d}", part) for r in (a, b))
            assert ta and ta.keys() == tb.keys() and all(torch.equal(ta[n], tb[n]) for n in ta), (step, part)


def assert_as_logged(run: Path, tmp: Path) -> None:
    """The average and the sum are, bitwise, those of the weights the run went through (each attempt's ParamLog),
    and best/ holds the best 2 of the evaluations logged over both attempts."""
    import torch

    params = torch.load(run / "params_0.pt", weights_only=True)
    params.update(torch.load(run / f"params_{STOP}.pt", weights_only=True))  # the resumed attempt, from step 12
    assert sorted(params) == list(range(STEPS + 1))
    average, total = dict(params[0]), {n: torch.zeros_like(v) for n, v in params[0].items()}
    for step in range(1, STEPS + 1):
        average = {n: torch.lerp(average[n], params[step][n], 1.0 - DECAY) for n in average}
        for n in total:
            total[n].add_(params[step][n])
    exported = export(run, tmp / f"{run.name}-ema.st", "--ema")
    assert all(torch.equal(exported[n], average[n]) for n in average)
    saved = state(run)
    assert saved["loaded"] and saved["count"] == STEPS
    assert all(torch.equal(saved["sums"][n], total[n]) for n in total)
    evals = sorted((x["val_loss"], x["step"]) for x in read_jsonl(run / "metrics.jsonl") if "val_loss" in x)
    assert [x for x in read_jsonl(run / "metrics.jsonl") if "val_loss" in x][-1]["step"] == STEPS
    assert best(run) == [(step, value) for value, step in evals[:2]]


def test_one_rank_stopped_and_resumed_ends_bitwise_as_uninterrupted(project, tabular_data, tmp_path):
    r = train(project, tabular_data, "whole1", LOGGED)
    assert r.returncode == 0, r.stderr[-3000:]
    first = train(project, tabular_data, "stop1", STOPPED)
    assert first.returncode == 143, first.stderr[-3000:]
    meta = json.loads((project / "runs" / "stop1" / f"checkpoint_{STOP:08d}" / "meta.json").read_text())
    assert meta["ema"] is True and "my_state:ParamSum" in meta["callbacks"]  # its JSON state beside its tensors
    second = train(project, tabular_data, "stop1", STOPPED)
    assert second.returncode == 0, second.stderr[-3000:]
    assert_same_run(project / "runs" / "whole1", project / "runs" / "stop1", tmp_path)
    assert_as_logged(project / "runs" / "stop1", tmp_path)


def test_two_fsdp_ranks_stopped_and_resumed_end_bitwise_as_uninterrupted(project, two_ranks, tmp_path):
    torchrun_case(two_ranks, "whole2")
    torchrun_case(two_ranks, "stop2", 143)
    torchrun_case(two_ranks, "resume2")
    assert_same_run(project / "runs" / "whole2", project / "runs" / "stop2", tmp_path)
    assert_as_logged(project / "runs" / "stop2", tmp_path)


def test_two_fsdp_ranks_resumed_on_one_keep_the_average_the_sum_and_the_best(project, tabular_data, two_ranks,
                                                                             tmp_path):
    torchrun_case(two_ranks, "stop2to1", 143)
    r = train(project, tabular_data, "stop2to1", STOPPED, "train.strategy=fsdp", "train.batch_size_per_worker=128")
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads((project / "runs" / "stop2to1" / "summary.json").read_text())
    assert summary["world_size"] == 1 and summary["restarts"] == 1 and summary["global_step"] == STEPS
    assert_as_logged(project / "runs" / "stop2to1", tmp_path)


def test_a_run_stopped_under_torchrun_resumes_on_two_ray_workers(project, two_ranks, ray_cluster, tmp_path):
    torchrun_case(two_ranks, "stop2ray", 143)
    r = run_cli(["-m", "stride", *two_ranks["args"]["stop2ray"], "scaling.num_workers=2"],
                env={**ray_cluster, "PYTHONPATH": str(project)}, cwd=project)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    summary = json.loads((project / "runs" / "stop2ray" / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["strategy"] == "fsdp" and summary["restarts"] == 1
    assert_as_logged(project / "runs" / "stop2ray", tmp_path)
