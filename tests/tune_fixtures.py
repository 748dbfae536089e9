"""Helpers for tests/test_tune.py: sweep files around the test data, the user's project (tests/user_project), the
driver's event log, a fake cluster for the resource checks."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
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


def fake_cluster(monkeypatch, *nodes: dict[str, float]) -> None:
    """What ray.nodes() and ray.cluster_resources() answer, without Ray: `nodes` alive, and one dead node with
    plenty of everything, which no check may count (Ray lists a dead node until it is forgotten)."""
    import ray

    alive = [{"Alive": True, "Resources": dict(n)} for n in nodes]
    dead = {"Alive": False, "Resources": {"CPU": 64.0, "GPU": 8.0}}
    total: dict[str, float] = {}
    for n in nodes:
        for k, v in n.items():
            total[k] = total.get(k, 0.0) + v
    monkeypatch.setattr(ray, "nodes", lambda: [*alive, dead])
    monkeypatch.setattr(ray, "cluster_resources", lambda: dict(total))


# ---- the user's own project (tests/user_project): a task module found in the working directory ----

USER_PROJECT = Path(__file__).resolve().parent / "user_project"
USER_TASK = "signal_task:SignalTask"


def copy_user_project(dst: Path) -> Path:
    """The user's folder, as a user has it: its three files, then `python make_data.py` run there."""
    shutil.copytree(USER_PROJECT, dst, ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "runs", "data"))
    r = subprocess.run([sys.executable, "make_data.py"], cwd=dst, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    return dst


def signal_param_bytes(channels: int, depth: int = 3, classes: int = 4) -> int:
    """float32 bytes of signal_task's SignalCNN: stem conv (kernel 7), `depth` convs (kernel 3), linear head."""
    return 4 * ((channels * 7 + channels) + depth * (channels * channels * 3 + channels) + channels * classes + classes)


def max_overlap(intervals: list[tuple[float, float]]) -> int:
    """The most intervals open at one instant."""
    points = sorted([(a, 1) for a, _ in intervals] + [(b, -1) for _, b in intervals], key=lambda p: (p[0], p[1]))
    best = cur = 0
    for _, d in points:
        cur += d
        best = max(best, cur)
    return best
