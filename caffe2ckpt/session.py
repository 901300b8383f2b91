"""Sessions run task groups against per-node workspaces.

:class:`Session` is the protocol the runner and the checkpoint managers need; :class:`LocalSession`
runs everything in this process, one thread per node of a group. :func:`run_node_tasks` is the
one place that implements Caffe2's per-node semantics (PRIVATE child workspace, output
promotion), and :func:`run_group` the one place that runs a group's nodes and hands each task's
return value to its ``on_result``, so other sessions (Prefect, Dask) reuse them.

A node's share of a group travels as *steps*: ``(fn, outputs, keep)`` triples
(:func:`node_steps`), never the :class:`Task` objects, which also hold their group and session;
``keep`` says whether the task has an ``on_result`` (other return values are dropped where they
are made, never sent back).
"""

from __future__ import annotations

import hashlib
import os
import socket
import threading
import uuid
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, TypeVar, runtime_checkable

from caffe2ckpt.errors import JobDefinitionError
from caffe2ckpt.job import Task, TaskGroup
from caffe2ckpt.workspace import Workspace, WorkspaceType

__all__ = ["LocalSession", "RunEvent", "Session", "Step", "as_group", "deliver", "memory_tier",
           "node_steps", "notify", "run_epoch", "run_group", "run_node_tasks", "run_on",
           "tier_key", "tier_token", "token_key", "token_run", "wait_all"]

T = TypeVar("T")

Step = tuple[Callable[[Workspace], Any] | None, tuple[str, ...], bool]
"""One task as a node runs it: its function, its declared outputs, whether to keep its result."""


@dataclass(frozen=True, kw_only=True)
class RunEvent:
    """What the runner tells its session as a job progresses (for logs, UIs, artifacts).

    Kinds: ``"started"`` (fresh start), ``"loading"`` (checkpoint ``epoch`` is about to be
    loaded to resume), ``"resumed"`` (it was loaded),
    ``"epoch"`` (epoch ``epoch`` is about to run), ``"saved"`` / ``"save_failed"`` (checkpoint
    of ``epoch``), ``"deleted"`` (retention removed checkpoint ``epoch``), ``"preempted"`` (a
    preemption signal stopped the job after ``epoch``), ``"recovered"`` (a node was lost with
    its worker and every node went back to ``epoch``; ``detail`` says from where),
    ``"finished"`` (``epoch`` is the final epoch).
    """

    kind: Literal["started", "loading", "resumed", "epoch", "saved", "save_failed", "deleted",
                  "preempted", "recovered", "finished"]
    job: str
    epoch: int
    max_epochs: int | None = None
    records: Mapping[str, Any] = field(default_factory=dict)  # node -> CommitRecord
    error: str | None = None
    detail: str | None = None
    checkpoint_manager: Any = None


@runtime_checkable
class Session(Protocol):
    """What runs a job: ``run`` a TaskGroup or Task synchronously, hand out node workspaces."""

    def run(self, runnable: TaskGroup | Task) -> None:
        """Run ``runnable`` to completion, hand each task's return value to its ``on_result``
        (the checkpoint managers rely on it: use :func:`run_group` or :func:`deliver`), then
        raise the first task failure."""

    def workspace(self, node: str) -> Workspace:
        """The workspace of ``node`` (created empty on first use)."""

    def writer_info(self) -> dict[str, Any]:
        """Who is running: stored in every commit record this session's saves write."""

    def notify(self, event: RunEvent) -> None:
        """Hear about the job's progress (optional: sessions without it are not told)."""


def notify(session: Session, event: RunEvent) -> None:
    """Tell ``session`` about ``event`` if it listens (user sessions may predate ``notify``)."""
    listener = getattr(session, "notify", None)
    if listener is not None:
        listener(event)


def memory_tier(session: Session) -> Any:
    """The session's memory tier (``DaskSession(memory_tier=True)``, also inside a
    ``PrefectSession``), or None."""
    return getattr(session, "memory_tier", None)


def tier_key(prefix: str) -> str:
    """The key under which worker memory keeps copies taken for the checkpoint prefix
    ``prefix`` (its canonical URL; '' without a checkpoint manager, and then the key is '':
    nothing resumes from such copies): a digest, so that no URL (nor a password in one)
    reaches the workers."""
    return hashlib.sha256(prefix.encode()).hexdigest()[:32] if prefix else ""


def tier_token(prefix: str, run: tuple[int, float] | None) -> str:
    """A ``train()`` call's memory-tier token: its prefix's :func:`tier_key`, its run on the
    prefix as (generation, creation time of its run log entry: a prefix deleted and made anew
    numbers its runs from 1 again; none when unknown: its copies then continue nothing in a
    later session) and a nonce of its own."""
    who = "" if run is None else f"{run[0]}@{run[1]!r}"
    return f"{tier_key(prefix)}/{who}/{uuid.uuid4().hex}"


def token_key(token: str) -> str:
    """The :func:`tier_key` a :func:`tier_token` starts with."""
    return token.partition("/")[0]


def token_run(token: str, prefix: str | None = None) -> tuple[int, float] | None:
    """The run (generation, creation time) in ``token`` if it names one (and was made for
    ``prefix``, if given)."""
    generation, at, created = token.partition("/")[2].partition("/")[0].partition("@")
    if (prefix is not None and token_key(token) != tier_key(prefix)) or not (
            generation.isdigit() and at):
        return None
    try:
        return int(generation), float(created)
    except ValueError:
        return None


def run_epoch(session: Session, epoch: int, body: Callable[[], T]) -> T:
    """Run ``body`` (everything epoch ``epoch`` runs: its groups and its save) through the
    session's ``run_epoch`` if it has one (``PrefectSession`` makes it one parent task run, so
    the epoch's task runs are grouped under it), else just call it."""
    runner = getattr(session, "run_epoch", None)
    return body() if runner is None else runner(epoch, body)


def as_group(runnable: TaskGroup | Task) -> TaskGroup:
    """A bare Task runs as a one-task GLOBAL group (Caffe2's rule)."""
    if isinstance(runnable, TaskGroup):
        return runnable
    if isinstance(runnable, Task):
        if runnable.group is not None:
            raise JobDefinitionError(
                f"task {runnable.name!r} belongs to group {runnable.group.name!r}; run the group"
            )
        group = TaskGroup(runnable.workspace_type or WorkspaceType.GLOBAL, name=runnable.name)
        group.tasks.append(runnable)
        runnable.workspace_type = group.workspace_type
        return group
    raise JobDefinitionError(f"cannot run {runnable!r}: expected a TaskGroup or a Task")


def node_steps(tasks: Sequence[Task]) -> list[Step]:
    """The steps a node runs for ``tasks`` (picklable whenever the task functions are)."""
    return [(t.fn, tuple(t.output_names()), t.on_result is not None) for t in tasks]


def run_node_tasks(steps: Sequence[Step], ws: Workspace,
                   workspace_type: WorkspaceType) -> list[Any]:
    """Run one node's steps of a group, in order, with Caffe2's workspace semantics, and return
    what each step's function returned.

    GLOBAL: tasks see and change ``ws`` directly. PRIVATE: the node's tasks share one child
    workspace for this group run; existing blobs are written through to ``ws``, declared outputs
    are promoted to ``ws`` at the end, and every other new blob is dropped.
    """
    target = ws if workspace_type is WorkspaceType.GLOBAL else Workspace(parent=ws)
    results = []
    for fn, _, keep in steps:
        value = fn(target) if fn is not None else None
        results.append(value if keep else None)
    if target is not ws:
        for _, outputs, _ in steps:
            for name in outputs:
                if name in target.local_names():
                    ws[name] = target[name]
    return results


def deliver(by_node: Mapping[str, Sequence[Task]], results: Mapping[str, Sequence[Any]]) -> None:
    """Hand each finished node's step results to its tasks' ``on_result``."""
    for node, values in results.items():
        for task, value in zip(by_node[node], values, strict=True):
            if task.on_result is not None:
                task.on_result(value)


RunNode = Callable[[str, list[Step], WorkspaceType], list[Any]]


def run_group(group: TaskGroup, run_node: RunNode) -> None:
    """Run every node's share of ``group`` concurrently (one thread per node) as
    ``run_node(node, steps, workspace_type)``; once all have ended, deliver the results of the
    nodes that finished (:func:`deliver`), then raise the first failure."""
    by_node = group.tasks_by_node()
    wtype = group.workspace_type or WorkspaceType.PRIVATE
    results: dict[str, list[Any]] = {}

    def call(node: str, tasks: list[Task]) -> None:
        results[node] = run_node(node, node_steps(tasks), wtype)

    try:
        wait_all([lambda n=node, ts=tasks: call(n, ts) for node, tasks in by_node.items()])
    finally:
        deliver(by_node, {n: results[n] for n in by_node if n in results})


def run_on(session: Session, runnable: TaskGroup | Task, run_node: RunNode) -> None:
    """:func:`run_group` for ``session``; its tasks then know the session ran them (for
    :meth:`TaskOutput.fetch` and the managers' background saves)."""
    group = as_group(runnable)
    try:
        run_group(group, run_node)
    finally:
        for task in group.tasks:
            task.last_session = session


def wait_all(calls: list[Callable[[], None]], *, max_workers: int | None = None) -> None:
    """Run ``calls`` concurrently, wait for all, then raise the first failure (if any)."""
    if len(calls) == 1:
        calls[0]()
        return
    errors: list[BaseException] = []
    with ThreadPoolExecutor(max_workers=max_workers or len(calls) or 1) as pool:
        for future in [pool.submit(c) for c in calls]:
            exc = future.exception()
            if exc is not None:
                errors.append(exc)
    if errors:
        raise errors[0]


class LocalSession:
    """Runs groups in this process: each node's tasks in a thread, all nodes concurrently.

    Args:
        workspaces: existing node workspaces to use (others are created on demand).

    Example:
        >>> from caffe2ckpt import Task, LocalSession
        >>> session = LocalSession()
        >>> session.run(Task(lambda ws: ws.__setitem__("x", 1), node="n0"))
        >>> int(session.workspace("n0")["x"])
        1
    """

    def __init__(self, workspaces: Mapping[str, Workspace] | None = None) -> None:
        self._workspaces: dict[str, Workspace] = dict(workspaces or {})
        self._lock = threading.Lock()
        self.epoch: int | None = None  # the epoch being run, as last notified

    def workspace(self, node: str) -> Workspace:
        with self._lock:
            return self._workspaces.setdefault(str(node), Workspace())

    @property
    def workspaces(self) -> dict[str, Workspace]:
        """All node workspaces created so far."""
        return dict(self._workspaces)

    def writer_info(self) -> dict[str, Any]:
        return {"session": "local", "host": socket.gethostname(), "pid": os.getpid()}

    def notify(self, event: RunEvent) -> None:
        self.epoch = event.epoch

    def run_node(self, node: str, steps: list[Step], workspace_type: WorkspaceType) -> list[Any]:
        """Run one node's steps against its workspace here (see :func:`run_node_tasks`)."""
        return run_node_tasks(steps, self.workspace(node), workspace_type)

    def run(self, runnable: TaskGroup | Task) -> None:
        run_on(self, runnable, self.run_node)
