"""Run several trainers/torchrun.py cases under ONE torchrun launch: each case a run of its own, the same process.

    python -m torch.distributed.run --nproc-per-node 2 tests/torchrun_cases.py CASES.json RESULTS_DIR

Why: a test file's torchrun cases each paid torchrun's, Python's and torch's start-up and the process group's
set-up (seconds each on a 2-core machine); here that is paid once per batch. CASES.json is a list of
{"label": ..., "args": [trainers/torchrun.py arguments], "env": {extra variables, optional}, "entry": "stride"
(optional: the args are a `stride` command line instead)}, run in order (a case
may resume the run of an earlier one). Every rank calls stride.trainers.launch.torchrun.main(args) per case, as the script's
own entry point does: train() initializes the process group from the environment (env://) and destroys it at the
end, so the next case initializes it again. Not on torchrun's agent store: every init writes the same keys there
("default_pg/0/..."), and a rank that starts the next case first could read its peer's address from the case before.
Each case gets a store of its own instead, as a launch of its own would: rank 0 hosts it on a free port
(TORCHELASTIC_USE_AGENT_STORE=False, MASTER_PORT) and tells the others the port through the agent's store. A case
that fails does not stop the others. Each rank writes RESULTS_DIR/rank<r>.json: per case its label, exit code,
stdout and stderr (their tails) and the traceback of an unexpected exception. Exit 0 only if every case passed on
this rank.

What one run leaves in the process for the next is put back between cases: environment variables, deterministic
algorithms, thread count, signal handlers, Stride's log handler and dynamo's caches (seeds are the loop's own).
"""

from __future__ import annotations

import io
import json
import os
import signal
import sys
import traceback
from datetime import timedelta
from pathlib import Path

# Import Stride as the `stride` package from this checkout, as trainers/torchrun.py does when run as a file.
import runpy

runpy.run_path(str(Path(__file__).resolve().parents[1] / "stride" / "_checkout.py"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

TAIL = 20000  # characters of each stream kept per case: enough for a run's log, not a results file of megabytes
SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)


class Tee(io.TextIOBase):
    """Writes to the launch's own stream (torchrun's output stays whole) and keeps a copy for the case's result."""

    def __init__(self, stream):
        self.stream, self.copy = stream, io.StringIO()

    def write(self, s: str) -> int:
        self.stream.write(s)
        return self.copy.write(s)

    def flush(self) -> None:
        self.stream.flush()

    def isatty(self) -> bool:  # trainers/torchrun.py draws a progress bar on a terminal only
        return False


def case_store_env(agent: dist.TCPStore | None, index: int, rank: int) -> dict[str, str]:
    """MASTER_PORT of the store rank 0 will host for this case (train() opens it with the process group)."""
    if agent is None:  # one process: train() starts no process group
        return {}
    key = f"torchrun_cases/{index}/port"
    if rank == 0:
        import socket

        with socket.socket() as s:  # a port free now; the case's store binds it a moment later
            s.bind((os.environ["MASTER_ADDR"], 0))
            agent.set(key, str(s.getsockname()[1]))
    return {"TORCHELASTIC_USE_AGENT_STORE": "False", "MASTER_PORT": agent.get(key).decode()}


def run_case(case: dict, store_env: dict[str, str]) -> dict:
    from stride import commands
    from stride.trainers.launch import torchrun

    saved_env = dict(os.environ)
    saved = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
             torch.backends.cudnn.benchmark, torch.get_num_threads(), {s: signal.getsignal(s) for s in SIGNALS})
    out, err = Tee(sys.stdout), Tee(sys.stderr)
    sys.stdout, sys.stderr = out, err
    result = {"label": case.get("label"), "args": case["args"], "code": None, "exception": None}
    try:
        os.environ.update({**store_env, **{k: str(v) for k, v in (case.get("env") or {}).items()}})
        entry = commands.main if case.get("entry") == "stride" else torchrun.main  # `stride <command>`, or training
        result["code"] = entry(list(case["args"]))
    except (Exception, SystemExit) as e:  # argparse's SystemExit too: recorded, and the next case runs (an interrupt
        # is not a case's failure: it ends the launch)
        result["code"] = e.code if isinstance(e, SystemExit) and isinstance(e.code, int) else 1
        result["exception"] = traceback.format_exc()[-TAIL:]
        print(result["exception"], file=sys.stderr)
    finally:
        sys.stdout, sys.stderr = out.stream, err.stream
        # A run that failed midway left its process group up: the next case initializes its own.
        if dist.is_available() and dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 (a broken group: nothing more to free)
                pass
        # Variables the case set, and those the run set itself (CUBLAS_WORKSPACE_CONFIG by setdefault, inductor's
        # TORCHINDUCTOR_CACHE_DIR once it resolved its default): the next case starts from the launch's environment.
        os.environ.clear()
        os.environ.update(saved_env)
        torch.use_deterministic_algorithms(saved[0], warn_only=saved[1])
        torch.backends.cudnn.benchmark = saved[2]
        torch.set_num_threads(saved[3])
        for s, handler in saved[4].items():
            if handler is not None:
                signal.signal(s, handler)
        # The loop's log handler writes to this case's Tee; each run installs its own (loop.setup_logging).
        import logging

        logging.getLogger("stride").handlers.clear()
        # Compiled code and guards of this case's modules: never reused (nor matched against) by the next case.
        if "torch._dynamo" in sys.modules:
            torch._dynamo.reset()
        import gc

        gc.collect()
    result["stdout"], result["stderr"] = out.copy.getvalue()[-TAIL:], err.copy.getvalue()[-TAIL:]
    return result


def main(argv: list[str]) -> int:
    cases_path, results_dir = Path(argv[0]), Path(argv[1])
    cases = json.loads(cases_path.read_text())
    rank, world_size = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    # torchrun's agent hosts this store for the whole launch: only the case ports go through it. A rank waits there
    # for rank 0 to finish the case before (up to an hour: a case's run, not a hang, is what it waits for).
    agent = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size, is_master=False,
                          timeout=timedelta(hours=1)) if world_size > 1 else None
    results = []
    for index, case in enumerate(cases):
        results.append(run_case(case, case_store_env(agent, index, rank)))
        # Written after every case: a launch that dies in a later case still tells what the earlier ones did.
        results_dir.mkdir(parents=True, exist_ok=True)
        tmp = results_dir / f".rank{rank}.json.tmp"
        tmp.write_text(json.dumps(results, indent=1))
        tmp.replace(results_dir / f"rank{rank}.json")
    if agent is not None:
        # torchrun ends every worker once one exits non-zero: a rank whose cases failed quickly waits here for the
        # others to finish theirs (and write their results) before it exits.
        agent.set(f"torchrun_cases/done/{rank}", "1")
        agent.wait([f"torchrun_cases/done/{r}" for r in range(world_size)])
    failed = [r for r in results if r["code"] != 0]
    for r in failed:
        print(f"torchrun_cases: rank {rank}: case {r['label']!r} exited {r['code']}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    code = main(sys.argv[1:])
    # As trainers/torchrun.py: everything is written and every process group destroyed; leave without the
    # interpreter's finalization, where a gloo thread torn down unjoined could abort a finished launch (SIGABRT).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
