"""Length bucketing (datasets/bucketing.py, data.length_column) and the window's bound in bytes: rows of similar
length in each micro-batch, each row once per epoch at any world size, exact on resume, padding cut to a third or
less on log-uniform lengths; a bad length column is one DataError naming it."""

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from stride.datasets.bucketing import Padding, bucket
from stride.datasets.mixing import order_for
from stride.datasets.splits import DataError, DataSpec, check_length_column, open_split
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
