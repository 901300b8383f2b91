"""A temporary local Prefect server that cannot outlive the process that started it.

Without ``PREFECT_API_URL``, Prefect starts a temporary server (a uvicorn subprocess) on first
use and stops it at interpreter exit. A process killed with SIGKILL never reaches that exit, and
the server runs on by itself. :func:`temporary_server` starts Prefect's own temporary server
(the same one Prefect would start, so flows behave exactly as without it) and hands each server
process it spawns to a small reaper (``caffe2ckpt/prefect/_reaper.py``, run as a script). The
reaper reads process ids, the server's API URL and this process's ``<host>:<pid>`` from a pipe
whose only writer is this process: when the pipe closes without a ``release`` line (this process
ended, however it ended) it marks the flow runs this process left unfinished *Crashed* (their
end time is the time of death) and stops those processes.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import httpx
from prefect.settings import PREFECT_API_URL

from caffe2ckpt.prefect.orphans import NOT_FINAL, process_id

__all__ = ["temporary_server"]

logger = logging.getLogger(__name__)

_NOT_FINAL = sorted(t.value for t in NOT_FINAL)


@functools.cache
def _guarded_server() -> type:
    """Prefect's temporary server class, each of whose processes is registered with the reaper.

    It shares Prefect's instance registry, so once started it *is* the server Prefect's
    clients use when no API URL is set. (Made on first use: Prefect's server modules take
    about two seconds to import, which a flow run on a real server never needs.)
    """
    from prefect.server.api.server import SubprocessASGIServer

    class GuardedServer(SubprocessASGIServer):
        reaper: IO[str] | None = None

        def _run_uvicorn_command(self) -> subprocess.Popen[Any]:
            proc = super()._run_uvicorn_command()
            if self.reaper is not None:
                self.reaper.write(f"{proc.pid}\n")
                self.reaper.flush()
            return proc

    return GuardedServer


def _temporary_server_running() -> bool:
    """Whether Prefect's temporary server already runs in this process (never imports the
    server modules to find out: they are imported once one was started)."""
    server = sys.modules.get("prefect.server.api.server")
    return server is not None and None in server.SubprocessASGIServer._instances


def _drain_senders(timeout: float = 30.0) -> None:
    """Send the logs and events still queued in this process while the server is up (at
    interpreter exit, after the server stopped, each would wait out its connection retries)."""
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    for worker in (APILogWorker, EventsWorker):
        worker.drain_all(timeout=timeout, at_exit=False)


def _wait_until_recorded(api_url: str, timeout: float = 30.0, still: float = 3.0) -> None:
    """Wait for the server to record the task-run events it has received. Its task-run recorder
    writes them one by one and lags behind a fast flow; stopping the server in the middle logs
    an ERROR traceback per event cut off ("Error flushing 1 events") and leaves those task runs
    unfinished in the UI. Done when no task run is left unfinished and their number is steady,
    or when nothing changed for ``still`` seconds (a run interrupted with its task runs
    unfinished), or after ``timeout`` seconds."""
    def counts() -> tuple[int, int]:
        total = client.post("/task_runs/count", json={})
        pending = client.post("/task_runs/count", json={
            "task_runs": {"state": {"type": {"any_": _NOT_FINAL}}}})
        total.raise_for_status()
        pending.raise_for_status()
        return int(total.json()), int(pending.json())

    start = time.monotonic()
    with httpx.Client(base_url=api_url, timeout=10) as client:
        try:
            seen, since = counts(), time.monotonic()
            while time.monotonic() - start < timeout:
                time.sleep(0.5)
                now = counts()
                if now != seen:
                    seen, since = now, time.monotonic()
                elif now[1] == 0 or time.monotonic() - since >= still:
                    return
        except httpx.HTTPError as exc:  # the server is going anyway; say why we stopped early
            logger.debug("could not ask the temporary server about its task runs: %r", exc)
            return
    logger.debug("the temporary server still records task runs after %.0f s", timeout)


def _tell(reaper: IO[str], *lines: str) -> None:
    """What the reaper needs to mark this process's flow runs Crashed if it dies: the server's
    API URL and the ``infrastructure_pid`` :func:`run_job` gives them."""
    reaper.write("".join(f"{line}\n" for line in lines))
    reaper.flush()


@contextlib.contextmanager
def temporary_server(timeout: int | None = None) -> Iterator[str | None]:
    """Run the block on Prefect's temporary local server, stopped even if this process is killed.

    Yields ``None`` and does nothing when ``PREFECT_API_URL`` is set (a real server), or when
    Prefect's temporary server is already running in this process. Otherwise yields the server's
    API URL; the server stops when the block ends, or when this process dies (after marking the
    flow runs this process left unfinished *Crashed*, see ``_reaper.py``).
    """
    if PREFECT_API_URL.value() or _temporary_server_running():
        yield None
        return
    # run by path, isolated: it needs only the standard library, not caffe2ckpt or prefect
    reaper = subprocess.Popen(
        [sys.executable, "-I", "-S", str(Path(__file__).with_name("_reaper.py"))],
        stdin=subprocess.PIPE, text=True)
    assert reaper.stdin is not None
    server = _guarded_server()()
    server.reaper = reaper.stdin
    try:
        server.start(timeout=timeout)
        _tell(reaper.stdin, f"api {server.api_url}", f"owner {process_id()}")
        yield server.api_url
    finally:
        _drain_senders()
        _wait_until_recorded(server.api_url)
        server.stop()
        with contextlib.suppress(BrokenPipeError):
            reaper.stdin.write("release\n")
            reaper.stdin.close()
        reaper.wait(timeout=30)
