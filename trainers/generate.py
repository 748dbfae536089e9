"""Sample text from a trained char_gpt run.

    python trainers/generate.py --run runs/char_gpt --prompt "def " --tokens 200 [--temperature 0.8] [--seed 0]

Loads the run's final checkpoint (summary.json's `checkpoint`, else the newest complete checkpoint folder)
with the model settings recorded in summary.json.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
    sys.path.pop(0)
sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402

from trainers import checkpointing  # noqa: E402
from trainers.config import from_dict  # noqa: E402
from trainers.step import build_model  # noqa: E402


def find_checkpoint(run_dir: Path, summary: dict) -> Path | None:
    named = summary.get("checkpoint")
    if named and checkpointing.verify(Path(named)) is None:
        return Path(named)
    found = [p for p in run_dir.glob("checkpoint_*") if checkpointing.verify(p) is None]
    return max(found, key=lambda p: checkpointing.read_meta(p)["step"]) if found else None


@torch.no_grad()
def sample(model: torch.nn.Module, prompt: bytes, tokens: int, temperature: float, context: int) -> bytes:
    idx = torch.tensor([list(prompt) or [10]], dtype=torch.long)
    for _ in range(tokens):
        logits = model(idx[:, -context:])[:, -1, :]
        if temperature <= 0:
            nxt = logits.argmax(-1, keepdim=True)
        else:
            nxt = torch.multinomial(torch.softmax(logits / temperature, dim=-1), 1)
        idx = torch.cat([idx, nxt], dim=1)
    return bytes(idx[0].tolist())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Sample from a trained char_gpt run.")
    ap.add_argument("--run", required=True, type=Path, help="run folder: <run.storage_path>/<run.name>")
    ap.add_argument("--prompt", default="def ")
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    summary_path = args.run / "summary.json"
    if not summary_path.is_file():
        print(f"generate: error: --run ({args.run}) has no summary.json; pass a finished run folder such as runs/char_gpt",
              file=sys.stderr)
        return 2
    summary = json.loads(summary_path.read_text())
    cfg = from_dict(summary["config"])
    if cfg.model.name != "char_gpt":
        print(f"generate: error: --run ({args.run}) trained model.name={cfg.model.name}; generation needs char_gpt",
              file=sys.stderr)
        return 2
    ckpt = find_checkpoint(args.run, summary)
    if ckpt is None:
        print(f"generate: error: --run ({args.run}) has no complete checkpoint; train it first", file=sys.stderr)
        return 2
    state, _ = checkpointing.load(ckpt)
    model = build_model(cfg)
    model.load_state_dict(state["model"])
    model.eval()
    torch.manual_seed(args.seed)
    out = sample(model, args.prompt.encode(), args.tokens, args.temperature, cfg.model.context)
    sys.stdout.write(out.decode("utf-8", errors="replace") + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
