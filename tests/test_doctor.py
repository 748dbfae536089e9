"""ray_cluster.doctor: usage errors (exit 2, one line, fast), gang planning, the command's report of a failure (one
stderr line each, exit 1), the preflight's checks of torchrun's own gang (no Ray), and on the session's shared 2-CPU
head (tests/shared_ray.py): the command's healthy gang passes, and the preflight API fails a threshold and an
unwritable storage path by name and reports hung workers and unplaceable gangs instead of waiting."""

from __future__ import annotations

import json
import os
import time

import pytest

from conftest import free_port, run_cli, run_cli_forked

DOCTOR = ["-m", "stride.ray_cluster.doctor"]
CORES = os.cpu_count() or 1


# ---- no Ray ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("args, flag", [
    (["--num-workers", "0"], "--num-workers"),
    (["--num-workers", "two"], "--num-workers"),
    (["--use-gpu", "maybe"], "--use-gpu"),
    (["--timeout-s", "-5"], "--timeout-s"),
    (["--min-allreduce-gbps", "fast"], "--min-allreduce-gbps"),
    (["--cpus-per-worker", "0"], "--cpus-per-worker"),
    (["--no-such-flag"], "--no-such-flag"),
])
def test_bad_option_value_exits_2_with_one_line(args, flag):
    p = run_cli_forked([*DOCTOR, *args], timeout=60)
    assert p.returncode == 2, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and flag in lines[0] and "Traceback" not in p.stderr, p.stderr
    assert p.stdout == ""


def test_more_workers_than_cpus_exits_2_quickly(tmp_path):
    t0 = time.monotonic()
    p = run_cli_forked([*DOCTOR, "--num-workers", str(CORES + 1), "--storage-path", str(tmp_path)], timeout=60)
    elapsed = time.monotonic() - t0
    assert p.returncode == 2, p.stderr
    line = p.stderr.strip()
    assert "\n" not in line and "Traceback" not in line
    assert f"--num-workers ({CORES + 1})" in line and f"{CORES} CPUs" in line, line  # requested and available
    assert elapsed < 20, f"took {elapsed:.1f} s: the refusal must not wait for Ray"


def test_unreachable_address_exits_2_without_waiting(tmp_path):
    address = f"127.0.0.1:{free_port()}"  # nothing listens there
    t0 = time.monotonic()
    p = run_cli_forked([*DOCTOR, "--address", address, "--storage-path", str(tmp_path)], timeout=120)
    assert p.returncode == 2, p.stderr[-2000:]
    assert f"--address ({address}) is not reachable" in p.stderr and "Traceback" not in p.stderr
    assert time.monotonic() - t0 < 60


@pytest.mark.slow
def test_a_listener_that_is_not_ray_fails_the_connection_by_timeout(tmp_path):
    import socket

    with socket.socket() as server:  # accepts TCP connections (the kernel's backlog) and never answers
        server.bind(("127.0.0.1", 0))
        server.listen(16)
        address = f"127.0.0.1:{server.getsockname()[1]}"
        t0 = time.monotonic()
        p = run_cli([*DOCTOR, "--address", address, "--timeout-s", "5", "--json", "--storage-path", str(tmp_path)],
                    timeout=120)
    assert p.returncode == 1, p.stdout[-2000:] + p.stderr[-2000:]
    report = json.loads(p.stdout)
    assert report["failures"] == [f"ray failed on node {address}: measured hung, threshold done within 5 s; "
                                  f"connecting to Ray at {address} did not finish within 5 s"]
    assert time.monotonic() - t0 < 60


NODE = {"Alive": True, "NodeManagerAddress": "10.0.0.1", "NodeID": "a" * 56}


def node(cpus: float, gpus: float = 0, ip: str = "10.0.0.1", node_id: str = "a") -> dict:
    return dict(NODE, NodeManagerAddress=ip, NodeID=node_id * 56, Resources={"CPU": cpus, "GPU": gpus})


@pytest.mark.parametrize("workers, use_gpu, cpus_per_worker, nodes, words", [
    (2, True, 1.0, [node(8)], ["--use-gpu (true) needs GPUs but the cluster has none"]),
    (4, True, 1.0, [node(8, 2)], ["--num-workers (4)", "needs 4 GPUs but the cluster has 2", "--num-workers 2"]),
    (3, False, 1.0, [node(2)], ["--num-workers (3)", "= 3 CPUs exceeds the cluster's 2 CPUs", "--num-workers 2"]),
    (1, False, 4.0, [node(2), node(2, node_id="b")], ["--cpus-per-worker (4) exceeds the largest node's 2 CPUs"]),
    # 3.75 of 4 CPUs in all, but a 1.25-CPU worker fits only once on each 2-CPU node
    (3, False, 1.25, [node(2), node(2, node_id="b")], ["do not fit on the cluster's nodes (at most 2)"]),
    # GPU workers need a node with both: the GPU node has 1 CPU free for one of them
    (2, True, 1.0, [node(1, 2), node(8, 0, node_id="b")], ["do not fit", "(at most 1)"]),
])
def test_impossible_gangs_are_refused_naming_requested_and_available(workers, use_gpu, cpus_per_worker, nodes, words):
    from stride.ray_cluster.doctor import Names, plan_gang
    from stride.errors import UsageError

    with pytest.raises(UsageError) as e:
        plan_gang(workers, use_gpu, cpus_per_worker, nodes, Names())
    for w in words:
        assert w in str(e.value), str(e.value)


def test_gang_auto_and_preflight_names():
    from stride.ray_cluster.doctor import Names, plan_gang
    from stride.errors import UsageError

    assert plan_gang("auto", "auto", 1.0, [node(8, 4)], Names()) == (4, True)  # one worker per GPU
    assert plan_gang("auto", "auto", 1.0, [node(2)], Names()) == (2, False)  # two CPU workers: an all-reduce to test
    assert plan_gang("auto", False, 1.0, [node(1)], Names()) == (1, False)
    with pytest.raises(UsageError, match=r"scaling\.num_workers \(3\).*use scaling\.num_workers=2"):
        plan_gang(3, False, 1.0, [node(2)], Names("config"))


def test_the_command_prints_each_failure_on_stderr_counts_it_in_the_table_and_exits_1(capsys):
    from stride.ray_cluster.doctor import EXIT_FAILED, CheckResult, _report, parse_args

    rows = [CheckResult("gemm", "10.0.0.1", "pass", 12.0, "GFLOP/s", 1.0, "fp32"),
            CheckResult("allreduce", "all", "fail", 0.25, "GB/s", 1e9, "gloo, 2 workers"),
            CheckResult("storage", "10.0.0.1", "fail", "not writable", detail="create folder failed: /x is not a folder")]
    assert _report(parse_args(["--quick"]), rows, {}, 3.0) == EXIT_FAILED
    out, err = capsys.readouterr()
    table = out.splitlines()
    assert table[0].startswith("CHECK") and any(ln.startswith("gemm") and " pass " in ln for ln in table)
    assert "1 passed, 2 failed" in table[-1]
    assert err.splitlines() == [f"doctor: FAIL {rows[1].failure_line()}", f"doctor: FAIL {rows[2].failure_line()}"]


def test_failure_line_names_check_node_value_and_threshold():
    from stride.ray_cluster.doctor import CheckResult, format_table

    row = CheckResult("allreduce", "all", "fail", 0.25, "GB/s", 1e9, "gloo, 2 workers")
    assert not row.ok
    assert row.failure_line() == "allreduce failed on node all: measured 0.25 GB/s, threshold >= 1e+09 GB/s; gloo, 2 workers"
    table = format_table([row, CheckResult("disk", "10.0.0.1", "pass", 80.0, "GB", 1.0, "free at /x")])
    assert table.splitlines()[0].split()[:5] == ["CHECK", "NODE", "STATUS", "VALUE", "THRESHOLD"]
    assert "FAIL" in table.splitlines()[1] and "80 GB" in table.splitlines()[2]


def test_the_preflight_under_torchrun_checks_the_gangs_own_processes_and_fails_by_name(tmp_path):
    """check_gang_in_place (scaling.preflight under torchrun) in one process: its checks pass here, and a second rank
    on another host (what the gang's all_gather would bring back from it) with another torch and a storage it cannot
    write fails the versions, storage and disk checks on that host, which the run's verdict names (exit 2)."""
    import torch

    from stride.errors import UsageError
    from stride.ray_cluster.doctor import check_gang_in_place
    from stride.trainers.launch.checks import judge_preflight

    storage = tmp_path / "runs"
    rows = check_gang_in_place(torch.device("cpu"), str(storage))
    status = {r.check: r.status for r in rows}
    assert status == {"gang": "pass", "versions": "pass", "gpu": "skip", "gemm": "pass", "storage": "pass",
                      "disk": "pass", "allreduce": "skip"}, rows
    assert list(storage.iterdir()) == []  # the probe file was deleted

    def with_another_host(mine):
        if isinstance(mine, dict) and "torch" in mine:  # the probe
            return [mine, dict(mine, hostname="other-host", torch="0.0.0")]
        if isinstance(mine, dict) and "stage" in mine:  # the storage probe of each host's first rank
            return [mine, {"ok": False, "stage": "write", "error": "OSError: Read-only file system", "free_bytes": 0,
                           "write_mb_s": None}]
        return [mine, mine]  # the GEMM

    rows = check_gang_in_place(torch.device("cpu"), str(storage), all_gather=with_another_host)
    failed = [r.failure_line() for r in rows if not r.ok]
    assert [r.split(":")[0] for r in failed] == ["versions failed on node other-host", "storage failed on node "
                                                 "other-host", "disk failed on node other-host"], failed
    assert "torch 0.0.0" in failed[0] and "Read-only file system" in failed[1]
    with pytest.raises(UsageError) as e:
        judge_preflight(rows, time.perf_counter(), show=False)
    assert str(e.value) == (f"scaling.preflight (true) failed: {failed[0]} (+2 more above); fix the node or storage, "
                            f"or set scaling.preflight=false to train anyway")


# ---- the shared 2-CPU head (tests/shared_ray.py), joined through RAY_ADDRESS -----------------------------

def by_check(report: dict) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for row in report["checks"]:
        out.setdefault(row["check"], []).append(row)
    return out


@pytest.mark.slow
def test_healthy_two_worker_cpu_gang_passes_with_json(tmp_path, ray_cluster):
    storage = tmp_path / "runs"
    p = run_cli([*DOCTOR, "--num-workers", "2", "--storage-path", str(storage), "--json"], env=ray_cluster, timeout=400)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    report = json.loads(p.stdout)  # stdout is the JSON and nothing else
    assert report["ok"] is True and report["failures"] == [] and report["num_workers"] == 2
    checks = by_check(report)
    for name in ("node", "gang", "versions", "gemm", "storage", "disk", "allreduce"):
        assert name in checks and all(r["status"] == "pass" for r in checks[name]), (name, checks.get(name))
    assert checks["gpu"][0]["status"] == "skip"
    (allreduce,) = checks["allreduce"]
    assert allreduce["unit"] == "GB/s" and allreduce["value"] > 0 and "gloo, 2 workers" in allreduce["detail"]
    assert all(r["value"] > 0 and r["unit"] == "GFLOP/s" for r in checks["gemm"])
    assert "torch " in checks["versions"][0]["value"]
    assert [w["rank"] for w in report["workers"]] == [0, 1]
    assert list(storage.iterdir()) == []  # the probe file was deleted
    print(f"doctor wall {report['wall_s']} s, stages {report['elapsed_s']}")


PREFLIGHT = r"""
import json, sys, time
import ray
from stride.trainers.config_reader import load_config
from stride.ray_cluster.connect import UsageError, init_ray, quiet_ray_env
from stride.ray_cluster import doctor

storage, blocker = sys.argv[1:3]
quiet_ray_env()
init_ray()
out = {}

t0 = time.monotonic()
rows = doctor.run_preflight(2, "auto", blocker, 1.0, min_allreduce_gbps=1e9)
out["failed"] = {"s": time.monotonic() - t0, "rows": [r.__dict__ for r in rows], "bad": [r.failure_line() for r in rows if not r.ok]}

try:
    doctor.run_preflight(3, False, storage, 1.0)
except UsageError as e:
    out["impossible"] = str(e)

class HangingWorker(doctor.DoctorWorker):  # pickled by value: the workers run this GEMM
    def gemm(self, *args):
        time.sleep(3600)

doctor.DoctorWorker = HangingWorker
t0 = time.monotonic()
# 20 s: the workers must start (import torch) within the timeout before the GEMM can hang; 8 s was too short
# for that on a loaded 2-core machine.
rows = doctor.run_preflight(2, False, storage, 1.0, timeout_s=20)
out["hung"] = {"s": time.monotonic() - t0, "bad": [r.failure_line() for r in rows if not r.ok]}
doctor.DoctorWorker = HangingWorker.__mro__[1]

@ray.remote(num_cpus=1)
class Holder:  # another job's worker, holding one of the two CPUs
    def ping(self):
        return 1

holder = Holder.remote()
ray.get(holder.ping.remote())
t0 = time.monotonic()
rows = doctor.run_preflight(2, False, storage, 1.0, timeout_s=5)
out["busy"] = {"s": time.monotonic() - t0, "bad": [r.failure_line() for r in rows if not r.ok]}
print("PREFLIGHT " + json.dumps(out))
"""


@pytest.mark.slow
def test_preflight_fails_by_name_then_reports_hangs_and_busy_clusters_within_timeouts(tmp_path, ray_cluster):
    """The preflight API on the shared head: a failed threshold and an unwritable storage path fail by name (the
    other checks still run and pass), a hung worker and an unplaceable gang are reported instead of waited for. A
    healthy gang passes: the doctor command above, and tests/test_bad_inputs.py's run with scaling.preflight=true."""
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file where the storage folder should be\n")  # root ignores chmod; this stops root too
    p = run_cli(["-c", PREFLIGHT, str(tmp_path / "runs"), str(blocker)], env=ray_cluster, timeout=400)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    out = json.loads(next(ln for ln in p.stdout.splitlines() if ln.startswith("PREFLIGHT "))[len("PREFLIGHT "):])

    failed = out["failed"]
    assert len(failed["bad"]) == 2, failed["bad"]
    allreduce = next(ln for ln in failed["bad"] if "allreduce failed on node all" in ln)
    assert "GB/s, threshold >= 1e+09 GB/s" in allreduce
    storage = next(ln for ln in failed["bad"] if "storage failed on node " in ln)
    assert str(blocker) in storage and "create folder failed" in storage and "not a folder" in storage
    status = {r["check"]: r["status"] for r in failed["rows"]}
    assert all(status[c] == "pass" for c in ("gang", "versions", "gemm")), status  # (disk: of a storage that is not)
    print(f"quick preflight took {failed['s']:.1f} s")  # about 10 s on an idle 2-core machine
    assert failed["s"] < 120

    assert "scaling.num_workers (3)" in out["impossible"] and "2 CPUs" in out["impossible"]

    hung = out["hung"]
    assert any("gemm failed" in ln and "hung: no answer from the GEMM check within 20 s" in ln for ln in hung["bad"]), hung
    assert any("allreduce failed" in ln and "not run" in ln for ln in hung["bad"]), hung
    assert hung["s"] < 20 * 4, hung  # probe, GEMM, and the skipped stages: no stage waits longer than its timeout

    busy = out["busy"]
    assert len(busy["bad"]) == 1 and "gang failed on node all" in busy["bad"][0], busy
    assert "not ready within 5 s" in busy["bad"][0] and "free now" in busy["bad"][0], busy
    assert busy["s"] < 30, busy
