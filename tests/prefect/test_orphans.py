"""``kill -9`` of ``python flows/regression.py``: its temporary Prefect server goes with it,
silently, and the next run of the flow marks the killed run and its unfinished task runs
*Crashed* (they would show *Running* or *Pending* forever). That next run, a successful one of
100 epochs, logs no error (no telemetry, database-lock or flush errors) and leaves every one of
its task runs recorded as finished."""

from __future__ import annotations

import os
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from caffe2ckpt.fs.location import Location
from caffe2ckpt.store.records import list_records
from tests.procs import stop_tree

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
SECOND_EPOCHS = 100


def start(tmp_path: Path, ckpt: Path, epochs: int, log: str) -> subprocess.Popen:
    # as a user's shell: no API URL, and no analytics switch (caffe2ckpt.prefect sets the default)
    env = {k: v for k, v in os.environ.items()
           if k not in ("PREFECT_API_URL", "PREFECT_SERVER_ANALYTICS_ENABLED", "DO_NOT_TRACK")}
    env["PREFECT_HOME"] = str(tmp_path / "home")  # one home, as for a user's two runs
    with open(tmp_path / log, "wb") as out:
        return subprocess.Popen([sys.executable, str(REPO / "flows/regression.py"),
                                 "--checkpoint-url", str(ckpt), "--epochs", str(epochs)],
                                env=env, cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)


def until(check, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if result := check():
            return result
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def runs(tmp_path: Path) -> dict[str, tuple[str, str]]:
    """flow run infrastructure_pid -> (state type, state message), from the server's database."""
    with sqlite3.connect(tmp_path / "home" / "prefect.db") as db:
        rows = db.execute("SELECT r.infrastructure_pid, r.state_type, s.message FROM flow_run r "
                          "JOIN flow_run_state s ON s.id = r.state_id").fetchall()
    return {pid: (state, message) for pid, state, message in rows}


def task_run_states(tmp_path: Path, infrastructure_pid: str) -> dict[str, int]:
    """{state type: number of task runs} of the flow run with that infrastructure_pid."""
    with sqlite3.connect(tmp_path / "home" / "prefect.db") as db:
        rows = db.execute("SELECT t.state_type, count(*) FROM task_run t JOIN flow_run r ON "
                          "t.flow_run_id = r.id WHERE r.infrastructure_pid = ? GROUP BY "
                          "t.state_type", (infrastructure_pid,)).fetchall()
    return dict(rows)


def test_kill_9_stops_the_temporary_server_and_the_next_run_marks_the_run_crashed(tmp_path):
    ckpt = tmp_path / "ckpt"
    first = start(tmp_path, ckpt, 1000, "first.log")
    try:
        until(lambda: len(list_records(Location(str(ckpt)))) >= 2 * 2, 180, "epoch 1 committed")
        servers = [p for p in psutil.Process(first.pid).children()
                   if "uvicorn" in " ".join(p.cmdline())]
        assert len(servers) == 1, [p.cmdline() for p in psutil.Process(first.pid).children()]
        os.kill(first.pid, signal.SIGKILL)
        first.wait(timeout=10)
        at_kill = (tmp_path / "first.log").stat().st_size
        gone, alive = psutil.wait_procs(servers, timeout=30)
        assert not alive, f"the temporary server {servers[0].pid} outlived its killed parent"
    finally:
        stop_tree(first)
    # the dying server writes to the user's terminal: nothing, once its parent is gone
    after_kill = (tmp_path / "first.log").read_bytes()[at_kill:].decode(errors="replace")
    assert after_kill == "", after_kill
    killed = f"{socket.gethostname()}:{first.pid}"
    assert runs(tmp_path)[killed][0] == "RUNNING"  # what the UI showed, forever
    unfinished = sum(n for state, n in task_run_states(tmp_path, killed).items()
                     if state not in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED"))

    # enough epochs that the server's task-run recorder lags behind the flow at its end
    second = start(tmp_path, tmp_path / "other", SECOND_EPOCHS, "second.log")
    try:
        assert second.wait(timeout=180) == 0, (tmp_path / "second.log").read_text()
    finally:
        stop_tree(second)
    log = (tmp_path / "second.log").read_text()
    state, message = runs(tmp_path)[killed]
    assert state == "CRASHED" and killed in message, (state, message)
    # its task runs that never finished (submitted or running at the kill) are Crashed too
    left = task_run_states(tmp_path, killed)
    assert set(left) <= {"COMPLETED", "CRASHED"}, left
    assert left.get("CRASHED", 0) == unfinished, (left, unfinished)
    assert f"left Running by process {killed}, which is gone" in log
    assert "ERROR" not in log and "Traceback" not in log and "Error" not in log, log
    assert runs(tmp_path)[f"{socket.gethostname()}:{second.pid}"][0] == "COMPLETED"
    # every task run of the second run was recorded, and recorded finished, before its
    # temporary server stopped: init, checkpoint_init, each save and each epoch, per node, and
    # each epoch's parent task run ("epoch 0" to "epoch N")
    assert task_run_states(tmp_path, f"{socket.gethostname()}:{second.pid}") == {
        "COMPLETED": 2 * (2 + (SECOND_EPOCHS + 1) + SECOND_EPOCHS) + SECOND_EPOCHS + 1}
