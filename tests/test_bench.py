"""`make bench` (benchmarks/run.py) in its tiny smoke mode: every figure comes out as a finite number beside its goal
and pass/fail, with a dated copy of the JSON. Results go to a temporary folder, never benchmarks/results/.
No timing is asserted: the machine is shared and the figures are what they are."""

from __future__ import annotations

import json
import math
import re
import runpy
import sys

import pytest

from conftest import REPO, run_cli

GOALS = {"step_time_ratio": "<= 1.02", "wall_ratio": "<= 1.5", "ingest_ratio": ">= 1",
         "data_wait_fraction": "< 0.02", "ckpt_blocked_fraction": "<= 0.2",
         "memory_growth_ratio": "<= 0.35"}


def load_script(path: str) -> dict:
    """A benchmark script's namespace, run by path (benchmarks/ is no package, and the repository root is not on the
    tests' sys.path). The script puts the root on sys.path to import Stride from the checkout: undone here, so the
    repository's datasets/ never hides Hugging Face `datasets` in later tests."""
    saved = list(sys.path)
    try:
        return runpy.run_path(str(REPO / path), run_name=path.rsplit("/", 1)[-1].removesuffix(".py"))
    finally:
        sys.path[:] = saved


def finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


@pytest.mark.slow
def test_bench_smoke_writes_every_figure_with_its_goal(tmp_path):
    out = tmp_path / "results"
    # A few minutes on an idle 2-core machine; far longer when the suite runs beside it, hence the wide limit.
    r = run_cli(["benchmarks/run.py", "--smoke", "--out", str(out)], timeout=2400)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]

    latest = json.loads((out / "latest.json").read_text())
    dated = [p for p in out.glob("*.json") if p.name != "latest.json"]
    assert len(dated) == 1 and re.fullmatch(r"\d{4}-\d\d-\d\dT\d{4}\.json", dated[0].name), dated
    assert json.loads(dated[0].read_text()) == latest

    figs = latest["figures"]
    for name, goal in GOALS.items():
        f = figs[name]
        assert finite(f["value"]), (name, f["value"])
        assert f["goal"] == goal
        assert isinstance(f["pass"], bool)
        assert f["min"] <= f["value"] <= f["max"] and f["n"] >= 1
    assert finite(figs["scaling_2_over_1"]["value"]) and figs["scaling_2_over_1"]["goal"] is None
    for runtime in ("stride", "torchrun"):
        assert finite(figs["time_to_first_step_s"][runtime]["value"]) and figs["time_to_first_step_s"][runtime]["value"] > 0

    assert latest["mode"] == "smoke"
    assert latest["machine"]["cpu_count"] >= 1
    assert len(latest["loadavg_start"]) == 3 and len(latest["loadavg_end"]) == 3
    # The table printed for humans names every figure.
    for name in [*GOALS, "scaling_2_over_1", "time_to_first_step_s"]:
        assert name in r.stdout


def test_step_gap_sorts_py_spy_stacks_into_gil_and_collective_waits(tmp_path):
    """benchmarks/step_gap.py's reading of py-spy's raw stacks (the README's GIL-wait figure comes from it)."""
    classify = load_script("benchmarks/step_gap.py")["classify"]

    train = "thread (1): TrainingThread;run (trainers/loop.py:400);train_step (trainers/step.py:120)"
    raw = tmp_path / "spy.txt"
    raw.write_text("\n".join([
        f"{train};Linear.forward (torch/nn/modules/linear.py:134);mkl_sgemm (libtorch_cpu.so) 6",
        f"{train};Linear.forward (torch/nn/modules/linear.py:134);pybind11::gil_scoped_release::~gil_scoped_release "
        f"(libtorch_python.so);pthread_cond_timedwait (libc.so.6);0x7f00 (libc.so.6) 2",
        f"{train};all_reduce (torch/distributed/distributed_c10d.py:3252);pthread_cond_wait (libc.so.6);0x7f01 "
        f"(libc.so.6) 2",
        "thread (2): MainThread;main_loop (ray/_private/worker.py:1069);epoll_wait (libc.so.6) 50",
        "thread (2): MainThread;RayTrainWorker.poll_status (ray/train/v2/worker.py:10);Pickler.dump (cloudpickle.py:1) 3",
    ]) + "\n")
    got = classify(raw)
    assert got["training_thread_samples"] == 10
    assert (got["running_or_runnable"], got["gil_wait"], got["cond_wait"]) == (0.6, 0.2, 0.2)
    assert got["other_threads_busy_samples"] == {"Pickler.dump": 3}
