"""Job definition: Node, Task, TaskGroup, TaskOutput, Job and epoch_limiter.

These objects only *describe* work; a :class:`~caffe2ckpt.session.Session` runs it. The
"current" node, task group and job are tracked with :mod:`contextvars`, so ``with Node(...)``,
``with group:`` and ``with Job() as job:`` nest the way Caffe2 users expect and are safe to use
from several threads.

This module does no I/O; it imports only :mod:`caffe2ckpt.errors` and :mod:`caffe2ckpt.workspace`.
"""

from __future__ import annotations

import contextvars
import itertools
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from caffe2ckpt.errors import JobDefinitionError
from caffe2ckpt.workspace import Workspace, WorkspaceType, check_blob_name

if TYPE_CHECKING:
    from caffe2ckpt.session import Session

__all__ = ["DEFAULT_NODE", "Job", "Node", "Task", "TaskGroup", "TaskOutput", "epoch_limiter"]

DEFAULT_NODE = "local"

_node_stack: contextvars.ContextVar[tuple[str, ...]] = contextvars.ContextVar("node", default=())
_group_stack: contextvars.ContextVar[tuple[TaskGroup, ...]] = contextvars.ContextVar(
    "group", default=()
)
_job_stack: contextvars.ContextVar[tuple[Job, ...]] = contextvars.ContextVar("job", default=())
_task_ids = itertools.count()


class _Stacked:
    """Mixin: a context manager that pushes ``self`` (or a value) on a contextvar stack."""

    _stack: contextvars.ContextVar[tuple[Any, ...]]

    def _push(self, value: Any) -> None:
        tokens = self.__dict__.setdefault("_tokens", [])
        tokens.append(self._stack.set(self._stack.get() + (value,)))

    def _pop(self) -> None:
        self._stack.reset(self.__dict__["_tokens"].pop())


class Node(_Stacked):
    """A named place where tasks run; tasks created inside ``with Node(name):`` belong to it.

    Each node has its own workspace in a session. Outside any ``with Node`` the current node is
    ``"local"``.
    """

    _stack = _node_stack

    def __init__(self, name: str = DEFAULT_NODE) -> None:
        if not isinstance(name, str) or not name:
            raise JobDefinitionError(f"node names must be non-empty strings, got {name!r}")
        self.name = name

    def __enter__(self) -> Node:
        self._push(self.name)
        return self

    def __exit__(self, *exc: object) -> None:
        self._pop()

    @staticmethod
    def current() -> str:
        """The name of the innermost active node, or ``"local"``."""
        stack = _node_stack.get()
        return stack[-1] if stack else DEFAULT_NODE

    def __str__(self) -> str:
        return self.name

    def __repr__(self) -> str:
        return f"Node({self.name!r})"


class TaskOutput:
    """A handle on one blob that a task declares as its output.

    ``fetch()`` returns the blob's current value in the node's workspace of the session that last
    ran the task.
    """

    def __init__(self, task: Task, name: str) -> None:
        self.task = task
        self.name = name
        # Optional re-check used when resuming a finished job: given the node's restored
        # workspace, does this stop condition still hold? (see epoch_limiter)
        self.still_stopped: Callable[[Workspace], bool] | None = None

    @property
    def key(self) -> str:
        """A stable identifier: ``"<node>:<blob>"``."""
        return f"{self.task.node}:{self.name}"

    def fetch(self, session: Any = None) -> np.ndarray:
        """Return the blob's current value (a numpy array, 0-d for scalars) in ``session``'s
        workspace of the node (default: the session that last ran the task).

        Raises:
            JobDefinitionError: no session given and the task has never been run by one.
        """
        session = session if session is not None else self.task.last_session
        if session is None:
            raise JobDefinitionError(
                f"output {self.name!r} of task {self.task.name!r} was fetched before the task ran"
            )
        try:
            return session.workspace(self.task.node)[self.name]
        except KeyError:
            raise JobDefinitionError(
                f"output {self.name!r} of task {self.task.name!r} on node {self.task.node!r} "
                "was not set by the task"
            ) from None

    def __repr__(self) -> str:
        return f"TaskOutput({self.key!r})"


class Task:
    """One unit of work on one node: ``fn(ws)`` run against that node's workspace.

    Args:
        fn: called with the node's (or a PRIVATE child) workspace; ``None`` for a task that only
            declares outputs.
        name: shown in logs and the Prefect UI; defaults to ``fn.__name__``.
        outputs: blob names this task produces. In a PRIVATE group they survive the group run.
        group: the group to join; defaults to the active ``with group:``, else the current job's
            epoch group, else none (run it directly with ``session.run(task)``).
        node: defaults to the active ``with Node(...)``.
        workspace_type: defaults to the group's type, else PRIVATE.
        on_result: called with what ``fn`` returned, in the process that runs the group, once
            every node of the group has finished (a session delivers it, see
            :func:`caffe2ckpt.session.run_group`). On a remote session the value travels back
            from the node's worker, so keep it small.
    """

    def __init__(
        self,
        fn: Callable[[Workspace], Any] | None = None,
        *,
        name: str | None = None,
        outputs: Iterable[str] = (),
        group: TaskGroup | None = None,
        node: str | Node | None = None,
        workspace_type: WorkspaceType | None = None,
        on_result: Callable[[Any], None] | None = None,
    ) -> None:
        if fn is not None and not callable(fn):
            raise JobDefinitionError(f"Task fn must be callable, got {fn!r}")
        self.fn = fn
        self.node = str(node) if node is not None else Node.current()
        self.name = name or getattr(fn, "__name__", None) or f"task_{next(_task_ids)}"
        self._outputs = [TaskOutput(self, check_blob_name(o)) for o in outputs]
        self.workspace_type = workspace_type
        self.on_result = on_result
        self.last_session: Session | None = None
        group = group if group is not None else TaskGroup.current()
        if group is None and _job_stack.get():
            group = Job.current().epoch_group
        self.group = group
        if group is not None:
            group.add(self)

    def outputs(self) -> list[TaskOutput]:
        """The task's declared outputs, in declaration order."""
        return list(self._outputs)

    def output_names(self) -> list[str]:
        return [o.name for o in self._outputs]

    def __repr__(self) -> str:
        return f"Task({self.name!r}, node={self.node!r})"


class TaskGroup(_Stacked):
    """Tasks that run together: all nodes concurrently, each node's tasks in creation order.

    Its workspace type is fixed by the constructor or by its first task (PRIVATE if neither
    says); mixing types in one group is an error. ``epoch`` names the epoch a checkpoint
    operation acts on (sessions label its runs with it; None: the epoch the job is in).
    """

    _stack = _group_stack

    def __init__(self, workspace_type: WorkspaceType | None = None, *, name: str = "group",
                 epoch: int | None = None) -> None:
        self.workspace_type = workspace_type
        self.name = name
        self.epoch = epoch
        self.tasks: list[Task] = []

    def add(self, task: Task) -> None:
        """Add ``task`` to this group, fixing or checking the group's workspace type."""
        wanted = task.workspace_type or self.workspace_type or WorkspaceType.PRIVATE
        if self.workspace_type is None:
            self.workspace_type = wanted
        elif wanted is not self.workspace_type:
            raise JobDefinitionError(
                f"task {task.name!r} is {wanted.value} but group {self.name!r} is "
                f"{self.workspace_type.value}; a group cannot mix workspace types"
            )
        task.workspace_type = self.workspace_type
        self.tasks.append(task)

    def used_nodes(self) -> list[str]:
        """Node names of this group's tasks, in order of first appearance."""
        return list(dict.fromkeys(t.node for t in self.tasks))

    def tasks_by_node(self) -> dict[str, list[Task]]:
        """This group's tasks per node, each list in creation order."""
        by_node: dict[str, list[Task]] = {n: [] for n in self.used_nodes()}
        for task in self.tasks:
            by_node[task.node].append(task)
        return by_node

    def __enter__(self) -> TaskGroup:
        self._push(self)
        return self

    def __exit__(self, *exc: object) -> None:
        self._pop()

    @staticmethod
    def current() -> TaskGroup | None:
        stack = _group_stack.get()
        return stack[-1] if stack else None

    def __repr__(self) -> str:
        return f"TaskGroup({self.name!r}, {len(self.tasks)} tasks)"


class Job(_Stacked):
    """A checkpointable job: four task groups and the conditions that end its epoch loop.

    ``with Job() as job:`` makes the job current and its epoch group the active group, so tasks
    created in the block run every epoch; enter ``job.init_group`` (and the others) explicitly.

    Example:
        >>> with Job(name="demo") as job:
        ...     with Node("trainer_0"):
        ...         with job.init_group:
        ...             Task(lambda ws: ws.update(w=np.zeros(3)), name="init")
        ...         Task(lambda ws: ws.update(w=ws["w"] + 1), name="step")
        ...         epoch_limiter(job, 2)
        >>> job.nodes_to_checkpoint()
        ['trainer_0']
    """

    _stack = _job_stack

    def __init__(
        self,
        init_group: TaskGroup | None = None,
        epoch_group: TaskGroup | None = None,
        download_group: TaskGroup | None = None,
        exit_group: TaskGroup | None = None,
        stop_conditions: Sequence[TaskOutput] | None = None,
        nodes_to_checkpoint: Sequence[str] | None = None,
        name: str | None = None,
    ) -> None:
        self.name = name or "job"
        self.init_group = init_group or TaskGroup(WorkspaceType.GLOBAL, name="init_group")
        self.epoch_group = epoch_group or TaskGroup(name="epoch_group")
        self.download_group = download_group or TaskGroup(name="download_group")
        self.exit_group = exit_group or TaskGroup(name="exit_group")
        self.stop_conditions: list[TaskOutput] = list(stop_conditions or [])
        self.metrics: dict[str, TaskOutput] = {}  # recorded with every epoch's checkpoint
        self._nodes_to_checkpoint = [str(n) for n in nodes_to_checkpoint or []]
        self._limiters = 0
        self.max_epochs: int | None = None  # the tightest epoch_limiter, for progress reports

    def __enter__(self) -> Job:
        self.epoch_group.__enter__()
        self._push(self)
        return self

    def __exit__(self, *exc: object) -> None:
        self._pop()
        self.epoch_group.__exit__(*exc)

    @staticmethod
    def current() -> Job:
        """The innermost active job.

        Raises:
            JobDefinitionError: outside any ``with Job()`` block.
        """
        stack = _job_stack.get()
        if not stack:
            raise JobDefinitionError("Job.current() called outside a 'with Job()' block")
        return stack[-1]

    def add_stop_condition(self, output: TaskOutput | str) -> TaskOutput:
        """Stop the epoch loop after an epoch in which ``output`` holds any true element.

        ``output`` is a :class:`TaskOutput` or the name of a blob on the current node (it is then
        declared as the output of an empty task in the epoch group).
        """
        output = self._as_output(output, "stop", "a stop condition")
        self.stop_conditions.append(output)
        return output

    def _as_output(self, output: TaskOutput | str, prefix: str, what: str) -> TaskOutput:
        if isinstance(output, str):  # an empty epoch-group task declaring the blob
            task = Task(None, name=f"{prefix}:{output}", outputs=[output], group=self.epoch_group)
            output = task.outputs()[0]
        if not isinstance(output, TaskOutput):
            raise JobDefinitionError(f"{what} must be a TaskOutput or a blob name, got {output!r}")
        return output

    def add_metric(self, name: str, output: TaskOutput | str) -> TaskOutput:
        """Record ``output`` (a scalar) as metric ``name`` in every epoch's commit record.

        ``output`` is a :class:`TaskOutput` or a blob name on the current node, as for
        :meth:`add_stop_condition`. Metrics drive best-N retention and show in the Prefect
        checkpoint table and ``caffe2ckpt ls``.
        """
        if not isinstance(name, str) or not name:
            raise JobDefinitionError(f"a metric needs a non-empty name, got {name!r}")
        output = self._as_output(output, "metric", f"metric {name!r}")
        self.metrics[name] = output
        return output

    def fetch_metrics(self, session: Any = None) -> dict[str, float]:
        """The current value of every metric (in ``session``'s workspaces, given one: a resume
        from worker memory reads them before any task ran).

        Raises:
            JobDefinitionError: a metric is not a single number.
        """
        values = {}
        for name, output in self.metrics.items():
            value = np.asarray(output.fetch(session))
            if value.size != 1 or value.dtype.kind not in "biuf":
                raise JobDefinitionError(f"metric {name!r} ({output.key}) must be one real "
                                         f"number, got {value.dtype} of shape {value.shape}")
            values[name] = float(value.reshape(()))
        return values

    def nodes_to_checkpoint(self) -> list[str]:
        """The explicit node list if one was given, else the init group's nodes."""
        return list(self._nodes_to_checkpoint) or self.init_group.used_nodes()

    def compile(self, session_class: type | None = None) -> None:
        """Validate the job and freeze its node list (the job object stays the same).

        Raises:
            JobDefinitionError: the job has no stop condition (it would never end).
        """
        if not self.stop_conditions:
            raise JobDefinitionError(
                f"job {self.name!r} has no stop condition and would loop forever; "
                "add one with epoch_limiter(job, n) or job.add_stop_condition(...)"
            )
        self._nodes_to_checkpoint = self.nodes_to_checkpoint()

    def __repr__(self) -> str:
        return f"Job({self.name!r})"


def epoch_limiter(job: Job, num_epochs: int) -> TaskOutput:
    """Stop ``job`` after exactly ``num_epochs`` epochs, counted across resumes.

    The count of epochs run lives in a blob created by the init group, so it is checkpointed and
    restored; the limit itself is not, so re-running a finished job with a larger ``num_epochs``
    trains on up to the new limit, and re-running it unchanged runs no epoch. The tasks go on the
    active node, else on the job's first node.

    Returns:
        The stop condition's output.
    """
    if isinstance(num_epochs, bool) or not isinstance(num_epochs, (int, np.integer)):
        raise JobDefinitionError(f"num_epochs must be an int, got {num_epochs!r}")
    if num_epochs < 1:
        raise JobDefinitionError(f"num_epochs must be >= 1, got {num_epochs}")
    limit = int(num_epochs)
    if _node_stack.get():
        node = Node.current()
    elif job.init_group.used_nodes():
        node = job.init_group.used_nodes()[0]
    else:
        node = DEFAULT_NODE
    index = job._limiters
    job._limiters += 1
    job.max_epochs = limit if job.max_epochs is None else min(job.max_epochs, limit)
    count_name = f"epoch_limiter.{index}/epochs_done"
    stop_name = f"epoch_limiter.{index}/stop"

    def init_count(ws: Workspace) -> None:
        ws[count_name] = np.int64(0)

    def count_epoch(ws: Workspace) -> None:
        ws[count_name] = ws[count_name] + 1
        ws[stop_name] = bool(ws[count_name] >= limit)

    Task(init_count, name="epoch_limiter_init", group=job.init_group, node=node)
    task = Task(
        count_epoch, name="epoch_limiter", outputs=[stop_name], group=job.epoch_group, node=node
    )
    stop = job.add_stop_condition(task.outputs()[0])
    stop.still_stopped = lambda ws: bool(ws[count_name] >= limit)
    return stop
