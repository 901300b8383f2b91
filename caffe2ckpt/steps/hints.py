"""The ``changed_rows=`` hints of :meth:`StepCheckpointManager.save`: ``{node: {blob: row ids}}``
saying which rows of which blobs changed since the previous save (differential saves with
``delta_detection="hints"``), checked before anything is noted or written."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from caffe2ckpt.errors import InvalidLocationError, JobDefinitionError
from caffe2ckpt.policy import StepManagerOptions
from caffe2ckpt.workspace import check_rows

__all__ = ["ChangedRows", "check_hints"]

ChangedRows = Mapping[str, Mapping[str, Any]]  # {node: {blob name: row ids}}


def check_hints(step: int, blobs: dict[str, dict[str, np.ndarray]],
                changed_rows: ChangedRows | None, options: StepManagerOptions) -> None:
    """Raise unless ``changed_rows`` (if given) may be used with ``options`` and names only
    nodes and blobs of the step (``blobs``), with row ids of each blob.

    Raises:
        JobDefinitionError: hints without ``delta_saves`` and ``delta_detection="hints"``.
        InvalidLocationError: a node or blob the step does not have.
        InvalidBlobError: row ids that are not integers, or outside the blob.
    """
    if changed_rows is None:
        return
    if not (options.delta_saves and options.delta_detection == "hints"):
        raise JobDefinitionError(
            f"save({step}, changed_rows=...): hints are used only with "
            "StepManagerOptions(delta_saves=True, delta_detection='hints')")
    if not isinstance(changed_rows, Mapping):
        raise InvalidLocationError(
            f"save({step}, changed_rows=...): changed_rows must map node names to "
            f"{{blob: row ids}}, got {type(changed_rows).__name__}")
    for node, hints in changed_rows.items():
        unknown = sorted(set(hints) - set(blobs.get(node, {}))) if isinstance(
            hints, Mapping) else None
        if node not in blobs or unknown is None or unknown:
            raise InvalidLocationError(
                f"save({step}, changed_rows=...): node {node!r} must be a node of the step "
                f"mapping blobs of it to row ids (unknown: {unknown})")
        for blob, rows in hints.items():
            check_rows(f"save({step}, changed_rows=...): node {node!r}", blob, rows,
                       blobs[node][blob])
