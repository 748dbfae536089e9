"""export --format hf and --dtype (trainers/commands/export.py): a real checkpoint of the hf_causal_lm example (4 steps, one
process, no Ray) becomes a transformers folder that `from_pretrained` loads with the checkpoint's logits; bf16 halves
the bytes; what a user can fix is refused in one line, exit 2, with nothing written.

export.py imports the example's task in a subprocess, as a user runs it (--task, the module on PYTHONPATH or in the
working directory, as eval and predict find it). This process imports it from its file under a name of its own, never
through sys.path, so nothing of a tmp folder stays importable here.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
from pathlib import Path

import pytest

from conftest import REPO, run_cli_forked
from runs import OVERLAY
from test_examples import check, example, train

import torch
import transformers  # noqa: F401 - the test extra installs it: its absence is a failure, not a skip
from safetensors import safe_open

from stride.trainers.commands import export
from stride.trainers.run import checkpointing

EXPORT = ["-m", "stride", "export"]
TASK = "hf_lm_task:HFCausalLM"
STEPS = 4


@pytest.fixture(scope="module")
def lm(tmp_path_factory) -> Path:
    """The hf_causal_lm example's folder after a 4-step run in one process (small data, a 300-token tokenizer)."""
    folder = example("hf_causal_lm", tmp_path_factory.mktemp("lm"), "--max-chars", "100000", "--vocab-size", "300")
    s = train(folder, f"train.max_steps={STEPS}", f"train.eval_every_steps={STEPS}", "train.log_every_steps=2",
              f"checkpoint.every_steps={STEPS}", "train.batch_size_per_worker=8", "scaling.num_workers=1")
    assert s["status"] == "completed" and s["global_step"] == STEPS
    return folder


def train_mlp(data: Path, storage: Path, *overrides: str) -> Path:
    from stride.trainers.launch.torchrun import main as torchrun_main

    assert torchrun_main(["--config", str(REPO / "trainers/configs/tabular_mlp.yaml"), f"data.train_path={data}/train",
                          f"data.val_path={data}/val", f"run.storage_path={storage}", "run.name=mlp",
                          "train.epochs=null", "checkpoint.every_steps=2", *OVERLAY, *overrides]) == 0
    return storage / "mlp"


@pytest.fixture(scope="module")
def mlp(tabular_data, tmp_path_factory) -> Path:
    """A 2-step run of the built-in mlp task (no hf_model), without checkpoint.keep_best."""
    return train_mlp(tabular_data, tmp_path_factory.mktemp("mlp"), "train.max_steps=2")


@pytest.fixture(scope="module")
def torn(mlp, tmp_path_factory) -> Path:
    """A copy of the mlp run whose only checkpoint no longer verifies (a byte of its shard changed)."""
    run = tmp_path_factory.mktemp("torn") / "mlp"
    shutil.copytree(mlp, run)
    shard = next(run.glob("checkpoint_*/__0_0.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    return run


def export_cli(folder: Path, *args, from_folder: bool = False) -> dict:
    """export.py with the example's folder on PYTHONPATH, or (`from_folder`) run in that folder with no PYTHONPATH (a
    forked child); its JSON line."""
    if from_folder:
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        r = run_cli_forked([*EXPORT, *map(str, args)], env=env, cwd=folder, inherit_env=False, timeout=300)
    else:
        r = run_cli_forked([*EXPORT, *map(str, args)], env={"PYTHONPATH": str(folder)}, timeout=300)
    check(r, "export.py")
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def fp32_folder(lm, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("fp32") / "gpt2"
    info = export_cli(lm, "--run", lm / "runs" / "hf_causal_lm", "--out", out, "--format", "hf", "--task", TASK)
    assert info["format"] == "hf" and info["dtype"] == "fp32" and info["step"] == STEPS, info
    assert sorted(p.name for p in out.parent.iterdir()) == ["gpt2"]  # no temporary folder left beside it
    return out


def trained_model(folder: Path):
    """The example's model (task.build_model) with the run's last checkpoint loaded, the task imported from its file."""
    spec = importlib.util.spec_from_file_location(f"_stride_test_hf_lm_task_{abs(hash(folder))}",
                                                  folder / "hf_lm_task.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    summary = json.loads((folder / "runs" / "hf_causal_lm" / "summary.json").read_text())
    cls = module.HFCausalLM
    task = cls(cls.Config(**summary["config"]["model"]), None, summary["facts"])
    model = task.build_model()
    ckpt = checkpointing.newest_complete(folder / "runs" / "hf_causal_lm")
    model.load_state_dict(checkpointing.load_model_state(ckpt))
    return model.eval(), ckpt


def token_ids(model) -> torch.Tensor:
    return torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))


@torch.no_grad()
def test_hf_folder_loads_with_from_pretrained_and_gives_the_checkpoints_logits(lm, fp32_folder):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(fp32_folder).eval()
    model, _ = trained_model(lm)
    ids = token_ids(model)
    assert hf.dtype == torch.float32
    # build_model's weights are random: equal logits mean the checkpoint's weights went into the folder
    torch.testing.assert_close(hf(input_ids=ids).logits, model(input_ids=ids).logits)


@torch.no_grad()
def test_bf16_replaces_an_earlier_export_with_half_the_bytes(lm, fp32_folder, tmp_path):
    from transformers import AutoModelForCausalLM

    model, ckpt = trained_model(lm)
    out = tmp_path / "gpt2"
    shutil.copytree(fp32_folder, out)  # an earlier export: what --force may replace
    # the positional form, naming the checkpoint folder, run in the example's folder: --task finds hf_lm_task.py in the
    # working directory, as eval and predict find a task, with no PYTHONPATH
    info = export_cli(lm, ckpt, out, "--format", "hf", "--dtype", "bf16", "--force", "--task", TASK, from_folder=True)
    assert info["dtype"] == "bf16" and sorted(p.name for p in tmp_path.iterdir()) == ["gpt2"], info
    ratio = (out / "model.safetensors").stat().st_size / (fp32_folder / "model.safetensors").stat().st_size
    assert 0.45 <= ratio <= 0.55, ratio
    hf = AutoModelForCausalLM.from_pretrained(out).eval()
    assert hf.dtype == torch.bfloat16
    ids = token_ids(model)
    torch.testing.assert_close(hf(input_ids=ids).logits.float(), model(input_ids=ids).logits, atol=0.1, rtol=0.05)


def test_safetensors_dtype_casts_floats_and_halves_the_file(lm, tmp_path, capsys):
    run = lm / "runs" / "hf_causal_lm"
    sizes = {}
    for dtype, form in [("fp32", ["--run", str(run), "--out"]), ("bf16", ["--run", str(run), "--out"]),
                        ("fp16", [str(run)])]:
        out = tmp_path / f"{dtype}.safetensors"
        assert export.main([*form, str(out), "--dtype", dtype]) == 0, capsys.readouterr().err
        with safe_open(str(out), "pt") as f:
            assert f.metadata()["dtype"] == dtype
            assert {f.get_tensor(k).dtype for k in f.keys()} == {getattr(torch, export.DTYPES[dtype])}
        sizes[dtype] = out.stat().st_size
    assert all(0.45 <= sizes[half] / sizes["fp32"] <= 0.55 for half in ("bf16", "fp16")), sizes


def test_checkpoint_best_is_the_best_kept_one_and_last_the_newest(tabular_data, tmp_path):
    run = train_mlp(tabular_data, tmp_path, "train.max_steps=6", "train.eval_every_steps=2", "checkpoint.keep_last=1",
                    "checkpoint.keep_best={metric: val_loss, mode: max, k: 1}")  # max: the worst, never the last
    best = json.loads((run / "summary.json").read_text())["best_checkpoints"][0]["step"]
    assert best != 6
    for which, step in [("best", best), ("last", 6)]:
        out = tmp_path / f"{which}.safetensors"
        assert export.main(["--run", str(run), "--out", str(out), "--checkpoint", which]) == 0
        with safe_open(str(out), "pt") as f:
            assert f.metadata()["step"] == str(step)


class FakePretrained:
    """save_pretrained that writes a model file, then fails as a full disk does (`fail`) or finishes."""

    def __init__(self, fail: bool):
        self.fail = fail

    def save_pretrained(self, folder, safe_serialization):
        (Path(folder) / "model.safetensors").write_bytes(b"new")
        if self.fail:
            raise OSError(28, "No space left on device")
        (Path(folder) / "config.json").write_text("{}")


def test_a_failed_write_leaves_the_earlier_export_and_nothing_half_written(tmp_path):
    out = tmp_path / "gpt2"
    out.mkdir()
    (out / "config.json").write_text('{"earlier": true}')
    (out / "model.safetensors").write_bytes(b"earlier")
    with pytest.raises(export.ExportError, match=r"out \(.*gpt2\) could not be written \(.*No space left on device"):
        export.write_folder(FakePretrained(fail=True), out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gpt2"]
    assert (out / "model.safetensors").read_bytes() == b"earlier"
    export.write_folder(FakePretrained(fail=False), out)  # and a write that finishes replaces it whole
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gpt2"]
    assert {p.name: p.read_bytes() for p in out.iterdir()} == {"model.safetensors": b"new", "config.json": b"{}"}


def test_cast_leaves_integer_tensors_as_they_are():
    cast = export.cast({"w": torch.ones(3), "steps": torch.arange(3)}, "bf16")
    assert cast["w"].dtype == torch.bfloat16 and cast["steps"].dtype == torch.int64


# ---- refused: exit 2, one line, nothing written ----

REFUSED = [
    (["--run", "{mlp}", "--out", "{tmp}/hf", "--format", "hf"],
     "the task mlp has no Hugging Face form; implement Task.hf_model, or export --format safetensors"),
    (["--run", "{lm}", "--out", "{tmp}/hf", "--format", "hf"], "a module of your own that importing would run"),
    (["--run", "{mlp}", "--out", "{tmp}/exists.safetensors"], "exists; pass another path, or --force"),
    (["--run", "{mlp}", "--out", "{tmp}/notes", "--format", "hf"], "out ({tmp}/notes) exists; pass another path"),
    (["--run", "{mlp}", "--out", "{tmp}/notes", "--format", "hf", "--force"], "is not an earlier Hugging Face export"),
    (["{mlp}", "{tmp}/exists.safetensors", "--format", "hf", "--force"], "is not an earlier Hugging Face export"),
    (["--run", "{tmp}/notes", "--out", "{tmp}/m.safetensors"], "--run ({tmp}/notes) has no summary.json"),
    (["--run", "{tmp}/notes", "--out", "{tmp}/hf", "--format", "hf"], "--run ({tmp}/notes) has no summary.json"),
    (["--run", "{torn}", "--out", "{tmp}/m.safetensors"], "--run ({torn}) is a run folder without a complete"),
    (["{torn_checkpoint}", "{tmp}/hf", "--format", "hf", "--dtype", "bf16"], "{torn_checkpoint}) is unusable"),
    (["--run", "{mlp}", "--out", "{tmp}/m.safetensors", "--checkpoint", "best"],
     "--checkpoint best: run folder ({mlp}) names no best checkpoint"),
    (["{mlp}", "{tmp}/hf", "--best", "--format", "hf"], "--best: run folder ({mlp}) names no best checkpoint"),
]


@pytest.mark.parametrize("argv, says", REFUSED, ids=[f"{i}-{says[:40]}" for i, (_, says) in enumerate(REFUSED)])
def test_refused_in_one_line_and_nothing_written(lm, mlp, torn, tmp_path, capsys, argv, says):
    (tmp_path / "exists.safetensors").write_bytes(b"someone's file")
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "notes.txt").write_text("not a model")
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    places = {"mlp": mlp, "lm": lm / "runs" / "hf_causal_lm", "torn": torn, "tmp": tmp_path,
              "torn_checkpoint": next(torn.glob("checkpoint_*"))}
    capsys.readouterr()
    assert export.main([a.format(**places) for a in argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("stride: error: ") and says.format(**places) in err[0], err
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before
    assert (tmp_path / "exists.safetensors").read_bytes() == b"someone's file"
    assert "hf_lm_task" not in sys.modules  # the run's own module: refused before any import


def test_a_task_without_hf_model_is_refused_by_the_command_without_a_traceback(mlp, tmp_path):
    r = run_cli_forked([*EXPORT, "--run", str(mlp), "--out", str(tmp_path / "hf"), "--format", "hf"], timeout=120)
    assert r.returncode == 2 and r.stdout == "", r
    assert r.stderr.splitlines() == ["stride: error: --format hf: the task mlp has no Hugging Face form; implement "
                                     "Task.hf_model, or export --format safetensors"], r.stderr
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize("argv, says", [
    (["{mlp}", "out", "--run", "{mlp}", "--out", "x"], "pass either CHECKPOINT OUT or --run DIR --out PATH"),
    (["--run", "{mlp}"], "--run needs --out PATH"),
    (["--run", "{mlp}", "--out", "x", "--best"], "with --run pass --checkpoint best"),
    (["{mlp}", "out", "--checkpoint", "best"], "--checkpoint goes with --run DIR"),
    (["--run", "{mlp}", "--out", "x", "--format", "hf", "--trainable-only"], "drop it for --format hf"),
    (["--run", "{mlp}", "--out", "x", "--dtype", "int8"], "argument --dtype: invalid choice: 'int8'"),
    ([], "the following arguments are required: checkpoint, out"),
])
def test_usage_mistakes_are_one_line_under_the_callers_name(mlp, capsys, argv, says):
    with pytest.raises(SystemExit) as e:
        export.main([a.format(mlp=mlp) for a in argv], prog="stride export")
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1, err
    assert err[0].startswith("stride export: error: ") and says in err[0] and err[0].endswith(
        "; see stride export --help"), err
