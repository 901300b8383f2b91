"""Flow run artifacts for checkpoints: a table, a progress bar and a markdown summary.

There is exactly one artifact per key per flow run, also across retries: each artifact is
looked up by key and flow run id and updated in place, and only created when the run has none.
Keys are ``<job>-checkpoints``, ``<job>-progress`` and ``<job>-summary`` (lowercase letters,
digits and dashes, as Prefect requires).

The checkpoint table (rows: :mod:`caffe2ckpt.prefect.table`) has a row per epoch committed under
the prefix, by this flow run or any other: ``epoch``, ``status``, a column per metric the commit
records carry (``CommitRecord.metrics``, 4 significant digits, ``NaN`` and ``inf`` as such),
``nodes``, ``bytes`` (``12.3 MiB``), ``seconds``, ``MB/s``, ``written by`` (``this run, attempt
2`` or another run's name, short id and attempt) and ``path`` (relative to the checkpoint root,
which the table's description names). The summary says where the run started from and links
every flow run that wrote epochs of the table to its page in the Prefect UI (table cells get no
links: the default UI of Prefect 3.8 shows them as plain text).

Uploads are throttled. Updating the table and the progress bar takes two API calls and sends
the whole table, which grows with the epochs (~90 ms for 500 rows on a busy local server,
measured); doing that after every save made short epochs pay far more for the artifacts than for
their task runs, and more so the longer the job ran. So the table and progress of saved epochs
are uploaded by a background thread, at most every ``min_interval`` seconds, or every ten times
the last upload's duration when that is longer (uploads take at most about a tenth of the time);
the training loop never waits for them. A failed save, a preemption, the end of the job and a
failing task run (:class:`~caffe2ckpt.prefect.PrefectSession` calls :meth:`flush`) are uploaded at
once, as is the first upload. A process that dies otherwise may lose the last interval's table
updates; the next attempt rebuilds the table from the commit records.
"""

from __future__ import annotations

import contextvars
import json
import logging
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
    update_progress_artifact,
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
from caffe2ckpt.naming import db_name
from caffe2ckpt.prefect.table import (
    checkpoint_row,
    checkpoint_table,
    epoch_ranges,
    failed_row,
    md_text,
    writer_cell,
)
from caffe2ckpt.session import RunEvent

__all__ = ["CheckpointArtifacts", "artifact_key"]

logger = logging.getLogger(__name__)

_SUPERSEDED = "superseded (a later run went back to an earlier epoch)"
_UPLOAD_SHARE = 0.1  # throttled uploads wait 1 / share x the last one's duration, at least


def artifact_key(job_name: str, what: str) -> str:
    """A valid Prefect artifact key for ``what`` of job ``job_name``."""
    slug = re.sub(r"[^a-z0-9]+", "-", job_name.lower()).strip("-") or "job"
    return f"{slug}-{what}"


class CheckpointArtifacts:
    """Keeps a flow run's checkpoint artifacts in step with :class:`RunEvent`\\ s.

    Args:
        min_interval: upload the table and progress of saved epochs at most this often
            (seconds; longer while uploads are slow); 0: as soon as the last upload is done.
    """

    def __init__(self, *, min_interval: float = 2.0) -> None:
        self.min_interval = min_interval
        self._rows: dict[int, dict[str, Any]] = {}
        self._ids: dict[str, UUID] = {}
        self._resumed: tuple[int, dict[str, Any]] | None = None
        self._lock = threading.Lock()  # rows, pending uploads, timer
        self._upload_lock = threading.RLock()  # one upload at a time, newest snapshot last
        self._pending: dict[str, Callable[[], Any]] = {}  # artifact key -> its data, rendered late
        self._timer: threading.Timer | None = None
        self._uploading = False  # a flush is sending: it schedules what comes in meanwhile
        self._last_upload = float("-inf")
        self._interval = min_interval  # grows when uploads get slow (a long table, a busy server)

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
            if event.kind == "resumed" and event.records:
                self._resumed = (event.epoch, next(iter(event.records.values())).writer)
            self._summary(event, final=False)
            self._table(event)
            self._progress(event)
        elif event.kind in ("saved", "save_failed"):
            row = (checkpoint_row(event.epoch, event.records, flow_run.id)
                   if event.kind == "saved" else failed_row(event.epoch, event.error))
            with self._lock:
                self._rows[event.epoch] = row
                if event.kind == "saved":  # this run went on from an earlier epoch: rows of
                    for epoch in self._rows:  # later epochs belong to a superseded run
                        if epoch > event.epoch and self._rows[epoch]["status"] == "committed":
                            self._rows[epoch] = self._rows[epoch] | {"status": _SUPERSEDED}
            self._changed(event, urgent=event.kind == "save_failed")
        elif event.kind == "deleted":  # retention removed it: keep the row (and its metrics)
            with self._lock:
                row = self._rows.get(event.epoch)
                if row is not None:
                    self._rows[event.epoch] = row | {"status": "deleted (retention)"}
            if row is not None:
                self._changed(event, urgent=False, progress=False)
        elif event.kind == "preempted":  # the job stops now, without a "finished" event
            self.flush()
        elif event.kind == "finished":
            self.flush()
            self._progress(event, done=True)
            self._summary(event, final=True)

    # -- throttled uploads ---------------------------------------------------------------------

    def _changed(self, event: RunEvent, *, urgent: bool, progress: bool = True) -> None:
        """The table (and progress) changed: upload now if ``urgent``, else in the background."""
        table, bar = artifact_key(event.job, "checkpoints"), artifact_key(event.job, "progress")
        if table not in self._ids or (progress and bar not in self._ids):  # no "started" seen
            self._table(event)
            if progress:
                self._progress(event)
            return
        value = self._progress_value(event)
        with self._lock:
            self._pending[table] = self._table_json
            if progress:
                self._pending[bar] = lambda: value
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
        """Upload pending table and progress changes now."""
        with self._upload_lock:
            with self._lock:
                if self._timer is not None:
                    self._timer.cancel()
                    self._timer = None
                pending, self._pending = self._pending, {}
                data = {key: render() for key, render in pending.items()}
                self._uploading = True
            start = time.monotonic()
            try:
                if data:
                    with get_client(sync_client=True) as client:
                        for key, value in data.items():
                            client.update_artifact(self._ids[key], ArtifactUpdate(data=value))
            finally:
                with self._lock:
                    self._uploading = False
                    self._last_upload = time.monotonic()
                    if data:
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

    def _table_json(self) -> str:
        return json.dumps(checkpoint_table(self._rows[e] for e in sorted(self._rows)))

    def _committed_rows(self, cm: Any) -> dict[int, dict[str, Any]]:
        """Rows for every epoch committed under the prefix for the job's nodes (records only,
        as :mod:`caffe2ckpt.history.lineage` defines them; superseded epochs say so)."""
        family = scan(cm.store, cm.file_nodes()).families.get(frozenset(cm.file_nodes()))
        if family is None:
            return {}
        rows = {s.epoch: checkpoint_row(s.epoch, s.records, flow_run.id) | {"status": _SUPERSEDED}
                for s in family.superseded}
        rows.update({s.epoch: checkpoint_row(s.epoch, s.records, flow_run.id)
                     for s in family.lineage})
        return dict(sorted(rows.items()))

    # -- one artifact per key per flow run -----------------------------------------------------

    def _existing(self, key: str) -> UUID | None:
        if key in self._ids:
            return self._ids[key]
        with get_client(sync_client=True) as client:
            found = client.read_artifacts(artifact_filter=ArtifactFilter(
                key=ArtifactFilterKey(any_=[key]),
                flow_run_id=ArtifactFilterFlowRunId(any_=[UUID(flow_run.id)]),
            ))
        if found:
            self._ids[key] = found[0].id
        return self._ids.get(key)

    def _update(self, key: str, data: Any, create: Any) -> None:
        artifact_id = self._existing(key)
        if artifact_id is None:
            self._ids[key] = create()
            return
        with get_client(sync_client=True) as client:
            client.update_artifact(artifact_id, ArtifactUpdate(data=data))

    def _table(self, event: RunEvent) -> None:
        key = artifact_key(event.job, "checkpoints")
        with self._upload_lock:
            with self._lock:
                self._pending.pop(key, None)
                rows = checkpoint_table(self._rows[e] for e in sorted(self._rows))
            cm = event.checkpoint_manager
            where = f" in {md_text(cm.url)} (path: relative to it)" if cm is not None else ""
            self._update(key, json.dumps(rows), lambda: create_table_artifact(
                rows, key=key, description=f"Checkpoints of job {event.job!r}{where}"))
            self._last_upload = time.monotonic()

    @staticmethod
    def _progress_value(event: RunEvent, *, done: bool = False) -> float:
        limit = event.max_epochs
        return 100.0 if done else (min(100.0, 100.0 * event.epoch / limit) if limit else 0.0)

    def _progress(self, event: RunEvent, *, done: bool = False) -> None:
        key = artifact_key(event.job, "progress")
        value = self._progress_value(event, done=done)
        with self._upload_lock:
            with self._lock:
                self._pending.pop(key, None)
            artifact_id = self._existing(key)
            if artifact_id is None:
                self._ids[key] = create_progress_artifact(
                    value, key=key,
                    description=f"Epochs of job {event.job!r} (of {event.max_epochs})")
                return
            update_progress_artifact(artifact_id, value)

    def _writers(self) -> list[str]:
        """Markdown lines: which flow run (linked) and attempt wrote which epochs of the table."""
        epochs: dict[str, list[int]] = {}
        with self._lock:
            for epoch, row in sorted(self._rows.items()):
                if row.get("writer") is not None:  # None: a failed save
                    epochs.setdefault(writer_cell(row["writer"], flow_run.id, link=True),
                                      []).append(epoch)
        return (["", "Written by (epochs in the checkpoints table):", ""]
                + [f"- {who}: epochs {epoch_ranges(es)}" for who, es in epochs.items()]
                if epochs else [])

    def _summary(self, event: RunEvent, *, final: bool) -> None:
        key = artifact_key(event.job, "summary")
        cm = event.checkpoint_manager
        lines = [f"# Job `{event.job}`", ""]
        if self._resumed is not None:
            epoch, writer = self._resumed
            lines.append(f"- **Resumed** from epoch {epoch}, written by "
                         f"{writer_cell(writer, flow_run.id, link=True)}")
        else:
            lines.append("- **Fresh start** (no committed checkpoint to resume from)")
        this_run = {"flow_run_id": flow_run.id, "flow_run_name": flow_run.name,
                    "run_count": flow_run.run_count}
        lines.append(f"- This run: {writer_cell(this_run, None, link=True)}")
        if final:
            with self._lock:
                statuses = {e: r["status"] for e, r in sorted(self._rows.items())}
            failed = [e for e, status in statuses.items() if status.startswith("FAILED")]
            committed = sum(status == "committed" for status in statuses.values())
            lines.append(f"- Finished at epoch **{event.epoch}**; {committed} committed checkpoints"
                         + (f"; **failed saves: {failed}**" if failed else ""))
        if cm is not None:
            lines += ["", f"Checkpoints: `{cm.url}`", "", "Inspect them with:", "", "```python",
                      "import zarr",
                      f"g = zarr.open_group({db_name(event.epoch, cm.file_nodes()[0], cm.url)!r},"
                      " mode='r')",
                      "m = g.attrs['caffe2ckpt']",
                      "print(list(m['arrays']), m['packed']['names'])", "```"]
        lines += self._writers()
        markdown = "\n".join(lines)
        self._update(key, markdown, lambda: create_markdown_artifact(
            markdown, key=key, description=f"Summary of job {event.job!r}"))
