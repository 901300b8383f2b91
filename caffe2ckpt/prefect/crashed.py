"""A crashed flow run's checkpoint artifacts, brought up to date from the commit records.

A process killed with SIGKILL leaves its artifacts as it last uploaded them (uploads are
throttled: "Epoch 4 of 100" when epoch 9 was committed), and never says it crashed. Whoever
marks the run *Crashed* calls :func:`refresh_crashed_run`: the temporary server's reaper (through
``python -m caffe2ckpt.prefect refresh-crashed``), the next run's sweep of its flow
(:mod:`~caffe2ckpt.prefect.orphans`, also for runs the heartbeat automation marked, which runs
on the server and cannot), or a user. It reads the run's artifacts' metadata (the checkpoint
prefix, its nodes and the epoch limit, see :func:`~.artifacts.artifact_metadata`), rebuilds the
table from the records, sets the progress bar to the newest epoch the run committed and adds a
*Crashed* section to the summary. The records are read with the filesystem's default
credentials (environment, config files): a prefix they cannot read keeps its table, and the
progress and summary still say the run crashed.
"""

from __future__ import annotations

import json
import logging
from typing import Any
from uuid import UUID

from prefect.client.schemas.actions import ArtifactUpdate
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

from caffe2ckpt.fs.location import Location
from caffe2ckpt.prefect.artifacts import committed_rows
from caffe2ckpt.prefect.table import checkpoint_table
from caffe2ckpt.store.commit.protocol import CheckpointStore

__all__ = ["CRASHED_MARK", "refresh_crashed_run"]

logger = logging.getLogger(__name__)

CRASHED_MARK = "(crashed)"  # in the progress bar's description once refreshed


def _artifacts(client: Any, run_id: UUID) -> dict[str, Any]:
    """The run's caffe2ckpt artifacts by kind (``checkpoints``, ``progress``, ``summary``)."""
    found = client.read_artifacts(artifact_filter=ArtifactFilter(
        flow_run_id=ArtifactFilterFlowRunId(any_=[run_id])))
    return {a.key.rpartition("-")[2]: a for a in found
            if a.key and (a.metadata_ or {}).get("caffe2ckpt.url")}


def _rows(meta: dict[str, str], run_id: UUID) -> dict[int, dict[str, Any]] | None:
    """The table rows from the records (None: they cannot be read from here)."""
    try:
        store = CheckpointStore(Location(meta["caffe2ckpt.url"]))
        return committed_rows(store, meta["caffe2ckpt.nodes"].split(","), str(run_id))
    except Exception as exc:  # noqa: BLE001 - credentials, a gone disk: say the crash anyway
        logger.warning("the records under %s cannot be read from here (%s): the crashed run's "
                       "table stays as it was", meta["caffe2ckpt.url"], exc)
        return None


def _newest_by(rows: dict[int, dict[str, Any]], run_id: UUID) -> int | None:
    mine = [e for e, row in rows.items() if (row.get("writer") or {}).get("flow_run_id")
            == str(run_id)]
    return max(mine, default=None)


def refresh_crashed_run(client: Any, run_id: UUID | str, why: str) -> bool:
    """Bring crashed flow run ``run_id``'s checkpoint artifacts up to date (see the module
    docstring); ``why``: who marked it and how. False if it has none, or they are up to date."""
    run_id = UUID(str(run_id))
    by_kind = _artifacts(client, run_id)
    progress = by_kind.get("progress")
    if progress is None or CRASHED_MARK in (progress.description or ""):
        return False
    meta = progress.metadata_
    rows = _rows(meta, run_id)
    newest = _newest_by(rows, run_id) if rows else None
    limit = int(meta["caffe2ckpt.max_epochs"]) if meta.get("caffe2ckpt.max_epochs") else None
    said = (f"epoch {newest} is the newest it committed: a retry or re-run resumes from the "
            "newest committed epoch") if newest is not None else \
        "it committed no epoch that can be read from here"
    if rows is not None and "checkpoints" in by_kind:
        table = checkpoint_table(rows[e] for e in sorted(rows, reverse=True))
        client.update_artifact(by_kind["checkpoints"].id, ArtifactUpdate(data=json.dumps(table)))
    if "summary" in by_kind:
        client.update_artifact(by_kind["summary"].id, ArtifactUpdate(
            data=f"{by_kind['summary'].data}\n\n- **Crashed**: {why}; {said}.\n"))
    value = progress.data if newest is None or not limit else min(100.0, 100.0 * newest / limit)
    text = (f"Epoch {newest}" + (f" of {limit}" if limit else "")) if newest is not None \
        else (progress.description or "").partition(": ")[2].partition(" (")[0]
    client.update_artifact(progress.id, ArtifactUpdate(
        data=value, description=f"Job {meta.get('caffe2ckpt.job', '?')!r}: {text} "
                                f"{CRASHED_MARK}"))
    logger.info("brought the artifacts of crashed flow run %s up to date: %s", run_id, said)
    return True
