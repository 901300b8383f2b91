"""Flow runs whose process is gone: run without a deployment, killed, and left *Running*.

A deployment's run has a worker (and the crash-retry automation) to notice that its process died. A
flow called directly (``python flows/regression.py``) has nobody: killed with SIGKILL, it stays
*Running* in the UI forever. So :func:`run_job` notes in each such run which process runs it
(``infrastructure_pid`` = ``<host>:<pid>``, the field workers fill for theirs). On the temporary
server of :func:`~caffe2ckpt.prefect.temporary_server`, its reaper marks the runs of a process
that died *Crashed* within seconds (``_reaper.py``). Elsewhere (a real ``prefect server``, or a
reaper that could not reach its server), the next run of the same flow on the same host marks
every *Running* run whose process no longer exists *Crashed*, with its task runs that never
finished (submitted or running at the kill; one that never started is named as it would have
been, ``epoch_group[trainer_1] e7``); their end time is then that later moment. Runs on other
hosts are left alone (their processes cannot be checked from here); so is a run whose process
id was reused by a live process (it stays *Running*). The runs it marks, and the newest runs of
the flow that others marked *Crashed* (a worker, the heartbeat automation, on any host), get
their checkpoint artifacts brought up to date from the records
(:mod:`~caffe2ckpt.prefect.crashed`): that second part also in a deployment's run, so the next
run of a deployment whose run a worker marked *Crashed* brings that run's artifacts up to date.
"""

from __future__ import annotations

import logging
import os
import socket
from typing import Any

from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import (
    FlowFilter,
    FlowFilterName,
    FlowRunFilter,
    FlowRunFilterDeploymentId,
    FlowRunFilterId,
    FlowRunFilterState,
    FlowRunFilterStateType,
    TaskRunFilter,
    TaskRunFilterState,
    TaskRunFilterStateType,
)
from prefect.client.schemas.objects import TERMINAL_STATES, StateType
from prefect.client.schemas.sorting import FlowRunSort
from prefect.runtime import deployment, flow_run
from prefect.states import Crashed

from caffe2ckpt.prefect._reaper import GENERIC_NAME
from caffe2ckpt.prefect.crashed import refresh_crashed_run

__all__ = ["claim_and_sweep", "process_id"]

_RECENT_CRASHED = 5  # crashed runs of the flow whose artifacts a new run brings up to date
NOT_FINAL = [t for t in StateType if t not in TERMINAL_STATES]  #: a run in one may still change

logger = logging.getLogger(__name__)


def process_id() -> str:
    """``<host>:<pid>`` of this process."""
    return f"{socket.gethostname()}:{os.getpid()}"


def _gone(infrastructure_pid: str | None, host: str) -> bool:
    """Whether ``infrastructure_pid`` names a process of this host that no longer exists."""
    run_host, _, pid = (infrastructure_pid or "").rpartition(":")
    if run_host != host or not pid.isdigit() or int(pid) <= 1:
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def claim_and_sweep() -> list[str]:
    """Note this process on the current flow run; mark its flow's orphaned runs *Crashed*;
    bring the artifacts of its flow's runs others marked *Crashed* up to date.

    The first two only for a flow run without a deployment (a worker looks after deployments'
    runs, and fills their ``infrastructure_pid``). Returns the names of the runs marked
    *Crashed*.
    """
    if flow_run.id is None:
        return []
    with get_client(sync_client=True) as client:
        crashed = _sweep(client) if deployment.id is None else []
        _refresh_marked_elsewhere(client)
    return crashed


def _sweep(client: Any) -> list[str]:
    """Note this process on the current flow run; mark the runs of its flow (without a
    deployment) that a gone process of this host left *Running* *Crashed*; their names."""
    me, host = process_id(), socket.gethostname()
    crashed: list[str] = []
    client.update_flow_run(flow_run.id, infrastructure_pid=me)
    runs = client.read_flow_runs(
        flow_filter=FlowFilter(name=FlowFilterName(any_=[flow_run.flow_name])),
        flow_run_filter=FlowRunFilter(
            id=FlowRunFilterId(not_any_=[flow_run.id]),
            deployment_id=FlowRunFilterDeploymentId(is_null_=True),
            state=FlowRunFilterState(type=FlowRunFilterStateType(any_=[StateType.RUNNING]))),
        limit=200,
    )
    for run in runs:
        if not _gone(run.infrastructure_pid, host):
            continue
        message = (f"caffe2ckpt: the process that ran this flow run ({run.infrastructure_pid})"
                   f" is gone; marked Crashed by flow run {flow_run.name} ({flow_run.id})")
        client.set_flow_run_state(run.id, Crashed(message=message), force=True)
        tasks = _crash_unfinished_tasks(client, run.id, message)
        _refresh(client, run.id, f"its process ({run.infrastructure_pid}) is gone; flow "
                                 f"run {flow_run.name} marked it Crashed")
        logger.warning("flow run %s (%s) was left Running by process %s, which is gone: "
                       "marked it and %d unfinished task run(s) Crashed", run.name, run.id,
                       run.infrastructure_pid, tasks)
        crashed.append(run.name)
    return crashed


def _refresh(client: Any, run_id: Any, why: str) -> None:
    try:
        refresh_crashed_run(client, run_id, why)
    except Exception as exc:  # noqa: BLE001 - a view: never stops the run that sweeps
        logger.warning("could not update the artifacts of crashed flow run %s: %s", run_id, exc)


def _refresh_marked_elsewhere(client: Any) -> None:
    """Bring up to date the artifacts of the newest few runs of this flow that others marked
    *Crashed* (the heartbeat automation, a worker), unless done already."""
    runs = client.read_flow_runs(
        flow_filter=FlowFilter(name=FlowFilterName(any_=[flow_run.flow_name])),
        flow_run_filter=FlowRunFilter(
            id=FlowRunFilterId(not_any_=[flow_run.id]),
            state=FlowRunFilterState(type=FlowRunFilterStateType(any_=[StateType.CRASHED]))),
        sort=FlowRunSort.START_TIME_DESC, limit=_RECENT_CRASHED)
    for run in runs:
        _refresh(client, run.id, f"marked Crashed ({run.state.message or 'no message'}); "
                                 f"noticed by flow run {flow_run.name}")


def _crash_unfinished_tasks(client: Any, run_id: Any, message: str) -> int:
    """Mark the task runs of flow run ``run_id`` that are not in a final state *Crashed*."""
    unfinished = TaskRunFilter(state=TaskRunFilterState(type=TaskRunFilterStateType(
        any_=NOT_FINAL)))
    done: set[Any] = set()
    while tasks := [t for t in client.read_task_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[run_id])),
            task_run_filter=unfinished, limit=200) if t.id not in done]:
        for task_run in tasks:  # pages of 200: each one marked leaves the filter
            if generic := GENERIC_NAME.match(task_run.name or ""):  # it never started
                client.request("PATCH", "/task_runs/{id}", path_params={"id": task_run.id},
                               json={"name": generic.group(1)}).raise_for_status()
            client.set_task_run_state(task_run.id, Crashed(message=message), force=True)
            done.add(task_run.id)
    return len(done)
