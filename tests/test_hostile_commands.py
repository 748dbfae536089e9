"""The commands after training (eval, predict) against folders someone else wrote: predict's --out, the workers'
import path. The command-line cases (planted links, a planted module for every command, a damaged prediction
record) are in tests/test_bad_input_sweep.py; these are the guarantees cheapest proven below the command line."""

from __future__ import annotations

import json
import textwrap

import pytest

from conftest import run_cli

JOB_IDENTITY = {"run": "/r", "checkpoint": "/r/checkpoint_00000020", "data": ["/d.parquet"], "rows": 10, "blocks": 2}


def test_predict_force_replaces_only_what_predict_wrote(tmp_path):
    """--force over an earlier prediction removes its parts, a part a killed attempt left and its markers; a user's
    own files in the folder, part-* names included, stay byte for byte."""
    from stride.trainers.commands.predict import JOB, MANIFEST, prepare_output

    out = tmp_path / "out"
    out.mkdir()
    ours = [JOB, MANIFEST, "part-000000.parquet", "part-000001.parquet", ".part-000001.parquet.123-0a1b2c3d.tmp",
            ".part-000001.parquet.123.tmp"]
    mine = ["part-notes.txt", "part-000001.parquet.bak", "part-1.parquet", ".part-mine", "part-000002.parquet.csv"]
    for name in ours + mine:
        (out / name).write_text(json.dumps(JOB_IDENTITY) if name == JOB else name)
    assert prepare_output(out, JOB_IDENTITY, force=True) is False
    assert sorted(p.name for p in out.iterdir()) == sorted(mine)
    assert all((out / name).read_text() == name for name in mine)


def test_a_resume_removes_only_the_parts_a_killed_attempt_left(tmp_path):
    from stride.trainers.commands.predict import JOB, prepare_output

    out = tmp_path / "out"
    out.mkdir()
    (out / JOB).write_text(json.dumps(JOB_IDENTITY))
    (out / "part-000000.parquet").write_text("done")
    (out / ".part-000001.parquet.77-deadbeef.tmp").write_text("cut short")
    (out / ".part-mine.tmp").write_text("mine")
    assert prepare_output(out, JOB_IDENTITY, force=False) is True
    assert sorted(p.name for p in out.iterdir()) == sorted([JOB, "part-000000.parquet", ".part-mine.tmp"])


@pytest.mark.parametrize("record", [b"{not json", b"\xff\xfe", b"[1, 2]"])
def test_a_damaged_prediction_record_is_refused_in_one_line(tmp_path, record):
    """A .stride-predict.json that is not one predict wrote: a UsageError naming it (one line), nothing removed."""
    from stride.errors import UsageError
    from stride.trainers.commands.predict import JOB, prepare_output

    out = tmp_path / "out"
    out.mkdir()
    (out / JOB).write_bytes(record)
    (out / "part-000000.parquet").write_text("a part")
    if record == b"[1, 2]":  # valid JSON of another job: refused as another job's, as before
        with pytest.raises(UsageError, match="an unfinished prediction of other inputs"):
            prepare_output(out, JOB_IDENTITY, force=False)
    else:
        with pytest.raises(UsageError, match=r"\.stride-predict\.json is not a record stride predict wrote") as e:
            prepare_output(out, JOB_IDENTITY, force=False)
        assert "\n" not in str(e.value)
    assert (out / "part-000000.parquet").read_text() == "a part"


def test_a_prediction_record_that_is_a_link_is_refused(tmp_path):
    """A link planted as .stride-predict.json is neither read nor followed, even with --force."""
    from stride.errors import RunFolderError
    from stride.trainers.commands.predict import JOB, prepare_output

    out, victim = tmp_path / "out", tmp_path / "victim.json"
    out.mkdir()
    victim.write_text(json.dumps(JOB_IDENTITY))
    (out / JOB).symlink_to(victim)
    (out / "part-000000.parquet").write_text("a part")
    for force in (False, True):
        with pytest.raises(RunFolderError, match="is a symlink"):
            prepare_output(out, JOB_IDENTITY, force=force)
    assert (out / "part-000000.parquet").exists() and victim.read_text() == json.dumps(JOB_IDENTITY)


def test_a_part_is_never_written_through_a_planted_link(tmp_path):
    from stride.errors import RunFolderError
    from stride.trainers.commands.predict import write_part

    import pyarrow as pa

    victim = tmp_path / "victim.txt"
    victim.write_text("victim")
    (tmp_path / "part-000000.parquet").symlink_to(victim)
    with pytest.raises(RunFolderError, match="is a symlink"):
        write_part(tmp_path / "part-000000.parquet", pa.table({"sample_id": [1]}))
    assert victim.read_text() == "victim"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["part-000000.parquet", "victim.txt"]  # no temporary left


def test_ray_workers_do_not_import_from_the_drivers_working_directory(tmp_path, ray_cluster):
    """Ray puts the driver's working directory first on every worker's sys.path: a module planted there would be
    imported by the workers of `stride eval` run beside a run folder. Stride's drivers connect without it."""
    planted = tmp_path / "planted"
    planted.mkdir()
    (planted / "stride_planted_probe.py").write_text(f"open({str(tmp_path / 'pwned')!r}, 'w').write('ran')\n")
    driver = tmp_path / "driver.py"
    driver.write_text(textwrap.dedent("""
        import json, os, sys
        import ray
        from stride.ray_cluster.connect import init_ray

        init_ray()
        cwd = os.getcwd()

        @ray.remote(num_cpus=0)
        def probe():
            import importlib.util, sys
            return {"path": sys.path, "found": importlib.util.find_spec("stride_planted_probe") is not None}

        print(json.dumps({"cwd": cwd, **ray.get(probe.remote())}))
    """))
    r = run_cli([str(driver)], cwd=planted, env=ray_cluster, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["cwd"] == str(planted)  # the driver is back in its own working directory after connecting
    assert str(planted) not in got["path"] and not got["found"], got["path"][:5]
    assert not (tmp_path / "pwned").exists()


def test_python_m_stride_drops_the_working_directory_first(tmp_path):
    """`python -m stride ...` runs stride/__init__.py with the working directory first on sys.path, before anything
    else is imported: it is gone by the time stride's own imports run. `import stride` in a user's script (not -m)
    leaves their sys.path alone."""
    (tmp_path / "argparse.py").write_text("raise SystemExit('planted argparse imported')\n")
    r = run_cli(["-m", "stride", "--help"], cwd=tmp_path, timeout=120)
    assert r.returncode == 0 and "usage: stride <command>" in r.stdout, r.stderr[-2000:]
    probe = "import sys, stride; print(sys.path[0] == '')"
    r = run_cli(["-c", probe], cwd=tmp_path / "..", timeout=120)
    assert r.stdout.strip() == "True", r.stderr[-2000:]


def test_export_never_writes_through_a_link_planted_at_its_temporary_name(tmp_path):
    """stride export writes a fresh random temporary name beside --out (created without following links) and renames
    it: a link planted at the name earlier versions used (.<out>.tmp) is left alone, and so is its target."""
    import torch

    from stride.trainers.commands.export import write_weights

    victim, out = tmp_path / "victim.txt", tmp_path / "m.safetensors"
    victim.write_text("victim")
    (tmp_path / ".m.safetensors.tmp").symlink_to(victim)
    write_weights({"w": torch.ones(2)}, out, {"format": "pt"})
    assert victim.read_text() == "victim" and out.is_file() and not out.is_symlink()
    assert sorted(p.name for p in tmp_path.iterdir()) == [".m.safetensors.tmp", "m.safetensors", "victim.txt"]
