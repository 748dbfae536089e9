"""train.spike (issue 46, point 2, warn and skip): a task whose 15th training loss is 1000 times the others is
named at the next log step and counted in summary.json; with skip its update is dropped. One process (torchrun's
launcher, forked); the judgement itself is tests/test_host_reads.py's, the Ray path tests/test_train_ray.py's."""

from __future__ import annotations

import json

import pytest

from conftest import REPO
from runs import launch, tiny

SPIKY_TASK = '''
from stride.trainers.tasks.mlp import MLPTask


class SpikyTask(MLPTask):
    """The tabular MLP, whose 15th training loss is 1000 times what it is."""

    calls = 0

    def loss(self, model, batch):
        SpikyTask.calls += model.training
        out = super().loss(model, batch)
        return out * 1000 if model.training and SpikyTask.calls == 15 else out
'''


@pytest.mark.slow
@pytest.mark.parametrize("action", ["warn", "skip"])
def test_a_loss_spike_is_named_counted_and_with_skip_not_trained_on(action, tmp_path, tabular_data):
    (tmp_path / "spiky_task.py").write_text(SPIKY_TASK)
    args = tiny(tmp_path / "runs", tabular_data, 20, "model.name=spiky_task:SpikyTask", "train.log_every_steps=5",
                "train.eval_every_steps=null", "checkpoint.every_steps=20",
                f"train.spike={{metric: train_loss, window: 50, factor: 3.0, action: {action}}}",
                config=str(REPO / "trainers" / "configs" / "tabular_mlp.yaml"))
    r = launch.forked(args, cwd=tmp_path, entry=(str(REPO / "trainers" / "torchrun.py"),))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    named = [line for line in (r.stdout + r.stderr).splitlines() if "spike at step" in line]
    assert len(named) == 1 and "spike at step 15: train_loss" in named[0], named
    assert named[0].endswith("its update skipped" if action == "skip" else "trained on")
    s = json.loads((tmp_path / "runs" / "r" / "summary.json").read_text())
    assert s["status"] == "completed" and s["spikes"] == 1 and s["spike_steps"] == [15]
    assert s["spikes_skipped"] == (action == "skip")


def test_skip_under_fp16_is_refused_with_its_fix():
    from stride.errors import ConfigError
    from stride.trainers.config_reader import load_config

    with pytest.raises(ConfigError) as e:
        load_config("trainers/configs/tabular_mlp.yaml", ["train.precision=fp16", "train.spike={action: skip}"])
    assert "train.spike.action (skip) cannot veto a step under train.precision=fp16" in str(e.value)
    assert "train.precision=bf16" in str(e.value)
