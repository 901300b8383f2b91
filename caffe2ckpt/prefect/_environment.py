"""What importing :mod:`caffe2ckpt.prefect` changes in the process: one function, run once."""

from __future__ import annotations

import logging
import os


def apply() -> None:
    """Set caffe2ckpt's Prefect defaults, then make caffe2ckpt's log lines flow run logs.

    - ``PREFECT_LOGGING_EXTRA_LOGGERS`` gains ``caffe2ckpt`` (for this process's Prefect and for
      the processes it starts);
    - ``PREFECT_LOGGING_TO_API_WHEN_MISSING_FLOW=ignore`` unless set: caffe2ckpt also runs
      outside flows (``LocalSession``), where its log lines are not flow run logs;
    - ``PREFECT_SERVER_ANALYTICS_ENABLED=false`` unless set: a temporary server started from
      this process inherits the environment, and its analytics service otherwise logs an ERROR
      on every start offline ("Failed to send telemetry") and can hold a new database's lock
      during a first run ("database is locked"). Set it to "true" to keep Prefect's analytics;
    - ``PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS=120`` unless set: Prefect's 20 s is
      too short for a temporary server on a busy 2-core machine (a first run timed out). Like
      the analytics switch, it counts only if this package is imported before prefect;
    - the ``caffe2ckpt`` logger gets the handlers Prefect gives its extra loggers (the flow run
      log shipper among them) and their level. Prefect hands them over when it sets up logging,
      on its first import; if prefect was imported before this package, caffe2ckpt was not
      among its extra loggers yet, so they are handed over here, for records inside flow and
      task runs only (:class:`_InRuns`). Prefect does not hand over the level; without it the
      INFO lifecycle lines ("Resuming from epoch 6 ...") would be filtered out by the root level;
    - Prefect's wait at exit for its events worker's queue is bounded (:func:`_bound_exit_wait`).
    """
    extra = [n for n in os.environ.get("PREFECT_LOGGING_EXTRA_LOGGERS", "").split(",") if n]
    if "caffe2ckpt" not in extra:
        os.environ["PREFECT_LOGGING_EXTRA_LOGGERS"] = ",".join([*extra, "caffe2ckpt"])
    os.environ.setdefault("PREFECT_LOGGING_TO_API_WHEN_MISSING_FLOW", "ignore")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")

    import prefect.main  # noqa: F401 - sets Prefect's logging up (unless it was already)

    ours, shared = logging.getLogger("caffe2ckpt"), logging.getLogger("prefect.extra")
    present = {getattr(h, "target", h) for h in ours.handlers}  # handed over, or forwarded
    for handler in shared.handlers:
        if handler not in present:  # prefect came first: its settings predate the defaults above
            ours.addHandler(_InRuns(handler))
    if ours.level == logging.NOTSET:
        ours.setLevel(shared.getEffectiveLevel())
    _bound_exit_wait()


def _bound_exit_wait() -> None:
    """Make the process's exit wait at most 10 s for its queued events.

    At exit Prefect drains each events worker it started with no time limit: with an API that
    accepts connections and never answers, its websocket's reconnection attempts held a
    script's exit about 2 minutes (measured: 123 s). Each worker started from now on drains at exit through
    :meth:`caffe2ckpt.prefect.events.PrefectPublisher.flush` instead, which waits at most
    10 s for every worker at once; a worker it drained (the command line's, after printing) is
    not waited for again. Nothing else about Prefect's exit changes.
    """
    from prefect.events.worker import EventsWorker

    EventsWorker._at_exit = _flush_at_exit  # registered by each worker as it starts


def _flush_at_exit(worker: object) -> None:
    from caffe2ckpt.prefect.events import PrefectPublisher

    PrefectPublisher().flush()


class _InRuns(logging.Handler):
    """Hands records to one of Prefect's handlers inside flow and task runs only: outside them
    Prefect's API log handler would warn on every line (``PREFECT_LOGGING_TO_API_WHEN_MISSING_FLOW``
    was read before this package could set it)."""

    def __init__(self, target: logging.Handler) -> None:
        super().__init__()
        self.target = target

    def emit(self, record: logging.LogRecord) -> None:
        from prefect.context import FlowRunContext, TaskRunContext

        if FlowRunContext.get() is not None or TaskRunContext.get() is not None:
            self.target.handle(record)
