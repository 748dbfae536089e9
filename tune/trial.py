"""One sweep trial = one full Stride training run, and the Tune callbacks around it.

`run_trial` is the function trainable Tune runs (with almost no resources of its own: the TorchTrainer it
builds reserves the worker gang). Its run folder is <storage_path>/<sweep>/<trial id>: metrics.jsonl,
checkpoints and summary.json, exactly as `trainers/main.py` writes them. Evaluation results reach Tune through
`TuneReportCallback`, so ASHA can stop a trial between evaluations. This module is importable on every node
(the driver's tune/main.py is `__main__` there), which is why the trainable and the callbacks live here.
"""

from __future__ import annotations

from stride.errors import RunFolderError
import json
import math
import time
from pathlib import Path
from typing import Any

from ray.tune import Callback
from ray.tune.integration.ray_train import TuneReportCallback

from stride.trainers.launch import lifecycle
from stride.trainers.run import folder as runfolder
from stride.trainers.run.folder import atomic_write_text
from stride.trainers.launch.ray import SNAPSHOT, SNAPSHOT_COPY, is_json, repair_snapshot
from stride.trainers.config import Config, global_micro_batch
from stride.trainers.config_reader import build_config
from stride.tune.sweep_files import EVENTS

SUMMARY = "summary.json"


class MetricReportCallback(TuneReportCallback):
    """Forward to Tune only the reports that carry the sweep's metric (the loop reports train_loss on log steps
    and val_* on eval steps). Tune then sees one result per evaluation, ASHA compares trials on the metric at
    the same step, and Tune's strict metric check never trips over a log-only report.

    It also keeps a copy of Ray Train's checkpoint snapshot after every checkpoint: Ray writes that file in
    place, and a sweep killed during the write leaves it empty, after which the trial can never start again
    (CheckpointManagerInitializationError). `repair_snapshot` puts the copy back."""

    def __init__(self, metric: str, run_dir: str):
        super().__init__()
        self.metric = metric
        self.run_dir = run_dir

    def after_report(self, run_context, metrics, checkpoint):
        if checkpoint is not None:
            # Runs after Ray Train's checkpoint manager registered the checkpoint and rewrote the snapshot.
            src = Path(self.run_dir) / SNAPSHOT
            try:  # Ray's file, in a folder others can write: a regular file only (a FIFO would hang the callback)
                text = runfolder.read_bytes(src).decode(errors="replace")
            except (OSError, ValueError, RunFolderError):
                text = ""
            if is_json(text):
                atomic_write_text(Path(self.run_dir) / SNAPSHOT_COPY, text)
        if metrics and self.metric in metrics[0]:
            super().after_report(run_context, metrics, checkpoint)


def planned_steps(cfg: Config, train_rows: int, num_workers: int) -> int:
    """Optimizer steps a run of `cfg` will take (trainers/loop.py's total_steps without building an Order)."""
    if cfg.train.max_steps is not None:
        return cfg.train.max_steps
    micro_per_epoch = train_rows // global_micro_batch(cfg, num_workers)
    return max(1, math.ceil(cfg.train.epochs * micro_per_epoch / cfg.train.grad_accum_steps))


def read_summary(run: str | Path) -> dict[str, Any] | None:
    """The trial's summary.json (`run`: its folder, or its URI on a bucket), or None when there is none Stride would
    have written (absent, torn, untyped, a link: trainers/run/folder.py)."""
    from stride.trainers.run.storage import ObjectStore, location_of

    location = location_of(str(run))
    try:
        if location is None:
            return runfolder.read_summary(Path(run) / SUMMARY)
        data = ObjectStore(location).read(SUMMARY)
        return None if data is None else runfolder.validated(runfolder.Summary, json.loads(data), run)
    except (OSError, ValueError, RunFolderError):
        return None


def trial_raw(sweep, params: dict[str, Any], trial_id: str, base: Config | None = None) -> dict[str, Any]:
    """A trial's raw config. Its trackers find the sweep's record in their options (trainers/sinks: Sink.open_sweep);
    the base config's own tracking URI is passed on unchanged (tune/space.py's trial_raw takes one)."""
    return sweep.trial_raw(params, trial_id, (base or sweep.base_cfg()).tracking.mlflow_uri)


def run_trial(config: dict[str, Any], *, sweep, specs: dict, facts: dict,
              sink_options: dict[str, dict[str, Any]]) -> None:
    """`sink_options`: per tracker, what the sweep's record gives each trial's copy (MLflow: its parent run)."""
    from ray import tune
    import ray.train

    from stride.trainers.launch.ray import build_trainer
    from stride.trainers.tasks import make_task

    trial_id = tune.get_context().get_trial_id()
    params = sweep.decode(config)
    cfg = build_config(trial_raw(sweep, params, trial_id), origin=f"trial {trial_id}")
    metric = sweep.sweep.metric
    done = read_summary(cfg.run_location)
    if done and done.get("status") == "completed" and done.get("params") == params:
        # Finished before the driver was killed, but Tune's last saved state still had it running:
        # report the final result again instead of training it again.
        tune.report({"step": done.get("global_step"), metric: done.get(metric), "stride_restored": True})
        return
    def train(token: str | None) -> dict[str, Any]:
        repaired = repair_snapshot(cfg.run_dir)
        if repaired:
            print(f"stride: trial {trial_id}: {repaired}", flush=True)
        trainer, _, _ = build_trainer(cfg, specs, facts, callbacks=[MetricReportCallback(metric, str(cfg.run_dir))],
                                      sink_options=sink_options,
                                      run_lock_token=token,
                                      report_log_steps=True)  # Tune's schedulers read train_* figures too
        result = trainer.fit()
        summary = dict(result.return_value or {})
        summary.setdefault("status", "completed")
        summary["checkpoint"] = result.checkpoint.path if result.checkpoint else None
        return summary

    def failed(e: BaseException) -> dict[str, Any] | None:
        # Recorded, then raised again: Tune marks the trial errored.
        if isinstance(e, ray.train.TrainingFailedError):
            return {"status": "failed", "error": lifecycle.last_line(e)}
        return None

    # The trial id is the instance: Tune's restart of this trial (a new actor, perhaps on another node while the old
    # one's workers still run) takes the folder over at once, and the old workers' fences stop them.
    take = lifecycle.take_run(cfg, make_task(cfg, facts), f"tune-trial:{trial_id}")
    lifecycle.train_and_record(cfg, take, train, failed=failed, params=params, runtime="ray")


class ConsoleCallback(Callback):
    """Stride's console for a sweep (Tune runs with verbose=0): one line per trial start, result, end.
    Start/result/end times also go to <sweep>/trial_events.jsonl, which survives a resume (on a bucket: pushed whole
    after each event, in the background)."""

    def __init__(self, files, metric: str):
        self.files = files  # tune/sweep_files.py's SweepFiles
        self.metric = metric

    def _record(self, trial, event: str, **extra) -> None:
        with open(self.files.path(EVENTS), "a") as f:
            f.write(json.dumps({"trial_id": trial.trial_id, "event": event, "time": time.time(), **extra}) + "\n")
        self.files.push_soon(EVENTS)

    @staticmethod
    def _say(text: str) -> None:
        print(f"stride: {text}", flush=True)

    def on_trial_start(self, iteration, trials, trial, **info):
        self._record(trial, "start")
        params = ", ".join(f"{k}={_fmt(v)}" for k, v in trial.config.items())
        self._say(f"trial {trial.trial_id} started: {params}")

    def on_trial_result(self, iteration, trials, trial, result, **info):
        value = result.get(self.metric)
        self._record(trial, "result", step=result.get("step"), value=value)
        self._say(f"trial {trial.trial_id} step {result.get('step')} {self.metric} {_fmt(value)}")

    def on_trial_complete(self, iteration, trials, trial, **info):
        self._record(trial, "end")
        last = trial.last_result or {}
        # A trial that ran to the end wrote its summary; one the scheduler stopped was killed before it could.
        own = read_summary(self.files.trial(trial.trial_id)) or {}
        how = "completed" if own.get("status") == "completed" else "stopped early"
        self._say(f"trial {trial.trial_id} {how} at step {last.get('step')} {self.metric} {_fmt(last.get(self.metric))}")

    def on_trial_error(self, iteration, trials, trial, **info):
        self._record(trial, "error")
        self._say(f"trial {trial.trial_id} failed: {error_line(trial)}")


def error_line(trial) -> str:
    path = getattr(trial, "error_file", None) or getattr(trial, "local_error_file", None)
    try:
        text = Path(path).read_text() if path else ""
    except OSError:
        text = ""
    return lifecycle.last_line(text)[:300] or "see the trial's error.txt"


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)



def trial_dirname(trial) -> str:
    """A trial's folder (and Stride run name) is its trial id: short, unique, stable across a resume."""
    return trial.trial_id
