"""Prefect integration: the only part of caffe2ckpt that imports prefect.

- :class:`PrefectSession` runs each node's share of a task group as a Prefect task run;
- :func:`run_job` is the one-liner for a flow body, with an attempt cap for crash retries;
- :func:`plan_run` says where a flow run starts and where it stops (e.g. N more epochs per run);
- :class:`CheckpointArtifacts` keeps the checkpoint table, progress and summary artifacts;
- :func:`create_crash_retry_automation` re-schedules crashed runs of a deployment;
- :func:`temporary_server` runs a block on Prefect's temporary server, stopped even on SIGKILL.

caffe2ckpt's own log lines reach the flow run logs: importing this package adds ``caffe2ckpt``
to ``PREFECT_LOGGING_EXTRA_LOGGERS`` (for processes started from this one) and gives the
``caffe2ckpt`` logger the handlers Prefect gives its extra loggers, whichever of prefect and
this package was imported first. It also
turns off the analytics of a temporary server started from this process, unless
``PREFECT_SERVER_ANALYTICS_ENABLED`` is set.
"""

import logging
import os

_extra = [n for n in os.environ.get("PREFECT_LOGGING_EXTRA_LOGGERS", "").split(",") if n]
if "caffe2ckpt" not in _extra:
    os.environ["PREFECT_LOGGING_EXTRA_LOGGERS"] = ",".join([*_extra, "caffe2ckpt"])
# caffe2ckpt also runs outside flows (LocalSession): its log lines there are not flow run logs.
os.environ.setdefault("PREFECT_LOGGING_TO_API_WHEN_MISSING_FLOW", "ignore")
# The temporary server this process may start inherits the environment: without this, its
# analytics service logs an ERROR on every start offline ("Failed to send telemetry") and can
# hold the new database's lock during a first run ("database is locked"). Set it to "true" to
# keep Prefect's analytics.
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")

from caffe2ckpt.prefect.artifacts import CheckpointArtifacts, artifact_key  # noqa: E402
from caffe2ckpt.prefect.flow import (  # noqa: E402
    AttemptLimitExceeded,
    RunPlan,
    create_crash_retry_automation,
    plan_run,
    run_job,
)
from caffe2ckpt.prefect.localserver import temporary_server  # noqa: E402
from caffe2ckpt.prefect.session import PrefectSession, in_flow_run  # noqa: E402

# Prefect hands the handlers of "prefect.extra" (the flow run log shipper among them) to the
# extra loggers when it sets up logging, at its import: if prefect was imported before this
# package, caffe2ckpt was not among them yet, so hand them over here (once each). It does not
# hand over the level; without it caffe2ckpt's INFO lifecycle lines ("Resuming from epoch 6
# ...") would be filtered out by the root level.
_ours, _extra_logger = logging.getLogger("caffe2ckpt"), logging.getLogger("prefect.extra")
for _handler in _extra_logger.handlers:
    if _handler not in _ours.handlers:
        _ours.addHandler(_handler)
if _ours.level == logging.NOTSET:
    _ours.setLevel(_extra_logger.getEffectiveLevel())

__all__ = [
    "AttemptLimitExceeded",
    "CheckpointArtifacts",
    "PrefectSession",
    "RunPlan",
    "artifact_key",
    "create_crash_retry_automation",
    "in_flow_run",
    "plan_run",
    "run_job",
    "temporary_server",
]
