"""train.activation_checkpointing and train.compile in one process (no Ray, no process group); the 2-worker DDP and
FSDP runs and Ray's are in test_fsdp.py and test_user_task.py."""

import json
import os

import pytest
import torch

from conftest import run_cli
from stride.trainers import blocks
from stride.trainers.models import CharGPT
from runs import launch, losses, tiny


def _args(tmp_path, data, name, *extra):
    return tiny(tmp_path, data, 20, "train.log_every_steps=2", "train.eval_every_steps=20", "checkpoint.every_steps=20",
                "model.hidden_sizes=[64,64,64]", "model.dropout=0.2", "train.deterministic=true", *extra, name=name)


def test_activation_checkpointing_in_one_process_is_bitwise_neutral(tmp_path, tabular_data, capsys):
    assert launch.in_process(_args(tmp_path, tabular_data, "kept")) == 0
    assert launch.in_process(_args(tmp_path, tabular_data, "recomputed", "train.activation_checkpointing=true")) == 0
    assert "activation checkpointing: 3 of 3 blocks" in capsys.readouterr().out  # the MLP's Linears but the root's last
    kept, recomputed = losses(tmp_path / "kept"), losses(tmp_path / "recomputed")
    assert sorted(kept) == list(range(2, 21, 2)) and recomputed == kept
    a, b = (json.loads((tmp_path / n / "summary.json").read_text()) for n in ("kept", "recomputed"))
    assert a["param_checksums"] == b["param_checksums"] and a["val_loss"] == b["val_loss"]


def test_both_switches_leave_the_models_names_and_outputs_alone():
    """Checkpoints, export and resharding rely on the parameter names; compiled and checkpointed blocks compute what
    the plain ones do (every other block checkpointed here)."""
    torch.manual_seed(0)
    plain = CharGPT(256, 16, 4, 2, 32)
    changed = CharGPT(256, 16, 4, 2, 32)
    changed.load_state_dict(plain.state_dict())
    assert blocks.checkpoint_activations(list(changed.blocks), every=2) == 2
    assert blocks.compile_blocks(changed, list(changed.blocks), "default") == 4
    assert list(changed.state_dict()) == list(plain.state_dict())
    x = torch.randint(0, 256, (2, 16))
    torch.testing.assert_close(changed(x), plain(x), rtol=1e-5, atol=1e-5)
    changed(x).sum().backward()
    plain(x).sum().backward()
    for (name, p), q in zip(plain.named_parameters(), changed.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize("setting,strategy,scope", [
    ("auto", "ddp", "model"), ("auto", "fsdp", "blocks"), (True, "ddp", "model"), (True, "fsdp", "blocks"),
    (False, "ddp", "off"), ("model", "fsdp", "model"), ("blocks", "ddp", "blocks"), ("off", "fsdp", "off")])
def test_compile_auto_compiles_the_model_with_its_loss_except_under_fsdp(setting, strategy, scope):
    """train.compile=auto: one graph of the model and the loss, but per block under FSDP (its all-gathers run
    between the blocks); true and false, the switch of earlier configs, read as auto and off."""
    from stride.trainers.config import TrainSection

    t = TrainSection(compile=setting, strategy=strategy)
    assert t.compile_scope == scope and t.compile in ("auto", "model", "blocks", "off")


@pytest.mark.slow
def test_a_compile_failure_names_the_setting_to_turn_off(tmp_path, tabular_data):
    """No usable C++ compiler for inductor: the run fails (exit 1) with one line naming train.compile, not a
    traceback of Stride's (torch's own logged warnings about the failed compile stay, prefixed W...)."""
    env = {"CXX": str(tmp_path / "no-such-compiler"), "TORCHINDUCTOR_FORCE_DISABLE_CACHES": "1",
           "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    r = run_cli(["trainers/torchrun.py", *_args(tmp_path, tabular_data, "broken", "train.compile=true")], env=env,
                timeout=300)
    assert r.returncode == 1, r.stdout[-3000:] + r.stderr[-3000:]
    err = r.stderr.strip().splitlines()
    assert err[-1].startswith("stride: error: train.compile=auto failed (") and "set train.compile=off" in err[-1]
    assert not any(ln.startswith("Traceback") for ln in err), r.stderr[-3000:]
    assert os.environ.get("CXX") != env["CXX"]  # the test's environment only
