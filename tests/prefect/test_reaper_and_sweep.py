"""The two halves of cleaning up after ``kill -9``, each on its own: the reaper stops a dead
parent's server without letting it print a word, and the next run of the flow marks the killed
run *Crashed* together with its task runs that never finished (on a real Prefect server)."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
from pathlib import Path

from prefect import flow, task
from prefect.client.schemas.objects import StateType
from prefect.states import Completed, Pending, Running

from caffe2ckpt.prefect.orphans import claim_and_sweep

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

    assert next_run() == [killed.name]
    run = client.read_flow_run(killed.id)
    assert run.state.type == StateType.CRASHED and "is gone" in run.state.message
    after = {label: client.read_task_run(t.id).state for label, t in task_runs.items()}
    assert after["pending"].type == after["running"].type == StateType.CRASHED
    assert "is gone" in after["pending"].message
    assert after["completed"].type == StateType.COMPLETED
