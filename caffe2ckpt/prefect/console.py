"""Keep task runs' routine lines off the terminal; the flow run logs keep all of them.

Prefect echoes every record of its ``prefect.task_runs`` logger to the console (its console
handler sits on the root logger): with one task run per node, group and epoch that is a
"Finished in state Completed()" line per task run, and each ``print`` of a task run under
``log_prints``. :func:`quiet_task_runs` puts a filter on Prefect's console handlers that drops
the task-run records below WARNING. Nothing else changes: the same records still reach the API
(the run's logs in the UI, ``prefect flow-run logs``), task-run warnings and errors still reach
the terminal, and flow-run and caffe2ckpt lines (one per epoch) are echoed as before.

A storage outage would otherwise fill the terminal with tracebacks: each failed checkpoint task
run (``checkpoint_save[trainer_0] e7``) logs one at ERROR, and aiohttp leaves a "Task exception
was never retrieved" traceback from asyncio per dropped connection, while the runner's one
WARNING line per failed save says it all (with ``on_save_error="raise"``, the flow run's failure
shows the error). So, in a flow run, :class:`~caffe2ckpt.prefect.PrefectSession` calls
:func:`keep_tracebacks_in_run_logs`: Prefect's console handlers skip those records, and the flow
run's logs keep them (the task runs' through Prefect's API log handler as before, asyncio's
sent to it by the filter).
"""

from __future__ import annotations

import copy
import logging

from prefect.logging.handlers import APILogHandler, PrefectConsoleHandler

__all__ = ["keep_tracebacks_in_run_logs", "quiet_task_runs"]

_TASK_RUNS = "prefect.task_runs"
_CHECKPOINT_TASKS = "checkpoint_"  # the managers' groups: checkpoint_save, checkpoint_wait, ...
_NETWORK_LIBRARIES = ("aiohttp", "aiobotocore", "botocore")


class _QuietTaskRuns(logging.Filter):
    """Drops ``prefect.task_runs`` records below WARNING."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING or not (
            record.name == _TASK_RUNS or record.name.startswith(_TASK_RUNS + "."))


_FILTER = _QuietTaskRuns()


class _RunLogsOnly(logging.Filter):
    """Keeps off the console the tracebacks of failed checkpoint task runs and asyncio's
    unretrieved network errors; sends the latter to the logs of flow run :attr:`flow_run_id`."""

    def __init__(self) -> None:
        super().__init__()
        self.flow_run_id: str | None = None
        self._api = APILogHandler()

    def filter(self, record: logging.LogRecord) -> bool:
        if _failed_checkpoint_task(record):
            return False  # prefect.task_runs' own API log handler sent it to the run's logs
        if self.flow_run_id is None or not _unretrieved_network_error(record):
            return True
        sent = copy.copy(record)
        sent.flow_run_id = self.flow_run_id
        self._api.handle(sent)
        return False


def _failed_checkpoint_task(record: logging.LogRecord) -> bool:
    return (record.levelno >= logging.ERROR and record.name.startswith(_TASK_RUNS)
            and str(getattr(record, "task_name", "")).startswith(_CHECKPOINT_TASKS))


def _unretrieved_network_error(record: logging.LogRecord) -> bool:
    """asyncio's report of a task's exception that nobody retrieved (aiohttp's writes on a
    connection that was cut), when it is a network error."""
    exc = record.exc_info[1] if record.name == "asyncio" and record.exc_info else None
    return exc is not None and (isinstance(exc, OSError) or type(exc).__module__.startswith(
        _NETWORK_LIBRARIES))


_RUN_LOGS = _RunLogsOnly()


def _console_handlers() -> list[PrefectConsoleHandler]:
    return [h for h in logging.getLogger().handlers if isinstance(h, PrefectConsoleHandler)]


def quiet_task_runs(quiet: bool = True) -> int:
    """Stop (``quiet=False``: resume) echoing task runs' INFO and DEBUG lines to the console.

    Applies to the Prefect console handlers on the root logger now (call it after Prefect set
    its logging up, e.g. after importing ``caffe2ckpt.prefect``; calling it again is harmless).
    Returns how many console handlers it changed: 0 means Prefect's logging has no console
    handler in this process (a custom logging configuration), so nothing was quieted.
    """
    handlers = _console_handlers()
    for handler in handlers:
        if quiet:
            handler.addFilter(_FILTER)  # a no-op when it is there already
        else:
            handler.removeFilter(_FILTER)
    return len(handlers)


def keep_tracebacks_in_run_logs(flow_run_id: str) -> int:
    """From now on, keep the tracebacks of failed checkpoint task runs and asyncio's unretrieved
    network errors off Prefect's console handlers; the latter go to the logs of flow run
    ``flow_run_id`` instead (see the module's docstring). Returns how many console handlers it
    changed, as :func:`quiet_task_runs` does."""
    _RUN_LOGS.flow_run_id = flow_run_id
    handlers = _console_handlers()
    for handler in handlers:
        handler.addFilter(_RUN_LOGS)
    return len(handlers)
