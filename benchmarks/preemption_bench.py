"""A node preempted under a running job, as a cloud does it, on a two-node Ray cluster on this machine.

    python benchmarks/preemption_bench.py [--deadline-s 15] [--max-steps 3000] [--keep DIR]

prints one JSON object: {"preemption_steps_lost": n, ...}. tests/test_preemption.py runs the same `scenario`.

A Ray head with 1 CPU and a second node (its own raylet, ports and temp dir) with 1 CPU, token auth; a 2-worker
elastic tabular run (`scaling.num_workers=[1,2]`, one worker on each node, `checkpoint.every_steps=1000`, so that the
only checkpoint before the drain is the preemption's) started with `python trainers/main.py` and RAY_ADDRESS of the
head. Once it trains, the second node is drained as a cloud autoscaler does before it reclaims a spot instance:

    ray drain-node --address <head> --node-id <node> --reason DRAIN_NODE_REASON_PREEMPTION \\
        --reason-message ... --deadline-remaining-seconds <deadline_s>

and after the deadline its processes (raylet and all) are killed by pid, as the cloud takes the machine. Ray Train's
preemption watcher (polled every second here: RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S=1) tells the workers, Stride
checkpoints at the next step and waits; Ray ends the gang at the deadline and starts it again with 1 worker on the
head from that checkpoint; the run completes.

Ray 2.60's elastic policy still counts the drained node's CPUs when it restarts the gang at the deadline (the node
is draining, not yet dead), so its first try asks for 2 workers, which never place, and waits out the worker group's
start timeout before it tries 1 (RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S, 60 s by default; 20 s here, to keep the
run short). `gang_starts` lists the sizes Ray tried, from its controller's log.

preemption_steps_lost: the optimizer steps trained before the gang was ended that the restarted gang trained again,
i.e. (the highest step the 2-worker gang began, + 1) - (the step the 1-worker gang resumed at), from the workers'
sample logs (STRIDE_SAMPLE_LOG: one record per micro-batch a rank takes). 0 is the goal: nothing trained after the
preemption checkpoint. Without it the run would lose every step since its last periodic checkpoint (here: all).

Every process started here is stopped by pid (ray_cluster/local.py, ray_cluster/node.py), never by `ray stop`.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
    sys.path.pop(0)
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.procs import free_ports, read_jsonl  # noqa: E402

PYTHON = sys.executable
RAY = str(Path(PYTHON).parent / "ray")
RUN = "preempt"




def _nodes(head) -> list[dict]:
    """The cluster's nodes from the dashboard's state API (token auth)."""
    token = head.token_path.read_text().strip()
    request = urllib.request.Request(f"{head.dashboard_url}/api/v0/nodes?limit=100",
                                     headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(request, timeout=10) as response:
        return json.loads(response.read())["data"]["result"]["result"]




def _complete_steps(run_dir: Path) -> list[int]:
    """The steps of the run's complete checkpoints (checkpoint_<step> folders that verify), oldest first."""
    from stride.trainers.run.checkpointing import read_meta, verify

    folders = [c for c in run_dir.glob("checkpoint_*") if re.fullmatch(r"checkpoint_\d{8}", c.name)] if run_dir.is_dir() else []
    return sorted(read_meta(c)["step"] for c in folders if c.is_dir() and verify(c) is None)


def _wait(ready, proc: subprocess.Popen, timeout_s: float, what: str, poll_s: float = 0.2):
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if (value := ready()):
            return value
        if proc.poll() is not None:
            raise RuntimeError(f"the job exited ({proc.returncode}) before {what}")
        time.sleep(poll_s)
    raise RuntimeError(f"no {what} within {timeout_s:.0f} s")


def _client_env(head, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()  # the watcher's switch too: on unless the scenario turns it off
           if k not in ("RAY_ADDRESS", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH",
                        "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER")}
    env.update(head.client_env(), PYTHONUNBUFFERED="1", **extra)
    return env


def scenario(work: Path, *, deadline_s: int = 12, max_steps: int = 3000, checkpoint_every: int = 1000,
             start_timeout_s: float = 20.0, watcher: bool = True, timeout_s: float = 420.0) -> dict:
    """Run the scenario in `work` (data, run folder, logs); returns what it measured and saw. Every process it
    starts is stopped by pid before it returns, whatever happens. watcher=False: the baseline, Ray Train's
    preemption watcher off (RAY_TRAIN_ENABLE_PREEMPTION_WATCHER=0), so no preemption checkpoint is awaited; otherwise
    the watcher is Stride's default (the variable unset)."""
    from stride.ray_cluster import local

    work = Path(work)
    data, samples = work / "data", work / "samples"
    subprocess.run([PYTHON, "datasets/prepare.py", "tabular", "--out", str(data), "--rows", "4000"], cwd=REPO,
                   check=True, capture_output=True)
    # Ray's unix socket paths under a deep folder are too long: the nodes' folders go directly under /tmp.
    head_dir = Path(tempfile.mkdtemp(prefix="stpr-head-", dir="/tmp"))
    node_dir = Path(tempfile.mkdtemp(prefix="stpr-node-", dir="/tmp"))
    command = [PYTHON, "trainers/main.py", "--config", "trainers/configs/tabular_mlp.yaml",
               f"data.train_path={data}/train", f"data.val_path={data}/val", f"run.storage_path={work}",
               f"run.name={RUN}", "train.epochs=null", f"train.max_steps={max_steps}", "train.log_every_steps=50",
               "train.eval_every_steps=100000", f"checkpoint.every_steps={checkpoint_every}", "tracking.mlflow=false",
               "scaling.num_workers=[1,2]", "scaling.cpus_per_worker=1", "scaling.max_failures=0"]
    record: dict = {"command": " ".join(command[1:]), "deadline_s": deadline_s, "max_steps": max_steps,
                    "checkpoint_every": checkpoint_every, "exit_code": None, "left_alive": []}
    run_dir, job_log = work / RUN, work / "job.log"
    proc, deadline = None, None
    t_start = time.time()
    gcs, dashboard = free_ports(2)
    head = local.start_head(head_dir, port=gcs, dashboard_port=dashboard, num_cpus=1)
    try:
        local.add_node(head, node_dir, num_cpus=1)
        drained = [n["node_id"] for n in _nodes(head) if not n.get("is_head_node") and n.get("state") == "ALIVE"]
        assert len(drained) == 1, _nodes(head)
        record["drained_node"] = drained[0]
        with open(job_log, "w") as out:
            proc = subprocess.Popen(command, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                    env=_client_env(head, STRIDE_SHARED_FS="1", STRIDE_SAMPLE_LOG=str(samples),
                                                    RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S="1",
                                                    RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S=str(start_timeout_s),
                                                    **({} if watcher else {"RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0"})))
        # Training goes on on both nodes: a logged step, and both ranks' sample logs.
        _wait(lambda: any("train_loss" in r for r in read_jsonl(run_dir / "metrics.jsonl", skip_partial=True))
              and (samples / "rank1.jsonl").exists(), proc, timeout_s, "a logged step")
        record["training_started_s"] = time.time() - t_start
        t0 = time.time()
        drain = subprocess.run([RAY, "drain-node", "--address", head.address, "--node-id", record["drained_node"],
                                "--reason", "DRAIN_NODE_REASON_PREEMPTION", "--reason-message",
                                "spot instance reclaimed (preemption_bench)", "--deadline-remaining-seconds",
                                str(deadline_s)], env=_client_env(head), capture_output=True, text=True, timeout=120)
        t1 = time.time()
        record.update(drain_exit_code=drain.returncode, drain_output=(drain.stdout + drain.stderr)[-2000:],
                      drain_command_s=t1 - t0)
        if drain.returncode != 0:
            raise RuntimeError(f"ray drain-node failed ({drain.returncode}): {drain.stderr[-1000:]}")
        deadline = t0 + deadline_s  # the GCS counts from when it got the request, between t0 and t1
        # The preemption checkpoint: a complete one at a step that is not periodic.
        step = _wait(lambda: next((s for s in _complete_steps(run_dir) if s % checkpoint_every), None), proc,
                     deadline_s + 60, "a preemption checkpoint", poll_s=0.1) if watcher else None
        record.update(preemption_checkpoint_step=step, checkpoint_before_deadline_s=deadline - time.time())
        # The cloud takes the node after the deadline: every process of it, by pid (the raylet first among them).
        time.sleep(max(0.0, t1 + deadline_s + 1 - time.time()))
        record["node_stopped_pids"] = len(local.stop_node(node_dir))
        record["node_stopped_after_deadline_s"] = time.time() - deadline
        record["exit_code"] = proc.wait(timeout=timeout_s)
        record["resume_to_exit_s"] = time.time() - deadline
    finally:
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)  # its own session: the driver and what it started
            proc.wait()
        for stop, folder in ((local.stop_node, node_dir), (lambda d: local.stop_head(head), head_dir)):
            try:
                stop(folder)
            except Exception as e:  # noqa: BLE001 - reported, never hidden
                record["left_alive"].append(str(e))
            # Ray Train's own logs (the controller's decisions), kept with the run for a look afterwards.
            for log in (folder / "ray" / "session_latest" / "logs" / "train").glob("*.log"):
                (work / "ray-train-logs").mkdir(exist_ok=True)
                shutil.copy(log, work / "ray-train-logs" / f"{folder.name.split('-')[1]}-{log.name}")
            shutil.rmtree(folder, ignore_errors=True)
    record["wall_s"] = time.time() - t_start
    record["job_log"] = job_log.read_text()
    summary_path = run_dir / "summary.json"
    record["summary"] = json.loads(summary_path.read_text()) if summary_path.exists() else None
    record.update(steps_lost(samples))
    resumed = [ln for ln in record["job_log"].splitlines() if "resumed from" in ln]
    record["resume_log_lines"] = resumed
    if resumed and deadline is not None and (m := re.search(r"\] (\d\d):(\d\d):(\d\d) ", resumed[-1])):
        # Rank 0 logs local wall-clock time (whole seconds): training again this long after the deadline.
        day = time.localtime(deadline)
        at = time.mktime(day[:3] + tuple(int(x) for x in m.groups()) + (0, 0, day.tm_isdst))
        record["resumed_after_deadline_s"] = round(at - deadline, 1)
    controller = "\n".join(_message(line) for f in (work / "ray-train-logs").glob("*controller*.log")
                            for line in f.read_text().splitlines())
    record["gang_starts"] = [int(n) for n in re.findall(r"Attempting to start training worker group of size (\d+)",
                                                        controller)]
    record["failure_decisions"] = re.findall(r"\[FailurePolicy\] (\w+)\W+Source: (\w+)", controller)
    return record


def _message(line: str) -> str:
    """A Ray Train log line's message (its logs are JSON lines)."""
    try:
        return str(json.loads(line).get("message", ""))
    except (ValueError, AttributeError):
        return line


def steps_lost(samples: Path) -> dict:
    """From the ranks' sample logs: the world size of each gang in order, the step the last one resumed at, and
    preemption_steps_lost (steps the first gang began beyond where the next one resumed)."""
    records = [r for f in sorted(samples.glob("rank*.jsonl")) for r in read_jsonl(f, skip_partial=True)]
    sizes: list[int] = []
    for r in read_jsonl(samples / "rank0.jsonl", skip_partial=True):  # each gang's rank 0 appends to it, in time order
        if not sizes or sizes[-1] != r["world_size"]:
            sizes.append(r["world_size"])
    first = [r["step"] for r in records if r["world_size"] == 2]
    later = [r["step"] for r in records if r["world_size"] == 1]
    if not first or not later:
        return {"world_sizes": sizes, "resumed_at_step": None, "preemption_steps_lost": None}
    resumed = min(later)
    return {"world_sizes": sizes, "resumed_at_step": resumed, "steps_begun_before": max(first) + 1,
            "preemption_steps_lost": max(0, max(first) + 1 - resumed)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python benchmarks/preemption_bench.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--deadline-s", type=int, default=12, help="ray drain-node --deadline-remaining-seconds")
    ap.add_argument("--max-steps", type=int, default=3000, help="train.max_steps of the run")
    ap.add_argument("--no-watcher", action="store_true", help="the baseline: Ray Train's preemption watcher off")
    ap.add_argument("--keep", type=Path, default=None,
                    help="work in this folder and keep it (default: a temporary one)")
    args = ap.parse_args(argv)
    work = args.keep or Path(tempfile.mkdtemp(prefix="stride-preempt-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        r = scenario(work, deadline_s=args.deadline_s, max_steps=args.max_steps, watcher=not args.no_watcher)
    finally:
        if args.keep is None:
            shutil.rmtree(work, ignore_errors=True)
    summary = r.get("summary") or {}
    out = {"preemption_steps_lost": r.get("preemption_steps_lost"),
           "preemption_checkpoint_step": r.get("preemption_checkpoint_step"),
           "resumed_at_step": r.get("resumed_at_step"), "world_sizes": r.get("world_sizes"),
           "checkpoint_before_deadline_s": r.get("checkpoint_before_deadline_s"),
           "drain_command_s": r.get("drain_command_s"), "resumed_after_deadline_s": r.get("resumed_after_deadline_s"),
           "resume_to_exit_s": r.get("resume_to_exit_s"),
           "gang_starts": r.get("gang_starts"), "failure_decisions": r.get("failure_decisions"),
           "wall_s": r.get("wall_s"),
           "deadline_s": args.deadline_s, "max_steps": args.max_steps, "watcher": not args.no_watcher,
           "exit_code": r.get("exit_code"),
           "status": summary.get("status"), "global_step": summary.get("global_step"),
           "restarts": summary.get("restarts"), "preemptions": summary.get("preemptions"),
           "left_alive": r.get("left_alive")}
    print(json.dumps(out, indent=1))
    return 0 if out["status"] == "completed" and (out["preemption_steps_lost"] == 0 or args.no_watcher) else 1


if __name__ == "__main__":
    sys.exit(main())
