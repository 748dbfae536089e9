"""What fine-tuning costs: init.from's set-up memory under FSDP and DDP, the step with half the model frozen, and
init.from's load time, each measured side by side (-> init_peak_memory_ratio, init_peak_memory_ratio_ddp,
frozen_step_time_ratio, init_load_ratio).

    python benchmarks/finetune_bench.py                     # 5 repetitions; prints the figures and the raw runs as JSON
    python benchmarks/finetune_bench.py --smoke --reps 1    # tiny models: a check that every part runs

The model is this file's own task, `FinetuneTask` (model.name="benchmarks.finetune_bench:FinetuneTask", found the
way model.name finds a user's task): an input layer, a stack of identical residual blocks of two Linears (width ->
hidden -> width; the task's blocks(), FSDP's units) and a classifier head. Once per bench run a seeded copy of the big
one (18 blocks of 2048 -> 4096 -> 2048: 302.3M parameters, a 1.21 GB safetensors file) is written to a temporary
folder, which is removed at the end. Three parts:

* memory (init_peak_memory_ratio, init_peak_memory_ratio_ddp): `torch.distributed.run --nproc-per-node 2` of this
  file (gloo on CPU, NCCL where CUDA exists) with init.from set to that file, train.strategy=fsdp or ddp, a fresh
  pair of processes for each, alternating which goes first between repetitions. Each rank builds a real Trainer
  (trainers/loop.py) from a Config, a WorkerEnv and a RunPlan as trainers/torchrun.py builds them, with a data spec
  of one invented row group (setup() reads only its row counts; no data is read) and runs `Trainer.setup()`, its own
  code from start to end; only `Trainer.build_model()` (building the model and loading init.from, up to the
  optimizer) is measured, by wrapping it. Per rank: the peak of its memory during build_model above the memory just
  before, sampled every 5 ms by a thread. The figure is the largest rank's rise / the model's full fp32 size, per
  repetition. On CUDA the memory is torch.cuda.max_memory_allocated after reset_peak_memory_stats. On CPU it is the
  process's anonymous resident memory (RssAnon of /proc/self/status): what the process itself allocated, the CPU
  counterpart of the CUDA figure. safetensors (0.8) hands out tensors backed by the file's mmap, so every page of the
  file a rank reads also shows in its RSS (RssFile) until the file is closed; those pages are the kernel's page cache,
  the same physical pages in both ranks and reclaimable, not memory the rank holds. The JSON keeps both, and the
  ratio with the file's pages counted (VmRSS, RssAnon + RssFile) is beside each figure (`rss_ratio`): the same
  counting for both paths, FSDP ranks reading their half of each tensor, DDP ranks the whole file.
* step (frozen_step_time_ratio): one `torch.distributed.run --nproc-per-node 2` launch (DDP over gloo, 1 thread per
  rank: the skipped all-reduce of frozen parameters shows) holding two real Trainers of a smaller model (8 blocks of
  768 -> 1536 -> 768, 19.0M parameters, 32 rows per rank: ~0.25 s a step here), one with optim.groups=[{match: <the
  first half of the blocks>, freeze: true}] and one all trainable, each through setup() and restore() (DDP built over
  what requires grad after Freezer.apply(0), as the loop does). Steps are `Trainer.step()` (the loop's: unfreeze,
  train_step, scheduler) on a fresh random batch each (the same sequence for both variants, made before the clock
  starts). Chunks of steps alternate ABBA..., as in lock_bench.py; per repetition the sample is the median over its
  chunk pairs of the frozen chunk's time / the adjacent trainable one's (each chunk timed as its slowest rank).
* load (init_load_ratio): one process, one thread (a worker's default, scaling.cpus_per_worker=1), the big model
  built once; the file read once beforehand so that the page cache is warm for every variant. Per repetition, in
  alternating order: `stride.trainers.pretrained.init_model(model, path, strict=True, include=[], exclude=[],
  rename=[])` and `safetensors.torch.load_file(path)`. safetensors 0.8's load_file maps the file and reads no tensor
  data until it is used (a millisecond for 1.2 GB), so it is timed together with a `.clone()` of every tensor it
  returns: the bytes a load has to move into process memory (the copy into a model is not included). The figure's
  numerator is init_model given the file's sha256, as a worker is (the driver hashes init.from once for its check and
  hands the digest on: RunPlan.init_sha256); also timed, for where the time goes: init_model hashing the file itself
  (`hashing_ratio`: what a caller without the digest pays; the process's digest cache, keyed by the file's identity
  and filled by the digest made before timing, misses before each of these runs: the file's mtime moves on a second,
  untimed, so that each hashes the whole file: ~0.07 s per 100 MB here) and load_file alone (`lazy_ratio`). The
  sample is init_model (given the digest) / load_file (+ read), per repetition.

Why it is fair: both sides of every figure run the same model, the same file and Stride's own code paths, measured
the same way, interleaved so that this machine's other work weighs on both; memory in fresh processes for each path,
so that neither inherits the other's heap. `measure` returns the raw runs for benchmarks/run.py; benchmarks/figures.py
computes the figures from them.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.append(str(REPO))  # appended: the repository's datasets/ must not hide Hugging Face's `datasets`

from benchmarks.report import print_json  # noqa: E402
from stride import Task  # noqa: E402

TASK = "benchmarks.finetune_bench:FinetuneTask"
MODELS = {  # FinetuneTask.Config fields
    "big": {"blocks": 18, "width": 2048, "hidden": 4096},  # 302.3M parameters: init.from's file, 1.21 GB
    "step": {"blocks": 8, "width": 768, "hidden": 1536},  # 19M: a CPU step of ~0.1-0.5 s
}
SMOKE_MODELS = {"big": {"blocks": 2, "width": 128, "hidden": 256}, "step": {"blocks": 4, "width": 64, "hidden": 128}}
STEP_BATCH = 32  # rows per rank per step
CHUNK_STEPS = 2  # steps per chunk of the step part
PAIRS = 6  # chunk pairs per repetition
WARMUP_STEPS = 2  # per variant, before the first timed chunk
LOAD_VARIANTS = ("init_model", "load_file_read", "init_model_given_sha256", "load_file")


# ---------------------------------------------------------------- the task

class Block(nn.Module):
    def __init__(self, width: int, hidden: int):
        super().__init__()
        self.up = nn.Linear(width, hidden)
        self.down = nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class BlockStack(nn.Module):
    def __init__(self, inputs: int, width: int, hidden: int, blocks: int, classes: int):
        super().__init__()
        self.inp = nn.Linear(inputs, width)
        self.blocks = nn.ModuleList(Block(width, hidden) for _ in range(blocks))
        self.out = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.out(x)


class FinetuneTask(Task):
    """A stack of identical residual MLP blocks over random features: a model of a chosen size, nothing else."""

    class Config(Task.Config):
        blocks: int = 18
        width: int = 2048
        hidden: int = 4096
        inputs: int = 64
        classes: int = 16

    columns = ("x", "y")

    def transform(self, batch):
        return {"x": np.asarray(batch["x"], dtype=np.float32), "y": np.asarray(batch["y"], dtype=np.int64)}

    def build_model(self) -> nn.Module:
        c = self.config
        return BlockStack(c.inputs, c.width, c.hidden, c.blocks, c.classes)

    def loss(self, model, batch):
        return nn.functional.cross_entropy(model(batch["x"]), batch["y"])

    def blocks(self, model):
        return list(model.blocks)


def frozen_match(blocks: int) -> str:
    """optim.groups' match of the first half of the blocks (the lower layers, as a fine-tuning freezes them)."""
    return r"^blocks\.(" + "|".join(str(i) for i in range(blocks // 2)) + r")\."


def config(dims: dict, storage: Path, **sections):
    from stride import load_config

    raw = {"run": {"name": "finetune-bench", "storage_path": str(storage)}, "model": {"name": TASK, **dims},
           "tracking": {"mlflow": False}, "train": {"max_steps": 10_000, "batch_size_per_worker": STEP_BATCH}}
    for section, values in sections.items():
        raw[section] = {**raw.get(section, {}), **values}
    # Every key as a command-line override (`section.key=<value>`, the value as JSON, which YAML reads as it is).
    return load_config(None, [f"{section}.{key}={json.dumps(value)}" for section, body in raw.items()
                              for key, value in body.items()])


def trainer(cfg, rank: int, world: int, local_rank: int, device: torch.device):
    """A Trainer as trainers/torchrun.py builds one: its Config, WorkerEnv and RunPlan. The data spec is one
    invented row group: setup() reads its row counts (the data order), and nothing here reads data."""
    from stride.datasets.splits import DataSpec
    from stride.trainers.loop import Trainer, WorkerEnv, plan_run

    def wrap_model(m):
        if world == 1:
            return m
        return torch.nn.parallel.DistributedDataParallel(m, device_ids=[local_rank] if device.type == "cuda" else None)

    env = WorkerEnv(rank, world, local_rank, device, wrap_model=wrap_model, latest_checkpoint=lambda: None,
                    report=lambda metrics, written: None, node=socket.gethostname())
    rows = 64 * STEP_BATCH * world
    spec = DataSpec(columns=FinetuneTask.columns, has_sample_id=False, num_rows=rows, blocks=((0, 0, rows),))
    return Trainer(cfg, env, plan_run(cfg, {"train": spec}, {}))


# ---------------------------------------------------------------- memory

def status_kib(fields=("VmRSS", "RssAnon", "RssFile")) -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in fields:
                out[key] = int(value.split()[0]) * 1024
    return out


class PeakMemory:
    """This process's memory every 5 ms between enter and exit: the peak of each of VmRSS, RssAnon and RssFile, and
    on CUDA the device's max_memory_allocated, each above its value at enter."""

    def __init__(self, device: torch.device):
        self.device, self._stop = device, threading.Event()

    def __enter__(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.cuda_base = torch.cuda.memory_allocated(self.device)
        self.base = status_kib()  # a field this kernel does not report (gVisor's) stays out: None in the record
        self.peak = dict(self.base)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        for k, v in status_kib().items():
            self.peak[k] = max(self.peak[k], v)

    def _run(self):
        while not self._stop.wait(0.005):
            self._sample()

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self._sample()
        self.cuda_rise = None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.cuda_rise = torch.cuda.max_memory_allocated(self.device) - self.cuda_base

    def record(self) -> dict:
        rise = {k: self.peak[k] - self.base[k] for k in self.base}
        return {"base_rss_bytes": self.base.get("VmRSS"), "peak_rss_bytes": self.peak.get("VmRSS"),
                "peak_anon_increase_bytes": rise.get("RssAnon"), "peak_file_increase_bytes": rise.get("RssFile"),
                "peak_rss_increase_bytes": rise.get("VmRSS"), "cuda_peak_increase_bytes": self.cuda_rise,
                # the figure's: the device's allocations on CUDA, the process's own (anonymous) memory on CPU
                "peak_increase_bytes": self.cuda_rise if self.cuda_rise is not None else rise.get("RssAnon")}


def init_distributed() -> tuple[int, int, int, torch.device]:
    import torch.distributed as dist

    rank, world, local_rank = (int(os.environ[k]) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
    # a GPU per rank, as trainers/torchrun.py needs; with fewer (one GPU, 2 ranks) the ranks run on the CPU
    use_cuda = torch.cuda.is_available() and torch.cuda.device_count() >= int(os.environ["LOCAL_WORLD_SIZE"])
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if use_cuda else "gloo")
    return rank, world, local_rank, device


def leave_process_group() -> None:
    """As trainers/torchrun.py ends a rank: the process group destroyed while the interpreter is alive, then (main)
    os._exit, no interpreter finalization. Left to finalization, gloo's threads were torn down unjoined after the
    result was written ("terminate called without an active exception", SIGABRT) in 3 of 10 launches here."""
    import gc

    import torch.distributed as dist

    gc.collect()
    dist.destroy_process_group()


def memory_worker(args) -> None:
    """One rank of one launch: Trainer.setup() with init.from, its build_model measured."""
    import torch.distributed as dist

    from stride.trainers import fsdp

    rank, world, local_rank, device = init_distributed()
    cfg = config(json.loads(args.dims), Path(args.dir), init={"from": args.file}, train={"strategy": args.strategy})
    t = trainer(cfg, rank, world, local_rank, device)
    build, seen = t.build_model, {}

    def measured_build_model():
        dist.barrier()  # both ranks start together, as in a launch
        with PeakMemory(device) as mem:
            t0 = time.perf_counter()
            model = build()
            seen["build_s"] = time.perf_counter() - t0
        seen["memory"] = mem.record()
        seen["full_bytes"] = sum(p.numel() for p in model.parameters()) * 4  # fp32; a DTensor counts its full shape
        seen["local_param_bytes"] = fsdp.local_param_bytes(model)
        return model

    t.build_model = measured_build_model  # the instance's attribute: setup() calls it where it calls build_model
    t.setup()
    t.writer.close()
    mine = {"rank": rank, "strategy": t.strategy, "device": str(device), "build_s": seen["build_s"],
            "full_bytes": seen["full_bytes"], "local_param_bytes": seen["local_param_bytes"], "init": t.init_record,
            **seen["memory"]}
    every = [None] * world
    dist.all_gather_object(every, mine)
    if rank == 0:
        Path(args.result).write_text(json.dumps(every))
    leave_process_group()


# ---------------------------------------------------------------- step

def step_worker(args) -> None:
    """One rank: two Trainers of the same model, half frozen and all trainable, stepped in alternating chunks."""
    import torch.distributed as dist

    rank, world, local_rank, device = init_distributed()
    dims = json.loads(args.dims)
    frozen_group = {"match": frozen_match(dims["blocks"]), "freeze": True, "name": "frozen"}
    trainers = {}
    for variant, groups in (("trainable", []), ("frozen", [frozen_group])):
        t = trainer(config(dims, Path(args.dir), optim={"groups": groups}), rank, world, local_rank, device)
        t.setup()
        t.restore()  # DDP over the parameters that require grad after the step-0 freeze
        trainers[variant] = t
    counts = {v: (sum(p.numel() for p in t.raw_model.parameters()),
                  sum(p.numel() for p in t.raw_model.parameters() if p.requires_grad)) for v, t in trainers.items()}
    c = trainers["trainable"].cfg
    rngs = {v: np.random.default_rng(rank) for v in trainers}  # each variant the same batches, a fresh one a step
    nonfinite = {v: 0 for v in trainers}

    def batch(variant: str) -> list:
        """A step's batch (random features and labels: nothing to memorise), made before the chunk's clock starts,
        as the loop's data wait is not step time."""
        rng = rngs[variant]
        rows = {"x": rng.standard_normal((STEP_BATCH, c.model.inputs), dtype=np.float32),
                "y": rng.integers(0, c.model.classes, STEP_BATCH)}
        return [{k: torch.from_numpy(np.ascontiguousarray(v)).to(device)
                 for k, v in trainers[variant].task.transform(rows).items()}]

    def chunk(variant: str, steps: int) -> float:
        t = trainers[variant]
        batches = [batch(variant) for _ in range(steps)]
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        for micro_batches in batches:
            nonfinite[variant] += not t.step(micro_batches).finite
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - t0

    for variant in trainers:
        chunk(variant, WARMUP_STEPS)
    runs = []
    for rep in range(args.reps):
        chunk_s: dict[str, list[float]] = {"frozen": [], "trainable": []}
        for i in range(args.pairs):
            for variant in (("frozen", "trainable") if (i + rep) % 2 == 0 else ("trainable", "frozen")):
                chunk_s[variant].append(chunk(variant, args.chunk_steps))
        runs += [{"rep": rep, "variant": v, "rank": rank, "chunk_s": s} for v, s in chunk_s.items()]
    for t in trainers.values():
        t.writer.close()
    every = [None] * world
    dist.all_gather_object(every, runs)
    if rank == 0:
        Path(args.result).write_text(json.dumps({
            "world_size": world, "device": str(device), "batch_per_rank": STEP_BATCH, "chunk_steps": args.chunk_steps,
            "pairs": args.pairs, "warmup_steps": WARMUP_STEPS, "params": counts["trainable"][0],
            "trainable_params": {v: n for v, (_, n) in counts.items()}, "frozen_match": frozen_group["match"],
            "nonfinite_steps": nonfinite, "runs": [r for rank_runs in every for r in rank_runs]}))
    leave_process_group()


# ---------------------------------------------------------------- load

def cold_digest(path: str) -> None:
    """Move the file's mtime on a whole second (coarse filesystems keep no less). pretrained caches a process's
    digests by (device, inode, size, mtime): with a new mtime init_model hashes the whole file again instead of reusing
    the digest made before timing."""
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))


def load_worker(args) -> None:
    """One process: init_model and load_file of the same file, alternating, into / beside an already-built model."""
    from safetensors.torch import load_file

    from stride.trainers import pretrained
    from stride.trainers.tasks import make_task

    torch.set_num_threads(1)
    cfg = config(json.loads(args.dims), Path(args.dir))
    torch.manual_seed(cfg.run.seed)
    model = make_task(cfg, {}).build_model()
    path = args.file
    with open(path, "rb") as f:  # the page cache warm for every variant
        while f.read(1 << 24):
            pass
    with pretrained.open_source(path) as source:
        sha = source.sha256()  # what the driver's check hands the workers (RunPlan.init_sha256)

    def run(variant: str) -> float:
        """Seconds until the tensors are in the model (init_model) or returned (load_file); freeing what load_file
        returned is not timed."""
        held = None
        if variant == "init_model":  # a cold digest, as for a file this process never hashed
            cold_digest(path)
        t0 = time.perf_counter()
        if variant == "init_model":
            pretrained.init_model(model, path, strict=True, include=[], exclude=[], rename=[])
        elif variant == "init_model_given_sha256":
            pretrained.init_model(model, path, strict=True, include=[], exclude=[], rename=[], sha256=sha)
        elif variant == "load_file":
            held = load_file(path)
        else:  # load_file_read
            held = {k: v.clone() for k, v in load_file(path).items()}
        seconds = time.perf_counter() - t0
        del held
        return seconds

    for variant in LOAD_VARIANTS:  # warm-up: the allocator, the first page faults of each path
        run(variant)
    runs = []
    for rep in range(args.reps):
        for variant in (LOAD_VARIANTS if rep % 2 == 0 else LOAD_VARIANTS[::-1]):
            runs.append({"rep": rep, "variant": variant, "seconds": run(variant)})
    # "digest": "cold": every init_model run hashed the file (figures.py reports hashing_ratio only then)
    Path(args.result).write_text(json.dumps({"threads": torch.get_num_threads(), "digest": "cold", "runs": runs}))


# ---------------------------------------------------------------- the file

def write_worker(args) -> None:
    """The init.from file: a seeded model (seed 1, not the run's 0, so that loading it changes every weight)."""
    from safetensors.torch import save_file

    from stride.trainers.tasks import make_task

    cfg = config(json.loads(args.dims), Path(args.dir))
    torch.manual_seed(1)
    model = make_task(cfg, {}).build_model()
    save_file(model.state_dict(), args.file)
    Path(args.result).write_text(json.dumps({"params": sum(p.numel() for p in model.parameters()),
                                             "tensors": len(model.state_dict()),
                                             "file_bytes": os.path.getsize(args.file)}))


# ---------------------------------------------------------------- launching



def launch(worker: str, nproc: int | None, tmp: Path, name: str, timeout_s: float, failed: list, **opts) -> dict:
    """This file as a worker (`nproc` ranks under torch.distributed.run, or one plain process); its JSON result.
    A failed launch is retried once (gloo crashed once here in checkpoint_bench's launches) and recorded."""
    result = tmp / f"{name}.json"
    head = ([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)] if nproc else [sys.executable])
    cmd = head + [str(Path(__file__).resolve()), "--worker", worker, "--dir", str(tmp), "--result", str(result)]
    for key, value in opts.items():
        cmd += [f"--{key.replace('_', '-')}", str(value)]
    for attempt in (1, 2):
        r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout_s,
                           env=dict(os.environ, OMP_NUM_THREADS="1"))
        if r.returncode == 0 and result.exists():
            return json.loads(result.read_text())
        failed.append({"launch": name, "exit": r.returncode, "stderr_tail": r.stderr[-1500:]})
        if attempt == 2:
            raise RuntimeError(f"finetune_bench {name} failed (exit {r.returncode}):\n{r.stdout[-3000:]}\n"
                               f"{r.stderr[-3000:]}")
    raise AssertionError("unreachable")


def measure(reps: int = 5, smoke: bool = False, timeout_s: float = 600, pairs: int = PAIRS,
            chunk_steps: int = CHUNK_STEPS) -> dict:
    """Every part, `reps` repetitions each. Returns the raw runs (figures.finetune_figures makes the figures)."""
    models = SMOKE_MODELS if smoke else MODELS
    tmp = Path(tempfile.mkdtemp(prefix="stride-finetune-bench-"))
    failed: list = []
    t0 = time.perf_counter()
    try:
        file = tmp / "init.safetensors"
        big = json.dumps(models["big"])
        written = launch("write", None, tmp, "write", timeout_s, failed, dims=big, file=file)
        memory = []
        for rep in range(reps):
            for strategy in (("fsdp", "ddp") if rep % 2 == 0 else ("ddp", "fsdp")):
                ranks = launch("memory", 2, tmp, f"memory_{strategy}_{rep}", timeout_s, failed, dims=big, file=file,
                               strategy=strategy)
                memory += [{"rep": rep, **r, "loadavg_after": os.getloadavg()} for r in ranks]
                shares = [r["peak_increase_bytes"] and round(r["peak_increase_bytes"] / r["full_bytes"], 3)
                          for r in ranks]
                print(f"finetune_bench: rep {rep + 1}/{reps} {strategy}: set-up memory rise per rank {shares} of the "
                      "model", flush=True)
        load_before = os.getloadavg()
        step = launch("step", 2, tmp, "step", timeout_s, failed, dims=json.dumps(models["step"]), reps=reps,
                      pairs=2 if smoke else pairs, chunk_steps=1 if smoke else chunk_steps)
        step.update(loadavg_before=load_before, loadavg_after=os.getloadavg())
        load_before = os.getloadavg()
        load = launch("load", None, tmp, "load", timeout_s, failed, dims=big, file=file, reps=reps)
        load.update(loadavg_before=load_before, loadavg_after=os.getloadavg())
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # the 1.2 GB file with it
    return {"model": {**models["big"], **written}, "step_model": models["step"], "memory": {"runs": memory},
            "step": step, "load": load, "failed_launches": failed, "wall_s": time.perf_counter() - t0}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python benchmarks/finetune_bench.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=5, help="repetitions (samples); a verdict needs 5")
    ap.add_argument("--smoke", action="store_true", help="tiny models: a check that every part runs")
    ap.add_argument("--out", help="also write the JSON here")
    for hidden in ("--worker", "--dir", "--result", "--dims", "--file", "--strategy"):
        ap.add_argument(hidden, help=argparse.SUPPRESS)
    ap.add_argument("--pairs", type=int, default=PAIRS, help=argparse.SUPPRESS)
    ap.add_argument("--chunk-steps", type=int, default=CHUNK_STEPS, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        {"memory": memory_worker, "step": step_worker, "load": load_worker, "write": write_worker}[args.worker](args)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)  # the result is written: no interpreter finalization (see leave_process_group)
    from benchmarks.figures import finetune_figures  # after the path set-up above

    raw = measure(args.reps, args.smoke)
    print_json({"figures": finetune_figures({"finetune": raw}), "raw": raw}, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
