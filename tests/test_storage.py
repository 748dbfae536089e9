"""The storage seam (trainers/run/storage.py) against real servers: the suite's S3-compatible server (moto) and, where
tests/gcs_server.py provides it, the GCS emulator. One process, no Ray: what the run lock and the checkpoint commit
rely on is that these calls behave as the clouds' do (create-if-absent, replace-if-unchanged, one clock)."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest

from gcs_server import gcs_server_fixture
from s3_server import s3_server_fixture
from stride.trainers.run import storage
from stride.trainers.run.storage import Location, ObjectStore, parse_uri

s3_server = s3_server_fixture()
gcs_server = gcs_server_fixture()


@pytest.fixture
def s3_env(s3_server, monkeypatch):
    for k in [k for k in os.environ if k.startswith("AWS_")]:
        monkeypatch.delenv(k)
    missing = str(s3_server.root / "no-such-aws-file")
    for k, v in dict(s3_server.env_vars(), AWS_CONFIG_FILE=missing, AWS_SHARED_CREDENTIALS_FILE=missing).items():
        monkeypatch.setenv(k, v)
    return s3_server


@pytest.fixture
def gcs_env(gcs_server, monkeypatch):
    for k, v in gcs_server.env_vars().items():
        monkeypatch.setenv(k, v)
    return gcs_server


@pytest.fixture(params=["s3", "gs"])
def bucket_store(request):
    """A fresh bucket on the S3 server, then on the GCS emulator: every test below runs against both."""
    bucket = f"b-{uuid.uuid4().hex[:12]}"
    if request.param == "s3":
        request.getfixturevalue("s3_env").create_bucket(bucket)
    else:
        request.getfixturevalue("gcs_env").make_bucket(bucket)
    return ObjectStore(Location(request.param, bucket, "runs"))


# ---- parsing: pure functions ---------------------------------------------------------------------------------


@pytest.mark.parametrize("uri, want", [
    ("s3://my-bucket/runs", Location("s3", "my-bucket", "runs")),
    ("s3://my-bucket/a/b/", Location("s3", "my-bucket", "a/b")),
    ("gs://my_bucket.x", Location("gs", "my_bucket.x", "")),
    ("file:///tmp/runs", Path("/tmp/runs")),
])
def test_uris_parse(uri, want):
    assert parse_uri(uri) == want


@pytest.mark.parametrize("uri, words", [
    ("hdfs://nn/runs", "scheme 'hdfs'"),
    ("s3://bucket/runs/../other", "'..' segment"),
    ("s3://bucket//runs", "empty"),
    ("s3://AKIAEXAMPLE:topsecret@bucket/runs", "carries credentials"),
    ("s3://B/runs", "not a bucket name"),
    ("s3://bucket/runs?x=1", "query"),
    ("file://relative/runs", "absolute path"),
])
def test_bad_uris_say_why_and_never_repeat_a_secret(uri, words):
    with pytest.raises(ValueError) as e:
        parse_uri(uri)
    assert words in str(e.value)
    assert "topsecret" not in str(e.value) and "AKIAEXAMPLE" not in str(e.value)


# ---- an S3 bucket --------------------------------------------------------------------------------------------


def test_create_writes_only_when_absent(bucket_store):
    first = bucket_store.create("stride.lock", b"one")
    assert first is not None
    assert bucket_store.create("stride.lock", b"two") is None
    assert bucket_store.read("stride.lock") == b"one"


def test_replace_writes_only_when_unchanged(bucket_store):
    v1 = bucket_store.create("stride.lock", b"one")
    v2 = bucket_store.replace("stride.lock", b"two", v1)
    assert v2 is not None and v2 != v1
    assert bucket_store.replace("stride.lock", b"three", v1) is None  # a stale version loses
    assert bucket_store.read("stride.lock") == b"two"
    assert bucket_store.replace("gone.lock", b"x", v2) is None


def test_listing_folders_copy_delete(bucket_store, tmp_path):
    (tmp_path / "shard").write_bytes(b"x" * 1000)
    bucket_store.upload(tmp_path / "shard", "run/checkpoint_00000010/__0_0.distcp")
    bucket_store.write("run/checkpoint_00000010/meta.json", b"{}")
    bucket_store.write("run/metrics.jsonl", b"")
    assert bucket_store.listing("run") == {"run/checkpoint_00000010/__0_0.distcp": 1000,
                                           "run/checkpoint_00000010/meta.json": 2, "run/metrics.jsonl": 0}
    assert bucket_store.folders("run") == ["checkpoint_00000010"]
    bucket_store.copy("run/checkpoint_00000010", "run/best/checkpoint_00000010")
    assert "run/best/checkpoint_00000010/__0_0.distcp" in bucket_store.listing("run/best")
    bucket_store.delete("run/checkpoint_00000010")
    assert sorted(bucket_store.listing("run")) == ["run/best/checkpoint_00000010/__0_0.distcp",
                                                   "run/best/checkpoint_00000010/meta.json", "run/metrics.jsonl"]
    bucket_store.download("run/best/checkpoint_00000010/__0_0.distcp", tmp_path / "back")
    assert (tmp_path / "back").read_bytes() == b"x" * 1000


def test_a_shard_goes_up_with_the_sha256_meta_json_records_for_the_bucket_to_check(s3_env, tmp_path):
    """S3 refuses a PUT whose bytes do not match its x-amz-checksum-sha256 (BadDigest) and keeps the digest with the
    object: the one meta.json records, computed once on the host. (moto stores the digest but does not check it, so
    the refusal is S3's documented behaviour, not tested here.)"""
    import base64
    import hashlib

    s3_env.create_bucket(bucket := f"b-{uuid.uuid4().hex[:12]}")
    store = ObjectStore(Location("s3", bucket, "runs"))
    (tmp_path / "shard").write_bytes(b"x" * 1000)
    digest = hashlib.sha256(b"x" * 1000).hexdigest()
    store.upload(tmp_path / "shard", "c/__0_0.distcp", sha256=digest)
    head = store.fs.call_s3("head_object", Bucket=bucket, Key="runs/c/__0_0.distcp", ChecksumMode="ENABLED")
    assert base64.b64decode(head["ChecksumSHA256"]).hex() == digest
    assert store.read("c/__0_0.distcp") == b"x" * 1000


def test_the_clock_is_the_servers(bucket_store):
    import time

    t = bucket_store.now()
    assert abs(t - time.time()) < 120  # moto stamps with this host's clock; a real bucket with its own
    assert bucket_store.listing("") == {}  # the probe is gone


def test_a_missing_bucket_is_one_line_naming_it(s3_env):
    store = ObjectStore(Location("s3", "no-such-bucket-here", "runs"))
    with pytest.raises(storage.StorageError) as e:
        store.check_writable("run.storage_path")
    assert "run.storage_path (s3://no-such-bucket-here/runs)" in str(e.value)
    assert "does not exist" in str(e.value)


def test_missing_credentials_are_one_line_without_secrets(s3_env, monkeypatch):
    bucket = f"b-{uuid.uuid4().hex[:12]}"
    s3_env.create_bucket(bucket)
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    store = ObjectStore(Location("s3", bucket, "runs"))
    with pytest.raises(storage.StorageError) as e:
        store.check_writable("run.storage_path")
    assert "no credentials" in str(e.value), e.value
    assert "testing" not in str(e.value)


@pytest.mark.parametrize("error, words", [
    (PermissionError("Access Denied"), "may not write there"),
    (OSError("ClientError: An error occurred (AccessDenied) when calling the PutObject operation"), "may not write"),
    (OSError("Forbidden: 403 POST https://storage.googleapis.com/upload"), "may not write there"),
    (FileNotFoundError("NoSuchBucket"), "does not exist"),
    (OSError("NoCredentialsError: Unable to locate credentials"), "no credentials"),
    (OSError("DefaultCredentialsError: Your default credentials were not found"), "no credentials"),
])
def test_what_the_storage_refused_is_said_with_its_fix(error, words):
    """No permission cannot be staged on the suite's S3 server (it accepts any key for any action): the clouds' words
    for it, and for the other refusals, each map to the clause that names the fix."""
    assert words in storage.refusal(Location("s3", "my-bucket", "runs"), error)
