"""Data step of the LoRA example: the hf_causal_lm example's data, and a small "pretrained" GPT-2 to adapt.

    python prepare.py                                   # -> data/train, data/val, data/tokenizer.json, pretrained/
    python prepare.py --max-chars 1500000 --steps 200   # more text, a better base

Nothing is downloaded. Two steps:
  1. ../hf_causal_lm/prepare.py --out data --max-chars N: rows of the running Python's standard library source
     (Parquet, a `text` column) and a byte-level BPE tokenizer trained on them (data/tokenizer.json).
  2. "Pretraining": the GPT-2 that lora_task.LoRACausalLM wraps, built for lora.yaml's model settings (the same
     build_model as the hf_causal_lm example), trained --steps AdamW steps in plain PyTorch on the training rows
     (tokenised with the task's own transform), then saved with transformers' save_pretrained into pretrained/
     (model.safetensors, config.json): the folder lora.yaml's init.from names, as a downloaded model would be.
A few seconds on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def prepare_data(out: Path, max_chars: int) -> None:
    script = HERE.parent / "hf_causal_lm" / "prepare.py"
    subprocess.run([sys.executable, str(script), "--out", str(out), "--max-chars", str(max_chars)], check=True)


def pretrain(config: str, out: Path, steps: int, lr: float, seed: int) -> None:
    import numpy as np
    import pyarrow.parquet as pq
    import torch
    from tokenizers import Tokenizer

    from stride.trainers.config_reader import load_config
    from stride.trainers.tasks import make_task

    cfg = load_config(config)
    tok = Tokenizer.from_file(cfg.model.tokenizer)
    facts = {"tokenizer": tok.to_str(), "vocab_size": tok.get_vocab_size(), "eos_id": tok.token_to_id("<|endoftext|>")}
    task = make_task(cfg, facts)  # lora_task.LoRACausalLM
    torch.manual_seed(seed)
    model = task.build_base()  # the plain GPT2LMHeadModel: no adapters
    text = pq.read_table(Path(cfg.data.train_path), columns=["text"]).column("text").to_numpy(zero_copy_only=False)
    rng = np.random.default_rng(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1)
    batch = cfg.train.batch_size_per_worker
    model.train()
    for step in range(1, steps + 1):
        arrays = task.transform({"text": text[rng.choice(len(text), batch, replace=False)]})
        loss = model(input_ids=torch.from_numpy(arrays["input_ids"]), labels=torch.from_numpy(arrays["labels"]),
                     use_cache=False).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if step == 1 or step % 20 == 0 or step == steps:
            print(f"pretrain step {step}/{steps}: loss {loss.item():.3f}")
    model.save_pretrained(out)  # safetensors (model.safetensors) and config.json
    n = sum(p.numel() for p in model.parameters())
    print(f"pretrained: GPT-2 of {n:,} parameters -> {out}/")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="lora.yaml", help="the YAML whose model settings the base is built with")
    ap.add_argument("--max-chars", type=int, default=500_000, help="characters of source text to use")
    ap.add_argument("--steps", type=int, default=60, help="pretraining steps of the base")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=1234, help="the base's init and batches (not lora.yaml's run.seed)")
    ap.add_argument("--out", type=Path, default=Path("pretrained"), help="save_pretrained folder (lora.yaml's init.from)")
    a = ap.parse_args()
    prepare_data(Path("data"), a.max_chars)
    pretrain(a.config, a.out, a.steps, a.lr, a.seed)


if __name__ == "__main__":
    main()
