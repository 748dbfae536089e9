"""Export a checkpoint's model weights: one safetensors file loadable without Stride, or a Hugging Face model folder.

    stride export runs/char_gpt/checkpoint_00000600 model.safetensors
    stride export runs/char_gpt model.safetensors        # a run folder: its newest complete checkpoint
    stride export runs/char_gpt model.safetensors --best # its best one (checkpoint.keep_best)
    stride export --run runs/char_gpt --out model.safetensors [--checkpoint last|best] [--dtype bf16]
    stride export --run s3://bucket/runs/char_gpt --out model.safetensors   # a run on a bucket (downloaded first)
    stride export --run runs/hf_causal_lm --out hf_model --format hf \\
        --task hf_lm_task:HFCausalLM     # a transformers save_pretrained folder (the task's hf_model)

The checkpoint's shards (every rank's DCP file, any world size, DDP or FSDP) are consolidated in this one process into
the full tensors, named as the model's `state_dict()` names them, and written with safetensors (no pickle: loading the
file runs no code). Load them anywhere with

    from safetensors.torch import load_file
    model.load_state_dict(load_file("model.safetensors"))   # the task's build_model(), built-in or your own

--dtype bf16|fp16 casts the floating-point tensors (integer buffers stay as they are) before writing: half the bytes.
The optimizer state is not exported (resume from the checkpoint folder for that). The file's header metadata records
the step, the model name and the checkpoint it came from. An existing output file is never overwritten unless --force;
a folder is never replaced (--format hf: see below).

The safetensors format reads only tensors (through the checkpoint's allow-list), meta.json and the run's summary.json:
it imports no task, so no module a run folder names runs, and it needs neither --task nor --trust-remote-code. It
does not put the working directory on sys.path either. As `stride eval` does (trained.py), it exports only a checkpoint
of the run's own task (its meta.json's model.name is the summary.json's; a --task given must be it too), and a best
checkpoint that summary.json names only from inside the run folder.

--format hf writes a folder that `transformers.AutoModel*.from_pretrained` loads: the run's task is rebuilt from its
summary.json (config and data facts) as `stride eval` and `stride predict` rebuild it (trainers/commands/trained.py): a task of
your own needs consent (--task MODULE:CLASS or --trust-remote-code) and is found in the working directory or on
PYTHONPATH. Its model gets the checkpoint's weights, and the task's `hf_model` turns it into a
`transformers.PreTrainedModel`, saved with `save_pretrained` (safetensors). The folder is written beside `out`
and renamed into place, so a failed export leaves nothing half-written; --force replaces only an earlier Hugging Face
export (a folder with config.json and a *.safetensors file).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from stride.cli import ArgumentParser, reports_errors
from stride.errors import ExportError, RunFolderError
from stride.trainers.commands import trained
from stride.trainers.run import checkpointing
from stride.trainers.run import folder as runfolder
from stride.trainers.run import retention

# `stride NAME`, its line in `stride --help` and its place there (stride/commands.py reads these unimported).
NAME = "export"
HELP = "a checkpoint's weights as safetensors, or a Hugging Face folder"
ORDER = 30

EXIT_USAGE = 2
# --dtype: the torch dtype floating-point tensors are written in (fp32: as Stride saves them).
DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
FORMATS = ("safetensors", "hf")


def resolve(folder: Path, name: str = "checkpoint") -> Path:
    """The checkpoint to export: `folder` itself, or a run folder's newest complete checkpoint. `name`: the argument
    that gave `folder`, for the error line."""
    if not folder.is_dir():
        raise ExportError(f"{name} ({folder}) is not a folder; pass a checkpoint folder such as "
                          f"runs/char_gpt/checkpoint_00000600, or a run folder")
    is_run = any(folder.glob("checkpoint_*")) or (folder / "summary.json").is_file()
    if not (folder / checkpointing.META).exists() and is_run:
        skipped: list[str] = []
        newest = checkpointing.newest_complete(folder, skipped.append, "exporting")
        if newest is None:
            raise ExportError(f"{name} ({folder}) is a run folder without a complete checkpoint; train it first")
        for line in skipped:  # a newer checkpoint passed over, and why: not the one the user may expect
            warn_line(line)
        return newest
    if problem := checkpointing.verify(folder):
        raise ExportError(f"{name} ({folder}) is unusable ({problem}); pass a complete checkpoint folder, "
                          f"or the run folder to take its newest complete one")
    return folder


def warn_line(line: str) -> None:
    print(f"stride: warning: {line}", file=sys.stderr, flush=True)


def best_of(run: Path, flag: str = "--best", label: str = "run folder") -> Path:
    """A run folder's best checkpoint (checkpoint.keep_best), as its summary.json names it: inside the run folder,
    as eval takes it (trained.best_named). `label`: the argument that gave `run`."""

    try:
        summary = runfolder.read_summary(run / "summary.json")
    except (OSError, ValueError, RunFolderError):
        summary = {}
    best = trained.best_named(run, summary, flag, label)
    if best is None:
        raise ExportError(f"{flag}: run folder ({run}) names no best checkpoint in its summary.json (it ran without "
                          f"checkpoint.keep_best, or has not finished); export its newest checkpoint (without "
                          f"{flag}) or a checkpoint folder instead")
    return best


def run_folder_of(checkpoint: Path) -> Path | None:
    """The run folder that holds `checkpoint` (its parent; a kept best one's grandparent), when it has a
    summary.json; None for a checkpoint folder on its own."""
    parent = checkpoint.parent
    run = parent.parent if parent.name == retention.BEST else parent
    return run if (run / "summary.json").is_file() else None


def check_task(ckpt: Path, meta: dict, run_dir: Path | None, task: str | None, name: str, label: str) -> None:
    """Another task's checkpoint is not exported as the run's: its model.name must be the one the run's
    summary.json names (as eval requires, trained.check_same_task), and a --task must name that task too, though
    safetensors imports none. `name`, `label`: the arguments that gave `ckpt` and `run_dir`."""
    if run_dir is None:  # a checkpoint folder on its own: its meta.json is all there is to match
        if task is not None and task != meta.get("model"):
            raise ExportError(f"--task ({task[:200]}) is not the task of {name} ({ckpt}), model.name "
                              f"({meta.get('model')}); pass --task {meta.get('model')}, or no --task")
        return
    summary = trained.read_summary(run_dir, label)
    trained.check_named_task(run_dir, summary, task, label)
    trained.check_same_task(trained.run_model_name(run_dir, summary, label), ckpt, meta, "checkpoint")


def cast(weights: dict, dtype: str) -> dict:
    """Floating-point tensors in `dtype` (a DTYPES key); integer buffers (step counters, indices) as they are."""
    import torch

    to = getattr(torch, DTYPES[dtype])
    return {k: v.to(to) if v.is_floating_point() else v for k, v in weights.items()}


def check_out_parent(out: Path) -> None:
    if not out.parent.is_dir():
        raise ExportError(f"out ({out}): folder {out.parent} does not exist; create it or pass another path")
    if not os.access(out.parent, os.W_OK | os.X_OK):
        raise ExportError(f"out ({out}): folder {out.parent} is not writable by you; pass a path in a folder you "
                          f"can write")


def export(checkpoint: Path, out: Path, force: bool = False, trainable_only: bool = False, ema: bool = False,
           dtype: str = "fp32", name: str = "checkpoint", task: str | None = None, run_dir: Path | None = None,
           run_label: str = "checkpoint's run folder", source: str | None = None) -> dict:
    """Write `checkpoint`'s model weights to `out` (safetensors); returns what was written. `trainable_only`: only
    the parameters that were training when it was saved (a LoRA run's adapters), as its meta.json lists them.
    `name`: the argument that gave `checkpoint`, for the error lines. `task`, `run_dir` (default: the run folder
    holding the checkpoint), `run_label`: see check_task. `source`: the checkpoint as the output names it (default:
    its folder; a run on a bucket: its URI)."""
    if out.is_dir():
        raise ExportError(f"out ({out}) is a folder; pass a file path such as {out / 'model.safetensors'}")
    if out.exists() and not force:
        raise ExportError(f"out ({out}) exists; pass another path, or --force to replace it")
    check_out_parent(out)
    ckpt = resolve(checkpoint, name)
    meta = checkpointing.read_meta(ckpt)
    check_task(ckpt, meta, run_dir or run_folder_of(ckpt), task, name, run_label)
    weights = trained.load_weights(ckpt, meta, ema=ema)
    if meta.get("trainable_only") and not trainable_only:
        raise ExportError(f"checkpoint ({ckpt}) holds only the trainable parameters (checkpoint.trainable_only): "
                          f"its frozen base is init.from's ({(meta.get('init') or {}).get('from')}); pass "
                          f"--trainable-only to export them, and load them on that base")
    if trainable_only and meta.get("trainable") is not None:
        weights = {k: v for k, v in weights.items() if k in set(meta["trainable"])}
    # Tied weights (a head sharing the embedding) are separate tensors here, each under its own name, as
    # load_state_dict expects; safetensors refuses tensors that share memory: each is copied.
    weights = {k: v.detach().contiguous().clone() for k, v in cast(weights, dtype).items()}
    header = {"format": "pt", "step": str(meta.get("step")), "model": str(meta.get("model")),
              "checkpoint": source or str(ckpt.resolve()), "trainable_only": str(trainable_only).lower(),
              "ema": str(ema).lower(), "dtype": dtype}
    write_weights(weights, out, header)
    return {"checkpoint": source or str(ckpt), "out": str(out), "tensors": len(weights),
            "parameters": sum(v.numel() for v in weights.values()), "bytes": out.stat().st_size, **header}


def write_weights(weights: dict, out: Path, header: dict[str, str]) -> None:
    """`weights` as one safetensors file at `out`. Written under a fresh random name beside it, created without
    following links (a name planted in advance is never written through), then renamed onto `out`: a reader never
    sees half a file, and a failed export leaves `out` as it was."""
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    tmp = runfolder.temp_name(out)
    try:
        os.close(runfolder.create_new(tmp))
        save_file(weights, str(tmp), metadata=header)
        os.replace(tmp, out)
    except (OSError, SafetensorError) as e:  # safetensors reports an I/O error as its own SafetensorError
        tmp.unlink(missing_ok=True)
        raise ExportError(f"out ({out}) could not be written ({' '.join(str(e).split())[:200]}); pass a path in a "
                          f"folder you can write, with room for the file") from None


# ---- --format hf ----

def is_hf_export(folder: Path) -> bool:
    """An earlier `save_pretrained` folder: config.json, a *.safetensors file, and files only (what --force may
    replace: never a folder of anything else)."""
    if folder.is_symlink() or not folder.is_dir():
        return False
    entries = list(folder.iterdir())
    return ((folder / "config.json").is_file() and any(e.suffix == ".safetensors" for e in entries)
            and all(e.is_file() and not e.is_symlink() for e in entries))


def check_out_folder(out: Path, force: bool) -> None:
    if out.exists() or out.is_symlink():
        if not force:
            raise ExportError(f"out ({out}) exists; pass another path, or --force to replace it")
        if not is_hf_export(out):
            raise ExportError(f"out ({out}) exists and is not an earlier Hugging Face export (a folder of files with "
                              f"config.json and *.safetensors), which is all --force replaces; pass another path")
    check_out_parent(out)


def hf_model_of(checkpoint: Path, run_dir: Path, ema: bool, task: str | None, trust_remote_code: bool, label: str):
    """The run folder `run_dir` opened as eval and predict open it (trained.open_trained: its task rebuilt from its
    summary.json), its model with the checkpoint's weights, as the task's `transformers.PreTrainedModel`
    (Task.hf_model). `label` names the run folder's argument."""
    run = trained.open_trained(run_dir, checkpoint, task, trust_remote_code, label=label, checkpoint_label="checkpoint")
    model = trained.trained_model(run, ema)
    try:
        hf = run.task.hf_model(model)
    except NotImplementedError:
        raise ExportError(f"--format hf: the task {run.cfg.model.name} has no Hugging Face form; implement "
                          f"Task.hf_model, or export --format safetensors") from None
    if not callable(getattr(hf, "save_pretrained", None)):
        raise ExportError(f"--format hf: the task {run.cfg.model.name}'s hf_model returned a {type(hf).__name__}, not "
                          f"a transformers PreTrainedModel; return one (the model itself when build_model gives one)")
    return hf


def write_folder(model, out: Path) -> None:
    """`model.save_pretrained` into a sibling folder, then renamed to `out` (an earlier export moved aside and
    removed only once the new one is in place): a failed export leaves `out` as it was."""
    import shutil

    from safetensors import SafetensorError

    # Fresh random names (runfolder.temp_name): nothing can be planted there in advance, and mkdir never follows.
    tmp, old = runfolder.temp_name(out), runfolder.temp_name(out).with_suffix(".old")
    try:
        tmp.mkdir()
        model.save_pretrained(tmp, safe_serialization=True)
        if out.exists():
            os.rename(out, old)
        os.rename(tmp, out)
    except (OSError, SafetensorError) as e:
        if old.exists() and not out.exists():
            os.rename(old, out)
        raise ExportError(f"out ({out}) could not be written ({' '.join(str(e).split())[:200]}); pass a path in a "
                          f"folder you can write, with room for the model") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    shutil.rmtree(old, ignore_errors=True)


def export_hf(checkpoint: Path, out: Path, force: bool = False, ema: bool = False, dtype: str = "fp32",
              task: str | None = None, trust_remote_code: bool = False, name: str = "checkpoint",
              run_dir: Path | None = None, run_label: str = "checkpoint's run folder",
              source: str | None = None) -> dict:
    """Write `checkpoint`'s model as a Hugging Face folder `out` (save_pretrained, safetensors); returns what was
    written. The task comes from the summary.json of `run_dir` (default: the checkpoint's run folder); `name` and
    `run_label`: the arguments that gave `checkpoint` and `run_dir`, for the error lines."""
    import torch

    check_out_folder(out, force)
    ckpt = resolve(checkpoint, name)
    run_dir = run_dir or run_folder_of(ckpt) or ckpt.parent  # no summary.json there: refused by name
    model = hf_model_of(ckpt, run_dir, ema, task, trust_remote_code, run_label)
    model.to(getattr(torch, DTYPES[dtype]))  # nn.Module.to(dtype) casts floating-point tensors only
    write_folder(model, out)
    meta = checkpointing.read_meta(ckpt)
    return {"checkpoint": source or str(ckpt), "out": str(out), "format": "hf", "class": type(model).__name__,
            "parameters": sum(p.numel() for p in model.parameters()),
            "bytes": sum(f.stat().st_size for f in out.iterdir()), "step": meta.get("step"),
            "model": meta.get("model"), "ema": ema, "dtype": dtype}


# ---- the command line ----

def parse_args(argv: list[str] | None, prog: str):
    usage = "%(prog)s CHECKPOINT OUT [options]\n       %(prog)s --run DIR --out PATH [options]"
    ap = ArgumentParser(prog=prog, usage=usage,
                        description="Export a checkpoint's model weights: one safetensors file, or a Hugging Face "
                                    "model folder (--format hf).")
    ap.add_argument("checkpoint", type=Path, nargs="?",
                    help="checkpoint folder (or run folder: its newest complete checkpoint)")
    ap.add_argument("out", type=Path, nargs="?", help="output file, e.g. model.safetensors (--format hf: a folder)")
    ap.add_argument("--run", type=trained.run_arg, metavar="DIR",
                    help="run folder, or a run on a bucket (s3://, gs://) (instead of CHECKPOINT OUT): "
                         "<run.storage_path>/<run.name>")
    ap.add_argument("--out", type=Path, dest="out_path", metavar="PATH", help="with --run: the file (--format hf: "
                                                                              "the folder) to write")
    ap.add_argument("--checkpoint", choices=("last", "best"), dest="which",
                    help="with --run: its newest complete checkpoint (last, the default) or its best one "
                         "(checkpoint.keep_best)")
    ap.add_argument("--format", choices=FORMATS, default="safetensors",
                    help="safetensors: one file of the state_dict's tensors; hf: a save_pretrained folder (the "
                         "task's hf_model)")
    ap.add_argument("--dtype", choices=tuple(DTYPES), default="fp32",
                    help="the floating-point tensors' type as written (integer buffers stay as they are)")
    ap.add_argument("--force", action="store_true",
                    help="replace `out` if it exists (--format hf: only an earlier Hugging Face export)")
    ap.add_argument("--ema", action="store_true", help="the average of the weights (train.ema) instead of the weights")
    ap.add_argument("--best", action="store_true",
                    help="the run folder's best checkpoint (checkpoint.keep_best; summary.json names it)")
    ap.add_argument("--trainable-only", action="store_true",
                    help="only the parameters that were training (a LoRA run's adapters), not the frozen base")
    trained.consent_arguments(ap, "--format hf: ", " (safetensors: checked, never imported)")
    args = ap.parse_args(argv)
    if args.run is not None:
        if args.checkpoint is not None:
            ap.error("pass either CHECKPOINT OUT or --run DIR --out PATH, not both")
        if args.out_path is None:
            ap.error("--run needs --out PATH (the file to write; with --format hf, the folder)")
        if args.best:
            ap.error("--best goes with CHECKPOINT OUT; with --run pass --checkpoint best")
    else:
        if args.out_path is not None or args.which is not None:
            ap.error(f"{'--out' if args.out_path is not None else '--checkpoint'} goes with --run DIR; pass --run, "
                     f"or CHECKPOINT OUT")
        if missing := [n for n in ("checkpoint", "out") if getattr(args, n) is None]:
            ap.error(f"the following arguments are required: {', '.join(missing)}")
    if args.format == "hf" and args.trainable_only:
        ap.error("--trainable-only writes the trained parameters alone, a safetensors file; drop it for --format hf")
    return args


@reports_errors
def main(argv: list[str] | None = None, prog: str = "stride export") -> int:
    print(json.dumps(export_command(parse_args(argv, prog))))
    return 0


def export_command(args) -> dict:
    """What main does after parsing: the checkpoint the arguments name, exported. A run on a bucket (--run URI) is
    downloaded first (its summary.json and that checkpoint, into a private folder removed after the export)."""
    if args.run is not None and trained.is_uri(args.run):
        copy = trained.download_run(str(args.run), args.which or "last")
        if isinstance(copy, Path):  # file:///folder
            return export_folder(argparse_replace(args, run=copy))
        with copy:
            return export_copy(args, copy)
    return export_folder(args)


def export_copy(args, copy) -> dict:
    """export_command of a run on a bucket, on its downloaded copy; the output names the checkpoint by its URI."""
    name, where = ("--checkpoint best" if args.which == "best" else "--run"), copy.where(copy.checkpoint)
    try:
        if args.format == "hf":
            return export_hf(copy.checkpoint, args.out_path, args.force, args.ema, args.dtype, args.task,
                             args.trust_remote_code, name, copy.run_dir, "--run", where)
        return export(copy.checkpoint, args.out_path, args.force, args.trainable_only, args.ema, args.dtype, name,
                      args.task, copy.run_dir, "--run", where)
    except BaseException as e:
        raise trained.in_bucket_words(e, copy) from None


def argparse_replace(args, **changes):
    import argparse

    return argparse.Namespace(**{**vars(args), **changes})


def export_folder(args) -> dict:
    run_dir, run_label = args.run, ("--run" if args.run is not None else "checkpoint's run folder")
    if args.run is not None:
        if not (args.run / "summary.json").is_file():
            raise ExportError(f"--run ({args.run}) has no summary.json; pass a run folder such as runs/char_gpt, "
                              f"or a checkpoint folder as CHECKPOINT")
        name, out = ("--checkpoint best" if args.which == "best" else "--run"), args.out_path
        source = best_of(args.run, name, "--run") if args.which == "best" else args.run
    else:
        name, out = ("--best" if args.best else "checkpoint"), args.out
        source = best_of(args.checkpoint) if args.best else args.checkpoint
        run_dir = args.checkpoint if args.best else None
    if args.format == "hf":
        return export_hf(source, out, args.force, args.ema, args.dtype, args.task, args.trust_remote_code, name,
                         run_dir, run_label)
    return export(source, out, args.force, args.trainable_only, args.ema, args.dtype, name, args.task, run_dir,
                  run_label)


if __name__ == "__main__":
    sys.exit(main())
