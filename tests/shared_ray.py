"""One token-auth Ray head for the whole test session, which tests join as a user joins a cluster.

An embedded Ray costs about 40 s of start-up on a 2-core machine; a run that joins a running head pays a few
seconds. Tests that train on Ray request the `ray_cluster` fixture: it returns the client environment Stride
supports (RAY_ADDRESS, RAY_AUTH_MODE, RAY_AUTH_TOKEN_PATH) and, after the test, fails it if the test left actors,
placement groups or reserved CPUs behind, so that a leak fails the test that caused it and not the next one.

The head has 2 logical CPUs whatever the machine has, so a test sees the same cluster on 2 cores as on 64. Tests
whose guarantee is about a cluster of their own (make train's embedded Ray, the stride-auth-* cleanup, a node
joining an elastic run, the local head's own lifecycle) keep starting their own.
"""

from __future__ import annotations

import json
import shutil
import time
import urllib.request

import pytest

from cluster_fixtures import free_ports, short_tmp
from s3_server import environment, node_identity
from stride.ray_cluster import local

HEAD_CPUS = 2
# A driver that exits (or is killed) has its actors and placement groups removed by the GCS within seconds; a
# loaded 2-core machine has been seen to take 20.
SETTLE_S = 60


def _cluster_singleton(actor: dict) -> bool:
    """Ray Data's and Ray Train's own named, detached, CPU-less actors (stats, usage, autoscaling coordinator,
    Train's state actor) are created once per cluster (get_if_exists) and live as long as it by design: not a
    test's leak. Anything that holds a CPU is caught by the reserved-CPU check whatever it is."""
    return bool(actor.get("is_detached") and actor.get("name")
                and not (actor.get("required_resources") or {}).get("CPU"))


class SharedHead:
    def __init__(self, head: local.Head):
        self.head = head
        self._token = head.token_path.read_text().strip()

    def env(self) -> dict[str, str]:
        return self.head.client_env()

    def _get(self, path: str) -> dict:
        request = urllib.request.Request(self.head.dashboard_url + path, headers={"Authorization": f"Bearer {self._token}"})
        with urllib.request.urlopen(request, timeout=10) as response:
            return json.loads(response.read())["data"]

    def leftovers(self) -> list[str]:
        """What a finished test left on the head: live actors, placement groups, CPUs still reserved."""
        out = []
        actors = self._get("/api/v0/actors?limit=10000&detail=true")["result"]["result"]
        out += [f"actor {a.get('class_name')} ({a['state']})" for a in actors
                if a["state"] != "DEAD" and not _cluster_singleton(a)]
        groups = self._get("/api/v0/placement_groups?limit=10000")["result"]["result"]
        out += [f"placement group {g.get('name') or g['placement_group_id'][:8]} ({g['state']})"
                for g in groups if g["state"] != "REMOVED"]
        usage = self._get("/api/cluster_status")["clusterStatus"]["loadMetricsReport"]["usage"]
        used = usage.get("CPU", [0.0, HEAD_CPUS])[0]
        if used > 1e-6:
            out.append(f"{used:g} of {HEAD_CPUS} CPUs reserved")
        return out

    def wait_idle(self, timeout_s: float = SETTLE_S) -> list[str]:
        deadline = time.monotonic() + timeout_s
        while (left := self.leftovers()) and time.monotonic() < deadline:
            time.sleep(0.5)
        return left


@pytest.fixture(scope="session")
def shared_ray_head():
    """Module-scoped fixtures that train on it call `assert not shared_ray_head.wait_idle()` when done."""
    folder = short_tmp("stc-shared-")
    gcs, dashboard = free_ports(2)
    with environment(node_identity()):  # the node's own credentials for the suite's S3 server
        head = local.start_head(folder, port=gcs, dashboard_port=dashboard, num_cpus=HEAD_CPUS)
    try:
        yield SharedHead(head)
    finally:
        local.stop_head(head)  # by pid; raises if anything of it survives
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def ray_cluster(shared_ray_head):
    """The shared head's client environment; the test fails if it leaves actors, groups or reserved CPUs."""
    if left := shared_ray_head.leftovers():  # not this test's doing: say so instead of blaming it
        left = shared_ray_head.wait_idle()
        assert not left, f"the shared Ray head was not idle before this test: {left}"
    yield shared_ray_head.env()
    left = shared_ray_head.wait_idle()
    assert not left, f"this test left on the shared Ray head: {left}"
