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
    json_metrics,
    open_prefix,
    require_nodes,
    require_step,
)
from caffe2ckpt.errors import (
    CheckpointCorruptedError,
)
from caffe2ckpt.history.catalog import PrefixScan
from caffe2ckpt.store.protocol import CheckpointStore

__all__ = ["cmd_show"]


def newest_epoch(store: CheckpointStore, found: PrefixScan) -> int:
    """The newest epoch of the current lineage (never a superseded one)."""
    if not found.current():
        raise CLIError(f"no committed epoch under {store.location.display()!r}", EXIT_NOT_FOUND)
    return max(found.current())


def cmd_show(ctx: Context, args: argparse.Namespace) -> tuple[Document, int]:
    store, found = open_prefix(ctx, args.prefix)
    epoch = newest_epoch(store, found) if args.epoch is None else args.epoch
    step = require_step(store, found, epoch)
    nodes = require_nodes(store, step, args.node)
    if args.verify:
        ctx.progress.start(f"verify epoch {epoch}",
                           sum(step.records[n].nbytes for n in nodes))
    blobs: list[Document] = []
    problems: list[Document] = []
    for node in nodes:
        if args.verify:
            check = check_node(store, node, epoch, ctx.progress, step.records[node].nbytes)
            manifest, states = check.manifest, check.blobs
            problems += [{"node": node, **e} for e in check.errors]
        else:
            try:
                manifest, states = checked_manifest(store, node, epoch), {}
            except CheckpointCorruptedError as exc:
                manifest = None
                problems.append({"node": node, "blob": exc.blob, "error": str(exc)})
        if manifest is None:
            continue
        for info in manifest.blobs.values():
            entry = {"node": node, "name": info.name, "dtype": info.dtype,
                     "shape": list(info.shape), "order": info.order, "bytes": info.nbytes,
                     "checksum": states.get(info.name, "recorded")}
            if info.path is not None:
                entry.update(storage="array", path=info.path, chunks=len(info.crcs),
                             chunk_rows=info.chunk_rows)
            else:
                entry.update(storage="packed", offset=info.offset)
            blobs.append(entry)
    ctx.progress.close()
    doc = {"prefix": store.location.display(), "epoch": epoch, "nodes": nodes,
           "verified": bool(args.verify), "blobs": blobs, "problems": problems,
           "metrics": json_metrics(step.metrics)}
    return doc, EXIT_DAMAGED if problems else EXIT_OK
