"""Automations: re-run crashed deployment runs, mark runs that went silent *Crashed*, run a
deployment when epochs commit, and raise the alarm when a save fails or damage is found.

A deployment's worker marks its run *Crashed* when the run's process exits, and
:func:`create_crash_retry_automation` puts such runs back to ``AwaitingRetry`` so a worker runs
the *same* flow run again in a new process (pair it with ``run_job(..., max_attempts=N)``:
automations have no attempt limit). A run with no worker watching it (a flow called directly on
a real server, or a machine that is gone with its worker) is noticed only by its silence: every
flow run sends a ``prefect.flow-run.heartbeat`` event every ``PREFECT_FLOWS_HEARTBEAT_FREQUENCY``
seconds (180 by default), and :func:`create_heartbeat_crash_automation` marks a run *Crashed*
when neither another heartbeat nor a final state follows within a window.

The other three react to caffe2ckpt's own events (:mod:`caffe2ckpt.prefect.events`):
:func:`create_epoch_deployment_automation` runs a deployment (an evaluation flow, an export)
when an epoch that is a multiple of k is committed, passing it the prefix and the epoch;
:func:`create_metric_deployment_automation` does so when a committed epoch's metric crosses a
threshold; and :func:`create_checkpoint_alert_automation` sends a notification through a
notification block (and, if asked, marks the flow run *Failed*) when a save fails or damage is
found.
"""

from __future__ import annotations

import logging
from datetime import timedelta
from uuid import UUID

from prefect.automations import Automation
from prefect.client.schemas.objects import StateType
from prefect.events.actions import Action, ChangeFlowRunState, RunDeployment, SendNotification
from prefect.events.schemas.automations import EventTrigger, Posture
from prefect.events.schemas.events import ResourceSpecification

from caffe2ckpt import events
from caffe2ckpt.errors import JobDefinitionError
from caffe2ckpt.prefect.events import EPOCH_LABEL, RESOURCE_PREFIX, resource_id
from caffe2ckpt.prefect.orderkey import METRIC_LABEL, finite_number, keys_above, keys_below

__all__ = ["create_checkpoint_alert_automation", "create_crash_retry_automation",
           "create_epoch_deployment_automation", "create_heartbeat_crash_automation",
           "create_metric_deployment_automation"]

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


# the epochs an every-k-th automation names by default: multiples of k up to this one
UP_TO_EPOCH = 10_000
ONCE_WINDOW = timedelta(days=3650)  # a once-only threshold automation fires once in this
FAILED_MESSAGE = ("caffe2ckpt: a checkpoint save failed or damage was found (the event is in "
                  "the Event Feed)")
ALERT_SUBJECT = "caffe2ckpt: {{ event.event }} for {{ event.resource['caffe2ckpt.url'] }}"
ALERT_BODY = ("{{ event.event }}: {{ event.payload.message }}\n"
              "checkpoint: {{ event.resource['caffe2ckpt.url'] }}\n"
              "epoch: {{ event.payload.epoch }}, node: {{ event.payload.node }}"
              "{% if event.payload.blob %}, blob: {{ event.payload.blob }}{% endif %}")


def _prefixes(checkpoint_url: str | None, **labels: list[str]) -> ResourceSpecification:
    """The checkpoint prefixes an automation watches: one (given as saved, e.g. its canonical
    URL ``file:///...`` for a folder) or, with None, all; and the resource ``labels``."""
    return ResourceSpecification({"prefect.resource.id": resource_id(checkpoint_url)
                                  if checkpoint_url else f"{RESOURCE_PREFIX}*", **labels})


def create_epoch_deployment_automation(deployment_id: UUID | str, *, every: int = 1,
                                       checkpoint_url: str | None = None,
                                       parameters: dict[str, object] | None = None,
                                       up_to_epoch: int = UP_TO_EPOCH,
                                       name: str | None = None) -> UUID:
    """Create an automation that runs deployment ``deployment_id`` when an epoch whose number
    is a multiple of ``every`` is committed (every epoch with ``every=1``; epoch 0, the save
    after init, only then), under any checkpoint prefix or under ``checkpoint_url`` only.

    The run gets two parameters from the event: ``checkpoint_url`` (the prefix, canonical: a
    folder is ``file:///...``) and ``epoch`` (the epoch just committed), plus ``parameters``.
    Prefect's triggers match labels, not arithmetic, so with ``every`` above 1 the automation
    lists the epochs it runs for: the multiples of ``every`` up to ``up_to_epoch``. A retried
    or re-run job that commits such an epoch again runs the deployment again.

    Returns:
        The automation's id.

    Raises:
        JobDefinitionError: ``every`` or ``up_to_epoch`` is not a positive int.
    """
    for what, value in (("every", every), ("up_to_epoch", up_to_epoch)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise JobDefinitionError(f"create_epoch_deployment_automation: {what} must be an "
                                     f"int >= 1, got {value!r}")
    epochs = {} if every == 1 else {
        EPOCH_LABEL: [str(e) for e in range(every, up_to_epoch + 1, every)]}
    automation_id = _run_on_commit(
        deployment_id, _prefixes(checkpoint_url, **epochs), parameters,
        name=name or f"caffe2ckpt-run-{deployment_id}-every-{every}-epochs",
        description=f"Run deployment {deployment_id} when an epoch that is a multiple of "
                    f"{every} is committed (caffe2ckpt)")
    logger.info("created automation %s: committed epochs that are multiples of %d run "
                "deployment %s", automation_id, every, deployment_id)
    return automation_id


def create_metric_deployment_automation(deployment_id: UUID | str, *, metric: str,
                                        below: float | None = None, above: float | None = None,
                                        once: bool = True, checkpoint_url: str | None = None,
                                        parameters: dict[str, object] | None = None,
                                        name: str | None = None) -> UUID:
    """Create an automation that runs deployment ``deployment_id`` when an epoch is committed
    whose ``metric`` (a job metric its commit records carry, e.g. ``"loss"``) is strictly
    ``below`` (or ``above``: give one) the threshold, under any checkpoint prefix or under
    ``checkpoint_url`` only, with the parameters of :func:`create_epoch_deployment_automation`.

    With ``once`` (the default) the deployment runs for the first such epoch of each checkpoint
    prefix only: Prefect's trigger fires, then waits out a window of :data:`ONCE_WINDOW`
    (create the automation again to re-arm it). "First" is the first event the server takes:
    epochs committed within a second of each other may reach it in either order. With
    ``once=False`` every such epoch runs it. An epoch whose metric is NaN or infinite, or that
    has no such metric, runs nothing. (Prefect's triggers compare labels, not numbers: the
    trigger lists the prefixes of every order key on the threshold's side,
    :mod:`caffe2ckpt.prefect.orderkey`.)

    Returns:
        The automation's id.

    Raises:
        JobDefinitionError: not exactly one of ``below`` and ``above`` is given as a finite
            number, or ``metric`` is not a non-empty string.
    """
    if not isinstance(metric, str) or not metric:
        raise JobDefinitionError(f"create_metric_deployment_automation: metric must be a "
                                 f"metric's name, got {metric!r}")
    side, threshold = _threshold(below, above)
    patterns = keys_below(threshold) if side == "below" else keys_above(threshold)
    automation_id = _run_on_commit(
        deployment_id, _prefixes(checkpoint_url, **{METRIC_LABEL + metric: patterns}),
        parameters, within=ONCE_WINDOW if once else timedelta(0),
        name=name or f"caffe2ckpt-run-{deployment_id}-when-{metric}-{side}-{threshold:g}",
        description=f"Run deployment {deployment_id} when an epoch is committed whose "
                    f"{metric} is {side} {threshold!r}{' (once)' if once else ''} (caffe2ckpt)")
    logger.info("created automation %s: committed epochs whose %s is %s %r run deployment %s",
                automation_id, metric, side, threshold, deployment_id)
    return automation_id


def _threshold(below: float | None, above: float | None) -> tuple[str, float]:
    """``("below" | "above", the threshold)`` of the two arguments, exactly one given."""
    given = [(side, value) for side, value in (("below", below), ("above", above))
             if value is not None]
    if len(given) != 1 or not finite_number(given[0][1]):
        raise JobDefinitionError("create_metric_deployment_automation: give exactly one of "
                                 f"below= and above=, a finite number (got below={below!r}, "
                                 f"above={above!r})")
    return given[0][0], float(given[0][1])


def _run_on_commit(deployment_id: UUID | str, match: ResourceSpecification,
                   parameters: dict[str, object] | None, *, name: str, description: str,
                   within: timedelta = timedelta(0)) -> UUID:
    """Create an automation running ``deployment_id`` for each committed epoch ``match``
    matches (with ``within``: for the first in each prefix, then not again for that long),
    with parameters ``checkpoint_url`` and ``epoch`` from the event."""
    run = RunDeployment(source="selected", deployment_id=UUID(str(deployment_id)),
                        parameters={"checkpoint_url": "{{ event.resource['caffe2ckpt.url'] }}",
                                    "epoch": "{{ event.payload.epoch }}", **(parameters or {})})
    return Automation(
        name=name, description=description,
        trigger=EventTrigger(expect={events.EPOCH_COMMITTED}, match=match,
                             for_each={"prefect.resource.id"}, posture=Posture.Reactive,
                             threshold=1, within=within),
        actions=[run],
    ).create().id


def create_checkpoint_alert_automation(*, notification_block_id: UUID | str | None = None,
                                       fail_flow_run: bool = False,
                                       checkpoint_url: str | None = None,
                                       name: str = "caffe2ckpt-checkpoint-alerts") -> UUID:
    """Create an automation for a save that failed or damage that was found (in each
    checkpoint prefix, or in ``checkpoint_url`` only).

    ``notification_block_id``: send a notification through this Prefect notification block
    (Slack, e-mail, a webhook...): what happened, the prefix, epoch, node and blob.
    ``fail_flow_run``: also mark the flow run that sent the event *Failed* (a job whose
    ``on_save_error="warn"`` would otherwise go on without that checkpoint). At least one.

    Returns:
        The automation's id.

    Raises:
        JobDefinitionError: neither action was asked for.
    """
    actions: list[Action] = []
    if notification_block_id is not None:
        actions.append(SendNotification(block_document_id=UUID(str(notification_block_id)),
                                        subject=ALERT_SUBJECT, body=ALERT_BODY))
    if fail_flow_run:
        actions.append(ChangeFlowRunState(state=StateType.FAILED, message=FAILED_MESSAGE))
    if not actions:
        raise JobDefinitionError("create_checkpoint_alert_automation: give "
                                 "notification_block_id, fail_flow_run=True or both")
    automation = Automation(
        name=name,
        description="A checkpoint save failed or damage was found (caffe2ckpt)",
        trigger=EventTrigger(
            expect={events.SAVE_FAILED, events.CHECKPOINT_DAMAGED},
            match=_prefixes(checkpoint_url), posture=Posture.Reactive, threshold=1,
            within=timedelta(0)),
        actions=actions,
    ).create()
    logger.info("created automation %s for failed saves and damaged checkpoints", automation.id)
    return automation.id
