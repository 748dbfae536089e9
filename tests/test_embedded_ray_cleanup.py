"""A killed embedded driver leaves nothing behind (issue 27, point 3): when `python trainers/main.py` without
RAY_ADDRESS (an embedded local Ray) is SIGKILLed, every process of its Ray is gone within seconds
(ray_cluster/watchdog.py), so no orphaned worker writes into the run folder again, and its /tmp/stride-auth-* token
folder does not outlive the next start (ray_cluster/connect.py)."""

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from conftest import PYTHON, REPO, auth_folders, descendants, kill_pids
from runs import tiny
from stride.ray_cluster import connect
from stride.trainers.run import lock as runlock


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _files(run: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(run)): (p.stat().st_size, p.stat().st_mtime_ns) for p in run.rglob("*") if p.is_file()}


def _start(storage: Path, data: Path, name: str, stderr=subprocess.DEVNULL) -> subprocess.Popen:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("RAY_ADDRESS", None)  # an embedded Ray: the guarantee is about the cluster this driver starts
    args = tiny(storage, data, 1000000, "train.log_every_steps=20", "checkpoint.every_steps=50", "scaling.num_workers=1",
                name=name)
    return subprocess.Popen([PYTHON, "trainers/main.py", *args], cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                            stderr=stderr)


def _wait_for_training(proc: subprocess.Popen, run: Path, timeout: float = 240) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        assert proc.poll() is None, f"the driver exited ({proc.returncode}) before training"
        metrics = run / "metrics.jsonl"
        if metrics.exists() and '"train_loss"' in metrics.read_text() and list(run.glob("checkpoint_*")):
            return
        time.sleep(0.3)
    raise AssertionError(f"no training within {timeout} s")


@pytest.mark.slow
def test_a_sigkilled_embedded_driver_takes_its_ray_and_token_folder_with_it_and_a_rerun_takes_over(tmp_path, tabular_data):
    driver = _start(tmp_path, tabular_data, "k")
    run = tmp_path / "k"
    second = None
    try:
        _wait_for_training(driver, run)
        ray_pids = descendants(driver.pid)  # GCS, raylet, dashboard, agents, workers: the driver's tree
        assert len(ray_pids) >= 5
        (token_dir,) = [folder for folder, pid in auth_folders().items() if pid == driver.pid]
        assert token_dir.stat().st_mode & 0o777 == 0o700 and (token_dir / "token").stat().st_mode & 0o777 == 0o600

        os.kill(driver.pid, signal.SIGKILL)
        driver.wait()
        deadline = time.time() + 15
        while (left := [p for p in ray_pids if _alive(p)]) and time.time() < deadline:
            time.sleep(0.2)
        assert not left, [Path(f"/proc/{p}/cmdline").read_bytes()[:80] for p in left if _alive(p)]
        written = _files(run)
        time.sleep(3)
        assert _files(run) == written  # no orphan writes a checkpoint or a metric any more

        # The rerun of the same run.name takes the dead driver's run lock over at once (its holder is dead on this
        # host) and trains on from its checkpoint. The watchdog removed the token folder already; a start removes
        # any a killed watchdog left.
        old_lock = json.loads((run / runlock.LOCK).read_text())
        last_step = max(json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines())
        with open(tmp_path / "rerun.err", "w") as err:
            second = _start(tmp_path, tabular_data, "k", stderr=err)
            deadline = time.time() + 240
            while not _trained_past(run, last_step) and time.time() < deadline:
                assert second.poll() is None, (tmp_path / "rerun.err").read_text()[-2000:]
                time.sleep(0.3)
        assert _trained_past(run, last_step), "the rerun did not train within 240 s"
        new_lock = json.loads((run / runlock.LOCK).read_text())
        assert new_lock["token"] != old_lock["token"] and new_lock["pid"] == second.pid
        warning = [ln for ln in (tmp_path / "rerun.err").read_text().splitlines() if "taking over the run lock" in ln]
        assert len(warning) == 1 and f"pid {old_lock['pid']}" in warning[0] and "(dead)" in warning[0], warning
        assert not token_dir.exists()
    finally:
        for proc in (driver, second):
            if proc is not None and proc.poll() is None:
                kill_pids([proc.pid])
                proc.wait()


def _trained_past(run: Path, step: int) -> bool:
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return any(json.loads(line)["step"] > step for line in lines if line.strip())


def test_a_start_removes_only_token_folders_of_dead_drivers_of_this_user(tmp_path):
    """The sweep at start: a folder whose owner record names a dead process goes; one of a live process (this one,
    or a live pid whose start time differs: a reused pid, so dead), one without an owner record, and a link stay."""
    def folder(name: str, owner: str | None) -> Path:
        f = tmp_path / f"{connect.AUTH_PREFIX}{name}"
        f.mkdir(mode=0o700)
        (f / "token").write_text("t")
        if owner is not None:
            (f / connect.AUTH_OWNER).write_text(owner)
        return f

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    gone = folder("dead", f"{dead.pid} 1")
    reused = folder("reused", f"{os.getpid()} 1")  # this pid, another start time: another, dead, process
    live = folder("live", f"{os.getpid()} {connect.process_start(os.getpid())}")
    unknown = folder("unknown", None)
    target = folder("target", f"{dead.pid} 1")
    link = tmp_path / f"{connect.AUTH_PREFIX}link"
    link.symlink_to(target)
    others = folder("others", f"{dead.pid} 1")
    os.chown(others, 65534, 65534) if os.geteuid() == 0 else others.rename(tmp_path / "not-an-auth-folder")
    removed = connect.remove_orphaned_auth_folders(str(tmp_path))
    assert sorted(removed) == sorted([gone, reused, target])
    assert live.exists() and unknown.exists() and link.is_symlink() and others.exists() == (os.geteuid() == 0)


def test_an_embedded_start_sweeps_orphaned_token_folders_and_records_its_own(tmp_path, monkeypatch):
    import stat

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    for key in ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "RAY_AUTH_MODE"):
        # setenv first: monkeypatch then restores the variable as it was (absent) after the test, also when the code
        # under test sets it, as _auth_env_for_embedded does; a leaked token path breaks every later embedded run.
        monkeypatch.setenv(key, "")
        monkeypatch.delenv(key)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    orphan = tmp_path / f"{connect.AUTH_PREFIX}orphan"
    orphan.mkdir(mode=0o700)
    (orphan / connect.AUTH_OWNER).write_text(f"{dead.pid} 1")
    connect._auth_env_for_embedded()
    token = Path(os.environ["RAY_AUTH_TOKEN_PATH"])
    assert not orphan.exists() and token.parent.parent == tmp_path
    assert stat.S_IMODE(token.parent.stat().st_mode) == 0o700 and stat.S_IMODE(token.stat().st_mode) == 0o600
    assert (token.parent / connect.AUTH_OWNER).read_text() == f"{os.getpid()} {connect.process_start(os.getpid())}"
