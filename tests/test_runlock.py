from stride.errors import RunLockLostError, RunLockedError
"""One run at a time per run folder (trainers/run/lock.py): the lock's acquire, refusal and takeover as functions, the
workers' fence, then torchrun runs of one run.name. The orphan of a killed Ray driver is another file's (Ray's)."""

import json
import os
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch

from conftest import PYTHON, REPO, read_jsonl, run_cli, run_cli_forked, torchrun_launcher
from runs import tiny
from stride.errors import UsageError
from stride.trainers.run import checkpointing
from stride.trainers.run import lock as runlock
from stride.errors import ConfigError
from stride.trainers.config_reader import build_config


def plant(run_dir, age_s: float = 0.0, **fields) -> dict:
    """A lock as another process would have left it, its heartbeat `age_s` old."""
    record = {"token": "f" * 32, "fence": 7, "host": "elsewhere", "pid": 1, "pid_start": "1", "started": time.time(),
              "instance": None, **fields}
    path = run_dir / runlock.LOCK
    # Whole or not at all, as another run's lock appears (never a truncated file a fence could read in between).
    part = path.with_name(path.name + ".planting")
    part.write_text(json.dumps(record))
    os.utime(part, (time.time() - age_s, time.time() - age_s))
    os.replace(part, path)
    return record


def token_on_disk(run_dir) -> str | None:
    path = run_dir / runlock.LOCK
    return json.loads(path.read_text())["token"] if path.exists() else None


def finished_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


# ---- acquire, refuse, take over ----

def test_the_first_run_takes_the_lock_with_its_identity_and_release_removes_it(tmp_path):
    lock = runlock.acquire(tmp_path, 60, "slurm:9")
    record = json.loads((tmp_path / runlock.LOCK).read_text())
    assert record["token"] == lock.token and len(lock.token) == 32 and record["fence"] == 1
    assert (record["host"], record["pid"]) == (socket.gethostname(), os.getpid())
    assert record["pid_start"] == runlock.process_start(os.getpid()) is not None
    assert record["instance"] == "slurm:9" and abs(record["started"] - time.time()) < 60
    assert (tmp_path / runlock.LOCK).stat().st_mode & 0o777 == 0o644
    lock.release()
    assert list(tmp_path.iterdir()) == []  # nor a probe file left behind


def test_a_live_holder_refuses_a_second_run_in_one_line_naming_the_folder_and_holder(tmp_path):
    run_dir = tmp_path / "same_name"
    run_dir.mkdir()
    with runlock.acquire(run_dir, 60) as first:
        with pytest.raises(RunLockedError) as e:
            runlock.acquire(run_dir, 60)
        assert isinstance(e.value, UsageError)  # exit 2 in every launcher
        line = str(e.value)
        assert "\n" not in line and line.startswith(f"run.name (same_name): {run_dir} is in use by another run ")
        assert f"host {socket.gethostname()}, pid {os.getpid()}, since " in line and "heartbeat 0s ago" in line
        assert line.endswith("wait for it, stop it, or use another run.name")
        assert token_on_disk(run_dir) == first.token  # the refused run changed nothing


def test_a_lock_whose_holder_died_on_this_host_is_taken_over_with_one_warning(tmp_path, capsys):
    plant(tmp_path, host=socket.gethostname(), pid=finished_pid(), pid_start="1")
    with runlock.acquire(tmp_path, 60) as lock:
        assert lock.fence == 8 and token_on_disk(tmp_path) == lock.token
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(f"stride: warning: taking over the run lock of {tmp_path} from host ")
    assert err[0].endswith("(dead)")
    assert list(tmp_path.iterdir()) == []  # the old lock, moved aside, is gone too


def test_a_reused_pid_is_not_the_holder(tmp_path, capsys):
    """The holder's pid now names another live process (ours): its start time differs, so the holder is dead."""
    plant(tmp_path, host=socket.gethostname(), pid=os.getpid(), pid_start="12345")
    with runlock.acquire(tmp_path, 60):
        assert "(dead)" in capsys.readouterr().err


def test_a_live_holder_on_this_host_is_not_taken_for_dead(tmp_path):
    """The same check with the right start time: the process is alive, so the lock holds."""
    plant(tmp_path, host=socket.gethostname(), pid=os.getpid(), pid_start=runlock.process_start(os.getpid()))
    with pytest.raises(RunLockedError):
        runlock.acquire(tmp_path, 60)


def test_a_killed_holder_not_yet_reaped_is_dead(tmp_path, capsys):
    """A SIGKILLed holder that its parent has not reaped yet (a zombie: its /proc entry and start time are still
    there) holds nothing: the rerun takes the lock over at once, not after the heartbeat goes stale."""
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        plant(tmp_path, host=socket.gethostname(), pid=holder.pid, pid_start=runlock.process_start(holder.pid))
        holder.kill()  # not waited for: a zombie until holder.wait() below
        deadline = time.monotonic() + 30
        while open(f"/proc/{holder.pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z":
            assert time.monotonic() < deadline, "the killed holder never became a zombie"
            time.sleep(0.01)
        with runlock.acquire(tmp_path, 60):
            assert "(dead)" in capsys.readouterr().err
    finally:
        holder.kill()
        holder.wait()


def test_a_holder_elsewhere_is_judged_by_its_heartbeat_age_on_the_filesystem_clock(tmp_path, capsys):
    plant(tmp_path, age_s=30)
    with pytest.raises(RunLockedError, match="host elsewhere, pid 1, .*heartbeat 30s ago"):
        runlock.acquire(tmp_path, 60)
    plant(tmp_path, age_s=90)
    with runlock.acquire(tmp_path, 60) as lock:
        assert lock.fence == 8
    assert capsys.readouterr().err.strip().endswith("(stale heartbeat 90s)")


def age(run_dir, seconds: float) -> None:
    """The lock's last beat `seconds` earlier: as if that long passed on the filesystem's clock without a beat (a
    contender judges staleness by that clock alone, so the tests move it instead of sleeping)."""
    path = run_dir / runlock.LOCK
    then = path.stat().st_mtime - seconds
    os.utime(path, (then, then), follow_symlinks=False)


def wait_for(condition, what: str, timeout_s: float = 60) -> None:
    """Until `condition()` holds; the timeout is far beyond any beat interval, so a busy machine only slows it."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def test_the_heartbeat_keeps_a_lock_fresh_and_a_stopped_one_goes_stale(tmp_path, capsys):
    """The holder's thread beats the lock fresh again after 100 s without a beat; frozen, it stays 100 s old, and a
    contender (window 60 s) takes it over. No sleep against the window: the margins are tens of seconds."""
    first = runlock.acquire(tmp_path, 1.0)  # the holder's stale_s sets its beat: every 0.25 s
    assert first._thread.is_alive()
    age(tmp_path, 100)
    wait_for(lambda: time.time() - (tmp_path / runlock.LOCK).stat().st_mtime < 50, "the holder never beat")
    with pytest.raises(RunLockedError):
        runlock.acquire(tmp_path, 60)
    first._stop.set()  # the holder freezes (as a SIGSTOPped or partitioned driver)
    first._thread.join()
    age(tmp_path, 100)
    with runlock.acquire(tmp_path, 60) as second:
        assert second.fence == 2
    assert "(stale heartbeat 10" in capsys.readouterr().err


def test_the_same_instance_takes_over_at_once_and_another_does_not(tmp_path, capsys):
    """A SLURM requeue (same job id) or Tune's restart of a trial: the earlier holder may still look alive."""
    plant(tmp_path, instance="slurm:42")
    with pytest.raises(RunLockedError):
        runlock.acquire(tmp_path, 60, "slurm:43")
    with pytest.raises(RunLockedError):
        runlock.acquire(tmp_path, 60)
    with runlock.acquire(tmp_path, 60, "slurm:42"):
        assert capsys.readouterr().err.strip().endswith("(same job slurm:42)")


@pytest.mark.parametrize("planted", ["dead", "none"])
def test_of_racing_contenders_exactly_one_wins(tmp_path, planted):
    """Threads of one process act as processes here: the lock is a file, and each contender has a token of its own.
    Whether the lock is free or stale, one contender holds it afterwards and every other is refused."""
    for attempt in range(10):
        run_dir = tmp_path / f"r{attempt}"
        run_dir.mkdir()
        if planted == "dead":
            plant(run_dir, host=socket.gethostname(), pid=finished_pid())
        start, won, refused = threading.Barrier(6), [], []

        def contend():
            start.wait()
            try:
                won.append(runlock.acquire(run_dir, 60))
            except RunLockedError:
                refused.append(1)

        threads = [threading.Thread(target=contend) for _ in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(won) == 1 and len(refused) == 5, (attempt, len(won))
        assert token_on_disk(run_dir) == won[0].token
        won[0].release()
        assert list(run_dir.iterdir()) == []


def test_release_deletes_only_its_own_lock_and_the_holder_notices_a_takeover(tmp_path, capsys):
    lock = runlock.acquire(tmp_path, 1.0)  # beats every 0.25 s
    plant(tmp_path, token="a" * 32)  # another run took the folder over
    lock._thread.join(timeout=60)  # its next beat finds the lock taken and ends the heartbeat
    assert not lock._thread.is_alive() and lock.lost and not lock.held()
    assert "is no longer this run's (its run lock is now held by host elsewhere" in capsys.readouterr().err
    lock.release()
    assert token_on_disk(tmp_path) == "a" * 32


def test_a_link_or_a_fifo_in_the_locks_place_is_refused_in_one_line_and_left_alone(tmp_path):
    outside = tmp_path / "precious"
    outside.write_text("keep")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / runlock.LOCK).symlink_to(outside)
    with pytest.raises(UsageError, match="stride.lock is a symlink"):
        runlock.acquire(run_dir, 60)
    assert outside.read_text() == "keep"
    (run_dir / runlock.LOCK).unlink()
    os.mkfifo(run_dir / runlock.LOCK)
    with pytest.raises(UsageError, match="not a regular file"):
        runlock.acquire(run_dir, 60)  # never blocks on the FIFO


def test_lock_stale_s_is_bounded():
    with pytest.raises(ConfigError, match="run.lock_stale_s"):
        build_config({"run": {"lock_stale_s": 0}})
    assert build_config({}).run.lock_stale_s == 60


# ---- the workers' fence ----

def test_the_fence_passes_while_held_and_stops_a_worker_whose_lock_changed_hands_or_vanished(tmp_path):
    lock = runlock.acquire(tmp_path, 60)
    fence = runlock.Fence(tmp_path, lock.token, 60)
    fence.still_holds()
    plant(tmp_path, token="b" * 32)
    with pytest.raises(RunLockLostError, match="no longer this run's .*held by host elsewhere"):
        fence.still_holds()
    (tmp_path / runlock.LOCK).unlink()
    with pytest.raises(RunLockLostError, match="its run lock is gone"):
        fence.still_holds()
    runlock.Fence(tmp_path, None, 60).still_holds()  # no lock taken (a Trainer without a launcher): no fence
    lock.release()


def test_the_fence_stops_an_orphan_whose_heartbeat_stood_still_on_its_own_clock(tmp_path):
    """The worker's clock is the test's (Fence's clock); the driver's beats are the lock's mtime moving."""
    lock = runlock.acquire(tmp_path, 60)
    lock._stop.set()  # the test beats in its place, at the times it picks
    lock._thread.join()
    now = [1000.0]
    fence = runlock.Fence(tmp_path, lock.token, 10, clock=lambda: now[0])
    path = tmp_path / runlock.LOCK
    for beat in range(1, 11):  # beating every 9 s: never stale (10 s), however long
        fence.still_holds()
        os.utime(path, (beat, beat), follow_symlinks=False)
        now[0] += 9
    fence.still_holds()  # the last beat seen: the driver is killed now, nobody beats, nobody takes over
    now[0] += 10
    fence.still_holds()  # 10 s without a beat: not yet more than run.lock_stale_s
    now[0] += 0.5
    with pytest.raises(RunLockLostError, match="heartbeat has not moved for 10s .*run.lock_stale_s=10\\)"):
        fence.still_holds()
    lock.release()


def test_a_checkpoint_write_checks_the_fence_before_the_shards_and_before_the_marker(tmp_path):
    """Lost before the write: no file at all. Lost between DCP's shards and meta.json: never marked complete, so
    never resumed from."""
    state = {"model": {"w": torch.ones(3)}}
    for lost_at_check in (1, 2):
        checks = []

        def fence():
            checks.append(1)
            if len(checks) == lost_at_check:
                raise RunLockLostError("lost")

        folder = tmp_path / f"ckpt{lost_at_check}"
        writer = checkpointing.CheckpointWriter(0, fence=fence)
        with pytest.raises(RunLockLostError):
            writer.save(folder, state, {"step": 1}).result()
        writer.close()
        written = sorted(p.name for p in folder.iterdir()) if folder.exists() else []
        assert checkpointing.META not in written
        assert written == ([] if lost_at_check == 1 else [".metadata", "__0_0.distcp"]), written


# ---- two runs of one run.name (torchrun's launcher, one process each) ----

def _args(tmp_path, data, steps, *extra):
    return ["trainers/torchrun.py", *tiny(tmp_path, data, steps, "train.log_every_steps=10",
                                          "train.eval_every_steps=100000", "checkpoint.every_steps=100",
                                          "model.hidden_sizes=[32]", "train.batch_size_per_worker=64", *extra,
                                          name="shared", config="trainers/configs/tabular_mlp.yaml")]


def _env() -> dict:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("SLURM_JOB_ID", None)  # two launches of one SLURM job would be one run restarted
    return env


@pytest.mark.slow
def test_a_second_run_of_the_same_name_exits_2_while_the_first_completes_every_step_once(tmp_path, tabular_data):
    run_dir = tmp_path / "shared"
    steps = 5000  # seconds of training: the second run starts, and is refused, meanwhile
    first = subprocess.Popen([PYTHON, *_args(tmp_path, tabular_data, steps)], cwd=REPO, env=_env(),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 120
        while time.time() < deadline and not (run_dir / "metrics.jsonl").exists() or \
                not (run_dir / "metrics.jsonl").read_text().strip():
            assert first.poll() is None, first.communicate()
            time.sleep(0.2)
        assert (run_dir / runlock.LOCK).exists()
        second = run_cli_forked(_args(tmp_path, tabular_data, steps), timeout=120, env={"SLURM_JOB_ID": ""})
        assert first.poll() is None, "the first run ended before the second was refused: raise its steps"
        out, err = first.communicate(timeout=300)
    finally:
        first.kill()
    assert second.returncode == 2, second.stderr[-2000:]
    lines = second.stderr.strip().splitlines()
    assert len(lines) == 1, second.stderr
    assert lines[0].startswith(f"stride: error: run.name (shared): {run_dir} is in use by another run (host ")
    assert f"pid {first.pid}," in lines[0]
    assert first.returncode == 0, err[-3000:]
    logged = [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl") if "train_loss" in r]
    assert logged == list(range(10, steps + 1, 10))
    assert json.loads((run_dir / "summary.json").read_text())["global_step"] == steps
    assert not (run_dir / runlock.LOCK).exists()


@pytest.mark.slow
def test_a_run_whose_lock_is_taken_over_stops_before_its_next_write(tmp_path, tabular_data):
    """The fence end to end: another run takes the folder while this one trains; this one exits 1 in one line and
    writes no metric or checkpoint after that moment."""
    run_dir = tmp_path / "shared"
    args = _args(tmp_path, tabular_data, 100000, "checkpoint.every_steps=100000")  # metrics only: no write in flight
    first = subprocess.Popen([PYTHON, *args], cwd=REPO, env=_env(),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 120
        while time.time() < deadline and not (run_dir / "metrics.jsonl").exists() or \
                len((run_dir / "metrics.jsonl").read_text().splitlines()) < 3:
            assert first.poll() is None, first.communicate()
            time.sleep(0.2)
        plant(run_dir, token="c" * 32)
        taken = {p.name: p.stat().st_mtime_ns for p in run_dir.rglob("*") if p.name != runlock.LOCK}
        out, err = first.communicate(timeout=120)
    finally:
        first.kill()
    assert first.returncode == 1, err[-3000:]
    assert err.strip().splitlines() == [f"stride: error: {run_dir} is no longer this run's (its run lock is held by "
                                        f"host elsewhere, pid 1, since " + err.split("since ", 1)[1].split(")")[0]
                                        + "); this worker stops before writing anything more there"]
    after = {p.name: p.stat().st_mtime_ns for p in run_dir.rglob("*") if p.name != runlock.LOCK}
    assert after == taken  # nothing written, nothing removed
    assert token_on_disk(run_dir) == "c" * 32


@pytest.mark.slow
def test_a_refused_lock_ends_every_torchrun_rank_with_exit_2_and_no_hang(tmp_path, tabular_data):
    """Rank 0 alone takes the lock; the other rank learns of the refusal from it instead of waiting in a collective."""
    run_dir = tmp_path / "shared"
    run_dir.mkdir()
    plant(run_dir, host=socket.gethostname(), pid=os.getpid(), pid_start=runlock.process_start(os.getpid()))
    cmd = [*torchrun_launcher(2), *_args(tmp_path, tabular_data, 50)]
    r = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=180)
    assert r.returncode != 0
    refusals = [ln for ln in r.stderr.splitlines() if ln.startswith("stride: error: run.name (shared): ")]
    assert len(refusals) == 2 and f"pid {os.getpid()}," in refusals[0], r.stderr[-3000:]
    assert "exitcode  : 2" in r.stderr  # torchrun's report of the ranks' own exit code
    assert sorted(p.name for p in run_dir.iterdir()) == [runlock.LOCK]  # nothing written by the refused run


def test_an_error_line_is_one_write_so_two_ranks_lines_never_run_together(tmp_path, monkeypatch):
    """torchrun's ranks share one stderr; print() writes the text and the newline apart, and two ranks' refusals were
    once read back as one line. error_line hands the kernel the whole line, newline included, in one write."""
    from stride.cli import error_line

    writes = []
    with open(tmp_path / "stderr", "w") as stream:
        monkeypatch.setattr(sys, "stderr", stream)
        monkeypatch.setattr(os, "write", lambda fd, data: writes.append((fd, data)) or len(data))
        error_line("run.name (shared): in use by another run")
        fd = stream.fileno()
    assert writes == [(fd, b"stride: error: run.name (shared): in use by another run\n")]
