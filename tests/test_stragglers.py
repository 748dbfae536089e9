"""Stragglers (issue 46, point 4): a rank whose forward is slowed by a sleep is named in one warning, with its node
and "its compute", after 3 log intervals above train.straggler_warn_ratio; straggler_ratio is in every log line.
torchrun with 2 CPU ranks: the check is the loop's (one all-reduce at each log step), the same on Ray."""

from __future__ import annotations

import json
import socket

import pytest

from conftest import REPO
from runs import launch, tiny

SLOW_TASK = '''
import os
import time

from stride.trainers.tasks.mlp import MLPTask


class SlowRankTask(MLPTask):
    """The tabular MLP, with rank 1's forward 50 ms slower."""

    def loss(self, model, batch):
        if os.environ.get("RANK") == "1":
            time.sleep(0.05)
        return super().loss(model, batch)
'''


@pytest.mark.slow
def test_a_rank_slowed_by_a_sleep_is_named_with_its_node_and_its_compute(tmp_path, tabular_data):
    (tmp_path / "slow_task.py").write_text(SLOW_TASK)
    args = tiny(tmp_path / "runs", tabular_data, 12, "model.name=slow_task:SlowRankTask", "train.log_every_steps=2",
                "train.eval_every_steps=null", "checkpoint.every_steps=12", "scaling.cpus_per_worker=1",
                config=str(REPO / "trainers" / "configs" / "tabular_mlp.yaml"))
    r = launch.torchrun(args, nproc=2, cwd=tmp_path, entry=(str(REPO / "trainers" / "torchrun.py"),))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    out = r.stdout + r.stderr
    warned = [line for line in out.splitlines() if "has been the slowest" in line]
    assert len(warned) == 1, out[-3000:]
    assert f"rank 1 on node {socket.gethostname()}" in warned[0] and "its compute" in warned[0], warned
    lines = [json.loads(x) for x in (tmp_path / "runs" / "r" / "metrics.jsonl").read_text().splitlines() if x]
    ratios = [x["straggler_ratio"] for x in lines if "train_loss" in x]
    assert len(ratios) == 6 and all(ratio > 1.5 for ratio in ratios[1:]), ratios  # the first holds start-up's reads
