"""`stride predict`: the task's per-sample outputs over a data set, written as Parquet parts.

    stride predict --run runs/my_run --data new.parquet --out predictions/ [--checkpoint last|best|PATH] \
        [--keep-columns path,...]
    torchrun --standalone --nproc-per-node 2 -m stride predict --run-dir runs/my_run --data ... --out ...

Each worker loads the whole model (the run's task, precision, checkpoint; no sharding, so no worker waits on
another) and takes the data's blocks (Parquet row groups, line ranges) r, r + N, ...; block b becomes
`<out>/part-<b>.parquet` with `sample_id` (the data's column, or the row's position in file order when it has none),
the input columns --keep-columns names, as read, and the columns `Task.predict(model, batch)` returns, in the data's
order. A part is written under a temporary name and renamed: it is there whole or not at all. A rerun of the same
command (after a crash, a SIGKILL, a lost node) skips the parts that are there and removes the temporary file of any
part the failure cut short, so every row is written exactly once. `<out>/_predict.json` marks the end.
"""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from stride.cli import reports_errors
from stride.errors import TrainingError, UsageError
from stride.trainers.commands import trained
from stride.trainers.commands.evaluate import CheckpointModel, JobPlan

# `stride NAME`, its line in `stride --help` and its place there (stride/commands.py reads these unimported).
NAME = "predict"
HELP = "the task's per-sample outputs over a data set, as Parquet parts"
ORDER = 20

# The end of a prediction, and what it is of (a resume checks it); "_" and "." keep readers of the folder (pyarrow,
# pandas, Ray Data) to the parts.
MANIFEST, JOB = "_predict.json", ".stride-predict.json"


def part_name(block: int) -> str:
    return f"part-{block:06d}.parquet"


def predict_job(cfg, env, plan: JobPlan) -> dict[str, Any]:
    """One worker's share of `stride predict`: its blocks that have no part yet."""
    from stride.datasets.order import eval_blocks
    from stride.datasets.stream import BlockReader, fetcher, frame_of

    job = CheckpointModel(cfg, env, plan, shard=False)
    job.load()
    if job.ema is not None and cfg.train.ema.eval != "raw":  # the weights the run evaluated (train.ema.eval)
        job.ema.average.swap()
    output = PartSink(plan)
    spec, keep = plan.val, list(plan.keep_columns)
    reads = task_columns(job.task)
    unread = [c for c in keep if reads is not None and c not in reads]  # read for the output only, not the task's
    reader, files = BlockReader(spec), fetcher(spec)
    rows = parts = 0
    t0 = time.perf_counter()
    try:
        for b in eval_blocks(reader.num_blocks, env.world_rank, env.world_size):
            if output.has(part_name(b)):  # written whole by an earlier attempt
                continue
            table = reader.read(b)
            frame = frame_of(table.drop_columns(unread))
            batches = [files.fetch(frame.slice(lo, lo + plan.batch_rows)).columns()
                       for lo in range(0, len(frame), plan.batch_rows)]
            output.write(part_name(b), with_kept(predict_rows(job, batches), table.select(keep)))
            rows, parts = rows + len(frame), parts + 1
    finally:
        files.close()
        output.close()
    # Summed over the gang, which is also the barrier: under torchrun rank 0 checks every part once this returns.
    from stride.trainers.step import all_reduce_sum

    rows, parts = all_reduce_sum(torch.tensor([rows, parts], dtype=torch.float64), env.device).tolist()
    return {"rows_predicted": int(rows), "parts_predicted": int(parts), "seconds": time.perf_counter() - t0}


class PartSink:
    """Where a worker puts its parts: the output folder (plan.out), or a bucket (plan.out_uri): each part written into
    this worker's private scratch folder, then uploaded as one object (there whole or not at all) and removed. The
    workers upload their own parts, so no node needs to see another's disk."""

    def __init__(self, plan: JobPlan):
        import tempfile

        self.store = bucket_store(plan.out_uri) if plan.out_uri else None
        self.folder = Path(tempfile.mkdtemp(prefix="stride-predict-")) if self.store else Path(plan.out)
        self.there = set(self.store.listing("")) if self.store else None

    def has(self, name: str) -> bool:
        return name in self.there if self.store else (self.folder / name).exists()

    def write(self, name: str, table: pa.Table) -> None:
        write_part(self.folder / name, table)
        if self.store:
            from stride.trainers.run.storage import with_backoff

            with_backoff(lambda: self.store.upload(self.folder / name, name))
            (self.folder / name).unlink()

    def close(self) -> None:
        if self.store:
            import shutil

            shutil.rmtree(self.folder, ignore_errors=True)


def bucket_store(uri: str):
    from stride.trainers.run.storage import ObjectStore, location_of

    return ObjectStore(location_of(uri))


@torch.no_grad()
def predict_rows(job: CheckpointModel, batches) -> pa.Table:
    """sample_id and the task's outputs of `batches` (Columns), as one table."""
    from stride.trainers.loop import to_device

    ids, outputs = [], {}
    for rows in batches:
        batch = to_device(job.task.transform(rows.data), job.env.device, job.cfg.model.name)
        with job.precision.autocast():
            got = job.task.predict(job.model, batch)
        for name, value in got.items():
            value = as_numpy(value)
            if len(value) != len(rows):
                raise TrainingError(f"model.name ({job.cfg.model.name}): predict returned {name!r} with {len(value)} "
                                    f"rows for a batch of {len(rows)}; return one value per row")
            outputs.setdefault(name, []).append(value)
        ids.append(rows.sample_id)
    return pa.table({"sample_id": np.concatenate(ids), **{k: arrow_column(np.concatenate(v)) for k, v in outputs.items()}})


def with_kept(part: pa.Table, kept: pa.Table) -> pa.Table:
    """The part with the --keep-columns (its rows' input values, in the same order) after sample_id."""
    for i, name in enumerate(kept.column_names):
        if name in part.column_names:
            raise TrainingError(f"--keep-columns ({name}): Task.predict returns an output of that name too; keep other "
                                f"columns, or rename the output")
        part = part.add_column(1 + i, name, kept.column(name))
    return part


def task_columns(task) -> tuple[str, ...] | None:
    """The columns `stride predict` reads for the task: its predict_columns, else its columns (None: every column)."""
    columns = task.predict_columns if task.predict_columns is not None else task.columns
    return None if columns is None else tuple(columns)


def as_numpy(value) -> np.ndarray:
    """One output of Task.predict on the host: a floating tensor as float32 (numpy has no bfloat16), any other
    tensor or a numpy array as it is."""
    if not isinstance(value, torch.Tensor):
        return np.asarray(value)
    value = value.detach()
    return (value.float() if torch.is_floating_point(value) else value).cpu().numpy()


def arrow_column(values: np.ndarray) -> pa.Array:
    """A per-row value as a column: a number, or a fixed-size list (a vector; further dimensions flattened)."""
    if values.ndim == 1:
        return pa.array(values)
    flat = values.reshape(len(values), -1)
    return pa.FixedSizeListArray.from_arrays(pa.array(flat.reshape(-1)), flat.shape[1])


def write_part(path: Path, table: pa.Table) -> None:
    """The part, whole or not at all, through the no-follow writer (a link planted at its name is refused)."""
    from stride.trainers.run.folder import atomic_write_bytes

    sink = pa.BufferOutputStream()
    pq.write_table(table, sink)
    atomic_write_bytes(path, sink.getvalue().to_pybytes())


# What stride predict writes in --out, and all that --force or a resume ever removes: the parts, a part a killed
# attempt was writing (runfolder.temp_name's names, and the <pid>.tmp ones of earlier versions), the markers.
OURS = re.compile(r"part-\d{6}\.parquet|\.part-\d{6}\.parquet\.[0-9a-f-]+\.tmp|" + re.escape(MANIFEST))
UNFINISHED = re.compile(r"\.part-\d{6}\.parquet\.[0-9a-f-]+\.tmp")


# ---- the driver: the output folder, the gang, the manifest ----

def job_identity(run, spec, keep: tuple[str, ...] = ()) -> dict[str, Any]:
    """What a prediction is of: a rerun resumes only the same run, checkpoint, data and kept columns (every part
    has the same columns)."""
    return {"run": run.where(), "checkpoint": run.where(run.checkpoint),
            "step": run.meta.get("step"), "data": [str(Path(f).resolve()) if "://" not in f else f for f in spec.files],
            "rows": spec.num_rows, "blocks": len(spec.blocks), **({"keep_columns": list(keep)} if keep else {})}


def predict_spec(run, data: str, keep: tuple[str, ...]):
    """What the workers read of `data` (--data): the task's columns and the --keep-columns. A kept name that is not
    a column of the data is refused (UsageError) with the names it has; sample_id is written anyway."""
    from stride.datasets import splits

    split = splits.open_path(data, "predict", "--data", splits.cache_folder(run.cfg))
    names = split.schema.names
    if unknown := [c for c in keep if c not in names and c != splits.SAMPLE_ID]:
        shown = ", ".join(names[:40]) + (f", ... ({len(names)} columns)" if len(names) > 40 else "")
        raise UsageError(f"--keep-columns ({unknown[0][:200]}) is not a column of --data ({data}); keep columns it "
                         f"has: {shown}")
    keep = tuple(c for c in keep if c != splits.SAMPLE_ID)
    reads = task_columns(run.task)
    columns = None if reads is None else (*reads, *(c for c in keep if c not in reads))
    return splits.split_spec(run.cfg, run.task, split, columns), keep


def keep_columns_arg(text: str) -> tuple[str, ...]:
    """--keep-columns a,b,...: the names in order, each once."""
    return tuple(dict.fromkeys(name.strip() for name in text.split(",") if name.strip()))


def prepare_output(out: Path, identity: dict[str, Any], force: bool) -> bool:
    """Make `out` ready; True when it resumes an unfinished prediction of the same job. An output that exists is
    refused (UsageError) unless it is that, or --force replaces (starts over) an earlier prediction. Only the files
    stride predict writes are ever removed (OURS): a folder that holds anything else is never emptied."""
    if not out.exists():
        out.mkdir(parents=True)
        return False
    if not out.is_dir():
        raise UsageError(f"--out ({out}) exists and is not a folder; pass a new folder")
    from stride.trainers.run.folder import refuse_unless_regular

    ours = refuse_unless_regular(out / JOB) is not None  # a link, a folder or a FIFO of that name: refused
    if not ours and any(out.iterdir()):
        raise UsageError(f"--out ({out}) exists and holds files that stride predict did not write; pass a new folder")
    earlier = read_job(out) if ours and not force else None
    if ours and earlier == identity and not (out / MANIFEST).exists() and not force:
        remove_ours(out, UNFINISHED)  # parts a killed attempt was writing: never renamed into place
        return True
    if not force and ours:
        what = "a finished prediction" if (out / MANIFEST).exists() else "an unfinished prediction of other inputs"
        raise UsageError(f"--out ({out}) exists and holds {what}; pass a new folder, or --force to replace it")
    remove_ours(out, OURS)
    (out / JOB).unlink(missing_ok=True)  # last, so that the folder stays marked as ours until it is clean
    return False


def read_job(out: Path) -> Any:
    """The record of the prediction in `out` (JOB), or a one-line refusal if it is not one Stride wrote."""
    from stride.trainers.run.folder import read_json

    try:
        return read_json(out / JOB)
    except (OSError, ValueError) as e:  # RunFolderError (a link, a FIFO) is a StrideError and goes up as it is
        raise UsageError(f"--out ({out}): {JOB} is not a record stride predict wrote ({type(e).__name__}: "
                         f"{str(e)[:200]}); pass a new folder, or --force to replace the earlier prediction") from None


def remove_ours(out: Path, names: re.Pattern) -> None:
    """Unlink the entries of `out` whose whole name matches `names` (unlink removes a link, never its target)."""
    for f in out.iterdir():
        if names.fullmatch(f.name):
            f.unlink()


def finish(out: Path, identity: dict[str, Any], results: dict, t0: float) -> dict[str, Any]:
    """Check that every block has its part, then write the manifest."""
    from stride.trainers.run.folder import atomic_write_text

    missing = [b for b in range(identity["blocks"]) if not (out / part_name(b)).exists()]
    if missing:
        raise TrainingError(f"--out ({out}): {len(missing)} part(s) missing after the workers finished (first: "
                            f"{part_name(missing[0])}); rerun the same command to write them")
    rows = sum(pq.ParquetFile(out / part_name(b)).metadata.num_rows for b in range(identity["blocks"]))
    manifest = {**identity, "parts": identity["blocks"], "rows_written": rows, **results, "wall_s": time.time() - t0}
    atomic_write_text(out / MANIFEST, json.dumps(manifest, indent=1) + "\n")
    return manifest


# ---- --out on a bucket (s3://, gs://): the same names and the same rules as a folder, on objects ----

def out_store(text: str):
    """The bucket prefix --out names (an ObjectStore, checked writable), or None for a folder. UsageError or
    StorageError (exit 2) naming --out, the URI without credentials, and the fix."""
    if not trained.is_uri(text):
        return None
    store = trained.open_store(text, "--out")
    if isinstance(store, Path):
        return None
    store.check_writable("--out")
    return store


def prepare_bucket(store, identity: dict[str, Any], force: bool) -> bool:
    """prepare_output on a bucket prefix: True when it resumes an unfinished prediction of the same job; a prefix
    holding anything else is refused, and --force removes only the names stride predict writes (OURS), at the
    prefix's top, and the job's record last."""
    label = f"--out ({store.describe()})"
    names = set(store.listing(""))
    ours = JOB in names
    if not ours and names:
        raise UsageError(f"{label} holds objects that stride predict did not write; pass a new prefix")
    if ours and not force:
        if read_bucket_job(store) == identity and MANIFEST not in names:
            return True
        what = "a finished prediction" if MANIFEST in names else "an unfinished prediction of other inputs"
        raise UsageError(f"{label} holds {what}; pass a new prefix, or --force to replace it")
    for name in sorted(n for n in names if OURS.fullmatch(n)):
        store.delete(name)
    store.delete(JOB)
    return False


def read_bucket_job(store) -> Any:
    try:
        return json.loads(store.read(JOB) or b"null")
    except ValueError as e:
        raise UsageError(f"--out ({store.describe()}): {JOB} is not a record stride predict wrote ({str(e)[:200]}); "
                         f"pass a new prefix, or --force to replace the earlier prediction") from None


def finish_bucket(store, identity: dict[str, Any], results: dict, t0: float) -> dict[str, Any]:
    """finish() on a bucket prefix: every part there, then the manifest."""
    there = store.listing("")
    missing = [b for b in range(identity["blocks"]) if part_name(b) not in there]
    if missing:
        raise TrainingError(f"--out ({store.describe()}): {len(missing)} part(s) missing after the workers finished "
                            f"(first: {part_name(missing[0])}); rerun the same command to write them")
    rows = 0
    for b in range(identity["blocks"]):  # each part's footer alone, by ranged reads
        with store.fs.open(f"{store.location.path}/{part_name(b)}", "rb") as f:
            rows += pq.ParquetFile(f).metadata.num_rows
    manifest = {**identity, "parts": identity["blocks"], "rows_written": rows, **results, "wall_s": time.time() - t0}
    store.write(MANIFEST, (json.dumps(manifest, indent=1) + "\n").encode())
    return manifest


def parse_args(argv):
    ap = trained.parser("stride predict", "Write the task's per-sample outputs (Task.predict) over a data set as "
                                          "Parquet.")
    ap.add_argument("--data", required=True, help="Parquet, JSON Lines or text files with the task's columns")
    ap.add_argument("--out", required=True, type=trained.run_arg,
                    help="output folder, or a bucket prefix (s3://, gs://) (new; or an unfinished one to resume)")
    ap.add_argument("--batch-size", type=int, default=None, help="rows per forward (default: max(64, "
                                                                  "train.batch_size_per_worker))")
    ap.add_argument("--keep-columns", type=keep_columns_arg, default=(), metavar="NAME,...",
                    help="input columns to copy, as read, beside sample_id into every output row (an ID, a path)")
    ap.add_argument("--force", action="store_true", help="replace an earlier prediction in --out")
    return ap.parse_args(argv)


@reports_errors
def main(argv: list[str] | None = None) -> int:
    t0, args = time.time(), parse_args(argv)
    store = out_store(str(args.out))  # before anything is downloaded: a bucket that is not there ends here
    if store is None and trained.is_uri(args.out):  # file:///folder: the folder
        from stride.trainers.run.storage import parse_uri

        args.out = parse_uri(str(args.out))
    with trained.open_run(args) as run:  # a run on a bucket: a local copy, removed at the end
        return predict(run, args, store, t0)


def predict(run: trained.TrainedRun, args, store, t0: float) -> int:
    from stride.trainers.launch import jobs as gang
    from stride.trainers.task import Task

    if type(run.task).predict is Task.predict:
        raise UsageError(f"model.name ({run.cfg.model.name}) has no predict; implement Task.predict(self, model, "
                         f"batch) returning per-sample outputs (docs/commands.md)")
    spec, keep = predict_spec(run, args.data, args.keep_columns)
    batch_rows = args.batch_size or max(64, run.cfg.train.batch_size_per_worker)
    identity = job_identity(run, spec, keep)
    shown = store.describe() if store is not None else str(args.out)

    def open_output() -> None:  # once, before any worker reads the folder
        from stride.trainers.run.folder import atomic_write_text

        if store is not None:
            resumed = prepare_bucket(store, identity, args.force)
            store.write(JOB, (json.dumps(identity, indent=1) + "\n").encode())
            there = store.listing("")
        else:
            resumed = prepare_output(args.out, identity, args.force)
            atomic_write_text(args.out / JOB, json.dumps(identity, indent=1) + "\n")
            there = {p.name for p in args.out.iterdir()}
        done = sum(part_name(b) in there for b in range(len(spec.blocks)))
        print(f"stride: predicting {spec.num_rows} rows ({len(spec.blocks)} parts"
              + (f", {done} already written" if resumed and done else "") + f") with {run.where(run.checkpoint)}",
              flush=True)

    out = "" if store is not None else str(args.out.resolve())
    plan = JobPlan.of(run, spec, out=out, out_uri=str(store.location) if store is not None else "",
                      batch_rows=batch_rows, keep_columns=keep)
    name = trained.output_name(store.location.prefix.rsplit("/", 1)[-1] if store else args.out.resolve().name)
    results, where = gang.run_job(run, predict_job, plan, f"predict-{name}", before=open_output)
    if results is None:  # a torchrun rank other than 0
        return 0
    if store is not None:
        manifest = finish_bucket(store, identity, {**where, **results}, t0)
    else:
        manifest = finish(args.out, identity, {**where, **results}, t0)
    print(f"stride: predict: {manifest['rows_written']} rows in {manifest['parts']} parts, written to {shown}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
