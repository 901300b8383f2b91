"""TcpGate: a TCP forwarder on 127.0.0.1 in front of a server that a test can close (a storage
outage: new connections are accepted and closed at once, open ones are cut) and open again."""

from __future__ import annotations

import contextlib
import socket
import threading

__all__ = ["TcpGate"]


class TcpGate:
    """Forwards connections to ``upstream`` (host, port) while :attr:`open`."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self.open = True
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            conn, _ = self._listener.accept()
            if not self.open:
                conn.close()
                continue
            upstream = socket.create_connection(self.upstream)
            for a, b in ((conn, upstream), (upstream, conn)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    def _pipe(self, source: socket.socket, sink: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while self.open and (data := source.recv(65536)):
                sink.sendall(data)
        for s in (source, sink):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
