"""Sample text from a trained run whose task generates text (char_gpt; a user task with `generate`).

    stride generate --run runs/char_gpt --prompt "def " --tokens 200 [--temperature 0.8] [--seed 0]
    stride generate --run s3://bucket/runs/char_gpt     # a run on a bucket: its newest complete checkpoint

Loads the run's final checkpoint (summary.json's `checkpoint`, else the newest complete checkpoint folder)
with the model settings and data facts recorded in summary.json, through the task's `generate`. The run is opened
and its weights read as `stride eval` and `stride export` do it (trainers/commands/trained.py). The facts carry
what decoding needs (char_gpt: the tokenizer of data from `prepare.py text --tokenizer bpe`, else bytes), so the
run folder is enough: the data need not be there.

A run of a built-in task (char_gpt, mlp) needs nothing more. A run of a task of your own names its module in
summary.json (`model.name: my_task:MyTask`), and importing a module runs its code: a run folder on shared storage
may have been written by someone else, so generate.py imports it only when you consent, either way:

    PYTHONPATH=path/to/project stride generate --run runs/my_run --task my_task:MyTask   # must match
    PYTHONPATH=path/to/project stride generate --run runs/my_run --trust-remote-code     # any module

Without either it exits 2 before importing anything of the module. The module is found on PYTHONPATH only: neither
the working directory nor the run folder's parent is put on sys.path (`python -m` puts the working directory
there; generate.py takes it off).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

from stride.cli import ArgumentParser, reports_errors
from stride.errors import UsageError
from stride.trainers.commands import trained
from stride.trainers.run import checkpointing
from stride.user_code import without_working_directory

# `stride NAME`, its line in `stride --help` and its place there (stride/commands.py reads these unimported).
NAME = "generate"
HELP = "sample text from a run whose task generates text"
ORDER = 40


def find_checkpoint(run_dir: Path, summary: dict) -> Path:
    """summary.json's `checkpoint`, else the newest complete checkpoint of `run_dir`. The one summary.json names is
    named explicitly: it must be a checkpoint folder inside `run_dir` that verifies, or it is refused (UsageError),
    never loaded from elsewhere or skipped for another. One that exists nowhere (a run folder moved since) gives way
    to the newest complete one; a run without one is refused too."""
    named = summary.get("checkpoint")
    if named and os.path.lexists(named):
        where = f"summary.json's checkpoint ({named[:200]})"
        if problem := checkpointing.verify(trained.contained(run_dir, Path(named), where)):
            raise UsageError(f"{where} is unusable: {problem}")
        return Path(named)
    if (newest := checkpointing.newest_complete(run_dir)) is None:
        raise UsageError(f"--run ({run_dir}) has no complete checkpoint; train it first")
    return newest


def parse_args(argv):
    ap = ArgumentParser(prog="stride generate",
                        description="Sample text from a trained run (a task with generate, e.g. char_gpt).")
    ap.add_argument("--run", required=True, type=trained.run_arg,
                    help="run folder, or a run on a bucket (s3://, gs://): <run.storage_path>/<run.name>")
    ap.add_argument("--prompt", default="def ")
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--seed", type=int, default=0)
    trained.consent_arguments(ap, task_help=" (found on PYTHONPATH)")
    return ap.parse_args(argv)


@reports_errors
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with without_working_directory():  # a module planted beside the run or in the working directory is not found
        run = trained.open_trained(args.run, find_checkpoint, args.task, args.trust_remote_code)
    with run:  # a run on a bucket: its downloaded copy, removed once the weights are read
        model = trained.trained_model(run).eval()
    torch.manual_seed(args.seed)
    try:
        out = run.task.generate(model, args.prompt, args.tokens, args.temperature)
    except NotImplementedError:
        raise UsageError(f"--run ({run.where()}) trained model.name={run.cfg.model.name}, whose task has no text "
                         f"generation; use a run of char_gpt or of a task that implements generate") from None
    sys.stdout.write(out + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
