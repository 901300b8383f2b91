"""``caffe2ckpt ls``: every epoch of a prefix (committed, superseded, partial, damaged) and its
leftovers."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from caffe2ckpt.cli._context import (
    EXIT_OK,
    Context,
    Document,
    json_metrics,
    leftover_doc,
    open_prefix,
    utc,
)
from caffe2ckpt.history.catalog import find_leftovers
from caffe2ckpt.store.records import CommitRecord

__all__ = ["cmd_ls"]


def node_workers(records: Sequence[CommitRecord]) -> dict[str, dict[str, Any]]:
    """``{node: {host, pid}}`` of the process that wrote each node's data, where its record
    names one (a Dask worker's, when the node lived there)."""
    return {r.node: r.writer["worker"] for r in records
            if isinstance(r.writer.get("worker"), dict)}


def cmd_ls(ctx: Context, args: argparse.Namespace) -> tuple[Document, int]:
    store, found = open_prefix(ctx, args.prefix)
    location = store.location
    rows: list[Document] = []
    for step in found.steps.values():
        records = [step.records[n] for n in step.nodes]
        rows.append({
            "epoch": step.epoch,
            "state": "superseded" if step.epoch in found.superseded else "committed",
            "nodes": step.nodes, "missing_nodes": [],
            "bytes": step.nbytes, "node_bytes": {r.node: r.nbytes for r in records},
            "blobs": sum(r.blob_count for r in records), "metrics": json_metrics(step.metrics),
            "created": step.created, "created_utc": utc(step.created),
            "writer": records[0].writer, "node_workers": node_workers(records),
            "stop": any(r.stop for r in records), "save_ids": sorted({r.save_id for r in records}),
        })
    unreadable = {(ref.epoch, ref.save_id, ref.node): msg for ref, msg in found.unreadable}
    for epoch, save_id, have, missing, by_node in found.partial:
        records = [by_node[n] for n in have]
        damaged = [unreadable.pop((epoch, save_id, n)) for n in missing
                   if (epoch, save_id, n) in unreadable]
        created = max((r.created for r in records), default=None)
        rows.append({
            "epoch": epoch, "state": "damaged record" if damaged else "partial", "nodes": have,
            "missing_nodes": missing, "bytes": sum(r.nbytes for r in records),
            "node_bytes": {r.node: r.nbytes for r in records},
            "blobs": sum(r.blob_count for r in records),
            "metrics": json_metrics(records[0].metrics) if records else {},
            "created": created, "created_utc": utc(created) if created else None,
            "writer": records[0].writer if records else {}, "node_workers": node_workers(records),
            "stop": any(r.stop for r in records), "save_ids": [save_id],
            **({"error": "; ".join(damaged)} if damaged else {}),
        })
    for (epoch, save_id, node), message in unreadable.items():
        rows.append({"epoch": epoch, "state": "damaged record", "nodes": [node],
                     "missing_nodes": [], "bytes": 0, "node_bytes": {}, "blobs": 0,
                     "metrics": {}, "created": None, "created_utc": None, "writer": {},
                     "node_workers": {}, "stop": False, "save_ids": [save_id], "error": message})
    order = {"committed": 0, "superseded": 0, "partial": 1, "damaged record": 2}
    rows.sort(key=lambda r: (r["epoch"], order[r["state"]]))
    items = find_leftovers(store, min_age=0, found=found)
    leftovers = [leftover_doc(location, x) for x in items
                 if x.kind != "partial save"]  # partial saves are rows above
    doc = {"prefix": location.display(), "epochs": rows, "leftovers": leftovers,
           "committed_epochs": found.epochs(), "superseded_epochs": sorted(found.superseded)}
    return doc, EXIT_OK
