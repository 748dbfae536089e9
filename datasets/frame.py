"""Rows in the read path: one numpy array per group of same-typed columns, cut with one call per group.

Why groups: the read threads run beside a training thread that holds the GIL most of the time (Python dispatch
between kernels). Each numpy or pyarrow call that releases the GIL must take it back, and a thread asking for it
waits up to the interpreter's switch interval (5 ms) while another runs Python. Cutting a window column by column
(34 columns: 34 concatenates and 34 gathers) paid that wait ~70 times a window; a Frame pays it a few times.
The training thread still gets a plain `Columns` (a dict of per-column arrays, views into the group arrays).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from stride.datasets.parquet import Columns, column_to_numpy


@dataclass(frozen=True)
class Frame:
    """Rows as groups: groups[g] has shape (rows, len(names[g]), ...) and groups[g][:, i] is column names[g][i]
    (row-major, so that the window's shuffle gathers whole rows: 4x faster than gathering column by column)."""

    names: tuple[tuple[str, ...], ...]
    groups: tuple[np.ndarray, ...]
    sample_id: np.ndarray  # (rows,) int64

    def __len__(self) -> int:
        return len(self.sample_id)

    @classmethod
    def from_table(cls, table: pa.Table, columns: list[str], sample_id: np.ndarray) -> Frame:
        """The columns of `table` (numeric columns without nulls stacked per Arrow type by pyarrow, in one call per
        type; any other column its own group, as `column_to_numpy` converts it)."""
        by_type: dict[pa.DataType, list[str]] = {}
        names, groups = [], []
        for c in columns:
            col = table.column(c)
            t = col.type
            if (pa.types.is_integer(t) or pa.types.is_floating(t)) and not col.null_count and table.num_rows:
                by_type.setdefault(t, []).append(c)
            else:
                names.append((c,))
                groups.append(column_to_numpy(col)[:, None])
        for same in by_type.values():
            batch = table.select(same).combine_chunks().to_batches()[0]
            names.append(tuple(same))
            # malloc's memory, not Arrow's pool: the array outlives the read by a window or two, and a pool keeps
            # what it frees (the decoded pages are Arrow's, freed at once and reused by the next read).
            groups.append(np.asarray(batch.to_tensor(row_major=True, memory_pool=pa.system_memory_pool())))
        return cls(tuple(names), tuple(groups), sample_id)

    @classmethod
    def concat(cls, parts: list[Frame]) -> Frame:
        if len(parts) == 1:
            return parts[0]
        if any(p.names != parts[0].names for p in parts):
            # Grouped differently: a column has nulls in one row group and not in another (or a row group is
            # empty). Column by column then, as numpy concatenates them (an int column with nulls is float64).
            parts = [p.per_column() for p in parts]
        return cls(parts[0].names, tuple(np.concatenate([p.groups[g] for p in parts])
                                          for g in range(len(parts[0].groups))),
                   np.concatenate([p.sample_id for p in parts]))

    def per_column(self) -> Frame:
        """The same rows with every column its own group, in name order."""
        data = self.columns().data
        return Frame(tuple((c,) for c in sorted(data)), tuple(data[c][:, None] for c in sorted(data)), self.sample_id)

    def slice(self, lo: int, hi: int) -> Frame:
        return Frame(self.names, tuple(g[lo:hi] for g in self.groups), self.sample_id[lo:hi])

    def take(self, index: np.ndarray) -> Frame:
        return Frame(self.names, tuple(g.take(index, axis=0) for g in self.groups), self.sample_id.take(index))

    def columns(self, lo: int = 0, hi: int | None = None) -> Columns:
        """Rows [lo, hi) as the dict of per-column arrays a task's transform gets: views, no copy (a column that
        shares its group with others is strided: rows are `len(group)` items apart)."""
        data: dict[str, np.ndarray] = {}
        for names, g in zip(self.names, self.groups):
            data.update(zip(names, g[lo:hi].swapaxes(0, 1)))
        return Columns(data, self.sample_id[lo:hi])


EMPTY = Frame((), (), np.zeros(0, np.int64))
