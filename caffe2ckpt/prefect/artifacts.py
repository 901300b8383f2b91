"""Flow run artifacts for checkpoints: a table, a progress bar and a markdown summary.

There is exactly one artifact per key per flow run, also across retries: each artifact is
looked up by key and flow run id and updated in place, and only created when the run has none.
Keys are ``<job>-checkpoints``, ``<job>-progress`` and ``<job>-summary`` (lowercase letters,
digits and dashes, as Prefect requires).
"""

from __future__ import annotations

import json
import logging
import re
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
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterKey
from prefect.runtime import flow_run

from caffe2ckpt.commit import CommitRecord, list_records, read_record
from caffe2ckpt.errors import CheckpointError
from caffe2ckpt.naming import db_name
from caffe2ckpt.session import RunEvent

__all__ = ["CheckpointArtifacts", "artifact_key"]

logger = logging.getLogger(__name__)

COLUMNS = ["epoch", "status", "nodes", "bytes", "seconds", "MB/s", "attempt", "url"]


def artifact_key(job_name: str, what: str) -> str:
    """A valid Prefect artifact key for ``what`` of job ``job_name``."""
    slug = re.sub(r"[^a-z0-9]+", "-", job_name.lower()).strip("-") or "job"
    return f"{slug}-{what}"


def _row(epoch: int, records: dict[str, CommitRecord], url: str) -> dict[str, Any]:
    nbytes = sum(r.nbytes for r in records.values())
    seconds = max((r.seconds for r in records.values()), default=0.0)
    attempt = next(iter(records.values())).writer.get("run_count", "") if records else ""
    return {
        "epoch": epoch,
        "status": "committed",
        "nodes": ", ".join(sorted(records)),
        "bytes": nbytes,
        "seconds": round(seconds, 4),
        "MB/s": round(nbytes / seconds / 1e6, 1) if seconds > 0 else None,
        "attempt": attempt,
        "url": url,
    }


class CheckpointArtifacts:
    """Keeps a flow run's checkpoint artifacts in step with :class:`RunEvent`\\ s."""

    def __init__(self) -> None:
        self._rows: dict[int, dict[str, Any]] = {}
        self._ids: dict[str, UUID] = {}
        self._resumed: tuple[int, dict[str, Any]] | None = None

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
                self._rows = self._committed_rows(cm)
            if event.kind == "resumed" and event.records:
                self._resumed = (event.epoch, next(iter(event.records.values())).writer)
            self._summary(event, final=False)
            self._table(event)
            self._progress(event)
        elif event.kind in ("saved", "save_failed"):
            if event.kind == "saved":
                self._rows[event.epoch] = _row(event.epoch, dict(event.records),
                                               self._url(cm, event.epoch))
            else:
                self._rows[event.epoch] = {c: "" for c in COLUMNS} | {
                    "epoch": event.epoch, "status": f"FAILED: {event.error}"}
            self._table(event)
            self._progress(event)
        elif event.kind == "finished":
            self._progress(event, done=True)
            self._summary(event, final=True)

    @staticmethod
    def _url(cm: Any, epoch: int) -> str:
        return db_name(epoch, "*", cm.url) if cm is not None else ""

    def _committed_rows(self, cm: Any) -> dict[int, dict[str, Any]]:
        """Rows for every epoch committed under the prefix for the job's nodes (records only)."""
        location, nodes = cm.store.location, cm.file_nodes()
        by_epoch: dict[int, dict[str, CommitRecord]] = {}
        for ref in list_records(location):
            if ref.node in nodes:
                try:
                    by_epoch.setdefault(ref.epoch, {})[ref.node] = read_record(location, ref)
                except CheckpointError:
                    continue
        return {e: _row(e, recs, self._url(cm, e)) for e, recs in sorted(by_epoch.items())
                if set(recs) == set(nodes)}

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
        rows = [self._rows[e] for e in sorted(self._rows)]
        self._update(key, json.dumps(rows), lambda: create_table_artifact(
            rows, key=key, description=f"Checkpoints of job {event.job!r}"))

    def _progress(self, event: RunEvent, *, done: bool = False) -> None:
        key = artifact_key(event.job, "progress")
        limit = event.max_epochs
        value = 100.0 if done else (min(100.0, 100.0 * event.epoch / limit) if limit else 0.0)
        artifact_id = self._existing(key)
        if artifact_id is None:
            self._ids[key] = create_progress_artifact(
                value, key=key, description=f"Epochs of job {event.job!r} (of {limit})")
            return
        update_progress_artifact(artifact_id, value)

    def _summary(self, event: RunEvent, *, final: bool) -> None:
        key = artifact_key(event.job, "summary")
        cm = event.checkpoint_manager
        lines = [f"# Job `{event.job}`", ""]
        if self._resumed is not None:
            epoch, writer = self._resumed
            lines.append(f"- **Resumed** from epoch {epoch}, written by attempt "
                         f"{writer.get('run_count', '?')} of flow run `{writer.get('flow_run_id', '?')}`"
                         f" ({writer.get('session', '?')} session on {writer.get('host', '?')})")
        else:
            lines.append("- **Fresh start** (no committed checkpoint to resume from)")
        lines.append(f"- Attempt {flow_run.run_count} of flow run `{flow_run.id}`")
        if final:
            failed = [e for e, r in sorted(self._rows.items()) if r["status"] != "committed"]
            lines.append(f"- Finished at epoch **{event.epoch}**; "
                         f"{len(self._rows) - len(failed)} committed checkpoints"
                         + (f"; **failed saves: {failed}**" if failed else ""))
        if cm is not None:
            lines += ["", f"Checkpoints: `{cm.url}`", "", "Inspect them with:", "", "```python",
                      "import zarr",
                      f"g = zarr.open_group({db_name(event.epoch, cm.file_nodes()[0], cm.url)!r},"
                      " mode='r')",
                      "m = g.attrs['caffe2ckpt']",
                      "print(list(m['arrays']), m['packed']['names'])", "```"]
        markdown = "\n".join(lines)
        self._update(key, markdown, lambda: create_markdown_artifact(
            markdown, key=key, description=f"Summary of job {event.job!r}"))
