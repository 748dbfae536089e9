"""What a callback is (`Callback`, public as `stride.Callback`: every hook optional) and what its hooks see
(`CallbackState`). The built-in callbacks of this package and a user's own subclass these; the package itself
(trainers/callbacks/__init__.py) builds, orders and drives them."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, ContextManager

import torch


class Callback:
    """Base class of a callback. Every hook is optional and runs on every rank, in the order the callbacks were
    given (train.callbacks first, then the task's). An exception in a hook ends the run (exit 1) with one line
    naming the callback and the hook; the checkpoints written before it stay as they are."""

    def on_fit_start(self, state: "CallbackState") -> None:
        """Before the first step of this attempt (after a resume: the checkpoint and this callback's state are
        restored)."""

    def on_step_end(self, state: "CallbackState", metrics: dict[str, Any]) -> None:
        """After every optimizer step. `metrics` holds step, epoch and samples_seen, and on a log step the training
        figures (train_loss, lr, ...; averaged over ranks), on an evaluation step the validation ones too."""

    def on_eval_end(self, state: "CallbackState", metrics: dict[str, float]) -> None:
        """After an evaluation: val_loss and the task's val_<metric> (reduced across ranks: equal on every rank)."""

    def on_checkpoint(self, state: "CallbackState") -> None:
        """After a checkpoint is staged (its files are written in the background)."""

    def on_fit_end(self, state: "CallbackState", summary: dict[str, Any]) -> None:
        """After the last step of this attempt; `summary` is rank 0's (other ranks: status and stop_signal)."""

    def on_optimizer_step(self, state: "CallbackState") -> None:
        """Right after every optimizer step (state.step counts it), before the step is logged, evaluated or
        checkpointed and before on_step_end: where an average of the weights is updated."""

    def evaluation_weights(self, state: "CallbackState") -> dict[str, Callable[[], ContextManager]]:
        """Weights of this callback's to evaluate, at every evaluation: suffix -> a context manager factory that puts
        them into the model for the forwards and puts the trained weights back afterwards. The figures of each are
        reported as val_<name><suffix>; the suffix "" replaces the trained weights' own evaluation."""
        return {}

    def on_checkpoint_complete(self, state: "CallbackState", folder: Path) -> None:
        """Rank 0 only, once the checkpoint in `folder` is complete (every rank's files in, meta.json written),
        from the checkpoint writer's background thread: file work only, no collective, no change to the model."""

    def summary_fields(self, state: "CallbackState") -> dict[str, Any]:
        """Rank 0, at the end of each attempt: fields this callback adds to summary.json (JSON values)."""
        return {}

    def state_dict(self) -> dict[str, Any]:
        """This callback's state, as JSON values: rank 0's is saved in every checkpoint."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """On resume, on every rank, before on_fit_start."""

    # Where state_tensors go in the checkpoint's DCP state: None, under "callbacks.<module>:<Class>" (a user's);
    # a built-in keeps the name its tensors always had (train.ema's: "ema").
    tensors_key: str | None = None

    def state_tensors(self, state: "CallbackState") -> dict[str, torch.Tensor]:
        """This rank's tensors to keep in every checkpoint beside the model (DCP): name -> tensor. A DTensor (a
        parameter's shard under FSDP) is saved shard by shard and resharded on resume at any world size; a plain
        tensor must be the same on every rank (DCP saves one copy). Called before each checkpoint, and on resume,
        before on_fit_start, for the tensors to fill in place (the same names, shapes and dtypes)."""
        return {}

    def load_state_tensors(self, state: "CallbackState", tensors: dict[str, torch.Tensor]) -> None:
        """On resume, on every rank, once the checkpoint's tensors are in those state_tensors returned (in place;
        `tensors` is that dict). Not called when the checkpoint holds none of them (written before this callback)."""



class CallbackState:
    """What a hook sees of the run. Counters are read-only; the model and the optimizer are the live ones (the
    model unwrapped: under FSDP its parameters are this rank's shards)."""

    def __init__(self, trainer):
        self._trainer = trainer

    @property
    def step(self) -> int:
        return self._trainer.state.step

    @property
    def epoch(self) -> int:
        return self._trainer.stream.position(self._trainer.state.micro_step)[0]

    @property
    def samples_seen(self) -> int:
        return self._trainer.state.samples_seen

    @property
    def total_steps(self) -> int:
        return self._trainer.total_steps

    @property
    def rank(self) -> int:
        return self._trainer.env.world_rank

    @property
    def world_size(self) -> int:
        return self._trainer.env.world_size

    @property
    def run_dir(self):
        return self._trainer.run_dir

    @property
    def remote(self):
        """The run's bucket side (trainers/run/remote.py: RunRemote), or None for a run in a folder."""
        return self._trainer.remote

    @property
    def config(self):
        return self._trainer.cfg

    @property
    def model(self) -> torch.nn.Module:
        return self._trainer.raw_model

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self._trainer.optimizer

    def request_stop(self, status: str = "stopped") -> None:
        """End the run after this step, with a checkpoint: every rank agrees at the step boundary (a request on any
        rank stops all). `status` goes to summary.json; a rerun of the same command does not train further."""
        self._trainer.stop.request(status)
