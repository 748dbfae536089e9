"""Micro-batches sized by a token budget (train.tokens_per_micro_batch, with data.length_column).

The order is the bucketed one (datasets/bucketing.py) with groups cut by the sum of their lengths instead of a row
count: each window's rows, sorted by length, form global micro-batches whose lengths sum to at most the budget x the
workers (`segments`), in a seeded order. Rank r of W takes its even share of each (`rank_share`), so every rank runs
the same number of micro-steps and the sequence of global micro-batches does not depend on W. Nothing is dropped:
an epoch is every row once, in as many micro-steps as its windows' lengths make.

A micro-step no longer maps to a data position by arithmetic, so the stream keeps the position itself: (epoch, rows
into the epoch) of the next micro-batch, which checkpoints store and a resume starts from (the window it falls in is
read again and cut the same way).
"""

from __future__ import annotations

from typing import Callable, Iterator

import numpy as np
import pyarrow as pa

from stride.datasets.bucketing import Padding, lengths_of, rank_share, segments
from stride.datasets.order import Order
from stride.datasets.splits import DataSpec
from stride.datasets.frame import Columns
from stride.errors import DataError
from stride.datasets.stream import BlockReader, Prefetcher, fetcher, frame_of, take_lengths


class BudgetStream:
    """TrainStream's interface (next_batch, position, global_rows, padding, close) for token-budget micro-batches.
    One background thread reads and cuts a window at a time (pyarrow releases the GIL while it decodes), up to
    `read_ahead` windows of micro-batches ahead."""

    def __init__(self, spec: DataSpec, order: Order, rank: int, world_size: int, start: tuple[int, int],
                 read_ahead: int, budget: float, transform: Callable[[Columns, int], dict] | None = None):
        self.spec, self.order, self.rank, self.world_size = spec, order, rank, world_size
        self.budget, self.transform = budget, transform
        self.padding = Padding()
        self.cursor = start  # (epoch, rows into it) of the next micro-batch
        self.global_rows = 0  # rows of the last micro-batch, every rank's
        self._reader = BlockReader(spec, lengths=True)
        self._files = fetcher(spec)
        # a window's micro-batches at a time: read_ahead windows of them, about
        depth = max(1, read_ahead) * max(1, order.window_rows // max(world_size, 1))
        self._items = Prefetcher(lambda: self._produce(start), depth, "stride-budget")

    @property
    def rows_read(self) -> int:
        return self._reader.rows_read

    def position(self, micro_step: int) -> tuple[int, int]:
        """(epoch, rows into it) of the next micro-batch: what a checkpoint after `micro_step` micro-steps stores."""
        return self.cursor

    def epochs_completed(self, micro_step: int) -> float:
        epoch, rows = self.cursor
        return epoch + rows / self.order.num_rows

    def next_batch(self, micro_step: int) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        rows = self.next()
        return rows.sample_id, self.transform(rows, micro_step)

    def next(self) -> Columns:
        rows, self.cursor, self.global_rows = self._items.get()
        rows, lengths = take_lengths(rows, self.spec)
        self.padding.add(lengths)
        return rows

    def close(self) -> None:
        self._items.close()
        self._files.close()

    def _produce(self, start: tuple[int, int]) -> Iterator[tuple[Columns, tuple[int, int], int]]:
        epoch, offset = start
        while True:
            plan = self.order.epoch(epoch)
            for k in range(offset // self.order.window_rows, plan.num_windows):
                yield from self._window(plan, epoch, k, offset)
            epoch, offset = epoch + 1, 0

    def _window(self, plan, epoch: int, k: int, offset: int) -> Iterator[tuple[Columns, tuple[int, int], int]]:
        """Window k's micro-batches from row `offset` of the epoch on: this rank's share of each, with the position
        after it and its rows on every rank."""
        lo, hi = plan.window_span(k)
        pieces = [self._reader.read(block).slice(first, end - first) for _, block, first, end in plan.window_pieces(k)]
        window = pa.concat_tables(pieces, promote_options="permissive")
        lengths = lengths_of(window.column(self.spec.length_column))
        position, found = lo, offset <= lo
        for part in segments(plan.window_permutation(k), lengths, self.budget, plan.seed, epoch, k):
            found = found or position == offset
            position += len(part)
            if not found or len(part) < self.world_size:  # a tiny epoch's end: a row per rank or none (dropped)
                continue
            mine = part[rank_share(len(part), self.rank, self.world_size)]
            rows = self._files.fetch(frame_of(window.take(mine))).columns()
            after = (epoch + 1, 0) if position == plan.num_rows else (epoch, position)
            yield rows, after, len(part)
        if not found:
            raise DataError(f"the checkpoint's data position ({offset} rows into epoch {epoch}) is not where a "
                            f"micro-batch starts: the data, data.length_column or train.tokens_per_micro_batch "
                            f"changed since it was written; resume with the same, or start a new run.name")
