"""Streaming a split to one rank: blocks (file parts: Parquet row groups, line ranges of text files) read on
demand, in the order of datasets/order.py.

A worker holds the blocks of the `read_ahead` windows after the current one (and the blocks they share with
it), plus the rows it kept of the current window and of the windows already cut ahead, however large the split.
Background threads read ahead while the loop trains (pyarrow releases the GIL while it decodes). Both runtimes, Ray
Train and torchrun, read the files the same way, with pyarrow, from a local folder, a shared filesystem or an
object store (s3://, gs://).

Every rank reads every block of a window and keeps its own rows: read amplification equals the world size. This
is what makes the order independent of the world size (rank r takes its slice of every global micro-batch); on local
or shared disks the page cache absorbs it, on an object store it is W x the egress (docs/data.md).
"""

from __future__ import annotations

import queue
import threading
from collections import OrderedDict, deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Iterator

import numpy as np
import pyarrow as pa

from stride.datasets.bucketing import Padding, bucket, lengths_of
from stride.datasets.files import FileFetcher, resolve, row_of
from stride.datasets.formats import PartReader, formats
from stride.datasets.frame import EMPTY, Frame
from stride.datasets.order import EpochPlan, Order, eval_blocks
from stride.datasets.splits import SAMPLE_ID, DataSpec, conform
from stride.datasets.frame import Columns
from stride.errors import DataError

__all__ = ["READ_THREADS", "TrainStream"]


READ_THREADS = 2  # windows read at once by each worker


class BlockReader:
    """Reads one split's blocks (file parts) with the columns the task needs; counts the rows it read."""

    OPEN_FILES = 16  # files kept open: an object store pays a request per open

    def __init__(self, spec: DataSpec, lengths: bool = False):
        self.spec = spec
        self.columns = [c for c in spec.columns if c != SAMPLE_ID or spec.has_sample_id]
        if lengths and spec.length_column and spec.length_column not in self.columns:
            self.columns.append(spec.length_column)  # bucketing sorts by it; take_lengths drops it again
        self.schema = pa.schema([spec.schema.field(c) for c in self.columns]) if spec.schema is not None else None
        self.base = np.concatenate([[0], np.cumsum([n for _, _, n in spec.blocks])]).astype(np.int64)
        self.rows_read = 0
        self._files: OrderedDict[int, PartReader] = OrderedDict()
        self._last: tuple[int, pa.Table] | None = None  # a block two windows share is read once

    @property
    def num_blocks(self) -> int:
        return len(self.spec.blocks)

    def read(self, block: int) -> pa.Table:
        """The block's rows (read once, however many windows share the block), with their sample ids (the
        sample_id column, or the row's index in file order)."""
        if self._last is not None and self._last[0] == block:
            return self._last[1]
        rows = self.read_file_blocks([block])[block]
        self._last = (block, rows)
        return rows

    def read_file_blocks(self, blocks: list[int]) -> dict[int, pa.Table]:
        """Blocks of one file, read in one call (the format reads the parts as one request where it can)."""
        f = self.spec.blocks[blocks[0]][0]
        try:
            table = self._file(f).read([self.spec.blocks[b][1] for b in blocks], self.columns)
        except DataError:
            self._files.pop(f, None)
            raise
        table = resolve(conform(table, self.schema, self.spec.key, self.spec.layouts[f].path), self.spec.file_columns,
                        self.spec.layouts[f].path)
        sizes = [self.spec.blocks[b][2] for b in blocks]
        if not self.spec.has_sample_id:
            table = table.append_column(SAMPLE_ID, pa.array(np.concatenate(
                [np.arange(self.base[b], self.base[b] + n, dtype=np.int64) for b, n in zip(blocks, sizes)])))
        out, lo = {}, 0
        for b, n in zip(blocks, sizes):  # the order asked for: the reader keeps it
            out[b], lo = table.slice(lo, n), lo + n
        self.rows_read += lo
        return out

    def _file(self, f: int) -> PartReader:
        if f not in self._files:
            layout = self.spec.layouts[f]
            self._files[f] = formats()[layout.format].reader(layout, self.spec.key)
            while len(self._files) > self.OPEN_FILES:
                self._files.popitem(last=False)[1].close()
        self._files.move_to_end(f)
        return self._files[f]


def rank_window(reader: BlockReader, order: Order, epoch: int, k: int, rank: int, world_size: int,
                from_position: int = 0, to_position: int | None = None) -> Frame | None:
    """The rows `rank` trains on from window k of `epoch` (positions in [from_position, to_position)), in order;
    None if none."""
    plan = order.epoch(epoch)
    positions = window_positions(order, epoch, k, rank, world_size, from_position, to_position)
    if not len(positions):
        return None
    return cut_window(plan, k, positions, [reader.read(block) for _, block, _, _ in plan.window_pieces(k)],
                      bucketing_of(reader.spec, order))


def bucketing_of(spec: DataSpec, order: Order) -> tuple[str, int] | None:
    return (spec.length_column, order.global_micro_batch) if spec.length_column else None


def take_lengths(rows: Columns, spec: DataSpec) -> tuple[Columns, np.ndarray | None]:
    """A micro-batch's lengths (data.length_column), and the batch without that column unless the task reads it."""
    if not spec.length_column:
        return rows, None
    lengths = lengths_of(rows.data[spec.length_column])
    if spec.length_column not in spec.columns:
        rows = Columns({k: v for k, v in rows.data.items() if k != spec.length_column}, rows.sample_id)
    return rows, lengths


def window_positions(order: Order, epoch: int, k: int, rank: int, world_size: int, from_position: int = 0,
                     to_position: int | None = None) -> np.ndarray:
    lo, hi = order.epoch(epoch).window_span(k)
    return order.rank_positions(rank, world_size, max(lo, from_position), min(hi, to_position or hi))


def cut_window(plan: EpochPlan, k: int, positions: np.ndarray, blocks: list[pa.Table],
               bucketing: tuple[str, int] | None = None) -> Frame:
    """The rows at `positions` of window k, given the blocks it overlaps (read whole, in sequence order): the
    window's shuffle (with `bucketing`, (length column, global micro-batch): sorted into groups of similar length,
    datasets/bucketing.py), a copy of the rows this rank keeps (one Arrow take, the GIL released; see frame.py)."""
    pieces = [rows.slice(first, end - first) for rows, (_, _, first, end) in zip(blocks, plan.window_pieces(k))]
    window = pa.concat_tables(pieces, promote_options="permissive")
    permutation = plan.window_permutation(k)
    if bucketing is not None:
        column, group = bucketing
        permutation = bucket(permutation, lengths_of(window.column(column)), group, plan.seed, plan.epoch, k)
    return frame_of(window.take(permutation[positions - plan.window_span(k)[0]]))


def frame_of(table: pa.Table) -> Frame:
    """A table read by BlockReader (the task's columns and sample_id) as numpy arrays, without a copy."""
    return Frame.from_table(table, [c for c in table.column_names if c != SAMPLE_ID],
                            table.column(SAMPLE_ID).to_numpy().astype(np.int64, copy=False))


def rank_rows(reader: BlockReader, order: Order, rank: int, world_size: int, micro_step: int, n: int) -> Frame:
    """The rows `rank` trains on in micro-steps [micro_step, micro_step + n) of one epoch, read from the windows
    they fall in."""
    epoch, i = order.position(micro_step)
    G, S = order.global_micro_batch, order.window_rows
    lo, hi = i * G, (i + n) * G
    parts = [rank_window(reader, order, epoch, k, rank, world_size, lo, hi) for k in range(lo // S, (hi - 1) // S + 1)]
    return Frame.concat([p for p in parts if p is not None] or [EMPTY])


class Prefetcher:
    """Runs the generator `produce()` in a daemon thread, at most `depth` items ahead of `get`. An exception in the
    thread is raised by the `get` that reaches it; `get` past the generator's end raises EOFError."""

    _END = object()

    def __init__(self, produce: Callable[[], Iterator], depth: int, name: str):
        self._produce = produce
        self._queue: queue.Queue = queue.Queue(maxsize=max(1, depth))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)  # started by the first get

    def get(self, timeout: float | None = None):
        if self._thread.ident is None:
            self._thread.start()
        item = self._queue.get(timeout=timeout)  # queue.Empty after `timeout` seconds
        if item is self._END:
            raise EOFError("the stream ended")
        if isinstance(item, BaseException):
            self.close()
            raise item
        return item

    def close(self) -> None:
        self._stop.set()
        while self._thread.ident is not None and self._thread.is_alive():
            try:  # unblock a producer waiting on a full queue
                self._queue.get_nowait()
            except queue.Empty:
                pass
            self._thread.join(timeout=0.05)

    def _run(self) -> None:
        try:
            for item in self._produce():
                if not self._put(item):
                    return
            self._put(self._END)
        except BaseException as e:  # delivered to the consumer, which raises it
            self._put(e)

    def _put(self, item) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False


class FixedPositions:
    """The data position of a stream of global micro-batches of a fixed size (`self.order`'s): arithmetic on the
    micro-step. (datasets/budget.py's stream keeps its position itself.)"""

    order: Order

    @property
    def global_rows(self) -> int:
        """Rows of a micro-batch, every rank's: the global micro-batch."""
        return self.order.global_micro_batch

    def position(self, micro_step: int) -> tuple[int, int]:
        """(epoch, rows into it) where micro-step `micro_step` starts: what a checkpoint stores."""
        epoch, i = self.order.position(micro_step)
        return epoch, i * self.order.global_micro_batch

    def epochs_completed(self, micro_step: int) -> float:
        return micro_step / self.order.micro_steps_per_epoch


class TrainStream(FixedPositions):
    """This rank's micro-batches from `micro_step` up to `end_micro_step` (the run's last; None: no end), across
    epochs. READ_THREADS background threads read the blocks of the next `read_ahead` windows and cut each
    window (one Arrow gather) as its last read completes; the caller's thread only slices micro-batches. `next_batch`
    applies `transform(rows, micro_step)` in the caller's thread too (the task's transform may draw from the global
    random streams, which belong to the training thread)."""

    def __init__(self, spec: DataSpec, order: Order, rank: int, world_size: int, micro_step: int, read_ahead: int,
                 end_micro_step: int | None = None, transform: Callable[[Columns, int], dict] | None = None):
        self.spec, self.order, self.rank, self.world_size = spec, order, rank, world_size
        self._readers: list[BlockReader] = []  # one per read thread: a file reader is not safe to share
        self._local = threading.local()
        self.per_worker = order.global_micro_batch // world_size
        self.transform = transform
        self._batches: Iterator[Columns] = iter(())  # the micro-batches of the window being consumed
        self._pool = ThreadPoolExecutor(READ_THREADS, thread_name_prefix="stride-read")
        self._files = fetcher(spec)
        self.padding = Padding() if spec.length_column else None  # padding_fraction (data.length_column)
        self._windows = self._produce(micro_step, end_micro_step, read_ahead)

    @property
    def rows_read(self) -> int:
        return sum(r.rows_read for r in list(self._readers))

    def next_batch(self, micro_step: int) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """(sample ids, the task's arrays) of the next micro-batch, which is micro-step `micro_step`."""
        rows = self.next()
        return rows.sample_id, self.transform(rows, micro_step)

    def next(self) -> Columns:
        """The next micro-batch: `per_worker` rows (micro-batches never straddle an epoch: the tail is dropped)."""
        rows = next(self._batches, None)
        while rows is None:  # every window holds whole micro-batches (see _produce)
            window = next(self._windows, None)
            if window is None:
                raise EOFError("the stream ended")
            self._batches = window.batches(self.per_worker)
            rows = next(self._batches, None)
        rows, lengths = take_lengths(rows, self.spec)
        if lengths is not None:
            self.padding.add(lengths)
        return rows

    def close(self) -> None:
        self._windows.close()
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._files.close()

    def _produce(self, micro_step: int, end_micro_step: int | None, read_ahead: int) -> Iterator[Frame]:
        """This rank's rows, in whole micro-batches: the rows a window leaves over open the next one. (The training
        thread cuts them as it goes: a window's worth of micro-batches made ahead would be thousands of objects for
        the garbage collector to scan.)"""
        n, carry = self.per_worker, None
        for rows in self._windows_in_order(micro_step, end_micro_step, read_ahead):
            if carry is not None:
                rows = Frame.concat([carry, rows])
            whole = len(rows) - len(rows) % n
            carry = rows.slice(whole, len(rows)) if whole < len(rows) else None
            if whole:
                yield rows.slice(0, whole)

    def _windows_in_order(self, micro_step: int, end_micro_step: int | None, read_ahead: int) -> Iterator[Frame]:
        """This rank's rows, window after window. The read threads read the blocks `read_ahead` windows ahead
        of the one being consumed, one call per file and window (pyarrow releases the GIL while it decodes); each
        block is read once, though two windows share it. The thread that completes a window's last read also cuts
        it, so the consumer's thread only slices micro-batches."""
        reads: dict[tuple[int, int], tuple[Future, int]] = {}  # (epoch, slot) -> (its file read, block id)
        pending: deque[tuple[Future, set]] = deque()  # the cut of each window ahead, and the slots it needs

        for epoch, k, start in self._window_jobs(micro_step, end_micro_step):
            positions = window_positions(self.order, epoch, k, self.rank, self.world_size, start)
            if not len(positions):
                continue
            plan = self.order.epoch(epoch)
            pieces = plan.window_pieces(k)
            by_file: dict[int, dict] = {}  # a block two of the window's pieces share is read once
            for j, block, _, _ in pieces:
                if (epoch, j) not in reads:
                    by_file.setdefault(self.spec.blocks[block][0], {})[j] = block
            for slots in by_file.values():
                read = self._pool.submit(self._read, list(slots.values()))
                reads.update({(epoch, j): (read, block) for j, block in slots.items()})
            needs = [reads[epoch, j] for j, *_ in pieces]

            def cut(plan=plan, k=k, positions=positions, needs=needs) -> Frame:  # bound now, called by a read thread
                return self._files.fetch(cut_window(plan, k, positions, [read.result()[block] for read, block in needs],
                                                    bucketing_of(self.spec, self.order)))

            pending.append((after({read for read, _ in needs}, cut), {(epoch, j) for j, *_ in pieces}))
            if len(pending) > read_ahead:
                yield self._take(pending, reads)
        while pending:
            yield self._take(pending, reads)

    @staticmethod
    def _take(pending: deque, reads: dict) -> Frame:
        window, _ = pending.popleft()
        # A window's blocks go once it is cut, except the newest window's: the next window submitted may share one.
        keep = set().union(*(slots for cut, slots in pending if not cut.done()))
        if pending:
            keep |= pending[-1][1]
        for key in [key for key in reads if key not in keep]:
            del reads[key]
        return window.result()

    def _window_jobs(self, micro_step: int, end_micro_step: int | None) -> Iterator[tuple[int, int, int]]:
        """(epoch, window, first position) of every window from `micro_step` on; none past the run's last
        micro-step (a run ending mid-epoch reads no further windows)."""
        order, G = self.order, self.order.global_micro_batch
        epoch, i = order.position(micro_step)
        start = i * G
        last_epoch, last_pos = order.position(end_micro_step - 1) if end_micro_step else (None, None)
        while last_epoch is None or epoch <= last_epoch:
            plan = order.epoch(epoch)
            end_window = plan.num_windows if epoch != last_epoch else (last_pos * G + G - 1) // order.window_rows + 1
            for k in range(start // order.window_rows, end_window):
                yield epoch, k, start
            epoch, start = epoch + 1, 0

    def _read(self, blocks: list[int]) -> dict[int, pa.Table]:
        if not hasattr(self._local, "reader"):
            self._local.reader = BlockReader(self.spec, lengths=True)
            self._readers.append(self._local.reader)
        return self._local.reader.read_file_blocks(blocks)


def after(futures: set[Future], fn: Callable[[], object]) -> Future:
    """A future of `fn()`, called by the thread that completes the last of `futures` (at once, in this thread, if
    they are all done); a failed future fails it with the same error."""
    out: Future = Future()
    left, lock, job = [len(futures)], threading.Lock(), [fn]

    def one_done(_: Future) -> None:
        with lock:
            left[0] -= 1
            if left[0]:
                return
        try:  # popped: the futures' callbacks must not keep what `fn` holds (the blocks) alive after the call
            out.set_result(job.pop()())
        except BaseException as e:  # the consumer's result() raises it
            out.set_exception(e)

    for f in futures:
        f.add_done_callback(one_done)
    return out


def eval_batch_counts(spec: DataSpec, world_size: int, batch: int) -> list[int]:
    """How many validation batches each rank runs (ranks pad to the most: FSDP all-gathers in every forward)."""
    return [sum(-(-spec.blocks[b][2] // batch) for b in eval_blocks(len(spec.blocks), r, world_size))
            for r in range(world_size)]


def eval_stream(spec: DataSpec, rank: int, world_size: int, batch: int) -> Iterator[Columns]:
    """Every validation row once across ranks: rank r reads blocks r, r + W, ... one at a time."""
    for rows, _ in eval_sources(spec, rank, world_size, batch):
        yield rows


def eval_sources(spec: DataSpec, rank: int, world_size: int, batch: int) -> Iterator[tuple[Columns, int | None]]:
    """eval_stream's batches, each with the index of the source (data.val) its block belongs to (None: one source).
    A batch never spans two blocks, so never two sources."""
    reader, files = BlockReader(spec), fetcher(spec)
    firsts = [src.first_block for src in spec.sources]
    try:
        for b in eval_blocks(reader.num_blocks, rank, world_size):
            source = int(np.searchsorted(firsts, b, side="right")) - 1 if firsts else None
            rows = frame_of(reader.read(b))
            for lo in range(0, len(rows), batch):
                yield files.fetch(rows.slice(lo, lo + batch)).columns(), source
    finally:
        files.close()


def fetcher(spec: DataSpec) -> FileFetcher:
    """The reader of the files the spec's file columns reference (none: fetch() passes frames through)."""
    return FileFetcher(spec.file_columns, spec.file_read_threads, row_of(spec.layouts, spec.has_sample_id),
                       spec.file_root)
