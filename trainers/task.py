"""The Task: the one small contract a model, its data columns and its loss are written against.

Stride's loop, driver, data path, FSDP and telemetry never ask which task they run; everything that varies
between models lives in a `Task` subclass. `model.name` selects it: a built-in name (`char_gpt`, `mlp`) or
`"<module>:<Class>"`, the module importable from the working directory or PYTHONPATH on the driver and on every
worker.

    import numpy as np, torch
    from stride import Task

    class Regression(Task):
        class Config(Task.Config):          # its fields are this task's model.<field> keys (unknown key: exit 2)
            hidden: int = 64
        columns = ("x", "y")                # the columns it reads (None: all)

        def transform(self, batch):         # CPU, numpy in and out, one batch of rows
            return {"x": batch["x"].astype(np.float32)[:, None], "y": batch["y"].astype(np.float32)}

        def build_model(self):
            return torch.nn.Sequential(torch.nn.Linear(1, self.config.hidden), torch.nn.Tanh(),
                                       torch.nn.Linear(self.config.hidden, 1))

        def loss(self, model, batch):       # the mean loss of this micro-batch
            return torch.nn.functional.huber_loss(model(batch["x"]).squeeze(-1), batch["y"])

The hooks below the four required methods have defaults that work; override one when a real task needs it.
Plain PyTorch and numpy: no Ray here, so a task runs under Ray Train and under torchrun alike.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import numpy as np
import torch
import torch.nn as nn

from stride.datasets.splits import DataSplit
from stride.errors import DataError
from stride.trainers.config import TaskConfig


class Task:
    """Base class of every task. Stride builds one per process: `self.config` is the validated model section
    (the task's Config), `self.data_config` the data section, `self.facts` what `inspect` found in the data."""

    Config: ClassVar[type[TaskConfig]] = TaskConfig
    columns: ClassVar[tuple[str, ...] | None] = None
    # Columns of file paths (relative ones to the manifest's folder): transform gets each file's bytes instead,
    # read ahead of training by Stride's reader threads (data.file_read_threads). A column of bytes passes as it is.
    file_columns: ClassVar[tuple[str, ...]] = ()
    # Names of the per-sample values `metrics` returns (val_<name>), when known before training: a sweep then
    # checks sweep.metric against them before any trial starts. None: not declared, any val_<name> is accepted.
    metric_names: ClassVar[tuple[str, ...] | None] = None
    # The columns `stride predict` reads (data without labels): None, the same as `columns`.
    predict_columns: ClassVar[tuple[str, ...] | None] = None

    def __init__(self, config: TaskConfig, data_config: Any = None, facts: dict[str, Any] | None = None):
        self.config = config
        self.data_config = data_config
        self.facts: dict[str, Any] = dict(facts or {})
        # True while Stride transforms training batches, False for validation ones (no augmentation there), as
        # nn.Module.training.
        self.training = True

    # ---- required ----

    def transform(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """CPU, numpy in and out, one batch of rows (`columns` -> arrays with the batch as first dimension):
        decoding, augmentation, tokenising. The arrays returned become tensors on the worker's device. Augment only
        when self.training (False for validation batches). Randomness: use np.random / torch; both are reseeded
        from (run.seed, rank, step), so a resume is exact."""
        raise NotImplementedError(f"{type(self).__name__}.transform")

    def build_model(self) -> nn.Module:
        """The model, built from self.config (and self.facts). Plain nn.Module: Stride wraps it (DDP, FSDP)."""
        raise NotImplementedError(f"{type(self).__name__}.build_model")

    def loss(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor | tuple[torch.Tensor, Any]:
        """The mean loss of this micro-batch (Stride handles accumulation, precision, DDP/FSDP). The validation
        loss (val_loss) is this on the validation split, averaged over samples. Where batches hold different numbers
        of terms (variable-length sequences, masked tokens), return `(loss_sum, count)` instead: Stride divides by
        the count summed over the step's micro-batches and all ranks, so every term weighs the same, and val_loss
        is weighted by count. Return the same form for every batch."""
        raise NotImplementedError(f"{type(self).__name__}.loss")

    # ---- optional hooks ----

    def metrics(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Per-sample values (shape [batch]) on validation batches; Stride averages each over every validation
        sample of every rank and reports it as val_<name>. Default: none."""
        return {}

    def train_metrics(self, model: nn.Module, batch: dict[str, torch.Tensor], outputs: Any) -> dict[str, torch.Tensor]:
        """Per-sample values (shape [batch]) on training micro-batches, averaged over the logging interval and every
        rank and logged as train_<name>. `outputs` is what `loss` returned as `LossOutput(loss, outputs=...)` (the
        forward's logits, say): no second forward. Runs under no_grad. Default: not overridden, nothing computed."""
        return {}

    def inspect(self, train: DataSplit, val: DataSplit | None) -> dict[str, Any]:
        """Driver only, before any worker starts: check the splits (raise stride.DataError for a problem the user
        can fix) and return facts derived from the data (JSON values: input width, class count, statistics).
        Every process's task then has them as self.facts; checkpoints and summary.json record them, so a model
        can be rebuilt without the data (generate, export). Default: no facts."""
        return {}

    def blocks(self, model: nn.Module) -> list[nn.Module]:
        """The model's repeated blocks: FSDP's units (each all-gathered on its own) and the units of activation
        checkpointing. Default: the largest run of same-type modules in a ModuleList or Sequential (a
        transformer's layers); the last one is left to the root when they would hold every parameter."""
        return repeated_blocks(model)

    def callbacks(self) -> list:
        """stride.Callback instances this task always runs with (after train.callbacks'): docs/callbacks.md.
        Default: none."""
        return []

    def flops_per_sample(self, model: nn.Module) -> float | None:
        """Training FLOPs (forward + backward) per sample, for MFU. Default: 6 x parameters, right for a model
        applied once per sample (an MLP, a CNN's dense part), low for sequence models (x tokens per sample):
        override it there, or return None to report no MFU."""
        return 6.0 * sum(p.numel() for p in model.parameters())

    def tokens_per_sample(self) -> int | None:
        """Tokens in one sample, for tokens_per_second (text tasks). Default: None (not reported)."""
        return None

    def configure_optimizer(self, model: nn.Module,
                            param_groups: list[dict[str, Any]]) -> torch.optim.Optimizer | None:
        """The optimizer, for what optim.name and optim.kwargs cannot say; None (the default): Stride builds
        optim.name. `model` is the model as trained (under FSDP its parameters are shards); `param_groups` are
        Stride's groups of its trainable parameters, each with "params", "lr" (optim.lr, scaled) and "weight_decay"
        (0 for 1-d parameters): pass them on so the schedule and weight decay apply. Stride still owns precision,
        the grad scaler, clipping, sharding, the lr schedule and checkpoints (the optimizer's state_dict)."""
        return None

    def init_weights(self, model: nn.Module) -> None:
        """Initialise the model's weights in place where Stride builds it on the meta device (train.strategy=fsdp on
        several workers: `model` is sharded, its parameters DTensor shards) and init.from does not fill them all,
        or always there when you override it. Default: reset_parameters() of every module that has one. A task whose
        model initialises itself otherwise (a scaled init, zeroed output layers) overrides it: see
        docs/fine-tuning.md."""
        for module in model.modules():
            if callable(getattr(module, "reset_parameters", None)):
                module.reset_parameters()

    def adapt_init_state(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """init.from's tensors (after init.rename) -> the names and layouts of this task's model, for what a regex
        cannot express: fused or transposed weights, another library's names. Called on the driver with meta
        tensors (shapes only: use tensor operations, not data) and on the workers with real ones. Default: as
        they are. Overriding it makes every rank read the whole file (no sliced reads under FSDP)."""
        return state

    def generate(self, model: nn.Module, prompt: str, tokens: int, temperature: float) -> str:
        """Text generation from a trained model (trainers/commands/generate.py), where the task has it."""
        raise NotImplementedError(f"the task {type(self).__name__} has no text generation")

    def predict(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor | np.ndarray]:
        """`stride predict`: per-sample outputs of one batch of `transform`ed rows, as {name: values} whose first
        dimension is the batch's rows (a class, a score, an embedding vector). Runs in eval mode under no_grad.
        Stride writes them beside each row's sample_id (docs/commands.md). Default: none (NotImplementedError)."""
        raise NotImplementedError(f"the task {type(self).__name__} has no predict")

    def hf_model(self, model: nn.Module) -> Any:
        """`stride export --format hf`: a `transformers.PreTrainedModel` holding `model`'s trained weights (the
        model itself when build_model returns one), written with its `save_pretrained` so that
        `from_pretrained` loads it. Default: none (NotImplementedError)."""
        raise NotImplementedError(f"the task {type(self).__name__} has no Hugging Face form")


def repeated_blocks(model: nn.Module) -> list[nn.Module]:
    """The largest group (by parameters) of same-type children of one ModuleList/Sequential, at least two of
    them and each holding parameters. When the group holds every parameter of the model, the last member is
    left out: FSDP's root must own something."""
    best: list[nn.Module] = []
    best_params = 0
    for container in model.modules():
        if not isinstance(container, (nn.ModuleList, nn.Sequential)):
            continue
        by_type: dict[type, list[nn.Module]] = {}
        for child in container.children():
            if any(True for _ in child.parameters()):
                by_type.setdefault(type(child), []).append(child)
        for group in by_type.values():
            n = sum(p.numel() for m in group for p in m.parameters())
            if len(group) >= 2 and n > best_params:
                best, best_params = group, n
    if best and best_params == sum(p.numel() for p in model.parameters()):
        best = best[:-1]
    return best


def cross_entropy_bits(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Per-sample mean cross-entropy in bits (bits per token for text), for metrics."""
    per_token = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1),
                                            reduction="none")
    return per_token.view(targets.shape[0], -1).mean(1) / math.log(2)
