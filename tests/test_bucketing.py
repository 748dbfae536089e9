"""Length bucketing (datasets/bucketing.py, data.length_column) and the window's bound in bytes: rows of similar
length in each micro-batch, each row once per epoch at any world size, exact on resume, padding cut to a third or
less on log-uniform lengths; a bad length column is one DataError naming it."""

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from runs import OVERLAY
from stride.datasets.bucketing import Padding, bucket
from stride.datasets.mixing import order_for
from stride.datasets.splits import DataSpec, check_length_column, open_split
from stride.errors import DataError
from stride.datasets.stream import TrainStream

ROWS, G = 3000, 24


@pytest.fixture(scope="module")
def lengths_split(tmp_path_factory):
    """Rows whose lengths are log-uniform over 10..1000, in files of row groups of 100."""
    folder = tmp_path_factory.mktemp("lengths")
    rng = np.random.default_rng(0)
    length = np.exp(rng.uniform(np.log(10), np.log(1000), ROWS)).astype(np.int64)
    for i in range(3):
        lo, hi = i * ROWS // 3, (i + 1) * ROWS // 3
        pq.write_table(pa.table({"x": np.arange(lo, hi, dtype=np.float32), "length": length[lo:hi]}),
                       folder / f"part-{i}.parquet", row_group_size=100)

    class Data:
        train_path = str(folder)

    return open_split(Data, "train"), length


def spec_of(split, length_column="length", columns=("x",)):
    return DataSpec(columns, False, split.num_rows, split.layouts, split.blocks, "train",
                    schema=pa.schema([split.schema.field(c) for c in (*columns, "length")]),
                    length_column=length_column)


def stream(spec, world_size, start, steps, window=600):
    order = order_for(spec, 5, G, window)
    streams = [TrainStream(spec, order, r, world_size, start, 2, start + steps) for r in range(world_size)]
    try:
        batches = [[s.next() for s in streams] for _ in range(steps)]
    finally:
        for s in streams:
            s.close()
    return order, batches, streams


def test_bucket_keeps_every_row_and_groups_similar_lengths():
    rng = np.random.default_rng(1)
    lengths = rng.integers(1, 100, 100).astype(float)
    perm = rng.permutation(100)
    out = bucket(perm, lengths, 10, 0, 0, 0)
    assert sorted(out.tolist()) == list(range(100))
    groups = lengths[out].reshape(10, 10)
    assert all(g.max() <= h.min() or h.max() <= g.min() for i, g in enumerate(groups) for h in groups[i + 1:])
    assert not np.array_equal(np.sort(groups[:, 0]), groups[:, 0])  # the groups' order is shuffled (seeded)
    assert np.array_equal(out, bucket(perm, lengths, 10, 0, 0, 0))
    assert not np.array_equal(out, bucket(perm, lengths, 10, 1, 0, 0))


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_each_row_once_per_epoch_at_any_world_size_in_the_same_batches(lengths_split, world_size):
    split, _ = lengths_split
    spec = spec_of(split)
    order, one, _ = stream(spec, 1, 0, ROWS // G)
    _, many, _ = stream(spec, world_size, 0, ROWS // G)
    ids = np.concatenate([np.concatenate([p.sample_id for p in parts]) for parts in many])
    assert len(np.unique(ids)) == len(ids) == order.micro_steps_per_epoch * G
    for a, b in zip(one, many):  # the same global batches, whatever the world size
        assert np.array_equal(a[0].sample_id, np.concatenate([p.sample_id for p in b]))
        assert "length" not in b[0].data  # the task does not read it: dropped after use


def test_a_resume_continues_the_bucketed_order_exactly(lengths_split):
    spec = spec_of(lengths_split[0])
    _, whole, _ = stream(spec, 2, 0, 100)
    _, resumed, _ = stream(spec, 2, 61, 39)
    for a, b in zip(whole[61:], resumed):
        assert all(np.array_equal(x.sample_id, y.sample_id) for x, y in zip(a, b))


def test_bucketing_cuts_padding_to_a_third_or_less(lengths_split):
    """bucketing_padding_ratio's check: log-uniform lengths over 10..1000, padding fraction with over without."""
    split, length = lengths_split
    fractions = []
    for column in ("length", None):
        spec = spec_of(split, column)
        _, batches, _ = stream(spec, 1, 0, ROWS // G)
        padding = Padding()
        for (rows,) in batches:
            padding.add(length[rows.sample_id].astype(float))
        fractions.append(padding.take())
    with_buckets, without = fractions
    assert without > 0.5 and with_buckets / without <= 0.33, fractions


def test_the_stream_reports_its_own_padding(lengths_split):
    split, length = lengths_split
    _, batches, streams = stream(spec_of(split), 1, 0, 20)
    expect = Padding()
    for (rows,) in batches:
        expect.add(length[rows.sample_id].astype(float))
    assert streams[0].padding.take() == pytest.approx(expect.take())


def test_the_window_is_bounded_in_bytes_by_the_datas_mean_row_size(lengths_split):
    split, _ = lengths_split
    spec = spec_of(split, None)
    heavy = DataSpec(spec.columns, False, spec.num_rows, spec.layouts, spec.blocks, "train", row_bytes=100_000)
    assert order_for(spec, 0, G, 65536, 1 << 30).window_rows == 65536  # small rows: the row bound
    assert order_for(heavy, 0, G, 65536, 1 << 30).window_rows == (1 << 30) // 100_000  # 100 KB rows: 10,737
    assert order_for(heavy, 0, G, 65536, 1 << 20).window_rows == G  # never less than one global micro-batch
    assert order_for(spec_of(split), 0, G, 1000).window_rows == 984  # bucketing: whole global micro-batches


@pytest.mark.parametrize("table, match", [
    (pa.table({"x": [1.0], "n": [3]}), r"data.length_column \(length\): data.train_path has no such column"),
    (pa.table({"x": [1.0], "length": ["3"]}), r"data.length_column \(length\) is string in data.train_path, not a number"),
    (pa.table({"x": [1.0, 2.0], "length": [3, None]}), r"data.length_column \(length\) has missing or negative values"),
    (pa.table({"x": [1.0], "length": [-1]}), r"data.length_column \(length\) has missing or negative values"),
])
def test_a_bad_length_column_is_one_data_error(tmp_path, table, match):
    pq.write_table(table, tmp_path / "t.parquet")

    class Data:
        train_path = str(tmp_path / "t.parquet")

    with pytest.raises(DataError, match=match):
        check_length_column(open_split(Data, "train"), "length")


# ---- train.tokens_per_micro_batch: micro-batches by a budget on the sum of lengths (datasets/budget.py) ----------

BUDGET = 2000  # per worker; 3 workers at most here


def budget_stream(spec, world_size, start=(0, 0), workers=3):
    from stride.datasets.budget import BudgetStream

    order = order_for(spec, 5, G, 600)
    return order, [BudgetStream(spec, order, r, world_size, start, 2, BUDGET * workers) for r in range(world_size)]


def take(streams, steps):
    """Each micro-step's global micro-batch (ranks' shares in rank order), its lengths per rank, and the positions."""
    out = []
    for _ in range(steps):
        parts = [s.next() for s in streams]
        out.append((np.concatenate([p.sample_id for p in parts]), [p.sample_id for p in parts], streams[0].cursor))
    for s in streams:
        s.close()
    return out


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_token_budget_batches_are_the_same_at_any_world_size_and_cover_each_row_once(lengths_split, world_size):
    split, length = lengths_split
    spec = spec_of(split)
    order, streams = budget_stream(spec, 1)
    one = take(streams, 400)
    epoch_end = next(i for i, (_, _, cursor) in enumerate(one) if cursor == (1, 0)) + 1
    ids = np.concatenate([ids for ids, _, _ in one[:epoch_end]])
    assert sorted(ids.tolist()) == list(range(ROWS))  # every row once in epoch 0, none dropped
    _, streams = budget_stream(spec, world_size)
    many = take(streams, epoch_end)
    for (a, _, pa_), (b, shares, pb) in zip(one, many):
        assert np.array_equal(a, b) and pa_ == pb  # the same global micro-batches and positions
        assert max(len(x) for x in shares) - min(len(x) for x in shares) <= 1  # every rank its even share
        assert length[b].sum() <= 2 * BUDGET * 3  # the budget, twice for a window's last one (what is left joins it)
        assert len(b) >= 3  # a row per worker at least (the driver holds the budget to the longest row)
    sizes = [len(ids) for ids, _, _ in one[:epoch_end]]
    assert max(sizes) > 3 * min(sizes)  # short rows: many per micro-batch; long ones: few


def test_token_budget_resumes_from_the_checkpointed_position_exactly(lengths_split):
    spec = spec_of(lengths_split[0])
    _, streams = budget_stream(spec, 2)
    whole = take(streams, 150)
    start = whole[99][2]  # the position after micro-step 99: what a checkpoint there stores
    _, streams = budget_stream(spec, 3, start)
    resumed = take(streams, 50)
    assert all(np.array_equal(a[0], b[0]) for a, b in zip(whole[100:], resumed))


def test_a_position_that_is_no_micro_batch_start_is_a_data_error(lengths_split):
    spec = spec_of(lengths_split[0])
    _, streams = budget_stream(spec, 1)
    first = take(streams, 1)[0]
    _, streams = budget_stream(spec, 1, (0, first[2][1] - 1))
    with pytest.raises(DataError, match=r"is not where a micro-batch starts"):
        take(streams, 1)


@pytest.mark.slow
def test_token_budget_runs_resume_at_another_world_size_on_the_same_micro_batches(tmp_path):
    """examples/audio_clips with train.tokens_per_micro_batch (seconds of audio per worker): a 2-rank run cut at a
    checkpoint and resumed on 1 worker (the budget doubled: the same global budget, as batch_size_per_worker would
    be) trains every micro-step on the uninterrupted run's clips; samples_seen counts the variable batches."""
    import json
    import os
    import shutil
    import subprocess

    from conftest import PYTHON, REPO, read_jsonl, run_cli_forked, run_torchrun_cases

    project = tmp_path / "audio_clips"
    shutil.copytree(REPO / "examples" / "audio_clips", project, ignore=shutil.ignore_patterns("data", "runs"))
    subprocess.run([PYTHON, "prepare.py", "--clips", "400"], cwd=project, check=True, capture_output=True, timeout=120)
    common = ["--config", "audio_clips.yaml", *OVERLAY, "train.tokens_per_micro_batch=4.25",
              "train.log_every_steps=1", "train.eval_every_steps=100", "checkpoint.every_steps=8",
              "train.deterministic=true", "data.shuffle_window_rows=256"]
    cases = [{"label": "whole", "args": [*common, "run.name=whole", "train.max_steps=16"]},
             {"label": "cut", "args": [*common, "run.name=cut", "train.max_steps=8"]}]
    env = dict(os.environ, PYTHONPATH=str(project), STRIDE_SAMPLE_LOG=str(tmp_path / "log"))
    r, _ = run_torchrun_cases(cases, tmp_path / "results", project, env, timeout=400)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    single = {k: v for k, v in env.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    r = run_cli_forked([str(REPO / "trainers" / "torchrun.py"), *common, "run.name=cut", "train.max_steps=16",
                        "train.tokens_per_micro_batch=8.5", "scaling.num_workers=1"], cwd=project,
                       env=dict(single, STRIDE_SAMPLE_LOG=str(tmp_path / "log_resumed")), timeout=300,
                       inherit_env=False)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    # The data line says what a micro-batch is under a budget (a fraction of a second: manifests give durations).
    assert "micro-batches of rows whose duration sums to at most 8.5 per worker x 1 workers" in r.stdout + r.stderr

    def batches(folder, name_filter):
        rows = [json.loads(x) for f in sorted(folder.glob("*")) for x in f.read_text().splitlines()]
        out = {}
        for rec in rows:
            out.setdefault(rec["micro_step"], {})[rec["rank"]] = rec["sample_ids"]
        return {m: sum((parts[k] for k in sorted(parts)), []) for m, parts in out.items() if name_filter(m)}

    # the launch logged both runs' micro-steps into one folder: "whole" ran 16, "cut" the first 8 again
    logged = [json.loads(x) for f in sorted((tmp_path / "log").glob("*")) for x in f.read_text().splitlines()]
    assert len(logged) == 2 * (16 + 8)
    whole = batches(tmp_path / "log", lambda m: True)
    resumed = batches(tmp_path / "log_resumed", lambda m: True)
    assert sorted(resumed) == list(range(8, 16))
    for m in range(8, 16):
        assert resumed[m] == whole[m], m
    sizes = {len(whole[m]) for m in range(16)}
    assert len(sizes) > 1  # micro-batches of several sizes: the budget, not a row count
    ends = [json.loads((project / "runs" / n / "summary.json").read_text()) for n in ("whole", "cut")]
    assert ends[0]["samples_seen"] == ends[1]["samples_seen"] == sum(len(whole[m]) for m in range(16))
    assert all("padding_fraction" in x for x in read_jsonl(project / "runs" / "cut" / "metrics.jsonl") if "train_loss" in x)


def test_a_budget_below_the_longest_row_or_without_its_needs_is_refused(lengths_split):
    from stride.errors import ConfigError
    from stride.trainers.config_reader import build_config

    split, length = lengths_split
    with pytest.raises(DataError, match=rf"train.tokens_per_micro_batch \(500\) is below the longest row of "
                                        rf"data.train_path \({length.max()} in data.length_column length\); use "
                                        rf"train.tokens_per_micro_batch={length.max()} or more"):
        check_length_column(split, "length", 500)
    for raw, needs in [({"train": {"tokens_per_micro_batch": 9, "max_steps": 5}}, "data.length_column"),
                       ({"train": {"tokens_per_micro_batch": 9}, "data": {"length_column": "n"}}, "train.max_steps"),
                       ({"train": {"tokens_per_micro_batch": 9, "max_steps": 5},
                         "data": {"length_column": "n", "pipeline": "ray_data"}}, "data.pipeline=thread")]:
        with pytest.raises(ConfigError, match=rf"train.tokens_per_micro_batch \(9\) needs {needs}"):
            build_config(raw)
