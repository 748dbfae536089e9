"""`make bench`'s harness without the benchmark: benchmarks/results/latest.json's raw runs replayed through
benchmarks/figures.py (the code that computes every figure, verdict and table), in milliseconds. No Ray, no torchrun,
nothing written: the measuring itself is `make bench`, outside the test suite."""

from __future__ import annotations

import importlib.util
import json
import math
import statistics

import pytest

from conftest import REPO

LATEST = REPO / "benchmarks" / "results" / "latest.json"


@pytest.fixture(scope="module")
def F():
    """benchmarks/figures.py, loaded by path (benchmarks/ is no package and the repository root is not on the tests'
    sys.path); it imports the standard library only."""
    spec = importlib.util.spec_from_file_location("bench_figures", REPO / "benchmarks" / "figures.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def latest() -> dict:
    return json.loads(LATEST.read_text())


def test_replaying_latest_json_gives_the_figures_verdicts_and_table_it_stored(F, latest):
    replayed = F.replay(latest["raw"])
    assert list(replayed["figures"]) == list(F.ORDER)
    for name in F.ORDER:  # one figure at a time, so that a failure names it
        assert replayed["figures"][name] == latest["figures"][name], name
        assert replayed["goals"][name] == latest["goals"][name], name
    assert replayed["table"] == latest["table"]


def test_every_figure_is_in_latest_json_with_its_goal_median_spread_and_rule_applied(F, latest):
    figs, verdicts, table = latest["figures"], latest["goals"], latest["table"].splitlines()
    assert set(F.GOALS) < set(F.ORDER) and len(F.GOALS) == 15
    for name in F.ORDER:
        f, v = figs[name], verdicts[name]
        counted = [x for x in f["samples"] if F.finite(x)]
        assert f["n"] == len(counted), name
        if counted:
            assert f["min"] <= f["median"] <= f["max"], name
            assert f["median"] == statistics.median(counted), name
        else:
            assert f["median"] is None and f["notes"], name  # a figure with no sample says why
        goal = F.GOALS.get(name)
        assert v["goal"] == (f"{goal[0]} {goal[1]:g}" if goal else None), name
        if goal and f["n"] >= F.MIN_SAMPLES and not f["lower_bound"]:
            assert v["pass"] is F.met(f["median"], *goal), name
        elif not f["lower_bound"]:
            assert v["pass"] is None, name  # too few samples, or no goal: never a pass
        # the table prints the median beside its spread and n
        (row,) = [r for r in table if r.split("  ")[0] == name]
        assert F.fmt(f["median"], f["unit"]) in row and F.spread(f) in row and f" {f['n']} " in row, row


def test_fewer_than_five_samples_give_no_verdict_and_five_do(F):
    goal = F.GOALS["ingest_ratio"]  # >= 1
    for samples, expected in (([1.2] * 4, None), ([1.2, 1.3, None, 1.1, 1.4], None), ([1.2] * 5, True),
                              ([0.9, 0.8, 1.2, 0.95, 1.5], False)):
        v = F.verdict(F.figure(samples, "ratio", ""), goal)
        assert v["pass"] is expected, (samples, v)
    assert F.verdict(F.figure([1.2] * 4, "ratio", ""), goal)["verdict"] == "no verdict (n=4 < 5)"


def memory_raw(reps: list[tuple[int | None, int | None, bool]]) -> dict:
    """A memory benchmark's raw runs: per repetition, (small peak, large peak, large run aborted); None: the small
    run was stopped."""
    out = []
    for i, (small, large, aborted) in enumerate(reps):
        stopped = "over the limit"
        out.append({"rep": i, "small": {"peak_pss_bytes": small or 0, "aborted": stopped if small is None else None},
                    "large": {"peak_pss_bytes": large, "aborted": stopped if aborted else None}})
    return {"memory": {"sets": {"small": {"raw_bytes": 50}, "large": {"raw_bytes": 1000}}, "reps": out}}


def test_a_lower_bound_memory_figure_within_its_goal_is_no_pass_and_one_over_it_fails(F):
    goal = F.GOALS["memory_growth_ratio"]  # <= 0.35
    under = F.memory_figure(memory_raw([(100, 300, i == 2) for i in range(5)]))  # 0.2 each, one stopped early
    assert under["median"] == pytest.approx(0.2) and under["lower_bound"] and under["lower_bound_reps"] == [2]
    assert F.verdict(under, goal) == {"goal": "<= 0.35", "pass": None,
                                      "verdict": "no verdict (a lower bound within the goal)"}
    over = F.memory_figure(memory_raw([(100, 600, True)] * 5))  # 0.5, at least
    assert F.verdict(over, goal)["pass"] is False
    clean = F.memory_figure(memory_raw([(100, 300, False)] * 5))
    assert not clean["lower_bound"] and F.verdict(clean, goal)["pass"] is True
    no_small = F.memory_figure(memory_raw([(None, 300, False)] + [(100, 300, False)] * 4))
    assert no_small["samples"][0] is None and no_small["n"] == 4 and F.verdict(no_small, goal)["pass"] is None


def test_scaling_compares_only_fits_taken_side_by_side(F):
    def fit(workers, rep, sps):
        lines = [{"step": s, "train_loss": 1.0, "samples_per_second": sps} for s in (5, 10, 15)]
        return {"workers": workers, "rep": rep, "metrics": lines}

    settings = {"scale_warmup_steps": 5}
    alone = F.scaling_figure({"settings": settings, "scaling": [fit(1, r, 100.0) for r in range(5)]})
    assert alone["n"] == 0 and "not measured side by side" in alone["notes"][0]
    both = F.scaling_figure({"settings": settings, "scaling": [fit(w, r, 100.0 * w * (0.9 if w == 2 else 1))
                                                               for r in range(5) for w in (1, 2)]})
    assert both["n"] == 5 and both["median"] == pytest.approx(1.8) and not both["notes"]


def test_ingest_says_when_pyarrow_had_fewer_threads_than_the_stream(F, latest):
    raw = json.loads(json.dumps(latest["raw"]))
    raw["ingest"]["threads"].update(pyarrow=2, stream_read_threads=2)
    assert F.ingest_figure(raw)["notes"] == []
    raw["ingest"]["threads"].update(pyarrow=1)
    note = F.ingest_figure(raw)["notes"][0]
    assert "pyarrow read on 1 thread" in note and "2 read threads" in note
    # ... and the note is printed beside the table and the README's figure
    figs = F.figures(raw)
    assert f"* ingest_ratio: {note}" in F.table(figs, F.goals(figs)).splitlines()


def test_the_readmes_quote_latest_json(F, latest):
    """The results block of benchmarks/README.md and the figures README.md's Performance section quotes are
    generated from latest.json (`python benchmarks/run.py --render` rewrites them after a `make bench`)."""
    for rel, (name, make) in F.BLOCKS.items():
        text = (REPO / rel).read_text()
        assert F.block(text, name) == make(latest), f"{rel} is stale: run `python benchmarks/run.py --render`"


def test_blocks_are_replaced_between_their_markers_only(F):
    start, end = F.block_markers("x")
    text = f"before\n{start}\nold\n{end}\nafter {start[:4]}\n"
    new = F.with_block(text, "x", "new\nlines")
    assert new == f"before\n{start}\nnew\nlines\n{end}\nafter {start[:4]}\n" and F.block(new, "x") == "new\nlines"
    assert F.block("no markers", "x") is None


def test_latest_json_holds_no_not_a_number(latest):
    """None marks a missing value: NaN is not JSON, and NaN != NaN would make the replay never equal."""
    def walk(x):
        if isinstance(x, float):
            assert math.isfinite(x)
        elif isinstance(x, dict):
            for v in x.values():
                walk(v)
        elif isinstance(x, list):
            for v in x:
                walk(v)
    walk(latest)
