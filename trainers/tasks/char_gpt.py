"""char_gpt: a GPT on rows of fixed-length token ids (python datasets/prepare.py pystdlib | text).

Bytes (ids 0-255) by default. Data prepared with a tokenizer (`prepare.py text --tokenizer bpe`) have its
`tokenizer.json` beside the splits (the data folder's parent, or beside the Parquet files): `inspect` finds it and
returns its JSON text as a fact, so every worker, checkpoint and summary.json carry the tokenizer, and `generate`
(trainers/commands/generate.py --run) needs only the run folder, even after the data moved or were deleted.
"""

from __future__ import annotations

import hashlib
import os
import posixpath

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import Field, model_validator

from stride.errors import DataError
from stride.trainers.models import CharGPT
from stride.trainers.task import Task, cross_entropy_bits
from stride.datasets.splits import DataSplit


class CharGPTTask(Task):
    class Config(Task.Config):
        n_layers: int = Field(3, ge=1, description="Transformer blocks")
        n_heads: int = Field(4, ge=1, description="Attention heads")
        width: int = Field(128, ge=8, description="Embedding width (divisible by n_heads)")
        context: int = Field(64, ge=2, description="Tokens per sequence seen by the model")
        vocab_size: int = Field(256, ge=2, description="Vocabulary size (bytes: 256; a tokenizer's: its size, "
                                                         "as prepare.py text prints)")
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
                                f"fixed-length token rows from python datasets/prepare.py pystdlib (or text), or set "
                                f"model.name=mlp for tabular data")
            t = split.schema.field("tokens").type
            if not (pa.types.is_fixed_size_list(t) and pa.types.is_integer(t.value_type)):
                raise DataError(f"{split.key}: column 'tokens' is {t}, must be a fixed-size list of integers")
            if self.config.context + 1 > t.list_size:
                raise DataError(f"model.context ({self.config.context}) needs rows of {self.config.context + 1} "
                                f"tokens but {split.key} has {t.list_size}; use model.context={t.list_size - 1} or "
                                f"prepare longer rows")
        facts: dict = {}
        found = {split.key: find_tokenizer(split.files) for split in (train, val) if split is not None}
        path = found.get(train.key) or next((p for p in found.values() if p), None)
        if path:
            text = read_text(path)
            facts = tokenizer_facts(text, path)
            for key, other in found.items():
                if other and other != path and _sha256(read_text(other)) != facts["tokenizer_sha256"]:
                    raise DataError(f"{key}: its tokenizer ({other}) differs from {path}; train and validation data "
                                    f"must be prepared with the same tokenizer")
            n = facts["tokenizer_vocab_size"]
            if self.config.vocab_size < n:
                raise DataError(f"model.vocab_size ({self.config.vocab_size}) is smaller than the {n} tokens of the data's "
                                f"tokenizer ({path}); use model.vocab_size={n}")
        for split in (train, val) if val is not None else (train,):
            self._check_ids_fit(split, path)
        return facts

    def _check_ids_fit(self, split: DataSplit, tokenizer_path: str | None) -> None:
        """Token ids must be < model.vocab_size: checked from the files' metadata (Parquet statistics: no data read),
        and only where the id type could hold a larger one (bytes as uint8 with vocab_size 256: nothing to check)."""
        import pyarrow as pa

        t = split.schema.field("tokens").type.value_type
        if not pa.types.is_signed_integer(t) and 2 ** t.bit_width <= self.config.vocab_size:
            return
        if (found := split.value_range("tokens")) is None:
            return
        lo, hi = found
        if lo < 0:
            raise DataError(f"{split.key}: token ids go down to {lo}; ids must be >= 0")
        if hi >= self.config.vocab_size:
            hint = f" (tokenizer: {tokenizer_path})" if tokenizer_path else " and no tokenizer.json is beside the data"
            raise DataError(f"{split.key}: token ids reach {hi} but model.vocab_size is {self.config.vocab_size}{hint}; "
                            f"use model.vocab_size={hi + 1} or more")

    @property
    def tokenizer(self):
        """The data's tokenizer (a Hugging Face tokenizers.Tokenizer) rebuilt from the facts, or None for bytes."""
        if "tokenizer" not in self.facts:
            return None
        if getattr(self, "_tokenizer", None) is None:
            from tokenizers import Tokenizer

            self._tokenizer = Tokenizer.from_str(self.facts["tokenizer"])
        return self._tokenizer

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
        tok = self.tokenizer
        if tok is None:
            start = list(prompt.encode()) or [10]
        else:  # an empty prompt starts a new document
            start = tok.encode(prompt).ids or [tok.token_to_id(TOKENIZER_EOS) or 0]
        idx = torch.tensor([start], dtype=torch.long)
        for _ in range(tokens):
            logits = model(idx[:, -self.config.context:])[:, -1, :]
            if temperature <= 0:
                nxt = logits.argmax(-1, keepdim=True)
            else:
                nxt = torch.multinomial(torch.softmax(logits / temperature, dim=-1), 1)
            idx = torch.cat([idx, nxt], dim=1)
        if tok is not None:
            return tok.decode(idx[0].tolist())  # special tokens (<|endoftext|>) left out
        return bytes(idx[0].tolist()).decode("utf-8", errors="replace")


TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_EOS = "<|endoftext|>"  # prepare.py text's document separator


def _exists(path: str) -> bool:
    if "://" in path:
        import pyarrow.fs as pafs

        fs, p = pafs.FileSystem.from_uri(path)
        return fs.get_file_info(p).type == pafs.FileType.File
    return os.path.isfile(path)


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def read_text(path: str) -> str:
    if "://" in path:
        import pyarrow.fs as pafs

        fs, p = pafs.FileSystem.from_uri(path)
        with fs.open_input_stream(p) as f:
            return f.read().decode("utf-8")
    with open(path, encoding="utf-8") as f:
        return f.read()


def find_tokenizer(files) -> str | None:
    """tokenizer.json beside a split's Parquet files, else in the folder above them (prepare.py text writes
    <out>/tokenizer.json beside <out>/train and <out>/val). None: bytes."""
    if not files:
        return None
    here = posixpath.dirname(files[0]) if "://" in files[0] else os.path.dirname(files[0])
    join, up = (posixpath.join, posixpath.dirname) if "://" in files[0] else (os.path.join, os.path.dirname)
    for folder in dict.fromkeys((here, up(here))):
        candidate = join(folder, TOKENIZER_FILE)
        if folder and _exists(candidate):
            return candidate
    return None


def tokenizer_facts(text: str, path: str) -> dict:
    """What generation needs, carried by the facts: the tokenizer's JSON text itself (so a run folder is
    self-contained: generate.py works after the data moved, on a machine that never had them), with its size,
    digest and where it was found."""
    from tokenizers import Tokenizer

    try:
        tok = Tokenizer.from_str(text)
    except Exception as e:  # noqa: BLE001 - a broken tokenizer.json: one line naming it
        raise DataError(f"{path} is not a Hugging Face tokenizers file ({str(e).splitlines()[0][:120]}); "
                        f"prepare the data again or remove it (bytes)") from None
    return {"tokenizer": text, "tokenizer_sha256": _sha256(text),
            "tokenizer_vocab_size": tok.get_vocab_size(), "tokenizer_path": path}
