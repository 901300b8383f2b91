"""Checkpoint events: what caffe2ckpt tells the outside world as checkpoints are made, used and
removed, for whoever subscribed (``caffe2ckpt.prefect`` subscribes one that emits Prefect
events, shown in the UI's Event Feed and usable as automation triggers).

Names, each with its payload (every payload also has ``job`` when a job is known):

- ``caffe2ckpt.epoch.committed``: ``epoch``, ``save_id``, ``nodes`` (names), ``bytes`` (the
  epoch's data), ``bytes_written`` (what this save wrote: less for a differential save),
  ``seconds``, ``kind`` (``"whole"`` or ``"delta"``), ``metrics``, ``kept`` (how many epochs
  the lineage keeps after this commit and its retention; None when that is not known without
  listing the prefix: a JobRunner without retention, or a re-send. An event never costs a
  LIST). Its id is fixed by the prefix, the epoch and the save (:func:`committed_event_id`):
  a run that resumes from an epoch sends that epoch's event again (``resent``), so that an
  event lost with a killed process still exists, and a receiver that keeps ids (Prefect's
  server) keeps it once;
- ``caffe2ckpt.save.failed``: ``epoch``, ``node`` (None when the failure is not one node's),
  ``error`` (its class) and ``message``;
- ``caffe2ckpt.run.resumed``: ``epoch``, ``reason`` (``"resume"``: the newest epoch, which the
  Prefect publisher turns into ``"retry"`` or ``"re-run"`` from the flow run's attempt;
  ``"going back"``: an older epoch on request; ``"elastic"``: saved by another node count;
  ``"fallback"``: the newer ones could not be loaded), ``saved_by`` and ``nodes`` (counts),
  ``source`` (``"storage"``, or ``"memory"``: copies an earlier session of the job left in
  Dask worker memory, ``DaskSession(memory_tier=True)``) and ``stored`` (the committed epoch
  the resume continues; ``epoch`` itself for a resume from storage);
- ``caffe2ckpt.run.recovered``: a running job lost nodes with their Dask worker and went back
  without a new run (``DaskSession(memory_tier=True)``): ``epoch`` (where every node went
  back to), ``source`` (``"memory"``: copies in worker memory; ``"storage"``: this run's
  newest commit), ``stored`` (the newest epoch committed then), ``lost`` (node names),
  ``failed_epoch`` (the epoch that was running) and ``seconds``;
- ``caffe2ckpt.checkpoint.damaged``: ``epoch``, ``node``, ``blob`` (each None where unknown;
  ``blob`` is a blob's name as the user gave it, also for damage in the array that holds the
  small blobs packed together: the first blob the damaged chunk holds, and ``message`` names
  the others), ``found_by`` (``"restore"`` or ``"verify"``), ``message``;
- ``caffe2ckpt.gc.finished``: ``deleted`` and ``kept`` (epochs), ``bytes_freed``, ``dry_run``.

Each event names the checkpoint prefix without credentials, query string or fragment
(:func:`public_url`). Publishing never fails the operation it reports: a subscriber's error is
logged as a WARNING. A payload is built only when some subscriber is listening.
"""

from __future__ import annotations

import functools
import logging
import math
import threading
import uuid
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

from caffe2ckpt.errors import CheckpointCorruptedError
from caffe2ckpt.urls import public_url

__all__ = ["CHECKPOINT_DAMAGED", "EPOCH_COMMITTED", "EVENT_NAMES", "GC_FINISHED", "RUN_RECOVERED",
           "RUN_RESUMED",
           "SAVE_FAILED", "CheckpointEvent", "Subscriber", "committed_event_id",
           "committed_payload", "damage_payload", "failure_payload", "flush", "public_url",
           "publish", "reporting_damage", "reporting_save_failure", "subscribe"]

logger = logging.getLogger(__name__)

EPOCH_COMMITTED = "caffe2ckpt.epoch.committed"
SAVE_FAILED = "caffe2ckpt.save.failed"
RUN_RESUMED = "caffe2ckpt.run.resumed"
RUN_RECOVERED = "caffe2ckpt.run.recovered"
CHECKPOINT_DAMAGED = "caffe2ckpt.checkpoint.damaged"
GC_FINISHED = "caffe2ckpt.gc.finished"
EVENT_NAMES = (EPOCH_COMMITTED, SAVE_FAILED, RUN_RESUMED, RUN_RECOVERED, CHECKPOINT_DAMAGED,
               GC_FINISHED)
_COMMITTED_IDS = uuid.uuid5(uuid.NAMESPACE_URL, "caffe2ckpt:" + EPOCH_COMMITTED)  # a namespace


@dataclass(frozen=True)
class CheckpointEvent:
    """One event: its ``name`` (one of :data:`EVENT_NAMES`), the checkpoint prefix ``url``
    (already made public), the ``job`` when known, and the ``payload``. ``id``: the event's own
    id where it is fixed (an epoch committed, :func:`committed_event_id`), else None.
    ``resent``: the event may have been sent before (a resume sends the committed event of the
    epoch it resumes from again); a publisher that can tell sends it only if it was not."""

    name: str
    url: str
    payload: Mapping[str, Any] = field(default_factory=dict)
    job: str | None = None
    id: str | None = None
    resent: bool = False


class Subscriber(Protocol):
    def active(self) -> bool:
        """Whether it would publish now (payloads are built only if some subscriber is)."""

    def __call__(self, event: CheckpointEvent) -> None:
        """Publish ``event``."""

    def flush(self) -> None:
        """Send what is queued (a short-lived process calls it before it exits)."""


_subscribers: list[Subscriber] = []
_lock = threading.Lock()


def subscribe(subscriber: Subscriber) -> Callable[[], None]:
    """Add ``subscriber``; return the function that removes it again."""
    with _lock:
        _subscribers.append(subscriber)

    def unsubscribe() -> None:
        with _lock:
            if subscriber in _subscribers:
                _subscribers.remove(subscriber)
    return unsubscribe


def _current() -> tuple[Subscriber, ...]:
    with _lock:
        return tuple(_subscribers)


def publish(name: str, url: str, payload: Callable[[], Mapping[str, Any]], *,
            job: str | None = None, resent: bool = False) -> None:
    """Hand event ``name`` about prefix ``url`` to every active subscriber; ``payload`` is
    called only if one is. ``resent``: see :class:`CheckpointEvent`. Never raises: a failure
    is logged."""
    try:
        listening = [s for s in _current() if s.active()]
        if not listening:
            return
        built = {**({"job": job} if job is not None else {}), **payload()}
        shown = public_url(url)
        fixed = (committed_event_id(shown, built["epoch"], built["save_id"])
                 if name == EPOCH_COMMITTED else None)
        event = CheckpointEvent(name, shown, built, job, fixed, resent)
    except Exception as exc:  # noqa: BLE001 - an event never fails what it reports
        logger.warning("could not prepare event %s for %s: %r", name, public_url(url), exc)
        return
    for subscriber in listening:
        try:
            subscriber(event)
        except Exception as exc:  # noqa: BLE001
            logger.warning("could not publish event %s for %s: %r", name, event.url, exc)


def flush() -> None:
    """Ask every subscriber to send what it queued (never raises)."""
    for subscriber in _current():
        try:
            subscriber.flush()
        except Exception as exc:  # noqa: BLE001
            logger.warning("could not send queued checkpoint events: %r", exc)


def committed_event_id(url: str, epoch: int, save_id: str) -> str:
    """The id of the ``caffe2ckpt.epoch.committed`` event of save ``save_id`` of ``epoch``
    under prefix ``url``: the same whenever and by whomever it is sent (a UUID 5 of the three,
    the URL made public first)."""
    return str(uuid.uuid5(_COMMITTED_IDS, f"{public_url(url)}\n{epoch}\n{save_id}"))


def committed_payload(records: Mapping[str, Any], *, kept: int | None) -> dict[str, Any]:
    """The payload of an epoch committed with ``records`` (node -> commit record)."""
    first = next(iter(records.values()))
    delta = any(r.delta is not None for r in records.values())
    return {
        "epoch": first.epoch,
        "save_id": first.save_id,
        "nodes": sorted(records),
        "bytes": sum(r.nbytes for r in records.values()),
        "bytes_written": sum(r.bytes_written for r in records.values()),
        "seconds": round(max(r.seconds for r in records.values()), 6),
        "kind": "delta" if delta else "whole",
        "metrics": {k: v if math.isfinite(v) else repr(v) for k, v in first.metrics.items()},
        "kept": kept,
    }


def failure_payload(epoch: int | None, exc: BaseException) -> dict[str, Any]:
    """The payload of a save of ``epoch`` that failed with ``exc``."""
    return {"epoch": epoch, "node": getattr(exc, "node", None), "error": type(exc).__name__,
            "message": str(exc)}


def damage_payload(exc: BaseException, *, found_by: str, epoch: int | None = None,
                   node: str | None = None, blob: str | None = None) -> dict[str, Any]:
    """The payload of damage ``exc`` found by ``found_by`` (its own node, epoch and blob first)."""
    return {"epoch": getattr(exc, "epoch", None) if epoch is None else epoch,
            "node": getattr(exc, "node", None) or node,
            "blob": getattr(exc, "blob", None) or blob,
            "found_by": found_by, "message": str(exc)}


@contextmanager
def reporting_save_failure(url: str, epoch: int, *, job: str | None = None) -> Iterator[None]:
    """Publish ``caffe2ckpt.save.failed`` for an exception raised in the block (re-raised)."""
    try:
        yield
    except Exception as exc:
        publish(SAVE_FAILED, url, functools.partial(failure_payload, epoch, exc), job=job)
        raise


@contextmanager
def reporting_damage(url: str, epoch: int | None, *, found_by: str,
                     job: str | None = None) -> Iterator[None]:
    """Publish ``caffe2ckpt.checkpoint.damaged`` for a :class:`CheckpointCorruptedError`
    raised in the block (re-raised)."""
    try:
        yield
    except CheckpointCorruptedError as exc:
        publish(CHECKPOINT_DAMAGED, url,
                functools.partial(damage_payload, exc, found_by=found_by, epoch=epoch), job=job)
        raise
