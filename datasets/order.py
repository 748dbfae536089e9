"""The order in which training samples are seen: a function of (seed, epoch, the split's blocks) only.

An epoch is built in two seeded steps, so that it can be read as a stream:
1. the split's blocks (file parts: Parquet row groups, line ranges of text files; in file order) are permuted,
   and laid end to end as one sequence;
2. the sequence is cut into windows of `window_rows` positions, and the rows inside each window are permuted.
Position p of the epoch holds one row; global micro-batch i is positions [i*G, (i+1)*G) (G = the global
micro-batch); rank r of W takes its slice [r*G/W, (r+1)*G/W) of every global micro-batch. Nothing here depends on
W, so a run resumed at another world size (same G) continues the same sequence. A reader needs one window (plus the
blocks it overlaps) at a time, and a resume at position p starts reading at window p // window_rows.

The tail of each epoch that does not fill a global micro-batch is dropped, so every rank runs the same number of
steps: at most G - 1 rows per epoch. The window trades memory for mixing: rows from blocks further apart than a
window never meet in one batch, so a split sorted by label needs a window spanning many blocks (docs/data.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

__all__ = ["Order"]


def _rng(*key: int) -> np.random.Generator:
    return np.random.default_rng([*key])


class WindowGrid:
    """An epoch's positions cut into windows of `window_rows` (the last one shorter): needs num_rows, window_rows."""

    num_rows: int
    window_rows: int

    @property
    def num_windows(self) -> int:
        return -(-self.num_rows // self.window_rows)

    def window_span(self, k: int) -> tuple[int, int]:
        lo = k * self.window_rows
        return lo, min(lo + self.window_rows, self.num_rows)


@dataclass(frozen=True)
class EpochPlan(WindowGrid):
    """One epoch's sequence: which block slices make up each window, and the permutation inside it."""

    seed: int
    epoch: int
    window_rows: int
    blocks: np.ndarray  # block ids in sequence order
    starts: np.ndarray  # starts[j]: sequence position where blocks[j] begins; starts[-1] = number of rows

    @property
    def num_rows(self) -> int:
        return int(self.starts[-1])

    def window_pieces(self, k: int) -> list[tuple[int, int, int, int]]:
        """(slot, block id, first row, end row) of every block slice inside window k, in sequence order; slot j is
        the block's place in this epoch's sequence (a block two windows share has one slot)."""
        lo, hi = self.window_span(k)
        first = int(np.searchsorted(self.starts, lo, side="right")) - 1
        pieces = []
        for j in range(first, len(self.blocks)):
            b_lo, b_hi = int(self.starts[j]), int(self.starts[j + 1])
            if b_lo >= hi:
                break
            pieces.append((j, int(self.blocks[j]), max(lo, b_lo) - b_lo, min(hi, b_hi) - b_lo))
        return pieces

    def window_permutation(self, k: int) -> np.ndarray:
        lo, hi = self.window_span(k)
        return _rng(self.seed, self.epoch, k, 0x5eed).permutation(hi - lo)


@dataclass(frozen=True)
class Order:
    block_rows: tuple[int, ...]  # rows of each block (row group), in file order
    seed: int
    global_micro_batch: int  # batch_size_per_worker x workers (elastic runs: x the most workers)
    window_rows: int
    _cache: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def num_rows(self) -> int:
        return sum(self.block_rows)

    @property
    def micro_steps_per_epoch(self) -> int:
        return self.num_rows // self.global_micro_batch

    @property
    def rows_dropped_per_epoch(self) -> int:
        return self.num_rows - self.micro_steps_per_epoch * self.global_micro_batch

    def source_counts(self, micro_step: int) -> dict[str, int]:
        """Rows each source gave to the first `micro_step` micro-batches: one source has no name (mixing.py)."""
        return {}

    def position(self, micro_step: int) -> tuple[int, int]:
        """Global micro-step counter -> (epoch, micro-step within the epoch)."""
        return divmod(micro_step, self.micro_steps_per_epoch)

    def epoch(self, epoch: int) -> EpochPlan:
        plan = self._cache.get(epoch)
        if plan is None:
            blocks = _rng(self.seed, epoch, 0xB10C).permutation(len(self.block_rows))
            starts = np.concatenate([[0], np.cumsum(np.asarray(self.block_rows, dtype=np.int64)[blocks])])
            plan = EpochPlan(self.seed, epoch, self.window_rows, blocks, starts)
            # Keep this epoch and the one before (read threads straddle an epoch's end); pop, never clear: another
            # read thread may be looking its plan up at the same time.
            for old in [k for k in list(self._cache) if k not in (epoch - 1, ("rows", epoch - 1))]:
                self._cache.pop(old, None)
            self._cache[epoch] = plan
        return plan

    def rank_positions(self, rank: int, world_size: int, lo: int, hi: int) -> np.ndarray:
        """The epoch positions in [lo, hi) that `rank` trains on, in order (the dropped tail excluded)."""
        per = self.global_micro_batch // world_size
        hi = min(hi, self.micro_steps_per_epoch * self.global_micro_batch)
        p = np.arange(lo, max(lo, hi), dtype=np.int64)
        return p[(p % self.global_micro_batch) // per == rank]

    # ---- a reference for tests and tools: whole epochs in memory (O(rows)), never used by the reader ----

    def epoch_rows(self, epoch: int) -> np.ndarray:
        """Row index (into the split in file order) at every position of `epoch`."""
        plan = self.epoch(epoch)
        if (seq := self._cache.get(("rows", epoch))) is not None:
            return seq
        base = np.concatenate([[0], np.cumsum(self.block_rows)])
        seq = np.concatenate([np.arange(base[b], base[b + 1]) for b in plan.blocks]) if len(plan.blocks) else np.zeros(0, int)
        for k in range(plan.num_windows):
            lo, hi = plan.window_span(k)
            seq[lo:hi] = seq[lo:hi][plan.window_permutation(k)]
        self._cache[("rows", epoch)] = seq
        return seq

    def rows(self, micro_step: int, world_rank: int, world_size: int) -> np.ndarray:
        """Row indices (file order) that `world_rank` trains on at `micro_step`."""
        epoch, i = self.position(micro_step)
        per = self.global_micro_batch // world_size
        start = i * self.global_micro_batch + world_rank * per
        return self.epoch_rows(epoch)[start:start + per]


def eval_blocks(num_blocks: int, world_rank: int, world_size: int) -> range:
    """Validation covers every block exactly once across ranks (uneven shares are fine: no collective per batch)."""
    return range(world_rank, num_blocks, world_size)
