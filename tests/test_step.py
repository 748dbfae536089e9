"""The plain-PyTorch core: schedule, accumulation, precision, sample order. No process group, no Ray."""

import copy
import math

import pytest
import torch

from conftest import REPO
from stride.trainers.config_reader import load_config
from stride.trainers.models import MLP, CharGPT
from stride.trainers.optim import build_optimizer, build_scheduler
from stride.trainers.schedules import cosine_factor
from stride.trainers.step import Precision, resolve_precision, train_step


def ce(model, batch):
    """Cross-entropy of an (inputs, targets) micro-batch: the loss the built-in tasks compute."""
    x, y = batch
    logits = model(x)
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))


def test_lr_warmup_then_cosine_to_min_ratio():
    f = [cosine_factor(s, warmup_steps=10, total_steps=110, min_lr_ratio=0.1) for s in range(110)]
    assert f[0] == pytest.approx(0.1) and f[9] == pytest.approx(1.0)
    assert all(a < b for a, b in zip(f[:9], f[1:10]))          # linear warm-up rises
    assert all(a >= b for a, b in zip(f[10:], f[11:]))         # cosine never rises
    assert f[60] == pytest.approx(0.1 + 0.9 * 0.5)             # half way through the decay
    assert cosine_factor(110, 10, 110, 0.1) == pytest.approx(0.1)  # ends at min_lr_ratio
    assert cosine_factor(500, 10, 110, 0.1) == pytest.approx(0.1)  # and stays there


def test_scheduler_drives_the_optimizer_lr():
    cfg = load_config(REPO / "trainers/configs/tabular_mlp.yaml",
                      ["optim.lr=0.01", "optim.warmup_steps=4", "optim.min_lr_ratio=0.0", "optim.lr_scaling=linear",
                       "optim.reference_batch_size=64", "train.batch_size_per_worker=64"])
    model = MLP(4, [8], 3)
    opt = build_optimizer(cfg, model, world_size=2)  # global batch 128 = 2x reference -> lr 0.02
    sched = build_scheduler(cfg, opt, total_steps=20)
    seen = []
    for _ in range(20):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert seen[3] == pytest.approx(0.02)
    assert seen[0] == pytest.approx(0.02 / 4)
    assert seen[-1] < 0.002


def _grads(model):
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def test_accumulation_equals_one_big_batch():
    torch.manual_seed(0)
    model = MLP(6, [16, 16], 4)
    x, y = torch.randn(32, 6), torch.randint(0, 4, (32,))
    prec = Precision.create("fp32", torch.device("cpu"))

    def grads_after(micro):
        m = copy.deepcopy(model)
        opt = torch.optim.SGD(m.parameters(), lr=0.0)  # lr 0: only the gradients matter
        captured = {}
        orig = opt.step

        def step_and_capture(*a, **k):
            captured["g"] = _grads(m).clone()
            return orig(*a, **k)

        opt.step = step_and_capture
        train_step(ce, m, opt, prec.grad_scaler(), prec, micro, grad_clip_norm=None)
        return captured["g"]

    one = grads_after([(x, y)])
    two = grads_after([(x[:16], y[:16]), (x[16:], y[16:])])
    four = grads_after([(x[i:i + 8], y[i:i + 8]) for i in range(0, 32, 8)])
    torch.testing.assert_close(two, one, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(four, one, rtol=1e-5, atol=1e-6)


def test_fp16_gradscaler_path_on_cpu():
    torch.manual_seed(0)
    model = CharGPT(vocab_size=256, context=16, n_layers=1, n_heads=2, width=32)
    prec = Precision.create("fp16", torch.device("cpu"))
    scaler = prec.grad_scaler()
    assert scaler.is_enabled() and scaler.get_scale() == 65536.0
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    data = torch.randint(0, 256, (8, 17))
    losses = []
    for _ in range(30):
        r = train_step(ce, model, opt, scaler, prec, [(data[:, :-1], data[:, 1:])], grad_clip_norm=1.0)
        losses.append(r.loss)
    assert all(math.isfinite(v) for v in losses)
    assert losses[-1] < losses[0] * 0.8  # it learns under autocast(fp16) + dynamic loss scaling
    with prec.autocast():
        assert model.blocks[0].attn.qkv(torch.randn(2, 32)).dtype == torch.float16


def test_fp16_scaler_skips_non_finite_steps():
    model = MLP(2, [4], 2)
    prec = Precision.create("fp16", torch.device("cpu"))
    scaler = prec.grad_scaler()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = [p.clone() for p in model.parameters()]
    x = torch.tensor([[float("inf"), 1.0]])
    r = train_step(ce, model, opt, scaler, prec, [(x, torch.tensor([0]))], grad_clip_norm=1.0)
    assert not r.finite
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # the step was skipped
    assert scaler.get_scale() < 65536.0


def test_auto_precision_is_fp32_on_cpu():
    assert resolve_precision("auto", torch.device("cpu")) == "fp32"
    assert resolve_precision("bf16", torch.device("cpu")) == "bf16"


def test_fp32_non_finite_gradients_are_never_applied():
    model = MLP(2, [4], 2)
    prec = Precision.create("fp32", torch.device("cpu"))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = [p.clone() for p in model.parameters()]
    r = train_step(ce, model, opt, prec.grad_scaler(), prec, [(torch.tensor([[float("nan"), 1.0]]), torch.tensor([0]))],
                   grad_clip_norm=None)
    assert not r.finite
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
