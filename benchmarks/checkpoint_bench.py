"""What a checkpoint costs each rank of a 2-worker FSDP run: the earlier rank-0 gather vs DCP shards, side by side.

    python benchmarks/checkpoint_bench.py          # char_gpt 24 layers x width 1024, 16 heads: 302.6M parameters
    python benchmarks/checkpoint_bench.py --layers 2 --width 256 --heads 4 --reps 1 --out ckpt.json   # a check

The default is the largest char_gpt that trains on 2 CPU workers of this 23.5 GiB machine under FSDP
(docs/fsdp.md#memory); make bench runs it (benchmarks/run.py).

Launches `torch.distributed.run --nproc-per-node 2` of itself (gloo, CPU, 1 thread per rank) once per method and
repetition, alternating which goes first: a fresh pair of processes each time, so that neither method starts on
memory the other left in the heap. Each rank builds the same char_gpt, shards it with Stride's FSDP
(trainers/fsdp.py), fills AdamW's state (one step on zero gradients), then checkpoints once:

* gather (the format before issue 15): `get_state_dict(full_state_dict=True, cpu_offload=True)` gathers the whole
  model and optimizer onto rank 0, which copies it (staging, so training may go on) and writes one state.pt with
  torch.save. Training is blocked for the gather and the copy; the write ran in Ray's upload thread.
* dcp (now): trainers/run/checkpointing.py's CheckpointWriter. Every rank stages its own shards (blocked), DCP writes
  one file per rank in a background thread, rank 0 hashes every file and writes meta.json last.

Per rank: peak RSS above the rank's resident memory just before the checkpoint (sampled every 5 ms by a thread),
the time training is blocked, and the time until the checkpoint is complete on storage. `measure` returns these raw
records (one per method, repetition and rank), for benchmarks/run.py; alone, the script prints them as JSON (and
--out) with the figures benchmarks/figures.py makes of them: a sample per repetition (--reps, 5), DCP / gather.
"""

from __future__ import annotations

import argparse
import json
import os
import runpy
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.append(str(REPO))  # appended: the repository's datasets/ must not hide Hugging Face's `datasets`

from benchmarks.procs import free_port, rss_bytes  # noqa: E402

STATE = "state.pt"  # the earlier format's single file, as the rank-0 gather wrote it




class PeakRSS:
    """Samples this process's resident memory every 5 ms between start() and stop()."""

    def __init__(self):
        self.base = self.peak = 0
        self._stop = threading.Event()

    def __enter__(self):
        self.base = self.peak = rss_bytes()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_bytes())

    def _run(self):
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, rss_bytes())


def gather_checkpoint(model, optimizer, folder: Path, rank: int) -> tuple[float, float]:
    """The earlier format: full state on rank 0, staged, written with torch.save. (blocked s, complete s)."""
    import torch
    import torch.distributed as dist

    from stride.trainers import fsdp

    t0 = time.perf_counter()
    model_state, optim_state = fsdp.full_state_dict(model, optimizer)  # a collective: every rank sends its shards
    staged = None
    if rank == 0:
        staged = {k: v.detach().clone() if isinstance(v, torch.Tensor) else v for k, v in model_state.items()}
        staged = {"model": staged, "optimizer": _copy(optim_state)}
    del model_state, optim_state
    blocked = time.perf_counter() - t0
    if rank == 0:
        folder.mkdir(parents=True)
        with open(folder / STATE, "wb") as f:
            torch.save(staged, f)
            f.flush()
            os.fsync(f.fileno())
        del staged
    dist.barrier()
    return blocked, time.perf_counter() - t0


def _copy(obj):
    import torch

    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: _copy(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_copy(v) for v in obj)
    return obj


def dcp_checkpoint(writer, model, optimizer, folder: Path) -> tuple[float, float]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    t0 = time.perf_counter()
    model_state, optim_state = get_state_dict(model, optimizer)
    future = writer.save(folder, {"model": model_state, "optim": optim_state}, {"step": 1})
    blocked = time.perf_counter() - t0
    future.result()
    return blocked, time.perf_counter() - t0


def worker(args) -> None:
    import torch
    import torch.distributed as dist

    from stride.trainers import fsdp
    from stride.trainers.run import checkpointing
    from stride.trainers.models import CharGPT

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = CharGPT(256, 64, args.layers, args.heads, args.width)  # (vocab, context, layers, heads, width)
    params = sum(p.numel() for p in model.parameters())
    model = fsdp.shard_model(model, list(model.blocks), torch.device("cpu"), fsdp.Mesh.flat(world), None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()  # AdamW's moments exist, as in a run that has trained
    optimizer.zero_grad(set_to_none=True)
    writer = checkpointing.CheckpointWriter(rank, dist.new_group(backend="gloo"))
    folder = Path(args.dir) / args.method
    dist.barrier()
    with PeakRSS() as mem:
        if args.method == "gather":
            blocked, done = gather_checkpoint(model, optimizer, folder, rank)
        else:
            blocked, done = dcp_checkpoint(writer, model, optimizer, folder)
    dist.barrier()
    size = sum(p.stat().st_size for p in folder.glob("*") if p.is_file()) if rank == 0 else 0
    mine = {"rank": rank, "peak_rss_bytes": mem.peak, "base_rss_bytes": mem.base,
            "peak_increase_bytes": mem.peak - mem.base, "blocked_s": blocked, "complete_s": done, "folder_bytes": size}
    every = [None] * world
    dist.all_gather_object(every, mine)
    if rank == 0:
        Path(args.result).write_text(json.dumps({"params": params, "layers": args.layers, "width": args.width,
                                                 "world_size": world, "method": args.method, "ranks": every}))
        shutil.rmtree(folder, ignore_errors=True)
    writer.close()
    dist.destroy_process_group()


def measure(layers: int, width: int, heads: int, reps: int, tmp: Path, timeout_s: float = 900) -> dict:
    tmp.mkdir(parents=True, exist_ok=True)
    raw: dict = {"reps": reps, "runs": [], "failed_launches": []}
    for rep in range(reps):
        for method in (("gather", "dcp") if rep % 2 == 0 else ("dcp", "gather")):
            result = tmp / f"{method}_{rep}.json"
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                   str(Path(__file__).resolve()), "--worker", "--method", method, "--layers",
                   str(layers), "--width", str(width), "--heads", str(heads), "--dir", str(tmp / "ckpts"),
                   "--result", str(result)]
            for attempt in (1, 2):  # gloo's run loop crashed once here (SIGSEGV in libc) during the gather: retry
                r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout_s,
                                   env=dict(os.environ, OMP_NUM_THREADS="1"))
                if r.returncode == 0:
                    break
                raw["failed_launches"].append(
                    {"method": method, "rep": rep, "exit": r.returncode, "stderr_tail": r.stderr[-1500:]})
                if attempt == 2:
                    raise RuntimeError(f"checkpoint_bench {method} failed (exit {r.returncode}):\n{r.stdout[-3000:]}\n"
                                       f"{r.stderr[-3000:]}")
            one = json.loads(result.read_text())
            raw.update(params=one["params"], model=f"char_gpt {one['layers']} layers x width {one['width']}",
                       world_size=one["world_size"])
            raw["runs"].extend({"method": method, "rep": rep, **r} for r in one["ranks"])
    return raw


def report(raw: dict) -> dict:
    """A standalone run's figures, computed as make bench computes them (benchmarks/figures.py, run by path: the
    repository root is not on sys.path here)."""
    f = runpy.run_path(str(Path(__file__).with_name("figures.py")))
    figs = f["checkpoint_figures"]({"checkpoint": raw})
    return {"figures": figs, "goals": f["goals"](figs), "per_rank": f["checkpoint_medians"]({"checkpoint": raw})}




def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--reps", type=int, default=5, help="repetitions (samples); a verdict needs 5")
    ap.add_argument("--out", help="also write the JSON here")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--method", choices=("gather", "dcp"), help=argparse.SUPPRESS)
    ap.add_argument("--dir", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    tmp = Path(tempfile.mkdtemp(prefix="stride-ckpt-bench-"))
    try:
        out = measure(args.layers, args.width, args.heads, args.reps, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    text = json.dumps({"raw": out, **report(out)}, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    if not __package__:  # run as a file from a checkout: import Stride as the `stride` package
        import runpy

        runpy.run_path(str(REPO / "stride" / "_checkout.py"))
    sys.exit(main())
