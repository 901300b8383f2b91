"""``caffe2ckpt ls``: every save under a prefix (committed, superseded, partial, damaged), where
its groups are, and the leftovers no record references."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from caffe2ckpt.cli._context import (
    EXIT_OK,
    Context,
    Document,
    committed_epochs,
    group_bytes,
    json_metrics,
    layout_doc,
    leftover_doc,
    open_prefix,
    save_kind,
    utc,
)
from caffe2ckpt.history.cleanup import find_leftovers
from caffe2ckpt.history.lineage import Save
from caffe2ckpt.history.scan import PrefixScan
from caffe2ckpt.store.commit.protocol import CheckpointStore
from caffe2ckpt.store.format.records import CommitRecord

__all__ = ["cmd_ls"]


def node_workers(records: Sequence[CommitRecord]) -> dict[str, dict[str, Any]]:
    """``{node: {host, pid}}`` of the process that wrote each node's data, where its record
    names one (a Dask worker's, when the node lived there)."""
    return {r.node: r.writer["worker"] for r in records
            if isinstance(r.writer.get("worker"), dict)}


def _row(epoch: int, state: str, save_id: str, records: list[CommitRecord], location: Any,
         missing: list[str] | None = None, error: str | None = None) -> Document:
    created = max((r.created for r in records), default=None)
    return {
        "epoch": epoch, "state": state, "nodes": [r.node for r in records],
        "missing_nodes": missing or [], "bytes": sum(r.nbytes for r in records),
        "node_bytes": {r.node: r.nbytes for r in records},
        "blobs": sum(r.blob_count for r in records),
        "metrics": json_metrics(records[0].metrics) if records else {},
        "created": created, "created_utc": utc(created) if created else None,
        "writer": records[0].writer if records else {}, "node_workers": node_workers(records),
        "stop": any(r.stop for r in records), "save_ids": [save_id],
        "paths": {r.node: location.display(r.group) for r in records},
        "layout": layout_doc(records),
        **save_kind(records, location),
        **({"error": error} if error else {}),
    }


def cmd_ls(ctx: Context, args: argparse.Namespace) -> tuple[Document, int]:
    store, found = open_prefix(ctx, args.prefix)
    location = store.location
    rows: list[Document] = []

    def committed(save: Save, state: str) -> None:
        records = [save.records[n] for n in sorted(save.records)]
        row = _row(save.epoch, state, save.save_id, records, location)
        rows.append(row | {"metrics": json_metrics(save.metrics)})

    superseded = []
    for family in found.families.values():
        for save in family.lineage:
            committed(save, "committed")
        for save in family.superseded:
            committed(save, "superseded")
            superseded.append(save.epoch)
    unreadable = {(ref.epoch, ref.save_id, ref.node): msg for ref, msg in found.unreadable}
    for part in found.partial:
        records = [part.records[n] for n in part.have]
        damaged = [unreadable.pop((part.epoch, part.save_id, n)) for n in part.missing
                   if (part.epoch, part.save_id, n) in unreadable]
        rows.append(_row(part.epoch, "damaged record" if damaged else "partial", part.save_id,
                         records, location, part.missing, "; ".join(damaged) or None))
    for (epoch, save_id, node), message in unreadable.items():
        rows.append(_row(epoch, "damaged record", save_id, [], location, error=message)
                    | {"nodes": [node]})
    order = {"committed": 0, "superseded": 0, "partial": 1, "damaged record": 2}
    rows.sort(key=lambda r: (r["epoch"], order[r["state"]], r["save_ids"]))
    items = find_leftovers(store, found, min_age=0, live=True)
    leftovers = [leftover_doc(location, x) for x in items
                 if x.kind != "partial save"]  # partial saves are rows above
    doc = {"prefix": location.display(), "epochs": rows, "leftovers": leftovers,
           "committed_epochs": committed_epochs(found),
           "superseded_epochs": sorted(set(superseded)), **_totals(store, found, rows)}
    return doc, EXIT_OK


def _totals(store: CheckpointStore, found: PrefixScan, rows: list[Document]) -> Document:
    """What the committed saves hold: ``bytes_stored``, the bytes the current lineages' saves
    wrote (what is on disk for them), beside ``bytes``, their blobs' size;
    ``superseded_bytes_stored``; and ``pinned_bytes_stored``, the older groups differential
    saves build on whose own records are gone (retention removed their saves)."""
    def total(state: str, key: str) -> int:
        return sum(r[key] for r in rows if r["state"] == state)

    own = {r.group for r in found.records()}
    pinned = [group_bytes(store, g) for g in sorted(found.referenced - own)]
    return {"bytes": total("committed", "bytes"),
            "bytes_stored": total("committed", "bytes_written"),
            "superseded_bytes_stored": total("superseded", "bytes_written"),
            "pinned_bytes_stored": sum(b or 0 for b in pinned)}
