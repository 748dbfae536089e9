"""Sample text from a trained run whose task generates text (char_gpt; a user task with `generate`).

    stride generate --run runs/char_gpt --prompt "def " --tokens 200 [--temperature 0.8] [--seed 0]

Loads the run's final checkpoint (summary.json's `checkpoint`, else the newest complete checkpoint folder)
with the model settings and data facts recorded in summary.json, through the task's `generate`. The facts carry
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

from stride.errors import RunFolderError, UnsafeCheckpointError
import os
import sys
from pathlib import Path
from typing import Any

import torch

from stride.cli import ArgumentParser, error_line
from stride.errors import UsageError
from stride.trainers.run import checkpointing
from stride.trainers.run import folder as runfolder
from stride.errors import ConfigError
from stride.trainers.config_reader import from_dict
from stride.trainers.tasks import consent, make_task
from stride.user_code import search_working_directory


def find_checkpoint(run_dir: Path, summary: dict) -> Path | None:
    """summary.json's `checkpoint`, else the newest complete checkpoint of `run_dir`. The one summary.json names is
    named explicitly: it must be a checkpoint folder of `run_dir` that verifies, or it is refused (UsageError), never
    loaded from elsewhere or skipped for another. One that exists nowhere (a run folder moved since) gives way to the
    newest complete one."""
    named = summary.get("checkpoint")
    if named and os.path.lexists(named):
        if os.path.realpath(Path(named).parent) != os.path.realpath(run_dir):
            raise UsageError(f"summary.json's checkpoint ({named[:200]}) lies outside --run ({run_dir}); pass the run "
                             f"folder it belongs to")
        if problem := checkpointing.verify(Path(named)):
            raise UsageError(f"summary.json's checkpoint ({named[:200]}) is unusable: {problem}")
        return Path(named)
    return checkpointing.newest_complete(run_dir)


def _model_name(summary: dict, summary_path: Path) -> str:
    name = summary
    for key in ("config", "model", "name"):
        name = name.get(key) if isinstance(name, dict) else None
    if not isinstance(name, str):
        raise ConfigError(f"{summary_path} has no string config.model.name ({str(name)[:200]}); pass the folder of a "
                          f"finished run")
    return name


def load_run(run: Path, task: str | None = None, trust_remote_code: bool = False,
             label: str = "--run") -> tuple[dict, Any, Any]:
    """A run folder's summary.json, its config and its task rebuilt from them (with the facts it records), for the
    commands that read a finished run (generate, export --format hf). A task of the user's own is imported only with
    consent (`task`, `trust_remote_code`). Raises UsageError or ConfigError, one line naming `label` (the argument
    that gave `run`)."""
    summary_path = run / "summary.json"
    if not summary_path.is_file():
        raise UsageError(f"{label} ({run}) has no summary.json; pass a finished run folder such as runs/char_gpt")
    try:
        summary = runfolder.read_summary(summary_path)
    except RunFolderError:  # its own line (a link in the run folder), not the ValueError's below
        raise
    except (OSError, ValueError) as e:
        raise UsageError(f"{label} ({run}): {summary_path.name} is not one Stride writes ({e}); pass the folder of a "
                         f"finished run") from None
    search_working_directory(False)
    consent(_model_name(summary, summary_path), task, trust_remote_code, str(summary_path))
    cfg = from_dict(summary["config"])
    return summary, cfg, make_task(cfg, summary.get("facts"))


def trained_model(task, cfg, ckpt: Path, weights: dict[str, torch.Tensor]) -> torch.nn.Module:
    """`task`'s model with a checkpoint's `weights` loaded. A checkpoint of the trainable parameters only
    (checkpoint.trainable_only) goes on the frozen base that init.from gives, as in training; a base that changed
    since is refused (ConfigError)."""
    model = task.build_model()
    meta = checkpointing.read_meta(ckpt)
    if not meta.get("trainable_only"):
        model.load_state_dict(weights)
        return model
    from stride.trainers import pretrained

    init = cfg.init
    plan = pretrained.init_model(model, init.from_, strict=init.strict, include=init.include, exclude=init.exclude,
                                 rename=init.rename, adapt=pretrained.adapter(task))
    recorded = (meta.get("init") or {}).get("sha256")
    if recorded != plan.sha256:
        raise ConfigError(pretrained.changed_base_line(init.from_, recorded, plan.sha256))
    model.load_state_dict(weights, strict=False)
    return model


def main(argv: list[str] | None = None) -> int:
    ap = ArgumentParser(prog="stride generate",
                        description="Sample text from a trained run (a task with generate, e.g. char_gpt).")
    ap.add_argument("--run", required=True, type=Path, help="run folder: <run.storage_path>/<run.name>")
    ap.add_argument("--prompt", default="def ")
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--task", metavar="MODULE:CLASS",
                    help="import this task of your own (found on PYTHONPATH); must be the run's model.name")
    ap.add_argument("--trust-remote-code", action="store_true",
                    help="import whatever task module the run's summary.json names (it runs that module's code)")
    args = ap.parse_args(argv)
    try:
        summary, cfg, task = load_run(args.run, args.task, args.trust_remote_code)
        ckpt = find_checkpoint(args.run, summary)
    except (UsageError, ConfigError) as e:
        error_line(e)
        return 2
    if ckpt is None:
        error_line(f"--run ({args.run}) has no complete checkpoint; train it first")
        return 2
    try:
        model = trained_model(task, cfg, ckpt, checkpointing.load_model_state(ckpt))
    except (UnsafeCheckpointError, ConfigError) as e:
        error_line(e)
        return 2
    model.eval()
    torch.manual_seed(args.seed)
    try:
        out = task.generate(model, args.prompt, args.tokens, args.temperature)
    except NotImplementedError:
        error_line(f"--run ({args.run}) trained model.name={cfg.model.name}, whose task has no text "
                   f"generation; use a run of char_gpt or of a task that implements generate")
        return 2
    sys.stdout.write(out + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
