"""`stride <command>`: the dispatcher, `stride eval` and `stride predict` (docs/commands.md).

The runs they read are trained, and the commands run, under one torchrun launch of 2 ranks (tests/torchrun_cases.py):
eval and predict are the same job code on Ray and under torchrun (trainers/launch/jobs.py, run_job), so the gang mechanics
are proven there, and one command on the shared Ray head proves the Ray edge: predict, the one with more of it (the
driver's output folder prepared before the gang, each worker writing its parts, Ray Train's job records removed).
What predict writes is checked against a forward pass of the exported weights (stride export), built in this process
without predict's code: the raw weights, and with train.ema the average. Bad inputs run in this process: each is
refused before any worker starts.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import textwrap
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import REPO, descendants, gone, kill_pids, run_torchrun_cases, torchrun_launcher
from runs import tiny

# Built once, on the worker of the tests on the shared cluster, which read it too (tests/conftest.py).
CLUSTER_STREAM_FIXTURES = {"gang"}

SLOW_TASK = '''
import os
import time

from stride.trainers.tasks.mlp import MLPTask


class SlowMLP(MLPTask):
    """The built-in MLP whose predict, after a rank's first block (2 batches of 10 rows), waits while the file
    $SLOW_TASK_HOLD exists: the test's SIGKILL lands mid-prediction however busy the machine is."""

    calls = 0

    def predict(self, model, batch):
        SlowMLP.calls += 1
        while SlowMLP.calls > 2 and os.path.exists(os.environ.get("SLOW_TASK_HOLD", "")):
            time.sleep(0.05)
        return super().predict(model, batch)
'''


# predict ddp's (torchrun and Ray): a column the task does not read, and one it reads
KEEP = ("--keep-columns", "path,f0")


def tabular(data: Path, storage: Path, name: str, *extra: str) -> list[str]:
    return tiny(storage, data, 20, "train.eval_every_steps=10", "checkpoint.every_steps=10", "model.hidden_sizes=[32]",
                *extra, name=name)


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("commands")
    (folder / "slow_task.py").write_text(textwrap.dedent(SLOW_TASK))
    return folder


@pytest.fixture(scope="module")
def unlabeled(project, tabular_data) -> Path:
    """The validation rows without label and sample_id, in row groups of 20 rows (a block each), ids by position,
    with a column the task does not read: `path`, a string per row (for --keep-columns)."""
    table = pq.read_table(tabular_data / "val").drop_columns(["label", "sample_id"])
    table = table.append_column("path", pa.array([f"images/{i:05d}.png" for i in range(table.num_rows)]))
    out = project / "unlabeled.parquet"
    pq.write_table(table, out, row_group_size=20)
    return out


@pytest.fixture(scope="module")
def gang(project, tabular_data, text_data, unlabeled, tmp_path_factory):
    """Runs trained and commands run under one launch of 2 ranks; returns the storage folder and the cases' results."""
    runs = project / "runs"
    stride = lambda label, *args: {"label": label, "entry": "stride", "args": list(args)}  # noqa: E731
    cases = [
        {"label": "train ddp", "args": tabular(tabular_data, runs, "ddp")},
        {"label": "train fsdp", "args": tabular(tabular_data, runs, "fsdp", "train.strategy=fsdp")},
        {"label": "train char_gpt", "args": tiny(runs, text_data, None, "train.max_steps=2", "train.eval_every_steps=2",
                                                 "checkpoint.every_steps=2", "model.n_layers=1", "model.width=32",
                                                 "model.n_heads=2", "model.context=16", "train.batch_size_per_worker=4",
                                                 name="gpt", config=REPO / "trainers/configs/char_gpt.yaml")},
        {"label": "train slow", "args": tabular(tabular_data, runs, "slow", "model.name=slow_task:SlowMLP")},
        # eval: both evaluates the raw weights as val_loss, and the average too: predict's weights are the average's
        {"label": "train ema", "args": tabular(tabular_data, runs, "ema", "train.strategy=fsdp",
                                               "train.ema={decay: 0.9, eval: both}")},
        stride("eval ddp", "eval", "--run-dir", str(runs / "ddp")),
        stride("eval fsdp", "eval", "--run-dir", str(runs / "fsdp")),
        stride("eval ddp train split", "eval", "--run-dir", str(runs / "ddp"), "--data", f"{tabular_data}/train",
               "--checkpoint", str(runs / "ddp" / "checkpoint_00000010"), "--name", "train_at_10"),
        stride("predict ddp", "predict", "--run-dir", str(runs / "ddp"), "--data", str(unlabeled),
               "--out", str(project / "predictions"), *KEEP),
        stride("predict again", "predict", "--run-dir", str(runs / "ddp"), "--data", str(unlabeled),
               "--out", str(project / "predictions")),  # finished: refused (exit 2) on every rank, not one
        stride("predict ema", "predict", "--run-dir", str(runs / "ema"), "--data", str(unlabeled),
               "--out", str(project / "ema_predictions")),
        stride("predict ema raw", "predict", "--run-dir", str(runs / "ema"), "--data", str(unlabeled),
               "--out", str(project / "ema_raw_predictions"), "train.ema={decay: 0.9, eval: raw}"),
        # --force over an earlier prediction of other inputs, beside a user's own files (FORCED_MINE)
        stride("predict force", "predict", "--run-dir", str(runs / "ddp"), "--data", str(unlabeled),
               "--out", str(plant_earlier_prediction(project / "forced")), "--force"),
    ]
    r, ranks = run_torchrun_cases(cases, tmp_path_factory.mktemp("commands_cases"), project,
                                  {"PYTHONPATH": str(project)})
    expected = {"predict again": 2}
    failed = [(c["label"], c["code"], c["stderr"][-2000:]) for c in ranks[0] + ranks[1]
              if c["code"] != expected.get(c["label"], 0)]
    assert len(ranks[0]) == len(ranks[1]) == len(cases) and not failed, (failed, r.stderr[-3000:])
    return {"runs": runs, "ranks": ranks}


FORCED_MINE = {"part-notes.txt": "mine", "part-000000.parquet.bak": "my copy", ".part-mine": "mine too"}


def plant_earlier_prediction(out: Path) -> Path:
    """`out` holding an earlier prediction of other inputs (its record and a part) and a user's own files."""
    out.mkdir()
    (out / ".stride-predict.json").write_text(json.dumps({"run": "/elsewhere", "rows": 1, "blocks": 1}))
    (out / "part-000000.parquet").write_text("an earlier part")
    for name, text in FORCED_MINE.items():
        (out / name).write_text(text)
    return out


@pytest.mark.slow
def test_predict_force_replaces_the_earlier_prediction_and_keeps_the_users_files(gang, project, unlabeled):
    """stride predict --force (issue 42): the earlier prediction's parts and records are replaced, every other file in
    --out stays byte for byte, part-* names included."""
    out = project / "forced"
    for name, text in FORCED_MINE.items():
        assert (out / name).read_text() == text
    parts = sorted(out.glob("part-*.parquet"))
    assert parts and sum(pq.ParquetFile(p).metadata.num_rows for p in parts) == pq.read_table(unlabeled).num_rows
    assert json.loads((out / ".stride-predict.json").read_text())["rows"] == pq.read_table(unlabeled).num_rows


def summary(run: Path) -> dict:
    return json.loads((run / "summary.json").read_text())


# ---- the dispatcher ----

def test_stride_help_lists_every_command(capsys):
    from stride.commands import commands, main

    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert all(f"  {name} " in out for name in commands())
    assert list(commands()) == ["train", "eval", "predict", "export", "generate", "sweep", "doctor", "prepare"]


def test_a_command_module_dropped_into_the_package_is_listed_and_dispatched(tmp_path, monkeypatch, capsys):
    """A new command is one file: a module of stride.trainers.commands declaring NAME, HELP and main(argv), with no
    list to edit. Listed by `stride --help` without importing it (the help stays fast), dispatched by its NAME."""
    import sys

    import stride.trainers.commands as package
    from stride.commands import main

    (tmp_path / "hello_cmd.py").write_text(
        'NAME = "hello"\nHELP = "greet from a dropped-in module"\nORDER = 25\n'
        'def main(argv):\n    print("hello", *argv)\n    return 7\n')
    (tmp_path / "helper_mod.py").write_text("X = 1\n")  # no NAME: a helper, not a command
    monkeypatch.setattr(package, "__path__", [*package.__path__, str(tmp_path)])
    monkeypatch.delitem(sys.modules, "stride.trainers.commands.hello_cmd", raising=False)

    assert main(["--help"]) == 0
    listed = [line.split()[0] for line in capsys.readouterr().out.splitlines()[3:12]]
    assert listed == ["train", "eval", "predict", "hello", "export", "generate", "sweep", "doctor", "prepare"]
    assert "stride.trainers.commands.hello_cmd" not in sys.modules  # read, not imported
    try:
        assert main(["hello", "a", "b"]) == 7
        assert capsys.readouterr().out == "hello a b\n"
    finally:
        sys.modules.pop("stride.trainers.commands.hello_cmd", None)


def test_an_unknown_command_exits_2_in_one_line(capsys):
    from stride.commands import main

    assert main(["evaluate", "--run", "x"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["stride: error: unknown command 'evaluate'; use one of train, eval, predict, export, generate, "
                   "sweep, doctor, prepare, or train with stride --config <file.yaml>; see stride --help"]


def test_train_is_the_default_command_and_each_command_names_itself_in_its_usage(capsys):
    from stride.commands import main, split_command

    assert split_command(["--config", "x.yaml", "train.max_steps=3"]) == ("train", ["--config", "x.yaml", "train.max_steps=3"])
    assert split_command(["train.max_steps=3"])[0] == "train" and split_command([])[0] == "train"
    assert split_command(["eval", "--run", "r"]) == ("eval", ["--run", "r"])
    with pytest.raises(SystemExit) as e:
        main(["sweep", "--no-such-flag"])
    assert e.value.code == 2
    assert capsys.readouterr().err.startswith("stride sweep: error: ")


# ---- eval ----

@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_eval_under_torchrun_equals_the_runs_val_loss_bitwise(gang, strategy):
    run = gang["runs"] / strategy
    record = json.loads((run / "eval" / "checkpoint_00000020.json").read_text())
    s = summary(run)
    assert record["val_loss"] == s["val_loss"] and record["val_accuracy"] == s["val_accuracy"]
    assert (record["runtime"], record["world_size"], record["step"]) == ("torchrun", 2, 20)
    assert record["checkpoint"] == str(run / "checkpoint_00000020")


@pytest.mark.slow
def test_eval_data_runs_on_another_split_and_checkpoint(gang, tabular_data):
    run = gang["runs"] / "ddp"
    record = json.loads((run / "eval" / "train_at_10.json").read_text())
    assert record["rows"] == sum(pq.read_metadata(f).num_rows for f in (tabular_data / "train").glob("*.parquet"))
    assert record["step"] == 10 and record["data"] == f"{tabular_data}/train"
    at_10 = [m for m in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
             if m.get("step") == 10 and "val_loss" in m][0]
    assert record["val_loss"] != at_10["val_loss"]  # the training rows, not the validation ones, at step 10


# ---- predict ----

def read_predictions(out: Path) -> pa.Table:
    return pq.read_table(out)  # the parts; _predict.json and .stride-predict.json are not read as data


@pytest.mark.slow
def test_predict_writes_every_row_once_with_its_position_as_sample_id(gang, project, unlabeled):
    out = project / "predictions"
    table = read_predictions(out)
    n = pq.read_metadata(unlabeled).num_rows
    assert sorted(table.column("sample_id").to_pylist()) == list(range(n))
    assert table.column("sample_id").to_pylist() == list(range(n))  # parts in the data's order
    blocks = pq.ParquetFile(unlabeled).metadata.num_row_groups
    assert sorted(p.name for p in out.glob("part-*")) == [f"part-{b:06d}.parquet" for b in range(blocks)]
    probs = np.stack(table.column("probs").to_pylist())
    assert probs.shape == (n, 4) and np.allclose(probs.sum(1), 1, atol=1e-5)
    assert table.column("label").to_pylist() == probs.argmax(1).tolist()
    manifest = json.loads((out / "_predict.json").read_text())
    assert (manifest["rows_written"], manifest["parts"], manifest["world_size"]) == (n, blocks, 2)


def forward(run: Path, checkpoint: Path, rows: pa.Table, folder: Path, ema: bool = False) -> np.ndarray:
    """The class probabilities the checkpoint's model gives `rows`: its weights exported (stride export; `ema`: the
    average), loaded into the run's task's build_model() as a user loads them, fed through the task's transform."""
    import torch
    from safetensors.torch import load_file

    from stride.trainers.commands import export
    from stride.trainers.config_reader import from_dict
    from stride.trainers.tasks import make_task

    weights = folder / f"{run.name}{'-ema' if ema else ''}.safetensors"
    export.export(checkpoint, weights, ema=ema)
    s = summary(run)
    task = make_task(from_dict(s["config"]), s["facts"])
    model = task.build_model().eval()
    model.load_state_dict(load_file(weights))
    x = task.transform({c: rows.column(c).to_numpy() for c in task.predict_columns})["x"]
    with torch.no_grad():
        return torch.softmax(model(torch.from_numpy(x)).float(), dim=-1).numpy()


def predicted(out: Path) -> tuple[np.ndarray, Path]:
    """A prediction's probs, row by row, and the checkpoint it used."""
    probs = np.stack(read_predictions(out).column("probs").to_pylist())
    return probs, Path(json.loads((out / "_predict.json").read_text())["checkpoint"])


@pytest.mark.slow
def test_predict_writes_what_the_checkpoints_model_computes(gang, project, unlabeled, tmp_path):
    """Two workers' predictions equal a forward pass of the checkpoint's exported weights, row for row (their order
    is the data's), to float tolerance: the weights, the transform and the row each worker took are the ones asked
    for."""
    probs, checkpoint = predicted(project / "predictions")
    expected = forward(gang["runs"] / "ddp", checkpoint, pq.read_table(unlabeled), tmp_path)
    np.testing.assert_allclose(probs, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_predict_with_train_ema_writes_what_the_average_computes(gang, project, unlabeled, tmp_path):
    """docs/commands.md: with train.ema, predict uses the average where the run evaluated it (train.ema.eval ema or
    both; this FSDP run: both), and the trained weights with train.ema.eval raw (an override of predict's)."""
    rows, run = pq.read_table(unlabeled), gang["runs"] / "ema"
    probs, checkpoint = predicted(project / "ema_predictions")
    raw_probs, raw_checkpoint = predicted(project / "ema_raw_predictions")
    assert checkpoint == raw_checkpoint
    average, weights = forward(run, checkpoint, rows, tmp_path, ema=True), forward(run, checkpoint, rows, tmp_path)
    assert not np.allclose(average, weights, rtol=1e-3, atol=1e-4)  # the two are told apart
    np.testing.assert_allclose(probs, average, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(raw_probs, weights, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_keep_columns_copies_input_columns_beside_sample_id(gang, project, unlabeled):
    table = read_predictions(project / "predictions")
    assert table.column_names == ["sample_id", "path", "f0", "label", "probs"]
    rows = pq.read_table(unlabeled)
    assert table.column("path").to_pylist() == rows.column("path").to_pylist()  # as read, in the data's order
    assert table.column("f0").equals(rows.column("f0")) and table.schema.field("path").type == pa.string()


@pytest.mark.slow
def test_a_refusal_under_torchrun_is_every_ranks_one_line(gang, project):
    for rank in gang["ranks"]:
        again = [c for c in rank if c["label"] == "predict again"][0]
        errors = [ln for ln in again["stderr"].splitlines() if ln.startswith("stride: error:")]
        assert errors == [f"stride: error: --out ({project / 'predictions'}) exists and holds a finished prediction; "
                          f"pass a new folder, or --force to replace it"] and again["exception"] is None


@pytest.mark.slow
def test_predict_after_a_sigkill_resumes_and_writes_every_row_exactly_once(gang, project, unlabeled):
    out = project / "killed"
    cmd = [*torchrun_launcher(2), "-m", "stride", "predict", "--run-dir", str(gang["runs"] / "slow"), "--data",
           str(unlabeled), "--out", str(out), "--batch-size", "10", "--task", "slow_task:SlowMLP"]
    hold = project / "hold"  # the killed prediction writes a part per rank, then waits on this file
    hold.touch()
    env = dict(os.environ, PYTHONPATH=str(project), SLOW_TASK_HOLD=str(hold))
    proc = subprocess.Popen(cmd, cwd=project, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not list(out.glob("part-*.parquet")) and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.1)
        written = len(list(out.glob("part-*.parquet")))
    finally:
        # The launcher and its ranks, as a lost node takes them: torchrun starts each rank in a session of its own,
        # so killing the launcher's group alone would leave the ranks running (and finishing the prediction).
        ranks = descendants(proc.pid)
        os.killpg(proc.pid, signal.SIGKILL)
        kill_pids(ranks)
        proc.wait(30)
        gone(ranks)
    assert 1 <= written < pq.ParquetFile(unlabeled).metadata.num_row_groups, proc.stdout.read().decode()[-3000:]
    assert not (out / "_predict.json").exists()
    hold.unlink()
    (out / ".part-000003.parquet.99999.tmp").write_bytes(b"torn")  # what a kill mid-write leaves, whatever this one did
    r = subprocess.run(cmd, cwd=project, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "already written" in r.stdout
    ids = read_predictions(out).column("sample_id").to_pylist()
    assert ids == list(range(pq.read_metadata(unlabeled).num_rows))  # none missing, none twice
    assert not list(out.glob(".part-*"))  # a part a kill cut short was never renamed into place, and is gone


# ---- refused before any worker: exit 2, one line ----

def refusal(capsys, *argv: str) -> str:
    from stride.commands import main

    code = main(list(argv))
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, (code, err)
    return err[0]


@pytest.mark.slow
def test_bad_inputs_are_refused_in_one_line(gang, project, unlabeled, tmp_path, capsys):
    runs = gang["runs"]
    line = refusal(capsys, "eval", "--run", str(tmp_path))
    assert line == (f"stride: error: --run ({tmp_path}) is not a run folder (no summary.json); pass "
                    f"<run.storage_path>/<run.name> of a run that trained, such as runs/char_gpt")
    gpt_checkpoint = runs / "gpt" / "checkpoint_00000002"
    line = refusal(capsys, "eval", "--run", str(runs / "ddp"), "--checkpoint", str(gpt_checkpoint))
    assert line == (f"stride: error: --checkpoint ({gpt_checkpoint}) lies outside --run ({runs / 'ddp'}); pass a "
                    f"checkpoint folder of the run, or the run folder that holds it")
    planted = runs / "ddp" / "planted" / gpt_checkpoint.name  # another task's checkpoint inside the run folder
    shutil.copytree(gpt_checkpoint, planted)
    try:
        line = refusal(capsys, "eval", "--run", str(runs / "ddp"), "--checkpoint", str(planted))
    finally:
        shutil.rmtree(planted.parent)
    assert line == (f"stride: error: --checkpoint ({planted}) holds model.name char_gpt, not the run's mlp; pass a "
                    f"checkpoint of this run")
    line = refusal(capsys, "predict", "--run", str(runs / "gpt"), "--data", str(unlabeled), "--out", str(tmp_path / "p"))
    assert line.startswith("stride: error: model.name (char_gpt) has no predict; implement Task.predict(")
    assert not (tmp_path / "p").exists()
    finished = project / "predictions"
    line = refusal(capsys, "predict", "--run", str(runs / "ddp"), "--data", str(unlabeled), "--out", str(finished))
    assert line == (f"stride: error: --out ({finished}) exists and holds a finished prediction; pass a new folder, or "
                    f"--force to replace it")
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    line = refusal(capsys, "predict", "--run", str(runs / "ddp"), "--data", str(unlabeled), "--out",
                   str(tmp_path / "mine"), "--force")
    assert "holds files that stride predict did not write" in line
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"
    line = refusal(capsys, "eval", "--run", str(runs / "slow"))  # a task of the user's own: imported on consent only
    assert ("pass --task slow_task:SlowMLP (found in the working directory or on PYTHONPATH) if you trust it, or "
            "--trust-remote-code") in line
    line = refusal(capsys, "eval", "--run", str(runs / "ddp"), "--checkpoint", "best")
    assert "kept no best checkpoint" in line
    line = refusal(capsys, "predict", "--run", str(runs / "ddp"), "--data", str(unlabeled), "--out",
                   str(tmp_path / "k"), "--keep-columns", "path,id")
    columns = ", ".join(pq.read_schema(unlabeled).names)
    assert line == (f"stride: error: --keep-columns (id) is not a column of --data ({unlabeled}); keep columns it has: "
                    f"{columns}")
    assert not (tmp_path / "k").exists()


# ---- on Ray ----

@pytest.mark.slow
def test_predict_on_two_ray_workers_writes_what_torchrun_wrote(gang, project, unlabeled, ray_cluster):
    from conftest import run_cli

    run = gang["runs"] / "ddp"
    out = project / "ray_predictions"
    r = run_cli(["-m", "stride", "predict", "--run", str(run), "--data", str(unlabeled), "--out", str(out), *KEEP],
                env=ray_cluster, cwd=project)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    manifest = json.loads((out / "_predict.json").read_text())
    assert (manifest["runtime"], manifest["world_size"]) == ("ray", 2)
    assert read_predictions(out).equals(read_predictions(project / "predictions"))  # bitwise: the same job code
    assert not (run / ".jobs").exists()  # Ray Train's records of the job are removed with it


# ---- one lifecycle: the same refusal from every launcher ----

def test_the_same_bad_config_gives_the_same_line_and_exit_code_from_train_torchrun_and_a_sweep(tmp_path, tabular_data,
                                                                                                capsys):
    """The batch-fit check is one function (config.check_batch_fits) that `stride train`, the torchrun launcher and a
    sweep's trials all run before any worker: one line, exit 2, from each."""
    from tune_fixtures import write_sweep

    from stride.commands import main
    from stride.trainers.launch import torchrun

    bad = ["scaling.num_workers=1", "train.batch_size_per_worker=100000", "model.hidden_sizes=[32]"]
    args = tabular(tabular_data, tmp_path / "runs", "too_big", *bad)
    sweep = write_sweep(tmp_path / "sweep.yaml", tabular_data, tmp_path / "sweeps", sweep={"name": "too_big"},
                        base={"train.batch_size_per_worker": 100000, "train.max_steps": 20},
                        space={"optim.lr": {"loguniform": [1e-4, 1e-2]}})
    lines = {}
    for name, call in [("train", lambda: main(["train", *args])), ("torchrun", lambda: torchrun.main(args)),
                       ("sweep", lambda: main(["sweep", "--config", str(sweep)]))]:
        code = call()
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(err) == 1, (name, code, err)
        lines[name] = err[0]
    rows = sum(pq.read_metadata(f).num_rows for f in (tabular_data / "train").glob("*.parquet"))
    assert set(lines.values()) == {f"stride: error: train.batch_size_per_worker (100000) x 1 worker(s) = 100000 rows per "
                                   f"micro-step exceeds the {rows} rows of {tabular_data}/train; use "
                                   f"train.batch_size_per_worker={rows} or less"}, lines
    assert not (tmp_path / "runs").exists()  # no run folder; the sweep's folder (made to check it is writable) is empty
    assert not any((tmp_path / "sweeps" / "too_big").iterdir())


def test_a_run_folder_is_opened_alike_by_train_and_torchrun(tmp_path, tabular_data, capsys):
    """lifecycle.open_run is every launcher's start after the checks: a checkpoint of another model under run.name,
    or storage that cannot be written, is the same one line and exit 2 from `stride train` and the torchrun launcher
    (here one rank, in process), and the checkpoint is left as it was."""
    from stride.commands import main
    from stride.trainers.launch import torchrun
    from stride.trainers.run import checkpointing
    from stride.trainers.models import MLP

    storage = tmp_path / "runs"
    ckpt = checkpointing.CheckpointWriter(0).save(storage / "other" / "checkpoint_00000010", {
        "model": MLP(16, [64], 4).state_dict()}, {"step": 10, "epoch": 0, "epoch_offset_samples": 0,
                                                  "samples_seen": 0}).result()
    before = sorted((p.name, p.read_bytes()) for p in ckpt.iterdir())
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    cases = {"another model": (tabular(tabular_data, storage, "other"), "holds checkpoint checkpoint_00000010 of "
                                                                        "another model"),
             "unwritable": (tabular(tabular_data, blocker / "runs", "x"), f"run.storage_path ({blocker}/runs) is "
                                                                          f"not writable")}
    for case, (args, expected) in cases.items():
        lines = {}
        for name, call in [("train", lambda: main(["train", *args])), ("torchrun", lambda: torchrun.main(args))]:
            code = call()
            err = capsys.readouterr().err.strip().splitlines()
            assert code == 2 and len(err) == 1 and expected in err[0], (case, name, code, err)
            lines[name] = err[0]
        assert lines["train"] == lines["torchrun"], (case, lines)
    assert sorted((p.name, p.read_bytes()) for p in ckpt.iterdir()) == before
    assert not (storage / "other" / "summary.json").exists()


def test_predict_output_rules(tmp_path):
    """An empty or new --out is used; the same unfinished job resumes; --force starts over (the earlier
    prediction's files only); a finished prediction or another job's needs --force; other files are never removed."""
    from stride.errors import UsageError
    from stride.trainers.commands.predict import JOB, MANIFEST, prepare_output

    job = {"run": "/r", "checkpoint": "/r/checkpoint_00000020", "data": ["/d.parquet"], "rows": 10, "blocks": 2}
    out = tmp_path / "out"
    out.mkdir()
    assert prepare_output(out, job, force=False) is False  # empty: a new prediction
    (out / JOB).write_text(json.dumps(job))
    (out / "part-000000.parquet").write_text("a part")
    assert prepare_output(out, job, force=False) is True and (out / "part-000000.parquet").exists()  # resumes
    with pytest.raises(UsageError, match="an unfinished prediction of other inputs"):
        prepare_output(out, {**job, "rows": 11}, force=False)
    assert prepare_output(out, job, force=True) is False and not any(out.iterdir())  # starts over
    (out / JOB).write_text(json.dumps(job))
    (out / MANIFEST).write_text("{}")
    with pytest.raises(UsageError, match="holds a finished prediction"):
        prepare_output(out, job, force=False)
    (out / JOB).unlink()  # no longer a folder of Stride's, and a file of the user's in it
    (out / "notes.txt").write_text("mine")
    with pytest.raises(UsageError, match="did not write"):
        prepare_output(out, job, force=True)
    assert (out / "notes.txt").read_text() == "mine"


def test_predict_outputs_become_columns_whatever_their_type():
    """Task.predict may return tensors (bf16 too) or numpy arrays: floats become float32, the rest keeps its type,
    a vector per row a fixed-size list."""
    import torch

    from stride.trainers.commands.predict import arrow_column, as_numpy

    assert as_numpy(torch.tensor([1.5, 2.5], dtype=torch.bfloat16)).dtype == np.float32
    assert as_numpy(torch.tensor([1, 2])).dtype == np.int64
    assert as_numpy(np.array([0.5, 1.5])).dtype == np.float64  # a numpy array as it is
    column = arrow_column(as_numpy(torch.ones(3, 4, dtype=torch.float16)))
    assert column.type == pa.list_(pa.float32(), 4) and len(column) == 3
    for names in (["cat", "dog", None], np.array(["cat", "dog", "eel"])):  # a class name per row: a string column
        column = arrow_column(as_numpy(names))
        assert column.type == pa.string() and column.to_pylist()[:2] == ["cat", "dog"]
