"""caffe2ckpt's checkpoint events as Prefect events (the Event Feed, automation triggers).

:class:`PrefectPublisher` is subscribed to :mod:`caffe2ckpt.events` when ``caffe2ckpt.prefect``
is imported, and by a command-line run (``caffe2ckpt gc``, ``verify``) when ``PREFECT_API_URL``
is set. It publishes only when a Prefect API is there to receive: ``PREFECT_API_URL`` is set,
or the caller runs inside a flow or task run (which has its server, the temporary one too); it
never starts a server of its own. Events go through Prefect's own events client, queued and
sent in the background: a server that cannot be reached costs the save nothing.

Each event's resource is the checkpoint prefix: ``prefect.resource.id`` is
``caffe2ckpt.checkpoint.<url>`` (the URL without credentials, query or fragment),
``prefect.resource.name`` ``<job> @ <url>`` (the URL alone without a job: the Event Feed tells
prefixes apart, and one prefix's jobs), with labels ``caffe2ckpt.url``,
``caffe2ckpt.job`` and, for an event about one epoch, ``caffe2ckpt.epoch``; a committed epoch's
finite metrics also as ``caffe2ckpt.metric-key.<name>``, an order key
(:mod:`caffe2ckpt.prefect.orderkey`) for threshold triggers. Prefect adds the flow run, flow,
deployment and task run it was sent from as related resources. The payloads are documented in
:mod:`caffe2ckpt.events`; a resume's ``reason`` ``"resume"`` becomes ``"retry"`` in a flow
run's second or later attempt, else ``"re-run"``.

An ``epoch.committed`` event keeps its own id (:func:`caffe2ckpt.events.committed_event_id`);
Prefect's server keeps one event per id (it drops a copy that arrives within minutes, stores an
id once, and its triggers act on an id once within 30 minutes). The copy a resume sends
(``resent``) is sent only if the server has not stored the event (asked for at most
:data:`_STORED_SECONDS`; unknown: sent): so an automation acts on a commit once, also when the
resume comes days later. It also names the commit event this process sent before it for the
prefix (Prefect's ``follows``): the server's triggers take one process's commits in order.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import logging
import threading
from datetime import UTC, datetime
from typing import Any
from uuid import UUID

from prefect.client.orchestration import get_client
from prefect.context import FlowRunContext, TaskRunContext
from prefect.events import Event, emit_event
from prefect.events.filters import EventFilter, EventIDFilter, EventOccurredFilter
from prefect.events.worker import EventsWorker
from prefect.runtime import flow_run
from prefect.settings import PREFECT_API_URL

from caffe2ckpt import events
from caffe2ckpt.prefect._bounded import in_background
from caffe2ckpt.prefect.orderkey import metric_labels

__all__ = ["EPOCH_LABEL", "RESOURCE_PREFIX", "PrefectPublisher", "resource_id",
           "subscribe_publisher"]

RESOURCE_PREFIX = "caffe2ckpt.checkpoint."
EPOCH_LABEL = "caffe2ckpt.epoch"  # a resource label of events about one epoch
_DRAIN_SECONDS = 10.0  # the longest a process waits to send its queued events (flush, exit)
_STORED_SECONDS = 2.0  # how long a resent event waits to learn whether the server has it
_LONG_AGO = datetime(2000, 1, 1, tzinfo=UTC)  # the events looked up: since then

logger = logging.getLogger(__name__)


def resource_id(url: str) -> str:
    """The Prefect resource id of checkpoint prefix ``url`` (made public first)."""
    return RESOURCE_PREFIX + events.public_url(url)


class PrefectPublisher:
    """Emits each checkpoint event as a Prefect event (see the module docstring)."""

    def __init__(self) -> None:
        # Per prefix (resource id), the last commit event this process sent (not a resent
        # copy: the server may drop that one as stored). The next commit's event names it as
        # the one it follows: Prefect's server evaluates triggers on two events at a time, so
        # two commits sent milliseconds apart could reach a trigger in either order and a
        # once-only threshold act on the later epoch; an event that follows another is
        # evaluated after it (Prefect links events within 5 minutes of each other only).
        self._last_commit: dict[str, Event] = {}
        self._lock = threading.Lock()

    def active(self) -> bool:
        return bool(PREFECT_API_URL.value()) or FlowRunContext.get() is not None \
            or TaskRunContext.get() is not None

    def __call__(self, event: events.CheckpointEvent) -> None:
        if event.resent and event.id is not None and _stored(event.id):
            return
        payload: dict[str, Any] = dict(event.payload)
        if event.name == events.RUN_RESUMED and payload.get("reason") == "resume":
            payload["reason"] = "retry" if flow_run.run_count > 1 else "re-run"
        resource = _resource(event, payload)
        send = functools.partial(emit_event, event.name, resource=resource, payload=payload,
                                 id=UUID(event.id) if event.id is not None else None)
        if event.name != events.EPOCH_COMMITTED:
            _emit(send)
            return
        with self._lock:
            sent = _emit(functools.partial(send, follows=self._last_commit.get(
                resource["prefect.resource.id"])))
            if sent is not None and not event.resent:
                self._last_commit[resource["prefect.resource.id"]] = sent

    def flush(self) -> None:
        """Send the events Prefect's events worker holds, waiting at most
        :data:`_DRAIN_SECONDS`; what is left then is not sent (one warning). It also stands in
        for Prefect's own wait at exit, which has no limit
        (:func:`caffe2ckpt.prefect._environment.apply`)."""
        # Prefect's queue logs "Still processing items" whenever it stops with items queued,
        # which is every time a short command drains: not news to its user
        quiet = logging.getLogger(EventsWorker.__name__)
        level = quiet.level
        quiet.setLevel(logging.ERROR)
        try:
            unsent = self._drain()
        finally:
            quiet.setLevel(level)
        if unsent:
            api = PREFECT_API_URL.value()
            logger.warning("Prefect events not sent within %g s were dropped: is the Prefect "
                           "API %s up?", _DRAIN_SECONDS,
                           f"at {events.public_url(api)}" if api else "of this run")

    @staticmethod
    def _drain() -> set[Any]:
        """Drain Prefect's events workers; those not done within :data:`_DRAIN_SECONDS`. Called
        where an event loop runs (a notebook), Prefect's drain would be a coroutine: it then
        runs in a thread of its own."""
        drain = functools.partial(EventsWorker.drain_all, timeout=_DRAIN_SECONDS)
        try:
            asyncio.get_running_loop()
        except RuntimeError:  # none: the usual case
            return drain()[1]
        return in_background(drain, name="caffe2ckpt-events-drain").result()[1]


def _resource(event: events.CheckpointEvent, payload: dict[str, Any]) -> dict[str, str]:
    """The event's resource: the checkpoint prefix, with its labels (the module docstring)."""
    resource = {"prefect.resource.id": resource_id(event.url),
                "prefect.resource.name": f"{event.job} @ {event.url}" if event.job
                else event.url,
                "caffe2ckpt.url": event.url}
    if event.job is not None:
        resource["caffe2ckpt.job"] = event.job
    if isinstance(payload.get("epoch"), int):  # for triggers on chosen epochs
        resource[EPOCH_LABEL] = str(payload["epoch"])
    if event.name == events.EPOCH_COMMITTED:  # for triggers on metric thresholds
        resource.update(metric_labels(payload.get("metrics") or {}))
    return resource


def _emit(send: functools.partial) -> Event | None:
    """``send()``, from outside any run when the caller is in none (:func:`_outside_any_run`)."""
    if FlowRunContext.get() is None and TaskRunContext.get() is None:
        return contextvars.copy_context().run(_outside_any_run, send)
    return send()


def _outside_any_run(send: functools.partial) -> Event | None:
    """``send()`` with no flow or task run in its context, said outright. Prefect's events
    worker relates an event to the runs of the context it was sent from, applied over its own
    thread's context, which is the one of the run it was started in: an event sent after that
    run ended, from outside any run, would be related to it (an alert naming, and
    ``fail_flow_run`` failing, a finished run)."""
    FlowRunContext.__var__.set(None)
    TaskRunContext.__var__.set(None)
    return send()


def _stored(event_id: str) -> bool:
    """Whether the server has stored event ``event_id``; False when it cannot tell within
    :data:`_STORED_SECONDS` (unreachable, slow, or it stores no events)."""
    try:
        return in_background(functools.partial(_read_stored, UUID(event_id))).result(
            timeout=_STORED_SECONDS)
    except Exception as exc:  # noqa: BLE001 - then it is sent: the server keeps one copy
        logger.debug("cannot tell whether event %s is stored (%r): sending it", event_id, exc)
        return False


def _read_stored(event_id: UUID) -> bool:
    with get_client(sync_client=True) as client:
        page = client.read_events(EventFilter(id=EventIDFilter(id=[event_id]),
                                              occurred=EventOccurredFilter(since=_LONG_AGO)),
                                  limit=1)
    return bool(page.events)


_publisher = PrefectPublisher()
_subscribed = False


def subscribe_publisher() -> None:
    """Subscribe the Prefect publisher (once per process)."""
    global _subscribed
    if not _subscribed:
        _subscribed = True
        events.subscribe(_publisher)
