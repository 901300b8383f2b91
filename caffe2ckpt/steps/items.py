"""A step's items (``{node: {blob: array}}``) for :class:`~caffe2ckpt.steps.StepCheckpointManager`:
checked before a save writes anything (their shape and, with a layout, the replicated and rows
blobs: who writes each replicated blob once, and what each node then writes), and read back as
the nodes saved them."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from caffe2ckpt.errors import CheckpointNotFoundError, InvalidLocationError
from caffe2ckpt.history.lineage import Save
from caffe2ckpt.naming import check_node_name
from caffe2ckpt.sharding import Layout
from caffe2ckpt.store.commit.protocol import CheckpointStore
from caffe2ckpt.store.read.replicas import check_replicas, check_rows, replica_digests, row_specs
from caffe2ckpt.store.read.save import SaveReader
from caffe2ckpt.workspace import as_blob

__all__ = ["Blobs", "Items", "check_items", "read_nodes", "split_replicas"]

Items = Mapping[str, Mapping[str, Any]]  # {node: {blob name: array}}, as given
Blobs = dict[str, dict[str, np.ndarray]]  # the same, checked


def check_items(step: int, items: Items, nodes: Sequence[str] | None) -> Blobs:
    """``items`` as arrays, once it maps node names (exactly ``nodes``, when given) to blobs.

    Raises:
        InvalidLocationError: ``items`` is not such a mapping.
    """
    if not isinstance(items, Mapping) or not items:
        raise InvalidLocationError(f"save({step}): items must be a non-empty mapping "
                                   f"{{node: {{blob: array}}}}, got {type(items).__name__}")
    blobs = {}
    for node, node_blobs in items.items():
        check_node_name(node)
        if not isinstance(node_blobs, Mapping):
            raise InvalidLocationError(f"save({step}): node {node!r} must map blob names to "
                                       f"arrays, got {type(node_blobs).__name__}")
        blobs[node] = {name: as_blob(name, value) for name, value in node_blobs.items()}
    if nodes is not None and set(blobs) != set(nodes):
        raise InvalidLocationError(f"save({step}): this manager saves nodes {list(nodes)}, "
                                   f"got {sorted(blobs)}")
    return blobs


def split_replicas(layout: Layout | None, step: int, order: Sequence[str], blobs: Blobs,
                   where: str) -> tuple[dict[str, str], dict[str, list[str]], Blobs]:
    """The writer of each replicated blob (checked before anything is written), each node's
    blob names, and what each node writes (its blobs less the replicated ones another node
    writes); ``where`` is the prefix, for the refusals."""
    writers = _replicas(layout, step, order, blobs, where)
    held = {node: list(b) for node, b in blobs.items()}
    return writers, held, {node: {n: a for n, a in b.items() if writers.get(n, node) == node}
                           for node, b in blobs.items()}


def _replicas(layout: Layout | None, step: int, order: Sequence[str], blobs: Blobs,
              where: str) -> dict[str, str]:
    """Which node writes each replicated blob (the first in ``order`` holding it), once every
    node holding it holds the same value.

    Raises:
        InvalidBlobError: nodes hold different values of a replicated blob, or a rows blob
            does not fit the layout (:mod:`~caffe2ckpt.store.read.replicas`; nothing is written).
    """
    if layout is None:
        return {}
    writers = layout.writers(order, {n: list(b) for n, b in blobs.items()})
    if writers:
        check_replicas(step, {n: replica_digests({k: v for k, v in b.items() if k in writers})
                              for n, b in blobs.items()}, writers, where)
    rows = layout.rows_among(n for b in blobs.values() for n in b)
    check_rows(step, {n: row_specs({k: v for k, v in b.items() if k in rows})
                      for n, b in blobs.items()}, rows, order, layout.partition, where)
    return writers


def read_nodes(store: CheckpointStore, info: Save, nodes: Sequence[str] | None,
               blobs: Sequence[str] | None) -> Blobs:
    """``info``'s nodes (or ``nodes``), all blobs or ``blobs``, as its nodes saved them.

    Raises:
        CheckpointNotFoundError: the step has no such node, or a node no such blob.
    """
    wanted = sorted(info.records) if nodes is None else [str(n) for n in nodes]
    where = store.location.display()
    unknown = sorted(set(wanted) - set(info.records))
    if unknown:
        raise CheckpointNotFoundError(f"step {info.epoch} under {where!r} has no nodes "
                                      f"{unknown}; it has {sorted(info.records)}")
    out = {}
    reader = SaveReader(store, info.records)  # a replicated blob one node wrote: read once
    for node in wanted:
        out[node] = reader.blobs(node, blobs)
        missing = [b for b in blobs or () if b not in out[node]]
        if missing:
            raise CheckpointNotFoundError(
                f"step {info.epoch} of node {node!r} under {where!r} has no blobs {missing}")
    return out
