"""``caffe2ckpt show``: the blobs of one epoch (``--verify`` reads and checks them)."""

from __future__ import annotations

import argparse

from caffe2ckpt.cli._context import (
    EXIT_DAMAGED,
    EXIT_NOT_FOUND,
    EXIT_OK,
    CLIError,
    Context,
    Document,
    check_node,
    checked_manifest,
    group_epoch,
    json_metrics,
    layout_doc,
    open_prefix,
    require_save,
    save_kind,
    save_nodes,
)
from caffe2ckpt.errors import (
    CheckpointCorruptedError,
)
from caffe2ckpt.history.scan import PrefixScan
from caffe2ckpt.store.protocol import CheckpointStore

__all__ = ["cmd_show"]


def newest_epoch(store: CheckpointStore, found: PrefixScan, nodes: list[str] | None) -> int:
    """The newest epoch of the current lineage of the job holding ``nodes`` (never a
    superseded one)."""
    epoch = found.newest_epoch(nodes or ())
    if epoch is None:
        held = f" holding node(s) {list(nodes)}" if nodes else ""
        jobs = "; ".join(", ".join(sorted(f)) for f in sorted(found.families, key=sorted))
        raise CLIError(f"no committed epoch under {store.location.display()!r}{held}"
                       + (f"; its jobs' nodes: {jobs}" if jobs else ""), EXIT_NOT_FOUND)
    return epoch


def cmd_show(ctx: Context, args: argparse.Namespace) -> tuple[Document, int]:
    store, found = open_prefix(ctx, args.prefix)
    epoch = newest_epoch(store, found, args.node) if args.epoch is None else args.epoch
    save = require_save(store, found, epoch, args.node)
    nodes = save_nodes(save, args.node)
    if args.verify:
        ctx.progress.start(f"verify epoch {epoch}",
                           sum(save.records[n].nbytes for n in nodes))
    blobs: list[Document] = []
    problems: list[Document] = []
    for node in nodes:
        record = save.records[node]
        crcs: dict[str, tuple[int, ...]] = {}
        if args.verify:
            check = check_node(store, record, ctx.progress)
            manifest, states = check.manifest, check.blobs
            problems += [{"node": node, **e} for e in check.errors]
        else:
            try:
                manifest, states = checked_manifest(store, record), {}
            except CheckpointCorruptedError as exc:
                manifest = None
                problems.append({"node": node, "blob": exc.blob, "error": str(exc)})
        if manifest is None:
            continue
        crcs = manifest.chunk_crcs(record.crcs)
        for info in manifest.blobs.values():
            entry = {"node": node, "name": info.name, "dtype": info.dtype,
                     "shape": list(info.shape), "order": info.order, "bytes": info.nbytes,
                     "checksum": states.get(info.name, "recorded")}
            inherited = manifest.inherited.get(info.name)
            if inherited is not None:  # a differential save's: read through older groups
                entry.update(storage=inherited.kind,
                             **{"from": [store.location.display(g) for g in inherited.chain]},
                             from_epochs=[group_epoch(g) for g in inherited.chain])
            elif info.path is not None:
                entry.update(storage="array", path=info.path, chunks=len(crcs[info.path]),
                             chunk_rows=info.chunk_rows)
            else:
                entry.update(storage="packed", offset=info.offset)
            blobs.append(entry)
    ctx.progress.close()
    layout = layout_doc(list(save.records.values()))
    if layout is not None:
        kinds = {**dict.fromkeys(layout["rows"], "rows"),
                 **dict.fromkeys(layout["replicated"], "replicated")}
        for entry in blobs:
            entry["kind"] = kinds.get(entry["name"], "local")
    doc = {"prefix": store.location.display(), "epoch": epoch, "nodes": nodes,
           "save_id": save.save_id, "superseded": found.is_superseded(save), "layout": layout,
           "paths": {n: store.where(save.records[n]) for n in nodes},
           "verified": bool(args.verify), "blobs": blobs, "problems": problems,
           "metrics": json_metrics(save.metrics),
           **save_kind([save.records[n] for n in nodes], store.location)}
    return doc, EXIT_DAMAGED if problems else EXIT_OK
