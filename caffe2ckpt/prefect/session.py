"""PrefectSession: every node's share of a task group becomes one Prefect task run.

Inside a flow, ``session.run(group)`` submits one task run per node of the group (named like
``epoch_group[trainer_1] e7``) to the flow's task runner, waits for all of them, and then raises
the first failure. Each epoch (its groups and its save) runs inside one parent task run named
``epoch N`` (``group_epochs``): Prefect nests the node task runs under it, and the flow run
graph shows one expandable node per epoch instead of one per node and group. The task run
calls its node session's ``run_node``: by default a :class:`~caffe2ckpt.session.LocalSession`,
whose workspaces live in the flow process, or a :class:`~caffe2ckpt.dask.DaskSession`, whose
workspaces live on Dask workers. Only the steps go in
and their small results come back (``quote``d, ``NO_CACHE``, no result persistence): the
checkpoint store is the only cache. Outside a flow it runs groups on the node session directly.

The task runs execute in threads of the flow process (workspaces are shared in memory with the
default node session), so the flow must use Prefect's default ``ThreadPoolTaskRunner``; any
other task runner is refused up front. To spread nodes over machines, use a ``DaskSession``.
"""

from __future__ import annotations

import copy
import logging
import os
import socket
from collections.abc import Callable, Mapping
from functools import lru_cache
from typing import Any

from prefect import Task as PrefectTask
from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.context import FlowRunContext
from prefect.futures import wait
from prefect.runtime import deployment, flow_run
from prefect.task_runners import ThreadPoolTaskRunner
from prefect.utilities.annotations import quote

from caffe2ckpt.errors import JobDefinitionError, NodeLostError
from caffe2ckpt.job import Task, TaskGroup
from caffe2ckpt.prefect.artifacts import CheckpointArtifacts
from caffe2ckpt.prefect.console import keep_tracebacks_in_run_logs
from caffe2ckpt.prefect.epochtask import run_in_epoch_task
from caffe2ckpt.session import LocalSession, RunEvent, RunNode, Step, as_group, deliver, node_steps
from caffe2ckpt.workspace import Workspace, WorkspaceType

__all__ = ["PrefectSession", "in_flow_run"]

logger = logging.getLogger(__name__)


def in_flow_run() -> bool:
    """Whether the caller runs inside a Prefect flow run."""
    return FlowRunContext.get() is not None


def _deployment_id(run: Any) -> str | None:
    """The deployment of the flow run ``run`` (a subflow's: its parent run's), as
    ``prefect.runtime.deployment.id`` gives it, without the request to the API that it sends
    (with a new client) on every call in a top-level run of no deployment."""
    if run.deployment_id is not None:
        return str(run.deployment_id)
    return deployment.id if run.parent_task_run_id is not None else None


@task(retries=0, cache_policy=NO_CACHE, persist_result=False, task_run_name="{label}")
def _run_node(label: str, run_node: RunNode, node: str, steps: list[Step],
              workspace_type: WorkspaceType) -> list[Any]:
    return run_node(node, steps, workspace_type)


@lru_cache(maxsize=1024)
def _node_task(group_name: str) -> PrefectTask:
    """``_run_node`` named after the group, made once per name: ``with_options`` builds a new
    Prefect task (reading the function's source and hashing its code), ~1 ms per call."""
    return _run_node.with_options(name=group_name)


def _labelled(group_name: str, label: str) -> PrefectTask:
    """The group's task named ``label`` itself. Prefect records a task run first under a name
    made from the task's (``<task name>-<3 hex digits>``) and renames it to ``task_run_name``
    only once it starts: a run that never starts (its flow run was killed first) keeps the first
    name, which thus says which node and epoch it was (``epoch_group[trainer_1] e7-1de``). A
    shallow copy: the same function, task key and options, in microseconds."""
    labelled = copy.copy(_node_task(group_name))
    labelled.name = label
    return labelled


class PrefectSession:
    """Runs task groups as Prefect task runs and reports checkpoints as flow run artifacts.

    Args:
        workspaces: existing node workspaces (others are created empty on first use), for the
            default node session.
        nodes: the session whose nodes run the tasks: a ``LocalSession`` (default) or a
            ``DaskSession``.
        artifacts: keep the checkpoint table, progress and summary artifacts up to date.
        artifacts_interval: upload the checkpoint table and progress at most this often
            (seconds), in the background; longer when uploads get slow (ten times the last
            one's duration). Failures and the end of the job are uploaded at once.
        group_epochs: run each epoch (its groups and its save; epoch 0: the init groups and
            the first save) inside one parent task run named ``epoch N``, so that the flow
            run graph shows one expandable node per epoch; the node task runs keep their
            names (``epoch_group[trainer_1] e7``). False: every node task run is a top-level
            node of the graph, as before.

    Example:
        >>> from prefect import flow
        >>> @flow(retries=2)
        ... def train(url: str = "checkpoints/demo") -> int:
        ...     cm = MultiNodeCheckpointManager(url, metadata_handler=ZarrMetadataHandler())
        ...     return JobRunner(build_job(), cm).train(PrefectSession())
    """

    def __init__(self, workspaces: Mapping[str, Workspace] | None = None, *, nodes: Any = None,
                 artifacts: bool = True, artifacts_interval: float = 2.0,
                 group_epochs: bool = True) -> None:
        if nodes is not None and workspaces is not None:
            raise JobDefinitionError("give PrefectSession either workspaces or a node session")
        self._local = nodes if nodes is not None else LocalSession(workspaces)
        self._artifacts = (CheckpointArtifacts(min_interval=artifacts_interval) if artifacts
                           else None)
        self.epoch: int | None = None
        self.group_epochs = group_epochs

    def workspace(self, node: str) -> Workspace:
        return self._local.workspace(node)

    @property
    def remote(self) -> bool:
        """Whether the nodes live in other processes (see ``DaskSession.remote``)."""
        return bool(getattr(self._local, "remote", False))

    @property
    def workspaces(self) -> dict[str, Workspace]:
        return self._local.workspaces

    @property
    def memory_tier(self) -> Any:
        """The node session's memory tier (see ``DaskSession(memory_tier=True)``), or None."""
        return getattr(self._local, "memory_tier", None)

    def writer_info(self) -> dict[str, Any]:
        """The flow run (id, name, attempt) and deployment that are writing checkpoints."""
        context = FlowRunContext.get()
        if context is None:
            return {**self._local.writer_info(), "session": "prefect"}
        return {
            **self._local.writer_info(),
            "session": "prefect",
            "flow_run_id": flow_run.id,
            "flow_run_name": flow_run.name,
            "flow_name": flow_run.flow_name,
            "run_count": flow_run.run_count,
            "deployment_id": _deployment_id(context.flow_run),
            "host": socket.gethostname(),
            "pid": os.getpid(),
        }

    def notify(self, event: RunEvent) -> None:
        self.epoch = event.epoch
        if self._artifacts is not None and in_flow_run():
            self._artifacts.handle(event)

    def _flush_artifacts(self) -> None:
        if self._artifacts is not None:
            try:
                self._artifacts.flush()
            except Exception as exc:  # noqa: BLE001 - never hide the task's own failure
                logger.warning("could not update checkpoint artifacts: %s", exc)

    def run_epoch(self, epoch: int, body: Callable[[], Any]) -> Any:
        """Call ``body`` (all that epoch ``epoch`` runs) inside a parent task run ``epoch N``
        (see ``group_epochs``); outside a flow, or with ``group_epochs=False``, just call it."""
        if not self.group_epochs or not in_flow_run():
            return body()
        _check_task_runner()
        return run_in_epoch_task(epoch, body)

    def run(self, runnable: TaskGroup | Task) -> None:
        group = as_group(runnable)
        if not in_flow_run():
            self._local.run(group)
            return
        _check_task_runner()
        keep_tracebacks_in_run_logs(str(FlowRunContext.get().flow_run.id))
        by_node = group.tasks_by_node()
        wtype = group.workspace_type or WorkspaceType.PRIVATE
        epoch = group.epoch if group.epoch is not None else self.epoch
        suffix = f" e{epoch}" if epoch is not None else ""
        futures = {}
        for node, tasks in by_node.items():
            label = f"{group.name}[{node}]{suffix}"
            futures[node] = _labelled(group.name, label).submit(
                label, quote(self._local.run_node), node, quote(node_steps(tasks)), wtype)
        try:
            wait(list(futures.values()))
            # A completed run's value is in memory (no persistence); State.result goes through
            # Prefect's event loop thread, so read failed states only through future.result().
            deliver(by_node, {n: f.state.result() for n, f in futures.items()
                              if f.state.is_completed()})
            errors = []
            for future in futures.values():
                if not future.state.is_completed():
                    try:
                        future.result()
                    except BaseException as exc:  # noqa: BLE001 - raised below
                        errors.append(exc)
            if errors:  # the first failure (a lost node first: the run cannot go on without it)
                raise next((e for e in errors if isinstance(e, NodeLostError)), errors[0])
        except BaseException:
            self._flush_artifacts()  # the job may end here, without a "finished" event
            raise
        finally:
            for t in group.tasks:
                t.last_session = self


def _check_task_runner() -> None:
    runner = FlowRunContext.get().task_runner
    if not isinstance(runner, ThreadPoolTaskRunner):
        raise JobDefinitionError(
            f"PrefectSession needs the flow's task runner to be Prefect's ThreadPoolTaskRunner "
            f"(node task runs share the node session with the flow process), not "
            f"{type(runner).__name__}; to run nodes on other machines keep the default task "
            "runner and pass PrefectSession(nodes=DaskSession(...))"
        )
