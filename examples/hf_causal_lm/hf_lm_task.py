"""A Hugging Face causal LM as a Stride Task: GPT-2 built from a config (no download), BPE-tokenised text.

Where tokenisation happens: the data keep raw text (a `text` column) and `transform` tokenises each batch with the
Hugging Face `tokenizers` tokenizer into fixed-length rows of model.context tokens. Tokenising a batch of short
rows takes well under a millisecond next to a training step, and the data stay independent of the tokenizer and
the context length (change either without preparing the data again). For long documents or a slow tokenizer,
tokenise once in the data step instead and store a fixed-size-list `tokens` column (see Stride's char_gpt task).

The tokenizer travels in the task's facts: `inspect` (on the driver) reads model.tokenizer and returns its JSON,
so every worker, every checkpoint and summary.json carry it, and `generate` needs only the run folder.
"""

from __future__ import annotations

import os

import numpy as np
import torch
from pydantic import Field, model_validator

from stride import DataError, DataSplit, Task


class HFCausalLM(Task):
    class Config(Task.Config):  # the model.<field> keys of the YAML
        tokenizer: str = Field("data/tokenizer.json", description="tokenizer.json of a Hugging Face tokenizers model")
        context: int = Field(64, ge=2, description="Tokens per training sequence (GPT-2's n_positions)")
        n_layer: int = Field(2, ge=1, description="Transformer blocks")
        n_head: int = Field(2, ge=1, description="Attention heads")
        n_embd: int = Field(64, ge=8, description="Embedding width (divisible by n_head)")
        dropout: float = Field(0.0, ge=0.0, lt=1.0, description="Residual, embedding and attention dropout")

        @model_validator(mode="after")
        def _heads_divide_width(self):
            if self.n_embd % self.n_head:
                raise ValueError(f"model.n_embd ({self.n_embd}) must be divisible by model.n_head ({self.n_head})")
            return self

    columns = ("text",)

    # ---- driver: check the data, load the tokenizer once ----

    def inspect(self, train: DataSplit, val: DataSplit | None) -> dict:
        import pyarrow as pa
        from tokenizers import Tokenizer

        for split in (train, val) if val is not None else (train,):
            if "text" not in split.schema.names or not pa.types.is_string(split.schema.field("text").type):
                raise DataError(f"{split.key}: needs a string column 'text' (found {split.schema}); run prepare.py")
        if not os.path.isfile(self.config.tokenizer):
            raise DataError(f"model.tokenizer ({self.config.tokenizer}) does not exist; run prepare.py (it writes "
                            f"data/tokenizer.json) or set model.tokenizer=<path to tokenizer.json>")
        tok = Tokenizer.from_file(self.config.tokenizer)
        return {"tokenizer": tok.to_str(), "vocab_size": tok.get_vocab_size(), "eos_id": tok.token_to_id("<|endoftext|>")}

    @property
    def tokenizer(self):
        if getattr(self, "_tokenizer", None) is None:  # built once per process from the facts
            from tokenizers import Tokenizer

            self._tokenizer = Tokenizer.from_str(self.facts["tokenizer"])
        return self._tokenizer

    # ---- workers ----

    def transform(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Text rows -> input_ids (N, context): the first `context` tokens of each row; a shorter row is padded,
        and its padding is -100 in labels (ignored by the loss). GPT-2 shifts labels by one itself."""
        n, eos = self.config.context, self.facts["eos_id"]
        ids = np.full((len(batch["text"]), n), eos, dtype=np.int64)
        labels = np.full_like(ids, -100)
        for i, enc in enumerate(self.tokenizer.encode_batch(list(batch["text"]))):
            row = enc.ids[:n]
            ids[i, : len(row)] = labels[i, : len(row)] = row
        return {"input_ids": ids, "labels": labels}

    def build_model(self):
        from transformers import GPT2Config, GPT2LMHeadModel

        c, f = self.config, self.facts
        config = GPT2Config(vocab_size=f["vocab_size"], n_positions=c.context, n_embd=c.n_embd, n_layer=c.n_layer,
                            n_head=c.n_head, resid_pdrop=c.dropout, embd_pdrop=c.dropout, attn_pdrop=c.dropout,
                            bos_token_id=f["eos_id"], eos_token_id=f["eos_id"])
        model = GPT2LMHeadModel(config)
        model.loss_type = "ForCausalLM"  # what GPT-2 uses anyway; naming it stops a warning of transformers >= 5
        return model

    def loss(self, model, batch):
        return model(input_ids=batch["input_ids"], labels=batch["labels"], use_cache=False).loss

    def hf_model(self, model):
        """`export --format hf`: build_model's GPT2LMHeadModel is already the Hugging Face model."""
        return model

    def blocks(self, model):
        return list(model.transformer.h)  # FSDP units / activation-checkpointing units: the GPT-2 blocks

    def tokens_per_sample(self) -> int:
        return self.config.context

    def flops_per_sample(self, model) -> float:
        """6 N FLOPs per token (forward 2N, backward 4N; N = the parameters, the tied embedding counted once)
        x context tokens; attention's context^2 term is left out (small at this context)."""
        return 6.0 * sum(p.numel() for p in model.parameters()) * self.config.context

    @torch.no_grad()
    def generate(self, model, prompt: str, tokens: int, temperature: float) -> str:
        ids = self.tokenizer.encode(prompt).ids or [self.facts["eos_id"]]
        idx = torch.tensor([ids], dtype=torch.long, device=next(model.parameters()).device)
        for _ in range(tokens):
            logits = model(input_ids=idx[:, -self.config.context:], use_cache=False).logits[:, -1, :].float()
            if temperature <= 0:
                nxt = logits.argmax(-1, keepdim=True)
            else:
                nxt = torch.multinomial(torch.softmax(logits / temperature, dim=-1), 1)
            idx = torch.cat([idx, nxt], dim=1)
        return self.tokenizer.decode(idx[0].tolist())
