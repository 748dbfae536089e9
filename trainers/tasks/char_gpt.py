"""char_gpt: a byte-level GPT on rows of fixed-length token ids (python datasets/prepare.py pystdlib)."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import Field, model_validator

from stride.datasets.parquet import DataError
from stride.trainers.models import CharGPT
from stride.trainers.task import DataSplit, Task, cross_entropy_bits


class CharGPTTask(Task):
    class Config(Task.Config):
        n_layers: int = Field(3, ge=1, description="Transformer blocks")
        n_heads: int = Field(4, ge=1, description="Attention heads")
        width: int = Field(128, ge=8, description="Embedding width (divisible by n_heads)")
        context: int = Field(64, ge=2, description="Tokens per sequence seen by the model")
        vocab_size: int = Field(256, ge=2, description="Vocabulary size (bytes: 256)")
        dropout: float = Field(0.0, ge=0.0, lt=1.0, description="Dropout probability")

        @model_validator(mode="after")
        def _heads_divide_width(self):
            if self.width % self.n_heads:
                raise ValueError(f"model.width ({self.width}) must be divisible by model.n_heads ({self.n_heads}); "
                                 f"use e.g. model.width={self.n_heads * max(1, round(self.width / self.n_heads))}")
            return self

    columns = ("tokens",)
    metric_names = ("bpb",)

    def inspect(self, train: DataSplit, val: DataSplit | None) -> dict:
        import pyarrow as pa

        for split in (train, val) if val is not None else (train,):
            if "tokens" not in split.schema.names:
                raise DataError(f"{split.key}: no 'tokens' column (found {split.schema.names}); char_gpt needs "
                                f"fixed-length token rows from python datasets/prepare.py pystdlib, or set "
                                f"model.name=mlp for tabular data")
            t = split.schema.field("tokens").type
            if not (pa.types.is_fixed_size_list(t) and pa.types.is_integer(t.value_type)):
                raise DataError(f"{split.key}: column 'tokens' is {t}, must be a fixed-size list of integers")
            if self.config.context + 1 > t.list_size:
                raise DataError(f"model.context ({self.config.context}) needs rows of {self.config.context + 1} "
                                f"tokens but {split.key} has {t.list_size}; use model.context={t.list_size - 1} or "
                                f"prepare longer rows")
        return {}

    def transform(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        t = batch["tokens"][:, : self.config.context + 1].astype(np.int64)
        return {"inputs": t[:, :-1], "targets": t[:, 1:]}

    def build_model(self) -> CharGPT:
        c = self.config
        return CharGPT(c.vocab_size, c.context, c.n_layers, c.n_heads, c.width, c.dropout)

    def loss(self, model, batch):
        logits = model(batch["inputs"])
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), batch["targets"].reshape(-1))

    def metrics(self, model, batch):
        return {"bpb": cross_entropy_bits(model(batch["inputs"]), batch["targets"])}

    def blocks(self, model):
        return list(model.blocks)

    def flops_per_sample(self, model) -> float:
        return self.config.context * model.flops_per_token()

    def tokens_per_sample(self) -> int:
        return self.config.context

    @torch.no_grad()
    def generate(self, model, prompt: str, tokens: int, temperature: float) -> str:
        idx = torch.tensor([list(prompt.encode()) or [10]], dtype=torch.long)
        for _ in range(tokens):
            logits = model(idx[:, -self.config.context:])[:, -1, :]
            if temperature <= 0:
                nxt = logits.argmax(-1, keepdim=True)
            else:
                nxt = torch.multinomial(torch.softmax(logits / temperature, dim=-1), 1)
            idx = torch.cat([idx, nxt], dim=1)
        return bytes(idx[0].tolist()).decode("utf-8", errors="replace")
