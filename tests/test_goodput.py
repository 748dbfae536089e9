"""Goodput (issue 46, point 7): where the wall time since a run first started went. A run of 10 steps, a pause of
3 s, then the same run resumed to 20 (one process each, torchrun's launcher): summary.json's goodput and
badput/<cause> add up to the wall time since the first start, the pause is a restart's, and that wall time is the
test's own clock's, less the interpreters' start-up before the first Trainer existed."""

from __future__ import annotations

import json
import time

import pytest

from runs import launch, tiny
from stride.trainers.telemetry import Goodput


def test_the_parts_of_one_attempt_and_of_a_resumed_one_sum_to_the_wall_time():
    g = Goodput(attempt_start=time.time() - 10)  # started 10 s ago, first step 4 s ago
    g.first_step = time.time() - 4
    g.waited_for("data_wait", 1.0)
    g.waited_for("checkpoint", 0.5)
    parts = g.parts()
    assert parts["startup"] == pytest.approx(6, abs=0.1) and parts["productive"] == pytest.approx(2.5, abs=0.1)
    saved = g.state()
    later = Goodput(attempt_start=saved["at"] + 30)  # resumed 30 s after that checkpoint
    later.resume(saved)
    later.first_step = later.attempt_start + 2
    parts = later.parts(now=later.attempt_start + 5)
    assert parts["restarts"] == pytest.approx(30) and parts["startup"] == pytest.approx(6 + 2, abs=0.1)
    assert sum(parts.values()) == pytest.approx(later.attempt_start + 5 - g.first_start, rel=1e-9)


@pytest.mark.slow
def test_a_resumed_runs_goodput_and_badput_add_up_to_the_wall_time_since_its_first_start(tmp_path, tabular_data):
    t0 = time.time()
    for steps in (10, 20):
        r = launch.forked(tiny(tmp_path, tabular_data, steps, "checkpoint.every_steps=5", "train.log_every_steps=5",
                               "train.eval_every_steps=5"))
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        time.sleep(3) if steps == 10 else None
    outside = time.time() - t0
    s = json.loads((tmp_path / "r" / "summary.json").read_text())
    badput = {k: v for k, v in s.items() if k.startswith("badput/")}
    assert set(badput) == {f"badput/{c}" for c in ("restarts", "startup", "data_wait", "evaluation", "checkpoint")}
    assert s["productive_s"] + sum(badput.values()) == pytest.approx(s["goodput_wall_s"], rel=0.01)
    assert 0 < s["goodput"] == pytest.approx(s["productive_s"] / s["goodput_wall_s"])
    assert badput["badput/restarts"] >= 3  # the pause, and the second process's start before its Trainer
    assert all(v > 0 for v in badput.values()), badput
    assert outside - 20 < s["goodput_wall_s"] <= outside  # less only the first interpreter's start-up
    metrics = [json.loads(x) for x in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines() if x]
    assert all(0 < x["goodput"] < 1 for x in metrics if "train_loss" in x)
