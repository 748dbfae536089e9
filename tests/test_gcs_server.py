"""The GCS emulator of the tests (tests/gcs_server.py) is a real one: it refuses a second create-if-absent and a
stale generation (what the lock on object storage builds on), serves byte ranges (what a resume reads), reaches a
child process through the environment alone, and leaves no process behind."""

from __future__ import annotations

import os
import subprocess
import textwrap
import uuid

import pytest

from conftest import PYTHON
from gcs_server import GCSServer, gcs_server_fixture

gcs_server = gcs_server_fixture()


@pytest.fixture
def bucket(gcs_server):
    name = f"b-{uuid.uuid4().hex[:12]}"
    gcs_server.make_bucket(name)
    return name


def test_create_if_absent_is_refused_the_second_time(gcs_server, bucket):
    fs = gcs_server.filesystem()
    fs.pipe_file(f"{bucket}/run/lock", b"first", mode="create")
    with pytest.raises(FileExistsError):
        fs.pipe_file(f"{bucket}/run/lock", b"second", mode="create")
    assert fs.cat_file(f"{bucket}/run/lock") == b"first"


def test_a_stale_generation_is_refused(gcs_server, bucket):
    from google.api_core.exceptions import PreconditionFailed

    blob = gcs_server.client().bucket(bucket).blob("run/lock")
    blob.upload_from_string(b"v1", if_generation_match=0)
    blob.reload()
    first = blob.generation
    blob.upload_from_string(b"v2", if_generation_match=first)
    with pytest.raises(PreconditionFailed):
        gcs_server.client().bucket(bucket).blob("run/lock").upload_from_string(b"v3", if_generation_match=first)
    assert gcs_server.client().bucket(bucket).blob("run/lock").download_as_bytes() == b"v2"


def test_a_ranged_read_returns_only_those_bytes(gcs_server, bucket):
    fs = gcs_server.filesystem()
    fs.pipe_file(f"{bucket}/shard.distcp", bytes(range(256)) * 4)
    # gcsfs returns the body as the server sent it: a server that ignored Range would send all 1024 bytes
    assert fs.cat_file(f"{bucket}/shard.distcp", start=300, end=310) == bytes(range(44, 54))
    assert gcs_server.list(f"gs://{bucket}") == [f"{bucket}/shard.distcp"]


def test_a_child_reaches_it_through_child_env_alone(gcs_server, bucket, tmp_path):
    # The clients a child makes without arguments: the default credential chain must end at the emulator, with
    # no metadata server and no developer credentials in the way.
    script = textwrap.dedent(f"""
        import gcsfs.core
        from google.cloud import storage
        fs = gcsfs.core.GCSFileSystem()
        fs.pipe_file("{bucket}/child/x", b"from the child", mode="create")
        print(storage.Client().bucket("{bucket}").blob("child/x").download_as_bytes().decode())
    """)
    base = dict(os.environ, GOOGLE_APPLICATION_CREDENTIALS=str(tmp_path / "developer.json"))
    r = subprocess.run([PYTHON, "-c", script], env=gcs_server.child_env(base), capture_output=True, text=True,
                       timeout=120, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "from the child"


def test_stop_leaves_no_process(tmp_path):
    server = GCSServer(tmp_path).start()
    pid = server.pid
    os.kill(pid, 0)  # running
    server.stop()
    assert server.pid is None
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    server.stop()  # a second stop does nothing
