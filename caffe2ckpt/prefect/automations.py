"""Automations for runs whose process died: re-run crashed deployment runs, and mark runs that
went silent *Crashed*.

A deployment's worker marks its run *Crashed* when the run's process exits, and
:func:`create_crash_retry_automation` puts such runs back to ``AwaitingRetry`` so a worker runs
the *same* flow run again in a new process (pair it with ``run_job(..., max_attempts=N)``:
automations have no attempt limit). A run with no worker watching it (a flow called directly on
a real server, or a machine that is gone with its worker) is noticed only by its silence: every
flow run sends a ``prefect.flow-run.heartbeat`` event every ``PREFECT_FLOWS_HEARTBEAT_FREQUENCY``
seconds (180 by default), and :func:`create_heartbeat_crash_automation` marks a run *Crashed*
when neither another heartbeat nor a final state follows within a window.
"""

from __future__ import annotations

import logging
from datetime import timedelta
from uuid import UUID

from prefect.automations import Automation
from prefect.client.schemas.objects import StateType
from prefect.events.actions import ChangeFlowRunState
from prefect.events.schemas.automations import EventTrigger, Posture
from prefect.events.schemas.events import ResourceSpecification

from caffe2ckpt.errors import JobDefinitionError

__all__ = ["create_crash_retry_automation", "create_heartbeat_crash_automation"]

logger = logging.getLogger(__name__)

FINAL_EVENTS = {"prefect.flow-run.Completed", "prefect.flow-run.Failed",
                "prefect.flow-run.Cancelled", "prefect.flow-run.Crashed"}
SILENT_MESSAGE = "no heartbeat: its process is gone"


def create_crash_retry_automation(deployment_id: UUID | str, *, name: str | None = None) -> UUID:
    """Create an automation that re-schedules crashed runs of one deployment (same run id).

    Pair it with ``run_job(..., max_attempts=N)``: each re-run increments ``run_count``, and the
    flow refuses to run past N, ending in *Failed* rather than looping.

    Returns:
        The automation's id.
    """
    automation = Automation(
        name=name or f"caffe2ckpt-retry-crashed-{deployment_id}",
        description="Put crashed flow runs of this deployment back to AwaitingRetry "
                    "(caffe2ckpt resumes them from the newest committed epoch)",
        trigger=EventTrigger(
            expect={"prefect.flow-run.Crashed"},
            match_related={"prefect.resource.id": f"prefect.deployment.{deployment_id}"},
            for_each={"prefect.resource.id"},
            posture=Posture.Reactive,
            threshold=1,
            within=0,
        ),
        actions=[ChangeFlowRunState(state=StateType.SCHEDULED, name="AwaitingRetry",
                                    message="caffe2ckpt: retrying a crashed run")],
    ).create()
    logger.info("created automation %s for crashed runs of deployment %s", automation.id,
                deployment_id)
    return automation.id


def create_heartbeat_crash_automation(within: timedelta = timedelta(minutes=10), *,
                                      name: str = "caffe2ckpt-crash-silent-runs") -> UUID:
    """Create an automation that marks *Crashed* every flow run whose heartbeats stopped.

    A flow run that sent a ``prefect.flow-run.heartbeat`` and then, for ``within``, neither
    another heartbeat nor a final state is marked *Crashed* ("no heartbeat: its process is
    gone"); its end time is when the automation fires, not the moment its process died. Make
    ``within`` a few heartbeat periods (``PREFECT_FLOWS_HEARTBEAT_FREQUENCY``, 180 s by
    default): a shorter window crashes live runs between two heartbeats.

    Returns:
        The automation's id.

    Raises:
        JobDefinitionError: ``within`` is not a positive duration.
    """
    if not isinstance(within, timedelta) or within <= timedelta(0):
        raise JobDefinitionError(f"create_heartbeat_crash_automation: within must be a positive "
                                 f"timedelta, got {within!r}")
    automation = Automation(
        name=name,
        description="Mark flow runs whose heartbeats stopped Crashed (caffe2ckpt)",
        trigger=EventTrigger(
            after={"prefect.flow-run.heartbeat"},
            expect={"prefect.flow-run.heartbeat", *FINAL_EVENTS},
            match=ResourceSpecification({"prefect.resource.id": ["prefect.flow-run.*"]}),
            for_each={"prefect.resource.id"},
            posture=Posture.Proactive,
            threshold=1,
            within=within,
        ),
        actions=[ChangeFlowRunState(state=StateType.CRASHED, message=SILENT_MESSAGE)],
    ).create()
    logger.info("created automation %s: flow runs silent for %s are marked Crashed",
                automation.id, within)
    return automation.id
