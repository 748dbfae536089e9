"""Length bucketing (data.length_column): the padding it saves and the training time that buys, measured side by side
(-> bucketing_padding_ratio, bucketing_step_time_ratio).

    python benchmarks/bucketing_bench.py            # 5 repetitions; prints the figures and the raw runs as JSON
    python benchmarks/bucketing_bench.py --smoke    # 128 rows, a tiny model, 1 repetition: a check that it runs

The data: ROWS token sequences whose lengths are log-uniform over 10..1000 (mean ~215), each a learnable pattern
(bytes start, start + step, start + 2 step, ... mod 256), in a Parquet file (row groups of 128) with a list<int16>
column "tokens" and an int32 column "length", written into a temporary folder this benchmark owns (removed at the
end). The model, this file's own: a small causal transformer (MODEL: 3 pre-norm blocks, d_model 64, 4 heads,
MLP 4 x d_model, learned positions up to 1,000, byte vocabulary; attention by scaled_dot_product_attention with
is_causal, so a row never attends to the padding after it), trained by next-token cross-entropy over the rows' own
tokens only (padding's targets ignored), AdamW, one torch thread (a worker's default, scaling.cpus_per_worker=1).

Two sides, the same process, the same rows, seed and global batch (BATCH; world size 1), each one epoch from a fresh
model (the same initial weights) and optimizer, the two epochs interleaved step by step (ABBA...: both have the same
number of steps), so that a burst of this machine's other work weighs on both alike:

* bucketed: TrainStream over the spec with length_column="length" (datasets/bucketing.py: within each shuffle window
  the rows are sorted by length, cut into global micro-batches, and the batches' order shuffled);
* unbucketed: the same spec with length_column=None (the window's plain shuffle).

The order is order_for with the config's defaults (shuffle_window_rows 65,536, shuffle_window_bytes 1 GiB): the whole
epoch is one window, its 1,536 rows sorted into 48 groups of 32 (a 65,536-row window of a larger set sorts into 2,048
groups, whose lengths are closer still: this set understates bucketing a little). Each micro-batch (the task's columns:
the tokens; the length column is dropped after use, as for a task that does not read it) is padded to its longest row
and stepped. Per side: the padding fraction over the epoch (datasets.bucketing.Padding over every micro-batch's lengths:
1 - real tokens / (rows x longest row), summed over the batches; the bucketed side's own `stream.padding`, what Stride
logs as padding_fraction, is kept beside it and must agree), and the epoch's time: the side's own, building its stream
and each of its steps (the next micro-batch, padding, forward, backward, AdamW), summed. Not timed, after it: the
model's loss per token on VAL_ROWS held-out rows (another seed), the same rows for both sides: how far each got in the
same number of steps. The samples: bucketed / unbucketed of each, per repetition; repetition r uses seed r for both
sides (the order and the initial weights). The rows: ROWS = 1,536 (48 steps of 32) is chosen so that a pair takes about
1-1.5 minutes on one core of this project's 2-vCPU machine (the unbucketed epoch ~1 minute: its batches pad to ~950
tokens).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
import torch.nn as nn
import torch.nn.functional as F

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.append(str(REPO))  # appended: the repository's datasets/ must not hide Hugging Face's `datasets`

from benchmarks.report import cpu_model, print_json  # noqa: E402

ROWS = 1_536
BATCH = 32  # train.batch_size_per_worker's default; world size 1: the global micro-batch
MIN_LENGTH, MAX_LENGTH = 10, 1000
MODEL = {"layers": 3, "d_model": 64, "heads": 4}
SMOKE = {"rows": 128, "batch": 16, "model": {"layers": 1, "d_model": 32, "heads": 2}}
VOCAB = 256
WINDOW_ROWS = 65_536  # data.shuffle_window_rows' default
WINDOW_BYTES = 1 << 30  # data.shuffle_window_bytes' default
READ_AHEAD = 2  # data.read_ahead_windows' default
LR = 3e-3
THREADS = 1
VAL_ROWS = 128  # the held-out rows (another seed) every side's model is evaluated on after its epoch
VARIANTS = ("bucketed", "unbucketed")


# ---------------------------------------------------------------- the model

class Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class TinyLM(nn.Module):
    def __init__(self, layers: int, d_model: int, heads: int):
        super().__init__()
        self.tok, self.pos = nn.Embedding(VOCAB, d_model), nn.Embedding(MAX_LENGTH, d_model)
        self.blocks = nn.Sequential(*(Block(d_model, heads) for _ in range(layers)))
        self.ln, self.head = nn.LayerNorm(d_model), nn.Linear(d_model, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok(tokens) + self.pos(torch.arange(tokens.shape[1]))
        return self.head(self.ln(self.blocks(x)))


def padded(rows) -> tuple[torch.Tensor, torch.Tensor, np.ndarray]:
    """A micro-batch's token lists padded to its longest row: (inputs, targets with padding ignored, lengths)."""
    lengths = np.array([len(r) for r in rows], dtype=np.int64)
    tokens = np.zeros((len(rows), int(lengths.max())), dtype=np.int64)
    for i, r in enumerate(rows):
        tokens[i, :len(r)] = r
    targets = np.where(np.arange(tokens.shape[1])[None, :] < lengths[:, None], tokens, -100)
    return torch.from_numpy(tokens[:, :-1]), torch.from_numpy(targets[:, 1:]), lengths


# ---------------------------------------------------------------- the data

def sequences(rows: int, seed: int) -> tuple[list[np.ndarray], np.ndarray]:
    """`rows` token sequences of log-uniform lengths, and their lengths."""
    rng = np.random.default_rng(seed)
    lengths = np.clip(np.exp(rng.uniform(np.log(MIN_LENGTH), np.log(MAX_LENGTH), rows)).astype(np.int64), MIN_LENGTH,
                      MAX_LENGTH)
    start, step = rng.integers(0, VOCAB, rows), rng.integers(1, 8, rows)
    return [((s + k * np.arange(n)) % VOCAB).astype(np.int16) for s, k, n in zip(start, step, lengths)], lengths


def write_set(folder: Path, rows: int, seed: int = 0) -> Path:
    tokens, lengths = sequences(rows, seed)
    path = folder / "train.parquet"
    table = pa.table({"tokens": pa.array(tokens, pa.list_(pa.int16())), "length": pa.array(lengths, pa.int32())})
    pq.write_table(table, path, row_group_size=128)
    return path


def spec_of(path: Path, length_column: str | None):
    """The train spec datasets/splits.inspect makes for a task reading ("tokens",), with data.length_column set or
    not (no sample_id column: rows are numbered in file order)."""
    from stride.datasets.splits import DataSpec, open_split

    class Data:
        train_path = str(path)

    split = open_split(Data, "train")
    columns = ("tokens",)
    schema = pa.schema([split.schema.field(c) for c in (*columns, *([length_column] if length_column else []))])
    return DataSpec(columns, False, split.num_rows, split.layouts, split.blocks, "train", schema=schema,
                    length_column=length_column,
                    row_bytes=sum(lay.data_bytes for lay in split.layouts) / split.num_rows)


# ---------------------------------------------------------------- one epoch

@torch.no_grad()
def val_loss(model: nn.Module, val: list[np.ndarray], batch: int) -> float:
    """Next-token loss per real token over a fixed held-out set (the same for both sides), after the epoch: that
    both sides trained alike."""
    total = count = 0.0
    by_length = sorted(val, key=len)
    for lo in range(0, len(by_length), batch):
        x, y, _ = padded(by_length[lo:lo + batch])
        total += F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1), ignore_index=-100, reduction="sum").item()
        count += int((y != -100).sum())
    return total / count


class Side:
    """One side's epoch, a step at a time: a fresh model (initial weights from `seed`) and optimizer, a TrainStream over
    its spec, each micro-batch padded to its longest row and stepped. `seconds` counts this side's own time only:
    building the stream and every step (the next micro-batch, padding, forward, backward, AdamW)."""

    def __init__(self, spec, seed: int, batch: int, dims: dict):
        from stride.datasets.bucketing import Padding
        from stride.datasets.mixing import order_for
        from stride.datasets.stream import TrainStream

        torch.manual_seed(seed)
        self.model = TinyLM(**dims)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=LR)
        self.padding, self.losses, self.compute_s, self.tokens, self.cells = Padding(), [], 0.0, 0, 0
        t0 = time.perf_counter()
        self.order = order_for(spec, seed, batch, WINDOW_ROWS, WINDOW_BYTES)
        self.steps = self.order.micro_steps_per_epoch
        self.stream = TrainStream(spec, self.order, 0, 1, 0, READ_AHEAD, self.steps)
        self.seconds = time.perf_counter() - t0

    def step(self) -> None:
        t0 = time.perf_counter()
        rows = self.stream.next()
        x, y, lengths = padded(rows.data["tokens"])
        self.padding.add(lengths.astype(np.float64))
        self.tokens, self.cells = self.tokens + int(lengths.sum()), self.cells + int(lengths.max()) * len(lengths)
        t = time.perf_counter()
        loss = F.cross_entropy(self.model(x).reshape(-1, VOCAB), y.reshape(-1), ignore_index=-100)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        self.losses.append(loss.item())
        done = time.perf_counter()
        self.compute_s += done - t
        self.seconds += done - t0

    def finish(self, val: list[np.ndarray], batch: int) -> dict:
        try:
            stride_padding = self.stream.padding.take() if self.stream.padding is not None else None
        finally:
            self.stream.close()
        return {"epoch_s": self.seconds, "compute_s": self.compute_s, "steps": self.steps, "rows": self.steps * batch,
                "padding_fraction": self.padding.take(), "stride_padding_fraction": stride_padding,
                "tokens": self.tokens, "padded_tokens": self.cells, "window_rows": self.order.window_rows,
                "mean_loss": float(np.mean(self.losses)), "val_loss": val_loss(self.model, val, batch)}


def warm_up(dims: dict, batch: int) -> None:
    """A few steps at short, middle and full lengths: oneDNN's kernels and the allocator, for both sides alike."""
    torch.manual_seed(0)
    model = TinyLM(**dims)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    for n in (MIN_LENGTH, 100, MAX_LENGTH):
        x = torch.randint(0, VOCAB, (batch, n))
        F.cross_entropy(model(x[:, :-1]).reshape(-1, VOCAB), x[:, 1:].reshape(-1)).backward()
        optimizer.step()


def measure(reps: int = 5, smoke: bool = False) -> dict:
    """`reps` pairs of epochs, bucketed and unbucketed, interleaved step by step. Returns the raw runs
    (figures.bucketing_figures makes the figures)."""
    rows, batch, dims = (SMOKE["rows"], SMOKE["batch"], SMOKE["model"]) if smoke else (ROWS, BATCH, MODEL)
    torch.set_num_threads(THREADS)
    tmp = Path(tempfile.mkdtemp(prefix="stride-bucketing-bench-"))
    t0 = time.perf_counter()
    started = datetime.now().isoformat(timespec="seconds")
    try:
        path = write_set(tmp, rows)
        lengths = pq.read_table(path, columns=["length"]).column("length").to_numpy()
        specs = {"bucketed": spec_of(path, "length"), "unbucketed": spec_of(path, None)}
        val = sequences(VAL_ROWS, 1)[0]
        warm_up(dims, batch)
        runs = []
        for rep in range(reps):
            load, t0_pair = os.getloadavg()[0], time.perf_counter()
            sides = {v: Side(specs[v], rep, batch, dims) for v in (VARIANTS if rep % 2 == 0 else VARIANTS[::-1])}
            steps = sides["bucketed"].steps
            if sides["unbucketed"].steps != steps:
                raise RuntimeError("the two sides' epochs have different numbers of steps")
            for i in range(steps):  # step by step, ABBA...: a burst of other work weighs on both sides alike
                for v in (VARIANTS if (i + rep) % 2 == 0 else VARIANTS[::-1]):
                    sides[v].step()
            pair_s = time.perf_counter() - t0_pair
            for v in VARIANTS:
                r = sides[v].finish(val, batch)
                runs.append({"rep": rep, "variant": v, "seed": rep, **r, "pair_wall_s": pair_s, "loadavg_before": load,
                             "loadavg_after": os.getloadavg()[0]})
                print(f"bucketing_bench: rep {rep + 1}/{reps} {v:10s} epoch {r['epoch_s']:.1f}s (compute "
                      f"{r['compute_s']:.1f}s), padding {r['padding_fraction']:.3f}, held-out loss "
                      f"{r['val_loss']:.3f} (load {os.getloadavg()[0]:.1f})", flush=True)
            on, off = runs[-2:]
            reported = on["stride_padding_fraction"]
            if reported is None or abs(reported - on["padding_fraction"]) > 1e-9:
                raise RuntimeError(f"the stream's padding_fraction {on['stride_padding_fraction']} is not the padding "
                                   f"counted over its batches {on['padding_fraction']}")
            if on["rows"] != off["rows"]:
                raise RuntimeError("the two sides trained on different numbers of rows")
        params = sum(p.numel() for p in TinyLM(**dims).parameters())
        return {"started": started, "cpu_count": os.cpu_count(), "cpu_model": cpu_model(), "rows": rows,
                "batch": batch, "threads": THREADS, "min_length": MIN_LENGTH, "max_length": MAX_LENGTH,
                "mean_length": float(lengths.mean()), "val_rows": VAL_ROWS, "model": {**dims, "params": params},
                "runs": runs, "wall_s": time.perf_counter() - t0}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python benchmarks/bucketing_bench.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=5, help="repetitions (samples); a verdict needs 5")
    ap.add_argument("--smoke", action="store_true", help="a tiny set and model, 1 repetition")
    ap.add_argument("--out", help="also write the JSON here")
    args = ap.parse_args(argv)
    from benchmarks.figures import bucketing_figures  # after the path set-up above

    raw = measure(1 if args.smoke else args.reps, args.smoke)
    print_json({**bucketing_figures({"bucketing": raw}), "raw": raw}, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
