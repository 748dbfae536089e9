"""Helpers for tests/test_tune.py: sweep files around the test data, the driver's event log, stopping a killed
driver's leftovers by pid."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parent.parent
TABULAR_YAML = str(REPO / "trainers" / "configs" / "tabular_mlp.yaml")


def write_sweep(path: Path, data_dir: Path, storage: Path, *, sweep: dict[str, Any], base: dict[str, Any] | None = None,
                space: dict[str, Any]) -> Path:
    """A sweep YAML over the tabular config and `data_dir`: tiny model, 1 worker per trial, frequent evals."""
    doc = {
        "sweep": {"base_config": TABULAR_YAML, "storage_path": str(storage), "metric": "val_loss", "mode": "min",
                  "seed": 0, **sweep},
        "base": {"data.train_path": str(data_dir / "train"), "data.val_path": str(data_dir / "val"),
                 "scaling.num_workers": 1, "model.hidden_sizes": [32], "optim.warmup_steps": 5,
                 "train.eval_every_steps": 10, "train.log_every_steps": 10, "checkpoint.every_steps": 10,
                 **(base or {})},
        "space": space,
    }
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def events(sweep_dir: Path) -> list[dict]:
    path = sweep_dir / "trial_events.jsonl"
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            pass  # a line being written right now
    return out


def wait_for(predicate, timeout: float, proc=None, what: str = "condition"):
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the driver exited ({proc.returncode}) while waiting for {what}")
        time.sleep(0.2)
    raise AssertionError(f"no {what} within {timeout} s")


def session_pids(sid: int) -> list[int]:
    """Processes in session `sid` (a driver started with start_new_session=True, and the Ray it started)."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid:  # after the command: state, ppid, pgrp, session
            out.append(int(stat.parent.name))
    return out


def stop_session(sid: int, timeout: float = 30) -> None:
    """A SIGKILLed driver leaves Ray's agents behind (they outlive their raylet for a while): stop each one by pid."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        pids = session_pids(sid)
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.5)
    raise AssertionError(f"processes of session {sid} still alive: {session_pids(sid)}")


def max_overlap(intervals: list[tuple[float, float]]) -> int:
    """The most intervals open at one instant."""
    points = sorted([(a, 1) for a, _ in intervals] + [(b, -1) for _, b in intervals], key=lambda p: (p[0], p[1]))
    best = cur = 0
    for _, d in points:
        cur += d
        best = max(best, cur)
    return best
