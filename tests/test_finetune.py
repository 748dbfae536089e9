"""Fine-tuning a user's model (issue 23): a pretrained encoder loaded with init.include, frozen by optim.groups or
frozen until unfreeze_at_step, a group at a tenth of the learning rate, resumed across the unfreeze step; under
DDP and FSDP, with torchrun (one launch of every case: tests/torchrun_cases.py) and on Ray (the session's head).

The model is tests/user_project's SignalCNN (a task outside Stride's packages): `stem` and `blocks.*` are the
"encoder", `head` the rest. The pretrained encoder is a safetensors file of another seed's weights.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from conftest import PYTHON, read_jsonl, run_torchrun_cases
from runs import tiny

PROJECT = Path(__file__).resolve().parent / "user_project"
ENCODER = r"^(stem|blocks)\."
STEPS = 20
# Encoder from the pretrained file and frozen until step 10; head at 0.1x the lr. A constant schedule (after a warm-up
# of 3 steps) does not depend on train.max_steps, so a run cut at step k with max_steps=k and resumed with
# max_steps=20 is the uninterrupted run: what a SIGKILL after step k's checkpoint leaves to resume.
GROUPS = f"optim.groups=[{{match: '{ENCODER}', name: encoder, unfreeze_at_step: 10}}, {{match: '^head\\.', name: head, lr_scale: 0.1}}]"
FROZEN = f"optim.groups=[{{match: '{ENCODER}', name: encoder, freeze: true}}, {{match: '^head\\.', name: head, lr_scale: 0.1}}]"


def common(project: Path, storage: Path, encoder: Path) -> list[str]:
    return tiny(storage, project / "data", None, "train.log_every_steps=1", "train.eval_every_steps=100",
                "checkpoint.every_steps=5", "checkpoint.keep_last=10", "optim.schedule=constant", "optim.warmup_steps=3",
                "train.deterministic=true", f"init.from={encoder}", f"init.include=['{ENCODER}']", name=None,
                config=project / "signal.yaml")


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    dst = tmp_path_factory.mktemp("finetune") / "project"
    shutil.copytree(PROJECT, dst, ignore=shutil.ignore_patterns("__pycache__", "runs", "data"))
    subprocess.run([PYTHON, "make_data.py"], cwd=dst, check=True, capture_output=True, timeout=120)
    return dst


@pytest.fixture(scope="module")
def encoder(project) -> Path:
    """The 'pretrained' encoder: random weights of the shapes of signal.yaml's stem and 3 blocks, as safetensors."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(1234)
    shapes = {"stem.weight": (16, 1, 7), "stem.bias": (16,)}
    for i in range(3):
        shapes |= {f"blocks.{i}.conv.weight": (16, 16, 3), f"blocks.{i}.conv.bias": (16,)}
    save_file({k: torch.randn(shape, generator=g) * 0.2 for k, shape in shapes.items()},
              str(project / "encoder.safetensors"))
    return project / "encoder.safetensors"


@pytest.fixture(scope="module")
def runs(project, encoder, tmp_path_factory):
    storage = tmp_path_factory.mktemp("finetune_runs")
    base = common(project, storage, encoder)

    def case(label, name, steps, *extra):
        return {"label": label, "args": [*base, f"run.name={name}", f"train.max_steps={steps}", *extra]}

    cases = []
    for strategy in ("ddp", "fsdp"):
        s = f"train.strategy={strategy}"
        cases += [case(strategy, strategy, STEPS, GROUPS, s),
                  case(f"{strategy}@10", f"{strategy}_cut10", 10, GROUPS, s),
                  case(f"{strategy}@10->20", f"{strategy}_cut10", STEPS, GROUPS, s),
                  case(f"{strategy}@15", f"{strategy}_cut15", 15, GROUPS, s),
                  case(f"{strategy}@15->20", f"{strategy}_cut15", STEPS, GROUPS, s),
                  case(f"{strategy} frozen", f"{strategy}_frozen", 10, FROZEN, s)]
    r, _ = run_torchrun_cases(cases, tmp_path_factory.mktemp("finetune_cases"), project, {"PYTHONPATH": str(project)})
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    return {"storage": storage, "stdout": r.stdout}


def weights(run: Path, step: int) -> dict[str, torch.Tensor]:
    from stride.trainers.run import checkpointing

    return checkpointing.load_model_state(run / f"checkpoint_{step:08d}")


def summary(run: Path) -> dict:
    return json.loads((run / "summary.json").read_text())


def encoder_names(state: dict) -> list[str]:
    return [k for k in state if k.startswith(("stem", "blocks"))]


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_the_pretrained_encoder_is_loaded_and_stays_bitwise_frozen(runs, encoder, strategy):
    """init.from with init.include loads the encoder; freeze: true keeps it bitwise equal to the file through
    training (no gradient, no weight decay), while the head trains; summary.json records the source."""
    from safetensors.torch import load_file

    pretrained = load_file(str(encoder))
    run = runs["storage"] / f"{strategy}_frozen"
    final = weights(run, 10)
    assert sorted(encoder_names(final)) == sorted(pretrained)
    for name, tensor in pretrained.items():
        assert torch.equal(final[name], tensor), name
    first = weights(run, 5)
    assert not torch.equal(first["head.weight"], final["head.weight"])  # the rest trains
    s = summary(run)
    assert s["status"] == "completed" and s["strategy"] == strategy
    init = s["init"]
    assert init["from"] == str(encoder) and init["loaded"] == len(pretrained) and init["missing"] == 0
    assert len(init["sha256"]) == 64


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_unfreeze_at_step_freezes_before_and_trains_after(runs, encoder, strategy):
    from safetensors.torch import load_file

    pretrained = load_file(str(encoder))
    run = runs["storage"] / strategy
    for step in (5, 10):  # frozen for steps 1..10: exactly the file
        state = weights(run, step)
        assert all(torch.equal(state[n], pretrained[n]) for n in pretrained), step
    later = weights(run, 15)
    assert any(not torch.equal(later[n], pretrained[n]) for n in pretrained)  # step 11 on: it trains


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_each_groups_lr_is_logged_and_the_head_trains_at_a_tenth(runs, strategy):
    lines = [r for r in read_jsonl(runs["storage"] / strategy / "metrics.jsonl") if "lr" in r]
    assert [r["step"] for r in lines] == list(range(1, STEPS + 1))
    for r in lines:
        assert r["lr/head"] == pytest.approx(0.1 * r["lr"], rel=1e-12) and r["lr/default"] == r["lr"]
        # logged at step n: the lr of step n+1 (0-based index n). Frozen through index 9; then a warm-up of its own.
        expected = 0.0 if r["step"] < 10 else r["lr"] * min(1.0, (r["step"] - 10 + 1) / 3)
        assert r["lr/encoder"] == pytest.approx(expected, rel=1e-12), r["step"]


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
@pytest.mark.parametrize("cut", [10, 15])
def test_a_resume_across_the_unfreeze_step_is_bitwise_the_uninterrupted_run(runs, strategy, cut):
    """Cut at step 10 (the last frozen step: the encoder has no optimizer state yet) and at 15 (after): resumed to
    step 20, the weights and the validation loss equal the uninterrupted run's bitwise."""
    full, resumed = summary(runs["storage"] / strategy), summary(runs["storage"] / f"{strategy}_cut{cut}")
    assert resumed["restarts"] == 1 and resumed["global_step"] == STEPS
    assert resumed["param_checksums"] == full["param_checksums"] and resumed["val_loss"] == full["val_loss"]
    a, b = weights(runs["storage"] / strategy, STEPS), weights(runs["storage"] / f"{strategy}_cut{cut}", STEPS)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert resumed["init"] == full["init"]  # the record of the first start, not re-read


@pytest.mark.slow
def test_the_driver_prints_the_groups_and_the_init_table(runs):
    out = runs["stdout"]
    assert re.search(r"encoder +8 tensor\(s\) +2,480 parameters +lr x1 +frozen until step 10", out)
    assert re.search(r"head +2 tensor\(s\) +68 parameters +lr x0.1 +trained", out)
    assert re.search(r"init\.from .*encoder\.safetensors \(sha256 [0-9a-f]{12}, 2,480 parameters\)", out)
    assert re.search(r"loaded +8 +stem\.weight", out) and re.search(r"missing +0", out)


# ---- bad inputs: each exits 2 with one line before anything is written; the user's files stay as they were ----

class NotAStateDict:  # torch.save of an object: unpickling it would import and run this module's code
    def __init__(self):
        self.weights = torch.ones(2)


@pytest.fixture(scope="module")
def mlp_source(tabular_data, tmp_path_factory) -> dict:
    """A 2-step tabular MLP run and its weights exported to safetensors: a source that fits the model."""
    from safetensors.torch import load_file

    from stride.trainers.commands.export import export
    from stride.trainers.launch.torchrun import main as torchrun_main

    tmp = tmp_path_factory.mktemp("mlp_source")
    assert torchrun_main(mlp_args(tabular_data, tmp, "src", 2)) == 0
    export(tmp / "src", tmp / "mlp.safetensors")
    return {"dir": tmp, "file": tmp / "mlp.safetensors", "weights": load_file(str(tmp / "mlp.safetensors"))}


def mlp_args(data: Path, storage: Path, name: str, steps: int, *extra: str) -> list[str]:
    return tiny(storage, data, steps, "checkpoint.every_steps=2", *extra, name=name)


def refused(capsys, args: list[str]) -> str:
    from stride.trainers.launch.torchrun import main as torchrun_main

    capsys.readouterr()
    assert torchrun_main(args) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


def test_bad_init_and_groups_exit_2_in_one_line_and_touch_nothing(mlp_source, tabular_data, tmp_path, capsys):
    from safetensors.torch import save_file

    w = mlp_source["weights"]
    torch.save({"model": NotAStateDict()}, tmp_path / "pickled.pt")
    save_file({**w, "net.0.weight": torch.zeros(3, 3)}, str(tmp_path / "wrong_shape.safetensors"))
    save_file({k: v for k, v in w.items() if k.startswith("net.0.")}, str(tmp_path / "half.safetensors"))
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    cases = [
        ([f"init.from={tmp_path}/nope.safetensors"], ["init.from", "nope.safetensors", "does not exist"]),
        ([f"init.from={tmp_path}/pickled.pt"], ["init.from", "pickled.pt", "is not a plain state dict",
                                                  "NotAStateDict"]),
        ([f"init.from={tmp_path}/wrong_shape.safetensors"], ["init.from", "1 mismatched", "net.0.weight",
                                                             "init.strict=false"]),
        ([f"init.from={tmp_path}/half.safetensors"], ["init.from", "4 model tensors missing", "net.2.weight"]),
        ([f"init.from={mlp_source['file']}", "init.include=['^encoder']"], ["init.include", "^encoder",
                                                                            "matches none"]),
        (["optim.groups=[{match: '^encoder', freeze: true}]"], ["optim.groups[0].match", "'^encoder'",
                                                                "matches none", "fix the pattern"]),
        (["optim.groups=[{match: 'net', freeze: true}]"], ["optim.groups", "every trainable parameter is frozen"]),
        (["optim.groups=[{match: 'net', unfreeze_at_step: 5}]"], ["unfreeze_at_step (5) is beyond train.max_steps (4)"]),
        (["optim.name=torch.optim:NoSuchOptimizer"], ["optim.name", "NoSuchOptimizer"]),
        (["optim.kwargs={nope: 1}"], ["optim.kwargs", "nope"]),
    ]
    for i, (extra, says) in enumerate(cases):
        err = refused(capsys, mlp_args(tabular_data, tmp_path / "runs", f"bad{i}", 4, *extra))
        assert all(s in err for s in says), (extra, err)
        assert not (tmp_path / "runs" / f"bad{i}").exists()  # refused before the run folder was made
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()} == before


def test_a_trainable_only_run_saves_only_what_trains_and_refuses_a_changed_base(mlp_source, tabular_data, tmp_path,
                                                                                capsys):
    """checkpoint.trainable_only with the first two layers frozen: the checkpoints hold the last layer and its
    optimizer state only; a resume reads the base from init.from again and continues exactly; once the base file
    changes, a resume exits 2 in one line and the checkpoints stay as they were."""
    from safetensors.torch import load_file, save_file

    from stride.trainers.run import checkpointing
    from stride.trainers.launch.torchrun import main as torchrun_main

    base = tmp_path / "base.safetensors"
    shutil.copy(mlp_source["file"], base)
    extra = (f"init.from={base}", "optim.groups=[{match: '^net\\.[02]\\.', freeze: true}]",
             "checkpoint.trainable_only=true", "checkpoint.keep_last=5", "train.deterministic=true")
    runs = tmp_path / "runs"
    assert torchrun_main(mlp_args(tabular_data, runs, "full", 6, *extra)) == 0
    assert torchrun_main(mlp_args(tabular_data, runs, "cut", 4, *extra)) == 0
    shapes = checkpointing.saved_model_shapes(runs / "cut" / "checkpoint_00000004")
    assert sorted(shapes) == ["net.4.bias", "net.4.weight"]
    assert torchrun_main(mlp_args(tabular_data, runs, "cut", 6, *extra)) == 0  # resumed at 4: the base re-read
    full, cut = (json.loads((runs / n / "summary.json").read_text()) for n in ("full", "cut"))
    assert cut["restarts"] == 1 and cut["param_checksums"] == full["param_checksums"]
    w = load_file(str(base))
    save_file({**w, "net.0.bias": w["net.0.bias"] + 1}, str(base))
    kept = {p: p.read_bytes() for p in (runs / "cut").rglob("*") if p.is_file()}
    err = refused(capsys, mlp_args(tabular_data, runs, "cut", 8, *extra))
    assert "init.from" in err and "checkpoint.trainable_only" in err and "sha256" in err
    assert {p: p.read_bytes() for p in (runs / "cut").rglob("*") if p.is_file()} == kept


# ---- on Ray: the same freeze, unfreeze and lr scale through Ray Train's DDP (prepare_model rebuilt at step 10) ----

@pytest.mark.slow
def test_on_ray_the_encoder_is_loaded_frozen_then_trained_and_each_lr_logged(project, encoder, shared_ray_head):
    from safetensors.torch import load_file

    from conftest import run_cli

    storage = project / "ray_runs"
    args = [a for a in common(project, storage, encoder) if a != "--config" and not a.endswith("signal.yaml")]
    r = run_cli(["-m", "stride", "--config", "signal.yaml", *args, "run.name=ray", f"train.max_steps={STEPS}", GROUPS,
                 "scaling.num_workers=2", "tracking.mlflow=true"], cwd=project, env=shared_ray_head.env(), timeout=400)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert not shared_ray_head.wait_idle()
    run, pretrained = storage / "ray", load_file(str(encoder))
    assert all(torch.equal(weights(run, 10)[n], pretrained[n]) for n in pretrained)  # frozen through step 10
    assert any(not torch.equal(weights(run, 15)[n], pretrained[n]) for n in pretrained)  # trained after
    lines = [x for x in read_jsonl(run / "metrics.jsonl") if "lr" in x]
    assert len(lines) == STEPS and all(x["lr/head"] == pytest.approx(0.1 * x["lr"], rel=1e-12) for x in lines)
    # grad_norm/<group>: the frozen encoder has no gradient until step 10; the groups' norms combine to grad_norm.
    assert all(x["grad_norm/encoder"] == 0 for x in lines if x["step"] <= 10)
    assert all(x["grad_norm/encoder"] > 0 and x["grad_norm/head"] > 0 for x in lines if x["step"] > 10)
    for x in lines:
        together = sum(x[f"grad_norm/{g}"] ** 2 for g in ("default", "encoder", "head")) ** 0.5
        assert together == pytest.approx(x["grad_norm"], rel=1e-5), x
    s = summary(run)
    assert s["status"] == "completed" and s["world_size"] == 2 and s["init"]["loaded"] == len(pretrained)
    from mlflow.tracking import MlflowClient

    tags = MlflowClient(f"sqlite:///{storage / 'mlflow.db'}").get_run(s["mlflow_run_id"]).data.tags
    assert tags["init.from"] == str(encoder) and tags["init.sha256"] == s["init"]["sha256"]
    assert tags["init.loaded"] == str(len(pretrained)) and tags["init.missing"] == "0"


def test_the_drivers_check_keeps_init_froms_digest_for_plan_run_until_the_file_changes(tmp_path):
    """The driver's check hashes init.from once and known_sha256 (what plan_run puts in RunPlan.init_sha256 for the
    workers) gives that digest back without hashing again; a file changed since gives None (hashed again), never a
    stale digest. In one process: that the workers then use RunPlan.init_sha256 is Trainer.load_init's code."""
    import hashlib

    from safetensors.torch import save_file

    from stride.trainers import pretrained

    path = tmp_path / "a.safetensors"
    save_file({"w": torch.ones(1, 4)}, str(path))
    assert pretrained.known_sha256(str(path)) is None
    model = torch.nn.Linear(4, 1, bias=False)
    plan = pretrained.check_init(model, str(path), strict=False, include=[], exclude=[], rename=[("^w$", "weight")])
    assert pretrained.known_sha256(str(path)) == plan.sha256 == hashlib.sha256(path.read_bytes()).hexdigest()
    save_file({"w": torch.full((1, 4), 2.0)}, str(path))
    assert pretrained.known_sha256(str(path)) is None


def test_a_resume_never_reads_init_from_again(mlp_source, tabular_data, tmp_path):
    """The checkpoint holds everything: with the source deleted after the first start, the run resumes and ends as
    an uninterrupted one, and keeps the record of where its weights came from."""
    from stride.trainers.launch.torchrun import main as torchrun_main

    source = tmp_path / "base.safetensors"
    shutil.copy(mlp_source["file"], source)
    extra = (f"init.from={source}", "train.deterministic=true")
    runs = tmp_path / "runs"
    assert torchrun_main(mlp_args(tabular_data, runs, "full", 4, *extra)) == 0
    assert torchrun_main(mlp_args(tabular_data, runs, "cut", 2, *extra)) == 0
    source.unlink()
    assert torchrun_main(mlp_args(tabular_data, runs, "cut", 4, *extra)) == 0
    full, cut = (json.loads((runs / n / "summary.json").read_text()) for n in ("full", "cut"))
    assert cut["restarts"] == 1 and cut["param_checksums"] == full["param_checksums"]
    assert cut["init"] == full["init"] and cut["init"]["from"] == str(source)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_on_cuda_mixed_precision_keeps_the_frozen_layers_bitwise_and_loads_init_from(mlp_source, tabular_data,
                                                                                    tmp_path, precision):
    """On a GPU, under autocast (bf16) and the GradScaler (fp16): init.from lands on the device, the frozen layers end
    bitwise equal to the file, the rest trains with finite losses."""
    from stride.trainers.run import checkpointing
    from stride.trainers.launch.torchrun import main as torchrun_main

    extra = (f"init.from={mlp_source['file']}", "optim.groups=[{match: '^net\\.0\\.', freeze: true}]",
             "scaling.use_gpu=true", f"train.precision={precision}", "train.log_every_steps=1")
    assert torchrun_main(mlp_args(tabular_data, tmp_path, "gpu", 6, *extra)) == 0
    s = json.loads((tmp_path / "gpu" / "summary.json").read_text())
    assert s["precision"] == precision and s["init"]["loaded"] == 6
    final = checkpointing.load_model_state(tmp_path / "gpu" / "checkpoint_00000006")
    w = mlp_source["weights"]
    assert torch.equal(final["net.0.weight"], w["net.0.weight"]) and torch.equal(final["net.0.bias"], w["net.0.bias"])
    assert not torch.equal(final["net.4.weight"], w["net.4.weight"])
    losses = [r["train_loss"] for r in read_jsonl(tmp_path / "gpu" / "metrics.jsonl") if "train_loss" in r]
    assert len(losses) == 6 and all(math.isfinite(x) for x in losses)
