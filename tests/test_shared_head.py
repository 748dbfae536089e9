"""The shared head's leak check (tests/shared_ray.py) sees what a test leaves behind: a detached actor that holds a
CPU and a placement group outlive the driver that made them, and the check names both until they are removed."""

import pytest

from conftest import run_cli

pytestmark = pytest.mark.slow

LEAK = """
import ray
from ray.util.placement_group import placement_group

ray.init(namespace="leak-probe")
actor = ray.remote(num_cpus=1)(type("Leaky", (), {"ping": lambda self: 1})).options(
    name="leaky", namespace="leak-probe", lifetime="detached").remote()
ray.get(actor.ping.remote())
group = placement_group([{"CPU": 1}], name="leaky-group", lifetime="detached")
ray.get(group.ready())
"""

CLEAN = """
import ray
from ray.util.placement_group import remove_placement_group

ray.init(namespace="leak-probe")
ray.kill(ray.get_actor("leaky"))
remove_placement_group(ray.util.get_placement_group("leaky-group"))
"""


def test_the_leak_check_names_what_a_driver_left_and_clears_once_it_is_gone(shared_ray_head):
    assert not shared_ray_head.wait_idle()
    r = run_cli(["-c", LEAK], env=shared_ray_head.env(), timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    try:
        left = shared_ray_head.wait_idle(timeout_s=5)  # the driver has exited: these stay
        assert "actor Leaky (ALIVE)" in left, left
        assert any(x.startswith("placement group leaky-group") for x in left), left
        assert any(x.endswith("CPUs reserved") for x in left), left
    finally:
        r = run_cli(["-c", CLEAN], env=shared_ray_head.env(), timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert shared_ray_head.wait_idle() == []
