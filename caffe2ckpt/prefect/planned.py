"""Planned failures (demos, fault drills) logged as what they are: one WARNING, no tracebacks.

A task that raises makes Prefect log an ERROR with a traceback for its task run, an ERROR for
the task run's final state and, for the flow run, one more ERROR with a traceback: for the
example's ``--fail-at-epoch`` demo with two nodes, five ERROR lines and three tracebacks before
the line that matters. Inside :func:`planned_failures` the task runs' lines about an exception of
the given types are dropped, and the flow run's line becomes one WARNING that says the failure
was planned and which attempt comes next. The task runs and the flow run still end *Failed* in
the UI; only the logs change. A failure with no retry left is logged as Prefect logs it.
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

    def _planned(self, record: logging.LogRecord) -> BaseException | None:
        exc = record.exc_info[1] if record.exc_info else None
        return exc if isinstance(exc, self.types) else None

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.ERROR:
            return True
        exc = self._planned(record)
        if record.name == _TASK_RUNS:  # "failed with exception" and "Finished in state Failed"
            return exc is None and not any(t.__name__ in record.getMessage() for t in self.types)
        if exc is None:
            return True
        context = FlowRunContext.get()
        if context is None or context.flow_run is None or context.flow is None:
            return True
        attempt, attempts = context.flow_run.run_count, (context.flow.retries or 0) + 1
        if attempt >= attempts:
            return True  # no retry left: a real failure
        record.levelno, record.levelname = logging.WARNING, "WARNING"
        record.msg = ("Planned failure (%s: %s); Prefect retries the flow run: attempt %d of %d "
                      "resumes from the newest committed epoch")
        record.args = (type(exc).__name__, exc, attempt + 1, attempts)
        record.exc_info = record.exc_text = None
        return True


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
