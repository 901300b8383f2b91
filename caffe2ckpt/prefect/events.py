"""caffe2ckpt's checkpoint events as Prefect events (the Event Feed, automation triggers).

:class:`PrefectPublisher` is subscribed to :mod:`caffe2ckpt.events` when ``caffe2ckpt.prefect``
is imported, and by a command-line run (``caffe2ckpt gc``, ``verify``) when ``PREFECT_API_URL``
is set. It publishes only when a Prefect API is there to receive: ``PREFECT_API_URL`` is set,
or the caller runs inside a flow or task run (which has its server, the temporary one too); it
never starts a server of its own. Events go through Prefect's own events client, queued and
sent in the background: a server that cannot be reached costs the save nothing.

Each event's resource is the checkpoint prefix: ``prefect.resource.id`` is
``caffe2ckpt.checkpoint.<url>`` (the URL without credentials, query or fragment),
``prefect.resource.name`` the job's name (or the URL), with labels ``caffe2ckpt.url``,
``caffe2ckpt.job`` and, for an event about one epoch, ``caffe2ckpt.epoch``; a committed epoch's
finite metrics also as ``caffe2ckpt.metric-key.<name>``, an order key
(:mod:`caffe2ckpt.prefect.orderkey`) for threshold triggers. Prefect adds the flow run, flow,
deployment and task run it was sent from as related resources. The payloads are documented in
:mod:`caffe2ckpt.events`; a resume's ``reason`` ``"resume"`` becomes ``"retry"`` in a flow
run's second or later attempt, else ``"re-run"``.
"""

from __future__ import annotations

import logging
from typing import Any

from prefect.context import FlowRunContext, TaskRunContext
from prefect.events import emit_event
from prefect.events.worker import EventsWorker
from prefect.runtime import flow_run
from prefect.settings import PREFECT_API_URL

from caffe2ckpt import events
from caffe2ckpt.prefect.orderkey import metric_labels

__all__ = ["EPOCH_LABEL", "RESOURCE_PREFIX", "PrefectPublisher", "resource_id",
           "subscribe_publisher"]

RESOURCE_PREFIX = "caffe2ckpt.checkpoint."
EPOCH_LABEL = "caffe2ckpt.epoch"  # a resource label of events about one epoch
_DRAIN_SECONDS = 10.0


def resource_id(url: str) -> str:
    """The Prefect resource id of checkpoint prefix ``url`` (made public first)."""
    return RESOURCE_PREFIX + events.public_url(url)


class PrefectPublisher:
    """Emits each checkpoint event as a Prefect event (see the module docstring)."""

    def active(self) -> bool:
        return bool(PREFECT_API_URL.value()) or FlowRunContext.get() is not None \
            or TaskRunContext.get() is not None

    def __call__(self, event: events.CheckpointEvent) -> None:
        payload: dict[str, Any] = dict(event.payload)
        if event.name == events.RUN_RESUMED and payload.get("reason") == "resume":
            payload["reason"] = "retry" if flow_run.run_count > 1 else "re-run"
        resource = {"prefect.resource.id": resource_id(event.url),
                    "prefect.resource.name": event.job or event.url,
                    "caffe2ckpt.url": event.url}
        if event.job is not None:
            resource["caffe2ckpt.job"] = event.job
        if isinstance(payload.get("epoch"), int):  # for triggers on chosen epochs
            resource[EPOCH_LABEL] = str(payload["epoch"])
        if event.name == events.EPOCH_COMMITTED:  # for triggers on metric thresholds
            resource.update(metric_labels(payload.get("metrics") or {}))
        emit_event(event.name, resource=resource, payload=payload)

    def flush(self) -> None:
        # Prefect's queue logs "Still processing items" whenever it stops with items queued,
        # which is every time a short command drains: not news to its user
        quiet = logging.getLogger(EventsWorker.__name__)
        level = quiet.level
        quiet.setLevel(logging.ERROR)
        try:
            EventsWorker.drain_all(timeout=_DRAIN_SECONDS)
        finally:
            quiet.setLevel(level)


_publisher = PrefectPublisher()
_subscribed = False


def subscribe_publisher() -> None:
    """Subscribe the Prefect publisher (once per process)."""
    global _subscribed
    if not _subscribed:
        _subscribed = True
        events.subscribe(_publisher)
