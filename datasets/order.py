"""The order in which training samples are seen: a function of (seed, epoch) only.

Every epoch is a seeded permutation of the rows (sorted by sample_id). It is cut into global micro-batches
of `world_size * batch_size_per_worker` rows; rank r takes the r-th slice of each. The global order does not
depend on the world size, so a run resumed with a different number of workers (same global batch) continues
the same sequence. The tail of each epoch that does not fill a global micro-batch is dropped, so every rank
runs the same number of steps: at most `world_size * batch_size_per_worker - 1` rows per epoch.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


def epoch_permutation(num_rows: int, seed: int, epoch: int) -> np.ndarray:
    return np.random.default_rng([seed, epoch, 0x5772]).permutation(num_rows)


@dataclass(frozen=True)
class Order:
    num_rows: int
    seed: int
    global_micro_batch: int  # world_size * batch_size_per_worker

    @property
    def micro_steps_per_epoch(self) -> int:
        return self.num_rows // self.global_micro_batch

    @property
    def rows_dropped_per_epoch(self) -> int:
        return self.num_rows - self.micro_steps_per_epoch * self.global_micro_batch

    def position(self, micro_step: int) -> tuple[int, int]:
        """Global micro-step counter -> (epoch, micro-step within the epoch)."""
        return divmod(micro_step, self.micro_steps_per_epoch)

    def rows(self, micro_step: int, world_rank: int, world_size: int) -> np.ndarray:
        """Row indices (into the sample_id-sorted split) that `world_rank` trains on at `micro_step`."""
        epoch, i = self.position(micro_step)
        perm = self._perm(epoch)
        per_worker = self.global_micro_batch // world_size
        start = i * self.global_micro_batch + world_rank * per_worker
        return perm[start:start + per_worker]

    def _perm(self, epoch: int) -> np.ndarray:
        # One permutation per epoch, cached: recomputing it per step would cost O(rows) each time.
        if getattr(self, "_cached_epoch", None) != epoch:
            object.__setattr__(self, "_cached_perm", epoch_permutation(self.num_rows, self.seed, epoch))
            object.__setattr__(self, "_cached_epoch", epoch)
        return self._cached_perm


def eval_rows(num_rows: int, world_rank: int, world_size: int) -> np.ndarray:
    """Validation covers every row exactly once across ranks (uneven shards are fine: no collective per batch)."""
    return np.arange(world_rank, num_rows, world_size)
