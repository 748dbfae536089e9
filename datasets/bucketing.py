"""Length bucketing (data.length_column): rows of similar length form micro-batches, so a batch pads to a length
close to its rows' own.

It works inside each shuffle window, after the window's seeded shuffle and before the window is cut into global
micro-batches: the window's rows are sorted by length (the shuffle breaks ties), cut into groups of one global
micro-batch (G rows), and the groups' order is shuffled with (seed, epoch, window). Every rank reads every block of
a window, so every rank sees the same lengths and computes the same order: it stays a function of (seed, epoch, the
data), independent of the world size and exact on resume. A window is then a whole number of global micro-batches
(data.shuffle_window_rows is rounded down to one, G at least), and a group never mixes two windows.

What the task does with a batch is its own business (it pads in transform); Stride reports `padding_fraction`: the
share of a micro-batch's cells that padding to its longest row would fill, 1 - sum(lengths) / (rows x max length),
averaged over the logging interval and the ranks.
"""

from __future__ import annotations

import numpy as np

from stride.datasets.order import _rng

__all__ = ["Padding"]


def window_rows(rows: int, global_micro_batch: int) -> int:
    """A bucketed window holds whole global micro-batches."""
    return max(global_micro_batch, rows // global_micro_batch * global_micro_batch)


def bucket(permutation: np.ndarray, lengths: np.ndarray, global_micro_batch: int, seed: int, epoch: int,
           window: int) -> np.ndarray:
    """The window's order with bucketing: `permutation` (the window's seeded shuffle, indices into its rows) sorted
    by the rows' lengths, cut into groups of `global_micro_batch`, the whole groups' order shuffled; a last partial
    group (the epoch's tail, which the order drops) stays last."""
    by_length = permutation[np.argsort(lengths[permutation], kind="stable")]
    whole = len(by_length) // global_micro_batch
    groups = by_length[:whole * global_micro_batch].reshape(whole, global_micro_batch)
    order = _rng(seed, epoch, window, 0xB0C).permutation(whole)
    return np.concatenate([groups[order].reshape(-1), by_length[whole * global_micro_batch:]])


def lengths_of(values) -> np.ndarray:
    """A length column as float64 (ints, floats such as durations); a missing value is a DataError's matter, found
    by the driver's check."""
    return np.asarray(values, dtype=np.float64)


class Padding:
    """padding_fraction over the micro-batches since the last `take`."""

    def __init__(self):
        self.cells = self.used = 0.0

    def add(self, lengths: np.ndarray) -> None:
        if len(lengths):
            self.used += float(lengths.sum())
            self.cells += float(lengths.max()) * len(lengths)

    def take(self) -> float:
        fraction = 1.0 - self.used / self.cells if self.cells else 0.0
        self.cells = self.used = 0.0
        return fraction


def segments(permutation: np.ndarray, lengths: np.ndarray, budget: float, seed: int, epoch: int,
             window: int) -> list[np.ndarray]:
    """train.tokens_per_micro_batch: the window's rows (its seeded shuffle, indices into its rows) sorted by length
    and cut into global micro-batches whose lengths sum to at most `budget` (the per-worker budget x the workers;
    the driver holds the per-worker budget to the longest row, so a micro-batch has a row per worker at least). The
    window's last micro-batch, what is left, joins the one before (so it never holds fewer rows than a worker count:
    up to twice the budget, once per window). The micro-batches' order is shuffled with (seed, epoch, window). Every
    row of the window is in exactly one; nothing here depends on the world size."""
    by_length = permutation[np.argsort(lengths[permutation], kind="stable")]
    total = np.concatenate([[0.0], np.cumsum(lengths[by_length])])
    cuts, start, n = [0], 0, len(by_length)
    while start < n:
        start = max(start + 1, int(np.searchsorted(total, total[start] + budget, side="right")) - 1)
        cuts.append(min(start, n))
    if len(cuts) > 2:
        del cuts[-2]
    parts = [by_length[a:b] for a, b in zip(cuts, cuts[1:])]
    return [parts[i] for i in _rng(seed, epoch, window, 0xB0D).permutation(len(parts))]


def rank_share(rows: int, rank: int, world_size: int) -> slice:
    """Rank r's share of a global micro-batch of `rows` rows: as even as it can be (shares differ by one row at
    most), whatever the world size."""
    return slice(rank * rows // world_size, (rank + 1) * rows // world_size)
