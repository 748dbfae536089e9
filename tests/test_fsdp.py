"""train.strategy=fsdp (FSDP2) on 2 CPU workers with gloo, launched with torchrun (faster than Ray; the loop is
the same): training, the loss curve against DDP, parameter memory per worker, exact resume, an FSDP checkpoint
in a 1-worker run, bf16, gradient accumulation, non-finite gradients, activation checkpointing and torch.compile;
one Ray run. Every test that launches torchrun or Ray is slow. Last, without a launch: the torchrun launcher refuses
GPUs it does not have, by the rule Ray's driver applies."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest
import torch

from conftest import PYTHON, REPO, run_cli, run_cli_forked
from runs import launch, losses, tiny

from stride.trainers import fsdp
from stride.trainers.run import checkpointing

# Built once, on the worker of the tests on the shared cluster, which read it too (tests/conftest.py).
CLUSTER_STREAM_FIXTURES = {"runs"}

STEPS = 20


def tiny_args(data, storage, name, steps=STEPS, *extra):
    # optim.warmup_steps > steps: the lr depends on the step only (not on max_steps), so a run stopped at step 10
    # and resumed to 20 follows the same schedule as one that ran 20 steps. scaling.use_gpu=false: CPU workers with
    # gloo (deterministic, bitwise comparable) on a machine with GPUs too.
    return tiny(storage, data, None, "model.n_layers=2", "model.width=32", "model.n_heads=2", "model.context=32",
                "train.batch_size_per_worker=8", f"train.max_steps={steps}", "train.log_every_steps=1",
                "train.eval_every_steps=10", "checkpoint.every_steps=10", "optim.warmup_steps=50",
                "train.deterministic=true", "scaling.use_gpu=false", *extra, name=name,
                config="trainers/configs/char_gpt.yaml")


def torchrun(nproc: int, args: list[str], script: str = "trainers/torchrun.py",
             env: dict | None = None) -> subprocess.CompletedProcess:
    r = launch.torchrun(args, nproc=nproc, entry=(script,), env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r


def summary(run_dir) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


@pytest.fixture(scope="module")
def small_text(tmp_path_factory, text_data):
    """4096 training rows of the stdlib set, and 513 validation rows: an odd count, so rank 0 evaluates one batch
    more than rank 1 and the FSDP padding of evaluation (every rank runs as many forwards) is exercised."""
    import pyarrow.parquet as pq

    out = tmp_path_factory.mktemp("data") / "small_text"
    for split, rows in (("train", 4096), ("val", 513)):
        (out / split).mkdir(parents=True)
        table = pq.ParquetDataset(text_data / split).read().slice(0, rows)
        pq.write_table(table, out / split / "part-0000.parquet")
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory, small_text, tabular_data):
    """DDP and FSDP, 20 steps each; FSDP stopped at step 10 and resumed to 20; DDP's step 10 resumed under FSDP;
    FSDP bf16 with accumulation; dropout with and without activation checkpointing; the tabular MLP under DDP and
    FSDP; the first 10 steps of the run that Ray resumes; torch.compile. All under ONE torchrun launch
    (tests/torchrun_cases.py): the cases run one after another in the same two processes, so torchrun's, Python's
    and torch's start-up is paid once, not once per case. In order: a case "<name>@20" resumes the checkpoint that
    "<name>@10" wrote."""
    storage = tmp_path_factory.mktemp("fsdp_runs")

    def case(label, name, steps, *extra, env=None):
        return {"label": label, "args": tiny_args(small_text, storage, name, steps, *extra), "env": env or {}}

    cases = [case("ddp", "ddp", STEPS), case("fsdp", "fsdp", STEPS, "train.strategy=fsdp"),
             case("resumed@10", "resumed", 10, "train.strategy=fsdp"),
             case("resumed@20", "resumed", STEPS, "train.strategy=fsdp"),
             case("bf16", "bf16", 10, "train.strategy=fsdp", "train.precision=bf16", "train.grad_accum_steps=2")]
    # train.activation_checkpointing on FSDP's units (with dropout: recomputation must replay it), and train.compile
    # (without: inductor draws its own random numbers, so a compiled run's dropout masks are not eager's).
    for name, extra in (("drop", []), ("drop_ac", ["train.activation_checkpointing=true"])):
        cases.append(case(name, name, 10, "train.strategy=fsdp", "model.dropout=0.1", *extra))
    cases += [case("switched@10", "switched", 10), case("switched@20", "switched", STEPS, "train.strategy=fsdp"),
              case("ray@10", "ray", 10, "train.strategy=fsdp")]
    cases += [{"label": f"mlp_{strategy}", "args": mlp_args(tabular_data, storage, f"mlp_{strategy}",
                                                           f"train.strategy={strategy}")} for strategy in ("ddp", "fsdp")]
    # An empty inductor cache of its own: what inductor generates for this run shows that it compiled (a shared,
    # warm cache could hold kernels from another run). Inductor reads TORCHINDUCTOR_CACHE_DIR whenever it resolves
    # its cache folder, so set for this case alone it takes effect; the case is last, after no other compiled one.
    inductor = storage / "inductor"
    cases.append(case("compiled", "compiled", 10, "train.strategy=fsdp", "train.compile=auto",
                      "train.activation_checkpointing=true", "train.activation_checkpointing_every=2",
                      env={"TORCHINDUCTOR_CACHE_DIR": str(inductor)}))
    results = tmp_path_factory.mktemp("torchrun_cases")
    (results / "cases.json").write_text(json.dumps(cases))
    torchrun(2, [str(results / "cases.json"), str(results)], script="tests/torchrun_cases.py")
    ranks = [json.loads((results / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    # What a case printed (every rank's, as its own launch's stdout held).
    printed = {c["label"]: "".join(next(r for r in rank if r["label"] == c["label"])["stdout"] for rank in ranks)
               for c in cases}
    return {"storage": storage, "resumed_stdout": printed["resumed@20"], "printed": printed, "inductor": inductor}


def mlp_args(data, storage, name, *extra):
    return tiny(storage, data, 30, "train.log_every_steps=10", "train.eval_every_steps=30", "checkpoint.every_steps=30",
                "train.deterministic=true", "scaling.use_gpu=false", *extra, name=name,
                config="trainers/configs/tabular_mlp.yaml")


@pytest.mark.slow
def test_fsdp_trains_char_gpt_and_checkpoints_one_shard_file_per_rank(runs):
    run = runs["storage"] / "fsdp"
    s = summary(run)
    assert s["status"] == "completed" and s["strategy"] == "fsdp" and s["world_size"] == 2 and s["global_step"] == STEPS
    assert s["val_loss"] < s["initial_val_loss"] - 0.2
    curve = losses(run)
    assert sorted(curve) == list(range(1, STEPS + 1)) and curve[STEPS] < curve[1] - 0.2  # the loss goes down
    assert s["param_checksums"][0] == s["param_checksums"][1]  # both ranks sum the same full parameters
    ckpt = checkpointing.newest_complete(run)
    meta = checkpointing.read_meta(ckpt)
    assert checkpointing.verify(ckpt) is None and meta["strategy"] == "fsdp"
    # DCP: each rank wrote its own shards, no rank the whole state; the marker lists (and hashes) every file.
    files = sorted(p.name for p in ckpt.iterdir())
    assert files == [".metadata", "__0_0.distcp", "__1_0.distcp", "meta.json"]
    assert sorted(meta["files"]) == files[:3]
    shards = [(ckpt / f).stat().st_size for f in files[1:3]]
    assert abs(shards[0] - shards[1]) < 0.2 * max(shards), shards  # about half the state each
    # Every parameter is saved as its two dim-0 shards; its full shape is in the metadata.
    md = checkpointing.dcp_metadata(ckpt).state_dict_metadata
    assert tuple(md["model.tok_emb.weight"].size) == (256, 32) and "model.head.weight" in md
    assert len(md["model.blocks.0.attn.qkv.weight"].chunks) == 2
    assert any(k.startswith("optim.state.blocks.0.attn.qkv.weight.exp_avg") for k in md)  # optimizer by name
    # Consolidated in one process (export, generate): full tensors, the tied head included.
    model = checkpointing.load_model_state(ckpt)
    assert model["tok_emb.weight"].shape == (256, 32) and torch.equal(model["head.weight"], model["tok_emb.weight"])


@pytest.mark.slow
def test_fsdp_loss_curve_matches_ddp(runs):
    """Same seed, data and init. With 2 ranks both strategies average gradients exactly ((a+b)/2 either way); what
    differs is the order of reductions: FSDP's gradient norm (for clipping) sums per-shard partial norms across
    ranks, DDP's sums per-tensor norms, and the AdamW update runs on shards. That moves results by float32
    rounding (observed: <= 1e-7 relative over 20 steps), so 1e-5 leaves room for rounding and still fails on a
    real error (a wrong shard, a missing reduce, a skipped step differ by 1e-3 or more within a few steps)."""
    ddp, sharded = losses(runs["storage"] / "ddp"), losses(runs["storage"] / "fsdp")
    assert sorted(ddp) == sorted(sharded) == list(range(1, STEPS + 1))
    for step in ddp:
        assert sharded[step] == pytest.approx(ddp[step], rel=1e-5), step
    a, b = summary(runs["storage"] / "ddp"), summary(runs["storage"] / "fsdp")
    assert b["val_loss"] == pytest.approx(a["val_loss"], rel=1e-5)  # evaluation (with its padding) agrees too
    assert b["initial_val_loss"] == pytest.approx(a["initial_val_loss"], rel=1e-6)
    assert b["param_checksums"][0] == pytest.approx(a["param_checksums"][0], rel=1e-6)


@pytest.mark.slow
def test_parameter_memory_per_worker_is_half_of_ddp(runs):
    from stride.trainers.models import CharGPT

    full = sum(p.numel() for p in CharGPT(256, 32, 2, 2, 32).parameters()) * 4  # fp32, tied head counted once
    ddp = summary(runs["storage"] / "ddp")["param_bytes_per_worker"]
    sharded = summary(runs["storage"] / "fsdp")["param_bytes_per_worker"]
    assert ddp == [full, full]
    assert sum(sharded) == full  # every parameter is on exactly one rank (dim 0 shards; no padding counted)
    assert all(abs(b - full / 2) <= 0.01 * full for b in sharded), (sharded, full)


@pytest.mark.slow
def test_fsdp_resume_continues_at_the_exact_step(runs):
    run = runs["storage"] / "resumed"
    assert "resumed from" in runs["resumed_stdout"] and "at step 10" in runs["resumed_stdout"]
    s = summary(run)
    assert s["global_step"] == STEPS and s["restarts"] == 1 and s["strategy"] == "fsdp"
    got, expected = losses(run), losses(runs["storage"] / "fsdp")
    assert sorted(got) == list(range(1, STEPS + 1))  # metrics.jsonl continues from step 10: no gap, no repeat
    assert got == expected  # bitwise the uninterrupted run's losses (deterministic CPU)
    assert s["param_checksums"] == summary(runs["storage"] / "fsdp")["param_checksums"]
    assert s["val_loss"] == summary(runs["storage"] / "fsdp")["val_loss"]


@pytest.mark.slow
def test_fsdp_checkpoint_continues_in_a_one_worker_run(runs, small_text, tmp_path):
    """The FSDP checkpoint of step 10 (2 workers x 8) resumed by 1 worker x 16 without FSDP: the same samples per
    step, and the 16-sample mean gradient is the mean of the two ranks' 8-sample means, so the losses follow the
    FSDP run's steps 11-20 up to float rounding (observed <= 1e-7)."""
    src = min(runs["storage"].glob("resumed/checkpoint_*"), key=lambda p: checkpointing.read_meta(p)["step"])
    assert checkpointing.read_meta(src)["step"] == 10 and checkpointing.read_meta(src)["strategy"] == "fsdp"
    (tmp_path / "one").mkdir()
    shutil.copytree(src, tmp_path / "one" / src.name)
    r = run_cli_forked(["trainers/torchrun.py", *tiny_args(small_text, tmp_path, "one", STEPS,
                                                          "train.batch_size_per_worker=16")], timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "resumed from" in r.stdout and "at step 10" in r.stdout
    s = summary(tmp_path / "one")
    assert s["status"] == "completed" and s["global_step"] == STEPS and s["world_size"] == 1 and s["strategy"] == "none"
    got, sharded = losses(tmp_path / "one"), losses(runs["storage"] / "fsdp")
    assert sorted(got) == list(range(11, STEPS + 1))  # (only the checkpoint was copied, not metrics.jsonl)
    for step in got:
        assert got[step] == pytest.approx(sharded[step], rel=1e-5), step
    assert s["val_loss"] < s["initial_val_loss"]
    # Its own checkpoint is one process's: one shard file.
    own = checkpointing.newest_complete(tmp_path / "one")
    assert checkpointing.read_meta(own)["strategy"] == "none" and sorted(checkpointing.read_meta(own)["files"]) == [
        ".metadata", "__0_0.distcp"]


@pytest.mark.slow
def test_ddp_checkpoint_resumes_under_fsdp(runs):
    """The other direction: DDP's checkpoint (each replicated tensor written once, by one of the ranks) read into
    FSDP's shards: each rank reads its slice (the batch's "switched": 10 DDP steps, then the same run to 20 under
    FSDP)."""
    src = min(runs["storage"].glob("ddp/checkpoint_*"), key=lambda p: checkpointing.read_meta(p)["step"])
    assert checkpointing.read_meta(src)["step"] == 10 and checkpointing.read_meta(src)["strategy"] == "ddp"
    # Both DDP replicas hold every tensor; DCP writes each once, split between the ranks: together the two files
    # are about the size of the FSDP checkpoint of the same model, not twice it.
    shard = lambda ckpt, r: (ckpt / f"__{r}_0.distcp").stat().st_size  # noqa: E731
    fsdp_ckpt = runs["storage"] / "resumed" / "checkpoint_00000010"
    ddp_sizes, fsdp_total = [shard(src, r) for r in (0, 1)], shard(fsdp_ckpt, 0) + shard(fsdp_ckpt, 1)
    assert sum(ddp_sizes) < 1.2 * fsdp_total and min(ddp_sizes) > 0.2 * max(ddp_sizes), (ddp_sizes, fsdp_total)
    switched = runs["storage"] / "switched"
    assert checkpointing.read_meta(switched / "checkpoint_00000010")["strategy"] == "ddp"
    assert "at step 10" in runs["printed"]["switched@20"]
    s = summary(switched)
    assert s["strategy"] == "fsdp" and s["global_step"] == STEPS and s["restarts"] == 1
    got, ddp = losses(switched), losses(runs["storage"] / "ddp")
    assert sorted(got) == list(range(1, STEPS + 1))
    for step in got:
        assert got[step] == pytest.approx(ddp[step], rel=1e-5), step


@pytest.mark.slow
def test_export_consolidates_the_fsdp_shards_into_one_safetensors_file(runs, tmp_path):
    """trainers/commands/export.py: the 2-rank FSDP checkpoint of the run's last step, as one file that loads without Stride
    and into the task's model with load_state_dict: the run's final weights exactly."""
    from safetensors.torch import load_file

    from stride.trainers.models import CharGPT

    run, out = runs["storage"] / "fsdp", tmp_path / "model.safetensors"
    r = run_cli_forked(["-m", "stride", "export", str(run), str(out)], timeout=120)  # a run folder: its newest checkpoint
    assert r.returncode == 0, r.stderr[-3000:]
    info = json.loads(r.stdout.strip().splitlines()[-1])
    assert info["step"] == str(STEPS) and info["checkpoint"].endswith(f"checkpoint_{STEPS:08d}")
    # Plain safetensors: another interpreter loads it with torch and safetensors alone.
    probe = subprocess.run([PYTHON, "-c", "import sys; from safetensors.torch import load_file; "
                            f"w = load_file({str(out)!r}); print(sorted(w)[0], tuple(w['tok_emb.weight'].shape)); "
                            "assert not any(m == 'stride' or m.startswith('stride.') for m in sys.modules)"],
                           cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert probe.returncode == 0 and "(256, 32)" in probe.stdout, probe.stderr[-2000:]
    model = CharGPT(256, 32, 2, 2, 32)
    model.load_state_dict(load_file(out))  # strict: every tensor named as the model names it
    checksum = float(sum(p.detach().double().sum() for p in model.parameters()))
    assert checksum == pytest.approx(summary(run)["param_checksums"][0], rel=1e-12)
    # An existing file is never overwritten without --force; the refusal is one line.
    again = run_cli_forked(["-m", "stride", "export", str(run), str(out)], timeout=120)
    assert again.returncode == 2 and "--force" in again.stderr and "Traceback" not in again.stderr


@pytest.mark.slow
def test_activation_checkpointing_under_fsdp_gives_bitwise_the_same_losses(runs):
    """Every block recomputes its activations (dropout included) in the backward pass: on CPU the run is bitwise
    the one that kept them. That a checkpointed block really runs its forward again under FSDP, replaying its
    dropout, is checked inside the step (STEP_CHECKS, 4); here, that the run applied it."""
    # Both of char_gpt's blocks were checkpointed, none in the run that kept them: the equality below compares two
    # ways of computing the gradients, not one run with itself.
    assert summary(runs["storage"] / "drop_ac")["activation_checkpointed_blocks"] == 2
    assert summary(runs["storage"] / "drop")["activation_checkpointed_blocks"] == 0
    plain, checked = losses(runs["storage"] / "drop"), losses(runs["storage"] / "drop_ac")
    assert sorted(plain) == list(range(1, 11)) and checked == plain
    assert summary(runs["storage"] / "drop_ac")["param_checksums"] == summary(runs["storage"] / "drop")["param_checksums"]
    assert summary(runs["storage"] / "drop_ac")["val_loss"] == summary(runs["storage"] / "drop")["val_loss"]


@pytest.mark.slow
def test_compiled_blocks_under_fsdp_train_like_eager(runs):
    """train.compile=auto (blocks under FSDP; inductor on CPU) with every other block checkpointed: the eager FSDP run's first 10 steps
    (the schedule depends on the step only) up to the float rounding of fused kernels, and checkpoints with the same
    tensor names (a compiled run's checkpoint is any run's)."""
    # Both switches reached the model (2 blocks compiled, 1 of 2 checkpointed) and inductor generated code for this
    # run: an eager run would pass the comparison below as well.
    s = summary(runs["storage"] / "compiled")
    assert s["compiled_modules"] == 2 and s["activation_checkpointed_blocks"] == 1
    assert list(runs["inductor"].rglob("*.py")), "inductor generated no code: nothing was compiled"
    eager, compiled = losses(runs["storage"] / "fsdp"), losses(runs["storage"] / "compiled")
    assert sorted(compiled) == list(range(1, 11))
    for step in compiled:
        assert compiled[step] == pytest.approx(eager[step], rel=1e-5), step
    names = lambda run: sorted(checkpointing.saved_model_shapes(checkpointing.newest_complete(run)))  # noqa: E731
    assert names(runs["storage"] / "compiled") == names(runs["storage"] / "fsdp")


@pytest.mark.slow
def test_bf16_with_accumulation_under_fsdp_trains(runs):
    run = runs["storage"] / "bf16"
    s = summary(run)
    assert s["status"] == "completed" and s["precision"] == "bf16" and s["strategy"] == "fsdp" and s["global_step"] == 10
    assert s["samples_seen"] == 10 * 8 * 2 * 2
    curve = losses(run)
    assert curve[10] < curve[1] and s["val_loss"] < s["initial_val_loss"]
    # bf16 compute really ran: the untrained model's val loss differs from fp32's, but only by bf16 rounding.
    fp32 = summary(runs["storage"] / "fsdp")["initial_val_loss"]
    assert s["initial_val_loss"] != fp32 and s["initial_val_loss"] == pytest.approx(fp32, rel=1e-2)
    # The sharded master weights stay fp32: the same bytes per worker as an fp32 run.
    assert s["param_bytes_per_worker"] == summary(runs["storage"] / "fsdp")["param_bytes_per_worker"]


STEP_CHECKS = r'''
import math, sys
import torch, torch.distributed as dist
from stride.trainers import blocks, fsdp
from stride.trainers.models import CharGPT
from stride.trainers.step import Precision, train_step

def ce(model, batch):
    x, y = batch
    logits = model(x)
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))

dist.init_process_group("gloo")
rank = dist.get_rank()
cpu = torch.device("cpu")
fp32 = Precision.create("fp32", cpu, sharded=True)

def model(precision=fp32, shard=True):
    torch.manual_seed(0)
    m = CharGPT(256, 16, 2, 2, 32)
    return fsdp.shard_model(m, list(m.blocks), cpu, fsdp.Mesh.flat(2), precision.fsdp_param_dtype) if shard else m

def full(m):
    return torch.cat([p.full_tensor().flatten() if hasattr(p, "full_tensor") else p.detach().flatten() for p in m.parameters()])

torch.manual_seed(1)
data = torch.randint(0, 256, (2, 2, 4, 17))  # [micro-step, rank, rows, tokens]

# 1. Two accumulated micro-steps per rank under FSDP (no reduce-scatter on the first) = one process on all rows.
m = model()
sgd = torch.optim.SGD(m.parameters(), lr=0.5)
micro = [(data[i, rank, :, :-1], data[i, rank, :, 1:]) for i in range(2)]
r = train_step(ce, m, sgd, fp32.grad_scaler(), fp32, micro, grad_clip_norm=None)
ref = model(Precision.create("fp32", cpu), shard=False)
ref_sgd = torch.optim.SGD(ref.parameters(), lr=0.5)
both = [(data[i].reshape(8, 17)[:, :-1], data[i].reshape(8, 17)[:, 1:]) for i in range(2)]
rr = train_step(ce, ref, ref_sgd, torch.amp.GradScaler("cpu", enabled=False), Precision.create("fp32", cpu), both, None)
assert r.finite and math.isclose(r.grad_norm, rr.grad_norm, rel_tol=1e-5), (r.grad_norm, rr.grad_norm)
assert torch.allclose(full(m), full(ref), rtol=1e-5, atol=1e-7), (full(m) - full(ref)).abs().max()

# 1b. optim.groups' norms under FSDP: each group's, reduced over the shards, equals the unsharded model's.
def halves(mod):
    ps = list(mod.parameters())
    return [ps[: len(ps) // 2], ps[len(ps) // 2:]]

gm, gref = model(), model(Precision.create("fp32", cpu), shard=False)
g = train_step(ce, gm, torch.optim.SGD(gm.parameters(), lr=0.5), fp32.grad_scaler(), fp32, micro, 1.0,
               groups=halves(gm))
gg = train_step(ce, gref, torch.optim.SGD(gref.parameters(), lr=0.5), torch.amp.GradScaler("cpu", enabled=False),
                Precision.create("fp32", cpu), both, 1.0, groups=halves(gref))
assert torch.allclose(g.group_norms, gg.group_norms, rtol=1e-5), (g.group_norms, gg.group_norms)
assert math.isclose(g.read()[1], float(torch.linalg.vector_norm(g.group_norms)), rel_tol=1e-6)

# 2. A NaN in one rank's gradient shard only: the clipped norm is NaN on every rank, and no rank steps.
class Poison(torch.amp.GradScaler):
    def unscale_(self, optimizer):
        if rank == 1:
            next(iter(m.parameters())).grad.to_local().view(-1)[0] = float("nan")
before = full(m).clone()
r = train_step(ce, m, sgd, Poison("cpu", enabled=False), fp32, micro, grad_clip_norm=1.0)
assert not r.finite and math.isnan(r.grad_norm), r
assert torch.equal(full(m), before)

# 3. bf16 under FSDP: MixedPrecisionPolicy computes in bf16 (no autocast), the sharded weights stay fp32.
bf16 = Precision.create("bf16", cpu, sharded=True)
assert bf16.fsdp_param_dtype == torch.bfloat16 and not torch.is_autocast_enabled("cpu")
with bf16.autocast():
    assert not torch.is_autocast_enabled("cpu")
with Precision.create("bf16", cpu).autocast():
    assert torch.is_autocast_enabled("cpu")  # DDP keeps autocast
mb = model(bf16)
with torch.no_grad():
    assert mb(data[0, rank, :, :-1]).dtype == torch.bfloat16
mb.reshard()
assert all(p.dtype == torch.float32 for p in mb.parameters())
r = train_step(ce, mb, torch.optim.AdamW(mb.parameters(), lr=1e-3), bf16.grad_scaler(), bf16, micro, 1.0)
assert r.finite

# 4. Activation checkpointing under FSDP (every other block, as train.activation_checkpointing_every=2): the checked
# block runs its forward again in the backward pass (FSDP all-gathers its parameters for that), the other does not;
# dropout replays its draws there, so the gradients are bitwise those of the model that kept its activations.
def dropout_model(every):
    torch.manual_seed(0)
    m = CharGPT(256, 16, 2, 2, 32, dropout=0.1)
    if every:
        assert blocks.checkpoint_activations(list(m.blocks), every) == 1
    # Calls into each block's inner modules. Pre-hooks: the recomputation stops once it has what the backward needs
    # (torch's early stop), so a module's forward may be entered again without returning.
    calls = [0] * len(m.blocks)
    for i, block in enumerate(m.blocks):
        for inner in block.modules():
            if inner is not block:
                inner.register_forward_pre_hook(lambda *_, i=i: calls.__setitem__(i, calls[i] + 1))
    return fsdp.shard_model(m, list(m.blocks), cpu, fsdp.Mesh.flat(2), None), calls

grads = []
for every in (None, 2):
    m, calls = dropout_model(every)
    torch.manual_seed(2)
    loss = ce(m, micro[0])
    forward = list(calls)
    loss.backward()
    again = [c - f for c, f in zip(calls, forward)]
    assert (again[0] > 0 if every else again[0] == 0) and again[1] == 0, (every, forward, again)
    grads.append([p.grad.to_local().clone() for p in m.parameters()])
assert len(grads[0]) == len(grads[1]) and all(torch.equal(a, b) for a, b in zip(*grads))
print(f"rank {rank} ok", flush=True)
# As trainers/torchrun.py ends a rank: left to interpreter finalization, gloo's threads can abort a finished rank.
from stride.trainers.launch.torchrun import leave_gang
import os
leave_gang()
os._exit(0)
'''


@pytest.mark.slow
def test_accumulation_nonfinite_shard_and_bf16_inside_the_step(tmp_path):
    script = tmp_path / "step_checks.py"
    script.write_text(STEP_CHECKS)
    r = torchrun(2, [str(REPO)], script=str(script))
    assert "rank 0 ok" in r.stdout and "rank 1 ok" in r.stdout


@pytest.mark.slow
def test_a_torchrun_fsdp_checkpoint_resumes_on_ray_and_ends_where_torchrun_did(runs, small_text, ray_cluster):
    """The same loop on Ray Train (sharding in the loop, not prepare_model): 10 FSDP steps under torchrun (the
    batch's "ray@10"), then the same run on 2 Ray workers resumes from that checkpoint (through
    lifecycle.check_resume) to 20 and ends where torchrun's uninterrupted run did."""
    storage = runs["storage"]
    r = run_cli(["trainers/main.py", *tiny_args(small_text, storage, "ray", STEPS, "train.strategy=fsdp",
                                                "scaling.num_workers=2")], env=ray_cluster)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "at step 10" in r.stdout
    s, ref = summary(storage / "ray"), summary(storage / "fsdp")
    assert s["status"] == "completed" and s["strategy"] == "fsdp" and s["global_step"] == STEPS and s["restarts"] == 1
    assert s["param_bytes_per_worker"] == ref["param_bytes_per_worker"]
    assert s["param_checksums"][0] == s["param_checksums"][1] == pytest.approx(ref["param_checksums"][0], rel=1e-6)
    got, expected = losses(storage / "ray"), losses(storage / "fsdp")
    assert sorted(got) == list(range(1, STEPS + 1))
    for step in expected:
        assert got[step] == pytest.approx(expected[step], rel=1e-6), step


@pytest.mark.slow
def test_mlp_under_fsdp_matches_ddp(runs):
    """The tabular MLP: hidden Linears sharded one group each, the output layer with the root."""
    a, b = summary(runs["storage"] / "mlp_ddp"), summary(runs["storage"] / "mlp_fsdp")
    assert a["strategy"] == "ddp" and b["strategy"] == "fsdp" and b["val_accuracy"] > 0.5
    assert b["val_loss"] == pytest.approx(a["val_loss"], rel=1e-5)
    assert b["param_checksums"][0] == pytest.approx(a["param_checksums"][0], rel=1e-6)
    assert sum(b["param_bytes_per_worker"]) == a["param_bytes_per_worker"][0]
    assert max(b["param_bytes_per_worker"]) <= 0.51 * a["param_bytes_per_worker"][0]
    for step, loss in losses(runs["storage"] / "mlp_ddp").items():
        assert losses(runs["storage"] / "mlp_fsdp")[step] == pytest.approx(loss, rel=1e-5)


# ---- scaling.use_gpu: the torchrun launcher refuses what Ray's driver refuses -------------------------------------

def test_both_launchers_share_one_gpu_rule():
    """ray_cluster.connect.gpu_shortfall: Ray's driver asks it of the cluster, trainers/torchrun.py of its node's
    CUDA devices (one per process)."""
    from stride.trainers.launch.scaling import gpu_shortfall

    assert gpu_shortfall(False, 4, 0) is None and gpu_shortfall("auto", 4, 0) is None  # the CPU: asked for, or allowed
    assert gpu_shortfall(True, 2, 2) is None and gpu_shortfall("auto", 1, 8) is None  # a GPU for each worker
    assert gpu_shortfall(True, 2, 0) == ("scaling.use_gpu (true) needs GPUs but the cluster has none; set "
                                         "scaling.use_gpu=false (or auto)")
    assert gpu_shortfall("auto", 4, 2, workers_key="--nproc-per-node", where="this node") == (
        "--nproc-per-node (4) with scaling.use_gpu=auto needs 4 GPUs but this node has 2; use --nproc-per-node=2 or "
        "scaling.use_gpu=false")


def test_torchrun_refuses_use_gpu_on_a_machine_without_cuda(tmp_path, tabular_data):
    """Ray's driver refuses it (exit 2); without the same check the torchrun launcher would train on the CPU. One
    process (no launcher needed; a forked child): refused before anything is written."""
    r = run_cli_forked(["trainers/torchrun.py", *tiny(f"{tmp_path}/runs", tabular_data, 5, "scaling.use_gpu=true",
                                                      name=None, config="trainers/configs/tabular_mlp.yaml")],
                       env={"CUDA_VISIBLE_DEVICES": ""}, timeout=120)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and "Traceback" not in r.stderr and len(lines) == 1, r.stdout[-2000:] + r.stderr[-2000:]
    assert lines[0] == ("stride: error: scaling.use_gpu (true) needs GPUs but this node has none; set "
                        "scaling.use_gpu=false (or auto)")
    assert not (tmp_path / "runs").exists()  # nothing written: no run folder, no checkpoint, no summary
