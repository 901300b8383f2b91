"""``kill -9`` of a flow on caffe2ckpt's temporary Prefect server (``python flows/regression.py``):
within seconds its flow run is *Crashed*, ending at the kill (not at the next run, which would
show a run of 12 s as 55 s), with its unfinished task runs, and named as ours even if they never
started; then the server goes too, silently. The next run of the flow, a successful one of 40
epochs, logs no error (no telemetry, database-lock or flush errors) and leaves every one of its
task runs recorded as finished."""

from __future__ import annotations

import json
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import psutil
import pytest
from prefect import flow
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId
from prefect.flow_engine import run_flow
from prefect.states import Crashed

from caffe2ckpt import MultiNodeCheckpointManager
from caffe2ckpt.example import build_job
from caffe2ckpt.fs.location import Location
from caffe2ckpt.prefect import PrefectSession, run_job
from caffe2ckpt.store.commit.protocol import CheckpointStore
from caffe2ckpt.store.format.records import list_records
from tests import prefectdb
from tests.procs import stop_tree
from tests.stores import newest_epoch

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
SECOND_EPOCHS = 40
FINAL = ("COMPLETED", "FAILED", "CRASHED", "CANCELLED")
AT_DEATH = 3.0  #: seconds: how soon after the kill a killed run must end


def start(tmp_path: Path, ckpt: Path, epochs: int, log: str) -> subprocess.Popen:
    """The example flow on a temporary server whose database starts migrated (killed_flow.py
    starts on a fresh one, as a user's first run)."""
    prefectdb.seed_home(tmp_path / "home")
    return run_script(tmp_path, log, REPO / "flows/regression.py", "--checkpoint-url", str(ckpt),
                      "--epochs", str(epochs))


def run_script(tmp_path: Path, log: str, *args) -> subprocess.Popen:
    # as a user's shell: no API URL, and no analytics switch (caffe2ckpt.prefect sets the default)
    env = {k: v for k, v in os.environ.items()
           if k not in ("PREFECT_API_URL", "PREFECT_SERVER_ANALYTICS_ENABLED", "DO_NOT_TRACK")}
    env["PREFECT_HOME"] = str(tmp_path / "home")  # one home, as for a user's two runs
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    with open(tmp_path / log, "wb") as out:
        return subprocess.Popen([sys.executable, *map(str, args)], env=env, cwd=tmp_path,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def kill_9(proc: subprocess.Popen, log: Path) -> datetime:
    """SIGKILL ``proc`` and wait until its temporary server is gone too (after its reaper marked
    the runs); the time of the kill. Nothing may reach the terminal once ``proc`` is dead."""
    servers = [p for p in psutil.Process(proc.pid).children()
               if "uvicorn" in " ".join(p.cmdline())]
    assert len(servers) == 1, [p.cmdline() for p in psutil.Process(proc.pid).children()]
    killed_at = datetime.now(UTC)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)
    at_kill = log.stat().st_size
    _gone, alive = psutil.wait_procs(servers, timeout=60)
    assert not alive, f"the temporary server {servers[0].pid} outlived its killed parent"
    # the dying server writes to the user's terminal: nothing, once its parent is gone
    after_kill = log.read_bytes()[at_kill:].decode(errors="replace")
    assert after_kill == "", after_kill
    return killed_at


def end_time(tmp_path: Path, infrastructure_pid: str) -> datetime:
    """The end time of the flow run with that infrastructure_pid (stored in UTC)."""
    with sqlite3.connect(tmp_path / "home" / "prefect.db") as db:
        (text,) = db.execute("SELECT end_time FROM flow_run WHERE infrastructure_pid = ?",
                             (infrastructure_pid,)).fetchone()
    assert text, f"flow run of {infrastructure_pid} has no end time"
    value = datetime.fromisoformat(text)
    return value if value.tzinfo else value.replace(tzinfo=UTC)


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


def task_runs(tmp_path: Path, infrastructure_pid: str) -> dict[str, str]:
    """{name: state type} of the task runs of the flow run with that infrastructure_pid."""
    with sqlite3.connect(tmp_path / "home" / "prefect.db") as db:
        rows = db.execute("SELECT t.name, t.state_type FROM task_run t JOIN flow_run r ON "
                          "t.flow_run_id = r.id WHERE r.infrastructure_pid = ?",
                          (infrastructure_pid,)).fetchall()
    return dict(rows)


def artifacts(tmp_path: Path, infrastructure_pid: str) -> dict[str, str]:
    """The progress bar's description and the summary of that flow run's artifacts."""
    with sqlite3.connect(tmp_path / "home" / "prefect.db") as db:
        rows = db.execute("SELECT a.key, a.description, a.data FROM artifact a JOIN flow_run r "
                          "ON a.flow_run_id = r.id WHERE r.infrastructure_pid = ?",
                          (infrastructure_pid,)).fetchall()
    found = {key.rpartition("-")[2]: (description, data) for key, description, data in rows}
    return {"progress": found["progress"][0], "summary": json.loads(found["summary"][1])}


def recorded(tmp_path: Path, infrastructure_pid: str) -> list[str]:
    """The states of those task runs, or none while the server creates its database."""
    try:
        return list(task_runs(tmp_path, infrastructure_pid).values())
    except sqlite3.OperationalError:  # no database, or not all its tables yet
        return []


def test_kill_9_mid_epoch_ends_the_run_and_its_task_runs_crashed_at_the_kill(tmp_path):
    log = tmp_path / "killed.log"
    proc = run_script(tmp_path, log.name, Path(__file__).with_name("killed_flow.py"))
    killed = f"{socket.gethostname()}:{proc.pid}"
    try:
        # killed once the server recorded a task run finished, one running, one never started
        until(lambda: sorted(recorded(tmp_path, killed)) == ["COMPLETED", "PENDING", "RUNNING"],
              180, "the three task runs recorded")
        killed_at = kill_9(proc, log)
    finally:
        stop_tree(proc)
    state, message = runs(tmp_path)[killed]
    assert state == "CRASHED" and f"({killed}) died" in message, (state, message)
    assert abs((end_time(tmp_path, killed) - killed_at).total_seconds()) < AT_DEATH
    assert task_runs(tmp_path, killed) == {"init[trainer_0]": "COMPLETED",
                                           "epoch_group[trainer_0] e7": "CRASHED",
                                           "epoch_group[trainer_1] e7": "CRASHED"}


def test_kill_9_ends_the_run_at_the_kill_and_the_next_run_starts_clean(tmp_path):
    ckpt = tmp_path / "ckpt"
    first = start(tmp_path, ckpt, 1000, "first.log")
    try:
        until(lambda: len(list_records(Location(str(ckpt)))) >= 2 * 2, 180, "epoch 1 committed")
        killed_at = kill_9(first, tmp_path / "first.log")
    finally:
        stop_tree(first)
    killed = f"{socket.gethostname()}:{first.pid}"
    # Crashed, not Running (what the UI showed until the next run), ending at the kill
    state, message = runs(tmp_path)[killed]
    assert state == "CRASHED" and f"({killed}) died" in message, (state, message)
    assert abs((end_time(tmp_path, killed) - killed_at).total_seconds()) < AT_DEATH
    # its task runs that never finished (submitted or running at the kill) are Crashed too
    assert set(task_run_states(tmp_path, killed)) <= {"COMPLETED", "CRASHED"}
    # and its artifacts say so, at the newest epoch it committed (uploads were throttled); the
    # kill may land between the two nodes' records of the next epoch: that save is partial
    newest = newest_epoch(CheckpointStore(Location(str(ckpt))), ["trainer_0", "trainer_1"])
    shown = artifacts(tmp_path, killed)
    assert shown["progress"] == f"Job 'regression': Epoch {newest} of 1000 (crashed)", shown
    assert ("- **Crashed**: its process died, and the reaper of its temporary server marked it "
            f"Crashed; epoch {newest} is the newest it committed" in shown["summary"]), shown

    # enough epochs that the server's task-run recorder lags behind the flow at its end
    second = start(tmp_path, tmp_path / "other", SECOND_EPOCHS, "second.log")
    try:
        assert second.wait(timeout=180) == 0, (tmp_path / "second.log").read_text()
    finally:
        stop_tree(second)
    log = (tmp_path / "second.log").read_text()
    assert runs(tmp_path)[killed] == (state, message)  # nothing left for its sweep
    assert "left Running by process" not in log, log
    assert "ERROR" not in log and "Traceback" not in log and "Error" not in log, log
    assert runs(tmp_path)[f"{socket.gethostname()}:{second.pid}"][0] == "COMPLETED"
    # every task run of the second run was recorded, and recorded finished, before its
    # temporary server stopped: init, checkpoint_init, each save and each epoch, per node, and
    # each epoch's parent task run ("epoch 0" to "epoch N")
    assert task_run_states(tmp_path, f"{socket.gethostname()}:{second.pid}") == {
        "COMPLETED": 2 * (2 + (SECOND_EPOCHS + 1) + SECOND_EPOCHS) + SECOND_EPOCHS + 1}


def test_the_next_run_of_a_deployment_updates_the_artifacts_of_its_crashed_run(tmp_path, client):
    """A deployment's run that a worker marked *Crashed* (after ``kill -9``) gets its artifacts
    brought up to date by the next run of the deployment: in process on the session's server,
    the first run marked as a worker marks it, once it ran."""
    url = str(tmp_path / "ck")

    @flow(name="deployed-then-crashed")
    def deployed(epochs: int) -> int:
        return run_job(build_job(epochs), MultiNodeCheckpointManager(url),
                       session=PrefectSession(group_epochs=False))

    deployment = client.create_deployment(client.create_flow_from_name(deployed.name), "nightly")
    first, second = (client.create_flow_run_from_deployment(deployment, parameters={"epochs": n})
                     for n in (2, 3))
    run_flow(deployed, flow_run=first, parameters={"epochs": 2})
    client.set_flow_run_state(first.id, Crashed(message="Flow run infrastructure exited with "
                                                "non-zero status code -9."), force=True)
    run_flow(deployed, flow_run=second, parameters={"epochs": 3})
    shown = {a.key.rpartition("-")[2]: a for a in client.read_artifacts(
        artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[first.id])))
        if a.key}
    assert shown["progress"].description == "Job 'regression': Epoch 2 of 2 (crashed)", shown
    assert ("- **Crashed**: marked Crashed (Flow run infrastructure exited with non-zero status "
            f"code -9.); noticed by flow run {client.read_flow_run(second.id).name}; epoch 2 is "
            "the newest it committed" in shown["summary"].data), shown["summary"].data
