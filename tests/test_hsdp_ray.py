"""train.strategy=hsdp on a two-node Ray cluster (issue 47): its own head and a second node on this machine (2 CPUs
each), 4 workers, 2 per node. The shard groups are the nodes, whatever order Ray gave the ranks in; a shard size of 4
makes one group over both nodes, and the run says so in one warning naming the group and the nodes. The first run
also keeps its state on the CPU (train.fsdp.offload=cpu): the Ray workers rebuild both keys from the driver's dict."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest

from cluster_fixtures import PYTHON, REPO, clean_env, free_ports, short_tmp
from runs import tiny
from stride.ray_cluster import local

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def two_nodes():
    head_dir, node_dir = short_tmp("sthsdp-head-"), short_tmp("sthsdp-node-")
    gcs, dashboard = free_ports(2)
    head = local.start_head(head_dir, port=gcs, dashboard_port=dashboard, num_cpus=2)
    try:
        local.add_node(head, node_dir, num_cpus=2)
        yield head
    finally:
        local.stop_node(node_dir)
        local.stop_head(head)  # by pid; raises if anything of it survives
        shutil.rmtree(node_dir, ignore_errors=True)
        shutil.rmtree(head_dir, ignore_errors=True)


def train(head, tmp_path, tabular_data, name, *extra) -> tuple[dict, str]:
    args = tiny(tmp_path, tabular_data, 2, "scaling.num_workers=4", "train.strategy=hsdp", "train.log_every_steps=2",
                "train.eval_every_steps=2", "checkpoint.every_steps=2", "model.hidden_sizes=[64, 64]",
                "tracking.mlflow=false", "scaling.use_gpu=false", *extra, name=name)
    # Both nodes read the data set from this machine's disk: say it is shared, as a cluster with NFS would.
    r = subprocess.run([PYTHON, "trainers/main.py", *args], cwd=REPO, capture_output=True, text=True, timeout=600,
                       env=clean_env(**head.client_env(), STRIDE_SHARED_FS="1"))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return json.loads((tmp_path / name / "summary.json").read_text()), r.stdout + r.stderr


def test_the_shard_groups_are_the_nodes_and_a_group_over_both_is_said_once(two_nodes, tmp_path, tabular_data):
    s, out = train(two_nodes, tmp_path, tabular_data, "by_node", "train.fsdp.offload=cpu")
    nodes = s["worker_nodes"]
    assert s["status"] == "completed" and s["strategy"] == "hsdp" and len(set(nodes)) == 2
    mesh = s["mesh"]
    assert (mesh["shard_size"], mesh["replicas"]) == (2, 2)  # the default: the workers per node
    for group, on in zip(mesh["groups"], mesh["group_nodes"]):
        assert {nodes[r] for r in group} == set(on) and len(on) == 1, mesh  # each group on one node
    assert mesh["group_nodes"][0] != mesh["group_nodes"][1]
    assert "spans nodes" not in out and s["offload"] == "cpu"

    s, out = train(two_nodes, tmp_path, tabular_data, "over_both", "train.fsdp.shard_size=4")
    assert s["status"] == "completed" and s["mesh"]["groups"] == [[0, 1, 2, 3]] and s["mesh"]["replicas"] == 1
    warned = [line for line in out.splitlines() if "spans nodes" in line]
    assert len(warned) == 1 and "shard group 0" in warned[0], out[-3000:]
    assert all(n in warned[0] for n in set(s["worker_nodes"])), warned
