"""The loop's policies without a training: cadence, non-finite steps, stop requests, per-step seeds."""

import numpy as np
import pytest
import torch

from stride.trainers.policies import Cadence, NonFinitePolicy, StopRequest, clear_stop_request, request_stop, reseed, step_seed
from stride.errors import TrainingError


def test_cadence_logs_evaluates_and_checkpoints_on_schedule_and_at_the_end():
    c = Cadence(total_steps=25, log_every=5, eval_every=10, checkpoint_every=20, has_val=True)
    due = {s: c.due(s) for s in range(1, 26)}
    assert [s for s, d in due.items() if d.log] == [5, 10, 15, 20, 25]
    assert [s for s, d in due.items() if d.eval] == [10, 20, 25]  # and always at the end
    assert [s for s, d in due.items() if d.checkpoint] == [20, 25]  # and always at the end
    assert [s for s, d in due.items() if d.any] == [5, 10, 15, 20, 25]
    assert due[25].last and not due[20].last


def test_a_stop_checkpoints_and_logs_at_once_but_does_not_evaluate():
    c = Cadence(total_steps=100, log_every=50, eval_every=None, checkpoint_every=None, has_val=True)
    d = c.due(7, stopping=True)
    assert d.log and d.checkpoint and d.last and not d.eval
    assert not c.due(7).any


def test_no_validation_split_never_evaluates():
    c = Cadence(total_steps=10, log_every=1, eval_every=1, checkpoint_every=None, has_val=False)
    assert not any(c.due(s).eval for s in range(1, 11))


def test_nonfinite_skip_counts_steps_in_a_row_and_resets_on_a_good_one():
    p = NonFinitePolicy("skip", limit=3)
    assert p.observe(1, True, 0.5, 1.0) is None
    assert "step 2" in p.observe(2, False, float("nan"), float("nan")) and p.in_a_row == 1
    assert "2 in a row" in p.observe(3, False, float("inf"), 1.0)
    assert p.observe(4, True, 0.4, 1.0) is None and p.in_a_row == 0  # a good step resets the count
    p.observe(5, False, float("nan"), 1.0)
    p.observe(6, False, float("nan"), 1.0)
    with pytest.raises(TrainingError, match=r"non-finite .* at step 7 .*3 in a row.*optim.lr") as e:
        p.observe(7, False, float("nan"), 1.0)
    assert "\n" not in str(e.value)


def test_nonfinite_stop_ends_at_the_first():
    with pytest.raises(TrainingError, match=r"at step 1 .*1 in a row"):
        NonFinitePolicy("stop", limit=5).observe(1, False, float("nan"), float("nan"))


def test_stop_request_from_a_file_or_a_signal(tmp_path):
    stop = StopRequest(tmp_path, torch.device("cpu"), world_size=1)
    assert not stop.requested()
    request_stop(tmp_path, "preempted", 10)
    assert stop.requested() and stop.status() == "preempted" and stop.signal() == 10
    clear_stop_request(tmp_path)
    assert not stop.requested()
    stop.on_signal(15)
    assert stop.requested() and stop.status() == "interrupted" and stop.signal() == 15


def test_step_seeds_differ_by_rank_and_step_and_reseed_numpy_and_torch():
    seeds = {step_seed(0, r, s) for r in range(4) for s in range(50)}
    assert len(seeds) == 200 and step_seed(0, 1, 7) == step_seed(0, 1, 7) != step_seed(1, 1, 7)
    reseed(0, 1, 7)
    a = (np.random.rand(3), torch.rand(3))
    reseed(0, 1, 7)
    b = (np.random.rand(3), torch.rand(3))
    assert np.array_equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_stop_request_posted_by_the_driver_without_a_file(tmp_path):
    """A run on a bucket has no shared folder: the driver's request arrives by its channel (Ray), and counts as the
    file's does, with its status and signal."""
    posted = {"request": None}
    stop = StopRequest(tmp_path, torch.device("cpu"), world_size=1, posted=lambda: posted["request"])
    assert not stop.requested()
    posted["request"] = {"status": "interrupted", "signal": 15}
    assert not (tmp_path / ".stride-stop").exists()
    assert stop.requested() and stop.status() == "interrupted" and stop.signal() == 15


def test_garbage_collection_is_off_while_training_and_runs_every_n_steps(monkeypatch):
    """train.gc_every_steps: set-up's objects frozen, no automatic collection, a young-generation collection at the
    steps that are multiples of N (the same on every rank), and Python's collector as it was afterwards."""
    import gc

    from stride.trainers.policies import GarbageCollection

    assert gc.isenabled()
    collected = []
    real_collect = gc.collect
    monkeypatch.setattr(gc, "collect", lambda generation=2: collected.append(generation) or real_collect(generation))
    with GarbageCollection(3) as collector:
        assert not gc.isenabled() and gc.get_freeze_count() > 0
        collected.clear()  # set-up's full collection, before freezing
        for step in range(1, 8):
            collector.step(step)
        assert collected == [1, 1]  # steps 3 and 6
    assert gc.isenabled() and gc.get_freeze_count() == 0

    collected.clear()
    with GarbageCollection(0) as collector:  # 0: Python's own collection, untouched
        assert gc.isenabled() and gc.get_freeze_count() == 0
        collector.step(50)
    assert collected == [] and gc.isenabled()


def test_ddp_options_are_bucket_views_and_broadcast_only_buffers_that_exist():
    from stride.trainers.step import ddp_options

    assert ddp_options(torch.nn.Linear(2, 2)) == {"gradient_as_bucket_view": True, "broadcast_buffers": False}
    assert ddp_options(torch.nn.BatchNorm1d(2)) == {"gradient_as_bucket_view": True, "broadcast_buffers": True}


def _paces(*own):
    from stride.trainers.policies import RankPace

    return [RankPace(data_wait_s=d, forward_s=f) for d, f in own]


def test_a_rank_that_stays_slowest_is_named_once_after_three_intervals_with_what_is_slow():
    from stride.trainers.policies import Stragglers

    s, nodes = Stragglers(1.3), ["node-a", "node-a", "node-b"]
    slow_compute = _paces((0.01, 0.10), (0.01, 0.10), (0.01, 0.30))
    assert s.observe(slow_compute, nodes) == (pytest.approx(0.31 / 0.11), None)
    assert s.observe(slow_compute, nodes)[1] is None
    ratio, warning = s.observe(slow_compute, nodes)  # the third interval in a row above 1.3
    assert "rank 2 on node node-b" in warning and "its compute" in warning and "2.82" in warning, warning
    assert s.observe(slow_compute, nodes)[1] is None  # said once
    assert s.observe(_paces((0.01, 0.1), (0.01, 0.1), (0.01, 0.1)), nodes) == (1.0, None)  # back under: reset
    slow_data = _paces((0.5, 0.1), (0.01, 0.1), (0.01, 0.1))
    warnings = [s.observe(slow_data, nodes)[1] for _ in range(3)]
    assert warnings[:2] == [None, None] and "rank 0 on node node-a" in warnings[2] and "its data" in warnings[2]


def test_a_ratio_under_the_threshold_or_a_one_rank_gang_never_warns():
    from stride.trainers.policies import Stragglers

    s = Stragglers(1.3)
    assert all(s.observe(_paces((0.01, 0.1), (0.01, 0.12)), ["a", "b"])[1] is None for _ in range(5))
    assert all(s.observe(_paces((0.01, 0.1)), ["a"]) == (1.0, None) for _ in range(5))
