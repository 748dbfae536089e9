"""A trained run as the source of the commands that come after training (`stride eval`, `stride predict`; `stride
export --format hf` takes its config and task): its folder, config, task and one of its checkpoints, each checked
before any worker starts.

A run folder may sit on shared storage that someone else can write: its summary.json names the task module, and
importing a module runs it. As trainers/commands/generate.py does, a task of your own is imported only with consent
(`--task MODULE:CLASS`, the same as the run's, or `--trust-remote-code`); built-in tasks need neither. Consented to,
it is found in the working directory or on PYTHONPATH, as training finds it (run_config).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stride.datasets.splits import DataSpec
from stride.errors import UsageError
from stride.trainers.run import checkpointing
from stride.trainers.run import folder as runfolder
from stride.trainers.config import Config
from stride.trainers.config_reader import apply_overrides, build_config


@dataclass
class TrainedRun:
    run_dir: Path
    summary: dict[str, Any]
    cfg: Config  # the run's config, with the command's overrides; run.storage_path/run.name point at run_dir
    task: Any
    checkpoint: Path
    meta: dict[str, Any]  # the checkpoint's meta.json

    @property
    def facts(self) -> dict[str, Any]:
        return self.meta.get("facts") or self.summary.get("facts") or {}


def add_arguments(ap) -> None:
    """The options every command over a trained run takes."""
    # --run-dir: the same, for torchrun's command line, whose own parser takes --run for its --run-path.
    ap.add_argument("--run", "--run-dir", dest="run", required=True, type=Path,
                    help="run folder: <run.storage_path>/<run.name> (under torchrun: --run-dir)")
    ap.add_argument("--checkpoint", default="last", metavar="last|best|PATH",
                    help="the newest complete checkpoint (last), the best kept one (best: checkpoint.keep_best), or "
                         "a checkpoint folder of the run")
    ap.add_argument("--task", metavar="MODULE:CLASS",
                    help="import this task of your own; must be the run's model.name")
    ap.add_argument("--trust-remote-code", action="store_true",
                    help="import whatever task module the run's summary.json names (it runs that module's code)")
    ap.add_argument("overrides", nargs="*", metavar="section.field=value",
                    help="changes to the run's config (scaling.num_workers=2, train.batch_size_per_worker=64)")


def open_run(args) -> TrainedRun:
    """The run of `args.run` with the checkpoint `args.checkpoint`; UsageError/ConfigError (exit 2) otherwise."""
    from stride.trainers.tasks import make_task

    run_dir = Path(args.run)
    summary = read_summary(run_dir)
    cfg = run_config(run_dir, summary, args.task, args.trust_remote_code, args.overrides)
    checkpoint = pick_checkpoint(run_dir, summary, args.checkpoint)
    meta = checkpointing.read_meta(checkpoint)
    check_same_task(cfg.model.name, checkpoint, meta)  # before its facts build the run's task
    task = make_task(cfg, meta.get("facts") or summary.get("facts"))
    check_fits(cfg, task, checkpoint, meta)
    return TrainedRun(run_dir.resolve(), summary, cfg, task, checkpoint.resolve(), meta)  # workers run elsewhere


def run_config(run_dir: Path, summary: dict, task: str | None, trust_remote_code: bool, overrides=(),
               label: str = "--run") -> Config:
    """The run's config (its summary.json's, with `overrides`), where the run folder is now. Every command over a
    trained run (eval, predict, export --format hf) finds the run's task here: a built-in needs nothing; a module of
    the user's own is imported only with consent (`task`, the same as the run's, or `trust_remote_code`), from the
    working directory, STRIDE_TASK_PATH or PYTHONPATH (tasks.load_class). `label` names the argument that gave
    `run_dir`."""
    from stride.trainers.tasks import consent

    name = run_model_name(run_dir, summary, label)
    consent(name, task, trust_remote_code, str(run_dir / "summary.json"))
    raw = apply_overrides(summary["config"], list(overrides))
    # The run is where it is now, whatever folder it was started from.
    raw["run"] = {**raw.get("run", {}), "storage_path": str(run_dir.resolve().parent), "name": run_dir.resolve().name}
    return build_config(raw, origin=f"{run_dir / 'summary.json'}")


def run_model_name(run_dir: Path, summary: dict, label: str = "--run") -> str:
    """The run's task, config.model.name of its summary.json (`label` names the argument that gave `run_dir`)."""
    name = ((summary.get("config") or {}).get("model") or {}).get("name")
    if not isinstance(name, str):
        raise UsageError(f"{label} ({run_dir}): summary.json has no config.model.name; pass the folder of a run that "
                         f"trained")
    return name


def check_named_task(run_dir: Path, summary: dict, task: str | None, label: str = "--run") -> None:
    """A --task given to a command that imports no task (export --format safetensors) must still be the run's:
    consent's refusal of another task, without its import rule (nothing is imported here)."""
    from stride.trainers.tasks import consent

    if task is not None:
        consent(run_model_name(run_dir, summary, label), task, True, str(run_dir / "summary.json"))


def read_summary(run_dir: Path, label: str = "--run") -> dict[str, Any]:
    path = run_dir / "summary.json"
    if not path.is_file():
        raise UsageError(f"{label} ({run_dir}) is not a run folder (no summary.json); pass "
                         f"<run.storage_path>/<run.name> of a run that trained, such as runs/char_gpt")
    try:
        summary = runfolder.read_summary(path)
    except (OSError, ValueError) as e:
        raise UsageError(f"{label} ({run_dir}): summary.json is not one Stride writes ({e}); pass the folder of a run "
                         f"that trained") from None
    if not isinstance(summary.get("config"), dict):
        raise UsageError(f"{label} ({run_dir}): summary.json has no config; pass the folder of a run that trained")
    return summary


def pick_checkpoint(run_dir: Path, summary: dict, which: str) -> Path:
    if which == "last":
        newest = checkpointing.newest_complete(run_dir)
        if newest is None:
            raise UsageError(f"--run ({run_dir}) has no complete checkpoint; train it first, or pass --checkpoint PATH")
        return newest
    if which == "best":
        best = best_named(run_dir, summary)
        if best is None:
            raise UsageError(f"--checkpoint best: --run ({run_dir}) kept no best checkpoint (it trained without "
                             f"checkpoint.keep_best); pass --checkpoint last or a checkpoint folder")
        return usable(best, f"--checkpoint best: {best_field(run_dir)} ({best})")
    return usable(contained(run_dir, Path(which), f"--checkpoint ({which})"), f"--checkpoint ({which})")


def best_field(run_dir: Path) -> str:
    return f"{run_dir / 'summary.json'} best_checkpoints[0].checkpoint"


def best_named(run_dir: Path, summary: dict, flag: str = "--checkpoint best", label: str = "--run") -> Path | None:
    """The best kept checkpoint (checkpoint.keep_best) that the run's summary.json names, or None when it names
    none. Whoever can write the run folder writes summary.json too: the folder it names must lie inside the run
    folder (contained), never elsewhere. `flag` and `label` name the arguments, for the error line."""
    best = (summary.get("best_checkpoints") or [None])[0]
    if best is None:
        return None
    named = best.get("checkpoint") if isinstance(best, dict) else None
    if not isinstance(named, str):
        raise UsageError(f"{flag}: {best_field(run_dir)} ({str(named)[:200]}) is not a folder name; pass "
                         f"--checkpoint last or a checkpoint folder of the run")
    return contained(run_dir, Path(named), f"{flag}: {best_field(run_dir)} ({named[:200]})", label)


def contained(run_dir: Path, folder: Path, named: str, label: str = "--run") -> Path:
    """`folder`, when it lies inside the run folder `run_dir` with links resolved (a link inside the run cannot lead
    out of it); else UsageError (exit 2). `named`: where `folder` came from and its value; `label`: the argument that
    gave `run_dir`."""
    if not os.path.realpath(folder).startswith(os.path.realpath(run_dir) + os.sep):
        raise UsageError(f"{named} lies outside {label} ({run_dir}); pass a checkpoint folder of the run, or the run "
                         f"folder that holds it")
    return folder


def usable(folder: Path, named: str) -> Path:
    """`folder`, a complete checkpoint that verifies; else UsageError naming it (`named`) and what is wrong."""
    if problem := checkpointing.verify(folder):
        raise UsageError(f"{named} is unusable ({problem}); pass last, best or a complete checkpoint folder of the run")
    return folder


def check_same_task(run_name: str, checkpoint: Path, meta: dict, label: str = "--checkpoint") -> None:
    """A checkpoint of another task than the run's (`run_name`, its config.model.name) is refused before that
    task is built from the checkpoint's facts or given its weights. `label`: the argument that gave `checkpoint`.
    A meta.json that records no model (the earlier state.pt format) has nothing to compare: eval's shape check
    (check_fits) still applies, and export of it reads only tensors."""
    if meta.get("model") is not None and meta.get("model") != run_name:
        raise UsageError(f"{label} ({checkpoint}) holds model.name {meta.get('model')}, not the run's {run_name}; pass a "
                         f"checkpoint of this run")


def check_fits(cfg: Config, task, checkpoint: Path, meta: dict) -> None:
    """A checkpoint of another task, or of this task with other model settings, is refused before any worker."""
    import torch

    check_same_task(cfg.model.name, checkpoint, meta)
    with torch.device("meta"):
        model = task.build_model()
    saved = checkpointing.saved_model_shapes(checkpoint)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items() if not meta.get("trainable_only") or k in saved}
    if mismatch := checkpointing.shape_mismatch(shapes, saved):
        raise UsageError(f"--checkpoint ({checkpoint}) does not fit the run's model (the {mismatch}); pass a "
                         f"checkpoint of this run, or the model.* overrides it was trained with")


def output_name(text: str) -> str:
    """A name safe as a file name from a checkpoint's or data set's name."""
    import re

    return re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip("._") or "eval"


__all__ = ["TrainedRun", "add_arguments", "open_run", "run_config", "read_summary", "output_name"]


def split_spec(run, split: str, path: str | None, columns: tuple[str, ...] | None = None) -> DataSpec:
    """The rows a job reads: `path` (a command's --data), else the run's own `split`, checked against its task."""
    from stride.datasets import splits

    cache = splits.cache_folder(run.cfg)
    if path:
        data = splits.open_path(path, split, "--data", cache)
    elif getattr(run.cfg.data, f"{split}_path") or getattr(run.cfg.data, split):
        data = splits.open_split(run.cfg.data, split, cache)
    else:
        raise UsageError(f"--run ({run.run_dir}) trained without a {split} split (data.{split}_path); pass --data PATH")
    return splits.split_spec(run.cfg, run.task, data, columns)
