"""train.strategy=hsdp (shard within a group, replicate across groups) and train.fsdp.offload=cpu (issue 47).

First the layout alone (fsdp.plan_mesh, a function of each rank's node) and the refusals. Then one torchrun launch
of 4 CPU ranks with gloo: DDP, HSDP with 2 groups of 2 and HSDP with CPU offload; the HSDP checkpoint of step 10
resumed by 2 ranks under fsdp, whose step 20 is resumed by 1 rank under ddp, ends where the uninterrupted HSDP run
did. Last, the two-node local Ray cluster: the shard groups are the nodes, and a shard size of 4 is one group over
both, said in one warning."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest

from conftest import run_cli_forked
from runs import launch, losses, tiny

from stride.trainers import fsdp
from stride.trainers.config import check_mesh_fits
from stride.trainers.config_reader import load_config
from stride.trainers.run import checkpointing

STEPS = 30


# ---- the layout: which ranks shard together -------------------------------------------------------------------

def test_shard_groups_are_the_nodes_whatever_order_the_ranks_came_in():
    mesh = fsdp.plan_mesh("hsdp", None, ["a", "b", "a", "b"])  # default size: the workers per node
    assert mesh.groups == ((0, 2), (1, 3)) and (mesh.shard_size, mesh.replicas) == (2, 2) and mesh.notes == ()
    assert mesh.summary(["a", "b", "a", "b"])["group_nodes"] == [["a"], ["b"]]


def test_a_group_over_two_nodes_is_named_in_one_note():
    mesh = fsdp.plan_mesh("hsdp", 4, ["a", "a", "b", "b"])
    assert mesh.groups == ((0, 1, 2, 3),) and len(mesh.notes) == 1
    assert "shard group 0 (ranks 0, 1, 2, 3) spans nodes a, b" in mesh.notes[0]
    assert "train.fsdp.shard_size=2" in mesh.notes[0]


def test_a_size_that_does_not_divide_the_workers_becomes_the_largest_that_does():
    # An elastic resize to 6 workers with shard_size 4: groups of 3, said once.
    mesh = fsdp.plan_mesh("hsdp", 4, ["a"] * 6)
    assert mesh.groups == ((0, 1, 2), (3, 4, 5))
    assert mesh.notes == ("train.fsdp.shard_size (4) does not divide the 6 workers: shard groups of 3 ranks",)


def test_fsdp_is_one_group_of_every_rank():
    assert fsdp.plan_mesh("fsdp", None, ["a", "b", "a"]) == fsdp.Mesh.flat(3) == fsdp.Mesh("fsdp", ((0, 1, 2),))


@pytest.mark.parametrize("workers, overrides, words", [
    (4, ["train.fsdp.shard_size=3"], ["train.fsdp.shard_size (3) does not divide the 4 workers",
                                      "train.fsdp.shard_size=2"]),
    (1, [], ["train.strategy (hsdp) needs two workers or more"]),
])
def test_a_layout_the_workers_cannot_hold_is_one_line(workers, overrides, words):
    """The check of the Ray driver (once it knows the worker count) and of the gang (torchrun's ranks)."""
    from stride.errors import UsageError

    cfg = load_config("trainers/configs/tabular_mlp.yaml", ["train.strategy=hsdp", *overrides])
    with pytest.raises(UsageError) as e:
        check_mesh_fits(cfg, workers)
    assert all(w in str(e.value) for w in words) and "\n" not in str(e.value), str(e.value)
    elastic = load_config("trainers/configs/tabular_mlp.yaml",
                          ["train.strategy=hsdp", *overrides, "scaling.num_workers=[2,4]", "train.batch_size_per_worker=66"])
    check_mesh_fits(elastic, workers)  # an elastic run adapts (plan_mesh) instead


def test_offload_without_sharding_is_refused_by_the_config():
    from stride.errors import ConfigError

    with pytest.raises(ConfigError) as e:
        load_config("trainers/configs/tabular_mlp.yaml", ["train.fsdp.offload=cpu"])
    assert "train.fsdp.offload (cpu) needs a sharded model" in str(e.value) and "train.strategy=fsdp" in str(e.value)


@pytest.mark.slow
def test_the_ray_driver_refuses_an_hsdp_layout_with_exit_2_and_one_line_before_any_worker(ray_cluster, tmp_path,
                                                                                           tabular_data):
    r = launch.ray(tiny(tmp_path, tabular_data, 2, "train.strategy=hsdp", "scaling.num_workers=4",
                        "scaling.cpus_per_worker=0.5", "train.fsdp.shard_size=3"), ray_cluster, timeout=300)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stdout[-2000:] + r.stderr[-2000:]
    lines = [line for line in (r.stdout + r.stderr).splitlines() if "shard_size" in line]
    assert len(lines) == 1 and "does not divide the 4 workers" in lines[0], r.stdout[-2000:] + r.stderr[-2000:]
    assert not list(tmp_path.rglob("checkpoint_*")) and not list(tmp_path.rglob("metrics.jsonl"))


# ---- training: torchrun, 4 ranks ---------------------------------------------------------------------------------

def gpt_args(data, storage, name, steps, batch, *extra):
    # optim.warmup_steps > steps: the lr depends on the step alone, so a run resumed at 10 or 20 follows the same
    # schedule; the global micro-batch is 16 rows at every world size (4 x 4, 2 x 8, 1 x 16).
    return tiny(storage, data, steps, "model.n_layers=2", "model.width=32", "model.n_heads=2", "model.context=32",
                f"train.batch_size_per_worker={batch}", "train.log_every_steps=1", "train.eval_every_steps=10",
                "checkpoint.every_steps=10", "checkpoint.keep_last=5", "optim.warmup_steps=50",
                "train.deterministic=true", "scaling.use_gpu=false", "scaling.cpus_per_worker=0.5", *extra, name=name,
                config="trainers/configs/char_gpt.yaml")


def summary(run_dir) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


@pytest.fixture(scope="module")
def runs(tmp_path_factory, text_data):
    """ddp, hsdp (shard 2) and hsdp with offload, 4 ranks, in one torchrun launch (tests/torchrun_cases.py); then
    hsdp's step-10 checkpoint resumed by 2 ranks under fsdp to step 20, and that one by 1 rank under ddp to 30."""
    storage = tmp_path_factory.mktemp("hsdp_runs")
    hsdp = ["train.strategy=hsdp", "train.fsdp.shard_size=2"]
    cases = [{"label": name, "args": gpt_args(text_data, storage, name, steps, 4, *extra)}
             for name, steps, extra in (("ddp", STEPS, []), ("hsdp", STEPS, hsdp),
                                        ("offload", 10, [*hsdp, "train.fsdp.offload=cpu"]),
                                        # what works under fsdp works under hsdp: activation checkpointing, bf16,
                                        # accumulation (sync at the last micro-step), clipping. (Compiled blocks: the
                                        # fsdp path, test_fsdp.py; the mesh does not change what is compiled.)
                                        ("together", 6, [*hsdp, "train.precision=bf16",
                                                         "train.activation_checkpointing=true",
                                                         "train.grad_accum_steps=2", "optim.grad_clip_norm=0.5",
                                                         "train.batch_size_per_worker=2"]))]
    # torchrun's 4 ranks, which scaling.num_workers does not name: the gang refuses a size that does not divide them.
    cases.append({"label": "refused", "args": gpt_args(text_data, storage, "refused", 2, 4, *hsdp[:1],
                                                       "train.fsdp.shard_size=3")})
    results = tmp_path_factory.mktemp("hsdp_cases")
    (results / "cases.json").write_text(json.dumps(cases))
    r = launch.torchrun([str(results / "cases.json"), str(results)], nproc=4, entry=("tests/torchrun_cases.py",))
    done = {c["label"]: c for c in json.loads((results / "rank0.json").read_text())}
    assert [done[c["label"]]["code"] for c in cases] == [0, 0, 0, 0, 2], r.stdout[-3000:] + r.stderr[-3000:]
    resumed = {}
    for name, src, step, nproc, batch, strategy in (("fsdp2", "hsdp", 10, 2, 8, "fsdp"),
                                                     ("ddp1", "fsdp2", 20, 1, 16, "ddp"),
                                                     ("hsdp4", "fsdp2", 20, 4, 4, "hsdp")):
        (storage / name).mkdir()
        shutil.copytree(storage / src / f"checkpoint_{step:08d}", storage / name / f"checkpoint_{step:08d}")
        layout = ["train.fsdp.shard_size=2"] if strategy == "hsdp" else []
        r = launch.torchrun(gpt_args(text_data, storage, name, step + 10, batch, f"train.strategy={strategy}",
                                     *layout), nproc=nproc)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        resumed[name] = r.stdout + r.stderr
    return {"storage": storage, "resumed": resumed, "refused": done["refused"]}


@pytest.mark.slow
def test_a_shard_size_that_does_not_divide_torchruns_ranks_is_exit_2_and_one_line(runs):
    refused = runs["refused"]
    lines = [line for line in refused["stderr"].splitlines() if "shard_size" in line]
    assert refused["exception"] is None and "Traceback" not in refused["stderr"]
    assert len(lines) == 1 and "train.fsdp.shard_size (3) does not divide the 4 workers" in lines[0], refused
    assert "train.fsdp.shard_size=2" in lines[0]


@pytest.mark.slow
def test_hsdp_shards_within_groups_of_two_and_each_rank_holds_half(runs):
    from stride.trainers.models import CharGPT

    s = summary(runs["storage"] / "hsdp")
    assert s["status"] == "completed" and s["strategy"] == "hsdp" and s["world_size"] == 4
    assert s["mesh"]["shard_size"] == 2 and s["mesh"]["replicas"] == 2 and s["mesh"]["groups"] == [[0, 1], [2, 3]]
    full = sum(p.numel() for p in CharGPT(256, 32, 2, 2, 32).parameters()) * 4  # fp32, the tied head once
    held = s["param_bytes_per_worker"]
    assert all(abs(b - full / 2) <= 0.01 * full for b in held), (held, full)
    assert held[0] + held[1] == full and held[2] + held[3] == full  # each group one whole copy
    assert len(set(s["param_checksums"])) == 1  # every rank gathers the same full parameters
    ckpt = checkpointing.newest_complete(runs["storage"] / "hsdp")
    assert checkpointing.read_meta(ckpt)["strategy"] == "hsdp" and checkpointing.verify(ckpt) is None


@pytest.mark.slow
def test_hsdp_losses_equal_ddp_to_float_rounding(runs):
    """Both average the same 16 rows' gradients; HSDP reduce-scatters within a group, then all-reduces the shard
    across the groups, DDP all-reduces whole buckets: the sums' order differs, so the losses agree to float32
    rounding, not bitwise (observed: within 1e-6 relative over 30 steps)."""
    ddp, hsdp = losses(runs["storage"] / "ddp"), losses(runs["storage"] / "hsdp")
    assert sorted(ddp) == sorted(hsdp) == list(range(1, STEPS + 1))
    for step in ddp:
        assert hsdp[step] == pytest.approx(ddp[step], rel=1e-5), step
    assert hsdp[STEPS] < hsdp[1] - 0.2  # it trains
    assert summary(runs["storage"] / "hsdp")["val_loss"] == pytest.approx(summary(runs["storage"] / "ddp")["val_loss"],
                                                                           rel=1e-5)


@pytest.mark.slow
def test_offloaded_hsdp_keeps_the_state_on_the_cpu_and_trains_bitwise_like_hsdp(runs):
    offload, hsdp = losses(runs["storage"] / "offload"), losses(runs["storage"] / "hsdp")
    assert sorted(offload) == list(range(1, 11))
    assert all(offload[step] == hsdp[step] for step in offload)
    # Where the state lives between steps, as the run found it. (On this CPU-only machine every tensor is on the
    # CPU either way: here the figure is the losses'; on a GPU, the devices tell offload from not.)
    s = summary(runs["storage"] / "offload")
    assert s["offload"] == "cpu" and s["state_devices"] == {"parameters": ["cpu"], "optimizer_state": ["cpu"]}
    assert summary(runs["storage"] / "hsdp")["offload"] == "none"


@pytest.mark.slow
def test_an_hsdp_checkpoint_resumes_under_fsdp_on_2_then_ddp_on_1_and_ends_where_hsdp_did(runs):
    storage = runs["storage"]
    assert "at step 10" in runs["resumed"]["fsdp2"] and "at step 20" in runs["resumed"]["ddp1"]
    two, one, hsdp = summary(storage / "fsdp2"), summary(storage / "ddp1"), summary(storage / "hsdp")
    assert (two["strategy"], two["world_size"], one["strategy"], one["world_size"]) == ("fsdp", 2, "none", 1)
    got = {**losses(storage / "fsdp2"), **losses(storage / "ddp1")}
    want = losses(storage / "hsdp")
    assert sorted(got) == list(range(11, STEPS + 1))
    for step in got:
        assert got[step] == pytest.approx(want[step], rel=1e-5), step
    assert one["global_step"] == STEPS and one["param_checksums"][0] == pytest.approx(hsdp["param_checksums"][0],
                                                                                     rel=1e-6)


@pytest.mark.slow
def test_an_fsdp_checkpoint_of_2_ranks_resumes_under_hsdp_on_4(runs):
    storage = runs["storage"]
    assert "at step 20" in runs["resumed"]["hsdp4"]
    s = summary(storage / "hsdp4")
    assert (s["strategy"], s["world_size"], s["mesh"]["groups"]) == ("hsdp", 4, [[0, 1], [2, 3]])
    got, want = losses(storage / "hsdp4"), losses(storage / "hsdp")
    assert sorted(got) == list(range(21, STEPS + 1))
    for step in got:
        assert got[step] == pytest.approx(want[step], rel=1e-5), step


@pytest.mark.slow
def test_checkpointing_bf16_accumulation_and_clipping_work_under_hsdp(runs):
    s = summary(runs["storage"] / "together")
    assert s["status"] == "completed" and s["strategy"] == "hsdp" and s["precision"] == "bf16"
    assert s["activation_checkpointed_blocks"] > 0, s
    lines = [x for x in map(json.loads, (runs["storage"] / "together" / "metrics.jsonl").read_text().splitlines())
             if "train_loss" in x]
    assert len(lines) == 6 and all(x["grad_norm"] > 0 and 0 <= x["clipped"] <= 1 for x in lines)
    assert lines[-1]["train_loss"] < lines[0]["train_loss"]


@pytest.mark.slow
def test_export_consolidates_an_hsdp_run_into_one_file(runs, tmp_path):
    from safetensors.torch import load_file

    out = tmp_path / "model.safetensors"
    r = run_cli_forked(["-m", "stride", "export", str(runs["storage"] / "hsdp"), str(out)], timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    state = load_file(out)
    ckpt = checkpointing.newest_complete(runs["storage"] / "hsdp")
    full = checkpointing.load_model_state(ckpt)
    assert state.keys() <= full.keys() and all((state[k] == full[k]).all() for k in state)
    assert state["tok_emb.weight"].shape == (256, 32)
