"""Elastic training: `scaling.num_workers: [min, max]` on a cluster that grows while the job runs.

A head with 2 CPUs; a job with num_workers [1, 3] starts 2 workers. A worker node with 1 CPU then joins (on this
machine, its own processes and ports); Ray's elastic policy notices it (scaling.resize_check_s) and restarts the
gang with 3 workers from the last checkpoint. The global micro-batch stays 64 x 3 = 192 rows throughout (96 per
worker with 2, 64 with 3), so every micro-step trains on exactly the rows the global sample order gives it,
whichever world size ran it: each row once per epoch, nothing skipped at the resize.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import time
from collections import Counter

import numpy as np
import pyarrow.parquet as pq
import pytest

from cluster_fixtures import PYTHON, REPO, clean_env, free_ports, short_tmp
from conftest import read_jsonl
from stride.datasets.order import Order
from stride.ray_cluster import local

pytestmark = pytest.mark.slow

GLOBAL_MICRO_BATCH = 64 * 3


@pytest.fixture
def head():
    folder = short_tmp("stel-head-")
    gcs, dashboard = free_ports(2)
    head = local.start_head(folder, port=gcs, dashboard_port=dashboard, num_cpus=2)
    yield head
    local.stop_head(head)  # by pid; raises if anything of it survives
    shutil.rmtree(folder, ignore_errors=True)


def _records(log_dir):
    return [r for f in sorted(log_dir.glob("rank*.jsonl")) for r in read_jsonl(f)]


def test_job_grows_from_two_to_three_workers_and_keeps_the_global_sample_order(head, tmp_path):
    data = tmp_path / "data"
    subprocess.run([PYTHON, "datasets/prepare.py", "tabular", "--out", str(data), "--rows", "20000"], cwd=REPO,
                   check=True, capture_output=True)
    log_dir, node_dir = tmp_path / "samples", short_tmp("stel-node-")
    args = [PYTHON, "trainers/main.py", "--config", "trainers/configs/tabular_mlp.yaml",
            f"data.train_path={data}/train", f"data.val_path={data}/val", f"run.storage_path={tmp_path}",
            "run.name=grow", "train.epochs=null", "train.max_steps=100000", "train.batch_size_per_worker=64",
            "model.hidden_sizes=[256, 256]", "train.log_every_steps=5", "train.eval_every_steps=100000",
            "checkpoint.every_steps=10", "tracking.mlflow_uri=null", "scaling.num_workers=[1,3]",
            "scaling.resize_check_s=2"]
    out = open(tmp_path / "job.log", "w")
    proc = subprocess.Popen(args, cwd=REPO, env=clean_env(**head.client_env(), STRIDE_SAMPLE_LOG=str(log_dir)),
                            stdout=out, stderr=subprocess.STDOUT)
    try:
        _wait(lambda: any(r["world_size"] == 2 and r["step"] >= 20 for r in _records(log_dir)), proc, 300)
        local.add_node(head, node_dir, num_cpus=1)
        # Ray sees the third CPU, stops the gang and starts 3 workers from the newest checkpoint.
        _wait(lambda: sum(r["world_size"] == 3 for r in _records(log_dir)) >= 3 * 20, proc, 300)
        proc.send_signal(signal.SIGTERM)  # checkpoint at the next step, exit 143
        assert proc.wait(timeout=180) == 143, (tmp_path / "job.log").read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
        out.close()
        local.stop_node(node_dir)
        shutil.rmtree(node_dir, ignore_errors=True)

    log = (tmp_path / "job.log").read_text()
    assert "training grow on 1-3 CPU worker(s)" in log
    summary = json.loads((tmp_path / "grow" / "summary.json").read_text())
    assert summary["status"] == "interrupted" and summary["world_size"] == 3 and summary["restarts"] >= 1

    records = _records(log_dir)
    by_size = {w: [r for r in records if r["world_size"] == w] for w in (2, 3)}
    assert all(len(r["sample_ids"]) == GLOBAL_MICRO_BATCH // 2 for r in by_size[2])
    assert all(len(r["sample_ids"]) == GLOBAL_MICRO_BATCH // 3 for r in by_size[3])
    # The 3-worker gang resumed where a checkpoint of the 2-worker gang left off (steps since it are redone).
    first3 = min(r["micro_step"] for r in by_size[3])
    assert first3 % 10 == 0 and 20 <= first3 <= max(r["micro_step"] for r in by_size[2]) + 1

    # Every micro-step, whoever ran it and however often (steps since a checkpoint are redone after a restart),
    # trained on exactly the rows the global order gives it: each row once per epoch, across both world sizes.
    files = sorted((data / "train").glob("*.parquet"))  # the split in file order, its row groups the blocks
    sample_ids = np.concatenate([pq.read_table(f, columns=["sample_id"]).column(0).to_numpy() for f in files])
    blocks = tuple(m.row_group(g).num_rows for m in map(pq.read_metadata, files) for g in range(m.num_row_groups))
    order = Order(blocks, 0, GLOBAL_MICRO_BATCH, 65536)  # run.seed 0, the default data.shuffle_window_rows
    steps = sorted({r["micro_step"] for r in records})
    assert steps == list(range(steps[-1] + 1))  # no micro-step skipped
    assert steps[-1] >= order.micro_steps_per_epoch  # the check below covers a whole epoch at least
    # Per record (a rank's attempt): a gang stopped for the resize may have been killed after one rank logged a
    # micro-step and before the other did, so attempts are checked rank by rank, and a micro-step's ranks together
    # cover exactly its global micro-batch.
    for r in records:
        m, w, rank = r["micro_step"], r["world_size"], r["rank"]
        assert sorted(r["sample_ids"]) == sorted(sample_ids[order.rows(m, rank, w)].tolist()), (m, w, rank)
    for m in steps:
        for w in (2, 3):
            ranks = {r["rank"] for r in by_size[w] if r["micro_step"] == m}
            if ranks == set(range(w)):  # a complete attempt: together exactly the global micro-batch
                ids = Counter(i for r in by_size[w] if r["micro_step"] == m for i in r["sample_ids"])
                assert set(ids) == set(sample_ids[order.rows(m, 0, 1)].tolist()), (m, w)


def _wait(ready, proc, timeout):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if ready():
            return
        assert proc.poll() is None, f"the job exited early with {proc.returncode}"
        time.sleep(1)
    raise AssertionError(f"not reached in {timeout}s")
