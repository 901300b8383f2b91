"""``caffe2ckpt diff``: which blobs of one node changed between two epochs, and by how much.

Blobs are read (and their checksums verified) one array at a time, the packed small blobs of a
node in one read, so memory stays at about two blobs. Equality is NaN-aware: NaN against NaN
(in the same place) is the same, and so are 0.0 and -0.0.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from caffe2ckpt.cli._context import (
    EXIT_NOT_FOUND,
    EXIT_OK,
    CLIError,
    Context,
    Document,
    checked_manifest,
    open_prefix,
    require_save,
)
from caffe2ckpt.cli.render import Progress
from caffe2ckpt.history.lineage import Save
from caffe2ckpt.history.scan import PrefixScan
from caffe2ckpt.store.groupread import chained_together, read_node
from caffe2ckpt.store.manifest import BlobInfo
from caffe2ckpt.store.protocol import CheckpointStore
from caffe2ckpt.store.records import CommitRecord

__all__ = ["cmd_diff", "compare", "diff_node"]


class _Reader:
    """Reads the blobs of one committed node checkpoint on demand: each array alone, the
    packed blobs together, and (a differential save) the small blobs other groups hold
    together, so each source group's packed array is read once."""

    def __init__(self, store: CheckpointStore, record: CommitRecord) -> None:
        self.store, self.record = store, record
        self.manifest = checked_manifest(store, record)
        self.path = store.group_path(record)
        self.crcs = store.chunk_crcs(record, self.manifest)
        self._packed: dict[str, np.ndarray] | None = None
        self._together = chained_together(self.manifest)
        self._chained: dict[str, np.ndarray] | None = None

    def read(self, name: str) -> np.ndarray:
        if name in self.manifest.inherited:  # a differential save's: through its chain
            if name not in self._together:
                return self.store.load_node(self.record, [name])[name]
            if self._chained is None:
                self._chained = self.store.load_node(self.record, self._together)
            return self._chained[name]
        if self.manifest.blobs[name].path is not None:
            return read_node(self.store.location, self.path, self.manifest, self.crcs,
                             [name])[name]
        if self._packed is None:
            self._packed = read_node(self.store.location, self.path, self.manifest, self.crcs,
                                     [b.name for b in self.manifest.packed])
        return self._packed[name]


def _side(info: BlobInfo | None) -> dict[str, Any] | None:
    if info is None:
        return None
    return {"dtype": info.dtype, "shape": list(info.shape), "bytes": info.nbytes}


def _json_float(value: float) -> float | str:
    return value if math.isfinite(value) else repr(value)


def compare(a: np.ndarray, b: np.ndarray) -> dict[str, Any]:
    """Element-wise comparison of two arrays of one dtype and shape.

    Returns ``elements``, ``differing`` (count), ``max_abs_diff`` (the largest ``|b - a|`` over
    differing elements where both are numbers: float for floats and complex, exact int for
    ints, 1 for bools, None for strings or when every difference involves a NaN) and
    ``nan_mismatches`` (elements that are NaN on one side only).
    """
    kind = a.dtype.kind
    if kind in "fc":
        equal = (a == b) | (np.isnan(a) & np.isnan(b))
    else:
        equal = a == b
    equal = np.asarray(equal)
    differing = int(equal.size - np.count_nonzero(equal))
    out: dict[str, Any] = {"elements": int(a.size), "differing": differing,
                           "max_abs_diff": None, "nan_mismatches": 0}
    if not differing:
        return out
    mask = ~equal
    da, db = a[mask], b[mask]
    if kind in "fc":
        wide = np.complex128 if kind == "c" else np.float64
        delta = np.abs(db.astype(wide) - da.astype(wide))
        nan = np.isnan(delta)
        out["nan_mismatches"] = int(np.count_nonzero(nan))
        if not nan.all():
            out["max_abs_diff"] = _json_float(float(delta[~nan].max()))
    elif kind == "b":
        out["max_abs_diff"] = 1
    elif kind in "iu":
        if a.dtype.itemsize <= 4:
            out["max_abs_diff"] = int(np.abs(db.astype(np.int64) - da.astype(np.int64)).max())
        else:  # exact for int64 / uint64 (no overflow)
            out["max_abs_diff"] = max(abs(y - x) for x, y in zip(da.tolist(), db.tolist()))
    return out


def diff_node(store: CheckpointStore, node: str, records: Sequence[CommitRecord | None],
              progress: Progress) -> list[dict[str, Any]]:
    """One entry per blob of ``node`` in either save: added, removed, changed or same."""
    readers = [_Reader(store, r) if r is not None else None for r in records]
    blobs_a = readers[0].manifest.blobs if readers[0] is not None else {}
    blobs_b = readers[1].manifest.blobs if readers[1] is not None else {}
    out = []
    for name in [*blobs_a, *(n for n in blobs_b if n not in blobs_a)]:
        ia, ib = blobs_a.get(name), blobs_b.get(name)
        entry: dict[str, Any] = {"node": node, "name": name, "a": _side(ia), "b": _side(ib),
                                 "elements": None, "differing": None, "max_abs_diff": None,
                                 "nan_mismatches": None}
        if ia is None or ib is None:
            entry["status"] = "added" if ia is None else "removed"
            progress.advance((ia or ib).nbytes, f"{node}: {name}")
        elif (ia.dtype, ia.shape) != (ib.dtype, ib.shape):
            entry["status"] = "changed"
            progress.advance(ia.nbytes + ib.nbytes, f"{node}: {name}")
        else:
            entry.update(compare(readers[0].read(name), readers[1].read(name)))
            entry["status"] = "changed" if entry["differing"] else "same"
            progress.advance(ia.nbytes + ib.nbytes, f"{node}: {name}")
        out.append(entry)
    return out


def _save(store: CheckpointStore, found: PrefixScan, epoch: int,
          nodes: list[str] | None) -> Save:
    """The save of ``epoch`` holding ``nodes`` (jobs with other nodes may share the prefix),
    else the one ``epoch`` means without nodes (in which those nodes are added or removed)."""
    return found.save_at(epoch, nodes or ()) or require_save(store, found, epoch)


def cmd_diff(ctx: Context, args: argparse.Namespace) -> tuple[Document, int]:
    store, found = open_prefix(ctx, args.prefix)
    a, b = args.epoch_a, args.epoch_b
    step_a, step_b = (_save(store, found, epoch, args.node) for epoch in (a, b))
    nodes = sorted(set(step_a.records) | set(step_b.records))
    if args.node:
        unknown = [n for n in args.node if n not in nodes]
        if unknown:
            raise CLIError(f"neither epoch {a} nor epoch {b} under {store.location.display()!r}"
                           f" has node {', '.join(map(repr, unknown))}; their nodes: "
                           f"{', '.join(nodes)}", EXIT_NOT_FOUND)
        nodes = [n for n in nodes if n in args.node]
    total = sum(s.records[n].nbytes for s in (step_a, step_b) for n in nodes if n in s.records)
    ctx.progress.start(f"diff {a} {b}", total)
    blobs: list[Document] = []
    for node in nodes:
        blobs += diff_node(store, node, [s.records.get(node) for s in (step_a, step_b)],
                           ctx.progress)
    ctx.progress.close()
    summary = {k: sum(x["status"] == k for x in blobs)
               for k in ("changed", "added", "removed", "same")}
    doc = {"prefix": store.location.display(), "epochs": [a, b], "nodes": nodes,
           "nodes_added": sorted(set(step_b.records) - set(step_a.records) & set(nodes)),
           "nodes_removed": sorted(set(step_a.records) - set(step_b.records) & set(nodes)),
           "summary": summary, "blobs": blobs, "show_same": bool(args.all)}
    return doc, EXIT_OK
