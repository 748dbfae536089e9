"""Export a checkpoint's model weights as one safetensors file, loadable without Stride.

    python trainers/export.py runs/char_gpt/checkpoint_00000600 model.safetensors
    python trainers/export.py runs/char_gpt model.safetensors        # a run folder: its newest complete checkpoint
    python trainers/export.py runs/char_gpt model.safetensors --best # its best one (checkpoint.keep_best)

The checkpoint's shards (every rank's DCP file, any world size, DDP or FSDP) are consolidated in this one process into
the full tensors, named as the model's `state_dict()` names them, and written with safetensors (no pickle: loading the
file runs no code). Load them anywhere with

    from safetensors.torch import load_file
    model.load_state_dict(load_file("model.safetensors"))   # the task's build_model(), built-in or your own

The optimizer state is not exported (resume from the checkpoint folder for that). The file's header metadata records
the step, the model name and the checkpoint it came from. An existing output file is never overwritten unless --force;
a folder is never replaced.

Export reads only tensors (through the checkpoint's allow-list) and meta.json: it imports no task, so no module a run
folder names runs, and it needs neither --task nor --trust-remote-code (trainers/generate.py does). It does not put
the working directory on sys.path either.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

if not __package__:  # run as a file from a checkout: import Stride as the `stride` package (stride/_checkout.py)
    import runpy

    runpy.run_path(str(Path(__file__).resolve().parents[1] / "stride" / "_checkout.py"))
if __name__ == "__main__":
    from stride.cli import drop_working_directory_from_path

    drop_working_directory_from_path()

from stride.cli import ArgumentParser  # noqa: E402
from stride.trainers import checkpointing  # noqa: E402

EXIT_USAGE = 2


class ExportError(ValueError):
    """A problem the user can fix: one line naming the argument, the value and the fix."""


def resolve(folder: Path) -> Path:
    """The checkpoint to export: `folder` itself, or a run folder's newest complete checkpoint."""
    if not folder.is_dir():
        raise ExportError(f"checkpoint ({folder}) is not a folder; pass a checkpoint folder such as "
                          f"runs/char_gpt/checkpoint_00000600, or a run folder")
    if not (folder / checkpointing.META).exists() and any(folder.glob("checkpoint_*")):
        newest = checkpointing.newest_complete(folder)
        if newest is None:
            raise ExportError(f"checkpoint ({folder}) is a run folder without a complete checkpoint; train it first")
        return newest
    if problem := checkpointing.verify(folder):
        raise ExportError(f"checkpoint ({folder}) is unusable ({problem}); pass a complete checkpoint folder, "
                          f"or the run folder to take its newest complete one")
    return folder


def best_of(run: Path) -> Path:
    """A run folder's best checkpoint (checkpoint.keep_best), as its summary.json names it."""
    from stride.trainers import runfolder

    try:
        best = (runfolder.read_summary(run / "summary.json").get("best_checkpoints") or [None])[0]
    except (OSError, ValueError, runfolder.RunFolderError):
        best = None
    if best is None:
        raise ExportError(f"--best: run folder ({run}) names no best checkpoint in its summary.json (it ran without "
                          f"checkpoint.keep_best, or has not finished); pass a checkpoint folder instead")
    return Path(best["checkpoint"])


def export(checkpoint: Path, out: Path, force: bool = False, trainable_only: bool = False, ema: bool = False) -> dict:
    """Write `checkpoint`'s model weights to `out` (safetensors); returns what was written. `trainable_only`: only
    the parameters that were training when it was saved (a LoRA run's adapters), as its meta.json lists them."""
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    if out.is_dir():
        raise ExportError(f"out ({out}) is a folder; pass a file path such as {out / 'model.safetensors'}")
    if out.exists() and not force:
        raise ExportError(f"out ({out}) exists; pass another path, or --force to replace it")
    if not out.parent.is_dir():
        raise ExportError(f"out ({out}): folder {out.parent} does not exist; create it or pass another path")
    if not os.access(out.parent, os.W_OK | os.X_OK):
        raise ExportError(f"out ({out}): folder {out.parent} is not writable by you; pass a path in a folder you "
                          f"can write")
    ckpt = resolve(checkpoint)
    try:
        weights = checkpointing.load_model_state(ckpt)
        average = checkpointing.load_model_state(ckpt, "ema") if ema else {}
    except checkpointing.UnsafeCheckpointError as e:
        raise ExportError(str(e)) from None
    if ema and not average:
        raise ExportError(f"--ema: checkpoint ({ckpt}) holds no average of the weights (the run had no train.ema); "
                          f"export without --ema")
    weights.update(average)  # the average's parameters; buffers (batch-norm statistics) are the model's
    meta = checkpointing.read_meta(ckpt)
    if meta.get("trainable_only") and not trainable_only:
        raise ExportError(f"checkpoint ({ckpt}) holds only the trainable parameters (checkpoint.trainable_only): "
                          f"its frozen base is init.from's ({(meta.get('init') or {}).get('from')}); pass "
                          f"--trainable-only to export them, and load them on that base")
    if trainable_only and meta.get("trainable") is not None:
        weights = {k: v for k, v in weights.items() if k in set(meta["trainable"])}
    # Tied weights (a head sharing the embedding) are separate tensors here, each under its own name, as
    # load_state_dict expects; safetensors refuses tensors that share memory, so copies of the earlier format's.
    weights = {k: v.detach().contiguous().clone() for k, v in weights.items()}
    header = {"format": "pt", "step": str(meta.get("step")), "model": str(meta.get("model")),
              "checkpoint": str(ckpt.resolve()), "trainable_only": str(trainable_only).lower(),
              "ema": str(ema).lower()}
    tmp = out.with_name(f".{out.name}.tmp")
    try:
        save_file(weights, str(tmp), metadata=header)
        os.replace(tmp, out)  # a reader never sees half a file; a failed export leaves `out` as it was
    except (OSError, SafetensorError) as e:  # safetensors reports an I/O error as its own SafetensorError
        tmp.unlink(missing_ok=True)
        raise ExportError(f"out ({out}) could not be written ({' '.join(str(e).split())[:200]}); pass a path in a "
                          f"folder you can write, with room for the file") from None
    return {"checkpoint": str(ckpt), "out": str(out), "tensors": len(weights),
            "parameters": sum(v.numel() for v in weights.values()), "bytes": out.stat().st_size, **header}


def main(argv: list[str] | None = None) -> int:
    ap = ArgumentParser(prog="python trainers/export.py",
                        description="Consolidate a checkpoint's model weights into one safetensors file.")
    ap.add_argument("checkpoint", type=Path, help="checkpoint folder (or run folder: its newest complete checkpoint)")
    ap.add_argument("out", type=Path, help="output file, e.g. model.safetensors")
    ap.add_argument("--force", action="store_true", help="replace `out` if it exists")
    ap.add_argument("--ema", action="store_true", help="the average of the weights (train.ema) instead of the weights")
    ap.add_argument("--best", action="store_true",
                    help="the run folder's best checkpoint (checkpoint.keep_best; summary.json names it)")
    ap.add_argument("--trainable-only", action="store_true",
                    help="only the parameters that were training (a LoRA run's adapters), not the frozen base")
    args = ap.parse_args(argv)
    try:
        source = best_of(args.checkpoint) if args.best else args.checkpoint
        info = export(source, args.out, args.force, args.trainable_only, args.ema)
    except ExportError as e:
        print(f"export: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    print(json.dumps(info))
    return 0


if __name__ == "__main__":
    sys.exit(main())
