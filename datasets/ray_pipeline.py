"""data.pipeline=ray_data: the same rows as datasets/stream.py, read and transformed by Ray Data tasks.

Each worker runs its own streaming Ray Data pipeline over chunks of its micro-steps (about one window each): a
task reads the windows a chunk falls in, keeps this rank's rows and applies the task's transform to each
micro-batch (reseeded from the micro-step, so the arrays are those the training thread would make). The tasks run
on whatever CPUs the cluster has beside the worker gang, on any node; Ray Data's backpressure bounds what is read
ahead; `preserve_order` keeps the chunks in order, and the consumer checks every micro-step it receives.
The driver chooses this pipeline only where CPUs are free beside the gang (trainers/launch/ray.py), and a pipeline
that delivers nothing for `data.pipeline_timeout_s` fails the run with one line instead of waiting forever.
"""

from __future__ import annotations

import queue
from typing import Any, Callable

import numpy as np

from stride.datasets.order import Order
from stride.datasets.splits import DataSpec
from stride.datasets.files import FileFetcher
from stride.datasets.bucketing import Padding
from stride.datasets.stream import BlockReader, FixedPositions, Prefetcher, fetcher, rank_rows, take_lengths

_READERS: dict[tuple, BlockReader] = {}  # per Ray worker process: open footers survive between chunks
_FETCHERS: dict[tuple, FileFetcher] = {}  # and the file readers' threads


def chunks(order: Order, micro_step: int, end_micro_step: int, align: int = 1) -> list[tuple[int, int]]:
    """(first micro-step, count): about one window each, in whole multiples of `align` micro-steps (an optimizer
    step's micro-batches are transformed in one task, in order: the task's transform continues the step's random
    stream from one micro-batch to the next)."""
    per_chunk = max(align, order.window_rows // order.global_micro_batch // align * align)
    return [(m, min(per_chunk, end_micro_step - m)) for m in range(micro_step, end_micro_step, per_chunk)]


def make_chunk(batch: dict[str, np.ndarray], *, spec: DataSpec, order: Order, rank: int, world_size: int,
               transform: Callable[[Any, int], dict]) -> dict[str, np.ndarray]:
    """One Ray Data task: the transformed micro-batches of one chunk, one output row per micro-step."""
    first, n = int(batch["first"][0]), int(batch["n"][0])
    key = (spec.files, spec.columns)
    reader = _READERS.get(key) or _READERS.setdefault(key, BlockReader(spec, lengths=True))
    files = _FETCHERS.get(key) or _FETCHERS.setdefault(key, fetcher(spec))
    per = order.global_micro_batch // world_size
    ids, arrays, lengths = (np.empty(n, dtype=object) for _ in range(3))
    m = first
    while m < first + n:  # a chunk may run across an epoch's end: read each epoch's part from its windows
        count = min(first + n, (order.position(m)[0] + 1) * order.micro_steps_per_epoch) - m
        rows = files.fetch(rank_rows(reader, order, rank, world_size, m, count))
        for j, part in enumerate(rows.batches(per)):
            part, lengths[m - first + j] = take_lengths(part, spec)
            ids[m - first + j], arrays[m - first + j] = part.sample_id, transform(part, m + j)
        m += count
    return {"micro_step": np.arange(first, first + n), "ids": ids, "arrays": arrays, "lengths": lengths}


class RayDataStream(FixedPositions):
    """TrainStream's interface (next_batch) over a Ray Data pipeline; a thread moves its output into a queue."""

    def __init__(self, spec: DataSpec, order: Order, rank: int, world_size: int, micro_step: int, read_ahead: int,
                 end_micro_step: int | None = None, transform: Callable[[Any, int], dict] | None = None, *,
                 cpus_per_task: float = 1.0, timeout_s: float = 300.0):
        import ray.data

        ctx = ray.data.DataContext.get_current()
        ctx.execution_options.preserve_order = True
        ctx.enable_progress_bars = False
        ctx.print_on_execution_start = False
        end = end_micro_step if end_micro_step is not None else micro_step + order.micro_steps_per_epoch
        items = [{"first": f, "n": n} for f, n in chunks(order, micro_step, end, getattr(transform, "accum", 1))]
        self.timeout_s, self.order = timeout_s, order
        ds = ray.data.from_items(items or [{"first": 0, "n": 0}], override_num_blocks=max(1, len(items))).map_batches(
            make_chunk, batch_size=1, num_cpus=cpus_per_task, zero_copy_batch=True,
            fn_kwargs={"spec": spec, "order": order, "rank": rank, "world_size": world_size, "transform": transform})
        self.padding = Padding() if spec.length_column else None
        depth = max(1, read_ahead) * max(1, items[0]["n"] if items else 1)
        self._batches = Prefetcher(lambda: self._produce(ds, read_ahead), depth, "stride-ray-data")

    rows_read = None  # read in Ray Data tasks, not counted here

    def next_batch(self, micro_step: int) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        from stride.errors import TrainingError

        try:
            got, ids, arrays, lengths = self._batches.get(timeout=self.timeout_s)
        except queue.Empty:
            raise TrainingError(f"data.pipeline (ray_data) delivered no batch in {self.timeout_s:g}s (data."
                                f"pipeline_timeout_s): Ray Data is waiting for CPUs the worker gang holds; set "
                                f"data.pipeline=thread or lower scaling.cpus_per_worker") from None
        if got != micro_step:  # preserve_order is what keeps the order; never train on a batch out of place
            raise RuntimeError(f"Ray Data delivered micro-step {got} where {micro_step} was due")
        if self.padding is not None:
            self.padding.add(lengths)
        return ids, arrays

    def close(self) -> None:
        self._batches.close()

    @staticmethod
    def _produce(ds, read_ahead: int):
        for batch in ds.iter_batches(batch_size=None, batch_format="numpy", prefetch_batches=read_ahead):
            yield from zip((int(m) for m in batch["micro_step"]), batch["ids"], batch["arrays"], batch["lengths"])
