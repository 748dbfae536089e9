"""Task.loss returning (loss_sum, count): accumulation and DDP equal one big batch in tokens, val_loss is weighted
by count, and one step cannot mix it with a mean. Plain PyTorch; the DDP case is two gloo processes, no torchrun."""

import copy
import datetime
import itertools
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from stride.trainers.models import CharGPT
from stride.trainers.step import Precision, evaluate, train_step

PREC = Precision.create("fp32", torch.device("cpu"))
WIDTH, CLASSES, LENGTH = 4, 3, 5


def padded_batch(seed: int, valid: int, rows: int = 2) -> dict[str, torch.Tensor]:
    """`rows` padded sequences of LENGTH tokens, the first `valid` of them (row-major) real: float64, so sums in
    any order agree to ~1e-15."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(rows * LENGTH, dtype=torch.float64)
    mask[:valid] = 1.0
    return {"x": torch.randn(rows, LENGTH, WIDTH, generator=g, dtype=torch.float64),
            "y": torch.randint(0, CLASSES, (rows, LENGTH), generator=g), "mask": mask.view(rows, LENGTH)}


def union(batches: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {k: torch.cat([b[k] for b in batches]) for k in batches[0]}


def token_ce(model, batch):
    """A token-level cross-entropy over the real tokens: (sum, count)."""
    losses = torch.nn.functional.cross_entropy(model(batch["x"]).flatten(0, 1), batch["y"].flatten(), reduction="none")
    mask = batch["mask"].flatten()
    return (losses * mask).sum(), mask.sum()


def mean_ce(model, batch):
    loss_sum, count = token_ce(model, batch)
    return loss_sum / count


def model_fn() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(WIDTH, CLASSES).double()


def stepped(model, loss_fn, micro_batches, scaled=False):
    """The parameters after one SGD train_step over `micro_batches`, and the StepResult. `scaled`: with an enabled
    GradScaler, as under fp16, where the sums are weighted before backward (float64 here, so the results compare
    tightly)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    scaler = torch.amp.GradScaler("cpu", enabled=True) if scaled else PREC.grad_scaler()
    result = train_step(loss_fn, model, opt, scaler, PREC, micro_batches, grad_clip_norm=None)
    return [p.detach().clone() for p in model.parameters()], result


@pytest.mark.parametrize("scaled", [False, True])
def test_accumulation_weights_every_token_alike(scaled):
    micro = [padded_batch(1, valid=3), padded_batch(2, valid=7)]
    model = model_fn()
    one, one_result = stepped(copy.deepcopy(model), token_ce, [union(micro)], scaled)
    two, two_result = stepped(copy.deepcopy(model), token_ce, micro, scaled)
    for a, b in zip(two, one):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    assert two_result.finite and two_result.loss == pytest.approx(one_result.loss, rel=1e-12)
    # The mean of the micro-batches' means weighs a token of the 3 three times one of the 7 more: not one batch.
    means, _ = stepped(copy.deepcopy(model), mean_ce, micro)
    assert not all(torch.allclose(a, b, rtol=1e-6, atol=1e-6) for a, b in zip(means, one))


# Each rank's micro-batches: different counts per rank and per micro-batch, one micro-batch without a real token.
RANK_BATCHES = {0: [(10, 3), (11, 7)], 1: [(20, 0), (21, 6)]}


def _ddp_rank(rank: int, world: int, init: str, out: str) -> None:
    from torch.nn.parallel import DistributedDataParallel

    from stride.trainers.launch.torchrun import leave_gang

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    micro = [padded_batch(seed, valid) for seed, valid in RANK_BATCHES[rank]]
    for scaled in (False, True):
        params, result = stepped(DistributedDataParallel(model_fn()), token_ce, micro, scaled)
        torch.save({"params": params, "loss": result.loss, "finite": result.finite}, f"{out}.{rank}.{scaled}")
    # As trainers/torchrun.py ends: the DDP modules freed and the group destroyed, then no interpreter finalization,
    # where gloo's threads torn down unjoined aborted a finished rank ("terminate called without an active
    # exception", SIGABRT) in about one run of three here.
    leave_gang()
    os._exit(0)


def test_ddp_equals_one_process_on_the_union(tmp_path):
    mp.spawn(_ddp_rank, args=(2, f"file://{tmp_path}/rendezvous", str(tmp_path / "rank")), nprocs=2, join=True)
    everything = [padded_batch(seed, valid) for r in (0, 1) for seed, valid in RANK_BATCHES[r]]
    for rank, scaled in itertools.product((0, 1), (False, True)):
        expected, expected_result = stepped(model_fn(), token_ce, [union(everything)], scaled)
        got = torch.load(tmp_path / f"rank.{rank}.{scaled}")
        for a, b in zip(got["params"], expected):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
        assert got["finite"] and got["loss"] == pytest.approx(expected_result.loss, rel=1e-12)


class TokenTask:
    loss = staticmethod(token_ce)

    def metrics(self, model, batch):
        return {"real": batch["mask"].sum(1)}


def test_val_loss_is_weighted_by_count():
    model, batches = model_fn(), [padded_batch(1, valid=3), padded_batch(2, valid=7), padded_batch(3, valid=10)]
    with torch.no_grad():
        sums, counts = zip(*(token_ce(model, b) for b in batches))
    # A padding batch (0 rows) counts for nothing, whatever its sum.
    out = evaluate(TokenTask(), model, PREC, [(b, 2) for b in batches] + [(batches[2], 0)], torch.device("cpu"))
    assert out["val_loss"] == pytest.approx(float(sum(sums) / sum(counts)), rel=1e-12)
    assert out["val_loss"] != pytest.approx(float(sum(s / c for s, c in zip(sums, counts)) / 3), rel=1e-6)
    assert out["val_real"] == pytest.approx(20 / 6)  # metrics stay per row


def test_mixed_forms_in_one_step_are_refused():
    calls = iter([token_ce, mean_ce])
    model = model_fn()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    with pytest.raises(TypeError, match=r"Task\.loss returned a \(loss_sum, count\) tuple .* and a scalar mean"):
        train_step(lambda m, b: next(calls)(m, b), model, opt, PREC.grad_scaler(), PREC,
                   [padded_batch(1, valid=3), padded_batch(2, valid=7)], grad_clip_norm=None)


def test_a_step_without_any_token_is_skipped():
    model = model_fn()
    before = [p.detach().clone() for p in model.parameters()]
    after, result = stepped(model, token_ce, [padded_batch(1, valid=0), padded_batch(2, valid=0)])
    assert not result.finite and all(torch.equal(a, b) for a, b in zip(after, before))
    assert all(p.grad is None for p in model.parameters())


def test_fp16_sums_do_not_overflow_the_initial_scale():
    """Without the weight, 128-token sums overflow at 2^16 for the first steps: skipped steps in a row."""
    torch.manual_seed(0)
    model = CharGPT(vocab_size=256, context=16, n_layers=1, n_heads=2, width=32)
    prec = Precision.create("fp16", torch.device("cpu"))
    scaler = prec.grad_scaler()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    data = torch.randint(0, 256, (16, 17))

    def token_sum(m, batch):
        logits = m(batch[:, :-1])
        losses = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten(),
                                                   reduction="none")
        return losses.sum(), losses.numel()

    results = [train_step(token_sum, model, opt, scaler, prec, [data[:8], data[8:]], 1.0) for _ in range(3)]
    assert all(r.finite for r in results) and scaler.get_scale() == 65536.0
