"""Prefect integration: the only part of caffe2ckpt that imports prefect.

- :class:`PrefectSession` runs each node's share of a task group as a Prefect task run;
- :func:`run_job` is the one-liner for a flow body, with an attempt cap for crash retries;
- :func:`plan_run` says where a flow run starts and where it stops (e.g. N more epochs per run);
- :class:`CheckpointArtifacts` keeps the checkpoint table, progress and summary artifacts;
- :func:`create_crash_retry_automation` re-schedules crashed runs of a deployment, and
  :func:`create_heartbeat_crash_automation` marks runs whose heartbeats stopped *Crashed*;
- :func:`create_epoch_deployment_automation` runs a deployment every k-th committed epoch,
  :func:`create_metric_deployment_automation` when a committed epoch's metric crosses a
  threshold, and :func:`create_checkpoint_alert_automation` notifies when a save fails or
  damage is found;
- :class:`CheckpointStorage` is a block for a checkpoint prefix with secret storage options;
  it, Prefect's ``RemoteFileSystem``, prefect-aws's ``S3Bucket`` and ``prefect-block://``
  references are accepted wherever a checkpoint prefix is (:mod:`.blocks`);
- checkpoint events (an epoch committed, a save failed, a run resumed, damage found, gc
  finished) become Prefect events once this package is imported (:mod:`.events`);
- :func:`temporary_server` runs a block on Prefect's temporary server, stopped even on SIGKILL;
- :func:`planned_failures` logs a planned failure (a demo, a drill) as one WARNING;
- :func:`quiet_task_runs` keeps task runs' INFO lines off the console (not out of the logs).

Importing this package makes caffe2ckpt's own log lines flow run logs (whichever of prefect and
this package is imported first) and turns off the analytics of a temporary server started from
this process, unless ``PREFECT_SERVER_ANALYTICS_ENABLED`` is set: see
:func:`caffe2ckpt.prefect._environment.apply`.
"""

from caffe2ckpt.prefect import _environment

_environment.apply()  # before the modules below import prefect

from caffe2ckpt.prefect.artifacts import CheckpointArtifacts, artifact_key  # noqa: E402
from caffe2ckpt.prefect.automations import (  # noqa: E402
    create_checkpoint_alert_automation,
    create_crash_retry_automation,
    create_epoch_deployment_automation,
    create_heartbeat_crash_automation,
    create_metric_deployment_automation,
)
from caffe2ckpt.prefect.console import quiet_task_runs  # noqa: E402
from caffe2ckpt.prefect.flow import AttemptLimitExceeded, RunPlan, plan_run, run_job  # noqa: E402
from caffe2ckpt.prefect.localserver import temporary_server  # noqa: E402
from caffe2ckpt.prefect import plugin  # noqa: E402
from caffe2ckpt.prefect.blocks import CheckpointStorage  # noqa: E402
from caffe2ckpt.prefect.planned import planned_failures  # noqa: E402
from caffe2ckpt.prefect.session import PrefectSession, in_flow_run  # noqa: E402

plugin.install()  # checkpoint events become Prefect events; blocks name checkpoint prefixes

__all__ = [
    "AttemptLimitExceeded",
    "CheckpointArtifacts",
    "CheckpointStorage",
    "PrefectSession",
    "RunPlan",
    "artifact_key",
    "create_checkpoint_alert_automation",
    "create_crash_retry_automation",
    "create_epoch_deployment_automation",
    "create_heartbeat_crash_automation",
    "create_metric_deployment_automation",
    "in_flow_run",
    "plan_run",
    "planned_failures",
    "quiet_task_runs",
    "run_job",
    "temporary_server",
]
