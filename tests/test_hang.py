"""The hang watchdog (trainers/hang.py, issue 46 point 3): first alone in this process (a main thread that stops
inside a step), then on the shared Ray head: rank 1 sleeps in its forward at step 6, so rank 0 waits for it in the
backward's all-reduce; within train.hang_timeout_s both ranks' stacks are on disk (rank 1's naming the sleeping
frame), one line names rank 1 as the rank that did not arrive, the attempt ends, Ray restarts the gang from the
checkpoint of step 4 (scaling.max_failures) and the run completes."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import pytest

from conftest import REPO
from runs import launch, tiny
from stride.trainers import hang
from stride.trainers.hang import HangWatchdog


def watch(tmp_path, timeout_s, **kw):
    ended = threading.Event()
    dog = HangWatchdog(tmp_path, rank=3, node="node-x", timeout_s=timeout_s, nccl=False,
                       end=lambda code: ended.set(), poll_s=0.05, **kw)
    return dog.start(), ended


def stuck_in_the_task(seconds):  # a step's frame outside torch, as a task's loss that never returns would be
    time.sleep(seconds)


def test_a_step_that_does_not_finish_leaves_every_threads_stack_and_a_line_naming_where(tmp_path, capsys):
    dog, ended = watch(tmp_path, 0.3)
    dog.beat(7)
    stuck_in_the_task(1.0)
    assert ended.wait(5)
    stacks = (tmp_path / "diagnostics" / "hang-00000007" / "rank3.txt").read_text()
    assert "stuck_in_the_task" in stacks and stacks.count("hread 0x") >= 2  # every thread: the main one and this
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith("stride: hang: rank 3 on node node-x did not arrive at step 7's collective within 0.3 s")
    assert "in stuck_in_the_task" in line and str(tmp_path / "diagnostics" / "hang-00000007") in line


def test_a_rank_waiting_inside_torch_says_it_waited(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(hang, "TORCH_DIR", str(Path(__file__).parent) + os.sep)  # this file plays torch's part
    dog, ended = watch(tmp_path, 0.3)
    dog.beat(2)
    stuck_in_the_task(1.0)
    assert ended.wait(5)
    assert "rank 3 on node node-x waited inside torch (a collective)" in capsys.readouterr().err


def test_steps_that_finish_evaluation_and_a_first_step_never_fire(tmp_path):
    dog, ended = watch(tmp_path, 0.3)
    for step in range(1, 6):  # steps of 0.1 s
        dog.beat(step)
        time.sleep(0.1)
    with dog.paused():  # an evaluation longer than the timeout
        time.sleep(0.6)
    dog.beat(6)
    dog.close()
    assert not ended.is_set() and not (tmp_path / "diagnostics").exists()
    auto = HangWatchdog(tmp_path, 0, "n", None, nccl=False)
    auto.beat(1)
    assert auto.timeout() is None  # nothing finished yet: a first step may compile for minutes
    auto.recent.extend([20.0, 10.0, 30.0])
    assert auto.timeout() == 50 * 20.0
    auto.recent.clear()
    auto.recent.append(0.1)
    assert auto.timeout() == hang.MIN_AUTO_TIMEOUT_S


@pytest.mark.parametrize("mode", ["observe", "fail"])
def test_scaling_hang_detector_turns_on_rays_nccl_detector_in_the_drivers_environment(mode, monkeypatch):
    from stride.trainers.launch.ray import hang_detector_for

    for key in ("RAY_TRAIN_ENABLE_NCCL_HANG_DETECTOR", "RAY_TRAIN_NCCL_RAS_ACTION"):
        monkeypatch.delenv(key, raising=False)
    hang_detector_for("off")
    assert "RAY_TRAIN_ENABLE_NCCL_HANG_DETECTOR" not in os.environ
    hang_detector_for(mode)
    assert os.environ["RAY_TRAIN_ENABLE_NCCL_HANG_DETECTOR"] == "1" and os.environ["RAY_TRAIN_NCCL_RAS_ACTION"] == mode


SLEEPY_TASK = '''
import os
import time
from pathlib import Path

from stride.trainers.tasks.mlp import MLPTask

MARK = Path(__file__).with_name("slept")


class SleepyTask(MLPTask):
    """The tabular MLP; rank 1 sleeps in its 6th forward, the first time only (MARK)."""

    calls = 0

    def loss(self, model, batch):
        SleepyTask.calls += model.training  # training forwards only: evaluation calls this too
        if model.training and SleepyTask.calls == 6 and os.environ.get("RANK") == "1" and not MARK.exists():
            MARK.write_text("")
            time.sleep(600)
        return super().loss(model, batch)
'''


@pytest.mark.slow
def test_on_ray_a_rank_asleep_is_named_its_stacks_kept_and_the_restarted_gang_completes(ray_cluster, tmp_path,
                                                                                       tabular_data):
    (tmp_path / "sleepy_task.py").write_text(SLEEPY_TASK)
    args = tiny(tmp_path / "runs", tabular_data, 10, "model.name=sleepy_task:SleepyTask", "train.hang_timeout_s=8",
                "train.log_every_steps=2", "train.eval_every_steps=null", "checkpoint.every_steps=4",
                "scaling.max_failures=1", "scaling.num_workers=2", "scaling.cpus_per_worker=0.5",
                "tracking.mlflow=false", config=str(REPO / "trainers" / "configs" / "tabular_mlp.yaml"))
    t0 = time.time()
    r = launch.ray(args, ray_cluster, cwd=tmp_path, timeout=400)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    assert time.time() - t0 < 300  # the hang cost its timeout and a restart, not the 600 s sleep
    run = tmp_path / "runs" / "r"
    folder = run / "diagnostics" / "hang-00000006"
    assert "in loss" in (folder / "rank1.txt").read_text() and "sleepy_task.py" in (folder / "rank1.txt").read_text()
    assert (folder / "rank0.txt").read_text().strip()  # the waiting rank's stacks too
    named = [line for line in out.splitlines() if "did not arrive" in line]
    assert len(named) == 1 and "rank 1 on node" in named[0] and "step 6" in named[0], out[-4000:]
    s = json.loads((run / "summary.json").read_text())
    assert s["status"] == "completed" and s["global_step"] == 10 and s["restarts"] == 1
