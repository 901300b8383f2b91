"""What the checkpoint managers' tasks do on a node, wherever that node runs.

Each function takes its inputs as arguments and the node's workspace last (the managers bind the
rest with :func:`functools.partial`), changes nothing but that workspace and the store, and
returns a small result (blob names, a commit record, a duration) that the session hands back to
the manager (``Task.on_result``). So the same task runs in the flow process's threads or in a
Dask actor on another machine, and a node's arrays never leave the process that holds them.

Background saves (``async_save``) live in the process that runs the node: :func:`saves_for`
keeps one :class:`BackgroundSaves` per manager there.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections import deque
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from caffe2ckpt.background import BackgroundSaves
from caffe2ckpt.errors import CheckpointNotFoundError, CheckpointWriteError, writing
from caffe2ckpt.policy import StepManagerOptions
from caffe2ckpt.store.commit.protocol import CheckpointStore, SaveInfo
from caffe2ckpt.store.delta.plan import DeltaTracker
from caffe2ckpt.store.delta.write import DeltaWrite
from caffe2ckpt.store.format.paths import group_name
from caffe2ckpt.store.format.records import CommitRecord
from caffe2ckpt.store.read.replicas import RowSpec, replica_digests, row_specs
from caffe2ckpt.store.read.save import Cut, SaveReader
from caffe2ckpt.store.read.shared import SharedReads
from caffe2ckpt.workspace import Workspace

__all__ = ["DB_EXISTS", "DeltaArgs", "Timed", "blob_names", "db_exists", "forget_saves", "load",
           "manifest_names", "release_saves", "save", "saves_for", "tracker_for", "wait_saves",
           "worker_info"]

DB_EXISTS = "caffe2ckpt/db_exists"

_saves: dict[tuple[str, str], BackgroundSaves] = {}  # (manager key, node) -> its saves here
_trackers: dict[tuple[str, str], DeltaTracker] = {}  # (manager key, node) -> its delta state
_saves_lock = threading.Lock()
_forgotten: deque[str] = deque()  # keys of collected managers, dropped by the next registry user


@contextmanager
def _registry() -> Iterator[dict[tuple[str, str], BackgroundSaves]]:
    """``_saves`` under its lock, without the entries of managers collected meanwhile."""
    with _saves_lock:
        while _forgotten:
            _drop(_forgotten.popleft())
        yield _saves


def _drop(key: str) -> None:
    for k in [k for k in _saves if k[0] == key]:
        del _saves[k]
    for k in [k for k in _trackers if k[0] == key]:
        del _trackers[k]


def tracker_for(key: str, node: str, options: StepManagerOptions) -> DeltaTracker:
    """This process's differential state of ``node`` for the manager ``key`` (made on first
    use, and again when the options change)."""
    with _registry():
        tracker = _trackers.get((key, node))
        if tracker is None or tracker.options != options:
            tracker = _trackers[(key, node)] = DeltaTracker(node, options)
        return tracker


@dataclass(frozen=True)
class Timed:
    """A node operation's result and how long it took (nanoseconds)."""

    value: Any
    ns: int


def _timed(fn: Any) -> Timed:
    start = time.perf_counter_ns()
    value = fn()
    return Timed(value, time.perf_counter_ns() - start)


def saves_for(key: str, node: str) -> BackgroundSaves:
    """This process's background saves of ``node`` for the manager ``key`` (made on first use)."""
    with _registry() as registry:
        return registry.setdefault((key, node), BackgroundSaves())


def release_saves(key: str, node: str | None = None, ws: Workspace | None = None) -> None:
    """Wait for and forget this process's background saves of manager ``key`` (of one
    ``node``, or of all), freeing their buffers.

    Raises:
        CheckpointWriteError: a save not waited for yet failed (after all were released).
    """
    with _registry() as registry:
        released = [registry.pop(k) for k in list(registry) if k[0] == key and node in (None, k[1])]
        for k in [k for k in _trackers if k[0] == key and node in (None, k[1])]:
            del _trackers[k]
    errors = []
    for saves in released:
        try:
            saves.close()
        except CheckpointWriteError as exc:
            errors.append(exc)
    if errors:
        raise errors[0]


def forget_saves(key: str) -> None:
    """Drop this process's references to manager ``key``'s saves without waiting (for a manager
    that was never closed: running writes keep their own buffers until they end).

    A finalizer calls this when the manager is collected, which can happen inside any
    allocation, also in this thread while it holds the registry's lock: so it never waits for
    the lock, and when the lock is taken it leaves the key to the next registry user."""
    if _saves_lock.acquire(blocking=False):
        try:
            _drop(key)
        finally:
            _saves_lock.release()
    else:
        _forgotten.append(key)


def worker_info() -> dict[str, Any]:
    """Which process holds the node and writes its data."""
    return {"host": socket.gethostname(), "pid": os.getpid()}


def blob_names(ws: Workspace) -> list[str]:
    """The blobs in the node's workspace now (a fresh start's checkpointed names)."""
    return list(ws)


def manifest_names(store: CheckpointStore, record: CommitRecord, ws: Workspace) -> list[str]:
    """The blobs in the node's checkpoint ``record`` commits (a resume's checkpointed names),
    with the replicated ones another node of its save wrote."""
    lent = record.layout.written_by if record.layout is not None else {}
    return [*store.manifest(record).blobs, *lent]


@dataclass(frozen=True)
class DeltaArgs:
    """What a node needs for a differential save: the manager's key (its trackers here), the
    options, and the save the new one may build on (its id; None: write everything whole)."""

    key: str
    options: StepManagerOptions
    base: str | None


def save(store: CheckpointStore, node: str, file_node: str, epoch: int, names: Sequence[str],
         info: SaveInfo, background: str | None, delta: DeltaArgs | None,
         ws: Workspace) -> Timed | None:
    """Save and commit ``names`` of the node's workspace as ``epoch``; the commit record names
    this process as the worker. With a ``background`` key, only snapshot them here and write
    in the background (:func:`wait_saves` collects the record); returns None then. With
    ``delta``, write only what changed since the save it builds on (:mod:`~.store.delta`).
    Replicated blobs another node of the save writes (``info.writers``) are not written here:
    the record names that node."""
    borrowed = info.borrowed(file_node, names)
    names = [n for n in names if n not in borrowed]
    try:
        blobs = {n: ws[n] for n in names}
    except KeyError:
        missing = [n for n in names if n not in ws]
        raise CheckpointWriteError(
            f"cannot save node {node!r} epoch {epoch}: checkpointed blobs {missing} are no "
            "longer in its workspace") from None
    info = replace(info, writer={**(info.writer or {}), "worker": worker_info()})
    where = store.location.display(group_name(file_node, epoch))
    hints = ws.take_changed()  # taken at every save: hints never pile up
    tracker = plan = None
    if delta is not None:
        tracker = tracker_for(delta.key, file_node, delta.options)
        for blob, rows in hints.items():
            tracker.mark_changed(blob, rows)
        plan = tracker.plan(delta.base, blobs, store.has_record, defer=background is None)
        blobs = plan.whole

    def write(snapshot: dict[str, Any]) -> Timed:
        with writing(f"saving node {file_node!r} epoch {epoch} to {where!r}", epoch):
            return _timed(lambda: _commit(store, file_node, epoch, snapshot, info, tracker, plan,
                                          borrowed))

    if background is None:
        return write(blobs)
    try:
        saves_for(background, node).submit(epoch, node, blobs, write)
    except BaseException:  # nothing was written: the hints count for the next save
        if tracker is not None and plan is not None:
            tracker.failed(plan)
        raise
    return None


def _commit(store: CheckpointStore, node: str, epoch: int, blobs: dict[str, Any],
            info: SaveInfo, tracker: DeltaTracker | None, plan: DeltaWrite | None,
            borrowed: dict[str, str]) -> CommitRecord:
    """One node's save; its tracker (differential saves) learns how it ended."""
    try:
        record = store.save_node(node, epoch, blobs, info, plan, borrowed)
    except BaseException:
        if tracker is not None and plan is not None:
            tracker.failed(plan)
        raise
    if tracker is not None and plan is not None:
        tracker.committed(plan)
    return record


def wait_saves(background: str, node: str, epoch: int | None, ws: Workspace) -> Timed | None:
    """Wait for this process's background save of ``node`` of ``epoch`` (None: the node had no
    save in flight) and return its timed record.

    Raises:
        CheckpointWriteError: the save failed, or this process does not know it (the process
            that held the node was replaced: that save's outcome is unknown here).
    """
    if epoch is None:
        return None
    with _registry() as registry:
        saves = registry.get((background, node))
    if saves is None or saves.pending_epoch != epoch:
        where = worker_info()
        raise CheckpointWriteError(
            f"node {node!r}'s background save of epoch {epoch} is unknown to the process now "
            f"holding the node (pid {where['pid']} on {where['host']}): the process that ran "
            "it is gone, so the epoch commits only if every node's record is there",
            epoch=epoch)
    _, results = saves.wait()
    return results.get(node)


def load(store: CheckpointStore, records: dict[str, CommitRecord], node: str, cut: Cut | None,
         names: Sequence[str], require_all: bool, shared: SharedReads, ws: Workspace) -> Timed:
    """Restore ``names`` (with ``require_all``, every one of them; else those present) of
    ``node`` from the save ``records`` into its workspace: its own blobs, or with ``cut`` its
    share of the save cut anew (:meth:`~caffe2ckpt.store.read.save.SaveReader.read`; what
    several nodes read, read once per ``shared``)."""
    data = _timed(lambda: SaveReader(store, records, shared).read([node], list(names),
                                                                  cut)[node])
    missing = [n for n in names if n not in data.value] if require_all else []
    if missing:
        record = next(iter(records.values()))
        how = f", cut anew for node {node!r} of {list(cut.order)}," if cut is not None else ""
        raise CheckpointNotFoundError(
            f"epoch {record.epoch} under {store.location.display()!r}{how} gives node "
            f"{node!r} no blobs {missing}")
    ws.restore(data.value)
    return Timed(None, data.ns)


def layout_facts_of(replicated: Sequence[str], rows: Sequence[str], ws: Workspace
                    ) -> tuple[dict[str, str], dict[str, RowSpec]]:
    """What is compared across the nodes before a save: the digests of the node's replicated
    blobs ``replicated`` and the dtype and shape of its rows blobs ``rows``."""
    return (replica_digests({n: ws[n] for n in replicated if n in ws}),
            row_specs({n: np.asarray(ws[n]) for n in rows if n in ws}))


def given_names(names: Sequence[str], ws: Workspace) -> list[str]:
    """The blob list of a node resuming elastically: the save's (the same for every node)."""
    return list(names)


def db_exists(committed: bool, ws: Workspace) -> None:
    """Set the node's ``caffe2ckpt/db_exists`` blob to ``committed`` (Caffe2's output)."""
    ws[DB_EXISTS] = committed
