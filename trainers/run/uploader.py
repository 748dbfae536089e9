"""A checkpoint's shards go to the bucket from a child process at the lowest CPU priority (nice 19).

The upload of a shard is CPU work: its sha256 (meta.json records it), the request's signature and checksums, and the
client's event loop. Done by a thread of the training process, that work took the CPU and the GIL from the steps
running meanwhile (bucket_step_time_ratio 1.02-1.03 on 2 CPUs, benchmarks/bucket_bench.py); a thread cannot be given
a lower priority without holding the GIL while descheduled. A child process at nice 19 shares no GIL, and the kernel
gives it only the CPU time training leaves idle. What it costs: its imports once per rank (~0.5 s of CPU, at nice 19),
and an upload that waits longer when every CPU is busy.

One child per RunRemote, started at its first upload, and ended when the parent closes its end of the pipe, exits or
is killed (its stdin reaches EOF). One JSON line each way per file; the child's errors come back as OSError, which
the checkpoint writer retries with backoff as before. The child reaches the bucket as the parent does: the same
environment, so the same credentials chain and endpoint.

    python -m stride.trainers.run.uploader s3://bucket/prefix/run   # reads {"path", "name"} lines on stdin
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

NICE = 19


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


class Uploader:
    """Files of this node to the store at `location` (a URI string), from the child process."""

    def __init__(self, location: str):
        self.location = location
        self._proc: subprocess.Popen | None = None
        self._lock = threading.Lock()

    def upload(self, local: Path, name: str) -> dict:
        """`local` to the store's `name`; returns {"bytes", "sha256"} of what was sent. OSError when it failed."""
        with self._lock:
            proc = self._child()
            try:
                proc.stdin.write(json.dumps({"path": str(local), "name": name}) + "\n")
                proc.stdin.flush()
                line = proc.stdout.readline()
            except OSError as e:
                self._end()
                raise OSError(f"the upload process stopped ({e})") from None
            if not line:
                self._end()
                raise OSError("the upload process stopped")
        reply = json.loads(line)
        if not reply.get("ok"):
            raise OSError(reply.get("error") or "upload failed")
        return {"bytes": reply["bytes"], "sha256": reply["sha256"]}

    def close(self) -> None:
        with self._lock:
            self._end()

    def _child(self) -> subprocess.Popen:
        if self._proc is None or self._proc.poll() is not None:
            # The parent's own import path: Stride is found as it was here (installed, or a job's working folder).
            env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
            self._proc = subprocess.Popen([sys.executable, "-m", "stride.trainers.run.uploader", self.location],
                                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        return self._proc

    def _end(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        for stream in (proc.stdin, proc.stdout):
            try:
                stream.close()
            except OSError:
                pass
        try:
            proc.wait(timeout=30)  # EOF ends it after the file in hand
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def serve(location: str, requests, replies) -> None:
    """Upload each requested file; one reply line per request line, until `requests` ends."""
    from stride.trainers.run.storage import ObjectStore, location_of

    store = ObjectStore(location_of(location))
    for line in requests:
        request = json.loads(line)
        path = Path(request["path"])
        try:
            reply = {"ok": True, "bytes": path.stat().st_size, "sha256": sha256_of(path)}
            store.upload(path, request["name"])
        except Exception as e:  # noqa: BLE001 - any failure is this file's, retried by the parent; the child goes on
            reply = {"ok": False, "error": (str(e).splitlines() or [type(e).__name__])[0]}
        replies.write(json.dumps(reply) + "\n")
        replies.flush()


def main(argv: list[str]) -> int:
    os.nice(NICE)
    serve(argv[0], sys.stdin, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
