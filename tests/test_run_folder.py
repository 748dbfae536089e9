"""A run folder is shared, untrusted storage (trainers/run/folder.py): nothing Stride writes there follows a link, and
nothing it reads back from there (checkpoints, meta.json, summary.json, metrics.jsonl) is trusted. In one process,
no Ray: checkpoints are made with CheckpointWriter(rank=0), as tests/test_checkpoints.py makes them."""

from __future__ import annotations

from stride.errors import UnsafeCheckpointError
from stride.trainers.run.folder import atomic_write_text
import dataclasses
import hashlib
import json
import os
import pickle
import threading
from pathlib import Path

import pytest
import torch

from stride.trainers.run import checkpointing
from stride.trainers.run import folder as runfolder
from stride.errors import RunFolderError

STATE = {"model": {"w": torch.arange(6.0)}}


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _victim(tmp_path: Path) -> tuple[Path, str]:
    """A file of the user's outside any run folder, and its digest: what a planted link points at."""
    victim = tmp_path / "outside" / "precious.txt"
    victim.parent.mkdir(exist_ok=True)
    victim.write_text("the user's own bytes\n")
    return victim, _sha(victim)


def _checkpoint(run: Path, step: int, state=None, meta: dict | None = None) -> Path:
    writer = checkpointing.CheckpointWriter(0)
    folder = checkpointing.checkpoint_folder(run, step)
    writer.save(folder, state or STATE, {"step": step, **(meta or {})}).result()
    writer.close()
    return folder


def _within(seconds: float, fn, *args):
    """fn(*args), which must return within `seconds` (a FIFO opened the ordinary way would block forever)."""
    out: list = []

    def call():
        try:
            out.append((fn(*args), None))
        except BaseException as e:  # noqa: BLE001 - re-raised in the test's thread
            out.append((None, e))

    t = threading.Thread(target=call, daemon=True)
    t.start()
    t.join(seconds)
    assert out, f"{fn.__name__} did not return within {seconds}s"
    if out[0][1] is not None:
        raise out[0][1]
    return out[0][0]


# ---- 1. writes never follow links ----

def test_a_link_planted_in_a_torn_folder_of_the_next_step_is_refused_and_its_target_untouched(tmp_path):
    run = tmp_path / "run"
    _checkpoint(run, 10)
    victim, before = _victim(tmp_path)
    torn = checkpointing.checkpoint_folder(run, 20)  # what a killed run leaves: a folder without meta.json
    torn.mkdir()
    (torn / "__0_0.distcp").symlink_to(victim)
    with pytest.raises(RunFolderError, match=r"checkpoint_00000020/__0_0.distcp is a symlink"):
        runfolder.check_run_folder(run)
    writer = checkpointing.CheckpointWriter(0)
    with pytest.raises(RunFolderError, match="__0_0.distcp is a symlink"):
        writer.save(torn, STATE, {"step": 20})
    writer.close()
    assert _sha(victim) == before and (torn / "__0_0.distcp").is_symlink()  # refused, neither followed nor removed


def test_a_torn_folder_without_links_is_replaced_by_a_fresh_one(tmp_path):
    """Every file DCP writes is new, in a folder Stride created: a leftover file of a killed run is gone, not
    overwritten in place (a hard link to the user's file would have carried the write to it)."""
    run = tmp_path / "run"
    victim, before = _victim(tmp_path)
    torn = checkpointing.checkpoint_folder(run, 20)
    torn.mkdir(parents=True)
    os.link(victim, torn / "__0_0.distcp")
    (torn / "leftover").write_text("x")
    _checkpoint(run, 20)
    assert sorted(p.name for p in torn.iterdir()) == [".metadata", "__0_0.distcp", "meta.json"]
    assert checkpointing.verify(torn) is None and _sha(victim) == before


def test_a_link_planted_while_dcp_writes_is_refused_by_the_open_itself(tmp_path, monkeypatch):
    """The scan before the write cannot see a link planted after it: the shard's open (O_EXCL|O_NOFOLLOW) refuses it,
    the write is not retried, and the target is untouched."""
    run = tmp_path / "run"
    run.mkdir()
    victim, before = _victim(tmp_path)
    real = runfolder.make_folder

    def then_plant(path):
        real(path)
        if not (path / "__0_0.distcp").is_symlink():
            (path / "__0_0.distcp").symlink_to(victim)
        return path

    monkeypatch.setattr(runfolder, "make_folder", then_plant)
    writer = checkpointing.CheckpointWriter(0)
    writer.save(checkpointing.checkpoint_folder(run, 10), STATE, {"step": 10})
    with pytest.raises(RunFolderError, match="__0_0.distcp is a symlink"):
        writer.wait()
    writer.close()
    assert _sha(victim) == before


def test_a_symlinked_checkpoint_folder_is_refused_written_through_never_and_skipped_on_resume(tmp_path):
    run = tmp_path / "run"
    older = _checkpoint(run, 10)
    elsewhere = tmp_path / "outside" / "somewhere"
    elsewhere.mkdir(parents=True)
    # A complete checkpoint of a later step, elsewhere, linked in: not resumed from, not written into.
    _checkpoint(tmp_path / "outside", 30)
    (run / "checkpoint_00000030").symlink_to(tmp_path / "outside" / "checkpoint_00000030")
    (run / "checkpoint_00000020").symlink_to(elsewhere)
    with pytest.raises(RunFolderError, match="checkpoint_000000[23]0 is a symlink"):
        runfolder.check_run_folder(run)
    warned = []
    assert checkpointing.newest_complete(run, warned.append) == older
    assert "checkpoint_00000030 (a symlink, not followed)" in warned[0]
    writer = checkpointing.CheckpointWriter(0)
    with pytest.raises(RunFolderError, match="checkpoint_00000020 is a symlink"):
        writer.save(run / "checkpoint_00000020", STATE, {"step": 20})
    writer.close()
    assert list(elsewhere.iterdir()) == []


def test_metrics_summary_and_the_stop_file_are_never_written_through_a_link(tmp_path, monkeypatch):
    from stride.trainers.launch.lifecycle import write_summary
    from stride.trainers.policies import STOP_FILE, clear_stop_request, request_stop
    from stride.trainers.sinks.metrics_file import MetricsFile

    run = tmp_path / "run"
    run.mkdir()
    victim, before = _victim(tmp_path)
    for name in ("metrics.jsonl", "summary.json", STOP_FILE):
        (run / name).symlink_to(victim)
        with pytest.raises(RunFolderError, match=f"{name} is a symlink"):
            runfolder.check_run_folder(run)
        with pytest.raises(RunFolderError, match=f"{name} is a symlink"):
            if name == "metrics.jsonl":
                MetricsFile(run / name, None)
            elif name == "summary.json":
                write_summary(run, {"status": "completed"})
            else:
                request_stop(run, "interrupted", 15)
        if name == "metrics.jsonl":
            with pytest.raises(RunFolderError):
                MetricsFile(run / name, 5)  # a resume reads it back: not through the link either
        if name == STOP_FILE:
            with pytest.raises(RunFolderError):
                clear_stop_request(run)
        (run / name).unlink()
    # A link that appears after the file was opened for the run: the append is refused, not followed.
    metrics = MetricsFile(run / "metrics.jsonl", None)
    (run / "metrics.jsonl").unlink()
    (run / "metrics.jsonl").symlink_to(victim)
    with pytest.raises(RunFolderError):
        metrics.write({"step": 1})
    assert _sha(victim) == before


def test_temporary_names_are_fresh_so_a_link_at_the_old_fixed_name_is_never_opened(tmp_path):
    """meta.json, .metadata and summary.json were once written through `.<name>.tmp`, a name anyone could plant a
    link at beforehand."""
    run = tmp_path / "run"
    victim, before = _victim(tmp_path)
    folder = _checkpoint(run, 10)
    (folder / ".meta.json.tmp").symlink_to(victim)
    checkpointing.write_marker(folder, {"step": 10})
    (run / ".summary.json.tmp").symlink_to(victim)
    atomic_write_text(run / "summary.json", "{}")
    assert _sha(victim) == before and checkpointing.verify(folder) is None
    with pytest.raises(RunFolderError, match="summary.json is a symlink"):
        (run / "summary.json").unlink()
        (run / "summary.json").symlink_to(victim)
        atomic_write_text(run / "summary.json", "{}")
    assert _sha(victim) == before and not list(run.glob(".summary.json.*-*.tmp"))  # no temporary file left behind


def test_profile_traces_are_not_written_through_a_link(tmp_path):
    from types import SimpleNamespace

    from stride.trainers.sinks import Sinks
    from stride.trainers.telemetry import Profiler

    victim, before = _victim(tmp_path)
    env = SimpleNamespace(device=torch.device("cpu"), world_rank=0, world_size=1)
    for plant in ("folder", "trace"):
        run = tmp_path / plant
        run.mkdir()
        if plant == "folder":
            (run / "profile").symlink_to(victim.parent)
        else:
            (run / "profile").mkdir()
            (run / "profile" / "rank0.json").symlink_to(victim)
        with pytest.raises(RunFolderError, match="is a symlink"):
            runfolder.check_run_folder(run)
        profiler = Profiler([1, 1], run, env)
        profiler.before_step(0)
        with pytest.raises(RunFolderError, match="is a symlink"):
            profiler.after_step(1, Sinks([]))
    assert _sha(victim) == before and sorted(p.name for p in victim.parent.iterdir()) == ["precious.txt"]
    run = tmp_path / "clean"
    run.mkdir()
    profiler = Profiler([1, 1], run, env)
    profiler.before_step(0)
    profiler.after_step(1, Sinks([]))
    assert json.loads((run / "profile" / "rank0.json").read_text())  # the trace, where it belongs


def test_a_run_folder_under_a_symlinked_storage_path_is_fine(tmp_path):
    """Shared storage is often mounted through a link: only links inside the run folder are refused."""
    real = tmp_path / "mnt" / "shared"
    real.mkdir(parents=True)
    (tmp_path / "storage").symlink_to(real)
    run = tmp_path / "storage" / "run"
    _checkpoint(run, 10)
    (run / "metrics.jsonl").write_text("")
    assert runfolder.check_run_folder(run) == real / "run"


def test_the_launcher_exits_2_with_one_line_and_touches_nothing(tmp_path, tabular_data, capsys):
    from runs import launch, tiny

    storage = tmp_path / "runs"
    (storage / "planted").mkdir(parents=True)
    victim, before = _victim(tmp_path)
    (storage / "planted" / "metrics.jsonl").symlink_to(victim)
    code = launch.in_process(tiny(storage, tabular_data, None, "train.max_steps=2", name="planted",
                                  config="trainers/configs/tabular_mlp.yaml"))
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "metrics.jsonl is a symlink" in err[0], err
    assert _sha(victim) == before and sorted(p.name for p in (storage / "planted").iterdir()) == ["metrics.jsonl"]


# ---- 2. checkpoints contained and typed ----

def _rewrite_metadata(folder: Path, relative_path: str) -> None:
    """Point every storage item of `folder`'s .metadata at `relative_path`, and re-sign meta.json: what someone
    who can write the folder can do (the digests cannot tell)."""
    metadata = pickle.loads((folder / ".metadata").read_bytes())
    metadata.storage_data = {k: dataclasses.replace(v, relative_path=relative_path)
                             for k, v in metadata.storage_data.items()}
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))
    checkpointing.write_marker(folder, checkpointing.read_meta(folder))


@pytest.mark.parametrize("outside", ["../checkpoint_00000010/__0_0.distcp", "{tmp}/run/checkpoint_00000010/__0_0.distcp"])
def test_a_metadata_naming_a_file_outside_its_folder_fails_verify_is_skipped_and_refused(tmp_path, capsys, outside):
    from stride.trainers.commands.export import main as export_main

    run = tmp_path / "run"
    older = _checkpoint(run, 10, {"model": {"w": torch.zeros(6)}})
    folder = _checkpoint(run, 20)
    _rewrite_metadata(folder, outside.format(tmp=tmp_path))
    assert "not a file of this checkpoint's meta.json" in checkpointing.verify(folder)
    warned = []
    assert checkpointing.newest_complete(run, warned.append) == older
    assert "checkpoint_00000020" in warned[0] and "resuming from checkpoint_00000010" in warned[0]
    out = tmp_path / "w.safetensors"
    assert export_main([str(folder), str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "checkpoint_00000020" in err[0] and "not a file of this checkpoint" in err[0]
    assert not out.exists()
    # The reader at load time refuses it too: the folder may change between verify() and the load.
    with pytest.raises(UnsafeCheckpointError, match="not a file of this checkpoint"):
        checkpointing.load_model_state(folder)


@pytest.mark.parametrize("plant", ["fifo", "/dev/zero"])
def test_a_fifo_or_a_device_listed_in_meta_json_never_hangs_and_is_never_read(tmp_path, plant, capsys):
    from stride.trainers.commands.export import main as export_main

    run = tmp_path / "run"
    older = _checkpoint(run, 10)
    folder = _checkpoint(run, 20)
    shard = folder / "__0_0.distcp"
    shard.unlink()
    os.mkfifo(shard) if plant == "fifo" else shard.symlink_to("/dev/zero")
    problem = _within(10, checkpointing.verify, folder)
    assert problem == f"__0_0.distcp is {'a FIFO' if plant == 'fifo' else 'a symlink'}, not a regular file (not read)"
    assert _within(10, checkpointing.newest_complete, run) == older
    assert _within(30, export_main, [str(folder), str(tmp_path / "w.safetensors")]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1
    with pytest.raises(UnsafeCheckpointError, match="not a regular|is a (FIFO|symlink)"):
        _within(10, checkpointing.load_model_state, folder)  # the load-time reader: lstat before the open


@pytest.mark.parametrize("change, says", [
    ({"step": "abc"}, "step ('abc'): Input should be a valid integer"),
    ({"step": -1}, "step (-1): Input should be greater than or equal to 0"),
    ({"epoch": 1.5}, "epoch (1.5)"),
    ({"files": ["__0_0.distcp"]}, "files (['__0_0.distcp']): Input should be a valid dictionary"),
    ({"files": {"__0_0.distcp": {"bytes": 1, "sha256": "not hex"}}}, "files.__0_0.distcp.sha256 ('not hex')"),
    ({"scheduler": [1, 2]}, "scheduler ([1, 2])"),
    ({"metrics": {"train_loss": "low"}}, "metrics.train_loss"),
    ({"mlflow_run_id": 7}, "mlflow_run_id (7)"),
])
def test_an_untyped_meta_json_fails_verify_and_the_resume_takes_the_one_before(tmp_path, change, says):
    run = tmp_path / "run"
    older = _checkpoint(run, 10)
    folder = _checkpoint(run, 20, meta={"epoch": 0, "scheduler": {}, "metrics": {"train_loss": 1.0}})
    meta = json.loads((folder / "meta.json").read_text())
    (folder / "meta.json").write_text(json.dumps({**meta, **change}))
    assert says in checkpointing.verify(folder)
    warned = []
    assert checkpointing.newest_complete(run, warned.append) == older
    assert "checkpoint_00000020" in warned[0] and "is unusable" in warned[0]


class _Payload:
    """Unpickling this runs code: a pickle planted as an optimizer hyperparameter."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_a_pickled_bytes_item_fails_verify_and_never_runs(tmp_path):
    """DCP keeps non-tensor values (the optimizer's hyperparameters) as torch.save'd bytes in the shards; verify
    loads each with weights_only=True, so such a checkpoint is skipped on resume, not refused inside a worker."""
    import torch.distributed.checkpoint as dcp

    run = tmp_path / "run"
    marker = tmp_path / "pwned"
    older = _checkpoint(run, 10, {"model": {"w": torch.ones(2)}, "optim": {"lr": 0.1}})
    # Written by DCP itself: Stride's writer stages a copy first, and copying the payload would run it here.
    folder = checkpointing.checkpoint_folder(run, 20)
    dcp.save({"model": {"w": torch.ones(2)}, "optim": {"lr": _Payload(marker)}},
             storage_writer=dcp.FileSystemWriter(folder), no_dist=True)
    checkpointing.write_marker(folder, {"step": 20})
    assert "__0_0.distcp holds more than tensors (optim.lr:" in checkpointing.verify(folder)
    assert checkpointing.verify(older) is None  # a plain float is a plain value
    assert checkpointing.newest_complete(run) == older and not marker.exists()


def test_metrics_lines_of_the_wrong_types_are_dropped_on_resume_with_the_torn_ones(tmp_path, monkeypatch):
    from stride.trainers.sinks import metrics_file as sinks

    path = tmp_path / "metrics.jsonl"
    good = [{"step": 1, "train_loss": 1.0}, {"step": 2, "val_loss": 0.5, "val_accuracy": None}]
    bad = [{"val_loss": 1.0}, {"step": "2"}, {"step": 2, "train_loss": "x"}, {"step": True}, [1, 2]]
    lines = [json.dumps(r) for r in good[:1] + bad + good[1:]] + ['{"step": 3, "train_lo']
    path.write_text("\n".join(lines) + "\n")
    warned = []
    monkeypatch.setattr(sinks.log, "warning", lambda *a: warned.append(a[0] % a[1:]))
    sinks.MetricsFile(path, resume_step=2)
    assert [json.loads(ln) for ln in path.read_text().splitlines()] == good
    assert len(warned) == 1 and "dropped 6 unreadable line(s)" in warned[0]


def test_an_untyped_summary_counts_as_none_for_write_summary_and_exits_2_for_generate(tmp_path, capsys):
    from stride.trainers.launch.lifecycle import write_summary
    from stride.trainers.commands.generate import main as generate_main

    run = tmp_path / "run"
    run.mkdir()
    (run / "summary.json").write_text(json.dumps({"status": "completed", "global_step": "many"}))
    # Not a completed run's record Stride wrote: a failed rerun's summary is not set aside beside it.
    assert write_summary(run, {"status": "failed"}) == run / "summary.json"
    (run / "summary.json").write_text(json.dumps({"status": "completed", "config": ["not", "a", "dict"]}))
    assert generate_main(["--run", str(run)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "config (['not', 'a', 'dict'])" in err[0], err


def test_generate_refuses_a_summary_checkpoint_outside_the_run(tmp_path, capsys):
    from stride.trainers.commands.generate import find_checkpoint
    from stride.errors import UsageError

    run, other = tmp_path / "run", tmp_path / "other"
    own = _checkpoint(run, 10)
    theirs = _checkpoint(other, 20)
    with pytest.raises(UsageError, match="lies outside --run"):
        find_checkpoint(run, {"checkpoint": str(theirs)})
    with pytest.raises(UsageError, match="lies outside --run"):
        find_checkpoint(run, {"checkpoint": str(run / ".." / "other" / theirs.name)})
    assert find_checkpoint(run, {"checkpoint": str(own)}) == own
    assert find_checkpoint(run, {"checkpoint": str(tmp_path / "moved" / own.name)}) == own  # exists nowhere


def test_a_stop_file_that_is_a_fifo_never_blocks_a_rank(tmp_path):
    from stride.trainers.policies import STOP_FILE, StopRequest, clear_stop_request

    os.mkfifo(tmp_path / STOP_FILE)
    stop = StopRequest(tmp_path, torch.device("cpu"), world_size=1)
    assert _within(10, stop.status) == "interrupted"
    with pytest.raises(RunFolderError, match="is a FIFO"):
        clear_stop_request(tmp_path)
    with pytest.raises(RunFolderError, match="is a FIFO"):
        runfolder.check_run_folder(tmp_path)
