"""A trained run as the source of the commands that come after training: its folder, config, task and one of its
checkpoints, each checked before any worker starts (`open_trained`; `open_run` for `stride eval` and `stride
predict`), and the one reader of a checkpoint's model weights for them all (`load_weights`: into a model on this
rank, or whole for `stride export` and `stride generate`; `trained_model` builds the task's model around them).

A run folder may sit on shared storage that someone else can write: its summary.json names the task module, and
importing a module runs it. A task of your own is imported only with consent (`--task MODULE:CLASS`, the same as the
run's, or `--trust-remote-code`); built-in tasks need neither. Consented to, it is found in the working directory or
on PYTHONPATH, as training finds it (run_config; generate.py takes the working directory off first).

A run on a bucket (`--run s3://bucket/prefix/name`, `gs://...`) is opened by downloading its summary.json and the one
checkpoint the command reads into a private temporary folder (mode 0700, removed by `TrainedRun.close`): the command
then works on that copy as on a folder, and what it writes into the run (eval's `eval/<name>.json`) is uploaded to
the same name under the bucket run (`TrainedRun.publish`). On one node the workers (Ray's, torchrun's ranks) read the
driver's copy: same host, same user. Under torchrun each rank is its own `stride eval` and downloads its own copy.
Multi-node eval or predict of a bucket run on Ray needs the copy on every node: the workers of other nodes find no
such folder (download it on each node, or sync the run to shared storage, until the workers fetch it themselves).
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Union

from stride.datasets.splits import DataSpec
from stride.errors import ConfigError, UsageError
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
    copy: BucketCopy | None = None  # a run on a bucket: run_dir is its local copy

    @property
    def facts(self) -> dict[str, Any]:
        return self.meta.get("facts") or self.summary.get("facts") or {}

    def where(self, path: Path | None = None) -> str:
        """The run (or `path`, a file of it) as the user names it: its URI for a run on a bucket."""
        path = path or self.run_dir
        return self.copy.where(path) if self.copy is not None else str(path)

    def publish(self, path: Path) -> str:
        """`path`, a file the command wrote into the run, uploaded to its name under a bucket run; where it is."""
        return self.copy.publish(path) if self.copy is not None else str(path)

    def close(self) -> None:
        if self.copy is not None:
            self.copy.close()

    def __enter__(self) -> TrainedRun:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@dataclass
class BucketCopy:
    """A run on a bucket, downloaded for a command: `run_dir` (summary.json and `checkpoint`, at their names in the
    bucket) inside a private temporary folder that `close` removes."""

    remote: Any  # trainers.run.remote.RunRemote; its .local is run_dir
    run_dir: Path
    checkpoint: Path
    uri: str

    def where(self, path: Path) -> str:
        rel = Path(path).relative_to(self.run_dir).as_posix()
        return self.remote.store.describe(rel if rel != "." else "")

    def publish(self, path: Path) -> str:
        rel = Path(path).relative_to(self.run_dir).as_posix()
        self.remote.push(rel)
        return self.remote.store.describe(rel)

    def close(self) -> None:
        shutil.rmtree(self.run_dir.parent, ignore_errors=True)

    def replica(self) -> dict[str, str]:
        """What a worker on another node fetches to have this copy at the same path (remote.replica_on_this_node)."""
        return {"uri": self.uri, "run_dir": str(self.run_dir),
                "checkpoint": self.checkpoint.relative_to(self.run_dir).as_posix()}

    def __enter__(self) -> BucketCopy:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def run_arg(text: str) -> str | Path:
    """--run: a folder, or a URI kept as text (a Path would fold its '//')."""
    return text if is_uri(text) else Path(text)


def is_uri(text) -> bool:
    return "://" in str(text)


def shown(text: str) -> str:
    """A URI as an error line may print it: a user:password@ part never is."""
    return re.sub(r"^([A-Za-z][A-Za-z0-9+.-]*://)[^/]*@", r"\1…@", str(text))[:300]


def consent_arguments(ap, where: str = "", task_help: str = "") -> None:
    """--task and --trust-remote-code: consent to import a task of the user's own that a run folder names. `where`
    starts each help line (export: "--format hf: "); `task_help` ends --task's."""
    ap.add_argument("--task", metavar="MODULE:CLASS",
                    help=f"{where}import this task of your own; must be the run's model.name{task_help}")
    ap.add_argument("--trust-remote-code", action="store_true",
                    help=f"{where}import whatever task module the run's summary.json names (it runs that module's "
                         f"code)")


def parser(prog: str, description: str):
    """The command line of a command over a trained run on a gang (eval, predict), with add_arguments' options."""
    from stride.cli import ArgumentParser

    ap = ArgumentParser(prog=prog, description=description)
    add_arguments(ap)
    return ap


def add_arguments(ap) -> None:
    """The options every command over a trained run on a gang takes (eval, predict)."""
    # --run-dir: the same, for torchrun's command line, whose own parser takes --run for its --run-path.
    ap.add_argument("--run", "--run-dir", dest="run", required=True, type=run_arg,
                    help="run folder, or a run on a bucket (s3://, gs://): <run.storage_path>/<run.name> (under "
                         "torchrun: --run-dir)")
    ap.add_argument("--checkpoint", default="last", metavar="last|best|PATH",
                    help="the newest complete checkpoint (last), the best kept one (best: checkpoint.keep_best), or "
                         "a checkpoint folder of the run")
    consent_arguments(ap)
    ap.add_argument("overrides", nargs="*", metavar="section.field=value",
                    help="changes to the run's config (scaling.num_workers=2, train.batch_size_per_worker=64)")


Pick = Union[str, Path, Callable[[Path, dict], Path]]


def open_run(args) -> TrainedRun:
    """`stride eval`, `stride predict`: the run of `args.run` with the checkpoint `args.checkpoint`."""
    return open_trained(args.run, args.checkpoint, args.task, args.trust_remote_code, args.overrides)


def open_trained(run_dir: Path | str, which: Pick = "last", task: str | None = None, trust_remote_code: bool = False,
                 overrides=(), label: str = "--run", checkpoint_label: str = "--checkpoint") -> TrainedRun:
    """The one opener of a trained run: its summary.json, its config (with `overrides`), its task (imported only
    with consent), the checkpoint `which` names (last, best or a folder of the run: pick_checkpoint; a Path already
    chosen; or a function of the run folder and its summary), checked to be of the run's task and to fit its model.
    UsageError/ConfigError (exit 2) otherwise, one line naming `label` (the argument that gave `run_dir`) or
    `checkpoint_label` (the one that gave the checkpoint). A URI `run_dir` is a run on a bucket (download_run): the
    TrainedRun works on its local copy, which its close() removes."""
    from stride.trainers.tasks import make_task

    if is_uri(run_dir):
        return open_copy(str(run_dir), which, task, trust_remote_code, overrides, label, checkpoint_label)

    summary = read_summary(run_dir, label)
    cfg = run_config(run_dir, summary, task, trust_remote_code, overrides, label)
    if callable(which):
        checkpoint = which(run_dir, summary)
    else:
        checkpoint = which if isinstance(which, Path) else pick_checkpoint(run_dir, summary, which)
    meta = checkpointing.read_meta(checkpoint)
    check_same_task(cfg.model.name, checkpoint, meta, checkpoint_label)  # before its facts build the run's task
    built = make_task(cfg, meta.get("facts") or summary.get("facts"))
    check_fits(built, checkpoint, meta)
    return TrainedRun(run_dir.resolve(), summary, cfg, built, checkpoint.resolve(), meta)  # workers run elsewhere


def open_copy(uri: str, which: Pick, task, trust_remote_code, overrides, label, checkpoint_label) -> TrainedRun:
    """open_trained of a run on a bucket, on its downloaded copy; a file:// URI is its folder."""
    copy = download_run(uri, which, label, checkpoint_label)
    if isinstance(copy, Path):
        return open_trained(copy, which, task, trust_remote_code, overrides, label, checkpoint_label)
    try:
        run = open_trained(copy.run_dir, which if callable(which) else copy.checkpoint, task, trust_remote_code,
                           overrides, label, checkpoint_label)
    except BaseException as e:
        copy.close()
        raise in_bucket_words(e, copy) from None
    run.copy = copy
    return run


def in_bucket_words(e: BaseException, copy: BucketCopy) -> BaseException:
    """A refusal about the local copy names the run as the user gave it (its URI), not a temporary folder."""
    from stride.errors import StrideError

    if not isinstance(e, StrideError):
        return e
    return type(e)(str(e).replace(str(copy.run_dir), copy.uri))


def open_store(uri: str, label: str):
    """The bucket of an object-store URI an argument (`label`) gave, or the folder of a file:// URI. UsageError (exit
    2), one line naming `label` and the URI (never a credential): not a URI Stride takes, or no library for it."""
    from stride.trainers.run.storage import ObjectStore, parse_uri

    try:
        location = parse_uri(uri)
    except ValueError as e:
        raise UsageError(f"{label} ({shown(uri)}) {e}") from None
    if isinstance(location, Path):
        return location
    try:
        return ObjectStore(location)
    except ImportError as e:
        raise UsageError(f"{label} ({location}): its library is not installed; {e}") from None


def download_run(uri: str, which: Pick = "last", label: str = "--run",
                 checkpoint_label: str = "--checkpoint") -> BucketCopy | Path:
    """The run at `uri` (s3://bucket/prefix/name, gs://...) with the checkpoint `which` names (last: the newest
    complete one in the bucket that verifies; best: best/ as summary.json names it; a checkpoint's name or URI under
    the run; a function of the run (generate): last), downloaded into a new private folder. A file:// URI is its
    folder, returned as it is. UsageError (exit 2), one line naming `label` and the URI (never a credential): a URI
    that is not one, a bucket that does not exist or cannot be read, no run there, no such checkpoint."""
    from stride.trainers.run.remote import RunRemote

    store = open_store(uri, label)
    if isinstance(store, Path):
        return store
    location = store.location
    root = Path(tempfile.mkdtemp(prefix="stride-run-")).resolve()  # mode 0700: this user's alone
    local = root / (location.prefix.rsplit("/", 1)[-1] or location.bucket)  # the run's name, as in a folder
    copy = BucketCopy(RunRemote(store, local), local, local, str(location))
    try:
        fetch_summary(copy, label)
        copy.checkpoint = fetch_checkpoint(copy, "last" if callable(which) else str(which), label, checkpoint_label)
    except BaseException:
        copy.close()
        raise
    return copy


def fetch_summary(copy: BucketCopy, label: str) -> None:
    from stride.trainers.run.storage import refusal

    store = copy.remote.store
    try:
        found = copy.remote.pull("summary.json")
        bucket_there = found or store.fs.exists(store.location.bucket)
    except Exception as e:  # noqa: BLE001 - each cloud library raises its own kinds; refusal() reads what they say
        raise UsageError(f"{label} ({copy.uri}): {refusal(store.location, e)}") from None
    if not bucket_there:
        raise UsageError(f"{label} ({copy.uri}): the bucket {store.location.bucket!r} does not exist or cannot be "
                         f"listed with these credentials; name the bucket the run trained in")
    if not found:
        raise UsageError(f"{label} ({copy.uri}) is not a run (no summary.json there); pass "
                         f"<run.storage_path>/<run.name> of a run that trained, such as "
                         f"{store.location.scheme}://{store.location.bucket}/runs/my_run")


def fetch_checkpoint(copy: BucketCopy, which: str, label: str, checkpoint_label: str) -> Path:
    """The checkpoint `which` names, downloaded into the copy and verified; its local folder."""
    remote = copy.remote
    if which == "last":
        for _, name in reversed(remote.complete()):  # an unusable one gives way to the one before, as a resume
            folder = remote.fetch(name, copy.run_dir)
            if checkpointing.verify(folder) is None:
                return folder
            shutil.rmtree(folder, ignore_errors=True)
        raise UsageError(f"{label} ({copy.uri}) has no complete checkpoint; train it first, or pass "
                         f"{checkpoint_label} with a checkpoint of the run")
    if which == "best":
        summary = read_summary(copy.run_dir, label)
        named = best_named_in_bucket(summary)
        if named is None:
            raise UsageError(f"{checkpoint_label} best: {label} ({copy.uri}) kept no best checkpoint (it trained "
                             f"without checkpoint.keep_best); pass {checkpoint_label} last or a checkpoint of the run")
        name, flag = named, f"{checkpoint_label} best: {copy.uri}/summary.json best_checkpoints[0].checkpoint"
    else:
        name, flag = checkpoint_name(copy.uri, which, checkpoint_label), f"{checkpoint_label} ({shown(which)})"
    if f"{name}/{checkpointing.META}" not in remote.store.listing(name):
        raise UsageError(f"{flag}: {remote.store.describe(name)} is not a complete checkpoint (no meta.json); pass "
                         f"last, best or a checkpoint of the run, such as checkpoint_00000100")
    folder = remote.fetch(name, copy.run_dir)
    if problem := checkpointing.verify(folder):
        raise UsageError(f"{flag}: {remote.store.describe(name)} is unusable ({problem}); pass last, best or a "
                         f"complete checkpoint of the run")
    return folder


def best_named_in_bucket(summary: dict) -> str | None:
    """best/<checkpoint>: the best kept checkpoint that summary.json names, by its folder's name alone (the run
    recorded where its node kept it, not where the bucket keeps it)."""
    best = (summary.get("best_checkpoints") or [None])[0]
    named = best.get("checkpoint") if isinstance(best, dict) else None
    if not isinstance(named, str):
        return None
    name = named.rstrip("/").rsplit("/", 1)[-1]
    return f"best/{name}" if CHECKPOINT_NAME.fullmatch(name) else None


CHECKPOINT_NAME = re.compile(r"checkpoint_\d+")


def checkpoint_name(uri: str, which: str, checkpoint_label: str) -> str:
    """--checkpoint of a run on a bucket: a checkpoint's name (checkpoint_00000100, best/checkpoint_00000100) or its
    URI under the run; never a name that leaves the run's prefix."""
    name = which[len(uri) + 1:] if which.startswith(uri + "/") else which
    parts = name.strip("/").split("/")
    if is_uri(name) or not CHECKPOINT_NAME.fullmatch(parts[-1]) or parts[:-1] not in ([], ["best"]):
        raise UsageError(f"{checkpoint_label} ({shown(which)}) is not a checkpoint of --run ({uri}); pass last, best, "
                         f"a checkpoint's name such as checkpoint_00000100, or its URI under the run")
    return "/".join(parts)


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
    A meta.json that records no model has nothing to compare: eval's shape check (check_fits) still applies, and
    export of it reads only tensors."""
    if meta.get("model") is not None and meta.get("model") != run_name:
        raise UsageError(f"{label} ({checkpoint}) holds model.name {meta.get('model')}, not the run's {run_name}; pass a "
                         f"checkpoint of this run")


def check_fits(task, checkpoint: Path, meta: dict) -> None:
    """A checkpoint of this task with other model settings is refused before any worker (another task's:
    check_same_task, first)."""
    import torch

    with torch.device("meta"):
        model = task.build_model()
    saved = checkpointing.saved_model_shapes(checkpoint)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items() if not meta.get("trainable_only") or k in saved}
    if mismatch := checkpointing.shape_mismatch(shapes, saved):
        raise UsageError(f"--checkpoint ({checkpoint}) does not fit the run's model (the {mismatch}); pass a "
                         f"checkpoint of this run, or the model.* overrides it was trained with")


# ---- the weights: one reader for every command ----

def load_weights(checkpoint: Path, meta: dict, model=None, callbacks=None, group=None, ema: bool = False) -> dict:
    """A checkpoint's model weights, read for the commands through the checkpoint's allow-list (no pickle runs).
    * Without `model` (export, generate): the full tensors, consolidated in this process on the CPU, named as the
      model's state_dict() names them; `ema`: train.ema's average's parameters in place of the weights' (buffers,
      such as batch-norm statistics, stay the model's); a checkpoint without an average is refused (UsageError).
    * With `model` (eval, predict on a gang): into this rank's tensors of `model` (FSDP: its shards; DCP reads the
      slices each rank needs, whatever world size wrote them), with `callbacks`' tensors that the checkpoint holds
      (train.ema's average); a collective over `group` (None: one process). Returns the model's loaded state.
    A checkpoint.trainable_only checkpoint holds the trainable parameters alone: the rest is init.from's, which
    `model` holds already (built as training builds it; trained_model for a full state dict)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

    if model is None:
        weights = checkpointing.load_model_state(checkpoint)
        if ema:
            average = checkpointing.load_model_state(checkpoint, "ema")
            if not average:
                raise UsageError(f"--ema: checkpoint ({checkpoint}) holds no average of the weights (the run had no "
                                 f"train.ema); export without --ema")
            weights.update(average)
        return weights
    partial = bool(meta.get("trainable_only"))  # the frozen base came from init.from
    saved = checkpointing.saved_model_shapes(checkpoint)
    callback_tensors, present = callbacks.tensors_to_fill(checkpointing.saved_keys(checkpoint))
    state = {"model": {k: v for k, v in get_model_state_dict(model).items() if not partial or k in saved},
             **callback_tensors}
    checkpointing.load_sharded(checkpoint, state, group)
    callbacks.loaded(present)
    set_model_state_dict(model, state["model"], options=StateDictOptions(strict=not partial))
    return state["model"]


def trained_model(run: TrainedRun, ema: bool = False):
    """The run's task's model, whole in this process, with its checkpoint's weights (load_weights; `ema`: the
    average's): for generate and export --format hf. A checkpoint of the trainable parameters only
    (checkpoint.trainable_only) goes on the frozen base that init.from gives, as in training; a base that changed
    since is refused (ConfigError)."""
    model = run.task.build_model()
    weights = load_weights(run.checkpoint, run.meta, ema=ema)
    if not run.meta.get("trainable_only"):
        model.load_state_dict(weights)
        return model
    from stride.trainers import pretrained

    init = run.cfg.init
    plan = pretrained.init_model(model, init.from_, strict=init.strict, include=init.include, exclude=init.exclude,
                                 rename=init.rename, adapt=pretrained.adapter(run.task))
    recorded = (run.meta.get("init") or {}).get("sha256")
    if recorded != plan.sha256:
        raise ConfigError(pretrained.changed_base_line(init.from_, recorded, plan.sha256))
    model.load_state_dict(weights, strict=False)
    return model


def output_name(text: str) -> str:
    """A name safe as a file name from a checkpoint's or data set's name."""
    import re

    return re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip("._") or "eval"


__all__ = ["TrainedRun", "BucketCopy", "download_run", "run_arg", "add_arguments", "open_run", "open_trained",
           "load_weights", "trained_model", "run_config", "read_summary", "output_name"]


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
