"""The streamed sample order (datasets/order.py, datasets/stream.py): each row once per epoch, independent of the
world size, the same rows whether read as a stream or computed whole, resumable from its window, and mixing a
split sorted by label."""

from collections import Counter

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from stride.datasets.order import Order
from stride.datasets.splits import DataSpec, open_split
from stride.errors import DataError
from stride.datasets.stream import TrainStream, eval_batch_counts, eval_stream


def write_split(folder, rows_per_file, row_group, label_of=None):
    """Parquet files of consecutive sample_ids (and a label), `row_group` rows per row group."""
    folder.mkdir(parents=True, exist_ok=True)
    start = 0
    for i, n in enumerate(rows_per_file):
        ids = np.arange(start, start + n)
        cols = {"x": ids.astype(np.float32), "sample_id": ids}
        if label_of is not None:
            cols["label"] = label_of(ids)
        pq.write_table(pa.table(cols), folder / f"part-{i:03d}.parquet", row_group_size=row_group)
        start += n
    return folder


def spec_of(folder, columns=("x", "sample_id")):
    class Data:
        train_path = str(folder)

    split = open_split(Data, "train")
    return DataSpec(tuple(columns), True, split.num_rows, split.layouts, split.blocks, "train")


def order_of(spec, seed=0, G=24, window=100):
    return Order(tuple(n for _, _, n in spec.blocks), seed, G, window)


def streamed(spec, order, world_size, micro_step, steps):
    """sample_ids of each global micro-batch, ranks' slices joined in rank order, as the workers receive them."""
    streams = [TrainStream(spec, order, r, world_size, micro_step, read_ahead=2, end_micro_step=micro_step + steps)
               for r in range(world_size)]
    try:
        return [np.concatenate([s.next().sample_id for s in streams]) for _ in range(steps)], streams
    finally:
        for s in streams:
            s.close()


@pytest.fixture
def split(tmp_path):
    # 1003 rows in files of unequal size and row groups of 37: blocks straddle windows and files.
    return spec_of(write_split(tmp_path / "d", [300, 403, 300], row_group=37))


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_each_row_once_per_epoch_minus_documented_drop(split, world_size):
    order = order_of(split, G=8 * world_size)
    n = order.micro_steps_per_epoch
    seen = np.concatenate([order.rows(i, r, world_size) for i in range(n) for r in range(world_size)])
    assert len(seen) == len(set(seen.tolist()))  # nothing twice
    assert split.num_rows - len(seen) == order.rows_dropped_per_epoch < world_size * 8  # the documented drop
    nxt = np.concatenate([order.rows(n + i, r, world_size) for i in range(n) for r in range(world_size)])
    assert not np.array_equal(seen, nxt)  # the next epoch is another order


def test_order_depends_on_seed_and_epoch_not_on_world_size(split):
    order = order_of(split, G=24)
    for step in (0, 5, 40, 41, 60):
        one = order.rows(step, 0, 1)
        assert np.array_equal(one, np.concatenate([order.rows(step, r, 2) for r in range(2)]))
        assert np.array_equal(one, np.concatenate([order.rows(step, r, 3) for r in range(3)]))
    assert not np.array_equal(order_of(split, seed=1).rows(0, 0, 1), order.rows(0, 0, 1))


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_stream_delivers_the_reference_order_across_an_epoch(split, world_size):
    order = order_of(split, G=24)
    steps = order.micro_steps_per_epoch + 5  # into the second epoch
    got, _ = streamed(split, order, world_size, 0, steps)
    for m, ids in enumerate(got):
        assert np.array_equal(ids, order.rows(m, 0, 1)), m  # sample_id == row index in file order here


def test_a_split_without_sample_ids_streams_row_indices_in_the_reference_order(tmp_path):
    # Several row groups of one file are read in one call: each must get its own rows' indices in file order.
    folder = write_split(tmp_path / "d", [300, 403, 300], row_group=37)
    for f in folder.glob("*.parquet"):
        pq.write_table(pq.read_table(f).drop(["sample_id"]), f, row_group_size=37)
    spec = spec_of(folder, columns=("x",))
    spec = DataSpec(("x",), False, spec.num_rows, spec.layouts, spec.blocks, "train")
    order = order_of(spec, G=24)
    got, _ = streamed(spec, order, 2, 0, order.micro_steps_per_epoch)
    for m, ids in enumerate(got):
        assert np.array_equal(ids, order.rows(m, 0, 1)), m


def test_resume_at_90_percent_reads_about_10_percent_and_continues_exactly(split):
    order = order_of(split, G=24, window=100)
    n = order.micro_steps_per_epoch
    start = int(0.9 * n)
    full, _ = streamed(split, order, 2, 0, n)
    resumed, streams = streamed(split, order, 2, start, n - start)
    assert all(np.array_equal(a, b) for a, b in zip(full[start:], resumed))
    # Each rank read from the window holding the position on (at most one window, plus the row groups straddling
    # its edges, before it), not the 90% of the epoch before it.
    trained = (n - start) * 24
    for s in streams:
        assert trained <= s.rows_read <= trained + 100 + 2 * 37
        assert s.rows_read < 0.3 * split.num_rows


@pytest.mark.parametrize("read_ahead", [1, 2, 4])
def test_an_epoch_reads_each_row_group_once_however_far_it_reads_ahead(split, read_ahead):
    """Row groups straddle windows: the one two windows share is read once, even when the first window was cut (and
    its blocks let go) before the second was submitted."""
    order = order_of(split, G=8, window=100)
    stream = TrainStream(split, order, 0, 1, 0, read_ahead=read_ahead, end_micro_step=order.micro_steps_per_epoch)
    try:
        ids = np.concatenate([stream.next().sample_id for _ in range(order.micro_steps_per_epoch)])
        assert len(set(ids.tolist())) == len(ids) == split.num_rows - order.rows_dropped_per_epoch
        assert stream.rows_read == split.num_rows
    finally:
        stream.close()


def test_a_window_of_many_blocks_mixes_a_split_sorted_by_label(tmp_path):
    labels = lambda ids: (ids * 4 // 20000).astype(np.int64)  # noqa: E731 - sorted: 4 runs of 5000 rows
    spec = spec_of(write_split(tmp_path / "sorted", [5000] * 4, row_group=250, label_of=labels),
                   columns=("label", "sample_id"))
    B = 64

    def label_mix(window):
        order = order_of(spec, seed=0, G=B, window=window)
        got, _ = streamed(spec, order, 1, 0, order.micro_steps_per_epoch)
        # Total variation distance between each batch's label mix and the global one (uniform: 0.25 each).
        return np.mean([0.5 * np.abs(np.bincount(labels(ids), minlength=4) / B - 0.25).sum() for ids in got])

    assert label_mix(window=5000) < 0.2  # 20 row groups per window: batches close to the global mix
    assert label_mix(window=250) > 0.6  # one row group per window: a batch holds mostly one label


def test_validation_covers_every_row_once_across_ranks(split):
    for W in (1, 2, 3):
        parts = [np.concatenate([c.sample_id for c in eval_stream(split, r, W, 50)]) for r in range(W)]
        assert sorted(np.concatenate(parts).tolist()) == list(range(split.num_rows))
        assert [len(list(eval_stream(split, r, W, 50))) for r in range(W)] == eval_batch_counts(split, W, 50)


def test_a_file_that_disappears_mid_epoch_is_named(tmp_path):
    folder = write_split(tmp_path / "d", [200, 200, 200], row_group=50)
    spec = spec_of(folder)
    order = order_of(spec, G=10, window=50)
    stream = TrainStream(spec, order, 0, 1, 0, read_ahead=1)
    stream.next()
    for f in spec.files:
        (tmp_path / "d" / f.rsplit("/", 1)[1]).unlink()
    with pytest.raises(DataError, match=r"data.train_path: .*part-00\d.parquet could not be read"):
        for _ in range(order.micro_steps_per_epoch):
            stream.next()
    stream.close()


def test_a_file_rewritten_mid_epoch_is_named(tmp_path):
    folder = write_split(tmp_path / "d", [200, 200], row_group=50)
    spec = spec_of(folder)
    for f in folder.glob("*.parquet"):
        pq.write_table(pa.table({"x": np.zeros(10, np.float32), "sample_id": np.arange(10)}), f)
    stream = TrainStream(spec, order_of(spec, G=10, window=50), 0, 1, 0, read_ahead=1)
    with pytest.raises(DataError, match=r"part-00\d.parquet (could not be read|row groups [\d, ]+ hold )"):
        stream.next()
    stream.close()


def test_stream_counts_each_label_equally_over_an_epoch(tmp_path):
    # The per-batch mix above is statistical; over a whole epoch every row counts exactly once.
    labels = lambda ids: ids % 3  # noqa: E731
    spec = spec_of(write_split(tmp_path / "e", [999], row_group=111, label_of=labels), columns=("label", "sample_id"))
    order = order_of(spec, G=9, window=222)
    got, _ = streamed(spec, order, 3, 0, order.micro_steps_per_epoch)
    assert Counter(labels(np.concatenate(got)).tolist()) == {0: 333, 1: 333, 2: 333}
