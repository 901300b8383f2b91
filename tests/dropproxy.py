"""DropProxy: an HTTP/1.1 proxy on 127.0.0.1 in front of an S3 server that lets a chosen request
land and loses its answer, so the client's own retry runs (s3fs/botocore see a dropped
connection, retry, and get the store's answer to the retry).

A test points the client at :attr:`DropProxy.endpoint` (``endpoint_url``) and arms a rule:
``proxy.drop("PUT", r"/_commits/000000000003\\.")`` matches requests by method and a regex
searched in the request's path (URL-decoded, without the query); on its ``nth`` match the
request is forwarded to the server, the server's whole answer is read, and the client's
connection is closed without a byte of it (or, with ``sent``, part way through it). Every
other request and answer passes through unchanged, byte for byte (request signatures stay valid: the ``Host`` header is kept).

HTTP handled: persistent connections (one upstream connection per client connection, opened
again when the server closes it), bodies with ``Content-Length`` or ``Transfer-Encoding:
chunked`` (trailers included) in both directions, answers without a body (to ``HEAD``, 1xx,
204, 304) and answers that end when the server closes. ``Expect: 100-continue`` is answered by
the proxy itself (the header is not signed by SigV4) and not sent on. One thread per client
connection; :meth:`DropProxy.close` closes every socket and joins the threads.
"""

from __future__ import annotations

import re
import socket
import threading
import urllib.parse
from dataclasses import dataclass, field

__all__ = ["DropProxy", "Rule"]

_MAX_LINE = 65536


@dataclass
class Rule:
    """Drop the answer to the ``nth`` request whose method is ``method`` and whose path
    matches ``path`` (``re.search``)."""

    method: str
    path: str
    nth: int = 1
    sent: float = 0.0  # the share of the answer's bytes sent before the connection is closed
    matched: int = 0
    dropped: list[str] = field(default_factory=list)  # "PUT /b/k -> 200" of each drop

    def fires(self, method: str, path: str) -> bool:
        if method != self.method or not re.search(self.path, path):
            return False
        self.matched += 1
        return self.matched == self.nth


class _Closed(Exception):
    """The peer closed the connection between messages."""


def _read_head(f) -> bytes:
    """A message's start line and headers, up to the blank line."""
    lines: list[bytes] = []
    while True:
        line = f.readline(_MAX_LINE)
        if not line:
            if lines:
                raise ConnectionError("connection closed inside a message's headers")
            raise _Closed
        lines.append(line)
        if line in (b"\r\n", b"\n"):
            return b"".join(lines)


def _headers(head: bytes) -> dict[str, str]:
    out = {}
    for line in head.split(b"\r\n")[1:]:
        name, sep, value = line.decode("latin-1").partition(":")
        if sep:
            out[name.strip().lower()] = value.strip()
    return out


def _read_chunked(f) -> bytes:
    """A chunked body as it came (sizes, chunks, the last chunk and trailers)."""
    out = []
    while True:
        size_line = f.readline(_MAX_LINE)
        out.append(size_line)
        size = int(size_line.split(b";")[0].strip() or b"0", 16)
        if size == 0:
            while True:
                line = f.readline(_MAX_LINE)
                out.append(line)
                if line in (b"\r\n", b"\n", b""):
                    return b"".join(out)
        out.append(_read_exactly(f, size + 2))


def _read_exactly(f, n: int) -> bytes:
    data = f.read(n)
    if len(data) != n:
        raise ConnectionError(f"connection closed after {len(data)} of {n} body bytes")
    return data


def _read_body(f, headers: dict[str, str], *, until_close: bool) -> bytes:
    if "chunked" in headers.get("transfer-encoding", "").lower():
        return _read_chunked(f)
    if "content-length" in headers:
        return _read_exactly(f, int(headers["content-length"]))
    return f.read() if until_close else b""


class _Upstream:
    """One connection to the server, reopened when the server closed it."""

    def __init__(self, address: tuple[str, int]) -> None:
        self.address = address
        self.sock: socket.socket | None = None
        self.file = None

    def exchange(self, request: bytes, method: str) -> tuple[bytes, bool]:
        """Send ``request``; return the whole answer and whether the server keeps the
        connection. A connection the server closed while idle is reopened once."""
        for attempt in (0, 1):
            if self.sock is None:
                self.sock = socket.create_connection(self.address, timeout=120)
                self.file = self.sock.makefile("rb")
            try:
                self.sock.sendall(request)
                head = _read_head(self.file)
                break
            except (_Closed, ConnectionError, OSError):
                self.close()
                if attempt:
                    raise
        headers = _headers(head)
        status = int(head.split(b" ", 2)[1])
        no_body = method == "HEAD" or status in (204, 304) or 100 <= status < 200
        until_close = "content-length" not in headers and "chunked" not in headers.get(
            "transfer-encoding", "").lower()
        body = b"" if no_body else _read_body(self.file, headers, until_close=until_close)
        keep = headers.get("connection", "").lower() != "close" and (no_body or not until_close)
        if not keep:
            self.close()
        return head + body, keep

    def close(self) -> None:
        if self.sock is not None:
            self.file.close()
            self.sock.close()
            self.sock = self.file = None


class DropProxy:
    """See the module docstring. ``upstream``: the server's ``http://host:port``."""

    def __init__(self, upstream: str) -> None:
        parsed = urllib.parse.urlsplit(upstream)
        self.upstream = (parsed.hostname, parsed.port)
        self._rules: list[Rule] = []
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        self._clients: set[socket.socket] = set()
        self._threads: list[threading.Thread] = []
        self._closed = False
        self.requests = 0
        self._accepter = threading.Thread(target=self._accept, name="dropproxy", daemon=True)
        self._accepter.start()

    def drop(self, method: str, path: str, nth: int = 1, *, sent: float = 0.0) -> Rule:
        """Arm a rule (see :class:`Rule`): its answer is lost, or with ``sent`` cut after that
        share of its bytes (headers included); returns it, to see what it dropped."""
        rule = Rule(method, path, nth, sent)
        with self._lock:
            self._rules.append(rule)
        return rule

    def close(self) -> None:
        self._closed = True
        _shut(self._listener)  # wakes the accepting thread (a close alone does not)
        with self._lock:
            clients = list(self._clients)
        for sock in clients:
            _shut(sock)
        for thread in [self._accepter, *self._threads]:
            thread.join(30)

    def __enter__(self) -> DropProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return
            with self._lock:
                self._clients.add(sock)
                thread = threading.Thread(target=self._serve, args=(sock,), daemon=True,
                                          name="dropproxy-client")
                self._threads.append(thread)
            thread.start()

    def _serve(self, client: socket.socket) -> None:
        upstream = _Upstream(self.upstream)
        f = client.makefile("rb")
        try:
            while self._relay_one(client, f, upstream):
                pass
        except (_Closed, ConnectionError, OSError):
            pass
        finally:
            upstream.close()
            f.close()
            _shut(client)
            with self._lock:
                self._clients.discard(client)

    def _relay_one(self, client: socket.socket, f, upstream: _Upstream) -> bool:
        """Relay one request and its answer (or drop the answer); whether to go on."""
        head = _read_head(f)
        method, target = head.split(b" ", 2)[:2]
        method, target = method.decode(), target.decode("latin-1")
        headers = _headers(head)
        if headers.get("expect", "").lower() == "100-continue":
            head = re.sub(rb"(?im)^expect:[^\r\n]*\r?\n", b"", head)
            client.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
        request = head + _read_body(f, headers, until_close=False)
        answer, keep = upstream.exchange(request, method)
        path = urllib.parse.unquote(urllib.parse.urlsplit(target).path)
        with self._lock:
            self.requests += 1
            fired = [r for r in self._rules if r.fires(method, path)]  # each rule counts
        for rule in fired:
            rule.dropped.append(f"{method} {path} -> {answer.split(b' ', 2)[1].decode()}")
        if fired:  # closed without (all of) its answer: the request was applied
            client.sendall(answer[:int(len(answer) * max(r.sent for r in fired))])
            return False
        client.sendall(answer)
        return keep and headers.get("connection", "").lower() != "close"


def _shut(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()
