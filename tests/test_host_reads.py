"""No device-to-host read in the training step between log steps (issue 45): the loss, the gradient norm and the
non-finite decision stay on the device and are read at once at log, evaluation and checkpoint steps.

On CPU, a read is a call of Tensor.item, tolist, cpu, numpy, __bool__, __float__ or __int__ (on a GPU each one waits
for every queued kernel); the tests count those calls. One process, no process group, no Ray: the loop under Ray
runs the same step (trainers/loop.py); the GPU's own check (torch.cuda.set_sync_debug_mode) is in test_gpu_bench.py.
"""

from __future__ import annotations

import copy
from contextlib import contextmanager

import pytest
import torch

from runs import launch, losses, tiny
from stride.trainers.models import CharGPT
from stride.trainers.step import Precision, train_step

READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__")


@contextmanager
def counted_reads(monkeypatch, where=lambda: None):
    """Every read while inside, as a list of `where()` at the time of each."""
    seen: list = []
    for name in READS:
        original = getattr(torch.Tensor, name)

        def counting(self, *args, _original=original, **kwargs):
            seen.append(where())
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counting)
    try:
        yield seen
    finally:
        monkeypatch.undo()


def token_ce(model, batch):
    logits = model(batch[:, :-1])
    losses = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten(), reduction="none")
    return losses.sum(), torch.tensor(losses.numel())


def mean_ce(model, batch):
    logits = model(batch[:, :-1])
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten())


def _setup(fused: bool):
    torch.manual_seed(0)
    model = CharGPT(vocab_size=64, context=8, n_layers=1, n_heads=2, width=16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, **({"fused": True} if fused else {"foreach": True}))
    return model, opt


@pytest.mark.parametrize("loss_fn", [mean_ce, token_ce], ids=["mean", "loss_sum_count"])
@pytest.mark.parametrize("mode", ["fp32", "bf16"])
def test_a_fused_step_reads_nothing_back(monkeypatch, loss_fn, mode):
    """fp32 and bf16, a mean loss and (loss_sum, count), with a non-finite step among them: 0 reads in 4 steps with
    gradient accumulation and clipping, and the non-finite step is skipped on the device."""
    model, opt = _setup(fused=True)
    prec = Precision.create(mode, torch.device("cpu"))
    scaler = prec.grad_scaler()
    data = torch.randint(0, 64, (4, 9))
    results = []
    with counted_reads(monkeypatch) as reads:
        for i in range(4):
            if i == 2:
                before = [p.detach().clone() for p in model.parameters()]
            results.append(train_step(_nan_of(loss_fn) if i == 2 else loss_fn, model, opt, scaler, prec,
                                      [data[:2], data[2:]], 1.0))
            if i == 2:
                after = [p.detach().clone() for p in model.parameters()]
    assert reads == [], f"{len(reads)} reads in the step"
    assert [bool(r.finite) for r in results] == [True, True, False, True]
    assert all(torch.equal(a, b) for a, b in zip(before, after))  # the skipped step left the weights alone
    steps = [int(s["step"]) for s in opt.state_dict()["state"].values()]
    assert steps and all(s == 3 for s in steps), steps  # and did not count as one of Adam's steps


def _nan_of(loss_fn):
    def nan_loss(m, b):
        out = loss_fn(m, b)
        return (out[0] * float("nan"), out[1]) if isinstance(out, tuple) else out * float("nan")
    return nan_loss


def test_the_step_is_todays_step_bitwise_in_fp32_on_cpu():
    """With a fixed seed, the weights and the loss equal those of the step as written by hand (backward, clip, foreach
    AdamW), bit for bit: keeping the figures on the device changed no arithmetic."""
    model, opt = _setup(fused=False)
    ref_model = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, foreach=True)
    prec = Precision.create("fp32", torch.device("cpu"))
    data = torch.randint(0, 64, (4, 9))
    for _ in range(3):
        r = train_step(mean_ce, model, opt, prec.grad_scaler(), prec, [data[:2], data[2:]], 1.0)
        ref_losses = []
        for part in (data[:2], data[2:]):
            loss = mean_ce(ref_model, part)
            (loss / 2).backward()
            ref_losses.append(loss.detach().float())
        norm = torch.nn.utils.clip_grad_norm_(ref_model.parameters(), 1.0)
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
        assert r.read() == (float(ref_losses[0] + ref_losses[1]) / 2, float(norm), True)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref_model.parameters()))


def test_group_norms_combine_to_clip_grad_norms_value_and_the_step_is_unchanged():
    """optim.groups' grad_norm/<group>: taken in the pass that gives the total, which equals clip_grad_norm_'s over
    every parameter to float rounding; the clipped step's weights agree with the ungrouped step's as closely."""
    model, opt = _setup(fused=False)
    ref_model = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, foreach=True)
    params = list(model.parameters())
    groups = [params[:1], params[1:], []]  # an empty group (all frozen) has norm 0
    prec = Precision.create("fp32", torch.device("cpu"))
    data = torch.randint(0, 64, (4, 9))
    for _ in range(3):
        r = train_step(mean_ce, model, opt, prec.grad_scaler(), prec, [data], 0.5, groups=groups)
        rr = train_step(mean_ce, ref_model, ref_opt, prec.grad_scaler(), prec, [data], 0.5)
        g = r.group_norms.tolist()
        assert len(g) == 3 and g[2] == 0 and g[0] > 0 and g[1] > 0
        assert float(r.grad_norm) == pytest.approx(float(rr.grad_norm), rel=1e-6)
        assert (g[0] ** 2 + g[1] ** 2) ** 0.5 == pytest.approx(float(r.grad_norm), rel=1e-6)
        assert float(rr.grad_norm) > 0.5  # clipped: the threshold acted on both
    assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-7) for a, b in zip(model.parameters(), ref_model.parameters()))


def test_the_loop_reads_only_at_log_and_checkpoint_steps(tmp_path, tabular_data, monkeypatch):
    """A run of 12 steps, logging every 4, the fused optimizer: every read of the training loop happens at step 0
    (set-up), 4, 8 or 12; none while steps 1-3, 5-7 or 9-11 train. The losses logged are the steps' own."""
    from stride.trainers.loop import Trainer

    trainers: list = []
    original_step = Trainer.step

    def step(self, batches):
        trainers.append(self) if not trainers else None
        return original_step(self, batches)

    monkeypatch.setattr(Trainer, "step", step)
    args = tiny(tmp_path, tabular_data, 12, "train.log_every_steps=4", "train.eval_every_steps=null",
                "checkpoint.every_steps=12", "optim.implementation=fused", "train.gc_every_steps=0")
    with counted_reads(monkeypatch, lambda: trainers[0].state.step if trainers else 0) as reads:
        assert launch.in_process(args) == 0
    at = sorted(set(reads))
    assert reads and set(at) <= {0, 4, 8, 12}, f"reads at steps {at}"
    assert sorted(losses(tmp_path / "r")) == [4, 8, 12]


def test_a_spike_is_judged_on_the_device_and_skip_drops_only_its_update():
    """train.spike (SpikeGuard): after 10 ordinary steps, a step whose loss is 100 times theirs is a spike; with skip
    its update is dropped (the weights stay as they were) and the next ordinary step trains again, judged against a
    window the spike never entered."""
    from stride.trainers.step import SpikeGuard

    model, opt = _setup(fused=False)
    prec = Precision.create("fp32", torch.device("cpu"))
    guard = SpikeGuard("train_loss", window=20, factor=3.0, skip=True)
    data = torch.randint(0, 64, (4, 9))

    def scaled(k):
        return lambda m, b: mean_ce(m, b) * k

    verdicts = [train_step(scaled(1.0), model, opt, prec.grad_scaler(), prec, [data], 1.0, guard=guard).spike
                for _ in range(10)]
    assert all(v[0] == 0 for v in verdicts)  # no spikes while the window fills
    before = [p.detach().clone() for p in model.parameters()]
    r = train_step(scaled(100.0), model, opt, prec.grad_scaler(), prec, [data], 1.0, guard=guard)
    spike, median, value = r.spike.tolist()
    assert spike == 1 and value > 3 * median and bool(r.finite)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # skipped
    r = train_step(scaled(1.0), model, opt, prec.grad_scaler(), prec, [data], 1.0, guard=guard)
    assert r.spike[0] == 0 and not all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    warn = SpikeGuard("grad_norm", window=20, factor=3.0, skip=False)
    for _ in range(10):
        train_step(scaled(1.0), model, opt, prec.grad_scaler(), prec, [data], 1.0, guard=warn)
    before = [p.detach().clone() for p in model.parameters()]
    r = train_step(scaled(100.0), model, opt, prec.grad_scaler(), prec, [data], 1.0, guard=warn)
    assert r.spike[0] == 1 and not all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # warned only
