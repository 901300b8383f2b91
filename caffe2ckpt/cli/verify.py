"""``caffe2ckpt verify``: re-read committed checkpoints and check every checksum."""

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
    open_prefix,
    require_nodes,
    require_save,
)

__all__ = ["cmd_verify"]


def cmd_verify(ctx: Context, args: argparse.Namespace) -> tuple[Document, int]:
    store, found = open_prefix(ctx, args.prefix)
    wanted = set(args.node or ())
    bad_records = [(ref, msg) for ref, msg in found.unreadable
                   if (args.epoch is None or ref.epoch == args.epoch)
                   and (not wanted or ref.node in wanted)]
    saves = sorted(found.saves(), key=lambda s: (s.epoch, s.save_id))
    if args.epoch is not None:
        saves = [s for s in saves if s.epoch == args.epoch]
        if not saves and not bad_records:
            require_save(store, found, args.epoch)
        if saves and wanted:
            require_nodes(store, saves[0], sorted(wanted))
    todo = [s.records[n] for s in saves for n in sorted(s.records) if not wanted or n in wanted]
    if not todo and not bad_records:
        raise CLIError(f"no committed checkpoint of node(s) {', '.join(sorted(wanted))} under "
                       f"{store.location.display()!r}", EXIT_NOT_FOUND)
    ctx.progress.start("verify", sum(r.nbytes for r in todo))
    results = []
    for record in todo:
        check = check_node(store, record, ctx.progress)
        results.append({"epoch": record.epoch, "node": record.node, "status": check.status,
                        "save_id": record.save_id, "path": store.where(record),
                        "blobs": record.blob_count, "bytes": record.nbytes,
                        "errors": check.errors})
    ctx.progress.close()
    summary = {"checked": len(results), "bytes": sum(r["bytes"] for r in results),
               **{k: sum(r["status"] == k for r in results) for k in ("ok", "damaged", "error")}}
    doc = {
        "prefix": store.location.display(), "results": results, "summary": summary,
        "unreadable_records": [{"epoch": ref.epoch, "node": ref.node, "record": ref.filename,
                                "error": msg} for ref, msg in bad_records],
        "partial": [{"epoch": p.epoch, "save_id": p.save_id, "nodes": p.have,
                     "missing_nodes": p.missing}
                    for p in found.partial
                    if (args.epoch is None or p.epoch == args.epoch)
                    and (not wanted or wanted & set(p.have))],
    }
    failed = summary["damaged"] or summary["error"] or bad_records
    return doc, EXIT_DAMAGED if failed else EXIT_OK
