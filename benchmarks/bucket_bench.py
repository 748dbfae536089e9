"""Runs on a bucket beside runs in a folder (issue 44): what checkpoints block, the step, and a resume's start.

    python benchmarks/run.py --only bucket
    python benchmarks/bucket_bench.py [REPS] [--smoke]   # alone: the raw runs as JSON

One local S3-compatible server (tests/s3_server.py, the suite's moto_server, loaded by path) holds bucket `bench`.
Every repetition trains the same job twice, with run.storage_path a temporary folder and `s3://bench/r<rep>`
(checkpoint.upload=async, the default; checkpoint.staging_dir a temporary folder), then resumes each of the two runs
for RESUME_STEPS more steps; the repetitions alternate which storage goes first (folder, bucket; bucket, folder; ...).
The job: tabular_mlp made wide (HIDDEN: a checkpoint of ~25 MB, a step of tens of milliseconds) on 2 CPU ranks of one
torch thread under torchrun (torch.distributed.run --standalone, trainers/torchrun.py), STEPS steps, a checkpoint
every CKPT_EVERY (and at the end), a log line every LOG_EVERY, no validation, no trackers. Both storages run in the
same environment (the server's endpoint and fake credentials), so only run.storage_path differs.

Per launch: wall seconds, the seconds from the launch to the end of the first optimizer step (rank 0's sample log,
benchmarks/procs.launch), every metrics.jsonl line (from the folder, or from the bucket's object), summary.json's
train_wall_s, the size of the newest checkpoint, and what the run left in its staging folder. benchmarks/figures.py
makes bucket_checkpoint_blocked_ratio (the checkpoint_blocked_s of a run's log lines summed), bucket_step_time_ratio
(the median step_time_s past WARMUP) and bucket_resume_ratio (first step of the resume) of them, a sample per
repetition: the bucket's over the folder's.

The server runs on this machine's 2 CPUs beside the ranks, at nice 19 (SERVER_NICE): on a cluster the bucket's work
(receiving, checksumming and storing the uploads) is done on other machines and costs the training host nothing, so
here it runs on the CPU time the ranks leave idle. (At nice 0 it took ~55 ms of CPU per 12 MB shard.) The
client's work (hashing, signing and sending every request, in the ranks' own processes) is counted in full; no
network is. It is what remains: the windows of steps during a checkpoint's upload are ~10-20 ms slower per step than
the folder's (bucket_step_time_ratio 1.020 at nice 0, 1.026 at nice 19 on a quiet machine).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.append(str(REPO))  # appended: the repository's datasets/ must not hide Hugging Face's `datasets`

from benchmarks.procs import clean_env, launch, run_checked  # noqa: E402

PY = sys.executable
CONFIG = REPO / "trainers" / "configs" / "tabular_mlp.yaml"
S3_SERVER = REPO / "tests" / "s3_server.py"
ROWS = 20_000
HIDDEN = "[1024, 1024, 1024]"
STEPS, CKPT_EVERY, LOG_EVERY, WARMUP, RESUME_STEPS = 120, 30, 5, 10, 4
SMOKE = {"steps": 40, "ckpt_every": 10}
BUCKET = "bench"
VARIANTS = ("folder", "bucket")
SERVER_NICE = 19  # the server takes the CPU the ranks leave: on a cluster, the bucket is not on their host


def s3_server_module():
    """tests/s3_server.py, loaded by path (tests/ is no package): the suite's moto_server on a free port, stopped by
    its pid, and the environment that points a child's s3:// at it."""
    spec = importlib.util.spec_from_file_location("stride_bench_s3_server", S3_SERVER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _args(data: Path, storage: str, staging: Path, steps: int, ckpt_every: int) -> list[str]:
    return ["--config", str(CONFIG), f"data.train_path={data}/train", "data.val_path=null",
            f"run.storage_path={storage}", "run.name=b", "train.epochs=null", f"train.max_steps={steps}",
            f"train.log_every_steps={LOG_EVERY}", "train.eval_every_steps=null", f"checkpoint.every_steps={ckpt_every}",
            f"checkpoint.staging_dir={staging}", "tracking.sinks=[]", "train.num_threads=1",
            f"model.hidden_sizes={HIDDEN}"]


class Storage:
    """Where one variant's run lives, and how its files are read back: a folder, or a prefix of the bucket."""

    def __init__(self, variant: str, rep: int, tmp: Path, s3):
        self.variant, self.s3 = variant, s3
        self.uri = f"s3://{BUCKET}/r{rep}" if variant == "bucket" else str(tmp / f"folder_r{rep}")

    def read(self, name: str) -> bytes | None:
        if self.variant == "folder":
            path = Path(self.uri) / "b" / name
            return path.read_bytes() if path.exists() else None
        from pyarrow import fs as pafs

        path = f"{self.uri.removeprefix('s3://')}/b/{name}"
        if self.s3.filesystem().get_file_info(path).type != pafs.FileType.File:
            return None
        with self.s3.filesystem().open_input_stream(path) as f:
            return f.read()

    def newest_checkpoint_bytes(self) -> int | None:
        """Bytes of the newest checkpoint (its shards, DCP's metadata and meta.json)."""
        from pyarrow import fs as pafs

        if self.variant == "folder":
            base, fs = str(Path(self.uri) / "b"), pafs.LocalFileSystem()
        else:
            base, fs = f"{self.uri.removeprefix('s3://')}/b", self.s3.filesystem()
        infos = fs.get_file_info(pafs.FileSelector(base, recursive=True, allow_not_found=True))
        by_ckpt: dict[str, int] = {}
        for i in infos:
            top = i.path[len(base) + 1:].split("/")[0]
            if top.startswith("checkpoint_") and i.type == pafs.FileType.File:
                by_ckpt[top] = by_ckpt.get(top, 0) + i.size
        return by_ckpt[max(by_ckpt)] if by_ckpt else None


def one_launch(storage: Storage, data: Path, tmp: Path, env: dict, rep: int, phase: str, steps: int,
               ckpt_every: int, timeout_s: int, after_step: int = 0) -> dict:
    """One torchrun launch of the run (phase "train": from scratch; "resume": the same run to `steps`, from its
    checkpoint of `after_step`), and the metrics.jsonl lines past `after_step`."""
    tag = f"{storage.variant}_{phase}_r{rep}"
    staging = tmp / f"staging_{storage.variant}_r{rep}"
    cmd = [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "trainers/torchrun.py",
           *_args(data, storage.uri, staging, steps, ckpt_every)]
    load_before = os.getloadavg()
    r = launch(cmd, tmp / f"{tag}.log", timeout_s, sample_log=tmp / f"samples_{tag}", env=env)
    if r.rc != 0:
        raise RuntimeError(f"bucket_bench: {tag} exited {r.rc}; its log {r.log}:\n{Path(r.log).read_text()[-3000:]}")
    lines = [json.loads(x) for x in (storage.read("metrics.jsonl") or b"").decode().splitlines() if x.strip()]
    metrics = [x for x in lines if x.get("step", 0) > after_step]  # a resume's own lines only
    summary = json.loads(storage.read("summary.json") or b"{}")
    resumed = next((t for t, line in r.lines if " INFO resumed from " in line), None)
    return {"variant": storage.variant, "phase": phase, "rep": rep, "rc": r.rc, "wall_s": r.wall_s,
            "first_step_s": r.first_step_s, "resumed_line_s": resumed, "steps": steps,
            "summary": {k: summary.get(k) for k in ("train_wall_s", "global_step", "status")},
            "checkpoint_bytes": storage.newest_checkpoint_bytes(),
            "staging_files_left": sum(1 for p in staging.rglob("*") if p.is_file()) if staging.exists() else 0,
            "loadavg_before": load_before, "loadavg_after": os.getloadavg(), "leftovers_killed": r.leftovers_killed,
            "metrics": metrics}


def measure(reps: int = 5, smoke: bool = False, timeout_s: int = 600) -> dict:
    steps, ckpt_every = (SMOKE["steps"], SMOKE["ckpt_every"]) if smoke else (STEPS, CKPT_EVERY)
    tmp = Path(tempfile.mkdtemp(prefix="stride-bucket-bench-"))
    started = datetime.now().isoformat(timespec="seconds")
    t0 = time.perf_counter()
    s3 = s3_server_module().S3Server(tmp / "s3")
    try:
        data = tmp / "data"
        run_checked([PY, "datasets/prepare.py", "tabular", "--out", str(data), "--rows", str(ROWS)],
                    dict(os.environ), 300, "bucket_bench")
        s3.start()
        os.setpriority(os.PRIO_PROCESS, s3.pid, SERVER_NICE)  # before its first request: its threads inherit it
        s3.create_bucket(BUCKET)
        env = s3.child_env(clean_env())  # both variants: only run.storage_path differs
        runs = []
        for rep in range(reps):
            order = VARIANTS if rep % 2 == 0 else VARIANTS[::-1]
            where = {v: Storage(v, rep, tmp, s3) for v in order}
            for phase, n, after in (("train", steps, 0), ("resume", steps + RESUME_STEPS, steps)):
                for v in order:
                    runs.append(one_launch(where[v], data, tmp, env, rep, phase, n, ckpt_every, timeout_s, after))
                    x = runs[-1]
                    blocked = sum(m.get("checkpoint_blocked_s") or 0 for m in x["metrics"])
                    print(f"bucket_bench: rep {rep + 1}/{reps} {phase:6s} {v:6s} wall {x['wall_s']:.1f}s first step "
                          f"{x['first_step_s'] or float('nan'):.1f}s blocked {blocked:.2f}s "
                          f"(load {x['loadavg_after'][0]:.1f})", flush=True)
        return {"started": started, "cpu_count": os.cpu_count(), "hidden": HIDDEN, "rows": ROWS, "steps": steps,
                "ckpt_every": ckpt_every, "log_every": LOG_EVERY, "warmup": WARMUP, "resume_steps": RESUME_STEPS,
                "world_size": 2, "upload": "async", "runs": runs, "wall_s": time.perf_counter() - t0}
    finally:
        s3.stop()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    print(json.dumps(measure(reps=int(sys.argv[1]) if len(sys.argv) > 1 and sys.argv[1].isdigit() else 1,
                             smoke="--smoke" in sys.argv), indent=1))
