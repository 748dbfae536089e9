"""Where a run's files live: a folder, or a prefix of a bucket (`s3://bucket/prefix`, `gs://bucket/prefix`).

One interface, `Store`, with two implementations: `FolderStore` (a folder, through the no-follow helpers of
trainers/run/folder.py) and `ObjectStore` (a bucket, through fsspec: s3fs and gcsfs). The bytes go through those
libraries; nothing here signs a request or speaks HTTP. Credentials come from each cloud's own chain (environment,
config files, instance or workload identity) inside those libraries, and endpoints from the standard variables:
`AWS_ENDPOINT_URL` / `AWS_ENDPOINT_URL_S3` (botocore) and `STORAGE_EMULATOR_HOST` (gcsfs, google-cloud-storage). A
location never carries a credential: a URI with a `user:password@` part is refused, and messages name only
`scheme://bucket/prefix`.

What an object store lacks (atomic rename, links, O_EXCL) the run gets from conditional writes instead:
`create` writes an object only if it is absent, and `replace` only if it is unchanged since it was read (S3
If-None-Match/If-Match, GCS generation preconditions). The run lock (trainers/run/lock.py) is built on those two.
"""

from __future__ import annotations

import base64
import hashlib
import logging
import os
import posixpath
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stride.errors import ConfigError

__all__ = ["Location", "ObjectStore", "FolderStore", "Store", "is_uri", "parse_uri", "open_store", "with_backoff"]

SCHEMES = ("s3", "gs")
# S3's and GCS's bucket naming rules, the part they share (lower case, digits, dots, dashes; 3-63 characters);
# GCS also allows underscores.
_BUCKET = re.compile(r"[a-z0-9][a-z0-9._-]{1,61}[a-z0-9]")
_S3_SINGLE_PUT = 100 << 20  # s3fs sends a file of this size or more in parts (2 x its 50 MiB chunks)
_INSTALL = {"s3": "pip install 'stride[s3]' (s3fs)", "gs": "pip install 'stride[gcs]' (gcsfs)"}


def is_uri(text: str) -> bool:
    return "://" in str(text)


@dataclass(frozen=True)
class Location:
    """`scheme://bucket/prefix`; the prefix has no leading or trailing slash, and may be empty."""

    scheme: str
    bucket: str
    prefix: str = ""

    def __str__(self) -> str:
        return f"{self.scheme}://{self.bucket}/{self.prefix}".rstrip("/")

    def join(self, *names: str) -> Location:
        return Location(self.scheme, self.bucket, posixpath.join(self.prefix, *names).strip("/"))

    @property
    def path(self) -> str:
        """bucket/prefix: what fsspec's filesystems take."""
        return f"{self.bucket}/{self.prefix}".rstrip("/")


def parse_uri(text: str) -> Location | Path:
    """An object-store URI as a Location, or a `file://` URI as its folder. Raises ValueError with the reason (the
    config's validator names the field); the reason never repeats a credential the URI carried."""
    scheme, sep, rest = str(text).partition("://")
    if not sep:
        raise ValueError("is not a URI")
    scheme = scheme.lower()
    if scheme == "file":
        if not rest.startswith("/"):
            raise ValueError("is a file:// URI without an absolute path; use file:///absolute/folder or a folder")
        return Path(rest)
    if scheme not in SCHEMES:
        raise ValueError(f"has the scheme {scheme!r}, which Stride cannot store runs in; use s3://bucket/prefix, "
                         f"gs://bucket/prefix or a folder")
    authority, _, path = rest.partition("/")
    if "@" in authority:
        raise ValueError(f"carries credentials in the URI ({scheme}://…@…); remove them: credentials come from the "
                         f"cloud's own chain (environment, config files, instance or workload identity)")
    if "?" in rest or "#" in rest:
        raise ValueError(f"has a query or fragment; use a plain {scheme}://bucket/prefix")
    if not _BUCKET.fullmatch(authority):
        raise ValueError(f"names the bucket {authority!r}, which is not a bucket name (3-63 lower-case letters, "
                         f"digits, dots, dashes); use {scheme}://<bucket>/<prefix>")
    parts = [p for p in path.split("/")]
    while parts and parts[-1] == "":
        parts.pop()  # a trailing slash
    if any(p in ("", ".", "..") for p in parts):
        raise ValueError("has an empty, '.' or '..' segment; name the prefix plainly, e.g. "
                         f"{scheme}://{authority}/runs")
    return Location(scheme, authority, "/".join(parts))


def location_of(text: str) -> Location | None:
    """The Location of an object-store URI; None for a folder or a file:// URI (the config has checked it)."""
    if not is_uri(text):
        return None
    found = parse_uri(text)
    return found if isinstance(found, Location) else None


class StorageError(ConfigError):
    """The storage refused the run before anything ran: no such bucket, no credentials, no permission."""


class Store:
    """A run's files by name (`checkpoint_00000010/meta.json`), under one root. Every method names paths relative to
    the root with '/' separators."""

    def describe(self, name: str = "") -> str:
        raise NotImplementedError

    def read(self, name: str) -> bytes | None:
        """The whole file, or None when it does not exist."""
        raise NotImplementedError

    def read_versioned(self, name: str) -> tuple[bytes, str] | None:
        """The file and the version that `replace` compares against; None when it does not exist."""
        raise NotImplementedError

    def write(self, name: str, data: bytes) -> None:
        """The whole file at once: a reader sees the old bytes or the new, never a mix."""
        raise NotImplementedError

    def create(self, name: str, data: bytes) -> str | None:
        """Write `name` only if it does not exist: its version, or None when it existed."""
        raise NotImplementedError

    def replace(self, name: str, data: bytes, version: str) -> str | None:
        """Write `name` only if it is still at `version`: the new version, or None when it changed or is gone."""
        raise NotImplementedError

    def upload(self, local: Path, name: str, sha256: str | None = None) -> None:
        """Copy the local file `local` to `name`. `sha256` (hex), when the caller has it, is the file's digest: the
        storage checks the bytes it receives against it."""
        raise NotImplementedError

    def download(self, name: str, local: Path) -> None:
        raise NotImplementedError

    def listing(self, prefix: str = "") -> dict[str, int]:
        """Every file under `prefix` (recursive): name -> bytes."""
        raise NotImplementedError

    def folders(self, prefix: str = "") -> list[str]:
        """The immediate sub-folders of `prefix`, by name."""
        raise NotImplementedError

    def delete(self, name: str) -> None:
        """A file, or a folder and everything under it; nothing when absent."""
        raise NotImplementedError

    def copy(self, src: str, dst: str) -> None:
        """A file or a folder, within the store."""
        raise NotImplementedError

    def now(self) -> float:
        """The storage's own clock (seconds since the epoch): staleness is judged on one clock, not two hosts'."""
        raise NotImplementedError

    def modified(self, name: str) -> float | None:
        """When `name` was last written, on the storage's clock; None when absent."""
        raise NotImplementedError


def _as_oserror(method):
    """The storage libraries raise their own kinds for a server that cannot be reached (botocore's
    EndpointConnectionError, aiohttp's, google-api-core's): each becomes an OSError with their words, so that callers
    retry and report storage trouble as one kind. Errors of Stride's own and programming errors pass unchanged."""
    import functools

    @functools.wraps(method)
    def wrapper(*args, **kwargs):
        try:
            return method(*args, **kwargs)
        except (OSError, ValueError, TypeError, KeyError, AttributeError, ImportError):
            raise
        except Exception as e:  # noqa: BLE001 - the libraries' many kinds, see above
            raise OSError(f"{type(e).__name__}: {e}") from e
    return wrapper


class ObjectStore(Store):
    """A prefix of a bucket, through fsspec (s3fs, gcsfs's core filesystem) and, for GCS's generation-matched
    replace, google-cloud-storage. Every failure to reach the storage is an OSError."""


    def __init__(self, location: Location, fs=None):
        self.location = location
        self.fs = fs if fs is not None else filesystem(location.scheme)

    def describe(self, name: str = "") -> str:
        return str(self.location.join(name)) if name else str(self.location)

    def _path(self, name: str) -> str:
        return posixpath.join(self.location.path, name).rstrip("/")

    def read(self, name: str) -> bytes | None:
        try:
            return self.fs.cat_file(self._path(name))
        except FileNotFoundError:
            return None

    def read_versioned(self, name: str) -> tuple[bytes, str] | None:
        # The version of the bytes read, not of a later write: read the version, then the bytes, then the version
        # again, until both agree (a writer between them just means another pass).
        for _ in range(5):
            before = self._version(name)
            if before is None:
                return None
            data = self.read(name)
            if data is not None and self._version(name) == before:
                return data, before
        raise OSError(f"{self.describe(name)} kept changing while it was read")

    def _info(self, name: str) -> dict[str, Any] | None:
        path = self._path(name)
        self.fs.invalidate_cache(path)
        try:
            return self.fs.info(path)
        except FileNotFoundError:
            return None

    def version(self, name: str) -> str | None:
        """The version `replace` compares against (one metadata request), or None when `name` does not exist."""
        return self._version(name)

    def _version(self, name: str) -> str | None:
        info = self._info(name)
        if info is None:
            return None
        return str(info.get("generation") or info.get("ETag") or info.get("etag"))

    def write(self, name: str, data: bytes) -> None:
        self.fs.pipe_file(self._path(name), data)

    def create(self, name: str, data: bytes) -> str | None:
        try:
            self.fs.pipe_file(self._path(name), data, mode="create")
        except FileExistsError:
            return None
        return self._version(name)

    def replace(self, name: str, data: bytes, version: str) -> str | None:
        if self.location.scheme == "s3":
            return self._replace_s3(name, data, version)
        return self._replace_gcs(name, data, version)

    def _replace_s3(self, name: str, data: bytes, version: str) -> str | None:
        try:
            self.fs.pipe_file(self._path(name), data, IfMatch=version)
        except FileNotFoundError:
            return None
        except OSError as e:
            if _precondition_failed(e):
                return None
            raise
        return self._version(name)

    def _replace_gcs(self, name: str, data: bytes, version: str) -> str | None:
        from google.api_core import exceptions as gexc

        blob = gcs_client().bucket(self.location.bucket).blob(posixpath.join(self.location.prefix, name))
        try:
            blob.upload_from_string(data, if_generation_match=int(version))
        except (gexc.PreconditionFailed, gexc.NotFound):
            return None
        return str(blob.generation)

    def upload(self, local: Path, name: str, sha256: str | None = None) -> None:
        if self.location.scheme == "s3" and sha256 and Path(local).stat().st_size < _S3_SINGLE_PUT:
            # One pass over the bytes on this host (the caller's sha256), checked by the bucket: botocore would
            # otherwise add a CRC32 pass, and over http a SigV4 payload-hash pass (payload signing is off:
            # UNSIGNED-PAYLOAD, as botocore sends over https whenever a checksum is present).
            digest = base64.b64encode(bytes.fromhex(sha256)).decode()
            self.fs.put_file(str(local), self._path(name), ChecksumAlgorithm="SHA256", ChecksumSHA256=digest)
            return
        self.fs.put_file(str(local), self._path(name))  # multipart (s3fs's own size limit), or GCS

    def download(self, name: str, local: Path) -> None:
        self.fs.get_file(self._path(name), str(local))

    def listing(self, prefix: str = "") -> dict[str, int]:
        root = self._path(prefix)
        self.fs.invalidate_cache(root)
        try:
            found = self.fs.find(root, detail=True)
        except FileNotFoundError:
            return {}
        base = self.location.path + "/"
        return {p[len(base):]: int(info.get("size") or 0) for p, info in found.items()
                if info.get("type") == "file" and p.startswith(base)}

    def folders(self, prefix: str = "") -> list[str]:
        root = self._path(prefix)
        self.fs.invalidate_cache(root)
        try:
            entries = self.fs.ls(root, detail=True)
        except FileNotFoundError:
            return []
        return sorted(posixpath.basename(e["name"].rstrip("/")) for e in entries if e.get("type") == "directory")

    def delete(self, name: str) -> None:
        names = [n for n in self.listing(name) if n == name or n.startswith(name.rstrip("/") + "/")] if name else []
        if names:
            self.fs.rm([self._path(n) for n in names])
        self.fs.invalidate_cache(self._path(name))

    def copy(self, src: str, dst: str) -> None:
        files = self.listing(src)
        for n in files:
            rel = n[len(src):].lstrip("/") if n != src else ""
            self.fs.copy(self._path(n), self._path(posixpath.join(dst, rel) if rel else dst))

    def modified(self, name: str) -> float | None:
        info = self._info(name)
        if info is None:
            return None
        for key in ("LastModified", "updated", "mtime", "last_modified"):
            if info.get(key) is not None:
                return _seconds(info[key])
        return None

    def now(self) -> float:
        probe = f".stride-clock-{os.getpid()}-{time.monotonic_ns()}"
        self.write(probe, b"")
        try:
            return self.modified(probe) or time.time()
        finally:
            self.delete(probe)

    def check_writable(self, field: str) -> None:
        """Write and delete one probe object under the prefix. Raises StorageError naming `field`, the location and
        the fix for a bucket that does not exist, missing credentials, or no permission; the cloud's own words are
        shortened and never carry a credential (they name the bucket and key only)."""
        probe = f".stride-probe-{os.getpid()}-{time.monotonic_ns()}"
        try:
            self.write(probe, b"")
            self.delete(probe)
        except Exception as e:  # noqa: BLE001 - each library raises its own kinds; classified below by what they say
            raise StorageError(f"{field} ({self.location}): {refusal(self.location, e)}") from None


for _name in ("read", "read_versioned", "version", "write", "create", "replace", "upload", "download", "listing", "folders",
              "delete", "copy", "modified", "now"):
    setattr(ObjectStore, _name, _as_oserror(getattr(ObjectStore, _name)))


def refusal(location: Location, e: BaseException) -> str:
    """What the storage's refusal means for the user, in one clause with the fix."""
    text = f"{type(e).__name__}: {e}"
    low = text.lower()
    if "nosuchbucket" in low or "bucket does not exist" in low or ("not found" in low and "bucket" in low) or \
            isinstance(e, FileNotFoundError):
        return f"the bucket {location.bucket!r} does not exist; create it, or name one that does"
    if any(w in low for w in ("nocredentials", "unable to locate credentials", "credentials were not found",
                              "defaultcredentialserror", "could not automatically determine credentials")):
        return ("no credentials were found; set the cloud's standard variables (AWS_ACCESS_KEY_ID/AWS_PROFILE, "
                "GOOGLE_APPLICATION_CREDENTIALS) or give the nodes an instance or workload identity")
    if isinstance(e, PermissionError) or any(w in low for w in ("accessdenied", "access denied", "forbidden", "403",
                                                                  "invalidaccesskeyid", "signaturedoesnotmatch")):
        return ("these credentials may not write there; grant write, list and delete on the prefix, or use "
                "another prefix")
    if isinstance(e, ImportError):
        return f"its library is not installed; {_INSTALL[location.scheme]}"
    return f"cannot be written ({_short(text)}); check the URI, the endpoint and the credentials"


def _short(text: str, limit: int = 160) -> str:
    line = " ".join(str(text).split())
    return line if len(line) <= limit else line[:limit - 1] + "…"


def _precondition_failed(e: BaseException) -> bool:
    low = str(e).lower().replace("-", "")  # S3: "pre-conditions you specified did not hold"
    return "precondition" in low or "412" in low


def _seconds(value: Any) -> float:
    if isinstance(value, (int, float)):
        return float(value)
    if hasattr(value, "timestamp"):
        return value.timestamp()
    from datetime import datetime

    return datetime.fromisoformat(str(value).replace("Z", "+00:00")).timestamp()


class _DroppedConnectionNoise(logging.Filter):
    """aiohttp leaves a traceback per request cut off by a dropped connection ("Task exception was never retrieved"),
    after s3fs/gcsfs have already turned the failure into the error Stride reports and retries: drop those alone."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        context = getattr(record, "msg", "")
        return not ("never retrieved" in str(context) and type(exc).__module__.startswith("aiohttp"))


def import_library(scheme: str) -> None:
    """Import the storage library of `scheme` now (s3fs and aiobotocore take ~0.5 s of CPU): for a process that
    would otherwise wait idle first and import it on the way to its first step. Nothing when it is not installed
    (filesystem() says so when it is needed)."""
    import importlib

    try:
        importlib.import_module("s3fs" if scheme == "s3" else "gcsfs.core")
    except ImportError:
        pass


def filesystem(scheme: str):
    """fsspec's filesystem for `scheme`, configured from the environment only. Raises ImportError naming the extra
    to install."""
    # Their INFO lines ("Found credentials in environment variables") are noise on every process's console.
    for name in ("botocore", "aiobotocore", "s3fs", "gcsfs", "google"):
        logging.getLogger(name).setLevel(max(logging.getLogger(name).level, logging.WARNING))
    asyncio_log = logging.getLogger("asyncio")
    if not any(isinstance(f, _DroppedConnectionNoise) for f in asyncio_log.filters):
        asyncio_log.addFilter(_DroppedConnectionNoise())
    if scheme == "s3":
        try:
            import s3fs
        except ImportError as e:
            raise ImportError(_INSTALL["s3"]) from e
        # botocore reads AWS_ENDPOINT_URL and AWS_ENDPOINT_URL_S3 itself, and its credential chain.
        return s3fs.S3FileSystem(skip_instance_cache=True, use_listings_cache=False,
                                 config_kwargs={"s3": {"payload_signing_enabled": False}})
    try:
        from gcsfs.core import GCSFileSystem  # the core class: gcsfs's default probes gRPC first (60 s per bucket)
    except ImportError as e:
        raise ImportError(_INSTALL["gs"]) from e
    # gcsfs reads STORAGE_EMULATOR_HOST; an emulator takes no credentials.
    token = "anon" if os.environ.get("STORAGE_EMULATOR_HOST") else None
    return GCSFileSystem(token=token, skip_instance_cache=True, use_listings_cache=False)


def gcs_client():
    """google-cloud-storage's client (for generation preconditions), from the same environment as gcsfs."""
    from google.cloud import storage

    if os.environ.get("STORAGE_EMULATOR_HOST"):
        from google.auth.credentials import AnonymousCredentials

        return storage.Client(credentials=AnonymousCredentials(), project="stride-emulator")
    return storage.Client()


class FolderStore(Store):
    """A folder, through the no-follow helpers: the same interface as a bucket, for code that serves both."""

    def __init__(self, root: Path):
        self.root = Path(root)

    def describe(self, name: str = "") -> str:
        return str(self.root / name) if name else str(self.root)

    def read(self, name: str) -> bytes | None:
        from stride.trainers.run import folder as runfolder

        try:
            return runfolder.read_bytes(self.root / name, limit=None)
        except FileNotFoundError:
            return None

    def read_versioned(self, name: str) -> tuple[bytes, str] | None:
        data = self.read(name)
        return None if data is None else (data, hashlib.sha256(data).hexdigest())

    def write(self, name: str, data: bytes) -> None:
        from stride.trainers.run import folder as runfolder

        (self.root / name).parent.mkdir(parents=True, exist_ok=True)
        runfolder.atomic_write_bytes(self.root / name, data)

    def create(self, name: str, data: bytes) -> str | None:
        from stride.trainers.run import folder as runfolder

        path = self.root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            fd = runfolder.create_new(path)
        except FileExistsError:
            return None
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        return hashlib.sha256(data).hexdigest()

    def replace(self, name: str, data: bytes, version: str) -> str | None:
        # Folders keep their own lock (trainers/run/lock.py, O_EXCL and rename); this compare is for tests and tools.
        found = self.read_versioned(name)
        if found is None or found[1] != version:
            return None
        self.write(name, data)
        return hashlib.sha256(data).hexdigest()

    def upload(self, local: Path, name: str, sha256: str | None = None) -> None:
        self.write(name, Path(local).read_bytes())

    def download(self, name: str, local: Path) -> None:
        data = self.read(name)
        if data is None:
            raise FileNotFoundError(self.root / name)
        Path(local).write_bytes(data)

    def listing(self, prefix: str = "") -> dict[str, int]:
        base = self.root / prefix
        if not base.is_dir():
            return {prefix: base.stat().st_size} if base.is_file() else {}
        return {str(p.relative_to(self.root)): p.stat().st_size for p in base.rglob("*")
                if p.is_file() and not p.is_symlink()}

    def folders(self, prefix: str = "") -> list[str]:
        base = self.root / prefix
        return sorted(p.name for p in base.iterdir() if p.is_dir() and not p.is_symlink()) if base.is_dir() else []

    def delete(self, name: str) -> None:
        import shutil

        path = self.root / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)

    def copy(self, src: str, dst: str) -> None:
        import shutil

        s, d = self.root / src, self.root / dst
        d.parent.mkdir(parents=True, exist_ok=True)
        shutil.copytree(s, d) if s.is_dir() else shutil.copyfile(s, d)

    def modified(self, name: str) -> float | None:
        try:
            return os.lstat(self.root / name).st_mtime
        except FileNotFoundError:
            return None

    def now(self) -> float:
        return time.time()


def open_store(where: str | Path) -> Store:
    """The store of a run folder's parent or of a run: a Location's bucket, else the folder."""
    loc = location_of(str(where))
    return ObjectStore(loc) if loc is not None else FolderStore(Path(where))


def with_backoff(fn: Callable[[], Any], attempts: int = 4, first_wait_s: float = 0.5):
    """`fn`, retried on OSError with exponential backoff; the last failure is raised."""
    wait = first_wait_s
    for attempt in range(attempts):
        try:
            return fn()
        except OSError:
            if attempt == attempts - 1:
                raise
            time.sleep(wait)
            wait *= 2
