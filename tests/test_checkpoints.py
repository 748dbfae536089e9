from stride.errors import CheckpointWriteError
"""Checkpoints in one process (no Ray, no process group): the background writer, the marker, the earlier format."""

import json
import shutil

import pytest
import torch

from runs import launch, losses, tiny
from stride.trainers.run import checkpointing


def _args(tmp_path, data, name, steps, *extra):
    return tiny(tmp_path, data, steps, "train.log_every_steps=5", "train.eval_every_steps=100",
                "checkpoint.every_steps=10", "train.deterministic=true", *extra, name=name)


def test_at_most_one_write_in_flight_and_the_marker_comes_last(tmp_path, monkeypatch):
    """A second save waits for the first (never two staged copies at once); until its write completes a folder has
    no meta.json, so a reader never takes it for complete; the marker lists and hashes every file."""
    import time

    import torch.distributed.checkpoint as dcp

    real = dcp.save

    def slow(*args, **kwargs):  # a write that surely outlasts the next save() call, were that not to wait
        time.sleep(0.5)
        return real(*args, **kwargs)

    monkeypatch.setattr(dcp, "save", slow)
    writer = checkpointing.CheckpointWriter(0)
    big = {"model": {"w": torch.randn(2_000_000)}}
    first = writer.save(tmp_path / "a", big, {"step": 1})
    assert not first.done() and not (tmp_path / "a" / checkpointing.META).exists()  # written in the background
    second = writer.save(tmp_path / "b", {"model": {"w": torch.ones(3)}}, {"step": 2})
    assert first.done()  # save() returned only after the write in flight finished
    assert writer.wait() == tmp_path / "b" and second.done() and writer.wait() is None
    meta = checkpointing.read_meta(tmp_path / "a")
    assert meta["step"] == 1 and sorted(meta["files"]) == [".metadata", "__0_0.distcp"]
    assert checkpointing.verify(tmp_path / "a") is None
    assert torch.equal(checkpointing.load_model_state(tmp_path / "a")["w"], big["model"]["w"])
    # Training goes on changing its tensors: the staged copy, not the live tensor, is what was written.
    live = {"model": {"w": torch.zeros(4)}}
    done = writer.save(tmp_path / "c", live, {"step": 3})
    live["model"]["w"] += 1
    done.result()
    assert torch.equal(checkpointing.load_model_state(tmp_path / "c")["w"], torch.zeros(4))
    writer.close()


def test_a_failed_write_is_retried_then_names_the_folder(tmp_path, monkeypatch):
    import torch.distributed.checkpoint as dcp

    calls = []
    real = dcp.save

    def flaky(*args, **kwargs):
        calls.append(1)
        if len(calls) < 3:
            raise OSError("transient")
        return real(*args, **kwargs)

    monkeypatch.setattr(dcp, "save", flaky)
    monkeypatch.setattr(checkpointing.time, "sleep", lambda s: None)
    writer = checkpointing.CheckpointWriter(0)
    assert writer.save(tmp_path / "ok", {"model": {"w": torch.ones(2)}}, {"step": 1}).result() == tmp_path / "ok"
    assert len(calls) == 3 and checkpointing.verify(tmp_path / "ok") is None
    monkeypatch.setattr(dcp, "save", lambda *a, **k: (_ for _ in ()).throw(OSError("disk full")))
    writer.save(tmp_path / "broken", {"model": {"w": torch.ones(2)}}, {"step": 2})
    with pytest.raises(CheckpointWriteError,
                       match=r"checkpoint broken could not be written \(disk full; failed 4 times\)"):
        writer.wait()
    assert not (tmp_path / "broken" / checkpointing.META).exists()


def test_a_rewrite_of_the_same_step_unmarks_the_stale_folder_first(tmp_path, monkeypatch):
    """A run killed while rewriting checkpoint_<step> over an older complete one of that name must not leave the old
    meta.json vouching for a mix of old and new files. From the rewrite's start until its own marker, the folder is no
    checkpoint: not to a resume, and not to torchrun's pruning, which re-hashes a folder only when its marker changes
    (so a stale marker it verified once would keep the torn folder and prune the good one before it)."""
    import threading

    import torch.distributed.checkpoint as dcp

    from stride.trainers.run.retention import complete_checkpoints

    older, folder = checkpointing.checkpoint_folder(tmp_path, 1), checkpointing.checkpoint_folder(tmp_path, 2)
    writer = checkpointing.CheckpointWriter(0)
    writer.save(older, {"model": {"w": torch.ones(5)}}, {"step": 1}).result()
    writer.save(folder, {"model": {"w": torch.ones(5)}}, {"step": 2}).result()
    assert complete_checkpoints(tmp_path) == [older, folder]  # both hashed, and remembered as complete
    real, files_in, release = dcp.save, threading.Event(), threading.Event()

    def held(*args, **kwargs):  # the new files are written, the marker is not: where a kill leaves the folder
        real(*args, **kwargs)
        files_in.set()
        release.wait(60)

    monkeypatch.setattr(dcp, "save", held)
    rewrite = writer.save(folder, {"model": {"w": torch.zeros(5)}}, {"step": 2})
    assert files_in.wait(60)
    try:
        assert not (folder / checkpointing.META).exists()
        assert checkpointing.newest_complete(tmp_path) == older and complete_checkpoints(tmp_path) == [older]
    finally:
        release.set()
    assert rewrite.result() == folder  # then the rewrite completes: marked again, with the new tensors
    assert checkpointing.verify(folder) is None and complete_checkpoints(tmp_path) == [older, folder]
    assert torch.equal(checkpointing.load_model_state(folder)["w"], torch.zeros(5))
    writer.close()


def _to_earlier_format(folder, cfg_args) -> None:
    """Rewrite a 1-process DCP checkpoint as the format before DCP: one state.pt (positional optimizer state)
    and meta.json with its digest, as `checkpointing.save` wrote them."""
    import hashlib

    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from stride.trainers.config_reader import load_config
    from stride.trainers.optim import build_optimizer, build_scheduler
    from stride.trainers.tasks import make_task

    meta = checkpointing.read_meta(folder)
    cfg = load_config(cfg_args[1], cfg_args[2:])
    model = make_task(cfg, meta["facts"]).build_model()
    optimizer = build_optimizer(cfg, model, 1)
    scheduler = build_scheduler(cfg, optimizer, 1)  # first, as the loop does: it sets the groups' lr when built
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state}
    checkpointing.load_sharded(folder, state)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    scheduler.load_state_dict(meta["scheduler"])
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                "scaler": meta["scaler"]}, folder / checkpointing.STATE)
    for f in meta["files"]:
        (folder / f).unlink()
    data = (folder / checkpointing.STATE).read_bytes()
    old = {k: v for k, v in meta.items() if k not in ("files", "format", "scheduler", "scaler")}
    (folder / checkpointing.META).write_text(json.dumps(
        dict(old, state_sha256=hashlib.sha256(data).hexdigest(), state_bytes=len(data))))


def test_a_checkpoint_of_the_earlier_format_resumes_exactly(tmp_path, tabular_data):
    """Run folders written before DCP (one state.pt) keep working: a resume from one continues bitwise as the
    uninterrupted run, and the run's next checkpoints are DCP's."""
    assert launch.in_process(_args(tmp_path, tabular_data, "full", 20)) == 0
    args = _args(tmp_path, tabular_data, "old", 10)
    assert launch.in_process(args) == 0
    folder = tmp_path / "old" / "checkpoint_00000010"
    _to_earlier_format(folder, args)
    assert sorted(p.name for p in folder.iterdir()) == ["meta.json", "state.pt"]
    assert checkpointing.verify(folder) is None and not checkpointing.is_sharded(folder)
    assert launch.in_process(_args(tmp_path, tabular_data, "old", 20)) == 0
    assert losses(tmp_path / "old") == losses(tmp_path / "full")
    s = json.loads((tmp_path / "old" / "summary.json").read_text())
    assert s["param_checksums"] == json.loads((tmp_path / "full" / "summary.json").read_text())["param_checksums"]
    assert checkpointing.is_sharded(tmp_path / "old" / "checkpoint_00000020")


def test_a_kill_mid_write_leaves_the_previous_checkpoint_to_resume_from(tmp_path, tabular_data):
    """A folder whose writer died before the marker (DCP files present, no meta.json) is not a checkpoint: the resume
    takes the one before and rewrites it, and the losses are the uninterrupted run's."""
    assert launch.in_process(_args(tmp_path, tabular_data, "full", 30)) == 0
    assert launch.in_process(_args(tmp_path, tabular_data, "cut", 30)) == 0
    run = tmp_path / "cut"
    (run / "checkpoint_00000030" / checkpointing.META).unlink()  # the marker never got written
    (run / "summary.json").unlink(missing_ok=True)
    assert checkpointing.newest_complete(run).name == "checkpoint_00000020"
    assert launch.in_process(_args(tmp_path, tabular_data, "cut", 30)) == 0
    assert losses(run) == losses(tmp_path / "full")
    assert checkpointing.verify(run / "checkpoint_00000030") is None
