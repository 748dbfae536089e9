"""Rows in the read path: one numpy array per column, each a view of the Arrow buffer it was converted from.

Why Arrow does the window's shuffle (stream.cut_window: `concat_tables(...).take(...)`), not numpy: one call, with
the GIL released, gathers every column of the window; the result converts to numpy without a copy. Stacking the
columns into one row-major array first (so that numpy gathers whole rows) transposes every value once more: on
this project's 2-vCPU machine that cost twice the gather it made faster. The training thread gets a plain
`Columns` (a dict of per-column arrays, contiguous slices of the window's).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from stride.datasets.parquet import Columns, column_to_numpy


@dataclass(frozen=True)
class Frame:
    """Rows as columns: arrays[i] has the rows as first dimension and is column names[i]."""

    names: tuple[str, ...]
    arrays: tuple[np.ndarray, ...]
    sample_id: np.ndarray  # (rows,) int64

    def __len__(self) -> int:
        return len(self.sample_id)

    @classmethod
    def from_table(cls, table: pa.Table, columns: list[str], sample_id: np.ndarray) -> Frame:
        """The columns of `table`, as `column_to_numpy` converts them (numbers without nulls: no copy)."""
        return cls(tuple(columns), tuple(column_to_numpy(table.column(c)) for c in columns), sample_id)

    @classmethod
    def concat(cls, parts: list[Frame]) -> Frame:
        """Column by column, as numpy concatenates them (an int column with nulls in one part is float64)."""
        parts = [p for p in parts if len(p)] or parts[:1]
        if len(parts) == 1:
            return parts[0]
        return cls(parts[0].names, tuple(np.concatenate(column) for column in zip(*(p.arrays for p in parts))),
                   np.concatenate([p.sample_id for p in parts]))

    def slice(self, lo: int, hi: int) -> Frame:
        return Frame(self.names, tuple(a[lo:hi] for a in self.arrays), self.sample_id[lo:hi])

    def take(self, index: np.ndarray) -> Frame:
        return Frame(self.names, tuple(a.take(index, axis=0) for a in self.arrays), self.sample_id.take(index))

    def columns(self, lo: int = 0, hi: int | None = None) -> Columns:
        """Rows [lo, hi) as the dict of per-column arrays a task's transform gets: views, no copy."""
        return Columns(dict(zip(self.names, [a[lo:hi] for a in self.arrays])), self.sample_id[lo:hi])


EMPTY = Frame((), (), np.zeros(0, np.int64))
