"""Sample text from a trained run whose task generates text (char_gpt; a user task with `generate`).

    python trainers/generate.py --run runs/char_gpt --prompt "def " --tokens 200 [--temperature 0.8] [--seed 0]

Loads the run's final checkpoint (summary.json's `checkpoint`, else the newest complete checkpoint folder)
with the model settings and data facts recorded in summary.json, through the task's `generate`. The facts carry
what decoding needs (char_gpt: the tokenizer of data from `prepare.py text --tokenizer bpe`, else bytes), so the
run folder is enough: the data need not be there.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

if not __package__:  # run as a file from a checkout: import Stride as the `stride` package (stride/_checkout.py)
    import runpy

    runpy.run_path(str(Path(__file__).resolve().parents[1] / "stride" / "_checkout.py"))

import torch  # noqa: E402

from stride.trainers import checkpointing  # noqa: E402
from stride.trainers.config import ConfigError, from_dict  # noqa: E402
from stride.trainers.tasks import make_task  # noqa: E402


def find_checkpoint(run_dir: Path, summary: dict) -> Path | None:
    named = summary.get("checkpoint")
    if named and checkpointing.verify(Path(named)) is None:
        return Path(named)
    found = [p for p in run_dir.glob("checkpoint_*") if checkpointing.verify(p) is None]
    return max(found, key=lambda p: checkpointing.read_meta(p)["step"]) if found else None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Sample text from a trained run (a task with generate, e.g. char_gpt).")
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
    try:
        cfg = from_dict(summary["config"])
        task = make_task(cfg, summary.get("facts"))
    except ConfigError as e:
        print(f"generate: error: {e}", file=sys.stderr)
        return 2
    ckpt = find_checkpoint(args.run, summary)
    if ckpt is None:
        print(f"generate: error: --run ({args.run}) has no complete checkpoint; train it first", file=sys.stderr)
        return 2
    try:
        weights = checkpointing.load_model_state(ckpt)
    except checkpointing.UnsafeCheckpointError as e:
        print(f"generate: error: {e}", file=sys.stderr)
        return 2
    model = task.build_model()
    model.load_state_dict(weights)
    model.eval()
    torch.manual_seed(args.seed)
    try:
        out = task.generate(model, args.prompt, args.tokens, args.temperature)
    except NotImplementedError:
        print(f"generate: error: --run ({args.run}) trained model.name={cfg.model.name}, whose task has no text "
              f"generation; use a run of char_gpt or of a task that implements generate", file=sys.stderr)
        return 2
    sys.stdout.write(out + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
