"""A Prefect API that does not answer costs a bounded wait (review D7, D8): an API that accepts
connections and never answers (``hung_api``: what is sent waits in the kernel's buffer) and a
port nobody listens on (``closed_api``).

- a process that sent checkpoint events exits at most ``_DRAIN_SECONDS`` (10 s) after its work,
  a script and ``caffe2ckpt gc --yes`` alike (real subprocesses); the command prints its result
  before it waits;
- a ``prefect-block://`` reference is refused with an InvalidLocationError naming the reference
  and the API (exit 2 on the command line) within ``PREFECT_API_REQUEST_TIMEOUT`` (at most
  15 s): the closed port at once, the hung API at the bound (set to 1 s here).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from prefect.settings import PREFECT_API_REQUEST_TIMEOUT, PREFECT_API_URL, temporary_settings

from caffe2ckpt import StepCheckpointManager
from caffe2ckpt.cli import main
from caffe2ckpt.prefect.blocks import _LOAD_SECONDS
from caffe2ckpt.prefect.events import _DRAIN_SECONDS

SLACK = 5.0  # for the interpreter's exit on a busy machine
SAVES = """
import sys
import numpy as np
import caffe2ckpt.prefect
from caffe2ckpt import StepCheckpointManager
with StepCheckpointManager(sys.argv[1], handle_preemption=False) as mgr:
    for step in range(3):
        mgr.save(step, {"n0": {"w": np.arange(4.0)}})
print("saved", flush=True)
"""


@pytest.fixture(scope="module")
def hung_api():
    """The URL of an API on 127.0.0.1 that accepts every connection and never answers."""
    server = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []

    def accept() -> None:
        while True:
            try:
                held.append(server.accept()[0])
            except OSError:  # closed: the module's tests are done
                return

    threading.Thread(target=accept, name="hung-api", daemon=True).start()
    yield f"http://127.0.0.1:{server.getsockname()[1]}/api"
    server.shutdown(socket.SHUT_RDWR)
    server.close()
    for conn in held:
        conn.close()


@pytest.fixture(scope="module")
def closed_api():
    """The URL of a port on 127.0.0.1 that refuses connections (bound, so no one else takes it,
    and not listening)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield f"http://127.0.0.1:{sock.getsockname()[1]}/api"


@dataclass
class Timed:
    printed: float  # seconds from start to the first line on stdout
    exited: float  # seconds from start to exit
    returncode: int
    stdout: str
    stderr: str


def _timed(args: list[str], api: str, cwd: Path, timeout: float = 60.0) -> Timed:
    """Run ``args`` in ``cwd`` with ``PREFECT_API_URL=api``; when it printed and exited."""
    env = {**os.environ, "PREFECT_API_URL": api}
    start = time.monotonic()
    with (subprocess.Popen(args, env=env, cwd=cwd, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True) as proc,
          ThreadPoolExecutor(1) as reader):
        err = reader.submit(proc.stderr.read)
        first = proc.stdout.readline()
        printed = time.monotonic() - start
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            pytest.fail(f"{args[1:]} with the API at {api} was still running {timeout:g} s "
                        f"after it printed {first!r}")
        exited = time.monotonic() - start
        return Timed(printed, exited, proc.returncode, first + proc.stdout.read(), err.result())


def _saved(prefix: str) -> str:
    with StepCheckpointManager(prefix, handle_preemption=False) as mgr:
        for step in range(3):
            mgr.save(step, {"n0": {"w": np.arange(4.0)}})
    return prefix


def test_a_process_that_sent_events_exits_within_the_bound(hung_api, closed_api, tmp_path):
    """A script's saves and ``caffe2ckpt gc --yes``, each against both APIs: four processes at
    once (each mostly waits), in ``tmp_path`` (so the package is the installed one)."""
    commands = {
        "script": lambda name: [sys.executable, "-c", SAVES, str(tmp_path / name)],
        "gc": lambda name: [sys.executable, "-m", "caffe2ckpt.cli", "gc",
                            _saved(str(tmp_path / name)), "--keep-last", "1", "--yes"]}
    with ThreadPoolExecutor(4) as pool:
        started = {(kind, api): pool.submit(_timed, make(f"{kind}-{api}"), url, tmp_path)
                   for kind, make in commands.items()
                   for api, url in (("hung", hung_api), ("closed", closed_api))}
        runs = {key: run.result() for key, run in started.items()}
    for key, run in runs.items():
        assert run.returncode == 0, (key, run.stderr)
        assert run.exited - run.printed < _DRAIN_SECONDS + SLACK, (key, run)
        assert (run.stdout == "saved\n" if key[0] == "script"
                else "Removed 2 epochs" in run.stdout), (key, run.stdout)
    # the hung API holds the events for the whole bound: gc printed before that wait, and the
    # events dropped are told, naming the API
    assert runs["gc", "hung"].exited - runs["gc", "hung"].printed > _DRAIN_SECONDS / 2
    for kind in commands:
        assert (f"Prefect events not sent within 10 s were dropped: is the Prefect API at "
                f"{hung_api} up?") in runs[kind, "hung"].stderr, runs[kind, "hung"].stderr


def test_a_block_reference_with_a_closed_port_is_refused_naming_it(closed_api, capsys):
    reference = "prefect-block://checkpoint-storage/nightly"
    start = time.monotonic()
    with temporary_settings({PREFECT_API_URL: closed_api}):
        code = main(["ls", reference])
    elapsed = time.monotonic() - start
    err = capsys.readouterr().err
    assert code == 2, err
    assert (f"caffe2ckpt ls: error: cannot load block checkpoint-storage/nightly ({reference}) "
            f"from the Prefect API at {closed_api}: ConnectError: ") in err
    assert elapsed < _LOAD_SECONDS


def test_a_block_reference_with_a_hung_api_is_refused_in_time(hung_api, capsys):
    reference = "prefect-block://checkpoint-storage/nightly"
    start = time.monotonic()
    with temporary_settings({PREFECT_API_URL: hung_api, PREFECT_API_REQUEST_TIMEOUT: 1.0}):
        code = main(["ls", reference])
    elapsed = time.monotonic() - start
    err = capsys.readouterr().err
    assert code == 2, err
    assert (f"cannot load block checkpoint-storage/nightly ({reference}) from the Prefect API "
            f"at {hung_api}: no answer within 1 s (PREFECT_API_REQUEST_TIMEOUT, at most 15 s)"
            ) in err
    assert elapsed < 1.0 + SLACK
