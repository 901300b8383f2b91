"""Planned failures (demos, fault drills) logged as what they are: one WARNING, no tracebacks.

A task that raises makes Prefect log an ERROR with a traceback for its task run, an ERROR for
the task run's final state and, for the flow run, one more ERROR with a traceback: for the
example's ``--fail-at-epoch`` demo with two nodes, five ERROR lines and three tracebacks before
the line that matters. Inside :func:`planned_failures` the ERROR lines of the task runs that
raised an exception of the given types are dropped, and the flow run's line becomes one WARNING
that says the failure was planned and which attempt comes next. The task runs still end
*Failed* in the UI (the flow run shows Prefect's *AwaitingRetry*); only the logs change. A
failure with no retry left is logged as Prefect logs it.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

from prefect.context import FlowRunContext

__all__ = ["planned_failures"]

_TASK_RUNS, _FLOW_RUNS = "prefect.task_runs", "prefect.flow_runs"


class _Planned(logging.Filter):
    def __init__(self, types: tuple[type[BaseException], ...]) -> None:
        super().__init__()
        self.types = types
        self.failed_tasks: set[str] = set()  # task runs whose exception was planned

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.ERROR:
            return True
        exc = record.exc_info[1] if record.exc_info else None
        planned = isinstance(exc, self.types)
        attempts = _attempts()
        if attempts is None or attempts[0] >= attempts[1]:
            return True  # no retry left (or not in a flow run): a real failure
        if record.name == _TASK_RUNS:  # "failed with exception", then "Finished in state Failed"
            task_run = str(getattr(record, "task_run_id", ""))
            if planned:
                self.failed_tasks.add(task_run)
            return not (planned or task_run in self.failed_tasks)
        if not planned:
            return True
        record.levelno, record.levelname = logging.WARNING, "WARNING"
        record.msg = ("Planned failure (%s: %s); Prefect retries the flow run: attempt %d of %d "
                      "resumes from the newest committed epoch")
        record.args = (type(exc).__name__, exc, attempts[0] + 1, attempts[1])
        record.exc_info = record.exc_text = None
        return True


def _attempts() -> tuple[int, int] | None:
    """(this attempt, attempts in all) of the current flow run, if any."""
    context = FlowRunContext.get()
    if context is None or context.flow_run is None or context.flow is None:
        return None
    return context.flow_run.run_count, (context.flow.retries or 0) + 1


@contextlib.contextmanager
def planned_failures(*types: type[BaseException]) -> Iterator[None]:
    """Within the block, exceptions of ``types`` raised in flow and task runs are logged as
    planned: see the module docstring. Wrap the flow call: Prefect logs the flow run's
    failure after the flow function returns."""
    planned = _Planned(types)
    loggers = [logging.getLogger(name) for name in (_TASK_RUNS, _FLOW_RUNS)]
    for logger in loggers:
        logger.addFilter(planned)
    try:
        yield
    finally:
        for logger in loggers:
            logger.removeFilter(planned)
