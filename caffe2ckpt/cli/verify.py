"""``caffe2ckpt verify``: re-read committed checkpoints and check every checksum. A node
checkpoint's check covers what its restore reads: its own group and, for each replicated blob
another node of its save wrote, that blob in the writer's group."""

from __future__ import annotations

import argparse
import functools

from caffe2ckpt import events
from caffe2ckpt.cli._context import (
    EXIT_DAMAGED,
    EXIT_NOT_FOUND,
    EXIT_OK,
    CLIError,
    Context,
    Document,
    check_nodes,
    open_prefix,
    require_save,
)
from caffe2ckpt.history.lineage import Save
from caffe2ckpt.history.scan import PrefixScan
from caffe2ckpt.store.commit.protocol import CheckpointStore
from caffe2ckpt.store.format.records import CommitRecord, RecordRef

__all__ = ["cmd_verify"]


def _matches(args: argparse.Namespace, wanted: set[str], epoch: int, nodes) -> bool:
    """Whether something of ``epoch`` with ``nodes`` is what ``--epoch`` / ``--node`` ask for."""
    return (args.epoch is None or epoch == args.epoch) and (not wanted or bool(wanted & set(nodes)))


def _selected(store: CheckpointStore, found: PrefixScan, args: argparse.Namespace,
              wanted: set[str]) -> tuple[list[tuple[Save, CommitRecord]],
                                         list[tuple[RecordRef, str]]]:
    """The node checkpoints to check (each with its save) and the unreadable records to report
    (CLIError when ``--epoch`` / ``--node`` name nothing there)."""
    bad_records = [(ref, msg) for ref, msg in found.unreadable
                   if _matches(args, wanted, ref.epoch, [ref.node])]
    saves = [s for s in sorted(found.saves(), key=lambda s: (s.epoch, s.save_id))
             if args.epoch is None or s.epoch == args.epoch]
    if args.epoch is not None and not bad_records:  # each node in some save of the epoch
        for node in sorted(wanted) or [None]:
            require_save(store, found, args.epoch, [node] if node else None)
    todo = [(s, s.records[n]) for s in saves for n in sorted(s.records)
            if not wanted or n in wanted]
    if not todo and not bad_records:
        raise CLIError(f"no committed checkpoint of node(s) {', '.join(sorted(wanted))} under "
                       f"{store.location.display()!r}", EXIT_NOT_FOUND)
    return todo, bad_records


def _check_all(ctx: Context, store: CheckpointStore,
               todo: list[tuple[Save, CommitRecord]]) -> list[Document]:
    """Check each node checkpoint of ``todo`` and what its restore reads of other nodes'
    groups (:func:`~caffe2ckpt.cli._context.check_nodes`): one result each."""
    ctx.progress.start("verify", sum(r.nbytes for _, r in todo))
    results = []
    for (_, record), check in zip(todo, check_nodes(store, todo, ctx.progress)):
        results.append({"epoch": record.epoch, "node": record.node, "status": check.status,
                        "save_id": record.save_id, "path": store.where(record),
                        "blobs": record.blob_count, "bytes": record.nbytes,
                        "errors": check.errors})
    ctx.progress.close()
    return results


def cmd_verify(ctx: Context, args: argparse.Namespace) -> tuple[Document, int]:
    store, found = open_prefix(ctx, args.prefix)
    wanted = set(args.node or ())
    todo, bad_records = _selected(store, found, args, wanted)
    results = _check_all(ctx, store, todo)
    summary = {"checked": len(results), "bytes": sum(r["bytes"] for r in results),
               **{k: sum(r["status"] == k for r in results) for k in ("ok", "damaged", "error")}}
    doc = {
        "prefix": store.location.display(), "results": results, "summary": summary,
        "unreadable_records": [{"epoch": ref.epoch, "node": ref.node, "record": ref.filename,
                                "error": msg} for ref, msg in bad_records],
        "partial": [{"epoch": p.epoch, "save_id": p.save_id, "nodes": p.have,
                     "missing_nodes": p.missing}
                    for p in found.partial if _matches(args, wanted, p.epoch, p.have)],
    }
    _publish_damage(store, results)
    failed = summary["damaged"] or summary["error"] or bad_records
    return doc, EXIT_DAMAGED if failed else EXIT_OK


def _publish_damage(store: CheckpointStore, results: list[Document]) -> None:
    """A ``caffe2ckpt.checkpoint.damaged`` event per damaged blob found."""
    for result in results:
        if result["status"] != "damaged":
            continue
        for error in result["errors"]:
            payload = {"epoch": result["epoch"], "node": result["node"], "blob": error["blob"],
                       "found_by": "verify", "message": error["error"]}
            events.publish(events.CHECKPOINT_DAMAGED, store.location.canonical_url,
                           functools.partial(dict, payload))
