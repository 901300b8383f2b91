"""The parent task run of an epoch: ``epoch N``, under which Prefect nests the epoch's node task
runs, so a flow run's graph shows one expandable node per epoch.

It is a plain wrapper, with no retries of its own (whatever ``PREFECT_TASKS_DEFAULT_RETRIES``
says): an epoch that failed is never run again in place on workspaces it already changed; the
flow's retry resumes from the newest committed epoch instead. When a node task run fails, the
exception passes up through the parent, and Prefect would log it a second time there (an ERROR
with a traceback, and "Finished in state Failed"): :class:`_ReportedOnce` drops those two lines
of the parent when a node task run already logged that same exception. The parent still ends
*Failed* in the UI, and a failure of the epoch's own code (outside any node task run) is logged
by the parent as usual.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable
from typing import Any, TypeVar

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.utilities.annotations import quote

__all__ = ["EPOCH_TASK", "run_in_epoch_task"]

T = TypeVar("T")

EPOCH_TASK = "epoch"  #: the task's name; each run is named ``epoch N``
_TASK_RUNS = "prefect.task_runs"


@task(name=EPOCH_TASK, retries=0, cache_policy=NO_CACHE, persist_result=False,
      task_run_name="{label}")
def _epoch(label: str, body: Callable[[], Any]) -> Any:
    return body()


class _ReportedOnce(logging.Filter):
    """Drops an epoch parent's ERROR lines about an exception a node task run logged already."""

    def __init__(self) -> None:
        super().__init__()
        self.reported: collections.deque[BaseException] = collections.deque(maxlen=256)
        self.quiet_parents: collections.deque[str] = collections.deque(maxlen=256)

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.ERROR:
            return True
        exc = record.exc_info[1] if record.exc_info else None
        if getattr(record, "task_name", None) != EPOCH_TASK:
            if exc is not None:
                self.reported.append(exc)
            return True
        run = str(getattr(record, "task_run_id", ""))
        if exc is not None and any(exc is seen for seen in self.reported):
            self.quiet_parents.append(run)  # its "Finished in state Failed" line comes next
            return False
        return exc is not None or run not in self.quiet_parents


_FILTER = _ReportedOnce()


def run_in_epoch_task(epoch: int, body: Callable[[], T]) -> T:
    """Call ``body`` inside the parent task run ``epoch {epoch}``; its value or its exception."""
    logging.getLogger(_TASK_RUNS).addFilter(_FILTER)  # once: a no-op when it is there already
    return _epoch(f"epoch {epoch}", quote(body))
