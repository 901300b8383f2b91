"""The two halves of cleaning up after ``kill -9``, each on its own: the reaper of a temporary
server marks the dead parent's flow runs *Crashed* at once (through the server's API), then stops
the server without letting it print a word, and stops it all the same when the API does not
answer; the next run of the flow marks the killed run *Crashed* together with its task runs that
never finished (on a real Prefect server, where no reaper outlives the process)."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path
from uuid import UUID

import pytest
from prefect import flow, task
from prefect.client.schemas.actions import ArtifactUpdate
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId
from prefect.client.schemas.objects import StateType
from prefect.runtime import flow_run
from prefect.settings import PREFECT_API_URL
from prefect.states import Completed, Crashed, Pending, Running

from caffe2ckpt import MultiNodeCheckpointManager
from caffe2ckpt.example import build_job
from caffe2ckpt.fs.location import Location
from caffe2ckpt.prefect import PrefectSession, run_job
from caffe2ckpt.prefect.crashed import refresh_crashed_run
from caffe2ckpt.prefect.orphans import claim_and_sweep

NO_LONGER = 25.0  #: seconds: a reaper's API work has 20 s at most (_reaper.BUDGET_SECONDS)
REAPER = Path(__file__).resolve().parents[2] / "caffe2ckpt" / "prefect" / "_reaper.py"

# a server that, told to stop, prints to the terminal it shares with the user (as uvicorn does)
NOISY = ("import signal, sys, time\n"
         "signal.signal(signal.SIGTERM, lambda *a: (print('shutdown traceback', flush=True),"
         " sys.exit(1)))\n"
         "print('ready', flush=True)\n"
         "time.sleep(120)\n")


@contextlib.contextmanager
def server_and_reaper():
    """A noisy "server" that is ready, and a reaper for it (both killed at the end)."""
    with subprocess.Popen([sys.executable, "-c", NOISY], stdout=subprocess.PIPE,
                          text=True) as server, \
            subprocess.Popen([sys.executable, "-I", "-S", str(REAPER)], stdin=subprocess.PIPE,
                             text=True) as reaper:
        try:
            assert server.stdout.readline() == "ready\n"
            reaper.stdin.write(f"{server.pid}\n")
            yield server, reaper
        finally:
            server.kill()
            reaper.kill()


def test_the_reaper_kills_a_dead_parents_server_without_a_word():
    with server_and_reaper() as (server, reaper):
        reaper.stdin.close()  # the parent is gone: no "release" line
        assert reaper.wait(timeout=30) == 0
        assert server.wait(timeout=10) == -9
        assert server.stdout.read() == ""


def test_the_reaper_leaves_a_released_server_alone():
    with server_and_reaper() as (server, reaper):
        reaper.stdin.write("release\n")
        reaper.stdin.close()
        assert reaper.wait(timeout=30) == 0
        assert server.poll() is None


def create_killed_run(client, flow_fn, owner: str) -> tuple:
    """A flow run left *Running* by process ``owner``, with a task run never started (still named
    as Prefect first names it), one running and one completed; (flow run, {label: task run})."""
    killed = client.create_flow_run(flow=flow_fn, state=Running())
    client.update_flow_run(killed.id, infrastructure_pid=owner)
    made = {"never started": ("epoch_group[trainer_1] e7-1de", Pending()),
            "running": ("epoch_group[trainer_0] e7", Running()),
            "completed": ("checkpoint_init[trainer_0]", Completed())}
    return killed, {label: client.create_task_run(left_behind, killed.id, dynamic_key=label,
                                                  name=name, state=state)
                    for label, (name, state) in made.items()}


def test_the_reaper_marks_the_dead_parents_runs_crashed_before_it_stops_the_server(client):
    @flow(name="killed-under-a-temporary-server")
    def killed_flow() -> None:
        """Only its definition is used: its runs are made by hand."""

    owner = f"{socket.gethostname()}:{dead_pid()}"
    killed, task_runs = create_killed_run(client, killed_flow, owner)
    alive = client.create_flow_run(flow=killed_flow, state=Running())
    client.update_flow_run(alive.id, infrastructure_pid=f"{socket.gethostname()}:{os.getpid()}")
    with server_and_reaper() as (server, reaper):
        reaper.stdin.write(f"api {PREFECT_API_URL.value()}\nowner {owner}\n")
        died = datetime.now(timezone.utc)
        reaper.stdin.close()  # the parent is gone
        assert reaper.wait(timeout=60) == 0
        assert server.wait(timeout=10) == -9
        assert server.stdout.read() == ""

    run = client.read_flow_run(killed.id)
    assert run.state.type == StateType.CRASHED, run.state
    assert f"({owner}) died" in run.state.message
    assert abs(run.end_time - died) < timedelta(seconds=2), (run.end_time, died)
    assert client.read_flow_run(alive.id).state.type == StateType.RUNNING  # not the dead one's
    after = {label: client.read_task_run(t.id) for label, t in task_runs.items()}
    assert after["never started"].state.type == after["running"].state.type == StateType.CRASHED
    assert after["never started"].name == "epoch_group[trainer_1] e7"
    assert after["running"].name == "epoch_group[trainer_0] e7"
    assert after["completed"].state.type == StateType.COMPLETED


@pytest.mark.parametrize("api", ["refused", "silent"])
def test_a_reaper_whose_api_does_not_answer_still_stops_the_server(api):
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        if api == "silent":  # connects, and never answers
            listener.listen(8)
        url = f"http://127.0.0.1:{listener.getsockname()[1]}/api"
        if api == "refused":
            listener.close()
        with server_and_reaper() as (server, reaper):
            reaper.stdin.write(f"api {url}\nowner {socket.gethostname()}:{dead_pid()}\n")
            start = time.monotonic()
            reaper.stdin.close()
            assert reaper.wait(timeout=NO_LONGER + 30) == 0
            assert server.wait(timeout=10) == -9
            assert time.monotonic() - start < NO_LONGER
            assert server.stdout.read() == ""


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


@task
def left_behind() -> None:
    """Only its definition is used: task runs of the killed flow run are made by hand."""


def test_the_next_run_marks_the_killed_run_and_its_unfinished_task_runs_crashed(client):
    name = "sweep-of-a-killed-run"

    @flow(name=name)
    def next_run() -> list[str]:
        return claim_and_sweep()

    killed = client.create_flow_run(flow=next_run, state=Running())  # then killed with -9
    client.update_flow_run(killed.id, infrastructure_pid=f"{socket.gethostname()}:{dead_pid()}")
    states = {"pending": Pending(), "running": Running(), "completed": Completed()}
    task_runs = {label: client.create_task_run(left_behind, killed.id, dynamic_key=label,
                                               name=f"left_behind {label}", state=state)
                 for label, state in states.items()}
    never_started = client.create_task_run(left_behind, killed.id, dynamic_key="never",
                                           name="epoch_group[trainer_1] e7-1de", state=Pending())

    assert next_run() == [killed.name]
    run = client.read_flow_run(killed.id)
    assert run.state.type == StateType.CRASHED and "is gone" in run.state.message
    after = {label: client.read_task_run(t.id).state for label, t in task_runs.items()}
    assert after["pending"].type == after["running"].type == StateType.CRASHED
    assert "is gone" in after["pending"].message
    assert after["completed"].type == StateType.COMPLETED
    never_started = client.read_task_run(never_started.id)
    assert never_started.state.type == StateType.CRASHED
    assert never_started.name == "epoch_group[trainer_1] e7"  # as it would have been named


def test_the_reaper_and_the_sweep_agree_on_which_states_are_not_final():
    """The reaper (stdlib only) spells out the states; the sweep takes them from Prefect."""
    from caffe2ckpt.prefect import _reaper, orphans

    assert sorted(_reaper.NOT_FINAL) == sorted(state.value for state in orphans.NOT_FINAL)


def test_a_crashed_runs_artifacts_are_brought_up_to_date_from_its_records(tmp_path, client):
    """A run another party marked Crashed (here by hand, as the heartbeat automation does) with
    its artifacts as a kill -9 leaves them: the next run of its flow sweeps it, setting the
    progress bar at the newest epoch it committed, the table from the records, the summary
    saying it crashed; once only."""
    url = str(tmp_path / "ckpt")

    @flow(name="stale-artifacts")
    def stale(train: bool = True) -> str:
        if train:
            cm = MultiNodeCheckpointManager(url)
            run_job(build_job(3), cm, session=PrefectSession(artifacts_interval=3600))
        else:  # the next run's start: what run_job does first
            claim_and_sweep()
        return flow_run.id

    run_id = UUID(stale())
    by_kind = {a.key.rpartition("-")[2]: a for a in client.read_artifacts(
        artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[run_id])))}
    assert by_kind["progress"].metadata_["caffe2ckpt.url"] == Location(url).canonical_url
    client.update_artifact(by_kind["progress"].id, ArtifactUpdate(
        data=33.3, description="Job 'regression': Epoch 1 of 3 (this run started from epoch 0)"))
    client.update_artifact(by_kind["checkpoints"].id, ArtifactUpdate(data="[]"))
    client.set_flow_run_state(run_id, Crashed(message="no heartbeat"), force=True)
    stale(train=False)
    after = {a.key.rpartition("-")[2]: a for a in client.read_artifacts(
        artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[run_id])))}
    assert after["progress"].description == "Job 'regression': Epoch 3 of 3 (crashed)"
    assert after["progress"].data == 100.0
    assert [row["epoch"] for row in json.loads(after["checkpoints"].data)] == [3, 2, 1, 0]
    assert ("- **Crashed**: marked Crashed (no heartbeat); noticed by flow run "
            in after["summary"].data), after["summary"].data
    assert "epoch 3 is the newest it committed" in after["summary"].data
    assert not refresh_crashed_run(client, run_id, "again")  # once only


def test_refresh_crashed_without_an_api_says_what_to_set():
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    for args in (["refresh-crashed", str(UUID(int=1))], ["retry-crashed", "a/b"]):
        out = subprocess.run([sys.executable, "-m", "caffe2ckpt.prefect", *args], env=env,
                             capture_output=True, text=True, check=False, timeout=120)
        assert out.returncode == 2 and "PREFECT_API_URL is not set" in out.stderr, out.stderr
