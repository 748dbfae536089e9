"""The sweep file, parsed and checked without Ray: its `sweep` section, the `base` overrides and the search `space`.

    sweep:  {name, base_config, storage_path, metric, mode, num_samples, search, scheduler, ...}  (SweepSection)
    base:   {section.field: value}               fixed overrides of the base training config, for every trial
    space:  {section.field: {distribution: args}} one of choice, uniform, loguniform, randint, grid

Everything a user can get wrong here (an unknown key, a bound the training config rejects, a distribution the
chosen search algorithm cannot sample) is a `ConfigError` with one line naming the key, before any trial starts.
"""

from __future__ import annotations

import difflib
import itertools
import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from stride.trainers.config import SECTIONS, Config, redact
from stride.errors import ConfigError
from stride.trainers.config_reader import build_config, parse_override, read_yaml, section_keys, set_values
from stride.trainers.run.storage import is_uri
from stride.trainers.tasks import task_class
from stride.tune.sweep_files import SweepFiles

REPO_ROOT = Path(__file__).resolve().parent.parent
DISTRIBUTIONS = ("choice", "uniform", "loguniform", "randint", "grid")
# Metrics the loop reports (trainers/loop.py); val_* need data.val_path.
# Metrics every run reports; val_* also the task's own (Task.metrics: val_<name>), and need data.val_path.
KNOWN_METRICS = ("val_loss", "train_loss", "samples_per_second")

# Keys a sweep owns, or that must stay fixed across trials: the driver reads the data once and sizes the
# concurrency from one worker gang, and every trial logs to the sweep's MLflow experiment under its parent run.
SWEEP_OWNED = {"run.name": "the sweep names each trial's run folder after its trial id",
               "run.storage_path": "trials live under sweep.storage_path/sweep.name; set sweep.storage_path"}
FIXED_IN_SPACE = ("data.", "model.name", "scaling.", "tracking.")


class SweepSection(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(description="Sweep name; results under storage_path/name (rerun the command to resume it)")
    base_config: str = Field(description="Training YAML every trial starts from (relative to the working directory or the repo)")
    storage_path: str = Field("./runs", description="Folder holding the sweep folder (and the default MLflow store), "
                                                    "or a bucket: s3://bucket/prefix, gs://bucket/prefix")
    metric: str = Field("val_loss", description=f"Reported metric to optimise: {', '.join(KNOWN_METRICS)} or the "
                                                f"task's val_<name> (val_accuracy for mlp, val_bpb for char_gpt)")
    mode: Literal["min", "max"] = Field("min", description="Minimise or maximise the metric")
    num_samples: int = Field(8, ge=1, description="Trials to sample (search: grid repeats the whole grid this many times)")
    search: Literal["random", "grid", "optuna"] = Field("random", description="random (grid entries enumerated), grid (choice/grid only) or optuna (TPE)")
    scheduler: Literal["fifo", "asha"] = Field("fifo", description="fifo runs every trial to the end; asha stops bad trials early on the metric")
    grace_period_steps: int | None = Field(None, ge=1, description="asha: steps before a trial can be stopped (null: train.eval_every_steps)")
    reduction_factor: float = Field(2.0, gt=1.0, description="asha: keep the best 1/reduction_factor of trials at each rung")
    max_concurrent_trials: int | Literal["auto"] = Field("auto", description="Trials at once (auto: how many worker gangs fit in the cluster now)")
    max_failures: int = Field(0, ge=0, description="Times Tune restarts a failed trial (it resumes from its last checkpoint)")
    seed: int = Field(0, description="Seed of the search algorithm")

    @field_validator("name")
    @classmethod
    def _plain_name(cls, v: str) -> str:
        if not v or "/" in v or "\\" in v or v in (".", ".."):
            raise ValueError("must be a plain folder name without path separators; use e.g. sweep.name=lr_sweep")
        return v

    @field_validator("storage_path")
    @classmethod
    def _a_folder_or_bucket(cls, v: str) -> str:
        from stride.trainers.run.storage import parse_uri

        if not is_uri(v):
            return v
        # Normalized: s3://bucket/prefix, and file:///x is the folder /x. A ValueError gives the reason, never a
        # credential the URI carried.
        return str(parse_uri(v))

    @field_validator("max_concurrent_trials")
    @classmethod
    def _positive(cls, v: int | str) -> int | str:
        if isinstance(v, int) and v < 1:
            raise ValueError("must be at least 1 (or auto); use e.g. sweep.max_concurrent_trials=auto")
        return v

    @field_validator("metric")
    @classmethod
    def _known_metric(cls, v: str) -> str:
        if v not in KNOWN_METRICS and not v.startswith("val_"):
            raise ValueError(f"is not a metric the trainer reports; use one of {', '.join(KNOWN_METRICS)} or the "
                             f"task's val_<name> (e.g. val_accuracy)")
        return v


@dataclass(frozen=True)
class Dimension:
    """One entry of the search space: `key` (section.field), a distribution and its arguments."""

    key: str
    kind: str
    args: tuple
    # Lists (model.hidden_sizes) are not categorical values every searcher accepts (Optuna takes only scalars):
    # such choices travel through Tune as JSON strings and are decoded in the trial.
    encoded: bool = False

    def describe(self) -> str:
        return f"{self.kind} {json.dumps([self.decode(v) for v in self.args])}"

    def values_to_check(self) -> list[Any]:
        """Values the training config must accept: every choice, or the bounds and one point inside."""
        if self.kind in ("choice", "grid"):
            return [self.decode(v) for v in self.args]
        lo, hi = self.args
        if self.kind == "uniform":
            return [lo, hi, lo + 0.37 * (hi - lo)]  # an interior, non-integral point catches integer fields
        if self.kind == "loguniform":
            return [lo, hi, math.exp(math.log(lo) + 0.37 * (math.log(hi) - math.log(lo)))]
        return [lo, hi - 1]  # randint: high is exclusive, as in Ray Tune

    def decode(self, value: Any) -> Any:
        return json.loads(value) if self.encoded else value

    def tune_domain(self, search: str):
        from ray import tune

        if self.kind == "grid" or (self.kind == "choice" and search == "grid"):
            return tune.grid_search(list(self.args))
        if self.kind == "choice":
            return tune.choice(list(self.args))
        lo, hi = self.args
        return {"uniform": tune.uniform, "loguniform": tune.loguniform, "randint": tune.randint}[self.kind](lo, hi)


@dataclass(frozen=True)
class Sweep:
    sweep: SweepSection
    base: dict[str, Any]            # the `base` mapping as written (section.field -> value)
    dims: tuple[Dimension, ...]
    base_config_path: Path
    base_raw: dict[str, Any]        # base YAML + base overrides: the raw training config every trial starts from
    # The sweep's files and its trials' runs: <storage_path>/<name>, a folder resolved where the sweep file is read
    # (trials run in Tune's per-trial working directories, where a relative storage_path would point somewhere
    # else), or a bucket's prefix (tune/sweep_files.py).
    files: SweepFiles
    # The base config as the driver built it (Config.to_dict: init.from and a task's Path fields absolute): what each
    # trial starts from, so that a relative path means the same in a trial's working directory as here.
    trial_base: dict[str, Any]

    @property
    def storage(self) -> str:
        """Where the sweep lives as the user reads it: its folder, or s3://bucket/prefix/<name>."""
        return self.files.where

    @property
    def sweep_dir(self) -> Path:
        """The folder the driver writes the sweep's own files in: the sweep folder, or for a sweep on a bucket this
        machine's private working copy of them."""
        return self.files.local

    def base_cfg(self) -> Config:
        return build_config(self.base_raw, origin="base")

    def identity(self) -> dict[str, Any]:
        """What defines the sweep's trials; a resumed sweep must match it (max_concurrent_trials may change)."""
        return {"sweep": self.sweep.model_dump(mode="json", exclude={"max_concurrent_trials"}),
                "base_raw": self.base_raw, "space": [[d.key, d.kind, list(d.args)] for d in self.dims]}

    def to_params(self) -> dict[str, Any]:
        """Flat sweep description for the MLflow parent run."""
        out = {f"sweep.{k}": v for k, v in self.sweep.model_dump(mode="json").items()}
        out.update({f"base.{k}": redact(v) if k == "tracking.mlflow_uri" else v for k, v in self.base.items()})
        out.update({f"space.{d.key}": d.describe() for d in self.dims})
        return out

    def num_trials(self) -> int:
        grid = math.prod(len(d.args) for d in self.dims
                         if d.kind == "grid" or (d.kind == "choice" and self.sweep.search == "grid"))
        return self.sweep.num_samples * grid

    def param_space(self) -> dict[str, Any]:
        return {d.key: d.tune_domain(self.sweep.search) for d in self.dims}

    def decode(self, config: dict[str, Any]) -> dict[str, Any]:
        """A Tune trial's config -> the training overrides {section.field: value}."""
        return {d.key: d.decode(config[d.key]) for d in self.dims if d.key in config}

    def trial_raw(self, params: dict[str, Any], run_name: str, mlflow_uri: str) -> dict[str, Any]:
        raw = with_values(self.trial_base, params)
        # The trial's run is <sweep>/<trial id>: Tune's trial folder (or prefix), with Stride's metrics.jsonl,
        # summary.json and checkpoints next to Tune's result files.
        return with_values(raw, {"run.name": run_name, "run.storage_path": self.storage,
                                 "tracking.mlflow_uri": mlflow_uri})


# ---- keys and values ----

def split_key(key: str, origin: str) -> tuple[str, str]:
    section, dot, field = str(key).partition(".")
    if not dot or not field:
        raise ConfigError(f"{origin}.{key}: keys are section.field, e.g. {origin}.optim.lr")
    if section not in SECTIONS:
        match = difflib.get_close_matches(section, list(SECTIONS), n=1)
        hint = f"did you mean {match[0]}.{field}?" if match else f"sections: {', '.join(SECTIONS)}"
        raise ConfigError(f"{origin}.{key} is not a field of the training config (no section '{section}'); {hint}")
    if section == "model":  # the task's fields: checked against the base config's task when the space is built
        return section, field
    fields = section_keys(SECTIONS[section])
    if field.partition(".")[0] not in fields:  # a nested key (train.early_stopping.patience) is checked when set
        match = difflib.get_close_matches(field, fields, n=1)
        hint = f"did you mean {section}.{match[0]}?" if match else f"fields of {section}: {', '.join(fields)}"
        raise ConfigError(f"{origin}.{key} is not a field of the training config; {hint}")
    return section, field


def with_values(raw: dict[str, Any], values: dict[str, Any]) -> dict[str, Any]:
    """A copy of a raw training config with {section.field: value} set (section.key.field too, as on the command
    line)."""
    return set_values(raw, [(*key.split(".", 1), value) for key, value in values.items()], origin="base")


def _number(value: Any, where: str) -> float:
    # PyYAML reads 1e-4 (no dot) as a string; accept it as the number it plainly is.
    if isinstance(value, bool):
        raise ConfigError(f"{where} must be numbers, got {value!r}")
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            raise ConfigError(f"{where} must be numbers, got {value!r}") from None
    if not isinstance(value, (int, float)):
        raise ConfigError(f"{where} must be numbers, got {value!r}")
    return value


def parse_dimension(key: str, spec: Any) -> Dimension:
    where = f"space.{key}"
    split_key(key, "space")
    if key in SWEEP_OWNED:
        raise ConfigError(f"{where} cannot be searched: {SWEEP_OWNED[key]}")
    if any(key == p or (p.endswith(".") and key.startswith(p)) for p in FIXED_IN_SPACE):
        raise ConfigError(f"{where} cannot be searched: data, model.name, scaling and tracking are fixed "
                          f"for a sweep (one data read, one worker-gang size); set it under base")
    if not isinstance(spec, dict) or len(spec) != 1:
        raise ConfigError(f"{where} must be one distribution, e.g. {{loguniform: [1.0e-4, 1.0e-1]}} "
                          f"or {{choice: [32, 64]}}; got {spec!r} (a fixed value goes under base)")
    (kind, args), = spec.items()
    if kind not in DISTRIBUTIONS:
        match = difflib.get_close_matches(str(kind), DISTRIBUTIONS, n=1)
        raise ConfigError(f"{where}: unknown distribution '{kind}'; "
                          + (f"did you mean {match[0]}?" if match else f"use one of {', '.join(DISTRIBUTIONS)}"))
    if not isinstance(args, list) or not args:
        raise ConfigError(f"{where}: {kind} takes a non-empty list, got {args!r}")
    if kind in ("choice", "grid"):
        encoded = any(isinstance(v, (list, dict)) for v in args)
        values = tuple(json.dumps(v) for v in args) if encoded else tuple(args)
        if len(set(values)) != len(values):
            raise ConfigError(f"{where}: {kind} {args} repeats a value; list each value once")
        return Dimension(key, kind, values, encoded)
    if len(args) != 2:
        raise ConfigError(f"{where}: {kind} takes [low, high], got {args!r}")
    lo, hi = (_number(v, f"{where}: {kind} bounds") for v in args)
    if kind == "randint":
        if not all(float(v).is_integer() for v in (lo, hi)):
            raise ConfigError(f"{where}: randint bounds must be integers, got {args!r}")
        lo, hi = int(lo), int(hi)
        if hi - lo < 1:
            raise ConfigError(f"{where}: randint [low, high) needs high > low (high is exclusive), got {args!r}")
    elif not lo < hi:
        raise ConfigError(f"{where}: {kind} [low, high] needs low < high, got {args!r}")
    if kind == "loguniform" and lo <= 0:
        raise ConfigError(f"{where}: loguniform needs low > 0, got {args!r}; use uniform for ranges that include 0")
    return Dimension(key, kind, (lo, hi))


def parse_space(raw: Any) -> tuple[Dimension, ...]:
    if not isinstance(raw, dict) or not raw:
        raise ConfigError("space must map at least one section.field to a distribution, "
                          "e.g. space: {optim.lr: {loguniform: [1.0e-4, 1.0e-1]}}")
    return tuple(parse_dimension(str(k), v) for k, v in raw.items())


def check_search(dims: tuple[Dimension, ...], search: str) -> None:
    for d in dims:
        if search == "grid" and d.kind not in ("grid", "choice"):
            raise ConfigError(f"space.{d.key} ({d.describe()}) cannot be enumerated by sweep.search=grid; "
                              f"use grid/choice values or sweep.search=random")
        if search == "optuna" and d.kind == "grid":
            raise ConfigError(f"space.{d.key} uses grid, which sweep.search=optuna cannot sample; "
                              f"use choice, or sweep.search=random")
    if search == "optuna":
        try:
            import optuna  # noqa: F401
        except ImportError:
            raise ConfigError("sweep.search=optuna needs the optuna package; pip install optuna, "
                              "or use sweep.search=random") from None


def _config_error(raw: dict[str, Any]) -> str | None:
    try:
        build_config(raw, origin="trial")
    except ConfigError as e:
        return str(e)
    return None


def check_space(dims: tuple[Dimension, ...], base_raw: dict[str, Any]) -> None:
    """Every value a trial can get must pass the training config's validation, alone and (for small discrete
    spaces) in combination, so a typo'd bound fails now and not as a failed trial an hour in."""
    for d in dims:
        for value in d.values_to_check():
            err = _config_error(with_values(base_raw, {d.key: value}))
            if err:
                hint = "; use randint for an integer field" if "valid integer" in err and d.kind != "randint" else ""
                raise ConfigError(f"space.{d.key} ({d.describe()}) can give {value!r}, which the training config "
                                  f"rejects: {err}{hint}")
    discrete = [d for d in dims if d.kind in ("choice", "grid")]
    if 1 < len(discrete) and math.prod(len(d.args) for d in discrete) <= 1000:
        fixed = {d.key: d.values_to_check()[0] for d in dims if d not in discrete}
        for combo in itertools.product(*(d.values_to_check() for d in discrete)):
            values = dict(fixed, **{d.key: v for d, v in zip(discrete, combo)})
            err = _config_error(with_values(base_raw, values))
            if err:
                shown = ", ".join(f"{d.key}={v!r}" for d, v in zip(discrete, combo))
                raise ConfigError(f"space: the combination {shown} is rejected by the training config: {err}")


# ---- the sweep file ----

def resolve_base_config(path: str, origin: Path | None) -> Path:
    p = Path(path).expanduser()
    candidates = [p] if p.is_absolute() else [Path.cwd() / p, REPO_ROOT / p] + ([origin.parent / p] if origin else [])
    for c in candidates:
        if c.is_file():
            return c.resolve()
    raise ConfigError(f"sweep.base_config ({path}) does not exist; give a training YAML such as "
                      f"trainers/configs/tabular_mlp.yaml (relative to the working directory or the repo)")


def apply_sweep_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """`sweep.field=value` and `base.section.field=value` from the command line (values parsed as YAML)."""
    out = {k: (dict(v) if isinstance(v, dict) else v) for k, v in raw.items()}
    for item in overrides:
        head, _, rest = item.partition(".")
        if head == "sweep":
            _, field, value = parse_override(item)
            out.setdefault("sweep", {})[field] = value
        elif head == "base":
            key, sep, text = rest.partition("=")
            if not sep:
                raise ConfigError(f"override '{item}' must look like base.section.field=value, e.g. base.train.max_steps=100")
            _, _, value = parse_override(f"{key}={text}")
            out.setdefault("base", {})
            out["base"] = dict(out["base"] or {}, **{key.strip(): value})
        else:
            raise ConfigError(f"override '{item}' must look like sweep.field=value or base.section.field=value, "
                              f"e.g. sweep.num_samples=4 or base.train.max_steps=100")
    return out


def build_sweep(raw: dict[str, Any], origin: Path | None = None) -> Sweep:
    unknown = [k for k in raw if k not in ("sweep", "base", "space")]
    if unknown:
        raise ConfigError(f"{origin or 'sweep file'}: unknown top-level key '{unknown[0]}'; the sections are sweep, base, space")
    if not isinstance(raw.get("sweep") or {}, dict):
        raise ConfigError(f"sweep must map setting: value (name, base_config, metric, ...), got {raw['sweep']!r}; "
                          f"write e.g. sweep: {{name: lr_sweep, base_config: trainers/configs/tabular_mlp.yaml}}")
    try:
        sweep = SweepSection.model_validate(raw.get("sweep") or {})
    except ValidationError as e:
        err = e.errors()[0]
        field = ".".join(str(p) for p in err["loc"][:1])
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            match = difflib.get_close_matches(field, list(SweepSection.model_fields), n=1)
            raise ConfigError(f"sweep.{field} is not a sweep setting; "
                              + (f"did you mean sweep.{match[0]}?" if match else f"valid: {', '.join(SweepSection.model_fields)}")) from None
        if err["type"] == "missing":
            raise ConfigError(f"sweep.{field} is required ({SweepSection.model_fields[field].description})") from None
        value = (raw.get("sweep") or {}).get(field)
        if isinstance(value, str) and "://" in value:  # never a URI's user:password@ part (a bucket's keys)
            value = re.sub(r"(//)[^/@]*@", r"\1***@", value)
        msg = msg.replace("Input should be", "must be")
        raise ConfigError(f"sweep.{field} ({value!r}) {msg}") from None
    base = raw.get("base") or {}
    if not isinstance(base, dict):
        raise ConfigError(f"base must map section.field to a value, e.g. base: {{train.max_steps: 300}}; got {base!r}")
    for key in base:
        split_key(key, "base")
        if key in SWEEP_OWNED:
            raise ConfigError(f"base.{key} cannot be set: {SWEEP_OWNED[key]}")
    dims = parse_space(raw.get("space"))
    check_search(dims, sweep.search)
    base_path = resolve_base_config(sweep.base_config, origin)
    root = sweep.storage_path if is_uri(sweep.storage_path) else str(Path(sweep.storage_path).expanduser().resolve())
    base_raw = with_values(read_yaml(base_path), dict(base, **{"run.name": sweep.name, "run.storage_path": root}))
    try:
        cfg = build_config(base_raw, origin=str(base_path))
    except ConfigError as e:
        raise ConfigError(f"base ({sweep.base_config} + base overrides): {e}") from None
    if sweep.metric.startswith("val_") and not (cfg.data.val_path or cfg.data.val):
        raise ConfigError(f"sweep.metric ({sweep.metric}) needs validation data but data.val_path is null; "
                          f"set base.data.val_path or sweep.metric=train_loss")
    reported = task_class(cfg.model.name).metric_names
    if sweep.metric not in KNOWN_METRICS and reported is not None and sweep.metric.removeprefix("val_") not in reported:
        names = ", ".join(["val_loss", *(f"val_{n}" for n in reported)])
        raise ConfigError(f"sweep.metric ({sweep.metric}) is not reported by model.name ({cfg.model.name}), which "
                          f"reports {names}; use one of those")
    if sweep.scheduler == "asha" and sweep.metric.startswith("val_") and not cfg.train.eval_every_steps \
            and "train.eval_every_steps" not in {d.key for d in dims}:
        raise ConfigError(f"sweep.scheduler (asha) stops trials on {sweep.metric} between evaluations, but "
                          f"train.eval_every_steps is null (one evaluation at the end); set base.train.eval_every_steps")
    if is_uri(root) and "mlflow" in cfg.tracking.active_sinks() and cfg.tracking.mlflow_uri is None:
        raise ConfigError(f"sweep.storage_path ({root}) is a bucket, where MLflow's default store (a SQLite file) "
                          f"cannot live; set base.tracking.mlflow_uri=<your tracking server>, or "
                          f"base.tracking.mlflow=false")
    check_space(dims, base_raw)
    files = SweepFiles(root, sweep.name, cfg.checkpoint.staging_dir)
    return Sweep(sweep, dict(base), dims, base_path, base_raw, files, cfg.to_dict())


def load_sweep(path: str | os.PathLike, overrides: list[str] = ()) -> Sweep:
    from stride.safe_yaml import read_mapping

    raw = read_mapping(path, "--config", "tune/configs/lr_sweep.yaml", ConfigError,
                       "a sweep needs the sections sweep, base and space")
    return build_sweep(apply_sweep_overrides(raw, list(overrides)), origin=Path(path))
