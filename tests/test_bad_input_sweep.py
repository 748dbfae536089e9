"""Bad input, as a whole: every entry below is a distinct mistake a user can make with one of Stride's commands. Each
must exit 2 with one line on stderr that names the key (or file or flag) and says what to do, with no traceback,
and leave every file that was there (data, a finished run's checkpoints, metrics and summary) byte for byte as it
was. The commands run against a folder holding a finished run of the same name, so a mistake that wrote anything
would show in the hashes. They run through tests/forked_cli.py: each in its own process, as `python <script>` runs
it, forked after the imports they share (two seconds of imports, a hundred times, were most of this file's time)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import threading
from contextlib import contextmanager
from pathlib import Path

import pytest

from conftest import PYTHON, REPO, run_cli
from runs import OVERLAY
from test_export_checks import tensor_item_on_bytes_item, tensor_item_payload  # the same tampers, one home
from forked_cli import digest
from services import unavailable
from test_run_folder_code import corrupt_pages

pytestmark = pytest.mark.slow

MAIN = ["trainers/main.py", "--config", "trainers/configs/tabular_mlp.yaml"]

# (override(s), what the error line must name). Values are YAML, as on the command line.
MAIN_CASES = [
    (["run.name=a/b"], "run.name"), (["run.name=.."], "run.name"), (["run.name=" + "x" * 300], "is 300 bytes long, over the 200"),
    (['run.name="a\\nb"'], "run.name"), (['run.name="a\\0b"'], "control characters"),
    (["run.seed=abc"], "run.seed"), (["run.storage_path=s3://bucket/runs"], "run.storage_path"),
    (["run.storage_path=/proc/stride"], "run.storage_path"), (["run.nope=1"], "run.nope"),
    (["data.train_path={tmp}/missing"], "data.train_path"), (["data.val_path={tmp}/missing"], "data.val_path"),
    (["data.train_path={tmp}/notes"], "data.train_path"), (["data.train_path={tmp}/empty"], "data.train_path"),
    (["model.label_column=nope"], "model.label_column"), (["model.feature_columns=[nope]"], "model.feature_columns"),
    (["model.nan_policy=maybe"], "model.nan_policy"), (["model.standardize=maybe"], "model.standardize"),
    (["data.label_column=label"], "moved to model.label_column"), (["data.nan_policy=impute"], "moved to model.nan_policy"),
    (["data.shuffle_window_rows=0"], "data.shuffle_window_rows"), (["data.read_ahead_windows=0"], "data.read_ahead_windows"),
    (["data.pipeline=gpu"], "data.pipeline"), (["data.pipeline_timeout_s=0"], "data.pipeline_timeout_s"),
    (["data.nope=1"], "data.nope"),
    (["model.name=nope"], "model.name"), (["model.name=no_such_module:Task"], "model.name"),
    (["model.hidden_sizes=abc"], "model.hidden_sizes"), (["model.num_classes=2"], "model.num_classes"),
    (["model.dropout=2"], "model.dropout"), (["model.colour=red"], "model.colour"),
    (["optim.name=adam2"], "optim.name"), (["optim.lr=-1"], "optim.lr"), (["optim.lr=0"], "optim.lr"),
    (["optim.lr=.inf"], "optim.lr (inf) must be a finite"), (["optim.betas=[0.9]"], "optim.betas"), (["optim.betas=[0.9, 0.9, 0.9]"], "optim.betas"),
    (["optim.weight_decay=-1"], "optim.weight_decay"), (["optim.momentum=-0.5"], "optim.momentum"),
    (["optim.lr_scaling=cubic"], "optim.lr_scaling"), (["optim.reference_batch_size=0"], "optim.reference_batch_size"),
    (["optim.warmup_steps=-1"], "optim.warmup_steps"), (["optim.min_lr_ratio=2"], "optim.min_lr_ratio"),
    (["optim.grad_clip_norm=0"], "optim.grad_clip_norm"),
    (["optim.name=no_such_optim:Lion"], "optim.name (no_such_optim:Lion): module no_such_optim is not importable"),
    (["optim.name=torch.optim:Nope"], "optim.name (torch.optim:Nope): module torch.optim has no Nope"),
    (["optim.name=torch.nn:Linear"], "optim.name (torch.nn:Linear) is not a torch.optim.Optimizer"),
    (["optim.kwargs={{foo: 1}}"], "optim.kwargs ({'foo': 1}): adamw refused it"), (["optim.kwargs={{lr: 1}}"], "optim.kwargs"),
    (["optim.schedule=step"], "optim.schedule"), (["optim.decay_fraction=0"], "optim.decay_fraction"),
    (["optim.decay_fraction=1.5"], "optim.decay_fraction"),
    (["train.batch_size_per_worker=0"], "train.batch_size_per_worker"),
    (["train.batch_size_per_worker=100000"], "train.batch_size_per_worker"),
    (["train.grad_accum_steps=0"], "train.grad_accum_steps"), (["train.max_steps=0"], "train.max_steps"),
    (["train.max_steps=many"], "train.max_steps"), (["train.epochs=.nan"], "train.epochs (nan) must be"), (["train.epochs=0"], "train.epochs"),
    (["train.max_steps=null", "train.epochs=null"], "train.max_steps"), (["train.precision=fp8"], "train.precision"),
    (["train.eval_every_steps=0"], "train.eval_every_steps"), (["train.log_every_steps=0"], "train.log_every_steps"),
    (["train.deterministic=maybe"], "train.deterministic"), (["train.num_threads=0"], "train.num_threads"),
    (["train.nonfinite=ignore"], "train.nonfinite"), (["train.max_nonfinite_steps=0"], "train.max_nonfinite_steps"),
    (["train.collective_timeout_s=.inf"], "train.collective_timeout_s (inf) must be a finite number"), (["train.peak_flops=-1"], "train.peak_flops"),
    (["train.profile_steps=abc"], "train.profile_steps"), (["train.strategy=tp"], "train.strategy"),
    (["train.compile=maybe"], "train.compile"), (["train.compile_mode=fastest"], "train.compile_mode"),
    (["train.activation_checkpointing=sometimes"], "train.activation_checkpointing"),
    (["train.activation_checkpointing_every=0"], "train.activation_checkpointing_every"),
    (["scaling.num_workers=0"], "scaling.num_workers"), (["scaling.num_workers=[3,1]"], "scaling.num_workers"),
    (["scaling.num_workers=[1,2,3]"], "scaling.num_workers"), (["scaling.cpus_per_worker=0"], "scaling.cpus_per_worker"),
    (["scaling.use_gpu=maybe"], "scaling.use_gpu"), (["scaling.max_failures=-5"], "scaling.max_failures"),
    (["checkpoint.keep_last=0"], "checkpoint.keep_last"), (["checkpoint.every_steps=0"], "checkpoint.every_steps"),
    (["tracking.mlflow=maybe"], "tracking.mlflow"),
    (["tracking.sinks=[nope]"], "tracking.sinks (['nope']) must be one of 'mlflow', 'tensorboard' or 'wandb'"),
    (["tracking.sinks=[wandb,wandb]"], "tracking.sinks (['wandb', 'wandb']) names a sink twice"),
    (["tracking.wandb_mode=sometimes"], "tracking.wandb_mode ('sometimes') must be one of 'online', 'offline'"),
    (["train.callbacks=[nope]"], "train.callbacks (['nope']) entry 0 ('nope') is not \"module:Class\""),
    (["train.callbacks=[no_such_module:Stop]"],
     "train.callbacks[0] (no_such_module:Stop): module no_such_module is not importable"),
    (["train.callbacks=[json:dumps]"], "train.callbacks[0] (json:dumps): dumps is not a stride.Callback"),
    (["train.callbacks=[{{stride.trainers.callbacks:Callback: {{every: 2}}}}]"],
     "got an unexpected keyword argument 'every'"),
    (["train.early_stopping={{metric: val_nope}}"],
     "train.early_stopping.metric (val_nope) is not a figure mlp reports; use one of val_loss, val_accuracy"),
    (["train.early_stopping={{metric: loss}}"], "train.early_stopping.metric ('loss') is not an evaluation figure"),
    (["train.early_stopping={{patience: 0}}"], "train.early_stopping.patience"),
    (["train.early_stopping={{metric: val_loss}}", "data.val_path=null"], "train.early_stopping needs a validation split"),
    (["checkpoint.keep_best={{metric: val_bpb}}"],
     "checkpoint.keep_best.metric (val_bpb) is not a figure mlp reports; use one of val_loss, val_accuracy"),
    (["checkpoint.keep_best={{k: 0}}"], "checkpoint.keep_best.k (0) must be greater than or equal to 1"),
    (["train.ema={{decay: 1.5}}"], "train.ema.decay (1.5) must be less than 1"),
    (["train.ema={{decay: 0}}"], "train.ema.decay (0) must be greater than 0"),
    (["train.ema={{eval: best}}"], "train.ema.eval ('best') must be one of 'ema', 'raw' or 'both'"),
    (["checkpoint.keep_best={{k: 1}}", "train.eval_every_steps=7", "checkpoint.every_steps=10"],
     "checkpoint.every_steps (10) is not a multiple of train.eval_every_steps (7)"), (["trian.max_steps=1"], "trian"), (["lr=0.1"], "section.field=value"),
    # Issue 27: counts with no sane upper bound, an MLflow scheme MLflow fails on later, a symlink loop, a task
    # module that exits at import (on PYTHONPATH, see `results`), damaged Parquet pages, a value too long to quote.
    (["train.max_steps=1000000000000000000000000000000"],
     "train.max_steps (1000000000000000000000000000000) must be less than or equal to 1000000000"),
    (["train.epochs=10000000"], "train.epochs (10000000) must be less than or equal to 1000000"),
    (["checkpoint.every_steps=10000000000"], "checkpoint.every_steps"), (["train.eval_every_steps=10000000000"], "train.eval_every_steps"),
    (["optim.warmup_steps=10000000000"], "optim.warmup_steps"),
    (["tracking.mlflow_uri=foo://bar"], "tracking.mlflow_uri ('foo://bar') has scheme foo://"),
    (["run.storage_path={tmp}/loop/a"], "/loop/a') is a loop of symbolic links"),
    (["model.name=exits_at_import:Task"], "module exits_at_import called sys.exit(0) while being imported"),
    (["data.train_path={tmp}/damaged/train"], "damaged/train/part-0000.parquet could not be read"),
    (["run.seed=" + "x" * 5000], "... (5002 characters)) must be a valid integer"),
    (["run.seed=" + "7" * 5000], "Exceeds the limit (4300 digits)"),
    (["model.hidden_sizes={{a: 1, a: 2}}"], "key 'a' appears twice in one mapping"),  # {{ }}: main_argv formats
    # Issue 42: a storage path inside the data, a damaged CSV cell, a CSV column of text beside numbers, a 2 GiB line.
    (["run.storage_path={tmp}/data/train/runs"], "inside data.train_path ("),
    (["run.storage_path={tmp}/data/val"], "inside data.val_path ("),
    (["data.train_path={tmp}/files/damaged_cell.csv", "data.val_path=null"],
     "damaged_cell.csv line 1501 column 'f7' holds '0.1.2'"),
    (["data.train_path={tmp}/files/csv_mixed", "data.val_path=null", "run.storage_path={tmp}/../mixed_runs"],
     "column 'f7' is string in"),
    (["data.train_path={tmp}/../huge_line/train.jsonl", "data.val_path=null"],
     "train.jsonl line 2 is 2,147,483,724 bytes long, over the 2,147,483,646"),
]


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    """A data set and a finished run named like the default (runs/tabular_mlp), plus files a user could point at."""
    tmp = tmp_path_factory.mktemp("sweep")
    r = run_cli(["datasets/prepare.py", "tabular", "--out", str(tmp / "data"), "--rows", "2000"], timeout=120)
    assert r.returncode == 0, r.stderr
    r = run_cli(["trainers/torchrun.py", "--config", "trainers/configs/tabular_mlp.yaml", *base(tmp),
                 "train.max_steps=4", "train.epochs=null", "train.eval_every_steps=4", "checkpoint.every_steps=2"],
                timeout=300)
    assert r.returncode == 0, r.stderr
    assert (tmp / "runs" / "tabular_mlp" / "summary.json").exists()
    (tmp / "notes").mkdir()
    (tmp / "notes" / "todo.txt").write_text("not parquet")
    (tmp / "empty").mkdir()
    # Inputs that once raised tracebacks: a binary config, a sweep that is a list, a sweep stored at a URI.
    (tmp / "files").mkdir()
    (tmp / "files" / "binary.yaml").write_bytes(b"\xff\xfe\x00binary")
    (tmp / "files" / "sweep_list.yaml").write_text("sweep: [1, 2]\n")
    (tmp / "files" / "sweep_uri.yaml").write_text(
        "sweep: {name: s, base_config: trainers/configs/tabular_mlp.yaml, storage_path: 's3://bucket/x'}\n"
        "space: {optim.lr: {loguniform: [1.0e-4, 1.0e-2]}}\n")
    # Issue 27: hostile YAML, a symlink loop, a task module that exits at import, a run folder naming a planted
    # module, a copy of the data with damaged pages.
    (tmp / "files" / "duplicate.yaml").write_text("train:\n  max_steps: 10\n  max_steps: 20\n")
    bomb = ", ".join(["&l0 [lol]"] + [f"&l{i} [{', '.join([f'*l{i - 1}'] * 9)}]" for i in range(1, 10)])
    (tmp / "files" / "bomb.yaml").write_text(f"init:\n  include: [{bomb}]\n")
    small = ", ".join(["&l0 [lol]"] + [f"&l{i} [{', '.join([f'*l{i - 1}'] * 9)}]" for i in range(1, 6)])
    (tmp / "files" / "small_bomb.yaml").write_text(f"init:\n  include: [{small}]\n")
    (tmp / "loop").mkdir()
    (tmp / "loop" / "a").symlink_to(tmp / "loop" / "b")
    (tmp / "loop" / "b").symlink_to(tmp / "loop" / "a")
    (tmp / "tasks").mkdir()
    (tmp / "tasks" / "exits_at_import.py").write_text("import sys\nsys.exit(0)\n")
    plant_bad_data(tmp)
    planted = tmp / "runs" / "planted"
    planted.mkdir()
    summary = json.loads((tmp / "runs" / "tabular_mlp" / "summary.json").read_text())
    summary["config"]["model"]["name"] = "planted:Task"
    (planted / "summary.json").write_text(json.dumps(summary))
    (tmp / "runs" / "planted.py").write_text(f"open({str(tmp / 'pwned')!r}, 'w').write('ran')\n")
    (tmp / "predicted-damaged").mkdir()
    (tmp / "predicted-damaged" / ".stride-predict.json").write_text('{"run": "/r", "checkp')
    (tmp / "predicted-damaged" / "part-000000.parquet").write_text("a part")
    shutil.copytree(tmp / "data", tmp / "damaged")
    corrupt_pages(tmp / "damaged" / "train" / "part-0000.parquet")
    plant_hostile_runs(tmp)
    return tmp


def plant_bad_data(tmp: Path) -> None:
    """Issue 42: a damaged CSV cell, a CSV file whose column is text beside one of numbers, a 2 GiB line (a sparse file
    outside the watched folder: the digests would read it after every case), manifests outside data.file_root."""
    import wave

    import pyarrow as pa
    import pyarrow.csv as pacsv
    import pyarrow.parquet as pq

    table = pq.read_table(tmp / "data" / "train").drop_columns(["sample_id"])
    pacsv.write_csv(table, tmp / "files" / "damaged_cell.csv")
    text = (tmp / "files" / "damaged_cell.csv").read_text().splitlines()
    cells = text[1500].split(",")
    cells[table.column_names.index("f7")] = "0.1.2"
    text[1500] = ",".join(cells)
    (tmp / "files" / "damaged_cell.csv").write_text("\n".join(text) + "\n")  # line 1501 holds f7 = 0.1.2
    (tmp / "files" / "csv_mixed").mkdir()
    pacsv.write_csv(table.slice(0, 100), tmp / "files" / "csv_mixed" / "a.csv")
    words = table.slice(100, 100).set_column(table.column_names.index("f7"), "f7", pa.array(["word"] * 100))
    pacsv.write_csv(words, tmp / "files" / "csv_mixed" / "b.csv")  # f7 all text here, numbers in a.csv
    huge = tmp.parent / "huge_line" / "train.jsonl"
    huge.parent.mkdir()
    huge.write_bytes(b'{"f0": 1.0, "label": 0}\n')
    os.truncate(huge, (2 << 30) + 100)  # sparse: line 2 is 2 GiB of zero bytes on no disk
    clips = tmp / "files" / "clips"
    clips.mkdir()
    with wave.open(str(clips / "a.wav"), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(8000)
        w.writeframes(b"\0\0" * 800)
    (clips / "link.wav").symlink_to(tmp / "notes" / "todo.txt")
    pq.write_table(pa.table({"path": ["a.wav", "../../notes/todo.txt"], "label": [0, 1], "duration": [0.1, 0.1]}),
                   clips / "dotdot.parquet")  # Parquet: no layout cache is written before the refusal
    pq.write_table(pa.table({"path": ["a.wav", "link.wav"], "label": [0, 1], "duration": [0.1, 0.1]}),
                   clips / "link.parquet")
    shutil.copy(REPO / "examples" / "audio_clips" / "clips_task.py", tmp / "tasks" / "clips_task.py")
    (tmp / "files" / "clips.yaml").write_text(
        "run: {name: clips}\nmodel: {name: clips_task:Clips}\n"
        "train: {batch_size_per_worker: 1, max_steps: 2, epochs: null}\nscaling: {num_workers: 1}\n")


@pytest.fixture(scope="module")
def full_disk(finished):
    """finished/full: a small tmpfs with no byte left, or the reason it cannot be mounted here (a str: the test
    calls services.unavailable with it, which fails under CI=true, where the suite runs as root)."""
    import subprocess

    where = finished / "full"
    where.mkdir()
    if os.geteuid() != 0:
        yield "mounting a small tmpfs (the full disk) needs root"
        return
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(where)], capture_output=True)
    if mounted.returncode != 0:
        yield f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}"
        return
    try:
        fd = os.open(where / "filler", os.O_WRONLY | os.O_CREAT)
        try:
            while os.write(fd, b"\0" * 4096):
                pass
        except OSError:  # ENOSPC: full
            pass
        finally:
            os.close(fd)
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


FULL_DISK = ["trainers/torchrun.py", "--config", "trainers/configs/tabular_mlp.yaml", "run.storage_path={tmp}/full/runs"]


@pytest.fixture(scope="module")
def results(finished, full_disk) -> dict[tuple, dict]:
    """Every case below run once (tests/forked_cli.py), keyed by its argv: each test checks its own."""
    (finished / "notes").chmod(0o755)  # a folder others can read: never a state folder
    (finished / "empty").chmod(0o777)
    before = digest(finished)
    cases = ([main_argv(finished, o) for o, _ in MAIN_CASES] + [other_argv(finished, a) for a, _ in OTHER_CASES]
             + [hostile_argv(finished, c, a) for c, a, _ in HOSTILE_CASES]
             + ([other_argv(finished, FULL_DISK)] if isinstance(full_disk, Path) else []))
    spec, out = finished.parent / "cases.json", finished.parent / "results.json"
    spec.write_text(json.dumps(cases))
    with _beating(finished.glob("hostile/*/runs/tabular_mlp/stride.lock")):
        r = run_cli(["tests/forked_cli.py", str(spec), str(out), str(finished)], timeout=1200,
                    env={"PYTHONPATH": str(finished / "tasks")})
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(out.read_text())
    assert len(got) == len(cases)
    return {"before": before, **{tuple(c): g for c, g in zip(cases, got)}}


def base(tmp: Path) -> list[str]:
    return [f"data.train_path={tmp}/data/train", f"data.val_path={tmp}/data/val", f"run.storage_path={tmp}/runs",
            *OVERLAY]


def check(r: dict, names: str, before: dict) -> None:
    lines = r["stderr"].strip().splitlines()
    assert r["returncode"] == 2, (r["returncode"], r["stdout"][-1500:], r["stderr"][-1500:])
    assert "Traceback" not in r["stderr"] and len(lines) == 1, r["stderr"][-2000:]
    assert names in lines[0], lines[0]
    assert r["files"] == before, "a refused command changed files"


def main_argv(tmp: Path, overrides: list[str]) -> list[str]:
    return [*MAIN, *base(tmp), *[o.format(tmp=tmp) for o in overrides]]


@pytest.mark.parametrize("overrides, names", MAIN_CASES, ids=[" ".join(o)[:60] for o, _ in MAIN_CASES])
def test_trainers_main_refuses(finished, results, overrides, names):
    check(results[tuple(main_argv(finished, overrides))], names, results["before"])


OTHER_CASES = [
    (["trainers/main.py", "--config", "{tmp}/missing.yaml"], "missing.yaml"),
    (["trainers/main.py", "--config", "{tmp}/notes/todo.txt"], "todo.txt"),
    (["trainers/main.py", "--config", "{tmp}/files/binary.yaml"], "is not a text file (byte 0 is not UTF-8)"),
    (["tune/main.py", "--config", "{tmp}/files/binary.yaml", "--print-space"], "is not a text file"),
    (["tune/main.py", "--config", "{tmp}/files/sweep_list.yaml", "--print-space"], "sweep must map setting: value"),
    (["tune/main.py", "--config", "{tmp}/files/sweep_uri.yaml", "--print-space"],
     "sweep.storage_path (s3://bucket/x) is a bucket, where MLflow's default store"),
    (["trainers/torchrun.py", "--config", "trainers/configs/tabular_mlp.yaml", "optim.lr=0"], "optim.lr"),
    (["trainers/torchrun.py", "--config", "trainers/configs/tabular_mlp.yaml", "data.train_path={tmp}/missing"],
     "data.train_path"),
    (["datasets/prepare.py", "tabular", "--out", "{tmp}/data", "--rows", "100"], "--out"),
    (["datasets/prepare.py", "tabular", "--out", "{tmp}/notes", "--rows", "100", "--force"], "--out"),
    (["datasets/prepare.py", "text", "--input", "{tmp}/missing", "--out", "{tmp}/t"], "--input"),
    (["datasets/prepare.py", "text", "--input", "{tmp}/notes", "--out", "{tmp}/t", "--tokenizer", "bpe",
      "--vocab-size", "100"], "--vocab-size"),
    (["-m", "stride.ray_cluster.local", "status", "--temp-dir", "{tmp}/notes"], "state folder"),
    (["-m", "stride.ray_cluster.local", "stop", "--temp-dir", "{tmp}/empty"], "state folder"),
    (["ray_cluster/node.py", "stop", "{tmp}/notes"], "state folder"),
    (["-m", "stride.tune.main", "--config", "{tmp}/missing.yaml", "--print-space"], "missing.yaml"),
    (["-m", "stride.ray_cluster.doctor", "--num-workers", "0"], "--num-workers"),
    (["-m", "stride.ray_cluster.doctor", "--use-gpu", "maybe"], "--use-gpu"),
    (["-m", "stride.ray_cluster.doctor", "--cpus-per-worker", "-1"], "--cpus-per-worker"),
    (["-m", "stride.ray_cluster.doctor", "--address", "127.0.0.1:1"], "--address (127.0.0.1:1)"),
    # Longer than local.MAX_TEMP_DIR_CHARS whatever pytest's temp folder is called (a short one would start a head).
    (["-m", "stride.ray_cluster.local", "start", "--temp-dir", "{tmp}/a-folder-name-too-long-for-ray-sockets"],
     "--temp-dir"),
    (["-m", "stride", "export", "{tmp}/missing", "{tmp}/m.safetensors"], "checkpoint ({tmp}/missing)"),
    (["-m", "stride", "export", "{tmp}/empty", "{tmp}/m.safetensors"], "checkpoint ({tmp}/empty)"),
    (["-m", "stride", "export", "{tmp}/runs/tabular_mlp", "{tmp}/data/train/part-0000.parquet"], "--force"),
    (["-m", "stride", "export", "{tmp}/runs/tabular_mlp", "{tmp}/missing/m.safetensors"], "does not exist"),
    # Issue 27: hostile YAML files, code a run folder names, export to a folder or where it cannot write, and
    # argparse's usage errors, one line each.
    (["trainers/main.py", "--config", "{tmp}/files/duplicate.yaml"], "key 'max_steps' appears twice in one mapping"),
    (["trainers/main.py", "--config", "{tmp}/files/bomb.yaml"], "aliases expand to more than 1000000 values"),
    (["trainers/main.py", "--config", "{tmp}/files/small_bomb.yaml"], "characters)) must be a valid string"),
    (["-m", "stride", "generate", "--run", "{tmp}/runs/planted"], "names model.name (planted:Task), a module of your own"),
    (["-m", "stride", "generate", "--run", "{tmp}/runs/planted", "--task", "other:Task"],
     "--task (other:Task) is not the task"),
    (["-m", "stride", "export", "{tmp}/runs/tabular_mlp", "{tmp}/notes"], "out ({tmp}/notes) is a folder"),
    (["-m", "stride", "export", "{tmp}/runs/tabular_mlp", "/proc/m.safetensors"], "out (/proc/m.safetensors)"),
    (["trainers/main.py", "--bogus"], "python trainers/main.py: error: unrecognized arguments: --bogus; see"),
    (["-m", "stride", "--bogus"], "unrecognized arguments: --bogus; see"),
    (["trainers/torchrun.py"], "the following arguments are required: --config; see"),
    (["-m", "stride", "generate", "--run"], "argument --run: expected one argument; see"),
    (["-m", "stride", "export"], "required: checkpoint, out; see"),
    (["tune/main.py", "--bogus"], "python tune/main.py: error: "),
    (["datasets/prepare.py", "tabular", "--rows", "many"], "argument --rows: invalid int value: 'many'; see"),
    (["-m", "stride.ray_cluster.doctor", "--bogus"], "unrecognized arguments: --bogus; see"),
    (["-m", "stride.ray_cluster.local", "restart"], "invalid choice: 'restart'"),
    (["ray_cluster/node.py", "restart"], "node.py: error: expected start|stop|status STATE_DIR"),
    # Issue 42: a manifest naming a file outside data.file_root, by ../ and by a planted link.
    (["trainers/torchrun.py", "--config", "{tmp}/files/clips.yaml", "data.train_path={tmp}/files/clips/dotdot.parquet",
      "data.val_path=null", "data.file_root={tmp}/files/clips"], "(column path, row 2 of"),
    (["trainers/torchrun.py", "--config", "{tmp}/files/clips.yaml", "data.train_path={tmp}/files/clips/link.parquet",
      "data.val_path=null", "data.file_root={tmp}/files/clips"], "is outside data.file_root"),
    # Issue 43: one YAML loader for configs, sweep files and cluster files (a key twice, an alias bomb).
    (["tune/main.py", "--config", "{tmp}/files/duplicate.yaml", "--print-space"], "key 'max_steps' appears twice"),
    (["tune/main.py", "--config", "{tmp}/files/bomb.yaml", "--print-space"], "aliases expand to more than 1000000"),
    (["-m", "stride.ray_cluster.updown", "down", "{tmp}/files/duplicate.yaml"], "key 'max_steps' appears twice"),
    (["-m", "stride.ray_cluster.updown", "up", "{tmp}/files/bomb.yaml"], "aliases expand to more than 1000000"),
    # Issue 42: predict's record of an earlier prediction in --out, damaged.
    (["-m", "stride", "predict", "--run", "{tmp}/runs/tabular_mlp", "--data", "{tmp}/data/val", "--out",
      "{tmp}/predicted-damaged"], "predicted-damaged): .stride-predict.json is not a record stride predict wrote"),
]


def other_argv(tmp: Path, argv: list[str]) -> list[str]:
    argv = [a.format(tmp=tmp) for a in argv]
    if "torchrun.py" in argv[0]:  # the case's override after the common ones, so that it wins
        argv = argv[:3] + base(tmp) + argv[3:]
    return argv


@pytest.mark.parametrize("argv, names", OTHER_CASES, ids=[" ".join(a[:3]) for a, _ in OTHER_CASES])
def test_other_commands_refuse(finished, results, argv, names):
    check(results[tuple(other_argv(finished, argv))], names.format(tmp=finished), results["before"])


def test_inputs_that_work_train(finished, tmp_path):
    """A config file that starts with a UTF-8 byte-order mark and names a Unicode run: trained, in a folder of that
    name (Ray's metric tags: tests/test_run_folder_code.py)."""
    config = tmp_path / "bom.yaml"
    config.write_bytes(b"\xef\xbb\xbf" + (REPO / "trainers/configs/tabular_mlp.yaml").read_bytes())
    storage = tmp_path / "runs"
    r = run_cli(["trainers/torchrun.py", "--config", str(config), *base(finished)[:2], f"run.storage_path={storage}",
                 "run.name=lauf-größe-日本",
                 *OVERLAY, "train.max_steps=2", "train.epochs=null", "train.eval_every_steps=2"], timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads((storage / "lauf-größe-日本" / "summary.json").read_text())["global_step"] == 2


# ---- run folders written by someone else: each case a copy of the finished run with one thing planted in it ----
# The attacker can write the whole folder, meta.json included, so planted files come with matching digests where
# that helps them: only the containment and type checks can catch them. Files outside every run (outside/) are in
# the watched folder, so a write through a link shows as a changed digest.

LAST = "checkpoint_00000004"


def _meta(ckpt: Path) -> dict:
    return json.loads((ckpt / "meta.json").read_text())


def _rehash(ckpt: Path, name: str) -> None:
    meta = _meta(ckpt)
    data = (ckpt / name).read_bytes()
    meta["files"][name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (ckpt / "meta.json").write_text(json.dumps(meta))


def _dcp_paths(new_path):
    """Point every storage item of the last checkpoint's .metadata at new_path(old) (the test's own file: a plain
    pickle round trip is fine here)."""
    def tamper(run: Path, outside: Path) -> None:
        import pickle

        ckpt = run / LAST
        md = pickle.loads((ckpt / ".metadata").read_bytes())
        for info in md.storage_data.values():
            info.relative_path = new_path(info.relative_path, outside)
        (ckpt / ".metadata").write_bytes(pickle.dumps(md))
        _rehash(ckpt, ".metadata")
    return tamper


def _replace(name: str, make):
    def tamper(run: Path, outside: Path) -> None:
        path = run / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)
        make(path, outside)
    return tamper


def _link(name: str, target: str):
    return _replace(name, lambda path, outside: path.symlink_to(target if target.startswith("/") else outside / target))


def _meta_fields(**fields):
    def tamper(run: Path, outside: Path) -> None:
        meta = _meta(run / LAST)
        meta.update({k: v(meta) if callable(v) else v for k, v in fields.items()})
        (run / LAST / "meta.json").write_text(json.dumps(meta))
    return tamper


def _truncate(name: str, keep: int, rehash: bool = False):
    def tamper(run: Path, outside: Path) -> None:
        (run / name).write_bytes((run / name).read_bytes()[:keep])
        if rehash:
            _rehash(run / LAST, Path(name).name)
    return tamper


def _torn_next_with_link(run: Path, outside: Path) -> None:
    """A torn folder of a step the resumed run writes again, holding a link to a file outside the run."""
    (run / "checkpoint_00000006").mkdir()
    (run / "checkpoint_00000006" / "__0_0.distcp").symlink_to(outside / "victim.txt")


def _summary_fields(**fields):
    def tamper(run: Path, outside: Path) -> None:
        summary = json.loads((run / "summary.json").read_text())
        summary.update({k: v(outside) if callable(v) else v for k, v in fields.items()})
        (run / "summary.json").write_text(json.dumps(summary))
    return tamper


def _summary_model(name: str):
    """summary.json's config names another task than its checkpoints hold (theirs: mlp)."""
    def tamper(run: Path, outside: Path) -> None:
        summary = json.loads((run / "summary.json").read_text())
        summary["config"]["model"] = {"name": name}
        (run / "summary.json").write_text(json.dumps(summary))
    return tamper


_BEST_OUTSIDE = _summary_fields(best_checkpoints=lambda outside: [
    {"checkpoint": str(outside / "other-checkpoint"), "step": 2, "val_loss": 1.0}])


TAMPER = {
    "shard-link": _link(f"{LAST}/__0_0.distcp", "shard-copy.distcp"),  # the same bytes: its digest matches
    "shard-fifo": _replace(f"{LAST}/__0_0.distcp", lambda path, outside: os.mkfifo(path)),
    "shard-dev-zero": _link(f"{LAST}/__0_0.distcp", "/dev/zero"),
    "shard-truncated": _truncate(f"{LAST}/__0_0.distcp", 100),
    "metadata-traversal": _dcp_paths(lambda p, outside: f"../checkpoint_00000002/{p}"),
    "metadata-absolute": _dcp_paths(lambda p, outside: str(outside / "shard-copy.distcp")),
    "metadata-truncated": _truncate(f"{LAST}/.metadata", 40, rehash=True),
    "meta-step-text": _meta_fields(step="4"),
    "meta-step-huge": _meta_fields(step=10 ** 30),
    "meta-files-list": _meta_fields(files=lambda m: sorted(m["files"])),
    "meta-files-traversal": _meta_fields(files=lambda m: {**m["files"], "../../../outside/victim.txt": {
        "bytes": 6, "sha256": hashlib.sha256(b"victim").hexdigest()}}),
    "meta-sha-not-hex": _meta_fields(files=lambda m: {**m["files"], "__0_0.distcp": {"bytes": 1, "sha256": "zz"}}),
    "meta-a-list": _replace(f"{LAST}/meta.json", lambda path, outside: path.write_text("[4]")),
    "meta-truncated": _truncate(f"{LAST}/meta.json", 20),
    "meta-link": _link(f"{LAST}/meta.json", "meta-copy.json"),
    "checkpoint-link": _link(LAST, "other-checkpoint"),
    "torn-next-with-link": _torn_next_with_link,
    "metrics-link": _link("metrics.jsonl", "victim.txt"),
    "summary-link": _link("summary.json", "summary-copy.json"),
    "stop-file-link": _link(".stride-stop", "victim.txt"),
    "profile-link": _link("profile", "profile-elsewhere"),
    "summary-status-number": _summary_fields(status=5),
    "summary-checkpoint-outside": _summary_fields(checkpoint=lambda outside: str(outside / "other-checkpoint")),
    "summary-config-list": _summary_fields(config=[1, 2]),
    "lock-held": lambda run, outside: _plant_live_lock(run),
    # Issue 42: links where the commands after training write (eval's results, Ray's records of a job).
    "eval-link": _link("eval", "eval-elsewhere"),
    "jobs-link": _link(".jobs", "jobs-elsewhere"),
    # Issue 42: export held to eval's checks (checkpoints inside the run, the run's task), tampered tensor items.
    "summary-best-outside": _BEST_OUTSIDE,
    "summary-best-outside-hf": _BEST_OUTSIDE,
    "summary-other-task": _summary_model("char_gpt"),
    "summary-other-task-run": _summary_model("char_gpt"),
    "summary-other-task-hf": _summary_model("char_gpt"),
    "task-other": lambda run, outside: None,
    "task-other-hf": lambda run, outside: None,
    "tensor-item-payload": tensor_item_payload,
    "tensor-item-on-bytes": tensor_item_on_bytes_item,
}


@contextmanager
def _beating(locks):
    """A live holder beats its lock (refreshes its mtime) every few seconds: so does this test for the locks it
    planted, while the cases run, however long they take (a lock left standing for run.lock_stale_s is stale)."""
    locks, stop = list(locks), threading.Event()

    def beat():
        while not stop.wait(2.0):
            for lock in locks:
                os.utime(lock)

    thread = threading.Thread(target=beat, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def _plant_live_lock(run: Path) -> None:
    """Another run of this name, alive on this host (this test's own process) with a fresh heartbeat: the second
    sbatch of one config."""
    import socket

    from stride.trainers.run import lock as runlock

    (run / runlock.LOCK).write_text(json.dumps({
        "token": "0" * 32, "fence": 1, "host": socket.gethostname(), "pid": os.getpid(),
        "pid_start": runlock.process_start(os.getpid()), "started": 0, "instance": None}))


def plant_hostile_runs(tmp: Path) -> None:
    """tmp/hostile/<case>/runs/tabular_mlp: the finished run with TAMPER[case] applied; tmp/outside: the files the
    planted links point at."""
    run, outside = tmp / "runs" / "tabular_mlp", tmp / "outside"
    outside.mkdir()
    (outside / "victim.txt").write_text("victim")
    (outside / "profile-elsewhere").mkdir()
    shutil.copy(run / LAST / "__0_0.distcp", outside / "shard-copy.distcp")
    shutil.copy(run / LAST / "meta.json", outside / "meta-copy.json")
    shutil.copy(run / "summary.json", outside / "summary-copy.json")
    shutil.copytree(run / "checkpoint_00000002", outside / "other-checkpoint")
    (outside / "eval-elsewhere").mkdir()  # what eval would replace through a planted eval link
    (outside / "eval-elsewhere" / f"{LAST}.json").write_text("victim")
    (outside / "jobs-elsewhere" / f"eval-{LAST}").mkdir(parents=True)  # what a job once removed through .jobs
    (outside / "jobs-elsewhere" / f"eval-{LAST}" / "victim.txt").write_text("victim")
    for case, tamper in TAMPER.items():
        copy = tmp / "hostile" / case / "runs" / "tabular_mlp"
        shutil.copytree(run, copy, symlinks=True)
        summary = json.loads((copy / "summary.json").read_text())
        summary["checkpoint"] = str(copy / LAST)  # the copy's own, as if it had been trained there
        (copy / "summary.json").write_text(json.dumps(summary))
        tamper(copy, outside)


def _export(case: str) -> list[str]:
    return ["-m", "stride", "export", f"{{tmp}}/hostile/{case}/runs/tabular_mlp/{LAST}", f"{{tmp}}/{case}.safetensors"]


def _resume(launcher: str):
    def argv(case: str) -> list[str]:
        return [launcher, "--config", "trainers/configs/tabular_mlp.yaml", f"run.storage_path={{tmp}}/hostile/{case}/runs",
                "train.max_steps=6", "train.epochs=null", "checkpoint.every_steps=2"]
    return argv


def _export_run(*flags: str):
    def argv(case: str) -> list[str]:
        return ["-m", "stride", "export", "--run", f"{{tmp}}/hostile/{case}/runs/tabular_mlp", "--out",
                f"{{tmp}}/{case}.safetensors", *flags]
    return argv


def _eval(case: str) -> list[str]:
    return ["-m", "stride", "eval", "--run", f"{{tmp}}/hostile/{case}/runs/tabular_mlp"]


def _predict(case: str) -> list[str]:
    return ["-m", "stride", "predict", "--run", f"{{tmp}}/hostile/{case}/runs/tabular_mlp", "--data", "{tmp}/data/val",
            "--out", f"{{tmp}}/predicted-{case}"]


def _generate(case: str) -> list[str]:
    return ["-m", "stride", "generate", "--run", f"{{tmp}}/hostile/{case}/runs/tabular_mlp"]


# (case, command, what the error line must name): a checkpoint named explicitly is refused (exit 2); a link where
# a run writes is refused before it trains, by either launcher.
HOSTILE_CASES = (
    [(c, _export, n) for c, n in [
        ("shard-link", "__0_0.distcp is a symlink"), ("shard-fifo", "__0_0.distcp is a FIFO"),
        ("shard-dev-zero", "__0_0.distcp is a symlink"), ("shard-truncated", "__0_0.distcp does not match"),
        ("metadata-traversal", "../checkpoint_00000002/__0_0.distcp"), ("metadata-absolute", "shard-copy.distcp"),
        ("metadata-truncated", ".metadata"), ("meta-step-text", "step ('4')"), ("meta-step-huge", "step (10000"),
        ("meta-files-list", "files ("), ("meta-files-traversal", "../../../outside/victim.txt"),
        ("meta-sha-not-hex", "sha256 ('zz')"), ("meta-a-list", "meta.json"), ("meta-truncated", "meta.json"),
        ("meta-link", "meta.json is a symlink"), ("checkpoint-link", "is unusable (a symlink, not followed)")]]
    + [(c, _resume(launcher), n) for launcher in ("trainers/torchrun.py", "trainers/main.py") for c, n in [
        ("shard-link", "__0_0.distcp is a symlink"), ("meta-link", "meta.json is a symlink"),
        ("checkpoint-link", f"{LAST} is a symlink"), ("torn-next-with-link", "checkpoint_00000006/__0_0.distcp is a symlink"),
        ("metrics-link", "metrics.jsonl is a symlink"), ("summary-link", "summary.json is a symlink"),
        ("stop-file-link", ".stride-stop is a symlink"), ("profile-link", "profile is a symlink"),
        ("lock-held", "is in use by another run")]]
    + [(c, _generate, n) for c, n in [
        ("summary-link", "summary.json"), ("summary-status-number", "status (5)"),
        ("summary-checkpoint-outside", "other-checkpoint"), ("summary-config-list", "config ([1, 2])"),
        ("shard-fifo", "__0_0.distcp is a FIFO"), ("metadata-traversal", "../checkpoint_00000002/__0_0.distcp")]]
    + [("eval-link", _eval, "tabular_mlp/eval is a symlink"), ("jobs-link", _eval, "tabular_mlp/.jobs is a symlink"),
       ("jobs-link", _predict, "tabular_mlp/.jobs is a symlink")]
    + [("summary-best-outside", _export_run("--checkpoint", "best"), "/outside/other-checkpoint) lies outside --run"),
       ("summary-best-outside-hf", _export_run("--checkpoint", "best", "--format", "hf"),
        "/outside/other-checkpoint) lies outside --run"),
       ("summary-other-task", _export, "holds model.name mlp, not the run's char_gpt"),
       ("summary-other-task-run", _export_run(), "holds model.name mlp, not the run's char_gpt"),
       ("summary-other-task-hf", _export_run("--format", "hf"), "holds model.name mlp, not the run's char_gpt"),
       ("task-other", _export_run("--task", "other:Task"), "--task (other:Task) is not the task"),
       ("task-other-hf", _export_run("--task", "other:Task", "--format", "hf"), "--task (other:Task) is not the task"),
       ("tensor-item-payload", _export,
        "__0_0.distcp holds more than tensors (model.net.0.weight: Trying to load unsupported GLOBAL posix.system"),
       ("tensor-item-payload", _generate,
        "__0_0.distcp holds more than tensors (model.net.0.weight: Trying to load unsupported GLOBAL posix.system"),
       ("tensor-item-on-bytes", _export,
        "places tensor model.net.0.weight on bytes of __0_0.distcp that hold a float, not a tensor")]
)


def command_name(argv: list[str]) -> str:
    """`stride export` for ["-m", "stride", "export", ...], `torchrun` for ["trainers/torchrun.py", ...]."""
    return argv[2] if argv[:2] == ["-m", "stride"] else Path(argv[0]).stem


def hostile_argv(tmp: Path, case: str, command) -> list[str]:
    argv = [a.format(tmp=tmp) for a in command(case)]
    if argv[0] in ("trainers/torchrun.py", "trainers/main.py"):  # the common overrides first, the case's last
        argv = argv[:3] + base(tmp) + argv[3:]
    return argv


@pytest.mark.parametrize("case, command, names", HOSTILE_CASES,
                         ids=[f"{command_name(cmd(c))}-{c}" for c, cmd, _ in HOSTILE_CASES])
def test_run_folders_written_by_someone_else_are_refused(finished, results, case, command, names):
    r = results[tuple(hostile_argv(finished, case, command))]
    check(r, names, results["before"])
    assert not (finished / f"{case}.safetensors").exists()


def test_a_full_disk_is_refused_before_training(finished, full_disk, results):
    """run.storage_path on a disk with no space left: one line naming it, and nothing else written."""
    if not isinstance(full_disk, Path):
        unavailable(full_disk)
    check(results[tuple(other_argv(finished, FULL_DISK))], "run.storage_path", results["before"])
    assert "No space left on device" in results[tuple(other_argv(finished, FULL_DISK))]["stderr"]


def test_the_sweep_covers_at_least_150_distinct_inputs():
    assert len({tuple(o) for o, _ in MAIN_CASES}) + len({tuple(a) for a, _ in OTHER_CASES}) + len(
        {(c, command_name(cmd(c))) for c, cmd, _ in HOSTILE_CASES}) + 1 >= 150  # + the full disk


# ---- Issue 42: no command imports a module planted in the working directory, however it is started ----
# Each command is given a mistake it refuses (exit 2, one line) after its imports, from a folder holding modules
# named like what every command imports; a planted module, once imported, leaves a mark and ends the process.

PLANTED = ("argparse", "numpy", "yaml", "torch")
COMMANDS = {
    "train": ["--config", "{tmp}/missing.yaml"],
    "eval": ["--run", "{tmp}/runs/tabular_mlp", "--data", "{tmp}/missing"],
    "predict": ["--run", "{tmp}/runs/tabular_mlp", "--data", "{tmp}/missing", "--out", "{tmp}/predicted-planted"],
    "export": ["--run", "{tmp}/runs/tabular_mlp", "--out", "{tmp}/notes"],
    "generate": ["--run", "{tmp}/missing"],
    "sweep": ["--config", "{tmp}/missing.yaml", "--print-space"],
    "doctor": ["--num-workers", "0"],
    "prepare": ["tabular", "--out", "{tmp}/data", "--rows", "100"],
}
SPELLINGS = {"stride": lambda: [str(Path(PYTHON).with_name("stride"))], "python -m stride": lambda: [PYTHON, "-m", "stride"]}


@pytest.fixture(scope="module")
def from_a_planted_folder(finished) -> dict[tuple[str, str], dict]:
    """Every command in both spellings, run from finished/planted (fresh interpreters: a forked one has its imports
    already), two at a time."""
    import subprocess
    from concurrent.futures import ThreadPoolExecutor

    planted = finished / "planted"
    planted.mkdir(exist_ok=True)
    for name in PLANTED:
        (planted / f"{name}.py").write_text(
            f"open({str(finished.parent / f'pwned-{name}')!r}, 'w').write('ran')\nraise SystemExit('planted {name}')\n")
    before = digest(finished)
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "PYTHONPATH")}

    def one(key):
        spelling, command = key
        argv = [*SPELLINGS[spelling](), command, *[a.format(tmp=finished) for a in COMMANDS[command]]]
        r = subprocess.run(argv, cwd=planted, env=env, capture_output=True, text=True, timeout=300)
        return {"returncode": r.returncode, "stdout": r.stdout, "stderr": r.stderr}

    keys = [(s, c) for s in SPELLINGS for c in COMMANDS]
    with ThreadPoolExecutor(2) as pool:
        got = dict(zip(keys, pool.map(one, keys)))
    after = digest(finished)
    return {k: {**r, "files": after} for k, r in got.items()} | {"before": before}


@pytest.mark.parametrize("spelling", SPELLINGS)
@pytest.mark.parametrize("command", COMMANDS)
def test_no_command_imports_a_module_from_the_working_directory(finished, from_a_planted_folder, spelling, command):
    check(from_a_planted_folder[(spelling, command)], "error", from_a_planted_folder["before"])
    assert not list(finished.parent.glob("pwned-*")), "a planted module was imported"
