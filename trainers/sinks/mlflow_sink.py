"""MLflow on rank 0: one MLflow run per training run, continued (never duplicated) on resume.

When the tracking server cannot be reached the run trains anyway and says so once. Its settings are tracking.mlflow,
tracking.mlflow_uri and tracking.experiment (`MLflowSink.Settings`). A sweep records to one parent run, with a child
run per trial (`open_sweep`, `close_sweep`).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from pydantic import Field, field_validator

from stride.trainers.sinks.base import RunInfo, Sink, SinkSettings, SweepInfo

log = logging.getLogger("stride")

# Tracking URI schemes MLflow's own stores take (a database URI may name its driver: postgresql+psycopg2);
# a plugin's scheme (entry point group mlflow.tracking_store) is accepted too.
MLFLOW_SCHEMES = ("http", "https", "file", "databricks", "sqlite", "postgresql", "mysql", "mssql")


def _mlflow_plugin_schemes() -> set[str]:
    from importlib.metadata import entry_points

    return {ep.name for ep in entry_points(group="mlflow.tracking_store")}


class MLflowSettings(SinkSettings):
    mlflow: bool = Field(True, description="Record the run in MLflow when tracking.sinks has mlflow (false: leave "
                         "it out)")
    mlflow_uri: str | None = Field(None, description="MLflow tracking URI (null: sqlite store under storage_path)")
    experiment: str = Field("stride", description="MLflow experiment name; the W&B project when wandb_project is null")

    @field_validator("mlflow_uri")
    @classmethod
    def _a_tracking_store(cls, v: str | None) -> str | None:
        # MLflow fails on an unknown scheme only when the first worker logs, with a hundred lines from each rank.
        scheme = v.partition("://")[0].partition("+")[0].lower() if v and "://" in v else ""
        if scheme and scheme not in MLFLOW_SCHEMES and scheme not in _mlflow_plugin_schemes():
            raise ValueError(f"has scheme {scheme[:50]}://, which MLflow cannot track to; use an http(s):// server, a "
                             f"folder, file://, databricks, or a database URI (sqlite:///mlflow.db, postgresql://...)")
        return v


def default_uri(storage_path: str | os.PathLike) -> str:
    return f"sqlite:///{Path(storage_path).expanduser().resolve() / 'mlflow.db'}"


def flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


class Tracker:
    """Thin wrapper over the MLflow client; every method is a no-op once the server proved unreachable."""

    def __init__(self, uri: str, experiment: str, storage_path: str):
        # Fail fast on an unreachable server instead of MLflow's default minutes of retries.
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
        import mlflow
        from mlflow.tracking import MlflowClient

        self.uri, self.experiment, self.storage_path = uri, experiment, storage_path
        self.client = MlflowClient(tracking_uri=uri)
        self._mlflow = mlflow
        self.run_id: str | None = None
        self.enabled = True

    def _guard(self, what: str, fn, *args, **kwargs):
        if not self.enabled:
            return None
        try:
            return fn(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - tracking must never kill training
            self.enabled = False
            from stride.trainers.config import redact

            log.warning("MLflow at %s failed while %s (%s); training continues without MLflow",
                        redact(self.uri), what, str(e).splitlines()[0][:200].replace(self.uri, redact(self.uri)))
            return None

    def start(self, run_name: str, run_id: str | None, params: dict[str, Any], parent_run_id: str | None = None) -> str | None:
        def _start():
            if run_id:
                self.client.update_run(run_id, status="RUNNING")
                return run_id
            exp = self.client.get_experiment_by_name(self.experiment)
            if exp is None:
                artifacts = None
                if not self.uri.startswith(("http://", "https://", "databricks")):
                    artifacts = (Path(self.storage_path).expanduser().resolve() / "mlartifacts").as_uri()
                exp_id = self.client.create_experiment(self.experiment, artifact_location=artifacts)
            else:
                exp_id = exp.experiment_id
            tags = {"mlflow.runName": run_name}
            if parent_run_id:
                tags["mlflow.parentRunId"] = parent_run_id
            run = self.client.create_run(exp_id, tags=tags, run_name=run_name)
            from mlflow.entities import Param

            flat = flatten(params)
            batch = [Param(k, str(v)[:6000]) for k, v in flat.items()]
            for i in range(0, len(batch), 100):
                self.client.log_batch(run.info.run_id, params=batch[i:i + 100])
            return run.info.run_id

        self.run_id = self._guard("starting a run", _start)
        return self.run_id

    def log_metrics(self, metrics: dict[str, Any], step: int) -> None:
        if self.run_id is None:
            return
        from mlflow.entities import Metric
        import time

        now = int(time.time() * 1000)
        batch = [Metric(k, float(v), now, step) for k, v in metrics.items() if isinstance(v, (int, float)) and v is not None]
        if batch:
            self._guard("logging metrics", self.client.log_batch, self.run_id, metrics=batch)

    def set_tag(self, key: str, value: Any) -> None:
        if self.run_id is not None:
            self._guard("setting a tag", self.client.set_tag, self.run_id, key, str(value))

    def log_artifact(self, path: str | os.PathLike, artifact_path: str | None = None) -> None:
        if self.run_id is not None:
            self._guard("logging an artifact", self.client.log_artifact, self.run_id, str(path), artifact_path)

    def finish(self, status: str = "FINISHED") -> None:
        if self.run_id is not None:
            self._guard("ending the run", self.client.set_terminated, self.run_id, status)


class MLflowSink(Sink):
    """tracking.sinks: [mlflow] (the default): params, metrics, tags and profiler traces in one MLflow run."""
    name = "mlflow"
    background = True
    Settings = MLflowSettings

    @classmethod
    def preflight(cls, cfg) -> str | None:
        from stride.trainers.run.storage import location_of

        if cfg.tracking.mlflow_uri is None and location_of(cfg.run.storage_path) is not None:
            # The default store is a SQLite file beside the runs; a bucket cannot hold one.
            return (f"tracking.mlflow_uri is unset, and its default store (a SQLite file under run.storage_path) "
                    f"cannot live in {cfg.run.storage_path}; set tracking.mlflow_uri=<your tracking server>, or "
                    f"tracking.mlflow=false")
        return super().preflight(cfg)

    @classmethod
    def enabled(cls, tracking) -> bool:
        return tracking.mlflow

    summary_fields = ("mlflow_run_id",)
    legacy_meta_key = "mlflow_run_id"

    def open(self, run: RunInfo) -> None:
        cfg = run.cfg
        # The launcher's URI: a default store under a relative run.storage_path is the launcher's folder's, not
        # the one a Ray worker happens to run in.
        self.tracker = Tracker(run.options.get("uri") or uri(cfg), cfg.tracking.experiment, str(run.run_dir.parent))
        # A resumed run continues its MLflow run (the id is in the checkpoint), never a second one.
        self.tracker.start(cfg.run.name, run.state.get("run_id"), run.params, run.options.get("parent_run_id"))
        for key, value in run.tags.items():  # where the weights came from
            self.tracker.set_tag(f"init.{key}", value)

    def step(self, step: int, metrics: dict[str, Any]) -> None:
        self.tracker.log_metrics(metrics, step)

    def artifact(self, path: Path, folder: str) -> None:
        self.tracker.log_artifact(path, folder)

    def state_dict(self) -> dict[str, Any]:
        return {"run_id": self.tracker.run_id} if self.tracker.run_id else {}

    def summary(self) -> dict[str, Any]:
        return {"mlflow_run_id": self.tracker.run_id}

    def close(self, status: str) -> None:
        self.tracker.finish()

    @classmethod
    def plan(cls, cfg) -> dict[str, Any]:
        return {"uri": uri(cfg)}

    @classmethod
    def after_run(cls, cfg, summary: dict[str, Any]) -> None:
        if summary.get("mlflow_run_id") and summary.get("checkpoint"):
            tracker = Tracker(uri(cfg), cfg.tracking.experiment, cfg.run.storage_path)
            tracker.run_id = summary["mlflow_run_id"]
            tracker.set_tag("final_checkpoint", summary["checkpoint"])

    @classmethod
    def where(cls, cfg, summary: dict[str, Any]) -> str:
        from stride.trainers.config import redact

        shown = redact(cfg.tracking.mlflow_uri) or default_uri(cfg.run.storage_path)
        return f"mlflow      run {summary.get('mlflow_run_id')} in {shown}  (view: mlflow ui --backend-store-uri {shown})"

    # ---- a sweep: one parent run, a child run per trial ----

    @classmethod
    def open_sweep(cls, sweep: SweepInfo, saved: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        import mlflow  # noqa: F401 - it sets its loggers' levels when imported: quiet them after that

        # Schema migrations and per-dataset INFO lines are noise next to one line per trial result.
        for name in ("mlflow", "alembic"):
            logging.getLogger(name).setLevel(logging.WARNING)
        # The store beside the sweep folder (a trial's storage_path is the sweep folder itself).
        where = sweep.cfg.tracking.mlflow_uri or default_uri(sweep.sweep_dir.parent)
        tracker = Tracker(where, sweep.cfg.tracking.experiment, str(sweep.sweep_dir.parent))
        run_id = tracker.start(sweep.name, saved.get("mlflow_parent_run_id"), sweep.params)
        tracker.set_tag("stride.sweep", "true")
        tracker.set_tag("stride.sweep_dir", str(sweep.sweep_dir))
        return {"mlflow_parent_run_id": run_id, "mlflow_uri": where}, {"uri": where, "parent_run_id": run_id}

    @classmethod
    def close_sweep(cls, sweep: SweepInfo, fields: dict[str, Any], trials: list[dict[str, Any]],
                    best: dict[str, Any] | None, complete: bool) -> None:
        """Each trial's row gets its child run (and the superseded ones); close what the trials could not:
        early-stopped and failed children were killed mid-run; the parent gets the best trial and the counts."""
        from stride.errors import RunFolderError
        from stride.trainers.run import folder as runfolder

        where, parent_run_id = fields.get("mlflow_uri"), fields.get("mlflow_parent_run_id")
        children = child_runs(where, sweep.cfg.tracking.experiment, parent_run_id)
        for t in trials:
            try:
                own = runfolder.read_summary(Path(t["run_dir"]) / "summary.json") or {}
            except (OSError, ValueError, RunFolderError):
                own = {}
            ids = children.get(t["trial_id"], [])
            run_id = own.get("mlflow_run_id") or (ids[0] if ids else None)
            t["mlflow_run_id"], t["superseded_mlflow_run_ids"] = run_id, [i for i in ids if i != run_id]
        if not parent_run_id:
            return
        from mlflow.entities import Param

        experiment, storage = sweep.cfg.tracking.experiment, str(sweep.sweep_dir.parent)
        child = Tracker(where, experiment, storage)
        for t in trials:
            for stale in t["superseded_mlflow_run_ids"]:
                child.run_id = stale
                child.set_tag("stride.superseded_by", t["mlflow_run_id"])
                child.finish("KILLED")
            if t["mlflow_run_id"]:
                child.run_id = t["mlflow_run_id"]
                child.set_tag("stride.trial_status", t["status"])
                if t["status"] != "completed":  # the loop closed completed runs itself
                    child.finish("FAILED" if t["status"] == "failed" else "KILLED")
        parent = Tracker(where, experiment, storage)
        parent.run_id = parent_run_id
        if best is not None:
            parent.log_metrics({f"best_{sweep.metric}": best["metric"]}, step=best.get("steps") or 0)
            parent.set_tag("stride.best_trial_id", best["trial_id"])
            if complete:
                params = [Param(f"best.{k}", json.dumps(v) if isinstance(v, (list, dict)) else str(v))
                          for k, v in best["params"].items()]
                parent._guard("logging the best params", parent.client.log_batch, parent_run_id, params=params)
        counts: dict[str, int] = {}
        for t in trials:
            counts[t["status"]] = counts.get(t["status"], 0) + 1
        parent.log_metrics({f"trials_{k}": v for k, v in counts.items()}, step=0)
        parent.finish("FINISHED" if complete else "KILLED")

    @classmethod
    def where_sweep(cls, sweep: SweepInfo, fields: dict[str, Any]) -> str:
        from stride.trainers.config import redact

        return f"mlflow      parent run {fields.get('mlflow_parent_run_id')} in {redact(fields.get('mlflow_uri'))}"


def child_runs(where: str, experiment: str, parent_run_id: str | None) -> dict[str, list[str]]:
    """MLflow child run ids per trial id, newest first. A trial restarted before its first checkpoint could not
    continue its child run and has two; the newest is the trial's, the older ones are closed as superseded."""
    if not parent_run_id:
        return {}
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=where)
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        return {}
    runs = client.search_runs([exp.experiment_id], filter_string=f"tags.`mlflow.parentRunId` = '{parent_run_id}'",
                              max_results=5000, order_by=["attributes.start_time DESC"])
    out: dict[str, list[str]] = {}
    for r in runs:
        out.setdefault(r.data.tags.get("mlflow.runName", r.info.run_name), []).append(r.info.run_id)
    return out


def uri(cfg) -> str:
    return cfg.tracking.mlflow_uri or default_uri(cfg.run.storage_path)
