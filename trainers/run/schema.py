"""The schemas of what Stride reads back from a run folder (meta.json, summary.json, metrics.jsonl lines), kept apart
from trainers/run/folder.py so that the loop's lower modules import without pydantic (benchmarks/gpu.py runs on torch
alone); runfolder loads them on first use."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, JsonValue, model_validator

def _quote(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


Count = Annotated[int, Field(ge=0)]
# Steps and epochs as the config bounds them (trainers/config.py): a planted 10**30 is not a finished run.
Step = Annotated[int, Field(ge=0, le=10**9)]
Number = int | float
Sha256 = Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]


class FileDigest(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    bytes: Count
    sha256: Sha256


class CheckpointMeta(BaseModel):
    """meta.json of a checkpoint folder: every field Stride reads back (trainers/loop.py Trainer._load, export.py,
    generate.py, the launchers), typed; other keys are kept as they are."""

    model_config = ConfigDict(strict=True, extra="allow")
    step: Step
    epoch: Step | None = None
    epoch_offset_samples: Count | None = None
    samples_seen: Count | None = None
    restarts: Count | None = None
    world_size: Annotated[int, Field(ge=1)] | None = None
    mlflow_run_id: str | None = None  # checkpoints before `sinks`
    sinks: dict[str, dict[str, JsonValue]] | None = None  # each tracker's state (trainers/sinks)
    callbacks: dict[str, JsonValue] | None = None  # each callback's state_dict (rank 0's)
    ended: str | None = None  # the status of a run a callback ended
    ema: bool | None = None  # the checkpoint holds train.ema's average under "ema"
    initial_val_loss: Number | None = None
    model: str | None = None
    strategy: str | None = None
    format: str | None = None
    facts: dict[str, JsonValue] | None = None
    metrics: dict[str, Number | None] | None = None
    scheduler: dict[str, JsonValue] | None = None
    scaler: dict[str, JsonValue] | None = None
    files: dict[str, FileDigest]  # every other file of the folder (checkpointing.write_marker)


def _figures_are_numbers(extra: dict[str, Any] | None, keys: tuple[str, ...]) -> None:
    for key, value in (extra or {}).items():
        if key.startswith(keys) and value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise ValueError(f"{key} ({_quote(value)}) must be a number or null")


class Summary(BaseModel):
    """summary.json: what generate.py, export.py, write_summary and sweeps (tune/trial.py) read back."""

    model_config = ConfigDict(strict=True, extra="allow")
    status: str | None = None
    config: dict[str, JsonValue] | None = None
    facts: dict[str, JsonValue] | None = None
    checkpoint: str | None = None
    params: dict[str, JsonValue] | None = None
    global_step: Step | None = None
    mlflow_run_id: str | None = None
    wandb_run_id: str | None = None
    final: bool | None = None  # the run is over (completed, or ended by a callback): a rerun trains no further

    @model_validator(mode="after")
    def _figures(self):
        _figures_are_numbers(self.model_extra, ("train_", "val_", "initial_val_loss"))
        return self


class MetricsLine(BaseModel):
    """One line of metrics.jsonl: the step it belongs to, and figures (numbers, or null)."""

    model_config = ConfigDict(strict=True, extra="allow")
    step: Step
    epoch: Step | None = None
    samples_seen: Count | None = None

    @model_validator(mode="after")
    def _figures(self):
        _figures_are_numbers(self.model_extra, ("",))
        return self
