"""Bad input, as a whole: every entry below is a distinct mistake a user can make with one of Stride's commands. Each
must exit 2 with one line on stderr that names the key (or file or flag) and says what to do, with no traceback,
and leave every file that was there (data, a finished run's checkpoints, metrics and summary) byte for byte as it
was. The commands run against a folder holding a finished run of the same name, so a mistake that wrote anything
would show in the hashes. They run through tests/forked_cli.py: each in its own process, as `python <script>` runs
it, forked after the imports they share (two seconds of imports, a hundred times, were most of this file's time)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import run_cli
from forked_cli import digest

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
    (["data.label_column=nope"], "data.label_column"), (["data.feature_columns=[nope]"], "data.feature_columns"),
    (["data.nan_policy=maybe"], "data.nan_policy"), (["data.standardize=maybe"], "data.standardize"),
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
    (["tracking.mlflow=maybe"], "tracking.mlflow"), (["trian.max_steps=1"], "trian"), (["lr=0.1"], "section.field=value"),
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
    return tmp


@pytest.fixture(scope="module")
def results(finished) -> dict[tuple, dict]:
    """Every case below run once (tests/forked_cli.py), keyed by its argv: each test checks its own."""
    (finished / "notes").chmod(0o755)  # a folder others can read: never a state folder
    (finished / "empty").chmod(0o777)
    before = digest(finished)
    cases = [main_argv(finished, o) for o, _ in MAIN_CASES] + [other_argv(finished, a) for a, _ in OTHER_CASES]
    spec, out = finished.parent / "cases.json", finished.parent / "results.json"
    spec.write_text(json.dumps(cases))
    r = run_cli(["tests/forked_cli.py", str(spec), str(out), str(finished)], timeout=1200)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(out.read_text())
    assert len(got) == len(cases)
    return {"before": before, **{tuple(c): g for c, g in zip(cases, got)}}


def base(tmp: Path) -> list[str]:
    return [f"data.train_path={tmp}/data/train", f"data.val_path={tmp}/data/val", f"run.storage_path={tmp}/runs",
            "tracking.mlflow=false"]


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
     "sweep.storage_path ('s3://bucket/x') must be a folder"),
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
    (["trainers/export.py", "{tmp}/missing", "{tmp}/m.safetensors"], "checkpoint ({tmp}/missing)"),
    (["trainers/export.py", "{tmp}/empty", "{tmp}/m.safetensors"], "checkpoint ({tmp}/empty)"),
    (["trainers/export.py", "{tmp}/runs/tabular_mlp", "{tmp}/data/train/part-0000.parquet"], "--force"),
    (["trainers/export.py", "{tmp}/runs/tabular_mlp", "{tmp}/missing/m.safetensors"], "does not exist"),
]


def other_argv(tmp: Path, argv: list[str]) -> list[str]:
    argv = [a.format(tmp=tmp) for a in argv]
    if "torchrun.py" in argv[0]:  # the case's override after the common ones, so that it wins
        argv = argv[:3] + base(tmp) + argv[3:]
    return argv


@pytest.mark.parametrize("argv, names", OTHER_CASES, ids=[" ".join(a[:3]) for a, _ in OTHER_CASES])
def test_other_commands_refuse(finished, results, argv, names):
    check(results[tuple(other_argv(finished, argv))], names.format(tmp=finished), results["before"])


def test_the_sweep_covers_at_least_80_distinct_inputs():
    assert len({tuple(o) for o, _ in MAIN_CASES}) + len({tuple(a) for a, _ in OTHER_CASES}) >= 80
