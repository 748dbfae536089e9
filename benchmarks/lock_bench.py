"""What the run lock costs a training step (-> lock_overhead_ratio), side by side in one process.

    python benchmarks/lock_bench.py                 # 5 repetitions; prints the figure and the raw runs as JSON

The same short training loop (trainers/configs/tabular_mlp.yaml's model and batch: an MLP of 256 x 256 units, 64 rows
a step, AdamW, one thread: a fraction of a millisecond a step, so that a fixed cost per step shows as much as it can)
runs in chunks of steps that alternate between two variants, while a real run lock is held on a temporary run folder
(trainers/run/lock.py):

* lock: the loop's real fence, `Fence.still_holds()`, at every log step (every 50 steps, tabular_mlp.yaml's
  train.log_every_steps), and a heartbeat, `RunLock.beat()`, every 0.25 s, called inline in the training thread (the
  real one beats from a thread of its own, every 5 s at the default run.lock_stale_s): an upper bound;
* none: a no-op where the check was, no inline beat.

Chunks alternate ABBA..., 200 pairs per repetition, so a load that drifts (this machine's other work) weighs on both
variants alike; coarser interleaving (chunks of seconds) gave A/A differences of a few percent here. Per repetition
the sample is the median over its pairs of a chunk's time with the lock / the adjacent one without (a burst of other
work spoils one pair, not the sample); benchmarks/figures.py takes the median over repetitions.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

LOG_EVERY = 50
BEAT_S = 0.25  # 20 times the default heartbeat rate (run.lock_stale_s=60 beats every 5 s)


def measure(reps: int = 5, chunks: int = 200, chunk_steps: int = LOG_EVERY) -> dict:
    """Every repetition: `chunks` chunks of `chunk_steps` steps per variant, interleaved. Returns the raw runs."""
    import torch

    from stride.trainers.run import lock as runlock

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256), torch.nn.ReLU(),
                                torch.nn.Linear(256, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    x, y = torch.randn(64, 32), torch.randint(0, 4, (64,))

    def chunk(check, beat) -> float:
        t0 = time.perf_counter()
        for step in range(1, chunk_steps + 1):
            optimizer.zero_grad(set_to_none=True)
            torch.nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
            if step % LOG_EVERY == 0:
                check()
            beat()
        return time.perf_counter() - t0

    def noop() -> None:
        pass

    runs = []
    with tempfile.TemporaryDirectory(prefix="stride-lock-bench-") as tmp, runlock.acquire(Path(tmp), 60) as lock:
        fence, last_beat = runlock.Fence(tmp, lock.token, 60), [time.perf_counter()]

        def beat() -> None:
            if time.perf_counter() - last_beat[0] >= BEAT_S:
                lock.beat()
                last_beat[0] = time.perf_counter()

        for _ in range(20):
            chunk(noop, noop)  # warm-up: allocator, optimizer state
        for rep in range(reps):
            chunk_s: dict[str, list[float]] = {"lock": [], "none": []}
            for i in range(chunks):
                for variant in (("lock", "none") if (i + rep) % 2 == 0 else ("none", "lock")):
                    chunk_s[variant].append(chunk(fence.still_holds, beat) if variant == "lock" else chunk(noop, noop))
            runs += [{"rep": rep, "variant": v, "chunk_s": c, "chunk_steps": chunk_steps} for v, c in chunk_s.items()]
    return {"log_every": LOG_EVERY, "heartbeat_s": BEAT_S, "runs": runs}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python benchmarks/lock_bench.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args(argv)
    from benchmarks.figures import lock_figure  # after the path set-up above

    raw = measure(args.reps)
    print(json.dumps({"lock_overhead_ratio": lock_figure({"lock": raw}), "raw": raw}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
