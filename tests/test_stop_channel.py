"""The driver's stop request reaches Ray workers through its channel (trainers/launch/stop_channel.py), not a file:
on the suite's shared Ray head, a driver posts the request and a task on a worker process sees it (issue 44: nothing
needs a shared filesystem)."""

from __future__ import annotations

import textwrap

import pytest

from conftest import REPO, run_cli

pytestmark = pytest.mark.slow

SCRIPT = textwrap.dedent("""
    import time
    import ray
    from stride.ray_cluster.connect import init_ray
    from stride.trainers.launch.stop_channel import StopChannel, poller

    init_ray()

    @ray.remote(num_cpus=0)
    def worker(name):
        ask = poller(name)
        first = ask()
        deadline = time.time() + 60
        while (got := ask()) is None and time.time() < deadline:
            time.sleep(0.2)
        return first, got

    channel = StopChannel("stride-stop-test")
    seen = worker.remote(channel.name)
    time.sleep(3)  # the worker asks first (and hears nothing), then the driver posts
    channel.post({"status": "interrupted", "signal": 15})
    first, got = ray.get(seen)
    print("FIRST", first)
    print("GOT", got)
""")



def test_a_posted_stop_reaches_a_worker_process(ray_cluster, tmp_path):
    (tmp_path / "channel_check.py").write_text(SCRIPT)
    done = run_cli([str(tmp_path / "channel_check.py")], cwd=REPO, env=ray_cluster, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "GOT {'status': 'interrupted', 'signal': 15}" in done.stdout
