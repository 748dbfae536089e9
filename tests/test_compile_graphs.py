"""train.compile=model compiles the task's loss, `task.loss(model, batch)`, as one torch.compile'd function: the
model's forward and the loss in one graph. A graph break would cut it in pieces, compiled apart with Python running
between them (and the optimisations across the cut lost), silently: the run still trains. This proves that the tasks
Stride ships (char_gpt, mlp) and every example's task (examples/*/*_task.py) trace whole: no graph break and one graph,
in training (then backward, gradients reaching every trainable parameter) and in evaluation (model.eval() under
no_grad: Stride evaluates with the same compiled loss), with the compiled loss equal to the eager one; and that a loss
returning LossOutput or (loss_sum, count) traces whole as well.

Dynamo only, on the CPU in this process: the backend records the FX graphs it is given and runs them eagerly (no
inductor, no C++ compiler). Each task is built from its YAML as Stride builds it (load_config, make_task) with tiny
model sizes, its batch made by its own transform from a few synthetic rows. No DDP here: the graphs DDP's optimizer
splits at its gradient buckets under a process group are not graph breaks of the task's code.
"""

from __future__ import annotations

import io
import shutil
import sys
import wave
from pathlib import Path
from typing import Callable, NamedTuple

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

from conftest import REPO
from stride.trainers.config_reader import load_config
from stride.trainers.step import LossOutput, split_loss
from stride.trainers.tasks import make_task
from stride.trainers.tasks.char_gpt import CharGPTTask

EXAMPLES = REPO / "examples"
ROWS = 4
# char_gpt at its smallest useful size: two blocks (the loop over them unrolls in the graph), two heads.
TINY_GPT = ["model.n_layers=2", "model.n_heads=2", "model.width=16", "model.context=8"]


class Compiled:
    """torch.compile(fn) with a backend that records each FX graph dynamo hands it and runs it eagerly; `graphs`
    and `breaks` ({reason: count}, dynamo's graph_break counter) are those of the calls since the last `take`."""

    def __init__(self, fn):
        torch._dynamo.reset()
        counters.clear()
        self.graphs: list[torch.fx.GraphModule] = []
        self.fn = torch.compile(fn, backend=self._backend)

    def _backend(self, gm: torch.fx.GraphModule, example_inputs):
        self.graphs.append(gm)
        return gm.forward

    def __call__(self, *args):
        return self.fn(*args)

    def take(self) -> tuple[int, dict[str, int]]:
        graphs, breaks = len(self.graphs), dict(counters["graph_break"])
        self.graphs.clear()
        counters.clear()
        return graphs, breaks


def assert_one_graph(compiled: Compiled, what: str) -> None:
    graphs, breaks = compiled.take()
    listed = "".join(f"\n  {n} x {reason.strip().splitlines()[0]}" for reason, n in breaks.items())
    assert not breaks, f"{what}: {sum(breaks.values())} graph break(s):{listed}"
    assert graphs == 1, f"{what}: dynamo compiled {graphs} graphs, not 1"


# ---- the tasks, each built from its YAML with tiny sizes, and a batch of its transform's ----

def tokenizer_facts() -> dict:
    """The facts hf_lm_task's inspect returns, for a tiny word-level tokenizer (no file, no training)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["<|endoftext|>", "[UNK]", "def", "return", "x", "y", "(", ")", ":", "+"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return {"tokenizer": tok.to_str(), "vocab_size": len(words), "eos_id": 0}


def text_rows(rng) -> dict[str, np.ndarray]:
    # The last row is shorter than the context: its padding is -100 in labels (ignored by the loss).
    return {"text": np.array(["def x ( y ) : return x + y + x + y"] * (ROWS - 1) + ["return y"], dtype=object)}


def png(rng, size: int) -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)).save(out, format="PNG")
    return out.getvalue()


def wav(rng, samples: int) -> bytes:
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(8000)
        w.writeframes(rng.integers(-3000, 3000, samples, dtype="<i2").tobytes())
    return out.getvalue()


class Case(NamedTuple):
    yaml: str  # relative to the example's folder, or to the checkout for a built-in task
    overrides: list[str]  # tiny model sizes
    rows: Callable[[np.random.Generator], dict[str, np.ndarray]]  # the columns transform reads, ROWS rows
    facts: Callable[[], dict] = dict  # what the task's inspect would have found
    example: str | None = None  # examples/<example>, copied and run from; None: a built-in task
    needs: tuple[str, ...] = ()  # modules the task imports (an optional extra: skipped without them)


GPT2_TINY = ["model.context=8", "model.n_layer=2", "model.n_head=2", "model.n_embd=16"]
TASKS = {
    "char_gpt": Case("trainers/configs/char_gpt.yaml", TINY_GPT,
                     lambda rng: {"tokens": rng.integers(0, 256, (ROWS, 9), dtype=np.uint8)}),
    "mlp": Case("trainers/configs/tabular_mlp.yaml", ["model.hidden_sizes=[8,8]", "model.nan_policy=impute"],
                lambda rng: {"a": np.array([np.nan, 1.0, 2.0, 3.0]), "b": rng.normal(size=ROWS),
                             "c": rng.integers(0, 5, ROWS), "label": np.array([0, 1, 2, 1])},
                lambda: {"feature_columns": ["a", "b", "c"], "label_column": "label", "num_classes": 3,
                         "fill": [0.0, 1.0, 2.0], "mean": [0.5, 0.0, -1.0], "std": [2.0, 1.0, 0.5]}),
    "regression": Case("regression.yaml", ["model.hidden=8", "model.layers=2"],
                       lambda rng: {**{f"x{i}": rng.normal(size=ROWS) for i in range(1, 5)},
                                    "y": rng.normal(size=ROWS)},
                       lambda: {"x_mean": [0.0, 0.1, 0.2, 0.3], "x_std": [1.0, 2.0, 1.0, 0.5], "y_mean": 0.5,
                                "y_std": 2.0}, example="regression"),
    "image_classifier": Case("image_classifier.yaml", ["model.channels=2", "model.image_size=8"],
                             lambda rng: {"image": np.array([png(rng, 10) for _ in range(ROWS)], dtype=object),
                                          "label": np.array([0, 1, 2, 0])},
                             example="image_classifier", needs=("PIL",)),
    "audio_clips": Case("audio_clips.yaml", ["model.samples=256", "model.channels=2"],
                        lambda rng: {"path": np.array([wav(rng, n) for n in (256, 300, 100, 256)], dtype=object),
                                     "label": np.array([0, 1, 2, 3])},
                        example="audio_clips"),
    "hf_causal_lm": Case("hf_causal_lm.yaml", GPT2_TINY, text_rows, tokenizer_facts, example="hf_causal_lm",
                         needs=("transformers", "tokenizers")),
    "lora": Case("lora.yaml", [*GPT2_TINY, "model.lora_r=2", "model.target_modules=[c_attn,c_proj]"], text_rows,
                 tokenizer_facts, example="lora", needs=("transformers", "peft", "tokenizers")),
}


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """No compiled code (nor the models its guards hold) outlives a test."""
    yield
    torch._dynamo.reset()
    counters.clear()


@pytest.fixture
def user_imports(tmp_path, monkeypatch):
    """Runs in `tmp_path`; afterwards sys.path is as it was and no module imported from tmp_path stays importable
    (an example's task module is imported from the working directory, by its plain name)."""
    monkeypatch.chdir(tmp_path)
    path_before = list(sys.path)
    yield tmp_path
    sys.path[:] = path_before
    for name, module in list(sys.modules.items()):
        if str(getattr(module, "__file__", None) or "").startswith(str(tmp_path)):
            del sys.modules[name]


def built(name: str, folder: Path, monkeypatch):
    """(task, model, training batch, evaluation batch) of TASKS[name], its example copied into `folder` (the
    checkout stays untouched: no bytecode, no data) and its YAML loaded in the copy, as a user runs it there."""
    case = TASKS[name]
    for module in case.needs:
        pytest.importorskip(module, reason=f"the {name} task needs {module}: pip install -e '.[examples]'")
    yaml = REPO / case.yaml
    if case.example is not None:
        # lora_task imports its sibling ../hf_causal_lm/hf_lm_task.py: both folders are copied side by side.
        for src in {case.example, "hf_causal_lm"} if case.example == "lora" else {case.example}:
            shutil.copytree(EXAMPLES / src, folder / src, ignore=shutil.ignore_patterns("data", "runs", "__pycache__"))
        monkeypatch.chdir(folder / case.example)
        yaml = Path(case.yaml)
    task = make_task(load_config(yaml, case.overrides), case.facts())
    torch.manual_seed(0)
    model = task.build_model()
    batches = []
    for training in (True, False):  # Stride transforms training batches with task.training, validation ones without
        task.training = training
        arrays = task.transform(case.rows(np.random.default_rng(0)))
        batches.append({k: torch.as_tensor(v) for k, v in arrays.items()})
    return task, model, *batches


@pytest.mark.parametrize("name", list(TASKS))
def test_whole_model_compile_traces_each_tasks_loss_in_one_graph(name, user_imports, monkeypatch):
    task, model, train_batch, val_batch = built(name, user_imports, monkeypatch)
    compiled = Compiled(task.loss)  # as train.compile=model: the task's loss, the model an argument of it

    model.train()
    expected, _ = split_loss(task.loss(model, train_batch), None)
    loss, count = split_loss(compiled(model, train_batch), None)
    assert_one_graph(compiled, f"{name}, training")
    assert count is None  # every task here returns a mean: the other forms are the next test's
    torch.testing.assert_close(loss, expected)
    loss.backward()
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(p.grad is not None and torch.isfinite(p.grad).all() for p in trainable.values()), \
        f"{name}: no or non-finite gradient for {[n for n, p in trainable.items() if p.grad is None]}"

    model.eval()
    with torch.no_grad():
        expected, _ = split_loss(task.loss(model, val_batch), None)
        loss, _ = split_loss(compiled(model, val_batch), None)
    assert_one_graph(compiled, f"{name}, evaluation (eval mode, no_grad)")
    torch.testing.assert_close(loss, expected)

    model.train()  # under bf16 autocast, as Stride trains with train.precision=bf16 (the CPU's autocast here)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected, _ = split_loss(task.loss(model, train_batch), None)
        loss, _ = split_loss(compiled(model, train_batch), None)
    assert_one_graph(compiled, f"{name}, training under bf16 autocast")
    torch.testing.assert_close(loss, expected)
    loss.backward()


class TokenSums(CharGPTTask):
    """char_gpt whose loss is the (loss_sum, count) form (count: the tokens that are not -1), or LossOutput with
    the logits for train_metrics."""

    form = "tuple"

    def loss(self, model, batch):
        logits = model(batch["inputs"])
        targets = batch["targets"].reshape(-1)
        loss_sum = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets, ignore_index=-1,
                                   reduction="sum")
        count = (targets != -1).sum()
        if self.form == "tuple":
            return loss_sum, count
        return LossOutput(loss_sum, count=count, outputs=logits)


def tiny_gpt(cls=CharGPTTask):
    """(task, model in training mode, batch) of the char_gpt YAML at TINY_GPT's sizes, the task of class `cls`."""
    cfg = load_config(REPO / "trainers" / "configs" / "char_gpt.yaml", TINY_GPT)
    task = cls(cfg.model, cfg.data)
    torch.manual_seed(0)
    model = task.build_model().train()
    rows = {"tokens": np.random.default_rng(0).integers(0, 256, (ROWS, 9), dtype=np.uint8)}
    return task, model, {k: torch.as_tensor(v) for k, v in task.transform(rows).items()}


@pytest.mark.parametrize("form", ["tuple", "LossOutput"])
def test_a_loss_returning_a_sum_and_its_count_traces_in_one_graph(form):
    task, model, batch = tiny_gpt(TokenSums)
    task.form = form
    batch["targets"] = batch["targets"].clone()  # a view of the inputs' array
    batch["targets"][0, :3] = -1  # three padding tokens
    expected_sum, expected_count = split_loss(task.loss(model, batch), None)
    compiled = Compiled(task.loss)
    out = compiled(model, batch)
    assert_one_graph(compiled, form)
    loss_sum, count = split_loss(out, None)
    assert int(count) == int(expected_count) == ROWS * 8 - 3
    torch.testing.assert_close(loss_sum, expected_sum)
    if form == "LossOutput":
        assert out.outputs.shape == (ROWS, 8, 256)
    loss_sum.backward()
    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize("fault, says", [
    ("branch", r"1 graph break\(s\):\s+1 x Unsupported Tensor\.item\(\)"),
    ("cached", r"dynamo compiled 0 graphs, not 1"),
])
def test_the_check_fails_on_a_graph_break_or_on_no_new_graph(fault, says):
    """The assertion can fail: a loss that reads a value to the host (float()) and branches on it breaks the graph;
    a call that dynamo's cache answers (same mode, grad mode and autocast as the last) traces no graph, so each phase
    of the test above that passes traced its own."""
    task, model, batch = tiny_gpt()

    def branching_loss(model, batch):
        loss = task.loss(model, batch)
        return loss * 2 if float(loss.detach()) > 1e9 else loss

    compiled = Compiled(branching_loss if fault == "branch" else task.loss)
    if fault == "cached":
        compiled(model, batch)
        assert_one_graph(compiled, fault)
    torch.testing.assert_close(compiled(model, batch), task.loss(model, batch))
    with pytest.raises(AssertionError, match=says):
        assert_one_graph(compiled, fault)
