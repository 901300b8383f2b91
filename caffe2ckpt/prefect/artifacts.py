"""Flow run artifacts for checkpoints: a table, a progress bar and a markdown summary.

There is exactly one artifact per key per flow run, also across retries: each artifact is
looked up by key and flow run id and updated in place, and only created when the run has none.
Keys are ``<job>-<folder>-<hash>-checkpoints``, ``...-progress`` and ``...-summary`` (lowercase
letters, digits and dashes, as Prefect requires): ``<folder>`` is the checkpoint folder's last
path segment and ``<hash>`` six hex digits of its full URL, so the runs of one job that write to
different folders have artifacts of their own (:func:`artifact_key`).

The checkpoint table (rows: :mod:`caffe2ckpt.prefect.table`), newest epoch first, has a row per
epoch committed under the prefix, by this flow run or any other: ``epoch``, ``status``, a column
per metric the commit records carry (``CommitRecord.metrics``, 4 significant digits, ``NaN`` and
``inf`` as such), ``nodes``, ``bytes`` (``12.3 MiB``), ``seconds``, ``MB/s``, ``written by``
(``this run, attempt 2`` or another run's name, short id and attempt) and ``path`` (relative to the
checkpoint root, which the table's description names). The progress bar is the epoch against the
run's epoch limit (the job's ``max_epochs``), and its description says both. The summary
(:mod:`caffe2ckpt.prefect.summary`) says why the attempt runs (a retry after which failure), where
it started from, how far it is, charts the metrics and the save seconds and MB/s per epoch, and
links every flow run that wrote epochs of the table to its page in the Prefect UI (table cells get
no links: the default UI of Prefect 3.8 shows them as plain text).

Uploads are throttled. Updating the table, the progress bar and the summary takes three API calls
and sends the whole table, which grows with the epochs (~90 ms for 500 rows on a busy local
server, measured); doing that after every save made short epochs pay far more for the artifacts
than for their task runs, and more so the longer the job ran. So the artifacts of saved epochs
are uploaded by a background thread, at most every ``min_interval`` seconds, or every ten times
the last upload's duration when that is longer (uploads take at most about a tenth of the time);
the training loop never waits for them. A failed save, a preemption, the end of the job and a
failing task run (:class:`~caffe2ckpt.prefect.PrefectSession` calls :meth:`flush`) are uploaded at
once, as is the first upload. A process that dies otherwise may lose the last interval's table
updates; the next attempt rebuilds the table from the commit records.
"""

from __future__ import annotations

import contextvars
import hashlib
import json
import logging
import math
import re
import threading
import time
from collections.abc import Callable
from typing import Any
from uuid import UUID

from prefect.artifacts import (
    create_markdown_artifact,
    create_progress_artifact,
    create_table_artifact,
)
from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import ArtifactUpdate
from prefect.client.schemas.filters import (
    ArtifactFilter,
    ArtifactFilterFlowRunId,
    ArtifactFilterKey,
)
from prefect.context import SyncClientContext
from prefect.runtime import flow_run

from caffe2ckpt.history.scan import scan
from caffe2ckpt.prefect.summary import Summary, attempt_reason, summary_markdown
from caffe2ckpt.prefect.table import (
    COMMITTED,
    DELETED,
    SUPERSEDED,
    checkpoint_row,
    checkpoint_table,
    failed_row,
    md_text,
)
from caffe2ckpt.session import RunEvent

__all__ = ["CheckpointArtifacts", "artifact_key", "artifact_metadata", "committed_rows"]

logger = logging.getLogger(__name__)

_STATUSES = (f"{COMMITTED}; {SUPERSEDED}: a later run went back to an earlier epoch and trained "
             f"on from there; {DELETED}: the checkpoint is gone, its row stays")
_UPLOAD_SHARE = 0.1  # throttled uploads wait 1 / share x the last one's duration, at least
_KINDS = ("checkpoints", "progress", "summary")


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def artifact_key(job_name: str, what: str, checkpoint_url: str | None = None) -> str:
    """A valid Prefect artifact key for ``what`` of job ``job_name``, with the checkpoint
    folder ``checkpoint_url`` (its last path segment and a hash of the whole URL) when given:
    ``regression-demo-1a2b3c-checkpoints``. Pass the folder's ``Location.canonical_url``, so
    that every spelling of one folder gives one key (:meth:`CheckpointArtifacts.key` does)."""
    parts = [_slug(job_name) or "job"]
    if checkpoint_url is not None:
        folder = _slug(checkpoint_url.rstrip("/").rpartition("/")[2])[:24].strip("-")
        digest = hashlib.sha256(checkpoint_url.encode()).hexdigest()[:6]
        parts += [folder, digest] if folder else [digest]
    return "-".join(parts + [what])


def committed_rows(store: Any, nodes: list[str], this_run: str | None
                   ) -> dict[int, dict[str, Any]]:
    """Rows for every epoch committed under ``store`` for ``nodes`` as flow run ``this_run``
    sees them (records only, as :mod:`caffe2ckpt.history.lineage` defines them; superseded
    epochs say so)."""
    family = scan(store, nodes).families.get(frozenset(nodes))
    if family is None:
        return {}
    rows = {s.epoch: checkpoint_row(s.epoch, s.records, this_run) | {"status": SUPERSEDED}
            for s in family.superseded}
    rows.update({s.epoch: checkpoint_row(s.epoch, s.records, this_run) for s in family.lineage})
    return dict(sorted(rows.items()))


def artifact_metadata(event: RunEvent) -> dict[str, str]:
    """What a later reader of the artifacts needs to find their records again (the run's
    crash handling, :mod:`caffe2ckpt.prefect.crashed`): the prefix, its nodes, the epoch limit."""
    cm = event.checkpoint_manager
    if cm is None:
        return {}
    return {"caffe2ckpt.url": cm.store.location.canonical_url,
            "caffe2ckpt.nodes": ",".join(cm.file_nodes()),
            "caffe2ckpt.max_epochs": "" if event.max_epochs is None else str(event.max_epochs),
            "caffe2ckpt.job": event.job}


class CheckpointArtifacts:
    """Keeps a flow run's checkpoint artifacts in step with :class:`RunEvent` events.

    Args:
        min_interval: upload the artifacts of saved epochs at most this often (seconds; longer
            while uploads are slow); 0: as soon as the last upload is done.
    """

    def __init__(self, *, min_interval: float = 2.0) -> None:
        self.min_interval = min_interval
        self._rows: dict[int, dict[str, Any]] = {}
        self._ids: dict[str, UUID] = {}
        self._summary: Summary | None = None
        self._epoch = 0  # the newest epoch reached: started or resumed from, saved, or failed
        self._lock = threading.Lock()  # rows, pending uploads, timer
        self._upload_lock = threading.RLock()  # one upload at a time, newest snapshot last
        self._pending: dict[str, Callable[[], ArtifactUpdate]] = {}  # key -> update, rendered late
        self._timer: threading.Timer | None = None
        self._uploading = False  # a flush is sending: it schedules what comes in meanwhile
        self._last_upload = float("-inf")
        self._interval = min_interval  # grows when uploads get slow (a long table, a busy server)

    @staticmethod
    def key(event: RunEvent, what: str) -> str:
        """The artifact key of ``what`` for ``event``'s job and checkpoint folder."""
        cm = event.checkpoint_manager
        if cm is None:
            return artifact_key(event.job, what)
        return artifact_key(event.job, what, cm.store.location.canonical_url)

    def handle(self, event: RunEvent) -> None:
        """Update the artifacts for ``event``; Prefect API errors are logged, never raised."""
        try:
            self._handle(event)
        except Exception as exc:  # the UI is a view: it must never break training
            logger.warning("could not update checkpoint artifacts for epoch %d: %s",
                           event.epoch, exc)

    def _handle(self, event: RunEvent) -> None:
        cm = event.checkpoint_manager
        if event.kind in ("started", "resumed"):
            if cm is not None:
                rows = self._committed_rows(cm)
                with self._lock:
                    self._rows = rows
            self._summary, self._epoch = self._new_summary(event), event.epoch
            self._create_or_update(event, final=False)
        elif event.kind in ("saved", "save_failed"):
            row = (checkpoint_row(event.epoch, event.records, flow_run.id)
                   if event.kind == "saved" else failed_row(event.epoch, event.error))
            with self._lock:
                self._rows[event.epoch] = row
                self._epoch = event.epoch
                if event.kind == "saved":  # this run went on from an earlier epoch: rows of
                    for epoch in self._rows:  # later epochs belong to a superseded run
                        if epoch > event.epoch and self._rows[epoch]["status"] == COMMITTED:
                            self._rows[epoch] = self._rows[epoch] | {"status": SUPERSEDED}
            self._changed(event, urgent=event.kind == "save_failed")
        elif event.kind == "deleted":  # retention removed it: keep the row (and its metrics)
            with self._lock:
                row = self._rows.get(event.epoch)
                if row is not None:
                    self._rows[event.epoch] = row | {"status": DELETED}
            if row is not None:
                self._changed(event, urgent=False, progress=False)
        elif event.kind == "recovered" and self._summary is not None:
            self._summary.recoveries.append(event.detail or f"went back to epoch {event.epoch}")
            self._epoch = event.epoch
            self._changed(event, urgent=True)
        elif event.kind == "preempted":  # the job stops now, without a "finished" event
            self.flush()
        elif event.kind == "finished":
            self._epoch = event.epoch
            self._create_or_update(event, final=True)

    def _new_summary(self, event: RunEvent) -> Summary:
        cm = event.checkpoint_manager
        resumed = elastic = None
        if event.kind == "resumed" and event.records:
            resumed = (event.epoch, next(iter(event.records.values())).writer)
            nodes = cm.file_nodes() if cm is not None else list(event.records)
            if set(nodes) != set(event.records):
                elastic = (len(event.records), len(nodes))
        return Summary(
            job=event.job,
            this_run={"flow_run_id": flow_run.id, "flow_run_name": flow_run.name,
                      "run_count": flow_run.run_count},
            start=event.epoch, target=event.max_epochs, resumed=resumed, elastic=elastic,
            memory=event.detail if event.kind == "resumed" else None,
            reason=attempt_reason(flow_run.id, flow_run.run_count),
            url=cm.url if cm is not None else None,
            file_node=cm.file_nodes()[0] if cm is not None else None)

    # -- what each artifact shows ----------------------------------------------------------------

    def _table_rows(self) -> list[dict[str, Any]]:
        """The table, newest epoch first (the caller holds ``_lock``)."""
        return checkpoint_table(self._rows[e] for e in sorted(self._rows, reverse=True))

    def _table_update(self) -> ArtifactUpdate:
        return ArtifactUpdate(data=json.dumps(self._table_rows()))

    def _progress_update(self, event: RunEvent, *, done: bool = False) -> ArtifactUpdate:
        """The newest epoch against this run's epoch limit (the job's ``max_epochs``)."""
        limit, epoch = event.max_epochs, self._epoch
        value = 100.0 if done else (min(100.0, 100.0 * epoch / limit) if limit else 0.0)
        text = f"Epoch {epoch}" + (f" of {limit}" if limit else "")
        start = self._summary.start if self._summary is not None else 0
        text += (" (finished)" if done else f" (this run started from epoch {start})")
        return ArtifactUpdate(data=value, description=f"Job {event.job!r}: {text}")

    def _summary_update(self, *, final: bool) -> ArtifactUpdate:
        """The summary (the caller holds ``_lock``; the summary is made)."""
        assert self._summary is not None
        return ArtifactUpdate(data=summary_markdown(self._summary, self._rows, epoch=self._epoch,
                                                    final=final))

    # -- throttled uploads ---------------------------------------------------------------------

    def _changed(self, event: RunEvent, *, urgent: bool, progress: bool = True) -> None:
        """The rows changed: upload now if ``urgent``, else in the background."""
        if any(self.key(event, what) not in self._ids for what in _KINDS):  # no "started" seen
            self._create_or_update(event, final=False)
            return
        bar = self._progress_update(event) if progress else None
        with self._lock:
            self._pending[self.key(event, "checkpoints")] = self._table_update
            self._pending[self.key(event, "summary")] = lambda: self._summary_update(final=False)
            if bar is not None:
                self._pending[self.key(event, "progress")] = lambda: bar
            if not urgent:
                self._schedule()
                return
        self.flush()

    def _schedule(self) -> None:
        """Start the timer that uploads whatever is pending one interval after the last upload
        (the caller holds ``_lock``). The training loop never waits for it."""
        if self._timer is not None or self._uploading or not self._pending:
            return
        wait = max(0.0, self._last_upload + self._interval - time.monotonic())
        run = contextvars.copy_context().run  # Prefect's settings (API URL) live there
        self._timer = threading.Timer(wait, run, args=(self._flush_quietly,))
        self._timer.name = "caffe2ckpt-artifacts"
        self._timer.daemon = True  # never hold up (or hang) the process's exit
        self._timer.start()

    def flush(self) -> None:
        """Upload pending changes now."""
        with self._upload_lock:
            with self._lock:
                if self._timer is not None:
                    self._timer.cancel()
                    self._timer = None
                pending, self._pending = self._pending, {}
                updates = {key: render() for key, render in pending.items()}
                self._uploading = True
            start = time.monotonic()
            try:
                if updates:
                    with get_client(sync_client=True) as client:
                        for key, update in updates.items():
                            client.update_artifact(self._ids[key], update)
            finally:
                with self._lock:
                    self._uploading = False
                    self._last_upload = time.monotonic()
                    if updates:
                        self._interval = max(self.min_interval,
                                             (self._last_upload - start) / _UPLOAD_SHARE)
                    self._schedule()  # changes made while this upload ran

    def _flush_quietly(self) -> None:
        """The timer's upload, in a copy of the flow's context: it keeps Prefect's settings (the
        API URL) but must not reuse the flow's client, which is closed when the flow run ends."""
        SyncClientContext.__var__.set(None)
        try:
            self.flush()
        except Exception as exc:  # a timer thread: nobody to raise to
            logger.warning("could not update checkpoint artifacts: %s", exc)

    def _committed_rows(self, cm: Any) -> dict[int, dict[str, Any]]:
        return committed_rows(cm.store, cm.file_nodes(), flow_run.id)

    # -- one artifact per key per flow run -----------------------------------------------------

    def _existing(self, key: str) -> UUID | None:
        if key in self._ids:
            return self._ids[key]
        with get_client(sync_client=True) as client:
            found = self._of_this_run(client, key)
        if found:
            self._ids[key] = found[0].id
        return self._ids.get(key)

    @staticmethod
    def _of_this_run(client: Any, key: str) -> list[Any]:
        """This flow run's artifacts ``key``, oldest first."""
        found = client.read_artifacts(artifact_filter=ArtifactFilter(
            key=ArtifactFilterKey(any_=[key]),
            flow_run_id=ArtifactFilterFlowRunId(any_=[UUID(flow_run.id)]),
        ))
        return sorted(found, key=lambda a: a.created.timestamp() if a.created else math.inf)

    def _only(self, client: Any, key: str, created: UUID) -> UUID:
        """The one artifact ``key`` of this flow run once ``created`` was made: a create that
        Prefect's client sent again after its answer was lost (a slow server) makes a second
        one, so the oldest is kept and the others deleted (best effort)."""
        found = self._of_this_run(client, key)
        if len(found) <= 1:
            return created
        for extra in found[1:]:
            try:
                client.delete_artifact(extra.id)
            except Exception as exc:  # noqa: BLE001 - a duplicate left is only a duplicate
                logger.warning("could not delete a duplicate of artifact %s: %s", key, exc)
        return found[0].id

    def _create_or_update(self, event: RunEvent, *, final: bool) -> None:
        """Upload all three artifacts now, creating the ones this flow run does not have."""
        cm = event.checkpoint_manager
        where = f" in {md_text(cm.url)} (path: relative to it)" if cm is not None else ""
        if self._summary is None:  # no "started" or "resumed" seen
            self._summary = self._new_summary(event)
        with self._upload_lock:
            with self._lock:
                for what in _KINDS:
                    self._pending.pop(self.key(event, what), None)
                rows = self._table_rows()
                summary = self._summary_update(final=final)
            bar = self._progress_update(event, done=final)
            creators = {
                "checkpoints": lambda key: create_table_artifact(
                    rows, key=key,
                    description=f"Checkpoints of job {event.job!r}{where}, newest first. "
                                f"Status: {_STATUSES}"),
                "progress": lambda key: create_progress_artifact(
                    bar.data, key=key, description=bar.description),
                "summary": lambda key: create_markdown_artifact(
                    summary.data, key=key, description=f"Summary of job {event.job!r}"),
            }
            updates = {"checkpoints": ArtifactUpdate(data=json.dumps(rows)), "progress": bar,
                       "summary": summary}
            metadata = artifact_metadata(event)
            for what in _KINDS:
                key = self.key(event, what)
                artifact_id = self._existing(key)
                with get_client(sync_client=True) as client:
                    if artifact_id is None:
                        self._ids[key] = self._only(client, key, creators[what](key))
                        if metadata:
                            client.update_artifact(self._ids[key],
                                                   ArtifactUpdate(metadata_=metadata))
                    else:
                        update = updates[what]
                        update.metadata_ = metadata or None
                        client.update_artifact(artifact_id, update)
            self._last_upload = time.monotonic()
