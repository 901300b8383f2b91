"""Keep task runs' routine lines off the terminal; the flow run logs keep all of them.

Prefect echoes every record of its ``prefect.task_runs`` logger to the console (its console
handler sits on the root logger): with one task run per node, group and epoch that is a
"Finished in state Completed()" line per task run, and each ``print`` of a task run under
``log_prints``. :func:`quiet_task_runs` puts a filter on Prefect's console handlers that drops
the task-run records below WARNING. Nothing else changes: the same records still reach the API
(the run's logs in the UI, ``prefect flow-run logs``), task-run warnings and errors still reach
the terminal, and flow-run and caffe2ckpt lines (one per epoch) are echoed as before.
"""

from __future__ import annotations

import logging

from prefect.logging.handlers import PrefectConsoleHandler

__all__ = ["quiet_task_runs"]

_TASK_RUNS = "prefect.task_runs"


class _QuietTaskRuns(logging.Filter):
    """Drops ``prefect.task_runs`` records below WARNING."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING or not (
            record.name == _TASK_RUNS or record.name.startswith(_TASK_RUNS + "."))


_FILTER = _QuietTaskRuns()


def quiet_task_runs(quiet: bool = True) -> int:
    """Stop (``quiet=False``: resume) echoing task runs' INFO and DEBUG lines to the console.

    Applies to the Prefect console handlers on the root logger now (call it after Prefect set
    its logging up, e.g. after importing ``caffe2ckpt.prefect``; calling it again is harmless).
    Returns how many console handlers it changed: 0 means Prefect's logging has no console
    handler in this process (a custom logging configuration), so nothing was quieted.
    """
    handlers = [h for h in logging.getLogger().handlers if isinstance(h, PrefectConsoleHandler)]
    for handler in handlers:
        if quiet:
            handler.addFilter(_FILTER)  # a no-op when it is there already
        else:
            handler.removeFilter(_FILTER)
    return len(handlers)
