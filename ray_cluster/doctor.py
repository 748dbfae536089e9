"""Cluster doctor: place the worker gang a training run would and check it before you spend GPU hours.

    python -m stride.ray_cluster.doctor                                   # embedded local Ray (or RAY_ADDRESS)
    python -m stride.ray_cluster.doctor --num-workers 2 --storage-path ./runs --json
    python -m stride.ray_cluster.doctor --address 10.0.0.5:6379 --num-workers 8 --use-gpu true --min-allreduce-gbps 100
    RAY_ADDRESS=... RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH=... python -m stride.ray_cluster.doctor --storage-path /shared/runs

It connects like the training driver (trainers/main.py: `--address`/RAY_ADDRESS, else an embedded local Ray
with token auth), reserves one placement-group bundle per worker ({CPU: --cpus-per-worker, GPU: 1 with GPUs},
PACK, as Ray Train does), starts one small actor per bundle and checks, one table row per check and node:

    node       CPUs, GPUs and memory of every alive node
    gang       the placement group became ready (an impossible gang is refused up front, exit 2)
    versions   torch (and CUDA, NCCL on GPU) are the same on every node
    gpu        every GPU worker sees its own GPU (distinct UUIDs)
    gemm       matrix-multiply throughput (GFLOP/s) and a finite, correct result on every worker's device
    storage    write, read back and delete a 1 MiB file under --storage-path from every node
    disk       free space at --storage-path on every node (>= --min-free-gb)
    allreduce  bus bandwidth of an all-reduce across the gang (NCCL on GPU, gloo on CPU), checked for the
               right sum; busbw = 2*(n-1)/n * bytes / time, in GB/s (10^9 bytes/s, as nccl-tests prints it)

Exit codes: 0 every check passed; 1 a check failed (each failure names check, node, measured value and
threshold); 2 a usage error (bad option, impossible gang; one line). Every check has a timeout (--timeout-s):
a worker that does not answer in time fails the check naming what hung; nothing waits forever.

The training driver calls run_preflight(...) (quick: small sizes, about 10 s) before fit() when
scaling.preflight is true; under torchrun each rank calls check_gang_in_place(...), the same checks on torchrun's
own processes and process group, without Ray.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

from stride.cli import ArgumentParser, error_line

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
ALL = "all"  # the node column of checks that span the whole gang

# Work sizes: quick keeps a 2-worker CPU preflight around 10 s on a busy laptop; full gives steadier numbers.
SIZES = {
    # (gemm n, gemm seconds, all-reduce MiB, all-reduce iterations)
    ("cpu", True): (256, 0.2, 4, 5),
    ("cpu", False): (1024, 1.0, 64, 10),
    ("gpu", True): (4096, 0.3, 64, 10),
    ("gpu", False): (8192, 1.0, 512, 20),
}
STORAGE_PROBE_BYTES = 1 << 20


@dataclass
class CheckResult:
    """One row of the doctor's table: a check on one node (or on the whole gang, node 'all')."""

    check: str
    node: str
    status: str  # pass | fail | skip
    value: float | str | None = None
    unit: str = ""
    threshold: float | str | None = None
    detail: str = ""

    @property
    def ok(self) -> bool:
        return self.status != "fail"

    def shown_value(self) -> str:
        if self.value is None:
            return "-"
        if isinstance(self.value, float):
            return f"{self.value:.4g} {self.unit}".strip()
        return f"{self.value} {self.unit}".strip()

    def shown_threshold(self) -> str:
        if self.threshold is None:
            return "-"
        if isinstance(self.threshold, (int, float)):
            return f">= {self.threshold:g} {self.unit}".strip()
        return str(self.threshold)

    def failure_line(self) -> str:
        return (f"{self.check} failed on node {self.node}: measured {self.shown_value()}, threshold "
                f"{self.shown_threshold()}" + (f"; {self.detail}" if self.detail else ""))


# ---- the worker: one actor per bundle of the gang ---------------------------------------------------------

class DoctorWorker:
    """Runs inside the gang's bundles. Plain methods returning plain dicts; expected failures (an unwritable
    path) come back as data, anything else propagates as an exception the driver reports."""

    def __init__(self, cpus: float):
        # The driver's stdout carries only the table or the JSON: send anything this process (or a C++
        # library in it) prints to its stderr, which Ray forwards to the driver's stderr.
        sys.stdout.flush()
        os.dup2(2, 1)
        import torch

        torch.set_num_threads(max(1, int(cpus)))

    def probe(self) -> dict:
        import ray

        return dict(probe_process(0), node_id=ray.get_runtime_context().get_node_id(), ip=ray.util.get_node_ip_address())

    def gemm(self, n: int, min_s: float, use_gpu: bool) -> dict:
        import torch

        return gemm_on(torch.device("cuda", 0) if use_gpu else torch.device("cpu"), n, min_s)

    def storage(self, path: str, tag: str) -> dict:
        return storage_probe(path, tag)

    def free_port(self) -> tuple[str, int]:
        import socket

        import ray

        with socket.socket() as s:
            s.bind(("", 0))
            return ray.util.get_node_ip_address(), s.getsockname()[1]

    def allreduce(self, addr: str, port: int, rank: int, world_size: int, use_gpu: bool, nbytes: int, iters: int,
                  timeout_s: float) -> dict:
        from datetime import timedelta

        import torch
        import torch.distributed as dist

        backend = "nccl" if use_gpu else "gloo"
        device = torch.device("cuda", 0) if use_gpu else torch.device("cpu")
        if use_gpu:
            torch.cuda.set_device(device)
        dist.init_process_group(backend, init_method=f"tcp://{addr}:{port}", rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=timeout_s), device_id=device if use_gpu else None)
        try:
            return dict(time_allreduce(device, rank, world_size, nbytes, iters), backend=backend)
        finally:
            dist.destroy_process_group()


def time_allreduce(device, rank: int, world_size: int, nbytes: int, iters: int) -> dict:
    """Seconds per all-reduce of `nbytes` on the initialised process group, and whether the first one summed right."""
    import torch
    import torch.distributed as dist

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    x = torch.full((nbytes // 4,), float(rank + 1), dtype=torch.float32, device=device)
    dist.all_reduce(x)  # also the warm-up: connections, NCCL communicator
    sync()
    want = world_size * (world_size + 1) / 2
    correct = bool((x == want).all())
    x.zero_()  # keep the timed loop's values bounded
    dist.barrier()
    sync()
    t0 = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(x)
    sync()
    return {"time_s": (time.perf_counter() - t0) / iters, "correct": correct}


def probe_process(cuda_index: int = 0) -> dict:
    """This process's host, Python, torch (CUDA, NCCL) and, with CUDA, the identity of its GPU `cuda_index`."""
    import platform
    import socket

    import torch

    info = {"hostname": socket.gethostname(), "pid": os.getpid(), "python": platform.python_version(),
            "torch": torch.__version__, "cuda": torch.version.cuda, "nccl": None,
            "cuda_available": torch.cuda.is_available(), "gpu_uuid": None, "gpu_name": None,
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")}
    if info["cuda_available"]:
        props = torch.cuda.get_device_properties(cuda_index)
        info["gpu_name"] = props.name
        info["gpu_uuid"] = (str(getattr(props, "uuid", "") or "")
                            or _nvidia_smi_uuid(info["cuda_visible_devices"], cuda_index))
        info["nccl"] = ".".join(map(str, torch.cuda.nccl.version())) if torch.distributed.is_nccl_available() else None
    return info


def gemm_on(device, n: int, min_s: float) -> dict:
    """Matrix-multiply throughput on `device` (bf16 on a GPU, fp32 on the CPU) for at least `min_s`, and whether a
    corner of the product matches a float64 one."""
    import torch

    use_gpu = device.type == "cuda"
    dtype = torch.bfloat16 if use_gpu else torch.float32
    gen = torch.Generator().manual_seed(1234)
    a_cpu = torch.randn(n, n, generator=gen).to(dtype)
    b_cpu = torch.randn(n, n, generator=gen).to(dtype)
    a, b = a_cpu.to(device), b_cpu.to(device)
    sync = torch.cuda.synchronize if use_gpu else (lambda: None)
    c = a @ b  # warm-up (kernel selection, allocation)
    sync()
    iters, t0 = 0, time.perf_counter()
    while True:
        c = a @ b
        iters += 1
        if iters >= 2:
            sync()
            elapsed = time.perf_counter() - t0
            if elapsed >= min_s:
                break
    finite = bool(torch.isfinite(c).all())
    # A corrupt device gives finite garbage too: compare a corner with a float64 product of the same inputs.
    rows, cols = min(n, 8), min(n, 256)
    ref = a_cpu[:rows].double() @ b_cpu[:, :cols].double()
    err = ((c[:rows, :cols].double().cpu() - ref).abs().max() / ref.abs().max()).item()
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    return {"gflops": 2.0 * n ** 3 * iters / elapsed / 1e9, "finite": finite, "rel_err": err,
            "correct": finite and err <= tol, "tol": tol, "dtype": str(dtype).replace("torch.", ""), "n": n,
            "iters": iters}


def storage_probe(path: str, tag: str) -> dict:
    """Write, read back and delete a file under `path`; free space there. Errors come back as data."""
    import shutil

    data = os.urandom(STORAGE_PROBE_BYTES)
    out = {"ok": False, "stage": "create folder", "error": None, "free_bytes": None, "write_mb_s": None}
    try:
        if "://" in path:
            import pyarrow.fs

            fs, base = pyarrow.fs.FileSystem.from_uri(path)
            fs.create_dir(base, recursive=True)
            name = f"{base.rstrip('/')}/.stride-doctor-{tag}"
            out["stage"] = "write"
            t0 = time.perf_counter()
            with fs.open_output_stream(name) as f:
                f.write(data)
            out["write_mb_s"] = len(data) / (time.perf_counter() - t0) / 1e6
            out["stage"] = "read back"
            with fs.open_input_stream(name) as f:
                back = f.read()
            out["stage"] = "delete"
            fs.delete_file(name)
            gone = fs.get_file_info(name).type == pyarrow.fs.FileType.NotFound
        else:
            folder = Path(path)
            folder.mkdir(parents=True, exist_ok=True)
            out["free_bytes"] = shutil.disk_usage(folder).free
            name = folder / f".stride-doctor-{tag}"
            out["stage"] = "write"
            t0 = time.perf_counter()
            with open(name, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            out["write_mb_s"] = len(data) / (time.perf_counter() - t0) / 1e6
            out["stage"] = "read back"
            back = name.read_bytes()
            out["stage"] = "delete"
            name.unlink()
            gone = not name.exists()
    except FileExistsError:
        out["error"] = "a file, not a folder, is in the way"
        return out
    except OSError as e:
        out["error"] = f"{type(e).__name__}: {e.strerror or e}"
        return out
    if back != data:
        out["error"] = f"read back {len(back)} bytes that differ from the {len(data)} written"
    elif not gone:
        out["error"] = "the file is still there after delete"
    else:
        out.update(ok=True, stage="done")
    return out


def _nvidia_smi_uuid(visible: str | None, cuda_index: int = 0) -> str | None:
    """The UUID of this process's cuda:<cuda_index> when torch does not expose it."""
    import subprocess

    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=index,uuid", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=20).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    rows = [[x.strip() for x in line.split(",")] for line in out.splitlines() if "," in line]
    shown = (visible or "").split(",")
    first = shown[cuda_index].strip() if visible and cuda_index < len(shown) else str(cuda_index)
    for index, uuid in rows:
        if first in (index, uuid):
            return uuid
    return None


# ---- the driver side ----------------------------------------------------------------------------------------

@dataclass
class Names:
    """How errors spell the settings: CLI flags for the doctor, config keys for the training driver's preflight."""

    style: str = "cli"  # cli | config

    def __call__(self, key: str, value=None) -> str:
        if self.style == "cli":
            flag = "--" + key.replace("_", "-")
            return flag if value is None else f"{flag} {value}"
        return f"scaling.{key}" if value is None else f"scaling.{key}={value}"


@dataclass
class Gang:
    """The actors of one placement group, and which of them stopped answering."""

    actors: list
    timeout_s: float
    labels: list[str] = field(default_factory=list)  # node label per rank
    hung: dict[int, str] = field(default_factory=dict)  # rank -> what it hung in
    progress: dict = field(default_factory=dict)

    def call(self, what: str, ranks: list[int], method: str, args_for) -> tuple[dict, dict]:
        """Run `method` on `ranks` at once; wait at most timeout_s. Returns ({rank: result}, {rank: error})."""
        import ray

        self.progress["stage"] = what
        errors = {r: f"skipped: rank {r} hung earlier in {self.hung[r]}" for r in ranks if r in self.hung}
        live = [r for r in ranks if r not in self.hung]
        refs = {getattr(self.actors[r], method).remote(*args_for(r)): r for r in live}
        ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=self.timeout_s) if refs else ([], [])
        results = {}
        for ref in ready:
            try:
                results[refs[ref]] = ray.get(ref)
            except ray.exceptions.RayError as e:
                errors[refs[ref]] = _error_line(e)
        for ref, r in refs.items():
            if r not in results and r not in errors:
                self.hung[r] = what
                errors[r] = f"rank {r} on {self._label(r)} hung: no answer from {what} within {self.timeout_s:g} s"
        return results, errors

    def _label(self, rank: int) -> str:
        return self.labels[rank] if rank < len(self.labels) and self.labels[rank] else f"rank {rank}"


def _error_line(e: BaseException) -> str:
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    return (lines[-1] if lines else type(e).__name__)[:300]


def _node_labels(nodes: list[dict]) -> dict[str, str]:
    """node id -> a short name: its IP, plus the id's start when several nodes share an IP (one host, two raylets)."""
    ips = Counter(n["NodeManagerAddress"] for n in nodes)
    return {n["NodeID"]: n["NodeManagerAddress"] if ips[n["NodeManagerAddress"]] == 1
            else f"{n['NodeManagerAddress']}#{n['NodeID'][:6]}" for n in nodes}


def plan_gang(num_workers: int | str, use_gpu: bool | str, cpus_per_worker: float, nodes: list[dict],
              names: Names) -> tuple[int, bool]:
    """'auto' -> numbers like the training driver, and refuse a gang the cluster can never place (UsageError)."""
    from stride.errors import UsageError

    cpus = sum(n["Resources"].get("CPU", 0.0) for n in nodes)
    gpus = sum(n["Resources"].get("GPU", 0.0) for n in nodes)
    gpu = bool(gpus > 0) if use_gpu == "auto" else bool(use_gpu)
    if gpu and gpus == 0:
        raise UsageError(f"{names('use_gpu')} (true) needs GPUs but the cluster has none; use {names('use_gpu', 'false')} "
                         f"(or auto)")
    if num_workers == "auto":
        # Training's auto is one worker per GPU, or one per node on CPU; with one CPU node that would test no
        # all-reduce, so take two workers where the CPUs allow.
        n = max(1, int(gpus)) if gpu else max(len(nodes), min(2, int(cpus // cpus_per_worker)), 1)
    else:
        n = int(num_workers)
    if gpu and gpus < n:
        raise UsageError(f"{names('num_workers')} ({n}) with {names('use_gpu')} true needs {n} GPUs but the cluster "
                         f"has {gpus:g}; use {names('num_workers', int(gpus))}")
    biggest = max((x["Resources"].get("CPU", 0.0) for x in nodes), default=0.0)
    if cpus_per_worker > biggest:
        raise UsageError(f"{names('cpus_per_worker')} ({cpus_per_worker:g}) exceeds the largest node's {biggest:g} "
                         f"CPUs; use {names('cpus_per_worker', f'{biggest:g}')} or less")
    if n * cpus_per_worker > cpus + 1e-9:
        fit = int(cpus // cpus_per_worker)
        raise UsageError(f"{names('num_workers')} ({n}) x {names('cpus_per_worker')} ({cpus_per_worker:g}) = "
                         f"{n * cpus_per_worker:g} CPUs exceeds the cluster's {cpus:g} CPUs; use "
                         f"{names('num_workers', max(1, fit))} or a bigger cluster")
    # Bundles are placed whole: count how many fit node by node (a CPU-only node holds no GPU worker).
    fits = sum(min(int(x["Resources"].get("CPU", 0.0) // cpus_per_worker + 1e-9),
                   int(x["Resources"].get("GPU", 0.0)) if gpu else 10 ** 9) for x in nodes)
    if fits < n:
        raise UsageError(f"{names('num_workers')} ({n}) workers of {{CPU: {cpus_per_worker:g}"
                         f"{', GPU: 1' if gpu else ''}}} do not fit on the cluster's nodes (at most {fits}); use "
                         f"{names('num_workers', max(1, fits))} or a smaller {names('cpus_per_worker')}")
    return n, gpu


def diagnose(num_workers: int | str = "auto", use_gpu: bool | str = "auto", storage_path: str = "./runs",
             cpus_per_worker: float = 1.0, *, quick: bool = False, timeout_s: float = 60.0,
             min_allreduce_gbps: float = 0.0, min_free_gb: float = 1.0, min_gemm_gflops: float = 0.0,
             names: Names | None = None, progress: dict | None = None) -> tuple[list[CheckResult], dict]:
    """Every check on a connected Ray cluster. Returns (rows, facts); progress["stage"] says where it is.
    Raises UsageError for impossible gangs."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    names = names or Names()
    progress = progress if progress is not None else {}
    progress["stage"] = "reading the cluster's nodes"
    storage = storage_path if "://" in storage_path else str(Path(storage_path).expanduser().resolve())
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    labels = _node_labels(nodes)
    rows: list[CheckResult] = []
    for n in nodes:
        res = n["Resources"]
        rows.append(CheckResult("node", labels[n["NodeID"]], "pass", f"{res.get('CPU', 0):g} CPU, {res.get('GPU', 0):g} GPU",
                                detail=f"{res.get('memory', 0) / 2**30:.1f} GiB memory, "
                                       f"{res.get('object_store_memory', 0) / 2**30:.1f} GiB object store, "
                                       f"host {n.get('NodeManagerHostname', '?')}"))
    n_workers, gpu = plan_gang(num_workers, use_gpu, cpus_per_worker, nodes, names)
    facts = {"num_workers": n_workers, "use_gpu": gpu, "cpus_per_worker": cpus_per_worker, "storage_path": storage,
             "quick": quick, "timeout_s": timeout_s, "nodes": len(nodes),
             "cluster": {k: ray.cluster_resources().get(k, 0.0) for k in ("CPU", "GPU", "memory")}, "elapsed_s": {}}
    elapsed = facts["elapsed_s"]  # seconds per stage: a slow stage is a finding too

    bundle = {"CPU": cpus_per_worker, **({"GPU": 1} if gpu else {})}
    shown_bundle = "{" + ", ".join(f"{k}: {v:g}" for k, v in bundle.items()) + "}"
    pg = placement_group([dict(bundle) for _ in range(n_workers)], strategy="PACK")
    gang = Gang([], timeout_s, progress=progress)
    try:
        progress["stage"] = "placing the gang"
        t0 = time.perf_counter()
        ready, _ = ray.wait([pg.ready()], timeout=timeout_s)
        if not ready:
            avail = ray.available_resources()
            rows.append(CheckResult("gang", ALL, "fail", "not placed", threshold=f"ready within {timeout_s:g} s",
                                    detail=f"placement group of {n_workers} x {shown_bundle} hung: not ready within "
                                           f"{timeout_s:g} s; free now {avail.get('CPU', 0):g} CPU, {avail.get('GPU', 0):g} "
                                           f"GPU (other jobs hold the rest)"))
            return rows, facts
        elapsed["placement"] = time.perf_counter() - t0
        rows.append(CheckResult("gang", ALL, "pass", f"{n_workers} workers",
                                detail=f"{n_workers} x {shown_bundle}, PACK, ready in {elapsed['placement']:.1f} s"))
        t0 = time.perf_counter()
        actor_cls = ray.remote(DoctorWorker)
        gang.actors = [actor_cls.options(num_cpus=cpus_per_worker, num_gpus=1 if gpu else 0,
                                         scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i))
                       .remote(cpus_per_worker) for i in range(n_workers)]
        ranks = list(range(n_workers))
        infos, errors = gang.call("worker start-up (probe)", ranks, "probe", lambda r: ())
        gang.labels = [labels.get(infos[r]["node_id"], infos[r]["ip"]) if r in infos else "" for r in ranks]
        for r, err in sorted(errors.items()):
            rows.append(CheckResult("gang", ALL, "fail", "no answer", detail=err))
        facts["workers"] = [dict(infos[r], rank=r, node=gang.labels[r]) for r in sorted(infos)]
        elapsed["probe"] = time.perf_counter() - t0
        rows += _check_versions(infos, gang.labels, gpu)
        if gpu:
            rows += _check_gpus(infos, gang.labels)
        else:
            rows.append(CheckResult("gpu", ALL, "skip", detail="CPU gang (use_gpu false): no GPU to check"))
        gemm_n, gemm_s, mib, iters = SIZES[("gpu" if gpu else "cpu", quick)]
        for name, check in (("gemm", lambda: _check_gemm(gang, list(infos), gemm_n, gemm_s, gpu, min_gemm_gflops)),
                            ("storage", lambda: _check_storage(gang, infos, storage, min_free_gb)),
                            ("allreduce", lambda: _check_allreduce(gang, n_workers, gpu, mib, iters, timeout_s,
                                                                   min_allreduce_gbps))):
            t0 = time.perf_counter()
            rows += check()
            elapsed[name] = time.perf_counter() - t0
    finally:
        progress["stage"] = "cleaning up the gang"
        for actor in gang.actors:
            ray.kill(actor)
        remove_placement_group(pg)
    return rows, facts


def _by_node(ranks, labels: list[str]) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for r in sorted(ranks):
        out.setdefault(labels[r], []).append(r)
    return out


def _check_versions(infos: dict, labels: list[str], gpu: bool) -> list[CheckResult]:
    keys = ("torch", "cuda", "nccl") if gpu else ("torch",)
    stack = {r: ", ".join(f"{k} {infos[r][k]}" for k in keys) for r in infos}
    if not stack:
        return []
    common, _ = Counter(stack.values()).most_common(1)[0]
    rows = []
    for node, ranks in _by_node(infos, labels).items():
        seen = sorted({stack[r] for r in ranks})
        bad = [s for s in seen if s != common]
        rows.append(CheckResult("versions", node, "fail" if bad else "pass", "; ".join(seen), threshold=common,
                                detail=(f"differs from the other workers' {common}" if bad else "same on every node")
                                + f"; python {infos[ranks[0]]['python']}"))
    return rows


def _check_gpus(infos: dict, labels: list[str]) -> list[CheckResult]:
    owners: dict[str, list[int]] = {}
    for r, info in infos.items():
        if info["gpu_uuid"]:
            owners.setdefault(info["gpu_uuid"], []).append(r)
    rows = []
    for node, ranks in _by_node(infos, labels).items():
        problems = []
        for r in ranks:
            info = infos[r]
            if not info["cuda_available"]:
                problems.append(f"rank {r} sees no GPU (CUDA_VISIBLE_DEVICES={info['cuda_visible_devices']}, "
                                f"torch {info['torch']})")
            elif not info["gpu_uuid"]:
                problems.append(f"rank {r} cannot read its GPU's UUID")
            elif len(owners[info["gpu_uuid"]]) > 1:
                problems.append(f"rank {r} shares GPU {info['gpu_uuid']} with ranks {owners[info['gpu_uuid']]}")
        distinct = len({infos[r]["gpu_uuid"] for r in ranks if infos[r]["gpu_uuid"]})
        names = sorted({infos[r]["gpu_name"] or "?" for r in ranks})
        rows.append(CheckResult("gpu", node, "fail" if problems else "pass", f"{distinct}/{len(ranks)} distinct",
                                threshold="one GPU per worker",
                                detail="; ".join(problems) if problems else ", ".join(names)))
    return rows


def _check_gemm(gang: Gang, ranks: list[int], n: int, min_s: float, gpu: bool, min_gflops: float) -> list[CheckResult]:
    results, errors = gang.call("the GEMM check", ranks, "gemm", lambda r: (n, min_s, gpu))
    return _gemm_rows(results, errors, ranks, gang.labels, n, min_gflops)


def _gemm_rows(results: dict, errors: dict, ranks: list[int], labels: list[str], n: int,
               min_gflops: float) -> list[CheckResult]:
    rows = []
    for node, node_ranks in _by_node(ranks, labels).items():
        done = {r: results[r] for r in node_ranks if r in results}
        problems = [errors[r] for r in node_ranks if r in errors]
        for r, g in done.items():
            if not g["finite"]:
                problems.append(f"rank {r}: NaN/Inf in the product")
            elif not g["correct"]:
                problems.append(f"rank {r}: wrong product (relative error {g['rel_err']:.2g} > {g['tol']:g})")
            elif g["gflops"] < min_gflops:
                problems.append(f"rank {r}: {g['gflops']:.4g} GFLOP/s < {min_gflops:g}")
        worst = min((g["gflops"] for g in done.values()), default=None)
        kind = next(iter(done.values()), {"dtype": "?"})["dtype"]
        detail = f"{kind} {n}x{n}, " + ", ".join(f"rank {r} {g['gflops']:.4g}" for r, g in done.items())
        rows.append(CheckResult("gemm", node, "fail" if problems else "pass", worst, "GFLOP/s", min_gflops,
                                "; ".join(problems) if problems else detail + ", finite and correct"))
    return rows


def _check_storage(gang: Gang, infos: dict, storage: str, min_free_gb: float) -> list[CheckResult]:
    # One worker per node: the question is whether each node can use the path.
    first = {node: ranks[0] for node, ranks in _by_node(infos, gang.labels).items()}
    tag = lambda r: f"{infos[r]['node_id'][:8]}-{infos[r]['pid']}-{os.urandom(3).hex()}"  # noqa: E731
    results, errors = gang.call("the storage check", list(first.values()), "storage", lambda r: (storage, tag(r)))
    return _storage_rows(first, results, errors, storage, min_free_gb)


def _storage_rows(first: dict[str, int], results: dict, errors: dict, storage: str,
                  min_free_gb: float) -> list[CheckResult]:
    rows = []
    for node, r in first.items():
        if r in errors:
            rows.append(CheckResult("storage", node, "fail", "error", threshold="write, read, delete",
                                    detail=f"{storage}: {errors[r]}"))
            rows.append(CheckResult("disk", node, "skip", detail="storage check did not finish"))
            continue
        s = results[r]
        if s["ok"]:
            rows.append(CheckResult("storage", node, "pass", "ok", threshold="write, read, delete",
                                    detail=f"{storage} (1 MiB, write {s['write_mb_s']:.0f} MB/s)"))
        else:
            rows.append(CheckResult("storage", node, "fail", f"{s['stage']} failed", threshold="write, read, delete",
                                    detail=f"{storage}: {s['error']}"))
        if s["free_bytes"] is None:
            why = "remote filesystem: no free-space figure" if "://" in storage else "the storage path is unusable"
            rows.append(CheckResult("disk", node, "skip", detail=why))
        else:
            free_gb = s["free_bytes"] / 1e9
            rows.append(CheckResult("disk", node, "pass" if free_gb >= min_free_gb else "fail", free_gb, "GB",
                                    min_free_gb, f"free at {storage}"))
    return rows


def _check_allreduce(gang: Gang, n: int, gpu: bool, mib: int, iters: int, timeout_s: float,
                     min_gbps: float) -> list[CheckResult]:
    backend = "nccl" if gpu else "gloo"
    if n < 2:
        return [CheckResult("allreduce", ALL, "skip", unit="GB/s", threshold=min_gbps,
                            detail="one worker: nothing to all-reduce")]
    if gang.hung or len(gang.labels) < n or not all(gang.labels):
        return [CheckResult("allreduce", ALL, "fail", unit="GB/s", threshold=min_gbps,
                            detail=f"not run: not every worker answers ({', '.join(f'rank {r} hung in {w}' for r, w in gang.hung.items()) or 'start-up failed'})")]
    addr, errors = gang.call("picking a rendezvous port", [0], "free_port", lambda r: ())
    if errors:
        return [CheckResult("allreduce", ALL, "fail", unit="GB/s", threshold=min_gbps, detail=errors[0])]
    host, port = addr[0]
    nbytes = mib << 20
    results, errors = gang.call(f"the {backend} all-reduce", list(range(n)), "allreduce",
                                lambda r: (host, port, r, n, gpu, nbytes, iters, timeout_s))
    what = f"{backend}, {n} workers, {mib} MiB x {iters}, rendezvous {host}:{port}"
    if errors:
        return [CheckResult("allreduce", ALL, "fail", unit="GB/s", threshold=min_gbps,
                            detail=f"{what}: " + "; ".join(errors[r] for r in sorted(errors)))]
    return [_allreduce_row(results, n, nbytes, what, min_gbps)]


def _allreduce_row(results: dict, n: int, nbytes: int, what: str, min_gbps: float) -> CheckResult:
    slowest = max(x["time_s"] for x in results.values())
    busbw = 2 * (n - 1) / n * nbytes / slowest / 1e9
    wrong = sorted(r for r, x in results.items() if not x["correct"])
    status = "fail" if wrong or busbw < min_gbps else "pass"
    detail = f"{what}, {slowest * 1e3:.1f} ms each ({busbw * 8:.3g} Gbit/s)"
    if wrong:
        detail += f"; wrong sum on ranks {wrong}"
    elif busbw < min_gbps:
        detail += "; bus bandwidth below the threshold"
    return CheckResult("allreduce", ALL, status, busbw, "GB/s", min_gbps, detail)


def format_table(rows: list[CheckResult]) -> str:
    head = ("CHECK", "NODE", "STATUS", "VALUE", "THRESHOLD", "DETAIL")
    cells = [head] + [(r.check, r.node, r.status.upper() if r.status == "fail" else r.status, r.shown_value(),
                       r.shown_threshold(), r.detail) for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(5)]
    return "\n".join("  ".join(c[i].ljust(widths[i]) for i in range(5)) + "  " + c[5] for c in cells)


def run_preflight(num_workers: int, use_gpu: bool | str, storage_path: str, cpus_per_worker: float, quick: bool = True,
                  *, timeout_s: float = 30.0, min_allreduce_gbps: float = 0.0, min_free_gb: float = 1.0
                  ) -> list[CheckResult]:
    """The doctor's checks for the training driver, before fit(): the gang it is about to place, on the cluster
    it is connected to (Ray must be initialised). Returns the rows; those with `.ok` False are failures
    (`.failure_line()` says what). Raises trainers.main.UsageError when the gang can never be placed."""
    import ray

    assert ray.is_initialized(), "run_preflight runs after init_ray()"
    rows, _ = diagnose(num_workers, use_gpu, storage_path, cpus_per_worker, quick=quick, timeout_s=timeout_s,
                       min_allreduce_gbps=min_allreduce_gbps, min_free_gb=min_free_gb, names=Names("config"))
    return rows


def check_gang_in_place(device, storage_path: str, *, quick: bool = True, min_allreduce_gbps: float = 0.0,
                        min_free_gb: float = 1.0, min_gemm_gflops: float = 0.0, all_gather=None) -> list[CheckResult]:
    """The doctor's checks on a gang that is already running, without Ray: torchrun's processes (scaling.preflight
    under torchrun), each on its `device`, in the process group they share (or one process). Versions and GPUs are
    compared across ranks, GEMM runs on every rank, storage from one rank per host, the all-reduce on the group
    itself. Every rank calls it and gets the same rows. `all_gather(obj) -> [each rank's obj]`: the group's, by
    default (a test passes its own)."""
    import torch.distributed as dist

    in_group = dist.is_available() and dist.is_initialized()
    rank, world_size = (dist.get_rank(), dist.get_world_size()) if in_group else (0, 1)
    if all_gather is None:
        all_gather = _gather_in_group if in_group else (lambda obj: [obj])
    gpu = device.type == "cuda"
    storage = storage_path if "://" in storage_path else str(Path(storage_path).expanduser().resolve())
    infos = dict(enumerate(all_gather(probe_process(device.index or 0) if gpu else probe_process())))
    ranks = sorted(infos)
    labels = [infos[r]["hostname"] for r in ranks]
    rows = [CheckResult("gang", ALL, "pass", f"{len(ranks)} workers",
                        detail=f"torchrun's processes on {len(set(labels))} node(s)")]
    rows += _check_versions(infos, labels, gpu)
    rows += _check_gpus(infos, labels) if gpu else [
        CheckResult("gpu", ALL, "skip", detail="CPU gang (use_gpu false): no GPU to check")]
    gemm_n, gemm_s, mib, iters = SIZES[("gpu" if gpu else "cpu", quick)]
    try:  # a device that fails the product is a failed check on every rank, not one rank's traceback
        mine = (gemm_on(device, gemm_n, gemm_s), None)
    except RuntimeError as e:
        mine = (None, _error_line(e))
    gemms = dict(enumerate(all_gather(mine)))
    rows += _gemm_rows({r: g for r, (g, _) in gemms.items() if g is not None},
                       {r: err for r, (_, err) in gemms.items() if err is not None}, ranks, labels, gemm_n,
                       min_gemm_gflops)
    first = {node: node_ranks[0] for node, node_ranks in _by_node(ranks, labels).items()}
    tag = f"{labels[rank]}-{os.getpid()}-{os.urandom(3).hex()}"
    stored = dict(enumerate(all_gather(storage_probe(storage, tag) if rank in first.values() else None)))
    rows += _storage_rows(first, {r: stored[r] for r in first.values()}, {}, storage, min_free_gb)
    if world_size < 2:
        rows.append(CheckResult("allreduce", ALL, "skip", unit="GB/s", threshold=min_allreduce_gbps,
                                detail="one worker: nothing to all-reduce"))
    else:
        nbytes = mib << 20
        times = dict(enumerate(all_gather(time_allreduce(device, rank, world_size, nbytes, iters))))
        rows.append(_allreduce_row(times, world_size, nbytes,
                                   f"{dist.get_backend()}, {world_size} workers, {mib} MiB x {iters}, torchrun's group",
                                   min_allreduce_gbps))
    return rows


def _gather_in_group(obj) -> list:
    import torch.distributed as dist

    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


# ---- command line ---------------------------------------------------------------------------------------------

def _workers(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"({text}) must be a whole number >= 1 or auto; use e.g. --num-workers 2")
    return value


def _number(flag: str, low: float, strict: bool):
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not math.isfinite(value) or value < low or (strict and value == low):
            rule = f"> {low:g}" if strict else f">= {low:g}"
            raise argparse.ArgumentTypeError(f"({text}) must be a number {rule}; use e.g. {flag} {max(low, 0) + 1:g}")
        return value
    parse.__name__ = "value"
    return parse


def _use_gpu(text: str) -> bool | str:
    choices = {"auto": "auto", "true": True, "false": False}
    if text.lower() not in choices:
        raise argparse.ArgumentTypeError(f"({text}) must be auto, true or false; use e.g. --use-gpu auto")
    return choices[text.lower()]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = ArgumentParser(prog="python -m stride.ray_cluster.doctor",
                 description="Place the worker gang a training run would and check nodes, GPUs, versions, GEMM, "
                             "all-reduce bandwidth and storage. Exit 0 all pass, 1 a check failed, 2 usage error.")
    ap.add_argument("--address", help="Ray cluster address (default: RAY_ADDRESS, else an embedded local Ray)")
    ap.add_argument("--num-workers", type=_workers, default="auto",
                    help="workers in the gang (auto: one per GPU; on CPU one per node, at least 2 where CPUs allow)")
    ap.add_argument("--use-gpu", type=_use_gpu, default="auto", help="auto|true|false (auto: when the cluster has GPUs)")
    ap.add_argument("--cpus-per-worker", type=_number("--cpus-per-worker", 0, strict=True), default=1.0,
                    help="CPUs per worker, like scaling.cpus_per_worker (default 1)")
    ap.add_argument("--storage-path", default="./runs", help="folder or URI every node writes runs to (default ./runs)")
    ap.add_argument("--min-allreduce-gbps", type=_number("--min-allreduce-gbps", 0, strict=False), default=0.0,
                    help="fail below this all-reduce bus bandwidth, in GB/s (10^9 bytes/s, like nccl-tests' busbw)")
    ap.add_argument("--min-gemm-gflops", type=_number("--min-gemm-gflops", 0, strict=False), default=0.0,
                    help="fail a device below this GEMM throughput, GFLOP/s (default 0: only NaN/correctness)")
    ap.add_argument("--min-free-gb", type=_number("--min-free-gb", 0, strict=False), default=1.0,
                    help="fail a node with less free disk at the storage path, in GB (default 1)")
    ap.add_argument("--timeout-s", type=_number("--timeout-s", 0, strict=True), default=60.0,
                    help="time limit of each check, seconds (default 60)")
    ap.add_argument("--quick", action="store_true", help="small sizes (what the training preflight runs)")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    return ap.parse_args(argv)


def _too_big_for_embedded(args: argparse.Namespace) -> str | None:
    """The embedded cluster has this machine's cores: a bigger gang is refused before the seconds of importing
    torch and starting Ray. None when it fits (or a cluster address decides)."""
    cores = os.cpu_count() or 1
    if args.address or os.environ.get("RAY_ADDRESS") or args.num_workers == "auto":
        return None
    if args.num_workers * args.cpus_per_worker <= cores + 1e-9:
        return None
    fit = max(1, int(cores // args.cpus_per_worker))
    return (f"--num-workers ({args.num_workers}) x --cpus-per-worker ({args.cpus_per_worker:g}) = "
            f"{args.num_workers * args.cpus_per_worker:g} CPUs exceeds the embedded local Ray's {cores} CPUs (this "
            f"machine's cores); use --num-workers {fit} or --address of a bigger cluster")


def _reachable(address: str, timeout_s: float) -> str | None:
    from stride.ray_cluster.connect import unreachable

    return unreachable(address, min(timeout_s, 10.0))


def _connect(args: argparse.Namespace) -> None:
    """The training driver's connection logic: --address/RAY_ADDRESS, else an embedded Ray with token auth."""
    from stride.ray_cluster.connect import init_ray, quiet_ray_env
    from stride.errors import UsageError

    if args.address:
        os.environ["RAY_ADDRESS"] = args.address
    address = os.environ.get("RAY_ADDRESS")
    if address and (why := _reachable(address, args.timeout_s)):
        flag = "--address" if args.address else "RAY_ADDRESS"
        raise UsageError(f"{flag} ({address}) is not reachable ({why}); start the cluster "
                         f"(python -m stride.ray_cluster.local start) or leave {flag} unset for an embedded local Ray")
    quiet_ray_env()
    init_ray()


class _Watchdog:
    """The last line of "never hangs": if a stage outlives its deadline (a GCS that accepts the connection and
    never answers, a call without a timeout of its own), report it as a failed check and exit 1."""

    def __init__(self, report):
        self.report = report
        self._timer = None

    def arm(self, check: str, node: str, stage: str, seconds: float, progress: dict | None = None) -> None:
        """Fire after `seconds` naming `stage`, or progress["stage"] (where diagnose() had got to)."""
        import threading

        self.disarm()
        self._timer = threading.Timer(seconds, self._fire, args=(check, node, stage, seconds, progress))
        self._timer.daemon = True
        self._timer.start()

    def disarm(self) -> None:
        if self._timer:
            self._timer.cancel()

    def _fire(self, check: str, node: str, stage: str, seconds: float, progress: dict | None) -> None:
        stage = (progress or {}).get("stage", stage)
        row = CheckResult(check, node, "fail", "hung", threshold=f"done within {seconds:g} s",
                          detail=f"{stage} did not finish within {seconds:g} s")
        self.report([row], {})
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(EXIT_FAILED)  # the main thread is the one stuck: no clean-up can run


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    too_big = _too_big_for_embedded(args)
    if too_big:
        error_line(too_big)
        return EXIT_USAGE
    from stride.errors import UsageError

    t0 = time.perf_counter()
    report = lambda rows, facts: _report(args, rows, facts, time.perf_counter() - t0)  # noqa: E731
    watchdog = _Watchdog(report)
    progress: dict = {}
    try:
        address = args.address or os.environ.get("RAY_ADDRESS")
        # An embedded start has Ray's own start-up timeout; a remote one may wait on a GCS for minutes.
        watchdog.arm("ray", address or "embedded",
                     f"connecting to Ray at {address}" if address else "starting the embedded Ray",
                     args.timeout_s if address else max(args.timeout_s, 180.0))
        try:
            _connect(args)
        except UsageError:
            raise
        except Exception as e:  # noqa: BLE001 - Ray failing to start is a failed check, not a traceback
            watchdog.disarm()
            row = CheckResult("ray", address or "embedded", "fail", "not connected", threshold="ray.init succeeds",
                              detail=_error_line(e))
            return report([row], {})
        # Every stage waits at most --timeout-s; this bounds the rest (six stages, start-up and clean-up).
        watchdog.arm("doctor", ALL, "the checks", 6 * args.timeout_s + 60, progress)
        rows, facts = diagnose(args.num_workers, args.use_gpu, args.storage_path, args.cpus_per_worker,
                               quick=args.quick, timeout_s=args.timeout_s, min_allreduce_gbps=args.min_allreduce_gbps,
                               min_free_gb=args.min_free_gb, min_gemm_gflops=args.min_gemm_gflops,
                               progress=progress)
        watchdog.disarm()
    except UsageError as e:
        watchdog.disarm()
        error_line(e)
        return EXIT_USAGE
    return report(rows, facts)


def _report(args: argparse.Namespace, rows: list[CheckResult], facts: dict, wall_s: float) -> int:
    """Print the table (or the JSON) on stdout and one line per failure on stderr; return the exit code."""
    failures = [r.failure_line() for r in rows if not r.ok]
    code = EXIT_FAILED if failures else EXIT_OK
    if args.json:
        print(json.dumps({"ok": not failures, "exit_code": code, "wall_s": round(wall_s, 2), **facts,
                          "checks": [asdict(r) for r in rows], "failures": failures}, indent=1, default=str))
    else:
        print(format_table(rows))
        counts = Counter(r.status for r in rows)
        print(f"doctor: {counts['pass']} passed, {counts['fail']} failed, {counts['skip']} skipped in {wall_s:.1f} s"
              + (f" ({facts['num_workers']} workers, use_gpu {str(facts['use_gpu']).lower()})" if facts else ""))
    for line in failures:
        print(f"doctor: FAIL {line}", file=sys.stderr)
    return code


if __name__ == "__main__":
    # Import ourselves by name so the actor class is pickled by reference (ray_cluster.doctor.DoctorWorker),
    # not by value from __main__.
    from stride.ray_cluster.doctor import main as _main

    sys.exit(_main())
