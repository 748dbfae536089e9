from stride.errors import CheckpointWriteError
"""Checkpoints in one process (no Ray, no process group): the background writer, the marker, the refused format before
DCP."""

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


def _to_format_before_dcp(folder) -> None:
    """Rewrite a DCP checkpoint as the format before DCP wrote it: one state.pt and a meta.json with its digest in
    place of `files`."""
    import hashlib

    meta = checkpointing.read_meta(folder)
    torch.save({"model": checkpointing.load_model_state(folder)}, folder / "state.pt")
    for f in meta["files"]:
        (folder / f).unlink()
    data = (folder / "state.pt").read_bytes()
    old = {k: v for k, v in meta.items() if k not in ("files", "format")}
    (folder / checkpointing.META).write_text(json.dumps(
        dict(old, state_sha256=hashlib.sha256(data).hexdigest(), state_bytes=len(data))))


def test_a_checkpoint_of_the_format_before_dcp_is_refused_by_name_and_left_as_it_was(tmp_path, tabular_data):
    """The single-file state.pt format is no longer read. A run whose newest checkpoint has it must not start over
    (losing its progress, then pruning the old folder): the resume, init.from, export and eval each end in exit 2 with
    one line naming the folder and what to do, and no file of the run folder is changed."""
    import hashlib

    from stride.trainers.run.retention import complete_checkpoints

    assert launch.in_process(_args(tmp_path, tabular_data, "old", 10)) == 0
    run = tmp_path / "old"
    folder = run / "checkpoint_00000010"
    _to_format_before_dcp(folder)
    assert sorted(p.name for p in folder.iterdir()) == ["meta.json", "state.pt"]
    before = {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(run.rglob("*")) if p.is_file()}
    out = tmp_path / "out.safetensors"
    refusals = {"resume": launch.forked(_args(tmp_path, tabular_data, "old", 20)),
                "init.from": launch.forked(_args(tmp_path, tabular_data, "new", 5, f"init.from={folder}")),
                "export": launch.forked([str(run), str(out)], entry=("-m", "stride", "export")),
                "eval": launch.forked(["--run", str(run), "--checkpoint", str(folder)], entry=("-m", "stride", "eval"))}
    says = f"checkpoint {folder} has the single-file state.pt format from before DCP, which this version of Stride " \
           f"no longer reads"
    for what, r in refusals.items():
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and "Traceback" not in r.stderr, (what, r.stderr[-3000:])
        assert len(lines) == 1 and lines[0].startswith("stride: error: ") and says in lines[0], (what, lines)
        assert "stride export" in lines[0] and "run.name" in lines[0], (what, lines)
    after = {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(run.rglob("*")) if p.is_file()}
    assert {p: after.get(p) for p in before} == before and not out.exists()
    assert [p.name for p in run.iterdir() if p.name.startswith("checkpoint_")] == [folder.name]
    assert complete_checkpoints(run) == []  # never listed by keep_last's pruning, so never removed


def test_a_folder_of_the_format_before_dcp_is_refused_only_where_a_resume_would_take_it(tmp_path):
    """newest_complete: a DCP checkpoint newer than a state.pt one is the resume's (the old folder stays, unread);
    a state.pt one newer than the newest usable checkpoint is refused, not passed over for the older one."""
    from stride.errors import CheckpointFormatError

    writer = checkpointing.CheckpointWriter(0)
    for step in (10, 20):
        writer.save(checkpointing.checkpoint_folder(tmp_path, step), {"model": {"w": torch.ones(3)}},
                    {"step": step}).result()
    writer.close()
    old = checkpointing.checkpoint_folder(tmp_path, 15)
    old.mkdir()
    (old / "state.pt").write_bytes(b"weights")
    (old / checkpointing.META).write_text(json.dumps({"step": 15, "state_bytes": 7, "state_sha256": "0" * 64}))
    assert checkpointing.newest_complete(tmp_path) == checkpointing.checkpoint_folder(tmp_path, 20)
    shutil.rmtree(checkpointing.checkpoint_folder(tmp_path, 20))
    with pytest.raises(CheckpointFormatError, match=f"checkpoint {old} has the single-file state.pt format"):
        checkpointing.newest_complete(tmp_path)
    with pytest.raises(CheckpointFormatError):
        checkpointing.verify(old)
    assert (old / "state.pt").read_bytes() == b"weights"


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
