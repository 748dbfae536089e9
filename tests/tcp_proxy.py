"""A TCP proxy on 127.0.0.1 in front of a test server, which a test (or a process it started) can cut off: while the
file `switch` exists, new connections are reset at once and open ones are cut. The storage server behind it keeps its
state, as a real outage keeps the bucket's; the client sees what it would see of a server gone from the network
(connection refused or reset). Threads of this process only; stopped by close()."""

from __future__ import annotations

import socket
import struct
import threading
from pathlib import Path


class CuttableProxy:
    def __init__(self, target_port: int, switch: Path):
        self.target, self.switch = ("127.0.0.1", target_port), Path(switch)
        self.listener = socket.socket()
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(64)
        self.port = self.listener.getsockname()[1]
        self._open: set[socket.socket] = set()
        self.bytes_down = 0  # bytes the server sent to clients (what a client downloaded), since start
        self._lock = threading.Lock()
        self._closed = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()
        threading.Thread(target=self._watch, daemon=True).start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def cut(self) -> bool:
        return self.switch.exists()

    def close(self) -> None:
        self._closed.set()
        self.listener.close()
        self._reset_all()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            if self.cut():
                _reset(client)
                continue
            try:
                upstream = socket.create_connection(self.target, timeout=10)
            except OSError:
                _reset(client)
                continue
            with self._lock:
                self._open.update((client, upstream))
            for a, b, down in ((client, upstream, False), (upstream, client, True)):
                threading.Thread(target=self._pipe, args=(a, b, down), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, down: bool) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
                if down:
                    with self._lock:
                        self.bytes_down += len(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with self._lock:
                    self._open.discard(s)
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                s.close()

    def _watch(self) -> None:
        while not self._closed.wait(0.05):
            if self.cut():
                self._reset_all()

    def _reset_all(self) -> None:
        with self._lock:
            open_now, self._open = list(self._open), set()
        for s in open_now:
            _reset(s)


def _reset(s: socket.socket) -> None:
    """Close with RST, as a vanished server's host answers."""
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    s.close()
