"""MLflow on rank 0: one MLflow run per training run, continued (never duplicated) on resume.

When the tracking server cannot be reached the run trains anyway and says so once.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from stride.trainers.sinks import RunInfo, Sink

log = logging.getLogger("stride")


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


def uri(cfg) -> str:
    return cfg.tracking.mlflow_uri or default_uri(cfg.run.storage_path)
