"""init.from (trainers/pretrained.py): pretrained weights read from every format Stride accepts land in the model
exactly; names are matched, renamed and selected as the config says; and whatever a user can get wrong is one line
naming the key and the fix, never a traceback and never an unpickled object."""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from safetensors.torch import save_file

from stride.trainers.run import checkpointing
from stride.trainers import pretrained as pt
from stride.errors import ConfigError

UNPICKLED = []  # what an unrestricted unpickler would have run


def _ran(what: str) -> None:
    UNPICKLED.append(what)


class Payload:
    """Would run code when unpickled: its __reduce__ makes the unpickler call _ran."""

    def __reduce__(self):
        return (_ran, ("Payload",))


class TwoPart(nn.Module):
    def __init__(self, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.encoder = nn.Linear(4, 3)
        self.decoder = nn.Linear(3, 2)
        self.register_buffer("scale", torch.full((2,), float(seed + 1)))  # persistent
        self.register_buffer("cache", torch.zeros(1), persistent=False)


class Wrapped(nn.Module):
    def __init__(self, seed: int = 0):
        super().__init__()
        self.model = TwoPart(seed)


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _init(model, location, **kw):
    args = dict(strict=True, include=[], exclude=[], rename=[]) | kw
    return pt.init_model(model, str(location), **args)


def _error(fn, *args, **kw) -> str:
    with pytest.raises(ConfigError) as e:
        fn(*args, **kw)
    message = str(e.value)
    assert "\n" not in message, message  # one line: no traceback is shown
    return message


@pytest.fixture
def weights(tmp_path) -> Path:
    path = tmp_path / "two.safetensors"
    save_file(TwoPart(seed=1).state_dict(), str(path))
    return path


# ---- the formats ----

def test_a_safetensors_file_round_trips(weights):
    model = TwoPart(seed=2)
    plan = _init(model, weights)
    assert _equal(model.state_dict(), TwoPart(seed=1).state_dict())
    assert plan.record() == {"from": str(weights), "sha256": hashlib.sha256(weights.read_bytes()).hexdigest(),
                             "loaded": 5, "missing": 0, "unexpected": 0, "mismatched": 0,
                             "parameters_loaded": 23}  # the buffer `scale` is loaded, but no parameter
    assert "loaded" in plan.table() and "encoder.weight" in plan.table()
    with pt.open_source(str(weights)) as source:
        assert source.kind == "safetensors" and source.location == str(weights)
        assert source.infos()["encoder.weight"] == pt.TensorInfo((3, 4), torch.float32)
        # a slice reads just that slice
        assert torch.equal(source.read("encoder.weight", (slice(1, 3), slice(0, 4))),
                           TwoPart(seed=1).encoder.weight[1:3].detach())


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory):
    """A tiny GPT-2 saved as Hugging Face does, in shards with an index; (config, folder, its state)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_embd=16, n_layer=2, n_head=2, vocab_size=64, n_positions=32, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(cfg)
    folder = tmp_path_factory.mktemp("hf") / "gpt2"
    model.save_pretrained(folder, max_shard_size="20KB")
    assert len(list(folder.glob("*.safetensors"))) > 1 and (folder / pt.INDEX).exists()
    return cfg, folder, {k: v.clone() for k, v in model.state_dict().items()}


def _fresh_gpt2(cfg):
    from transformers import GPT2LMHeadModel

    torch.manual_seed(1)
    return GPT2LMHeadModel(cfg)


@pytest.mark.parametrize("index", [True, False])
def test_a_hugging_face_folder_loads_every_parameter(gpt2, tmp_path, index):
    cfg, folder, state = gpt2
    if not index:
        folder = Path(shutil.copytree(folder, tmp_path / "noindex"))
        (folder / pt.INDEX).unlink()
    model = _fresh_gpt2(cfg)
    assert not torch.equal(model.transformer.wte.weight, state["transformer.wte.weight"])
    plan = _init(model, folder)  # strict: the tied lm_head.weight is not in the files, and need not be
    assert _equal(model.state_dict(), state)
    assert model.lm_head.weight is model.transformer.wte.weight  # still tied
    assert plan.record()["missing"] == plan.record()["unexpected"] == 0
    with pt.open_source(str(folder)) as source:
        assert source.kind == "safetensors_folder"
        assert source.sha256() == pt._digest((p.name, hashlib.sha256(p.read_bytes()).hexdigest())
                                             for p in folder.glob("*.safetensors"))


def test_an_index_naming_a_file_outside_the_folder_is_refused(gpt2, tmp_path):
    folder = Path(shutil.copytree(gpt2[1], tmp_path / "m"))
    index = (folder / pt.INDEX).read_text()
    (folder / pt.INDEX).write_text(index.replace("model-00001", "../model-00001", 1))
    message = _error(pt.open_source, str(folder))
    assert "init.from" in message and "../model-00001" in message and "not a file of this folder" in message


def test_a_state_dict_of_a_tied_model_loads_under_strict(gpt2, tmp_path):
    """A .pt of model.state_dict() holds the tied weight under both names: neither is unexpected."""
    cfg, _, state = gpt2
    torch.save(state, tmp_path / "gpt2.pt")
    model = _fresh_gpt2(cfg)
    _init(model, tmp_path / "gpt2.pt")
    assert _equal(model.state_dict(), state)


def test_meta_models_are_checked_without_data(gpt2):
    from transformers import GPT2LMHeadModel

    cfg, folder, _ = gpt2
    with torch.device("meta"):
        model = GPT2LMHeadModel(cfg)
    plan = pt.check_init(model, str(folder), strict=True, include=[], exclude=[], rename=[])
    assert plan.loaded_parameters == sum(p.numel() for p in model.parameters())
    infos, optional = pt.model_infos(model)
    assert "lm_head.weight" in infos and "lm_head.weight" in optional  # the tied second name


@pytest.mark.parametrize("wrap", ["plain", "state_dict", "model", "legacy"])
def test_a_pt_state_dict_loads(tmp_path, wrap):
    state = TwoPart(seed=1).state_dict()
    path = tmp_path / "w.pth"
    obj = state if wrap in ("plain", "legacy") else {wrap: state, "epoch": 3}
    torch.save(obj, path, _use_new_zipfile_serialization=wrap != "legacy")
    model = TwoPart(seed=2)
    _init(model, path)
    assert _equal(model.state_dict(), state)
    with pt.open_source(str(path)) as source:
        assert source.kind == "state_dict" and torch.equal(source.read("decoder.bias", (slice(1, 2),)),
                                                           state["decoder.bias"][1:2])


def test_a_folder_with_one_pytorch_model_bin_loads(tmp_path):
    torch.save(TwoPart(seed=1).state_dict(), tmp_path / "pytorch_model.bin")
    (tmp_path / "config.json").write_text("{}")
    model = TwoPart(seed=2)
    _init(model, tmp_path)
    assert _equal(model.state_dict(), TwoPart(seed=1).state_dict())


def test_a_pickled_object_is_refused_never_unpickled(tmp_path):
    path = tmp_path / "evil.pt"
    torch.save({"encoder.weight": torch.ones(3, 4), "extra": Payload()}, path)
    message = _error(pt.open_source, str(path))
    assert message.startswith(f"init.from ({path}) is not a plain state dict: it pickles ")
    assert "_ran" in message and "never unpickles" in message and "safetensors" in message
    assert UNPICKLED == []


def test_a_nested_value_that_is_no_tensor_is_refused(tmp_path):
    torch.save({"encoder.weight": torch.ones(3, 4), "step": 3}, tmp_path / "w.pt")
    message = _error(pt.open_source, str(tmp_path / "w.pt"))
    assert "'step' holds a int, not a tensor" in message and "set init.from=" in message


def test_what_cannot_be_read_is_one_line_naming_it(tmp_path):
    message = _error(pt.open_source, str(tmp_path / "nope"))
    assert message == (f"init.from ({tmp_path / 'nope'}) does not exist; set init.from=<a .safetensors file, a "
                       f"Hugging Face model folder, a .pt state dict or a Stride run folder>")
    (tmp_path / "empty").mkdir()
    assert "is a folder with no .safetensors file" in _error(pt.open_source, str(tmp_path / "empty"))
    (tmp_path / "w.txt").write_text("x")
    assert "is a .txt file" in _error(pt.open_source, str(tmp_path / "w.txt"))
    (tmp_path / "bad.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00garbage!")
    assert "bad.safetensors, which is not a readable safetensors file" in \
        _error(pt.open_source, str(tmp_path / "bad.safetensors"))
    torch.save({"w": torch.ones(100)}, tmp_path / "cut.pt")
    (tmp_path / "cut.pt").write_bytes((tmp_path / "cut.pt").read_bytes()[:300])
    assert "is not a readable state dict" in _error(pt.open_source, str(tmp_path / "cut.pt"))


def test_two_shards_holding_the_same_tensor_are_refused(tmp_path):
    save_file({"w": torch.ones(2)}, str(tmp_path / "a.safetensors"))
    save_file({"w": torch.zeros(2)}, str(tmp_path / "b.safetensors"))
    message = _error(pt.open_source, str(tmp_path))
    assert "tensor w in both a.safetensors and b.safetensors" in message


def _checkpoint(folder: Path, state: dict[str, torch.Tensor], step: int) -> Path:
    writer = checkpointing.CheckpointWriter(0)
    writer.save(folder, {"model": state}, {"step": step})
    writer.wait()
    writer.close()
    return folder


def test_a_stride_run_folder_gives_its_newest_complete_checkpoint(tmp_path):
    run = tmp_path / "run"
    old = TwoPart(seed=1).state_dict()
    old["decoder.bias"] = old["decoder.bias"].double()  # a float64 source casts to the model's float32
    _checkpoint(checkpointing.checkpoint_folder(run, 1), old, 1)
    torn = _checkpoint(checkpointing.checkpoint_folder(run, 2), TwoPart(seed=3).state_dict(), 2)
    (torn / checkpointing.META).unlink()  # a kill before the marker: not complete
    model = TwoPart(seed=2)
    plan = _init(model, run)
    assert _equal(model.state_dict(), {k: v.float() for k, v in old.items()})
    with pt.open_source(str(run)) as source:
        assert source.kind == "stride_checkpoint" and source.location == str(run)
        assert source.infos()["decoder.bias"] == pt.TensorInfo((2,), torch.float64)
        assert source.sha256() == plan.sha256
        assert torch.equal(source.read("encoder.weight", (slice(1, 2), slice(0, 4))), old["encoder.weight"][1:2])
    with pt.open_source(str(checkpointing.checkpoint_folder(run, 1))) as source:
        assert source.sha256() == plan.sha256  # the checkpoint itself, named directly
    model = TwoPart(seed=2)
    _init(model, f"file://{run}")  # a run folder behind a URI: only the checkpoint that verifies is downloaded
    assert _equal(model.state_dict(), {k: v.float() for k, v in old.items()})
    (torn / checkpointing.META).write_text("{}")
    shutil.rmtree(checkpointing.checkpoint_folder(run, 1))
    assert "no complete checkpoint" in _error(pt.open_source, str(run))


# ---- matching names ----

def test_rename_adds_a_prefix(weights):
    model = Wrapped(seed=2)
    plan = _init(model, weights, rename=[["^", "model."]])
    assert _equal(model.model.state_dict(), TwoPart(seed=1).state_dict())
    assert plan.mapping["model.encoder.weight"] == "model.encoder.weight"
    assert "init.strict=false" in _error(_init, Wrapped(), weights)  # unrenamed, nothing matches under strict


@pytest.mark.parametrize("select", [{"include": [r"^encoder\."]}, {"exclude": [r"^decoder\.", "scale"]}])
def test_include_and_exclude_select_the_encoder(weights, select):
    model = TwoPart(seed=2)
    plan = _init(model, weights, **select)
    assert _equal(model.encoder.state_dict(), TwoPart(seed=1).encoder.state_dict())
    assert _equal(model.decoder.state_dict(), TwoPart(seed=2).decoder.state_dict())  # untouched
    assert sorted(plan.mapping) == ["encoder.bias", "encoder.weight"]


def test_an_encoder_only_source_loads_into_half_the_model(tmp_path):
    save_file(TwoPart(seed=1).encoder.state_dict(), str(tmp_path / "enc.safetensors"))
    model = TwoPart(seed=2)
    _init(model, tmp_path / "enc.safetensors", rename=[["^", "encoder."]], include=["^encoder"])
    assert _equal(model.encoder.state_dict(), TwoPart(seed=1).encoder.state_dict())


@pytest.mark.parametrize("key, kw", [("init.include", {"include": ["^decodr"]}),
                                     ("init.exclude", {"exclude": ["lm_head"]}),
                                     ("init.rename", {"rename": [["^transformer", "model"]]})])
def test_a_pattern_matching_nothing_names_its_key(weights, key, kw):
    message = _error(_init, TwoPart(), weights, **kw)
    pattern = next(iter(kw.values()))[0]
    pattern = pattern[0] if isinstance(pattern, list) else pattern
    assert message.startswith(f"{key} pattern {pattern!r} matches none of the") and "fix the pattern" in message
    assert "(first: " in message


def test_a_bad_regex_and_a_collision_are_one_line(weights):
    assert _error(_init, TwoPart(), weights, include=["(["]).startswith("init.include ('([') is not a regular")
    message = _error(_init, TwoPart(), weights, rename=[[r"\.(weight|bias)$", ""]])
    assert "init.rename" in message and "renames both" in message


def test_strict_names_the_missing_tensors(tmp_path):
    state = TwoPart(seed=1).state_dict()
    del state["decoder.bias"], state["scale"]  # a missing buffer is no error
    save_file(state, str(tmp_path / "w.safetensors"))
    message = _error(_init, TwoPart(), tmp_path / "w.safetensors")
    assert message == (f"init.from ({tmp_path / 'w.safetensors'}): 1 model tensors missing (first: decoder.bias) "
                       f"under init.strict=true; rename them with init.rename, select with init.include/init.exclude,"
                       f" or set init.strict=false")
    model = TwoPart(seed=2)
    plan = _init(model, tmp_path / "w.safetensors", strict=False)
    assert plan.missing == ["decoder.bias"] and len(plan.mapping) == 3
    assert torch.equal(model.decoder.weight, TwoPart(seed=1).decoder.weight)
    assert torch.equal(model.decoder.bias, TwoPart(seed=2).decoder.bias)
    assert "missing" in plan.table() and "decoder.bias" in plan.table()


def test_a_shape_mismatch_is_reported_and_not_loaded(tmp_path):
    state = TwoPart(seed=1).state_dict()
    state["encoder.weight"] = torch.ones(4, 3)
    state["extra"] = torch.ones(1)
    save_file(state, str(tmp_path / "w.safetensors"))
    message = _error(_init, TwoPart(), tmp_path / "w.safetensors")
    assert "1 unexpected source tensors (first: extra), 1 mismatched (first: encoder.weight: source (4, 3) " \
           "float32, model (3, 4) float32) under init.strict=true" in message
    model = TwoPart(seed=2)
    plan = _init(model, tmp_path / "w.safetensors", strict=False)
    assert plan.mismatched == ["encoder.weight: source (4, 3) float32, model (3, 4) float32"]
    assert torch.equal(model.encoder.weight, TwoPart(seed=2).encoder.weight)
    assert torch.equal(model.decoder.weight, TwoPart(seed=1).decoder.weight)
    message = _error(_init, TwoPart(), tmp_path / "w.safetensors", strict=False, include=["encoder.weight"])
    assert "no tensor of init.from matches the model" in message


def test_an_int_tensor_does_not_load_into_a_float_one(tmp_path):
    state = TwoPart(seed=1).state_dict()
    state["scale"] = torch.ones(2, dtype=torch.int64)
    save_file(state, str(tmp_path / "w.safetensors"))
    assert "scale: source (2,) int64, model (2,) float32" in _error(_init, TwoPart(), tmp_path / "w.safetensors")


def test_adapt_transposes_on_meta_then_on_the_real_tensors(tmp_path):
    state = TwoPart(seed=1).state_dict()
    state["encoder.weight"] = state["encoder.weight"].t().contiguous()  # stored (in, out), as GPT-2's Conv1D
    save_file(state, str(tmp_path / "w.safetensors"))
    seen = []

    def adapt(tensors):
        seen.append(tensors["encoder.weight"].device.type)
        return tensors | {"encoder.weight": tensors["encoder.weight"].t()}

    model = TwoPart(seed=2)
    _init(model, tmp_path / "w.safetensors", adapt=adapt)
    assert seen == ["meta", "cpu"] and _equal(model.state_dict(), TwoPart(seed=1).state_dict())

    def broken(tensors):
        raise KeyError("qkv")

    message = _error(_init, TwoPart(), tmp_path / "w.safetensors", adapt=broken)
    assert message.startswith("Task.adapt_init_state failed on init.from's tensors (KeyError: 'qkv')")
    assert "returned a list" in _error(_init, TwoPart(), tmp_path / "w.safetensors", adapt=lambda t: list(t))


# ---- URIs, FSDP2 ----

def test_a_file_uri_is_downloaded_and_its_copy_removed(gpt2, weights):
    cfg, folder, state = gpt2
    for uri, kind in ((f"file://{weights}", "safetensors"), (f"file://{folder}", "safetensors_folder")):
        source = pt.open_source(uri)
        copy = source._temp
        assert source.location == uri and source.kind == kind and oct(os.stat(copy).st_mode & 0o777) == "0o700"
        source.close()
        assert not copy.exists()
    model = _fresh_gpt2(cfg)
    _init(model, f"file://{folder}")
    assert _equal(model.state_dict(), state)
    assert "does not exist" in _error(pt.open_source, f"file://{folder}/nope")


@pytest.fixture
def rank_1_of_2():
    """This process as rank 1 of a two-rank group that does nothing (torch's fake backend): FSDP2 shards the model
    here as it would on rank 1, with no other process."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=2)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_an_fsdp2_rank_reads_only_its_own_rows(weights, rank_1_of_2):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = TwoPart(seed=2)
    model.decoder = nn.Linear(3, 1)  # one row: rank 1 holds none of it
    fully_shard(model, mesh=init_device_mesh("cpu", (2,)))
    reads = []
    with pt.open_source(str(weights)) as source:
        real = source.read
        source.read = lambda name, index=None: reads.append((name, index)) or real(name, index)
        plan = pt.plan_init(source.infos(), pt.model_infos(model)[0], location=source.location, sha256="x",
                            strict=False)
        pt.load_into(model, source, plan)
    want = TwoPart(seed=1)
    assert torch.equal(model.encoder.weight.to_local(), want.encoder.weight[2:3])  # rows 2.. of 3: chunk of rank 1
    assert torch.equal(model.encoder.bias.to_local(), want.encoder.bias[2:3])
    assert ("encoder.weight", (slice(2, 3), slice(0, 4))) in reads
    assert not any(name.startswith("decoder") for name, _ in reads)
