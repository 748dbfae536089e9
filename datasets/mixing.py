"""Several training sources mixed by weight, inside Stride's order: a function of (seed, epoch, the sources) only.

Each source has an order of its own (datasets/order.py: its blocks permuted, its windows shuffled, seeded by the
run's seed and the source's index), read as one endless stream: its epoch e+1 follows its epoch e. The mixture then
decides, for every global micro-batch B of G rows, how many rows each source gives: A_s(B), the rows source s gave
before batch B, is round(w_s x B x G) for every source but the heaviest, which takes the rest. So every prefix of
the run holds each source's share to within a row (the heaviest: to within the number of sources), every global
batch draws in the weights' proportions, and batch B's rows of source s are that source's stream positions
[A_s(B), A_s(B + 1)). Inside the batch, the slots are dealt to the sources by a permutation seeded with (seed, B),
so each rank's slice holds a mix too. None of this depends on the world size, and a micro-step determines every
source's position: resume and a new world size continue the same sequence, as for one source.

An epoch of a mixture is as many rows as the sources hold together (sum of their rows, in whole global batches). A
source weighted above its share of the rows repeats within that epoch; one weighted below is seen partly, and the
next epoch continues its stream where this one stopped: every row of every source is seen equally often in the
long run, in proportion to its weight.

A window of the mixture (data.shuffle_window_rows positions) reads, for each source, the source windows its rows fall
in: a worker holds up to (sources + 1) windows of rows instead of one.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import numpy as np

from stride.datasets import bucketing
from stride.datasets.order import Order, WindowGrid, _rng

__all__ = ["order_for"]


@dataclass(frozen=True)
class MixSource:
    name: str
    first_block: int  # its blocks are spec.blocks[first_block : first_block + num_blocks]
    num_blocks: int
    weight: float


def deal(counts: np.ndarray, seed: int, batch: int) -> np.ndarray:
    """The source of each of a global batch's slots: counts[s] slots of source s, in a seeded random order."""
    labels = np.repeat(np.arange(len(counts)), counts)
    return labels[_rng(seed, batch, 0x313).permutation(len(labels))]


@dataclass(frozen=True)
class MixedOrder(Order):
    """The Order interface (datasets/order.py) over several sources: what the readers, the loop and the Ray Data
    pipeline call is the same. block_rows are every source's blocks, sources one after another."""

    sources: tuple[MixSource, ...] = ()
    _orders: tuple[Order, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        total = sum(s.weight for s in self.sources)
        weights = np.array([s.weight / total for s in self.sources])
        object.__setattr__(self, "weights", weights)
        object.__setattr__(self, "heaviest", int(np.argmax(weights)))
        object.__setattr__(self, "_orders", tuple(
            Order(self.block_rows[s.first_block:s.first_block + s.num_blocks],
                  int(np.random.SeedSequence([self.seed, 0x313, i]).generate_state(1)[0]), self.global_micro_batch,
                  self.window_rows) for i, s in enumerate(self.sources)))

    def __reduce__(self):  # to Ray Data's tasks: the arguments, not the plans and their locks
        return _mixed_order, (self.block_rows, self.seed, self.global_micro_batch, self.window_rows, self.sources)

    # ---- the Order interface: Order's, but for the epoch's plan and its length ----

    @property
    def rows_dropped_per_epoch(self) -> int:
        return 0  # nothing is left out: every source's stream continues into the next epoch

    def epoch(self, epoch: int) -> MixedEpochPlan:  # type: ignore[override]
        plan = self._cache.get(epoch)
        if plan is None:
            plan = MixedEpochPlan(self, epoch)
            for old in [k for k in list(self._cache) if k != epoch - 1]:
                self._cache.pop(old, None)
            self._cache[epoch] = plan
        return plan

    # ---- the mixture ----

    def before(self, batch: np.ndarray | int) -> np.ndarray:
        """A[s, i]: rows of source s in the global batches before batch[i] (every source, every batch asked)."""
        batch = np.atleast_1d(np.asarray(batch, dtype=np.int64))
        rows = batch * self.global_micro_batch
        counts = np.floor(self.weights[:, None] * rows[None, :].astype(np.float64) + 0.5).astype(np.int64)
        others = np.arange(len(self.sources)) != self.heaviest
        counts[self.heaviest] = rows - counts[others].sum(axis=0)
        return counts

    def source_counts(self, micro_step: int) -> dict[str, int]:
        """Rows each source gave to the first `micro_step` global micro-batches (samples_seen/<name>)."""
        return {s.name: int(n) for s, n in zip(self.sources, self.before(micro_step)[:, 0])}

    def slots(self, batch: int) -> tuple[np.ndarray, np.ndarray]:
        """(source, position in the source's stream) of each slot of global batch `batch`."""
        a = self.before(np.array([batch, batch + 1]))
        labels = deal(a[:, 1] - a[:, 0], self.seed, batch)
        position = np.empty(len(labels), dtype=np.int64)
        for s in range(len(self.sources)):
            mine = labels == s
            position[mine] = a[s, 0] + np.arange(int(mine.sum()))
        return labels, position

    def source_row(self, s: int, position: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(source epoch, window, offset in the window's permuted rows) of positions in source s's endless stream."""
        n = self._orders[s].num_rows
        epoch, at = np.divmod(position, n)
        return epoch, at // self.window_rows, at % self.window_rows

    # ---- a reference for tests: rows in file order of the combined blocks (O(rows)) ----

    def epoch_rows(self, epoch: int) -> np.ndarray:
        raise NotImplementedError("a mixture's reference is rows(micro_step, ...): its epochs are no permutation")

    def rows(self, micro_step: int, world_rank: int, world_size: int) -> np.ndarray:
        """Row indices (into all sources' rows in block order) that `world_rank` trains on at `micro_step`."""
        labels, position = self.slots(micro_step)
        base = np.concatenate([[0], np.cumsum(self.block_rows)])
        out = np.empty(len(labels), dtype=np.int64)
        for s, source in enumerate(self.sources):
            order, mine = self._orders[s], labels == s
            if mine.any():
                epoch, at = np.divmod(position[mine], order.num_rows)
                out[mine] = base[source.first_block] + np.array(
                    [order.epoch_rows(int(e))[int(a)] for e, a in zip(epoch, at)])
        per = self.global_micro_batch // world_size
        return out[world_rank * per:(world_rank + 1) * per]


def _mixed_order(block_rows, seed, global_micro_batch, window_rows, sources) -> MixedOrder:
    return MixedOrder(block_rows, seed, global_micro_batch, window_rows, sources=sources)


class MixedEpochPlan(WindowGrid):
    """EpochPlan's interface for one epoch of a mixture: a window's pieces are the source windows its rows fall in
    (each read whole, as a source's own window is), and its permutation points into their rows."""

    KEEP = 8  # windows whose pieces stay computed (the readers ask for a window's a few times, close together)

    def __init__(self, order: MixedOrder, epoch: int):
        self.order, self.epoch, self.seed = order, epoch, order.seed
        self.window_rows = order.window_rows
        self.num_rows = order.micro_steps_per_epoch * order.global_micro_batch
        self._windows: dict[int, tuple[list, np.ndarray]] = {}
        self._lock = threading.Lock()

    def window_pieces(self, k: int) -> list[tuple]:
        return self._window(k)[0]

    def window_permutation(self, k: int) -> np.ndarray:
        return self._window(k)[1]

    def _window(self, k: int) -> tuple[list, np.ndarray]:
        with self._lock:
            found = self._windows.get(k)
        if found is None:
            found = self._build(k)
            with self._lock:
                self._windows[k] = found
                for old in sorted(self._windows)[:-self.KEEP]:
                    del self._windows[old]
        return found

    def _build(self, k: int) -> tuple[list, np.ndarray]:
        order, G = self.order, self.order.global_micro_batch
        lo, hi = self.window_span(k)
        first = self.epoch * self.num_rows + lo  # global positions of the run's sequence
        batches = range(first // G, (first + hi - lo - 1) // G + 1)
        labels, positions = zip(*(order.slots(b) for b in batches))
        labels = np.concatenate(labels)[first % G:][:hi - lo]
        positions = np.concatenate(positions)[first % G:][:hi - lo]
        pieces, local = [], np.empty(hi - lo, dtype=np.int64)
        for s, source in enumerate(order.sources):
            mine = np.flatnonzero(labels == s)
            if not len(mine):
                continue
            epochs, windows, offsets = order.source_row(s, positions[mine])
            for e, w in sorted(set(zip(epochs.tolist(), windows.tolist()))):
                plan = order._orders[s].epoch(e)
                at = (epochs == e) & (windows == w)
                local[mine[at]] = sum(end - begin for *_, begin, end in pieces) + plan.window_permutation(w)[offsets[at]]
                pieces += [((s, e, slot), source.first_block + block, begin, end)
                           for slot, block, begin, end in plan.window_pieces(w)]
        return pieces, local


def order_for(spec, seed: int, global_micro_batch: int, window_rows: int,
              window_bytes: int | None = None) -> Order | MixedOrder:
    """The order of a training spec: one source's, or the mixture of its sources'. The window holds at most
    `window_rows` rows and `window_bytes` bytes of them (the data's mean row size: a function of the data, so of
    no world size); with length bucketing, whole global micro-batches (datasets/bucketing.py)."""
    block_rows = tuple(n for _, _, n in spec.blocks)
    if window_bytes and spec.row_bytes:
        window_rows = max(global_micro_batch, min(window_rows, int(window_bytes // spec.row_bytes)))
    if spec.length_column:
        window_rows = bucketing.window_rows(window_rows, global_micro_batch)
    if spec.sources:
        return MixedOrder(block_rows, seed, global_micro_batch, window_rows, sources=spec.sources)
    return Order(block_rows, seed, global_micro_batch, window_rows)
