"""A real S3-compatible server on localhost for tests: `moto_server` (pip install "moto[server]") as a subprocess.

    with s3_server(Path("/tmp/s3")) as s3:
        uri = s3.upload(local_folder, "bucket", "tab")          # -> "s3://bucket/tab"
        subprocess.run([...], env=s3.child_env())                # pyarrow's FileSystem.from_uri("s3://bucket/...")
                                                                 # in the child reaches this server

How a child process finds the server: the AWS SDK inside pyarrow (checked with pyarrow 25) honours the
environment variable AWS_ENDPOINT_URL (and the S3-specific AWS_ENDPOINT_URL_S3, which wins when both are set),
including its http:// scheme, so plain `s3://bucket/prefix` URIs, as a Stride config names them, work unchanged.
(`s3://bucket/x?endpoint_override=127.0.0.1:PORT&scheme=http` works too, but only for that one URI: Stride
lists a folder and re-prefixes the file paths with "s3://", which drops the query string.)

The credentials are fake (moto accepts any); EC2 instance metadata is disabled, a region is set, and the
developer's own AWS config/credentials files and profile are kept out, so nothing reaches the network. The
server is one Python process (Werkzeug, threaded, no reloader): it is stopped by its pid, never by name.
Without moto installed, starting the server fails the test (it does not skip): `make test` installs it.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path

ACCESS_KEY = "testing"
SECRET_KEY = "testing"
REGION = "us-east-1"


class S3Unavailable(RuntimeError):
    """moto_server is not installed or did not answer."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def moto_server_program() -> str:
    """The moto_server script beside this interpreter (the venv's), else one on PATH."""
    beside = Path(sys.executable).parent / "moto_server"
    if beside.exists():
        return str(beside)
    found = shutil.which("moto_server")
    if found:
        return found
    raise S3Unavailable(f"moto_server is not installed for {sys.executable}: pip install 'moto[server]' "
                        f"(part of pip install -e '.[test]', which make test runs)")


class S3Server:
    """One moto_server on 127.0.0.1:<free port>, logging to <root>/moto_server.log."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.log_path = self.root / "moto_server.log"
        self.proc: subprocess.Popen | None = None
        self.port: int | None = None
        self._fs = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    # ---- lifecycle ---------------------------------------------------------------------------------------

    def start(self, timeout: float = 60, attempts: int = 3) -> "S3Server":
        program = moto_server_program()
        last = ""
        for _ in range(attempts):  # a free port can be taken between choosing it and binding it: try another
            self.port = _free_port()
            with open(self.log_path, "ab") as log:
                self.proc = subprocess.Popen([program, "-H", "127.0.0.1", "-p", str(self.port)], stdout=log,
                                             stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                             env=self._server_env(), start_new_session=True)
            deadline = time.time() + timeout
            while time.time() < deadline and self.proc.poll() is None:
                if self._answers():
                    return self
                time.sleep(0.2)
            last = self.log_path.read_text(errors="replace")[-2000:]
            self.stop()
        raise S3Unavailable(f"moto_server did not answer on 127.0.0.1 within {timeout:.0f} s; its log:\n{last}")

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

    def __enter__(self) -> "S3Server":
        return self.start() if self.proc is None else self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _answers(self) -> bool:
        # No proxy: a developer's HTTP_PROXY must not carry a request for 127.0.0.1 elsewhere.
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        try:
            with opener.open(f"{self.endpoint}/moto-api/", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def _server_env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
        env.update(AWS_ACCESS_KEY_ID=ACCESS_KEY, AWS_SECRET_ACCESS_KEY=SECRET_KEY, AWS_DEFAULT_REGION=REGION,
                   AWS_EC2_METADATA_DISABLED="true")
        return env

    # ---- clients -----------------------------------------------------------------------------------------

    def child_env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """A whole environment for a subprocess whose pyarrow should reach this server through s3:// URIs:
        `base` (default os.environ) without any AWS_* variable of its own, plus the endpoint, fake credentials,
        a region, no EC2 metadata lookups, and no shared AWS config/credentials files."""
        env = {k: v for k, v in (os.environ if base is None else base).items() if not k.startswith("AWS_")}
        missing = str(self.root / "no-such-aws-file")
        no_proxy = ",".join(x for x in (env.get("NO_PROXY") or env.get("no_proxy"), "127.0.0.1", "localhost") if x)
        env.update(self.env_vars(), AWS_CONFIG_FILE=missing, AWS_SHARED_CREDENTIALS_FILE=missing,
                   NO_PROXY=no_proxy, no_proxy=no_proxy)
        return env

    def env_vars(self) -> dict[str, str]:
        """Just the AWS_* variables that point pyarrow (the AWS SDK) at this server."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ENDPOINT_URL_S3": self.endpoint,
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_DEFAULT_REGION": REGION,
            "AWS_REGION": REGION,
            "AWS_EC2_METADATA_DISABLED": "true",
        }

    def filesystem(self):
        """A pyarrow S3FileSystem on this server (for this process; explicit settings, no environment needed)."""
        if self._fs is None:
            # The AWS SDK reads this once, when pyarrow first initialises S3; it must never try instance metadata.
            os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")
            from pyarrow import fs as pafs

            self._fs = pafs.S3FileSystem(endpoint_override=f"127.0.0.1:{self.port}", scheme="http",
                                         access_key=ACCESS_KEY, secret_key=SECRET_KEY, region=REGION,
                                         allow_bucket_creation=True, connect_timeout=5, request_timeout=30)
        return self._fs

    def create_bucket(self, bucket: str) -> None:
        self.filesystem().create_dir(bucket)

    def upload(self, local: Path | str, bucket: str, prefix: str = "") -> str:
        """Copy the folder `local` (recursively) to s3://<bucket>/<prefix>, creating the bucket; returns that URI."""
        from pyarrow import fs as pafs

        local = Path(local).resolve()
        if not local.is_dir():
            raise FileNotFoundError(f"{local} is not a folder")
        self.create_bucket(bucket)
        dest = f"{bucket}/{prefix.strip('/')}".rstrip("/")
        pafs.copy_files(str(local), dest, source_filesystem=pafs.LocalFileSystem(),
                        destination_filesystem=self.filesystem())
        return f"s3://{dest}"

    def new_bucket(self) -> str:
        """A bucket of its own for one test (a random name), created."""
        import uuid

        name = f"b-{uuid.uuid4().hex[:12]}"
        self.create_bucket(name)
        return name

    def objects(self, uri: str) -> list[str]:
        """The object names under an s3:// URI, relative to it, sorted."""
        base = uri.removeprefix("s3://").rstrip("/") + "/"
        return [p[len(base):] for p in self.list(uri)]

    def read(self, uri: str) -> bytes:
        """One object's bytes (FileNotFoundError when there is none)."""
        with self.filesystem().open_input_stream(uri.removeprefix("s3://")) as f:
            return f.read()

    def list(self, uri: str) -> list[str]:
        """Every object under an s3:// URI (paths as bucket/key), sorted."""
        from pyarrow import fs as pafs

        path = uri.removeprefix("s3://").rstrip("/")
        infos = self.filesystem().get_file_info(pafs.FileSelector(path, recursive=True, allow_not_found=True))
        return sorted(i.path for i in infos if i.type == pafs.FileType.File)


def node_identity() -> dict[str, str]:
    """What a cluster node of the tests has as its own identity for the S3 server (moto takes any key): the keys in
    the node's own environment, as a real node has an instance profile. The driver forwards the endpoint to the
    workers, never its keys (ray_cluster/connect.py storage_env)."""
    return {"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY, "AWS_DEFAULT_REGION": REGION,
            "AWS_EC2_METADATA_DISABLED": "true"}


@contextmanager
def environment(extra: dict[str, str]):
    """os.environ with `extra` for the `with` block (a node started inside inherits it), then as before."""
    saved = {k: os.environ.get(k) for k in extra}
    os.environ.update(extra)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextmanager
def s3_server(root: Path):
    """A started S3Server for the `with` block; stopped (by pid) after it."""
    server = S3Server(root).start()
    try:
        yield server
    finally:
        server.stop()


def s3_server_fixture(scope: str = "session"):
    """A pytest fixture `s3_server` (import it into a test module or conftest.py). It fails, never skips, when
    moto_server is missing or does not start: the test extra installs it."""
    import pytest

    @pytest.fixture(scope=scope)
    def s3_server(tmp_path_factory):
        server = S3Server(Path(tmp_path_factory.mktemp("s3")))
        try:
            server.start()
            problem = None
        except S3Unavailable as e:
            problem = str(e)
        if problem:
            pytest.fail(problem, pytrace=False)
        yield server
        server.stop()

    return s3_server


if __name__ == "__main__":  # a server for trying things by hand: prints the environment to use, Ctrl-C stops it
    import signal
    import tempfile

    with s3_server(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.mkdtemp(prefix="s3-"))) as s3:
        for k, v in s3.env_vars().items():
            print(f"export {k}={v}")
        print(f"# moto_server pid {s3.pid}, log {s3.log_path}; Ctrl-C stops it", flush=True)
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        try:
            signal.pause()
        except (KeyboardInterrupt, SystemExit):
            pass
