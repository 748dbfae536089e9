"""export gets eval's checks on a run folder someone else could write (issue 42, findings 6, 8 and 10): a best
checkpoint that summary.json names outside the run, another task's checkpoint, and a checkpoint whose tensor items
point at a pickle payload are refused in one line (exit 2) with nothing written; on resume such a checkpoint is
skipped with a warning naming it and why, for the one before.

One tiny run (4 steps, checkpoints at 2 and 4, the best kept) is trained once; each case tampers a copy of it. The
tamper functions take (run, outside) as tests/test_bad_input_sweep.py's TAMPER entries do.
"""

from __future__ import annotations

import hashlib
import json
import pickle
import shutil
from pathlib import Path

import pytest

from conftest import REPO, run_cli
from runs import OVERLAY

from stride.errors import UsageError
from stride.trainers.commands import export
from stride.trainers.commands import trained
from stride.trainers.run import checkpointing

LAST = "checkpoint_00000004"
CONFIG = ["--config", str(REPO / "trainers/configs/tabular_mlp.yaml")]


def overrides(data: Path, storage: Path) -> list[str]:
    return [f"data.train_path={data}/train", f"data.val_path={data}/val", f"run.storage_path={storage}",
            *OVERLAY, "train.epochs=null", "train.eval_every_steps=2", "checkpoint.every_steps=2",
            "checkpoint.keep_best={k: 1}", "model.hidden_sizes=[8]", "scaling.num_workers=1"]


@pytest.fixture(scope="module")
def finished(tabular_data, tmp_path_factory) -> Path:
    """runs/tabular_mlp after 4 steps (checkpoints 2 and 4, best/checkpoint_00000004), and outside/ with a copy of its
    first checkpoint (what a planted summary points at)."""
    from stride.trainers.launch.torchrun import main as torchrun_main

    tmp = tmp_path_factory.mktemp("export_checks")
    assert torchrun_main([*CONFIG, *overrides(tabular_data, tmp / "runs"), "train.max_steps=4"]) == 0
    run = tmp / "runs" / "tabular_mlp"
    assert (run / LAST / "meta.json").exists() and (run / "best" / LAST).is_dir()
    (tmp / "outside").mkdir()
    shutil.copytree(run / "checkpoint_00000002", tmp / "outside" / "other-checkpoint")
    return tmp


def tampered(finished: Path, tmp_path: Path, tamper) -> Path:
    """A copy of the finished run (in tmp_path/runs/tabular_mlp) with `tamper` applied."""
    run = tmp_path / "runs" / "tabular_mlp"
    shutil.copytree(finished / "runs" / "tabular_mlp", run, symlinks=True)
    summary = json.loads((run / "summary.json").read_text())  # the copy's own, as if it had been trained there
    summary["checkpoint"] = str(run / LAST)
    summary["best_checkpoints"][0]["checkpoint"] = str(run / "best" / LAST)
    (run / "summary.json").write_text(json.dumps(summary))
    tamper(run, finished / "outside")
    return run


def refused(capsys, argv: list[str], says: str, out: Path) -> str:
    """export.main(argv): exit 2, one line on stderr naming `says`, nothing on stdout, `out` not written."""
    capsys.readouterr()
    assert export.main([str(a) for a in argv]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("stride: error: ") and says in lines[0], lines
    assert captured.out == "" and not out.exists() and not list(out.parent.glob(f".{out.name}*"))
    return lines[0]


# ---- tampering, as someone who can write the run folder does it ----

def best_outside(run: Path, outside: Path) -> None:
    """summary.json names a checkpoint outside the run as its best kept one."""
    summary = json.loads((run / "summary.json").read_text())
    summary["best_checkpoints"][0]["checkpoint"] = str(outside / "other-checkpoint")
    (run / "summary.json").write_text(json.dumps(summary))


def config_of_another_task(run: Path, outside: Path) -> None:
    """summary.json's config names another task than the one its checkpoints hold (theirs is mlp)."""
    summary = json.loads((run / "summary.json").read_text())
    summary["config"]["model"] = {"name": "char_gpt"}
    (run / "summary.json").write_text(json.dumps(summary))


def rehash(ckpt: Path, *names: str) -> None:
    """meta.json's digests made to match: whoever writes the files writes meta.json too."""
    meta = json.loads((ckpt / "meta.json").read_text())
    for name in names:
        data = (ckpt / name).read_bytes()
        meta["files"][name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (ckpt / "meta.json").write_text(json.dumps(meta))


def tensor_item_payload(run: Path, outside: Path) -> None:
    """The last checkpoint's first model tensor item pointed at a pickle payload appended to its shard: unpickled
    freely it would run `touch outside/pwned`. .metadata itself holds only DCP's classes (the allow-list passes it)."""
    ckpt = run / LAST
    payload = b"cposix\nsystem\n(V" + f"touch {outside / 'pwned'}".encode() + b"\ntR."
    shard = ckpt / "__0_0.distcp"
    offset = shard.stat().st_size
    shard.write_bytes(shard.read_bytes() + payload)
    metadata = pickle.loads((ckpt / ".metadata").read_bytes())  # the test's own file: a plain round trip is fine
    index = next(i for i in metadata.storage_data if i.fqn.startswith("model."))
    metadata.storage_data[index].offset, metadata.storage_data[index].length = offset, len(payload)
    (ckpt / ".metadata").write_bytes(pickle.dumps(metadata))
    rehash(ckpt, "__0_0.distcp", ".metadata")


def tensor_item_on_bytes_item(run: Path, outside: Path) -> None:
    """The last checkpoint's first model tensor item pointed at a bytes item's slice (the optimizer's lr, a pickled
    float): DCP would load it as the tensor."""
    ckpt = run / LAST
    metadata = pickle.loads((ckpt / ".metadata").read_bytes())
    lr = next(i for i in metadata.storage_data if i.fqn.endswith(".lr"))
    weight = next(i for i in metadata.storage_data if i.fqn.startswith("model."))
    metadata.storage_data[weight] = metadata.storage_data[lr]
    (ckpt / ".metadata").write_bytes(pickle.dumps(metadata))
    rehash(ckpt, ".metadata")


# ---- finding 6: export holds the run folder to eval's checks ----

@pytest.mark.parametrize("argv, says", [
    (["--run", "{run}", "--checkpoint", "best", "--out", "{out}"], "--checkpoint best: {run}/summary.json "
     "best_checkpoints[0].checkpoint ({outside}/other-checkpoint) lies outside --run ({run}); pass a checkpoint"),
    (["--run", "{run}", "--checkpoint", "best", "--out", "{out}", "--format", "hf"],
     "best_checkpoints[0].checkpoint ({outside}/other-checkpoint) lies outside --run ({run})"),
    (["{run}", "{out}", "--best"], "--best: {run}/summary.json best_checkpoints[0].checkpoint "
                                   "({outside}/other-checkpoint) lies outside run folder ({run})"),
], ids=["run-best", "run-best-hf", "best"])
def test_export_refuses_a_best_checkpoint_that_summary_names_outside_the_run(finished, tmp_path, capsys, argv, says):
    run = tampered(finished, tmp_path, best_outside)
    places = {"run": run, "out": tmp_path / "m.safetensors", "outside": finished / "outside"}
    refused(capsys, [a.format(**places) for a in argv], says.format(**places), places["out"])
    # eval takes the same check from the same place (trained.best_named)
    with pytest.raises(UsageError, match=r"lies outside --run"):
        trained.pick_checkpoint(run, json.loads((run / "summary.json").read_text()), "best")


@pytest.mark.parametrize("argv, tamper, says", [
    (["--run", "{run}", "--out", "{out}"], config_of_another_task,
     "checkpoint ({run}/checkpoint_00000004) holds model.name mlp, not the run's char_gpt; pass a checkpoint of this run"),
    (["--run", "{run}", "--out", "{out}", "--format", "hf"], config_of_another_task,
     "checkpoint ({run}/checkpoint_00000004) holds model.name mlp, not the run's char_gpt"),
    (["{run}/checkpoint_00000004", "{out}"], config_of_another_task,
     "checkpoint ({run}/checkpoint_00000004) holds model.name mlp, not the run's char_gpt"),
    (["--run", "{run}", "--out", "{out}", "--task", "other:Task"], lambda run, outside: None,
     "--task (other:Task) is not the task {run}/summary.json names, model.name (mlp)"),
], ids=["run", "run-hf", "checkpoint", "task"])
def test_export_refuses_another_tasks_checkpoint(finished, tmp_path, capsys, argv, tamper, says):
    run = tampered(finished, tmp_path, tamper)
    places = {"run": run, "out": tmp_path / "m.safetensors"}
    refused(capsys, [a.format(**places) for a in argv], says.format(**places), places["out"])


# ---- findings 8 and 10: a tensor item on a pickle payload makes its checkpoint unusable ----

@pytest.mark.parametrize("tamper, says", [
    (tensor_item_payload, "__0_0.distcp holds more than tensors (model.net.0.weight: Trying to load unsupported "
                          "GLOBAL posix.system"),
    (tensor_item_on_bytes_item, ".metadata places tensor model.net.0.weight on bytes of __0_0.distcp that hold a "
                                "float, not a tensor"),
], ids=["payload", "bytes-item"])
def test_export_refuses_a_checkpoint_whose_tensor_item_is_a_pickle(finished, tmp_path, capsys, tamper, says):
    run = tampered(finished, tmp_path, tamper)
    out = tmp_path / "m.safetensors"
    line = refused(capsys, [run / LAST, out], says, out)
    assert f"checkpoint ({run / LAST}) is unusable" in line
    assert not (finished / "outside" / "pwned").exists()


def test_a_resume_skips_a_checkpoint_whose_tensor_item_is_a_pickle_and_says_why(finished, tabular_data, tmp_path):
    run = tampered(finished, tmp_path, tensor_item_payload)
    r = run_cli(["trainers/torchrun.py", *CONFIG, *overrides(tabular_data, tmp_path / "runs"), "train.max_steps=6"],
                timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    warned = [ln for ln in (r.stdout + r.stderr).splitlines() if "is unusable" in ln]
    assert len(warned) == 1, warned
    assert (f"checkpoint {LAST} ({run / LAST}/__0_0.distcp holds more than tensors (model.net.0.weight: Trying to "
            f"load unsupported GLOBAL posix.system") in warned[0]
    assert "resuming from checkpoint_00000002 instead" in warned[0]
    assert f"resumed from {run / 'checkpoint_00000002'} at step 2" in r.stdout + r.stderr
    assert json.loads((run / "summary.json").read_text())["global_step"] == 6
    assert not (finished / "outside" / "pwned").exists()


def test_export_of_a_run_passes_over_a_tampered_newest_checkpoint_and_says_why(finished, tmp_path, capsys):
    """--run (last): the newest checkpoint that verifies, as a resume takes it, with the one passed over named."""
    run = tampered(finished, tmp_path, tensor_item_payload)
    out = tmp_path / "m.safetensors"
    capsys.readouterr()
    assert export.main(["--run", str(run), "--out", str(out)]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["checkpoint"] == str(run / "checkpoint_00000002") and out.exists()
    assert captured.err.splitlines() == [
        f"stride: warning: checkpoint {LAST} ({run / LAST}/__0_0.distcp holds more than tensors (model.net.0.weight: "
        f"Trying to load unsupported GLOBAL posix.system whose module posix is blocked.); it was not loaded. Move that "
        f"checkpoint folder away if you did not write it, or use another run.name) is unusable; exporting "
        f"checkpoint_00000002 instead"], captured.err
