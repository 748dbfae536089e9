"""Rows in the read path: one numpy array per column, each a view of the Arrow buffer it was converted from.

Why Arrow does the window's shuffle (stream.cut_window: `concat_tables(...).take(...)`), not numpy: one call, with
the GIL released, gathers every column of the window; the result converts to numpy without a copy. Stacking the
columns into one row-major array first (so that numpy gathers whole rows) transposes every value once more: on
this project's 2-vCPU machine that cost twice the gather it made faster. The training thread gets a plain
`Columns` (a dict of per-column arrays, contiguous slices of the window's).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from itertools import repeat

import numpy as np
import pyarrow as pa

__all__ = ["Columns", "column_to_numpy"]


def column_to_numpy(col: pa.ChunkedArray | pa.Array) -> np.ndarray:
    """One column as a numpy array with the rows as first dimension: numbers 1-D, fixed-size lists 2-D (n, size),
    everything else (bytes, strings, variable lists) an object array of Python values."""
    if isinstance(col, pa.ChunkedArray):  # one chunk (a row group) is used as it is: combining would copy it
        col = col.chunk(0) if col.num_chunks == 1 else col.combine_chunks()
    t = col.type
    if pa.types.is_fixed_size_list(t) and (pa.types.is_integer(t.value_type) or pa.types.is_floating(t.value_type)) \
            and not col.null_count:
        return col.flatten().to_numpy(zero_copy_only=False).reshape(len(col), t.list_size)
    if pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t):
        return col.to_numpy(zero_copy_only=False)
    return np.array(col.to_pylist() + [None], dtype=object)[:-1]  # the None keeps numpy from stacking lists


@dataclass
class Columns:
    """Rows of a split as numpy arrays (the task's columns) and their sample ids (the sample_id column, or the row's
    index in file order)."""

    data: dict[str, np.ndarray]
    sample_id: np.ndarray  # (n,) int64

    def __len__(self) -> int:
        return len(self.sample_id)

    def take(self, index: np.ndarray) -> Columns:
        return Columns({name: col.take(index, axis=0) for name, col in self.data.items()}, self.sample_id.take(index))

    def rows(self, index: np.ndarray) -> dict[str, np.ndarray]:
        return {name: col[index] for name, col in self.data.items()}


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

    def batches(self, n: int) -> Iterator[Columns]:
        """Consecutive n-row batches (len(self) a multiple of n), as `columns` gives them. numpy's C loops make the
        views (a reshape to (batches, n, ...) and its iteration): a micro-batch of 34 columns costs half of slicing
        each column in Python, which was the largest share of the training thread's time in the data path."""
        names, split = self.names, [a.reshape(-1, n, *a.shape[1:]) for a in self.arrays]
        for sample_id, arrays in zip(self.sample_id.reshape(-1, n), zip(*split) if split else repeat(())):
            yield Columns(dict(zip(names, arrays)), sample_id)


EMPTY = Frame((), (), np.zeros(0, np.int64))
