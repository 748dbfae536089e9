"""Stride's configuration schema: every section, its keys, their defaults and their rules, as pydantic models.

Defaults live only here. Reading a config (YAML, `section.field=value` overrides, a task's own model section, the
one-line error wording, the generated docs/configuration.md) is trainers/config_reader.py's.
"""

from __future__ import annotations

import math
import os
import re
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SerializeAsAny, field_validator, model_validator

from stride.errors import quote
from stride.trainers.schedules import DESCRIPTIONS, SCHEDULES


# Upper bounds of step and epoch counts: far above any real run (a billion steps at 10 ms is four months), low
# enough that a typo such as 10^30 is refused here, not discovered as an ETA of 10^27 s after resuming a run.
MAX_STEPS = 10**9
MAX_EPOCHS = 10**6


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, frozen=True)


class RunSection(Section):
    name: str = Field("char_gpt", description="Run name; results, checkpoints and resume live under storage_path/name")
    storage_path: str = Field("./runs", description="Where run folders live: a folder (shared by all nodes on a "
                              "cluster), or a bucket: s3://bucket/prefix or gs://bucket/prefix (credentials from the "
                              "cloud's own chain; docs/clusters-and-security.md)")
    seed: int = Field(0, description="Seed of the data order, the weight init and each step's random streams (dropout, augmentation)")
    lock_stale_s: float = Field(60.0, ge=1, le=3600, allow_inf_nan=False, description="A run holds its run folder's lock (stride.lock) and beats it every few seconds; a lock not beaten for this long is taken over by the next run, and the workers of a run whose driver stopped beating stop by themselves")

    @field_validator("name")
    @classmethod
    def _plain_name(cls, v: str) -> str:
        if not v or "/" in v or "\\" in v or v in (".", "..") or any(ord(c) < 32 or ord(c) == 127 for c in v):
            raise ValueError("must be a plain folder name without path separators or control characters; "
                             "use e.g. run.name=my_run")
        if len(v.encode()) > 200:  # with a suffix or two, still under the filesystems' 255-byte limit on a name
            raise ValueError(f"is {len(v.encode())} bytes long, over the 200 a folder name can safely take; use a "
                             f"shorter run.name")
        return v

    @field_validator("storage_path")
    @classmethod
    def _a_folder_or_bucket(cls, v: str) -> str:
        from stride.trainers.run.storage import is_uri, parse_uri

        if is_uri(v):
            found = parse_uri(v)  # ValueError: the reason, never a credential the URI carried
            if isinstance(found, Path):  # file:///x is the folder /x
                v = str(found)
            else:
                return str(found)  # normalized: s3://bucket/prefix, no trailing slash
        try:
            Path(v).expanduser().resolve()  # Config.run_dir resolves it: a loop would be a traceback there
        except RuntimeError:
            raise ValueError("is a loop of symbolic links (a link that leads back to itself); point it at a real "
                             "folder; use e.g. run.storage_path=./runs") from None
        return v


class TrainSource(Section):
    """One entry of data.train: a source of training rows and its share of every batch."""

    name: str = Field(description="The source's name in metrics (samples_seen/<name>) and messages")
    path: str = Field(description="Its files: a folder, file, glob or URI, as data.train_path")
    weight: float = Field(1.0, ge=0.0, allow_inf_nan=False, description="Its share of every global batch, relative "
                          "to the other sources' weights")

    @field_validator("name")
    @classmethod
    def _a_label(cls, v: str) -> str:
        if not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", v):
            raise ValueError("must be 1-64 letters, digits, '_', '.' or '-' (it names metrics); use e.g. name: speech")
        return v


class ValSource(Section):
    """One entry of data.val: a validation source, reported on its own (val_loss/<name>) and in val_loss."""

    name: str = Field(description="The source's name in metrics: val_loss/<name>, val_<metric>/<name>")
    path: str = Field(description="Its files: a folder, file, glob or URI, as data.val_path")

    _a_label = field_validator("name")(TrainSource._a_label.__func__)


class DataSection(Section):
    train_path: str | None = Field("data/pystdlib/train", description="Folder, file or glob of the training split: Parquet, JSON Lines (.jsonl, .json) or CSV files (null with data.train)")
    val_path: str | None = Field("data/pystdlib/val", description="Folder, file or glob of the validation split, as train_path (null: no validation)")
    shuffle_window_rows: int = Field(65536, ge=1, description="Rows shuffled together after the blocks (Parquet row groups, 4,096-line parts of text files) are permuted: more mixes better (a split sorted by label needs a window spanning many blocks); each worker holds about (2 + read_ahead_windows) x this many rows in memory (docs/data.md)")
    read_ahead_windows: int = Field(2, ge=1, description="Windows whose blocks each worker reads ahead of training (background threads)")
    pipeline: Literal["auto", "thread", "ray_data"] = Field("auto", description="Who reads and transforms the training rows: a thread of each worker, or Ray Data tasks on the CPUs beside the worker gang (any node); auto: ray_data for GPU workers when CPUs are free, else thread. Same batches either way")
    pipeline_timeout_s: float = Field(300.0, gt=0, allow_inf_nan=False, description="data.pipeline=ray_data: fail the run when no batch arrives for this long (Ray Data starved of CPUs)")
    train: list[TrainSource] | None = Field(None, description="Several training sources mixed by weight, e.g. "
                                            "[{name: speech, path: data/speech, weight: 0.7}, {name: music, path: "
                                            "data/music, weight: 0.3}], instead of train_path (docs/data.md)")
    val: list[ValSource] | None = Field(None, description="Several validation sources, e.g. [{name: speech, path: "
                                        "data/speech_val}]: val_loss/<name> for each, and val_loss over all of them, "
                                        "instead of val_path")
    length_column: str | None = Field(None, description="A numeric column of each row's length (tokens, samples, "
                                      "seconds): rows of similar length form micro-batches, within each shuffle window, "
                                      "and metrics report padding_fraction (docs/data.md)")
    shuffle_window_bytes: int = Field(1 << 30, ge=1 << 20, description="The shuffle window's bound in bytes: a window "
                                      "holds at most this many bytes of rows (the data's mean row size, referenced "
                                      "files included), whatever shuffle_window_rows says")
    file_read_threads: int = Field(16, ge=1, le=256, description="Threads per worker (and on the driver, for the existence check) reading the files a task's file_columns reference: I/O, so more than the cores pay (docs/data.md)")
    file_root: Path | None = Field(None, description="A folder that every path in a task's file_columns must lie in, after links are followed (a path outside it is refused, naming the row); set it for a manifest someone else wrote. null: paths are read wherever they point (docs/data.md)")


    @model_validator(mode="after")
    def _one_way_to_name_a_split(self) -> "DataSection":
        # Value-based, not only "did the user set it": a full dump (summary.json, which eval and predict rebuild)
        # holds every key, so the single-source key is nulled beside its list and a null one never conflicts.
        for many, one in (("train", "train_path"), ("val", "val_path")):
            sources = getattr(self, many)
            if sources is None:
                continue
            if one in self.model_fields_set and getattr(self, one) is not None:
                raise ValueError(f"data.{many} and data.{one} are both set; keep data.{many} (several sources) or "
                                 f"data.{one} (one), not both")
            if not sources:
                raise ValueError(f"data.{many} is an empty list; give it a source, e.g. [{{name: a, path: data/a}}], "
                                 f"or set data.{one}")
            names = [src.name for src in sources]
            if dup := sorted({n for n in names if names.count(n) > 1}):
                raise ValueError(f"data.{many}: the name {dup[0]!r} is used twice; give each source its own name")
            object.__setattr__(self, one, None)  # its default names the built-in data set, not these sources
        if self.train is None and self.train_path is None:
            raise ValueError("data.train_path is null and data.train is not set; name the training data, e.g. "
                             "data.train_path=data/tabular/train")
        if self.train is not None:
            if not sum(src.weight for src in self.train) > 0:
                raise ValueError("data.train: every weight is 0; give at least one source a weight above 0")
            if "val_path" not in self.model_fields_set:
                object.__setattr__(self, "val_path", None)  # the default names the built-in data set, not this mixture's
        return self


class TaskConfig(Section):
    """The model section: `name` picks the task; the task's Config (a subclass of this) adds its own fields."""

    name: str = Field("char_gpt", description='The task: a built-in (char_gpt, mlp) or "<module>:<Class>" of your '
                                              'own stride.Task, importable from the working directory or PYTHONPATH')


# The optimizers optim.name can call by a short name; anything else is "<module>:<Class>" (trainers/step.py).
BUILTIN_OPTIMIZERS = ("adamw", "adam", "sgd", "adafactor")


def builtin_or_spec(value: str, builtins: tuple[str, ...], what: str, examples: str) -> str:
    """`value` when it is a built-in name or has the form "<module>:<what>"; else ValueError saying both."""
    module, colon, name = value.partition(":")
    if value not in builtins and not (colon and module and name):
        raise ValueError(f"is neither {', '.join(builtins)} nor \"<module>:<{what}>\"; use e.g. {examples}")
    return value


class OptimSection(Section):
    name: str = Field("adamw", description="Optimizer: adamw, adam, sgd, adafactor (torch.optim's), or "
                                           "\"<module>:<Class>\" of any torch.optim.Optimizer, e.g. torch.optim:RAdam or "
                                           "my_optim:Lion (my_optim.py in the working directory or on PYTHONPATH)")
    kwargs: dict[str, Any] = Field(default_factory=dict, description="More keyword arguments for the optimizer, e.g. "
                                   "{nesterov: true} for sgd; they override betas/momentum. A \"<module>:<Class>\" "
                                   "optimizer gets only lr and these (weight_decay is set per parameter group)")
    implementation: Literal["auto", "fused", "foreach", "for_loop"] = Field(
        "auto", description="The optimizer's kernels: fused (one kernel for all parameters), foreach (batched over "
        "parameters) or for_loop (one parameter at a time); auto: fused for adamw, adam and sgd on CUDA, foreach "
        "elsewhere. optim.kwargs' fused/foreach win")
    lr: float = Field(1e-3, allow_inf_nan=False, gt=0.0, description="Peak learning rate at reference_batch_size")
    weight_decay: float = Field(0.01, allow_inf_nan=False, ge=0.0, description="Decoupled weight decay (AdamW) or L2 (SGD)")
    betas: tuple[float, float] = Field((0.9, 0.95), description="adamw and adam betas")
    momentum: float = Field(0.9, allow_inf_nan=False, ge=0.0, description="sgd momentum")
    lr_scaling: Literal["none", "linear", "sqrt"] = Field("none", description="Scale lr by global batch / reference_batch_size")
    reference_batch_size: int = Field(64, ge=1, description="Global batch size that optim.lr was tuned for")
    # The built-in schedules and their words are trainers/schedules.py's: a new one is added there alone.
    schedule: str = Field("cosine", description="lr schedule after the warm-up: "
                          + ", ".join(f"{name} ({text})" for name, text in DESCRIPTIONS.items())
                          + ", or \"<module>:<function>\" of your own: f(step, warmup_steps, total_steps, min_lr_ratio, "
                          "decay_fraction) -> the peak lr's multiplier")
    warmup_steps: int = Field(50, ge=0, le=MAX_STEPS, description="Linear warm-up steps before the schedule")
    min_lr_ratio: float = Field(0.1, ge=0.0, le=1.0, description="Final lr as a fraction of the peak lr (constant: unused)")
    decay_fraction: float = Field(0.1, allow_inf_nan=False, gt=0.0, le=1.0, description="schedule=wsd: the last fraction of "
                                  "the training steps over which the lr decays to min_lr_ratio")
    grad_clip_norm: float | None = Field(1.0, allow_inf_nan=False, gt=0.0, description="Clip the global gradient norm (null: no clipping)")
    groups: list[ParamGroup] = Field(default_factory=list, description="Parameter groups, e.g. [{match: '^encoder\\.', "
                                     "lr_scale: 0.1}, {match: '^decoder\\.embed', freeze: true}]: the first match wins, "
                                     "unmatched parameters form the default group; each group's lr is logged as "
                                     "lr/<name or index> (docs/fine-tuning.md)")

    # Only the form of these is checked here: the class or function is imported (and an optimizer built, a schedule
    # called) on the driver by stride.trainers.optim.check_optimizer, which may run a user's module.
    @field_validator("name")
    @classmethod
    def _optimizer_name(cls, v: str) -> str:
        return builtin_or_spec(v, BUILTIN_OPTIMIZERS, "Class", "optim.name=adamw or optim.name=torch.optim:RAdam")

    @field_validator("schedule")
    @classmethod
    def _schedule_name(cls, v: str) -> str:
        return builtin_or_spec(v, tuple(SCHEDULES), "function",
                               "optim.schedule=cosine or optim.schedule=my_schedules:step_decay")

    @field_validator("kwargs")
    @classmethod
    def _optimizer_kwargs(cls, v: dict[str, Any]) -> dict[str, Any]:
        # Stride sets these per parameter group, where they would silently win over a constructor argument.
        taken = sorted(k for k in ("lr", "weight_decay", "params") if k in v)
        if taken:
            raise ValueError(f"sets {', '.join(taken)}, which Stride sets itself; use optim.lr and optim.weight_decay "
                             f"instead and remove them from optim.kwargs")
        return v


def _not_a_regex(pattern: str, example: str) -> None:
    """A ValueError (one line with an example) unless `pattern` compiles as a Python regular expression."""
    try:
        re.compile(pattern)
    except re.error as e:
        raise ValueError(f"has {quote(pattern)}, not a regular expression ({e}); use e.g. {example}") from None


class ParamGroup(Section):
    """One entry of optim.groups: the parameters whose names `match` selects (the first entry that matches wins)."""

    match: str = Field(description="Regex searched in each parameter's name (as model.named_parameters() names it)")
    name: str | None = Field(None, description="The group's name in logs (lr/<name>); null: its index in optim.groups")
    lr_scale: float = Field(1.0, ge=0.0, allow_inf_nan=False, description="The group's lr as a multiple of the schedule's")
    weight_decay: float | None = Field(None, ge=0.0, allow_inf_nan=False, description="Weight decay of the group's "
                                       "2-d and larger parameters (null: optim.weight_decay); 1-d ones never decay")
    freeze: bool = Field(False, description="Frozen: no gradient, no optimizer state, no weight decay, no all-reduce; "
                                            "bitwise unchanged")
    unfreeze_at_step: int | None = Field(None, ge=1, le=MAX_STEPS, description="N: frozen for the first N optimizer "
                                         "steps, trained from step N+1 on, its lr warming up again over optim.warmup_steps")

    @field_validator("match")
    @classmethod
    def _a_regex(cls, v: str) -> str:
        _not_a_regex(v, "match: '^encoder\\.'")
        return v

    @field_validator("name")
    @classmethod
    def _a_label(cls, v: str | None) -> str | None:
        if v == "default":  # lr/default is the unmatched parameters' group
            raise ValueError("'default' names the group of unmatched parameters; use another name, e.g. name: encoder")
        if v is not None and not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", v):
            raise ValueError("must be 1-64 letters, digits, '_', '.' or '-' (it names a metric, lr/<name>); use e.g. "
                             "name: encoder")
        return v

    def frozen_at(self, step: int) -> bool:
        """Whether the group is frozen for the optimizer step that follows `step` completed steps."""
        if self.unfreeze_at_step is not None:
            return step < self.unfreeze_at_step
        return self.freeze


class EarlyStoppingSection(Section):
    metric: str = Field("val_loss", description="The evaluation figure watched: val_loss, a val_<metric> of the "
                        "task, or per source val_loss/<name>")
    mode: Literal["min", "max"] = Field("min", description="min: lower is better; max: higher is better")
    patience: int = Field(3, ge=1, le=1_000_000, description="Evaluations in a row without improvement that stop "
                          "the run")
    min_delta: float = Field(0.0, ge=0, allow_inf_nan=False, description="How much better than the best so far "
                             "counts as an improvement")

    @field_validator("metric")
    @classmethod
    def _an_evaluation_figure(cls, v: str) -> str:
        if not v.startswith("val_"):
            raise ValueError("is not an evaluation figure; use val_loss or a val_<metric> of the task")
        return v


class EMASection(Section):
    decay: float = Field(0.999, gt=0, lt=1, description="Each step: ema <- decay x ema + (1 - decay) x weights")
    eval: Literal["ema", "raw", "both"] = Field("ema", description="Which weights evaluations use: ema (val_loss is "
                                                "the average's), raw, or both (val_loss and val_loss_ema)")


class SpikeSection(Section):
    metric: Literal["train_loss", "grad_norm"] = Field("train_loss", description="The step's figure watched: the "
                                                      "loss (averaged over the ranks) or the gradient norm before "
                                                      "clipping")
    window: int = Field(100, ge=2, le=MAX_STEPS, description="A spike exceeds factor x the median of this many "
                        "recent steps' figures (spikes never enter them)")
    factor: float = Field(3.0, gt=1.0, allow_inf_nan=False, description="How many times the median a spike exceeds")
    action: Literal["warn", "skip"] = Field("warn", description="warn: log each spike and train on; skip: also drop "
                                            "the spike's update, as train.nonfinite=skip drops a non-finite one")


class FsdpSection(Section):
    shard_size: int | None = Field(None, ge=1, description="train.strategy=hsdp: ranks per shard group (each group "
                                   "holds one copy of the model, sharded; the groups are replicas); null: the workers "
                                   "per node. Must divide the number of workers")
    offload: Literal["none", "cpu"] = Field("none", description="Under fsdp and hsdp, cpu: parameters, gradients and "
                                            "optimizer state live on the CPU (pinned) between uses, and the optimizer "
                                            "steps there (FSDP2's CPUOffloadPolicy): for a model that does not fit "
                                            "even sharded")


class TrainSection(Section):
    ema: EMASection | None = Field(None, description="An exponential moving average of the weights, sharded like "
                                   "them, in the checkpoint, exported with export.py --ema: {decay, eval}")
    callbacks: list[str | dict[str, dict[str, Any] | None]] = Field(
        [], description='stride.Callback classes the run calls, each "module:Class" or {"module:Class": {keyword '
        'arguments}} (docs/callbacks.md)')

    @field_validator("callbacks")
    @classmethod
    def _callback_entries(cls, v: list) -> list:
        for i, entry in enumerate(v):
            spec = entry if isinstance(entry, str) else next(iter(entry)) if len(entry) == 1 else None
            if spec is None or ":" not in spec:
                raise ValueError(f"entry {i} ({entry!r}) is not \"module:Class\" or {{\"module:Class\": {{keyword "
                                 f"arguments}}}}; name a stride.Callback subclass, e.g. my_callbacks:StopAt")
        return v
    early_stopping: EarlyStoppingSection | None = Field(None, description="Stop when an evaluation figure stops "
                                                        "improving: {metric, mode, patience, min_delta} (status "
                                                        "stopped_early; a rerun trains no further)")
    batch_size_per_worker: int = Field(32, ge=1, description="Samples per worker per micro-step")
    tokens_per_micro_batch: float | None = Field(None, gt=0, allow_inf_nan=False, description="With "
                                                 "data.length_column: micro-batches hold rows whose lengths sum to at "
                                                 "most this per worker (rows of similar length, as many as fit) instead "
                                                 "of batch_size_per_worker rows; in the column's units (tokens, "
                                                 "seconds: 7.5 is fine); needs train.max_steps (docs/data.md)")
    grad_accum_steps: int = Field(1, ge=1, description="Micro-steps per optimizer step")
    max_steps: int | None = Field(None, ge=1, le=MAX_STEPS, description="Stop after this many optimizer steps (null: use epochs)")
    epochs: float | None = Field(1, allow_inf_nan=False, gt=0, le=MAX_EPOCHS, description="Stop after this many epochs when max_steps is null")
    precision: Literal["auto", "fp32", "bf16", "fp16"] = Field("auto", description="auto: bf16 on recent GPUs, fp16 on older GPUs, fp32 on CPU")
    eval_every_steps: int | None = Field(200, ge=1, le=MAX_STEPS, description="Validate every N optimizer steps (and always at the end)")
    log_every_steps: int = Field(20, ge=1, le=MAX_STEPS, description="Log, report and write metrics.jsonl every N optimizer steps")
    deterministic: bool = Field(False, description="Use deterministic algorithms (bitwise repeatable on CPU)")
    num_threads: int | None = Field(None, ge=1, description="torch intra-op threads per worker (null: from cpus_per_worker)")
    spike: SpikeSection | None = Field(None, description="Loss spikes: {metric, window, factor, action}; every rank "
                                       "takes the same decision on the device, the log names each spike at the next "
                                       "log step, summary.json counts them (docs/long-runs.md)")
    nonfinite: Literal["skip", "stop"] = Field("skip", description="On a NaN/inf loss or gradient: skip the step, or stop the run")
    max_nonfinite_steps: int = Field(5, ge=1, le=MAX_STEPS, description="Stop after this many non-finite steps in a row (with nonfinite=skip)")
    gc_every_steps: int = Field(50, ge=0, le=MAX_STEPS, description="Python's garbage collection while training: automatic collection off (what set-up built is frozen out of it), a young-generation collection every N optimizer steps on every rank, as torchtitan does; 0: Python's automatic collection")
    straggler_warn_ratio: float = Field(1.3, allow_inf_nan=False, gt=1.0, description="Warn (naming the rank, its "
                                        "node, and whether its data or its compute is slow) when the slowest rank's "
                                        "own time per step (data wait + forward) stays above this many times the "
                                        "median rank's for 3 log intervals; straggler_ratio is logged every log step")
    hang_timeout_s: float | None = Field(None, allow_inf_nan=False, gt=0, description="A step unfinished after this "
                                         "many seconds is a hang: every rank writes its threads' stacks to "
                                         "<run>/diagnostics/hang-<step>/, says whether it arrived at the collective, "
                                         "and ends the attempt (Ray restarts it; torchrun exits 1); null: 50 x the "
                                         "recent step time, at least 300 (docs/long-runs.md)")
    collective_timeout_s: float = Field(600.0, allow_inf_nan=False, gt=0, description="Report a hung collective (all-reduce) after this many seconds")
    peak_flops: float | None = Field(None, allow_inf_nan=False, gt=0, description="Peak FLOP/s of one worker's device for MFU (null: GPU table; unknown on CPU)")
    profile_steps: list[int] | None = Field(None, description="[start, end]: torch.profiler trace of these optimizer steps on every rank, into profile/rank<k>.json")
    strategy: Literal["ddp", "fsdp", "hsdp"] = Field("ddp", description="ddp: every worker holds the whole model (DistributedDataParallel); "
                                                                 "fsdp: parameters, gradients and optimizer state are sharded across workers (FSDP2); "
                                                                 "hsdp: sharded within groups of train.fsdp.shard_size workers (a node), replicated across groups (docs/fsdp.md)")
    fsdp: FsdpSection = Field(default_factory=FsdpSection, description="Sharding settings under train.strategy fsdp and hsdp")
    compile: Literal["auto", "model", "blocks", "off"] = Field("off", description="torch.compile for training and evaluation (inductor): model: the model and the task's loss in one graph, compiled after DDP wraps the model; blocks: each of the task's repeated blocks (or the whole model's forward when it names none), before FSDP wraps them; auto: blocks under train.strategy=fsdp, else model; off. true and false read as auto and off")
    compile_mode: Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"] = Field(
        "default", description="torch.compile's mode with train.compile on (reduce-overhead: CUDA graphs, GPU only)")
    activation_checkpointing: bool = Field(False, description="Recompute the activations of the task's repeated blocks in the backward pass: less memory, more compute")
    activation_checkpointing_every: int = Field(1, ge=1, description="With activation_checkpointing: every k-th block (1: all of them)")

    @field_validator("compile", mode="before")
    @classmethod
    def _compile_switch(cls, v: Any) -> Any:
        return {True: "auto", False: "off"}.get(v, v) if isinstance(v, bool) else v

    @property
    def compile_scope(self) -> str:
        """What train.compile compiles: "model", "blocks" or "off" (auto resolved for train.strategy)."""
        if self.compile == "auto":
            return "blocks" if self.strategy != "ddp" else "model"
        return self.compile

    @field_validator("profile_steps")
    @classmethod
    def _profile_range(cls, v: list[int] | None) -> list[int] | None:
        if v is not None and (len(v) != 2 or v[0] < 1 or v[1] < v[0] or v[1] > MAX_STEPS):
            raise ValueError(f"must be [start, end] with 1 <= start <= end <= {MAX_STEPS}; use e.g. "
                             f"train.profile_steps=[10,12]")
        return v

    @model_validator(mode="after")
    def _spike_skip_needs_a_step_it_can_veto(self) -> "TrainSection":
        if self.spike is not None and self.spike.action == "skip" and self.precision == "fp16":
            raise ValueError("train.spike.action (skip) cannot veto a step under train.precision=fp16 (the GradScaler "
                             "takes that decision); use train.precision=bf16, or train.spike.action=warn")
        return self

    @model_validator(mode="after")
    def _offload_needs_sharding(self) -> "TrainSection":
        if self.fsdp.offload != "none" and self.strategy == "ddp":
            raise ValueError(f"train.fsdp.offload ({self.fsdp.offload}) needs a sharded model; use "
                             f"train.strategy=fsdp (or hsdp), or train.fsdp.offload=none")
        return self

    @model_validator(mode="after")
    def _has_stop(self) -> "TrainSection":
        if self.max_steps is None and self.epochs is None:
            raise ValueError("train.max_steps and train.epochs are both null; set one, e.g. train.max_steps=1000")
        return self


class ScalingSection(Section):
    num_workers: int | Literal["auto"] | tuple[int, int] = Field(
        2, description="Training workers (auto: one per GPU, or one per node on CPU; [min, max]: elastic, as many as "
                       "the cluster holds, resized from the last checkpoint when that changes)")
    use_gpu: bool | Literal["auto"] = Field("auto", description="Train on GPUs (auto: when the cluster has them)")
    cpus_per_worker: float = Field(1.0, allow_inf_nan=False, gt=0.0, description="CPUs reserved by each worker (also its torch threads)")
    max_failures: int = Field(0, ge=-1, description="Worker-group restarts from the last checkpoint (-1: unlimited)")
    hang_detector: Literal["off", "observe", "fail"] = Field("off", description="Ray's NCCL hang detector "
                                                             "(RAS; GPU gangs on Ray): observe logs a hang and its "
                                                             "stacks, fail also ends the attempt (counted in "
                                                             "max_failures); Ray only")
    preflight: bool = Field(False, description="Before training, check the gang (versions, GEMM, storage, all-reduce) "
                                               "with ray_cluster.doctor's quick checks; stop on a failure")

    resize_check_s: float = Field(60.0, allow_inf_nan=False, gt=0.0, description="Elastic num_workers: seconds between Ray's checks "
                                                             "whether the cluster can hold a different worker count")

    @field_validator("num_workers", mode="before")
    @classmethod
    def _shape(cls, v: Any) -> Any:
        if isinstance(v, (list, tuple)) and (len(v) != 2 or not all(isinstance(x, int) for x in v)):
            raise ValueError(f"must be a number, auto, or [min, max] for elastic training; "
                             f"use e.g. scaling.num_workers=[1,4]")
        return v

    @field_validator("num_workers")
    @classmethod
    def _positive(cls, v: int | str | tuple[int, int]) -> int | str | tuple[int, int]:
        if isinstance(v, int) and v < 1:
            raise ValueError(f"must be at least 1 (or auto); use e.g. scaling.num_workers=2")
        if isinstance(v, tuple) and not 1 <= v[0] <= v[1]:
            raise ValueError(f"as [min, max] needs 1 <= min <= max; use e.g. scaling.num_workers=[1,4]")
        return v


class KeepBestSection(Section):
    metric: str = Field("val_loss", description="The evaluation figure checkpoints are ranked by: val_loss, a "
                        "val_<metric> of the task, or per source val_loss/<name>")
    mode: Literal["min", "max"] = Field("min", description="min: lower is better; max: higher is better")
    k: int = Field(1, ge=1, le=1000, description="How many of the best checkpoints are kept")

    _an_evaluation_figure = field_validator("metric")(EarlyStoppingSection._an_evaluation_figure.__func__)


class CheckpointSection(Section):
    keep_best: KeepBestSection | None = Field(None, description="Also keep the k checkpoints with the best "
                                              "evaluation figure, in <run>/best/: {metric, mode, k} "
                                              "(docs/fault-tolerance.md)")
    every_steps: int | None = Field(200, ge=1, le=MAX_STEPS, description="Checkpoint every N optimizer steps (and always at the end)")
    keep_last: int = Field(2, ge=1, description="Checkpoints kept on storage")
    staging_dir: str | None = Field(None, description="Runs on a bucket: the node-local folder where each rank writes "
                                    "its checkpoint shards before they upload, and the run's working files (default: "
                                    "a private folder under the node's temporary directory)")
    upload: Literal["async", "sync"] = Field("async", description="Runs on a bucket: upload checkpoint shards while "
                                             "training goes on (async), or before the next step (sync)")
    max_upload_failures: int = Field(3, ge=1, description="Runs on a bucket: a checkpoint whose upload still fails "
                                     "after retries is skipped with a warning; this many in a row fail the run")
    trainable_only: bool = Field(False, description="Save only the trainable parameters and their optimizer state "
                                 "(adapters: LoRA); a resume reads the frozen rest from init.from again, and exits 2 "
                                 "if that file changed")


class InitSection(Section):
    """Pretrained weights, loaded once at step 0 of a fresh run (docs/fine-tuning.md). A resume never reads them
    again (the checkpoint holds everything), except for checkpoint.trainable_only."""

    model_config = ConfigDict(populate_by_name=True)

    from_: str | None = Field(None, alias="from", description="A .safetensors file, a Hugging Face model folder "
                              "(save_pretrained's safetensors shards), a .pt/.pth/.bin state dict (read with "
                              "weights_only), or a Stride run or checkpoint folder; a path or an object-store URI "
                              "(s3://...). Relative paths are resolved where the config is loaded")
    strict: bool = Field(True, description="Every selected model parameter loaded and every selected source tensor "
                                           "used, with equal shapes; else exit 2")
    include: list[str] = Field(default_factory=list, description="Regexes on the model's parameter names: load only "
                               "those that match one (empty: all)")
    exclude: list[str] = Field(default_factory=list, description="Regexes on the model's parameter names: never load "
                               "those that match one")
    rename: list[tuple[str, str]] = Field(default_factory=list, description="[pattern, replacement] pairs applied in "
                                          "order (re.sub) to the source's tensor names, e.g. [['^', 'encoder.']]")

    @field_validator("from_")
    @classmethod
    def _resolved_here(cls, v: str | None) -> str | None:
        # Resolved where the config is loaded (the driver); workers receive it absolute (see absolute_paths).
        if v is None or "://" in v:
            return v
        if not v.strip():
            raise ValueError("is empty; set init.from=<a .safetensors file, a model folder or a run folder>, or null")
        return os.path.abspath(os.path.expanduser(v))

    @field_validator("include", "exclude")
    @classmethod
    def _regexes(cls, v: list[str]) -> list[str]:
        for pattern in v:
            _not_a_regex(pattern, "['^encoder\\.']")
        return v

    @field_validator("rename")
    @classmethod
    def _rename_pairs(cls, v: list[tuple[str, str]]) -> list[tuple[str, str]]:
        for pattern, _ in v:
            _not_a_regex(pattern, "[['^model\\.', '']]")
        return v


class TrackingBase(Section):
    """tracking.sinks; each built-in tracker's own keys come from its module (trainers/sinks/<x>_sink.py: its
    Sink's Settings), joined below into TrackingSection."""

    sinks: list[str | dict[str, dict[str, Any] | None]] = Field(
        ["mlflow"], description="Where the run's figures are recorded besides metrics.jsonl and the console "
        "(always on): mlflow, tensorboard (<run>/tensorboard/), wandb (see the wandb_* keys), or a stride.Sink of "
        "your own as \"module:Class\" or {\"module:Class\": {its settings}} (docs/monitoring.md)")

    @field_validator("sinks", mode="before")
    @classmethod
    def _entries(cls, v: Any) -> Any:
        from stride.trainers.sinks import builtin

        if not isinstance(v, list):
            return v  # pydantic's own words: must be a valid list
        names = list(builtin())
        specs = []
        for i, entry in enumerate(v):
            spec = entry if isinstance(entry, str) else next(iter(entry)) if isinstance(entry, dict) and len(
                entry) == 1 else None
            user = isinstance(spec, str) and spec not in names and _a_class_spec(spec)
            if spec not in names and not user:
                listed = ", ".join(map(repr, names[:-1])) + f" or {names[-1]!r}" if len(names) > 1 else repr(names[0])
                raise ValueError(f"must be one of {listed}, or \"module:Class\" naming a stride.Sink of your own "
                                 f"(tracking.sinks[{i}]: {entry!r})")
            if isinstance(entry, dict) and not user:
                raise ValueError(f"gives settings to the built-in sink {spec} (tracking.sinks[{i}]); set its "
                                 f"tracking.* keys instead")
            if isinstance(entry, dict) and not isinstance(entry[spec], (dict, type(None))):
                raise ValueError(f"gives {spec} (tracking.sinks[{i}]) settings that are not a mapping; use "
                                 f"{{\"{spec}\": {{key: value}}}}")
            if spec in specs:
                raise ValueError(f"names a sink twice: tracking.sinks[{i}] ({spec}) repeats tracking.sinks"
                                 f"[{specs.index(spec)}]; list each sink at most once")
            specs.append(spec)
        return v

    def active_sinks(self) -> list[str]:
        """The trackers this run records to: tracking.sinks (their names or "module:Class"), less those a setting
        of their own turns off (MLflow when tracking.mlflow is false)."""
        from stride.trainers.sinks import builtin

        specs = [e if isinstance(e, str) else next(iter(e)) for e in self.sinks]
        return [s for s in specs if s not in builtin() or builtin()[s].enabled(self)]


def _a_class_spec(spec: str) -> bool:
    module, colon, name = spec.partition(":")
    return bool(colon) and re.fullmatch(r"[A-Za-z_][\w.]*", module) is not None and name.isidentifier()


def _tracking_section() -> type[Section]:
    """TrackingSection: tracking.sinks, then each built-in tracker's settings in the order of their modules (the
    keys, defaults, validators and descriptions are the tracker's own)."""
    from stride.trainers.sinks import builtin

    settings = list(dict.fromkeys(cls.Settings for cls in builtin().values()))
    settings = [c for c in settings if not any(o is not c and issubclass(o, c) for o in settings)]  # no bare base
    # pydantic lists the fields of the last base first: reversed, the keys read sinks, then tracker by tracker.
    bases = tuple(reversed(settings))
    return type("TrackingSection", (*bases, TrackingBase), {"__module__": __name__, "__qualname__": "TrackingSection",
                                                           "__doc__": TrackingBase.__doc__})


TrackingSection = _tracking_section()


class Config(Section):
    run: RunSection = RunSection()
    data: DataSection = DataSection()
    init: InitSection = InitSection()
    # SerializeAsAny: the dict and YAML of a config carry the task's own fields, not only TaskConfig's.
    # The task's own Config (config_reader.section_class), validated before the rest; TaskConfig holds the
    # fields every task has.
    model: SerializeAsAny[TaskConfig] = Field(default_factory=TaskConfig)
    optim: OptimSection = OptimSection()
    train: TrainSection = TrainSection()
    scaling: ScalingSection = ScalingSection()
    checkpoint: CheckpointSection = CheckpointSection()
    tracking: TrackingSection = TrackingSection()

    @model_validator(mode="after")
    def _elastic_batch_splits(self) -> "Config":
        """Elastic runs keep the global micro-batch (batch_size_per_worker x max workers) whatever the current
        worker count, so it must split evenly over every count from min to max."""
        nw, b = self.scaling.num_workers, self.train.batch_size_per_worker
        if isinstance(nw, tuple):
            uneven = [w for w in range(nw[0], nw[1] + 1) if b * nw[1] % w]
            if uneven:
                # x * max splits over every count iff lcm(min..max) divides it, i.e. x is a multiple of
                # step = lcm / gcd(lcm, max): the smallest such x >= b, computed (a search took minutes at [1, 30]).
                lcm = math.lcm(*range(nw[0], nw[1] + 1))
                step = lcm // math.gcd(lcm, nw[1])
                fit = -(-b // step) * step
                raise ValueError(f"train.batch_size_per_worker ({b}) x max workers ({nw[1]}) = {b * nw[1]} rows per "
                                 f"micro-step cannot be split evenly over {uneven[0]} workers (scaling.num_workers "
                                 f"[{nw[0]}, {nw[1]}]); use train.batch_size_per_worker={fit}")
        return self

    @model_validator(mode="after")
    def _token_budget_needs(self) -> "Config":
        """train.tokens_per_micro_batch sizes micro-batches from the rows' lengths, as the data stream finds them."""
        budget = self.train.tokens_per_micro_batch
        if budget is None:
            return self
        needs = [(self.data.length_column is None, "data.length_column (the column of each row's length)"),
                 (self.train.max_steps is None, "train.max_steps (an epoch's micro-steps depend on the lengths, so "
                                                "train.epochs cannot say how many steps to take)"),
                 (self.data.pipeline == "ray_data", "data.pipeline=thread (Ray Data's chunks are counted in rows)"),
                 (self.data.train is not None, "one training source (a mixture deals rows per global batch of "
                                               "batch_size_per_worker x workers)")]
        for missing, what in needs:
            if missing:
                raise ValueError(f"train.tokens_per_micro_batch ({budget:g}) needs {what}; set it, or remove "
                                 f"train.tokens_per_micro_batch")
        return self

    @model_validator(mode="after")
    def _unfreeze_within_run(self) -> "Config":
        steps = self.train.max_steps
        for i, g in enumerate(self.optim.groups):
            if steps is not None and g.unfreeze_at_step is not None and g.unfreeze_at_step > steps:
                raise ValueError(f"optim.groups[{i}].unfreeze_at_step ({g.unfreeze_at_step}) is beyond train.max_steps "
                                 f"({steps}): the group would never train; use unfreeze_at_step < {steps}, or "
                                 f"freeze: true to keep it frozen")
        names = [g.name for g in self.optim.groups if g.name]
        if dup := sorted({n for n in names if names.count(n) > 1}):
            raise ValueError(f"optim.groups: the name {dup[0]!r} is used twice; give each group its own name")
        return self

    @property
    def run_dir(self) -> Path:
        """The run's folder; for a run on a bucket, this node's private working copy of it (trainers/run/remote.py
        says what reaches the bucket, and when)."""
        from stride.trainers.run.storage import location_of

        location = location_of(self.run.storage_path)
        if location is not None:
            from stride.trainers.run.remote import working_copy

            return working_copy(location, self.run.name, self.checkpoint.staging_dir)
        return Path(self.run.storage_path).expanduser().resolve() / self.run.name

    @property
    def run_location(self) -> str:
        """Where the run lives, as the user reads it: its folder, or s3://bucket/prefix/<run.name>."""
        from stride.trainers.run.storage import location_of

        location = location_of(self.run.storage_path)
        return str(location.join(self.run.name)) if location is not None else str(self.run_dir)

    def to_dict(self) -> dict[str, Any]:
        """The keys the user set, as validated here (paths resolved): what workers, Tune trials and the eval and
        predict gangs rebuild with from_dict, which fills the same defaults back in, so that every validator that
        asks "did the user set this?" answers there as it did here."""
        return self.model_dump(mode="json", by_alias=True, exclude_unset=True)

    def full_dict(self) -> dict[str, Any]:
        """Every key, defaults included: what a person reads (--print-config, summary.json, MLflow params)."""
        return self.model_dump(mode="json", by_alias=True)


# The model section's class depends on the task (section_class); TaskConfig holds the fields every task has.
SECTIONS: dict[str, type[Section]] = {name: TaskConfig if name == "model" else f.annotation
                                      for name, f in Config.model_fields.items()}


# ---- derived values: functions of the config, never stored back into it ----

def elastic_range(cfg: Config) -> tuple[int, int] | None:
    nw = cfg.scaling.num_workers
    return nw if isinstance(nw, tuple) else None


def global_micro_batch(cfg: Config, world_size: int) -> int:
    """Rows per micro-step over all workers. Elastic runs fix it at batch_size_per_worker x max workers, so the
    sample order, the global batch and the learning rate do not change when the worker count does; each of
    `world_size` workers then takes global_micro_batch / world_size rows."""
    elastic = elastic_range(cfg)
    return cfg.train.batch_size_per_worker * (elastic[1] if elastic else world_size)


def check_batch_fits(cfg: Config, train_rows: int, world_size: int) -> None:
    """One global micro-batch must fit in the training split, or no worker could take a step: the one check (and
    message) of the driver, torchrun, sweeps and the workers. Raises DataError."""
    from stride.errors import DataError

    G = global_micro_batch(cfg, world_size)
    if G > train_rows:
        workers = G // cfg.train.batch_size_per_worker
        where = ", ".join(src.path for src in cfg.data.train) if cfg.data.train else cfg.data.train_path
        raise DataError(f"train.batch_size_per_worker ({cfg.train.batch_size_per_worker}) x {workers} worker(s) = {G} "
                        f"rows per micro-step exceeds the {train_rows} rows of {where}; use "
                        f"train.batch_size_per_worker={max(1, train_rows // workers)} or less")


def check_mesh_fits(cfg: Config, world_size: int) -> None:
    """train.strategy=hsdp needs replicas (two workers or more) and shard groups that split the workers evenly: the
    Ray driver's check once it knows the worker count, and the gang's (torchrun's --nproc-per-node is not
    scaling.num_workers). An elastic run adapts instead (trainers/fsdp.py: plan_mesh). Raises UsageError."""
    from stride.errors import UsageError

    size = cfg.train.fsdp.shard_size
    if cfg.train.strategy != "hsdp" or elastic_range(cfg) is not None:
        return
    if world_size == 1:
        raise UsageError("train.strategy (hsdp) needs two workers or more (shard groups and their replicas); use 2 "
                         "workers or more, or train.strategy=fsdp")
    if size is not None and world_size % size:
        fits = max(d for d in range(1, min(size, world_size) + 1) if world_size % d == 0)
        raise UsageError(f"train.fsdp.shard_size ({size}) does not divide the {world_size} workers; use "
                         f"train.fsdp.shard_size={fits}, or a multiple of {size} workers")


def global_batch_size(cfg: Config, world_size: int) -> int:
    return global_micro_batch(cfg, world_size) * cfg.train.grad_accum_steps


def scaled_lr(cfg: Config, world_size: int) -> float:
    ratio = global_batch_size(cfg, world_size) / cfg.optim.reference_batch_size
    factor = {"none": 1.0, "linear": ratio, "sqrt": math.sqrt(ratio)}[cfg.optim.lr_scaling]
    return cfg.optim.lr * factor


def redact(uri: str | None) -> str | None:
    """A URI without the password of its `user:password@` part: what MLflow params, summary.json and the console
    show of tracking.mlflow_uri (the workers still get the real one)."""
    return re.sub(r"(//[^/@:]*):[^/@]*@", r"\1:***@", uri) if uri else uri


def public_dict(cfg: Config) -> dict[str, Any]:
    """The config as written to summary.json and MLflow: secrets redacted."""
    d = cfg.full_dict()
    d["tracking"]["mlflow_uri"] = redact(d["tracking"]["mlflow_uri"])
    d["init"]["from"] = redact(d["init"]["from"])  # an object-store URI may carry a password too
    return d
