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

A deployment (``deployment_id``) is given by its id or by its name ``flow-name/deployment-name``.

Names: an automation is known by its name. Each ``create_*`` function creates one, or, when an
automation of that name exists, updates it to what the call asks (trigger, actions,
description) and returns its id, so calling it again never adds a second one (a paused one
stays paused, its tags stay). Two or more of that name are refused: which one to keep is the
user's choice. The default names are built from what the automation watches and does: the
deployment as ``flow-name/deployment-name``, the prefix in its canonical public form (or "any
prefix"), the epochs or threshold, the notification block; settings that are not in the name
(``parameters``, ``up_to_epoch``, ``once``, ``fail_flow_run``) are updated by a call with other
values. Prefect sets no length limit on automation names, so a long prefix is kept whole (a
shortened one could give two prefixes one name). Two processes creating the same name at the
same moment can still make two: the server has no unique names. Prefect's UI shows every
trigger on events other than its own as "A custom trigger" (its triggers have no name or
description of their own): the automation's name and description say what it watches.

A prefix (``checkpoint_url``) is given as the managers take it (a relative or absolute path,
``file://``, any fsspec URL, a block) and watched in the canonical public form events name it
by (:func:`caffe2ckpt.fs.location.canonical_prefix`: a relative path is taken from the current
directory; no storage server is contacted, a block is read from the Prefect server). One that
no event can name is refused: an empty string, one with a ``*`` (Prefect matches resource ids
as glob patterns: ``checkpoint_url=None`` watches every prefix; a ``[`` is matched as itself),
and what the managers refuse (an unknown protocol, a query string, a password where the
filesystem does not log in with one).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import timedelta
from typing import Any
from uuid import UUID

from prefect.client.orchestration import SyncPrefectClient, get_client
from prefect.client.schemas.objects import StateType
from prefect.client.schemas.responses import DeploymentResponse
from prefect.events.actions import Action, ChangeFlowRunState, RunDeployment, SendNotification
from prefect.events.schemas.automations import AutomationCore, EventTrigger, Posture
from prefect.events.schemas.events import ResourceSpecification
from prefect.exceptions import ObjectNotFound

from caffe2ckpt import events
from caffe2ckpt.errors import InvalidLocationError, JobDefinitionError
from caffe2ckpt.fs.location import canonical_prefix
from caffe2ckpt.prefect.events import EPOCH_LABEL, RESOURCE_PREFIX, resource_id
from caffe2ckpt.prefect.orderkey import METRIC_LABEL, finite_number, keys_above, keys_below
from caffe2ckpt.urls import public_url

__all__ = ["create_checkpoint_alert_automation", "create_crash_retry_automation",
           "create_epoch_deployment_automation", "create_heartbeat_crash_automation",
           "create_metric_deployment_automation"]

logger = logging.getLogger(__name__)

FINAL_EVENTS = {"prefect.flow-run.Completed", "prefect.flow-run.Failed",
                "prefect.flow-run.Cancelled", "prefect.flow-run.Crashed"}
SILENT_MESSAGE = "no heartbeat: its process is gone"
SILENT_NAME = "caffe2ckpt-crash-silent-runs"  # the heartbeat automation's default name
ANY_PREFIX = "any prefix"  # how a name says the automation watches every prefix


def create_crash_retry_automation(deployment_id: UUID | str, *, name: str | None = None) -> UUID:
    """Create (or update: see the module docstring) an automation that re-schedules crashed
    runs of one deployment (same run id), named ``caffe2ckpt: retry crashed runs of
    FLOW/DEPLOYMENT`` unless ``name`` is given.

    Pair it with ``run_job(..., max_attempts=N)``: each re-run increments ``run_count``, and the
    flow refuses to run past N, ending in *Failed* rather than looping.

    Returns:
        The automation's id.

    Raises:
        JobDefinitionError: no such deployment, or two automations already have the name.
    """
    caller = "create_crash_retry_automation"
    with get_client(sync_client=True) as client:
        uid, deployment = _deployment(client, deployment_id, caller)
        automation = AutomationCore(
            name=_named(name, caller) or f"caffe2ckpt: retry crashed runs of {deployment}",
            description=f"Puts crashed flow runs of deployment {deployment} ({uid}) back to "
                        "AwaitingRetry: a worker runs the same flow run again, and caffe2ckpt "
                        "resumes it from its newest committed epoch. Created by caffe2ckpt.",
            trigger=EventTrigger(
                expect={"prefect.flow-run.Crashed"},
                match_related={"prefect.resource.id": f"prefect.deployment.{uid}"},
                for_each={"prefect.resource.id"},
                posture=Posture.Reactive,
                threshold=1,
                within=0,
            ),
            actions=[ChangeFlowRunState(state=StateType.SCHEDULED, name="AwaitingRetry",
                                        message="caffe2ckpt: retrying a crashed run")])
        return _save(client, automation, caller)


def create_heartbeat_crash_automation(within: timedelta = timedelta(minutes=10), *,
                                      name: str = SILENT_NAME) -> UUID:
    """Create (or update: see the module docstring) an automation that marks *Crashed* every
    flow run whose heartbeats stopped.

    A flow run that sent a ``prefect.flow-run.heartbeat`` and then, for ``within``, neither
    another heartbeat nor a final state is marked *Crashed* ("no heartbeat: its process is
    gone"); its end time is when the automation fires, not the moment its process died. Make
    ``within`` a few heartbeat periods (``PREFECT_FLOWS_HEARTBEAT_FREQUENCY``, 180 s by
    default): a shorter window crashes live runs between two heartbeats.

    Returns:
        The automation's id.

    Raises:
        JobDefinitionError: ``within`` is not a positive duration, or two automations already
            have the name.
    """
    caller = "create_heartbeat_crash_automation"
    if not isinstance(within, timedelta) or within <= timedelta(0):
        raise JobDefinitionError(f"{caller}: within must be a positive timedelta, got "
                                 f"{within!r}")
    automation = AutomationCore(
        name=_named(name, caller) or SILENT_NAME,
        description=f"Marks Crashed every flow run that sent a heartbeat and then neither "
                    f"another one nor a final state within {within}. Created by caffe2ckpt.",
        trigger=EventTrigger(
            after={"prefect.flow-run.heartbeat"},
            expect={"prefect.flow-run.heartbeat", *FINAL_EVENTS},
            match=ResourceSpecification({"prefect.resource.id": ["prefect.flow-run.*"]}),
            for_each={"prefect.resource.id"},
            posture=Posture.Proactive,
            threshold=1,
            within=within,
        ),
        actions=[ChangeFlowRunState(state=StateType.CRASHED, message=SILENT_MESSAGE)])
    with get_client(sync_client=True) as client:
        return _save(client, automation, caller)


# the epochs an every-k-th automation names by default: multiples of k up to this one
UP_TO_EPOCH = 10_000
ONCE_WINDOW = timedelta(days=3650)  # a once-only threshold automation fires once in this
FAILED_MESSAGE = ("caffe2ckpt: a checkpoint save failed or damage was found (the event is in "
                  "the Event Feed)")
ALERT_SUBJECT = "caffe2ckpt: {{ event.event }} for {{ event.resource['caffe2ckpt.url'] }}"
# one line per fact the event has (job, epoch, node, blob), then the flow run that sent it, with
# a link where the server knows its UI's address (PREFECT_UI_URL, or the PREFECT_API_URL it is
# derived from)
ALERT_BODY = (
    "{{ event.event }}: {{ event.payload.message }}\n"
    "checkpoint: {{ event.resource['caffe2ckpt.url'] }}"
    "{% if event.payload.job %}\njob: {{ event.payload.job }}{% endif %}"
    "{% if event.payload.epoch is not none %}\nepoch: {{ event.payload.epoch }}{% endif %}"
    "{% if event.payload.node %}\nnode: {{ event.payload.node }}{% endif %}"
    "{% if event.payload.blob %}\nblob: {{ event.payload.blob }}{% endif %}"
    "{% if flow_run %}\nflow run: {{ flow_run.name }} ({{ flow_run.id }})"
    "{% if flow_run|ui_url %}: {{ flow_run|ui_url }}{% endif %}{% endif %}")


def create_epoch_deployment_automation(deployment_id: UUID | str, *, every: int = 1,
                                       checkpoint_url: str | None = None,
                                       parameters: dict[str, object] | None = None,
                                       up_to_epoch: int = UP_TO_EPOCH,
                                       name: str | None = None) -> UUID:
    """Create (or update: see the module docstring) an automation that runs deployment
    ``deployment_id`` when an epoch whose number is a multiple of ``every`` is committed (every
    epoch with ``every=1``; epoch 0, the save after init, only then), under any checkpoint
    prefix or under ``checkpoint_url`` only (given as the managers take it). Its default name
    is ``caffe2ckpt: run FLOW/DEPLOYMENT every K epochs in PREFIX``.

    The run gets two parameters from the event: ``checkpoint_url`` (the prefix, canonical: a
    folder is ``file:///...``) and ``epoch`` (the epoch just committed), plus ``parameters``.
    Prefect's triggers match labels, not arithmetic, so with ``every`` above 1 the automation
    lists the epochs it runs for: the multiples of ``every`` up to ``up_to_epoch``. A retried
    or re-run job that commits such an epoch again runs the deployment again.

    Returns:
        The automation's id.

    Raises:
        JobDefinitionError: ``every`` or ``up_to_epoch`` is not a positive int,
            ``checkpoint_url`` names no prefix an event can name, no such deployment, or two
            automations already have the name.
    """
    caller = "create_epoch_deployment_automation"
    for what, value in (("every", every), ("up_to_epoch", up_to_epoch)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise JobDefinitionError(f"{caller}: {what} must be an int >= 1, got {value!r}")
    prefix = _prefix(checkpoint_url, caller)
    epochs = {} if every == 1 else {
        EPOCH_LABEL: [str(e) for e in range(every, up_to_epoch + 1, every)]}
    which = "every epoch" if every == 1 else f"every {every} epochs"
    epoch = "an epoch" if every == 1 else \
        f"an epoch that is a multiple of {every} (up to {up_to_epoch})"
    return _run_on_commit(
        deployment_id, _prefixes(prefix, **epochs), parameters, caller=caller,
        name=lambda deployment: f"caffe2ckpt: run {deployment} {which} in {prefix or ANY_PREFIX}",
        when=f"{epoch} is committed in {prefix or ANY_PREFIX}", given=name)


def create_metric_deployment_automation(deployment_id: UUID | str, *, metric: str,
                                        below: float | None = None, above: float | None = None,
                                        once: bool = True, checkpoint_url: str | None = None,
                                        parameters: dict[str, object] | None = None,
                                        name: str | None = None) -> UUID:
    """Create (or update: see the module docstring) an automation that runs deployment
    ``deployment_id`` when an epoch is committed whose ``metric`` (a job metric its commit
    records carry, e.g. ``"loss"``) is strictly ``below`` (or ``above``: give one) the
    threshold, under any checkpoint prefix or under ``checkpoint_url`` only, with the
    parameters of :func:`create_epoch_deployment_automation`. Its default name is
    ``caffe2ckpt: run FLOW/DEPLOYMENT when METRIC is below|above T in PREFIX``.

    With ``once`` (the default) the deployment runs for the first such epoch of each checkpoint
    prefix only: Prefect's trigger fires, then waits out a window of :data:`ONCE_WINDOW` (call
    again: the update re-arms it). "First" is the first event the server takes: one process's
    commits reach it in the order they were made (each names the one before it), while
    epochs committed by two processes within a second may reach it in either order. With
    ``once=False`` every such epoch runs it. An epoch whose metric is NaN or infinite, or that
    has no such metric, runs nothing. (Prefect's triggers compare labels, not numbers: the
    trigger lists the prefixes of every order key on the threshold's side,
    :mod:`caffe2ckpt.prefect.orderkey`.)

    Returns:
        The automation's id.

    Raises:
        JobDefinitionError: not exactly one of ``below`` and ``above`` is given as a finite
            number, ``metric`` is not a non-empty string, ``checkpoint_url`` names no prefix
            an event can name, no such deployment, or two automations already have the name.
    """
    caller = "create_metric_deployment_automation"
    if not isinstance(metric, str) or not metric:
        raise JobDefinitionError(f"{caller}: metric must be a metric's name, got {metric!r}")
    side, threshold = _threshold(below, above)
    prefix = _prefix(checkpoint_url, caller)
    patterns = keys_below(threshold) if side == "below" else keys_above(threshold)
    condition = f"{metric} is {side} {threshold!r}"
    return _run_on_commit(
        deployment_id, _prefixes(prefix, **{METRIC_LABEL + metric: patterns}), parameters,
        caller=caller, within=ONCE_WINDOW if once else timedelta(0),
        name=lambda deployment: f"caffe2ckpt: run {deployment} when {condition} in "
                                f"{prefix or ANY_PREFIX}",
        when=f"an epoch is committed in {prefix or ANY_PREFIX} whose {condition}"
             f"{' (the first such epoch of each prefix only)' if once else ''}", given=name)


def create_checkpoint_alert_automation(*, notification_block_id: UUID | str | None = None,
                                       fail_flow_run: bool = False,
                                       checkpoint_url: str | None = None,
                                       name: str | None = None) -> UUID:
    """Create (or update: see the module docstring) an automation for a save that failed or
    damage that was found (in each checkpoint prefix, or in ``checkpoint_url`` only). Its
    default name is ``caffe2ckpt: alert BLOCK-TYPE/BLOCK on failed saves and damage in PREFIX``
    (without a block: ``caffe2ckpt: fail flow runs on failed saves and damage in PREFIX``).

    ``notification_block_id``: send a notification through this Prefect notification block
    (Slack, e-mail, a webhook...): what happened, the prefix, job, epoch, node and blob (those
    known), and the flow run that sent the event, with a link to it in the UI where the server
    knows the UI's address. ``fail_flow_run``: also mark the flow run that sent the event
    *Failed* (a job whose ``on_save_error="warn"`` would otherwise go on without that
    checkpoint). At least one.

    Returns:
        The automation's id.

    Raises:
        JobDefinitionError: neither action was asked for, ``checkpoint_url`` names no prefix
            an event can name, no such notification block, or two automations already have the
            name.
    """
    caller = "create_checkpoint_alert_automation"
    if notification_block_id is None and not fail_flow_run:
        raise JobDefinitionError(f"{caller}: give notification_block_id, fail_flow_run=True "
                                 "or both")
    where = _prefix(checkpoint_url, caller) or ANY_PREFIX
    with get_client(sync_client=True) as client:
        block = None if notification_block_id is None else _block(client, notification_block_id,
                                                                   caller)
        actions, acts = _alert_actions(block, fail_flow_run)
        doing = f"alert {block[1]}" if block else "fail flow runs"
        automation = AutomationCore(
            name=_named(name, caller) or f"caffe2ckpt: {doing} on failed saves and damage in "
                                         f"{where}",
            description=f"When a checkpoint save fails or damage is found in {where}: {acts}. "
                        "Created by caffe2ckpt.",
            trigger=EventTrigger(
                expect={events.SAVE_FAILED, events.CHECKPOINT_DAMAGED},
                match=_prefixes(None if where == ANY_PREFIX else where), posture=Posture.Reactive,
                threshold=1, within=timedelta(0)),
            actions=actions)
        return _save(client, automation, caller)


def _alert_actions(block: tuple[UUID, str] | None,
                   fail_flow_run: bool) -> tuple[list[Action], str]:
    """The alert's actions (notify through ``block``, fail the run) and what they do."""
    actions: list[Action] = []
    doing = []
    if block is not None:
        actions.append(SendNotification(block_document_id=block[0], subject=ALERT_SUBJECT,
                                        body=ALERT_BODY))
        doing.append(f"notify through block {block[1]}")
    if fail_flow_run:
        actions.append(ChangeFlowRunState(state=StateType.FAILED, message=FAILED_MESSAGE))
        doing.append("mark the flow run that sent the event Failed")
    return actions, " and ".join(doing)


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
                   parameters: dict[str, object] | None, *, caller: str,
                   name: Callable[[str], str], when: str, given: str | None,
                   within: timedelta = timedelta(0)) -> UUID:
    """Create or update an automation running ``deployment_id`` for each committed epoch
    ``match`` matches (with ``within``: for the first in each prefix, then not again for that
    long), with parameters ``checkpoint_url`` and ``epoch`` from the event; named ``given`` or
    ``name(FLOW/DEPLOYMENT)``, described as running it when ``when``."""
    with get_client(sync_client=True) as client:
        uid, deployment = _deployment(client, deployment_id, caller)
        run = RunDeployment(
            source="selected", deployment_id=uid,
            parameters={"checkpoint_url": "{{ event.resource['caffe2ckpt.url'] }}",
                        "epoch": "{{ event.payload.epoch }}", **(parameters or {})})
        automation = AutomationCore(
            name=_named(given, caller) or name(deployment),
            description=f"Runs deployment {deployment} ({uid}) when {when}, with the "
                        "parameters checkpoint_url and epoch of that epoch. Created by "
                        "caffe2ckpt.",
            trigger=EventTrigger(expect={events.EPOCH_COMMITTED}, match=match,
                                 for_each={"prefect.resource.id"}, posture=Posture.Reactive,
                                 threshold=1, within=within),
            actions=[run])
        return _save(client, automation, caller)


def _named(name: str | None, caller: str) -> str | None:
    """``name`` as given (None: the caller builds its default), refused when empty."""
    if name is not None and (not isinstance(name, str) or not name.strip()):
        raise JobDefinitionError(f"{caller}: name must be a non-empty string, got {name!r}")
    return name


def _prefix(checkpoint_url: Any, caller: str) -> str | None:
    """The canonical public URL events name ``checkpoint_url`` by (None: every prefix), or a
    JobDefinitionError naming it if no event can (see the module docstring)."""
    if checkpoint_url is None:
        return None
    if isinstance(checkpoint_url, str) and not checkpoint_url.strip():
        raise JobDefinitionError(f"{caller}: checkpoint_url {checkpoint_url!r} names no prefix: "
                                 "give one as the managers take it, or None for every prefix")
    try:
        prefix = canonical_prefix(checkpoint_url)
    except InvalidLocationError as exc:
        raise JobDefinitionError(f"{caller}: checkpoint_url is no prefix an event can name: "
                                 f"{exc}") from exc
    if "*" in prefix:
        raise JobDefinitionError(
            f"{caller}: checkpoint_url {public_url(str(checkpoint_url))!r} (the prefix "
            f"{prefix}) has a wildcard '*': an automation watches one prefix, named "
            "exactly (checkpoint_url=None watches every prefix)")
    return prefix


def _prefixes(prefix: str | None, **labels: list[str]) -> ResourceSpecification:
    """The checkpoint prefixes an automation watches: one (canonical, public) or, with None,
    all; and the resource ``labels``. Prefect matches them as glob patterns: a ``[`` in the
    prefix is written as the set ``[[]`` that matches it alone."""
    watched = resource_id(prefix).replace("[", "[[]") if prefix else f"{RESOURCE_PREFIX}*"
    return ResourceSpecification({"prefect.resource.id": watched, **labels})


def _deployment(client: SyncPrefectClient, deployment: UUID | str,
                caller: str) -> tuple[UUID, str]:
    """The id and ``flow-name/deployment-name`` of ``deployment``, given by id or by that
    name."""
    try:
        uid = UUID(str(deployment))
    except ValueError:
        found = _deployment_by_name(client, deployment, caller)
    else:
        try:
            found = client.read_deployment(uid)
        except ObjectNotFound as exc:
            raise JobDefinitionError(f"{caller}: no deployment {uid} on the Prefect server at "
                                     f"{public_url(str(client.api_url))}") from exc
    return found.id, f"{client.read_flow(found.flow_id).name}/{found.name}"


def _deployment_by_name(client: SyncPrefectClient, name: object,
                        caller: str) -> DeploymentResponse:
    """The deployment named ``name`` (``flow-name/deployment-name``)."""
    if not isinstance(name, str) or name.count("/") != 1 or "" in name.split("/"):
        raise JobDefinitionError(f"{caller}: deployment {name!r} is neither a deployment id "
                                 "nor a name FLOW/DEPLOYMENT")
    try:
        return client.read_deployment_by_name(name)
    except ObjectNotFound as exc:
        raise JobDefinitionError(f"{caller}: no deployment named {name!r} on the Prefect server "
                                 f"at {public_url(str(client.api_url))}") from exc


def _block(client: SyncPrefectClient, block_id: UUID | str, caller: str) -> tuple[UUID, str]:
    """The id and ``block-type/name`` of notification block ``block_id``."""
    try:
        uid = UUID(str(block_id))
    except ValueError as exc:
        raise JobDefinitionError(f"{caller}: {block_id!r} is not a block document id") from exc
    try:
        block = client.read_block_document(uid, include_secrets=False)
    except ObjectNotFound as exc:
        raise JobDefinitionError(f"{caller}: no block {uid} on the Prefect server at "
                                 f"{public_url(str(client.api_url))}") from exc
    kind = block.block_type.slug if block.block_type else "block"
    return uid, f"{kind}/{block.name or uid}"


def _save(client: SyncPrefectClient, automation: AutomationCore, caller: str) -> UUID:
    """Create ``automation``, or update the one automation of its name (see the module
    docstring); its id."""
    same = client.read_automations_by_name(automation.name)
    if len(same) > 1:
        raise JobDefinitionError(
            f"{caller}: {len(same)} automations are named {automation.name!r} "
            f"({', '.join(str(a.id) for a in same)}): delete all but one (prefect automation "
            "delete --id ID), then call again")
    if not same:
        automation_id = client.create_automation(automation)
        logger.info("created automation %s: %s", automation_id, automation.name)
        return automation_id
    existing = same[0]
    # every field is sent (the client sends only those set); pause and tags stay the user's
    client.update_automation(existing.id, AutomationCore(
        **{**automation.model_dump(exclude={"owner_resource"}), "enabled": existing.enabled,
           "tags": existing.tags}))
    logger.info("updated automation %s: %s", existing.id, automation.name)
    if not existing.enabled:
        logger.warning("automation %s (%s) is paused: it was updated and stays paused",
                       existing.id, automation.name)
    return existing.id
