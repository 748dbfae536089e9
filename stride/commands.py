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

A new command is one file: a module in stride.trainers.commands that declares NAME, HELP (one line) and a main(argv)
is `stride NAME` (its ORDER places it in the list; without one it comes last).
"""

from __future__ import annotations

import ast
import importlib
import os
import pkgutil
import sys
from pathlib import Path
from typing import NoReturn

from stride import cli
from stride.errors import EXIT_OK, EXIT_USAGE

# The commands outside stride.trainers.commands: name -> (module with main(argv), one line of help, place in the list)
OWN = {
    "train": ("stride.trainers.main", "train a config (the default: `stride --config x.yaml` trains)", 0),
    "sweep": ("stride.tune.main", "a Ray Tune sweep over a config's fields", 50),
    "doctor": ("stride.ray_cluster.doctor", "check a cluster (nodes, GPUs, storage, collectives)", 60),
    "prepare": ("stride.datasets.prepare", "prepare a data set (the default pystdlib corpus, text, tabular)", 70),
}
PACKAGE = "stride.trainers.commands"  # where each module that declares NAME and HELP is a command
LAST = 1000  # the place of a command that declares no ORDER


def declared(path: Path) -> dict[str, object]:
    """The NAME, HELP and ORDER a module's source assigns at its top level, read without importing it: listing the
    commands must not import torch."""
    found = {}
    for node in ast.parse(path.read_text(), str(path)).body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            if node.targets[0].id in ("NAME", "HELP", "ORDER"):
                found[node.targets[0].id] = ast.literal_eval(node.value)
    return found


def commands() -> dict[str, tuple[str, str]]:
    """name -> (module with main(argv), one line of help), in the order `stride --help` lists them: OWN's and those
    the modules of PACKAGE declare."""
    placed = dict(OWN)
    package = importlib.import_module(PACKAGE)
    for info in pkgutil.iter_modules(package.__path__):
        spec = info.module_finder.find_spec(f"{PACKAGE}.{info.name}")
        if spec is None or not (spec.origin or "").endswith(".py"):
            continue
        const = declared(Path(spec.origin))
        if "NAME" in const and "HELP" in const:
            placed[const["NAME"]] = (spec.name, const["HELP"], const.get("ORDER", LAST))
    ordered = sorted(placed.items(), key=lambda item: (item[1][2], item[0]))
    return {name: (module, text) for name, (module, text, _) in ordered}


def usage(known: dict[str, tuple[str, str]] | None = None) -> str:
    lines = ["usage: stride <command> [options]", "", "commands:"]
    lines += [f"  {name:<9} {text}" for name, (_, text) in (known or commands()).items()]
    lines += ["", "`stride <command> --help` for each; `stride --config x.yaml` is `stride train --config x.yaml`.",
              "Exit codes: 0 done; 2 a problem you can fix (one line on stderr); 1 a failed run."]
    return "\n".join(lines)


def split_command(argv: list[str], known: dict[str, tuple[str, str]] | None = None) -> tuple[str | None, list[str]]:
    """(command, its arguments); the command is None for an unknown word. Options or overrides first mean train."""
    if not argv or argv[0].startswith("-") or "=" in argv[0]:
        return "train", argv
    if argv[0] in (known or commands()):
        return argv[0], argv[1:]
    return None, argv


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    known = commands()
    if argv and argv[0] in ("-h", "--help", "help"):
        print(usage(known))
        return EXIT_OK
    command, rest = split_command(argv, known)
    if command is None:
        print(f"stride: error: unknown command {argv[0]!r}; use one of {', '.join(known)}, or train with "
              f"stride --config <file.yaml>; see stride --help", file=sys.stderr)
        return EXIT_USAGE
    cli.COMMAND = f"stride {command}"
    module = importlib.import_module(known[command][0])
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
