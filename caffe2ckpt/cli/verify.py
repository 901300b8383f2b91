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
    require_step,
)

__all__ = ["cmd_verify"]


def cmd_verify(ctx: Context, args: argparse.Namespace) -> tuple[Document, int]:
    store, found = open_prefix(ctx, args.prefix)
    wanted = set(args.node or ())
    bad_records = [(ref, msg) for ref, msg in found.unreadable
                   if (args.epoch is None or ref.epoch == args.epoch)
                   and (not wanted or ref.node in wanted)]
    if args.epoch is not None:
        steps = [found.steps[args.epoch]] if args.epoch in found.steps else []
        if not steps and not bad_records:
            require_step(store, found, args.epoch)
        if steps and wanted:
            require_nodes(store, steps[0], sorted(wanted))
    else:
        steps = [found.steps[e] for e in found.epochs()]
    todo = [(s, n) for s in steps for n in s.nodes if not wanted or n in wanted]
    if not todo and not bad_records:
        raise CLIError(f"no committed checkpoint of node(s) {', '.join(sorted(wanted))} under "
                       f"{store.location.display()!r}", EXIT_NOT_FOUND)
    ctx.progress.start("verify", sum(s.records[n].nbytes for s, n in todo))
    results = []
    for step, node in todo:
        check = check_node(store, node, step.epoch, ctx.progress, step.records[node].nbytes)
        results.append({"epoch": step.epoch, "node": node, "status": check.status,
                        "blobs": step.records[node].blob_count,
                        "bytes": step.records[node].nbytes, "errors": check.errors})
    ctx.progress.close()
    summary = {"checked": len(results), "bytes": sum(r["bytes"] for r in results),
               **{k: sum(r["status"] == k for r in results) for k in ("ok", "damaged", "error")}}
    doc = {
        "prefix": store.location.display(), "results": results, "summary": summary,
        "unreadable_records": [{"epoch": ref.epoch, "node": ref.node, "record": ref.filename,
                                "error": msg} for ref, msg in bad_records],
        "partial": [{"epoch": e, "save_id": s, "nodes": have, "missing_nodes": missing}
                    for e, s, have, missing, _ in found.partial
                    if (args.epoch is None or e == args.epoch)
                    and (not wanted or wanted & set(have))],
    }
    failed = summary["damaged"] or summary["error"] or bad_records
    return doc, EXIT_DAMAGED if failed else EXIT_OK
