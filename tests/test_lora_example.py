"""Fine-tuning from Hugging Face weights: init.from a `save_pretrained` folder (the hf_causal_lm example's GPT-2),
and the LoRA example (examples/lora: peft adapters on a frozen base, checkpoint.trainable_only, export
--trainable-only), end to end.

One process each (trainers/torchrun.py, no Ray), in copies of the example folders made by tests/test_examples.py's
helpers. The LoRA example imports its sibling ../hf_causal_lm/hf_lm_task.py, so both folders are copied side by side.
One LoRA run (module fixture) serves the tests that only read it; those that change it work on a copy.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import math
import shutil
import sys
from pathlib import Path

import peft  # noqa: F401  (the test extra installs transformers and peft: a missing one is an error, not a skip)
import pyarrow.parquet as pq
import pytest
import torch
import transformers  # noqa: F401
import yaml

from conftest import REPO, run_cli_forked
from runs import OVERLAY
from test_examples import EXAMPLES, TORCHRUN, check, example, train

EXPORT = ["-m", "stride", "export"]
# The LoRA run of the fixture: 20 steps, a checkpoint every 10, both kept (the resume test starts from step 10).
LORA_STEPS = ("train.max_steps=20", "train.eval_every_steps=20", "train.log_every_steps=10",
              "checkpoint.every_steps=10", "checkpoint.keep_last=2", "train.deterministic=true")
GEN_TOKENS = 32  # generate.py's sampled text: long enough that the trained adapters change it from the base's
LORA_PREPARE = ("--max-chars", "300000", "--steps", "30")  # small data, a briefly pretrained base: seconds


@contextlib.contextmanager
def task_module(path: Path):
    """The task module at `path`, imported under a name of its own; sys.path and the sibling module a task imports
    (hf_lm_task) are put back afterwards, so nothing of a tmp folder stays importable in this process."""
    path_before, modules_before = list(sys.path), set(sys.modules)
    spec = importlib.util.spec_from_file_location(f"_stride_test_{path.stem}_{abs(hash(path))}", path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.path[:] = path_before
        for name in set(sys.modules) - modules_before:
            if name == "hf_lm_task":
                del sys.modules[name]


def model_section(yaml_path: Path, cls) -> object:
    """The YAML's model section as the task's validated Config (what Stride's config loading gives the task)."""
    return cls.Config(**yaml.safe_load(yaml_path.read_text())["model"])


def val_texts(folder: Path):
    return pq.read_table(folder / "data" / "val", columns=["text"]).column("text").to_numpy(zero_copy_only=False)


@torch.no_grad()
def val_loss(task, model, texts, batch: int = 64) -> float:
    """val_loss as Stride computes it on one worker: the task's loss on batches of max(batch_size_per_worker, 64)
    rows in file order, averaged over rows."""
    task.training = False
    model.eval()
    total, rows = 0.0, 0
    for lo in range(0, len(texts), batch):
        arrays = task.transform({"text": texts[lo:lo + batch]})
        loss = task.loss(model, {k: torch.from_numpy(v) for k, v in arrays.items()})
        total += float(loss.double()) * len(arrays["input_ids"])
        rows += len(arrays["input_ids"])
    return total / rows


def folder_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def tensor_bytes(checkpoint: Path) -> tuple[dict[str, int], int]:
    """The model tensors a DCP checkpoint holds (name -> bytes) and the bytes of all its tensors (model and
    optimizer state), from its .metadata: what the checkpoint stores, without the files' fixed overheads."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    entries = FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata
    size = {k: math.prod(v.size) * v.properties.dtype.itemsize for k, v in entries.items()
            if isinstance(v, TensorStorageMetadata)}
    return {k.removeprefix("model."): n for k, n in size.items() if k.startswith("model.")}, sum(size.values())


def checkpoints(run_dir: Path) -> list[Path]:
    return sorted(run_dir.glob("checkpoint_*"))


# ---- init.from: a transformers save_pretrained folder into the hf_causal_lm example ----

@pytest.mark.slow  # prepare.py and a one-step run: about 15 s
def test_init_from_save_pretrained_gives_transformers_own_loss_at_step_0(tmp_path):
    from tokenizers import Tokenizer
    from transformers import GPT2LMHeadModel

    folder = example("hf_causal_lm", tmp_path, "--max-chars", "300000")
    # A validation split of one evaluation batch (<= 64 rows), so Stride's val_loss is the loss of one forward.
    rows = pq.read_table(folder / "data" / "val").slice(0, 40)
    shutil.rmtree(folder / "data" / "val")
    (folder / "data" / "val").mkdir()
    pq.write_table(rows, folder / "data" / "val" / "part-0.parquet")
    tok = Tokenizer.from_file(str(folder / "data" / "tokenizer.json"))
    facts = {"tokenizer": tok.to_str(), "vocab_size": tok.get_vocab_size(), "eos_id": tok.token_to_id("<|endoftext|>")}
    pretrained = tmp_path / "gpt2_pretrained"
    with task_module(folder / "hf_lm_task.py") as mod:
        config = model_section(folder / "hf_causal_lm.yaml", mod.HFCausalLM)
        torch.manual_seed(123)  # not run.seed: weights Stride's own init would never give
        model = mod.HFCausalLM(config, None, facts).build_model()
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() == 2:  # far from GPT-2's init, so a loss near ln(vocab) cannot pass by chance
                    p.normal_(0.0, 0.2)
        model.save_pretrained(pretrained)
        assert (pretrained / "model.safetensors").is_file()

        s = train(folder, f"init.from={pretrained}", "train.max_steps=1", "train.eval_every_steps=1",
                  "train.deterministic=true", "checkpoint.every_steps=1")
        assert s["init"]["missing"] == 0 and s["init"]["unexpected"] == 0 and s["init"]["loaded"] >= 26, s["init"]
        assert s["facts"]["vocab_size"] == facts["vocab_size"]

        reference = GPT2LMHeadModel.from_pretrained(pretrained).eval()
        task = mod.HFCausalLM(config, None, s["facts"])
        expected = val_loss(task, reference, rows.column("text").to_numpy(zero_copy_only=False))
    assert abs(expected - math.log(facts["vocab_size"])) > 0.05, expected  # the saved weights, not an untrained init
    assert s["initial_val_loss"] == pytest.approx(expected, rel=1e-5)


# ---- the LoRA example ----

@pytest.fixture(scope="module")
def lora_run(tmp_path_factory) -> tuple[Path, dict]:
    """examples/lora (beside a copy of examples/hf_causal_lm) prepared and trained 20 steps: (its folder, summary)."""
    root = tmp_path_factory.mktemp("lora_example")
    shutil.copytree(EXAMPLES / "hf_causal_lm", root / "hf_causal_lm",
                    ignore=shutil.ignore_patterns("data", "runs", "__pycache__"))
    folder = example("lora", root, *LORA_PREPARE)
    assert (folder / "pretrained" / "model.safetensors").is_file() and (folder / "data" / "tokenizer.json").is_file()
    return folder, train(folder, *LORA_STEPS)


@pytest.fixture(scope="module")
def full_checkpoint(lora_run) -> Path:
    """The same config with checkpoint.trainable_only=false (2 steps): a full checkpoint to compare sizes with."""
    folder, _ = lora_run
    check(run_cli_forked([TORCHRUN, "--config", "lora.yaml", *OVERLAY, "run.name=full",
                   "checkpoint.trainable_only=false", "train.max_steps=2", "train.eval_every_steps=2"],
                  timeout=300, cwd=folder), "torchrun.py (full checkpoint)")
    (ckpt,) = checkpoints(folder / "runs" / "full")
    return ckpt


def copy_of(folder: Path, tmp_path: Path) -> Path:
    """The example folder with its data, base and runs, beside a copy of hf_causal_lm: for a test that changes it."""
    shutil.copytree(folder.parent / "hf_causal_lm", tmp_path / "hf_causal_lm")
    shutil.copytree(folder, tmp_path / folder.name)
    return tmp_path / folder.name


def test_lora_yaml_loads_and_states_its_commands(tmp_path):
    for name in ("hf_causal_lm", "lora"):
        shutil.copytree(EXAMPLES / name, tmp_path / name, ignore=shutil.ignore_patterns("data", "runs", "pretrained",
                                                                                        "__pycache__"))
    proc = run_cli_forked(["-m", "stride", "--config", "lora.yaml", "--print-config"], timeout=120,
                          cwd=tmp_path / "lora")
    check(proc, "--print-config")
    assert "name: lora_task:LoRACausalLM" in proc.stdout and "trainable_only: true" in proc.stdout
    head = (EXAMPLES / "lora" / "lora.yaml").read_text().split("\nrun:")[0]
    for command in ("python prepare.py", "python -m stride --config lora.yaml", "trainers/torchrun.py --config lora.yaml",
                    "stride export runs/lora adapters.safetensors --trainable-only"):
        assert command in head, command
    assert (EXAMPLES / "lora" / "README.md").is_file()


@pytest.mark.slow  # the fixture's prepare.py and 20 steps, a 2-step full run: about 30 s
def test_lora_trains_only_the_adapters_on_the_loaded_base(lora_run, full_checkpoint):
    folder, s = lora_run
    assert s["status"] == "completed" and s["global_step"] == 20
    assert s["init"]["missing"] == 0 and s["init"]["unexpected"] == 0 and s["init"]["loaded"] == 28, s["init"]
    assert s["val_loss"] < s["initial_val_loss"], s  # the adapters learn (from the base's loss: lora_B starts at 0)
    run_dir = folder / "runs" / "lora"
    assert [c.name for c in checkpoints(run_dir)] == ["checkpoint_00000010", "checkpoint_00000020"]
    meta = json.loads((checkpoints(run_dir)[-1] / "meta.json").read_text())
    assert meta["trainable_only"] is True
    # peft's names: lora_A / lora_B of the "default" adapter on each targeted layer, under base_model.model.
    assert meta["trainable"] == [f"base_model.model.transformer.h.{i}.attn.c_attn.lora_{ab}.default.weight"
                                 for i in range(2) for ab in "AB"]
    # Much smaller than the same run's checkpoint with checkpoint.trainable_only=false (which holds the frozen base).
    lora_bytes, full_bytes = folder_bytes(checkpoints(run_dir)[-1]), folder_bytes(full_checkpoint)
    assert lora_bytes < 0.5 * full_bytes, (lora_bytes, full_bytes)


@pytest.mark.slow
def test_lora_checkpoint_holds_only_the_adapters(lora_run):
    from safetensors.torch import load_file

    folder, _ = lora_run
    ckpt = checkpoints(folder / "runs" / "lora")[-1]
    model_tensors, payload = tensor_bytes(ckpt)
    # A full fine-tune's checkpoint: every weight of the base (the tied head once) and its two AdamW moments.
    full_payload = 3 * sum(t.numel() * t.element_size()
                           for t in load_file(str(folder / "pretrained" / "model.safetensors")).values())
    # Only the adapters and their AdamW moments: 3 x 4,096 float32 values (2.4%) against 3 x 169,728.
    assert payload < 0.05 * full_payload, (payload, full_payload, sorted(model_tensors))
    assert all("lora_" in name for name in model_tensors), sorted(model_tensors)


@pytest.mark.slow
def test_lora_exported_adapters_on_the_pretrained_base_are_the_trained_model(lora_run, tmp_path):
    from safetensors.torch import load_file

    folder, s = lora_run
    out = tmp_path / "adapters.safetensors"
    check(run_cli_forked([*EXPORT, str(folder / "runs" / "lora"), str(out), "--trainable-only"], timeout=120), "export.py")
    adapters = load_file(str(out))
    assert len(adapters) == 4 and all("lora_" in k for k in adapters), sorted(adapters)
    base_file = folder / "pretrained" / "model.safetensors"
    assert out.stat().st_size < 0.05 * base_file.stat().st_size, (out.stat().st_size, base_file.stat().st_size)

    with task_module(folder / "lora_task.py") as mod:
        task = mod.LoRACausalLM(model_section(folder / "lora.yaml", mod.LoRACausalLM), None, s["facts"])
        model = task.build_model()
        state = task.adapt_init_state(load_file(str(base_file))) | adapters
        missing, unexpected = model.load_state_dict(state, strict=False)
        assert not unexpected and missing == ["base_model.model.lm_head.weight"], (missing, unexpected)  # tied to wte
        # Bitwise: the frozen base never changed (Stride's checksum sums the same parameters in the same order).
        assert float(sum(p.detach().double().sum() for p in model.parameters())) == s["param_checksums"][0]
        assert val_loss(task, model, val_texts(folder)) == pytest.approx(s["val_loss"], rel=1e-5)


@pytest.mark.slow
def test_lora_resume_reads_the_base_again_and_ends_where_an_uninterrupted_run_ends(lora_run, tmp_path):
    folder, uninterrupted = lora_run
    work = copy_of(folder, tmp_path)
    run_dir = work / "runs" / "lora"
    shutil.rmtree(run_dir / "checkpoint_00000020")
    (run_dir / "summary.json").unlink()
    s = train(work, *LORA_STEPS)
    assert s["status"] == "completed" and s["global_step"] == 20 and s["restarts"] == 1, s
    assert s["init"]["sha256"] == uninterrupted["init"]["sha256"]
    assert s["param_checksums"] == uninterrupted["param_checksums"]
    assert s["val_loss"] == uninterrupted["val_loss"]


@pytest.mark.slow
def test_lora_resume_on_a_changed_base_exits_2_naming_init_from(lora_run, tmp_path):
    from safetensors.torch import load_file, save_file

    folder, _ = lora_run
    work = copy_of(folder, tmp_path)
    base_file = work / "pretrained" / "model.safetensors"
    tensors = load_file(str(base_file))
    tensors["transformer.h.0.mlp.c_fc.weight"][0, 0] += 1.0
    save_file(tensors, str(base_file), metadata={"format": "pt"})
    longer = [o for o in LORA_STEPS if not o.startswith("train.max_steps=")] + ["train.max_steps=30"]
    proc = run_cli_forked([TORCHRUN, "--config", "lora.yaml", *OVERLAY, *longer], timeout=300, cwd=work)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr + proc.stdout, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("stride: error:")]
    assert len(errors) == 1 and "init.from" in errors[0] and "trainable_only" in errors[0], proc.stderr[-3000:]
    assert not (work / "runs" / "lora" / "checkpoint_00000030").exists()


@pytest.mark.slow
def test_an_adapter_checkpoint_generates_on_its_base_and_refuses_a_full_export(lora_run, tmp_path):
    """generate.py rebuilds the frozen base from init.from, as training does, then the adapters; export.py without
    --trainable-only exits 2 in one line instead of writing a 'full' file that lacks the base. The adapters are
    applied: sampled with the same seed, generate.py's text is the base's with the checkpoint's adapters, and not the
    base's alone (greedy text would not tell them apart: both models of this short run repeat one token)."""
    from safetensors.torch import load_file

    from stride.trainers.run import checkpointing

    folder, s = lora_run
    gen = run_cli_forked(["-m", "stride", "generate", "--run", "runs/lora", "--task", "lora_task:LoRACausalLM",
                          "--prompt", "def ", "--tokens", str(GEN_TOKENS), "--temperature", "1", "--seed", "0"],
                         timeout=120, cwd=folder, env={"PYTHONPATH": str(folder)})
    check(gen, "generate.py")
    assert gen.stdout.startswith("def ") and len(gen.stdout) > len("def \n")
    with task_module(folder / "lora_task.py") as mod:
        task = mod.LoRACausalLM(model_section(folder / "lora.yaml", mod.LoRACausalLM), None, s["facts"])
        base = task.build_base()
        missing, unexpected = base.load_state_dict(load_file(str(folder / "pretrained" / "model.safetensors")),
                                                   strict=False)
        assert not unexpected and missing == ["lm_head.weight"], (missing, unexpected)  # tied to wte
        adapted = task.build_model()  # lora_B starts at 0: the base's output until the checkpoint's adapters load
        adapted.load_state_dict(task.adapt_init_state(base.state_dict()), strict=False)
        adapters = checkpointing.load_model_state(checkpoints(folder / "runs" / "lora")[-1])
        assert sorted(adapters) == sorted(n for n, p in adapted.named_parameters() if "lora_" in n), sorted(adapters)
        adapted.load_state_dict(adapters, strict=False)
        texts = []
        with torch.no_grad():
            for model in (base, adapted):
                torch.manual_seed(0)  # generate.py's --seed
                texts.append(task.generate(model.eval(), "def ", GEN_TOKENS, 1.0))
        base_text, adapted_text = texts
    assert gen.stdout == adapted_text + "\n" and adapted_text != base_text, (gen.stdout, adapted_text, base_text)
    out = tmp_path / "full.safetensors"
    proc = run_cli_forked([*EXPORT, str(folder / "runs" / "lora"), str(out)], timeout=120)
    assert proc.returncode == 2 and not out.exists(), proc.stderr[-2000:]
    assert "--trainable-only" in proc.stderr and "Traceback" not in proc.stderr and len(proc.stderr.splitlines()) == 1
