"""`stride <command>`: one command for every step of a run's life.

    stride [train] --config my.yaml [section.field=value ...]      train (the default command)
    stride eval --run runs/my_run [--checkpoint last|best|PATH] [--data PATH]
    stride predict --run runs/my_run --data new.parquet --out predictions/
    stride export --run runs/my_run --out model/ --format hf [--dtype bf16]
    stride generate --run runs/char_gpt --prompt "def "
    stride sweep --config tune/configs/tabular_sweep.yaml
    stride doctor
    stride prepare pystdlib

Each command is a module's `main(argv)`; the scripts (`python trainers/main.py`, `python tune/main.py`, ...) keep
working. `train`, `eval` and `predict` run on Ray (RAY_ADDRESS, or an embedded local Ray), or under torchrun when
started by it (`torchrun --nproc-per-node 2 -m stride eval --run ...`).
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import NoReturn

from stride import cli
from stride.errors import EXIT_OK, EXIT_USAGE

# name -> (module with main(argv), one line of help)
COMMANDS = {
    "train": ("stride.trainers.main", "train a config (the default: `stride --config x.yaml` trains)"),
    "eval": ("stride.trainers.commands.evaluate", "evaluate a run's checkpoint on its validation split or other data"),
    "predict": ("stride.trainers.commands.predict", "the task's per-sample outputs over a data set, as Parquet parts"),
    "export": ("stride.trainers.commands.export", "a checkpoint's weights as safetensors, or a Hugging Face folder"),
    "generate": ("stride.trainers.commands.generate", "sample text from a run whose task generates text"),
    "sweep": ("stride.tune.main", "a Ray Tune sweep over a config's fields"),
    "doctor": ("stride.ray_cluster.doctor", "check a cluster (nodes, GPUs, storage, collectives)"),
    "prepare": ("stride.datasets.prepare", "prepare a data set (the default pystdlib corpus, text, tabular)"),
}


def usage() -> str:
    lines = ["usage: stride <command> [options]", "", "commands:"]
    lines += [f"  {name:<9} {text}" for name, (_, text) in COMMANDS.items()]
    lines += ["", "`stride <command> --help` for each; `stride --config x.yaml` is `stride train --config x.yaml`.",
              "Exit codes: 0 done; 2 a problem you can fix (one line on stderr); 1 a failed run."]
    return "\n".join(lines)


def split_command(argv: list[str]) -> tuple[str | None, list[str]]:
    """(command, its arguments); the command is None for an unknown word. Options or overrides first mean train."""
    if not argv or argv[0].startswith("-") or "=" in argv[0]:
        return "train", argv
    if argv[0] in COMMANDS:
        return argv[0], argv[1:]
    return None, argv


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-h", "--help", "help"):
        print(usage())
        return EXIT_OK
    command, rest = split_command(argv)
    if command is None:
        print(f"stride: error: unknown command {argv[0]!r}; use one of {', '.join(COMMANDS)}, or train with "
              f"stride --config <file.yaml>; see stride --help", file=sys.stderr)
        return EXIT_USAGE
    cli.COMMAND = f"stride {command}"
    module = importlib.import_module(COMMANDS[command][0])
    return cli.reports_errors(module.main)(rest)  # what a command lets through ends as every command's errors do


def run() -> NoReturn:
    """The `stride` executable and `python -m stride`: main(), then exit with its code."""
    code = main()
    if "TORCHELASTIC_RUN_ID" in os.environ:
        # A torchrun rank: everything is written and the process group destroyed; leave without the interpreter's
        # finalization, where gloo's threads torn down unjoined could still abort a finished gang (trainers/torchrun.py).
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
