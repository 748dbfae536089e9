"""tracking.sinks: [wandb]: a Weights & Biases run, continued across resumes and SLURM requeues.

The run id is saved in the checkpoint, so a resumed run (a requeue, a restart) logs to the same W&B run. The mode
is `tracking.wandb_mode`, else the launcher's WANDB_MODE, resolved on the launcher so that Ray workers use the same:
`offline` writes under <run>/wandb/ for `wandb sync` to upload later (compute nodes without internet). The API key
stays where W&B keeps it (WANDB_API_KEY, ~/.netrc): Stride never reads, prints or writes it, and W&B's own
captures that could carry one (the console, the command line, the environment) are off. Its settings are
tracking.wandb_project, wandb_entity, wandb_tags and wandb_mode (`WandbSink.Settings`). A sweep's trials are one W&B
group, named after the sweep (`open_sweep`); W&B has no parent run to open.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

from pydantic import Field

from stride.trainers.run import folder as runfolder
from stride.trainers.sinks.base import RunInfo, Sink, SinkSettings, SweepInfo


class WandbSettings(SinkSettings):
    wandb_project: str | None = Field(None, description="W&B project (null: tracking.experiment)")
    wandb_entity: str | None = Field(None, description="W&B entity (team or user; null: W&B's default)")
    wandb_tags: list[str] = Field([], description="W&B tags of the run")
    wandb_mode: Literal["online", "offline", "disabled"] | None = Field(
        None, description="W&B mode (null: WANDB_MODE, else online); offline writes <run>/wandb/ for `wandb sync`")


class WandbSink(Sink):
    name = "wandb"
    background = True
    Settings = WandbSettings
    package = "wandb"
    summary_fields = ("wandb_run_id",)

    def open(self, run: RunInfo) -> None:
        import wandb

        cfg, tracking = run.cfg, run.cfg.tracking
        runfolder.refuse_link(run.run_dir / "wandb")  # shared storage: never write through a planted link
        settings = wandb.Settings(console="off", x_disable_meta=True, x_disable_stats=True, save_code=False,
                                  disable_code=True, disable_git=True, silent=True)
        self.run = wandb.init(project=tracking.wandb_project or tracking.experiment, entity=tracking.wandb_entity,
                              tags=list(tracking.wandb_tags) or None, name=cfg.run.name, id=run.state.get("run_id"),
                              group=run.options.get("group"),
                              resume="allow", mode=run.options.get("mode"), dir=str(run.run_dir),
                              config={**run.params, **{f"init.{k}": v for k, v in run.tags.items()}},
                              settings=settings, reinit="create_new")
        self.run_id = self.run.id

    def step(self, step: int, metrics: dict[str, Any]) -> None:
        self.run.log({k: v for k, v in metrics.items() if isinstance(v, (int, float))}, step=step)

    def state_dict(self) -> dict[str, Any]:
        return {"run_id": self.run_id} if hasattr(self, "run_id") else {}

    def summary(self) -> dict[str, Any]:
        return {"wandb_run_id": getattr(self, "run_id", None)}

    def close(self, status: str) -> None:
        self.run.finish(exit_code=0 if status == "completed" else 1)

    @classmethod
    def plan(cls, cfg) -> dict[str, Any]:
        return {"mode": cfg.tracking.wandb_mode or os.environ.get("WANDB_MODE") or None}

    @classmethod
    def open_sweep(cls, sweep: SweepInfo, saved: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        return {}, {"group": sweep.name}

    @classmethod
    def where(cls, cfg, summary: dict[str, Any]) -> str:
        mode = cls.plan(cfg)["mode"] or "online"
        folder = Path(cfg.run_dir) / "wandb"
        upload = f"  (upload: wandb sync {folder}/offline-run-*)" if mode == "offline" else ""
        return f"wandb       run {summary.get('wandb_run_id')} ({mode}) in {folder}{upload}"
