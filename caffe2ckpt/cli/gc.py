"""``caffe2ckpt gc``: remove uncommitted leftovers and the epochs a retention policy does not
keep; a dry run unless ``--yes``.

Retention is :func:`caffe2ckpt.policy.retained_epochs` (the function the runner and
``StepCheckpointManager`` use), so the newest committed epoch is always kept and no option means
no committed epoch is deleted. Removal is :func:`caffe2ckpt.history.catalog.delete_step` (records first,
then data) and :func:`caffe2ckpt.history.catalog.remove_leftovers`, so an interrupted ``gc --yes`` leaves
only uncommitted leftovers. The library's safety rules hold (only a caffe2ckpt prefix is
swept; a partial save with an unreadable record is left for a person to inspect, and listed
here); on top of them, with ``--node`` an epoch saved together with nodes not given is never
split (deleting some nodes' records of one save would uncommit the others' epoch).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

from caffe2ckpt.cli._context import (
    EXIT_DAMAGED,
    EXIT_IO,
    EXIT_NOT_FOUND,
    EXIT_OK,
    EXIT_USAGE,
    CLIError,
    Context,
    Document,
    json_metrics,
    known_nodes,
    leftover_doc,
    open_prefix,
)
from caffe2ckpt.errors import CheckpointError, JobDefinitionError
from caffe2ckpt.history.catalog import (
    delete_step,
    find_leftovers,
    is_checkpoint_prefix,
    remove_leftovers,
)
from caffe2ckpt.naming import CLAIMS_DIR, COMMITS_DIR
from caffe2ckpt.policy import StepManagerOptions, retained_epochs

__all__ = ["cmd_gc"]


def retention_options(args: argparse.Namespace) -> StepManagerOptions:
    try:
        return StepManagerOptions(max_to_keep=args.keep_last, keep_period=args.keep_every,
                                  keep_best=args.keep_best, best_fn=args.metric,
                                  best_mode=args.mode)
    except JobDefinitionError as exc:
        raise CLIError(str(exc), EXIT_USAGE) from exc


def keep_reasons(args: argparse.Namespace, metrics: dict[int, dict[str, float]],
                 superseded: frozenset[int]) -> dict[int, list[str]]:
    """Why each epoch is kept, rule by rule (the same pure function retention uses); the
    rules rank the current lineage only, never a superseded epoch."""
    reasons: dict[int, list[str]] = {e: [] for e in metrics}
    epochs = sorted(set(metrics) - superseded)
    if not epochs:
        return reasons
    reasons[epochs[-1]].append("newest")
    rules: list[tuple[str, StepManagerOptions]] = []
    if args.keep_last:
        rules.append((f"last {args.keep_last}", StepManagerOptions(max_to_keep=args.keep_last)))
    if args.keep_every:
        rules.append((f"every {args.keep_every}",
                      StepManagerOptions(keep_period=args.keep_every)))
    if args.keep_best:
        rules.append((f"best {args.keep_best} by {args.metric} ({args.mode})", StepManagerOptions(
            keep_best=args.keep_best, best_fn=args.metric, best_mode=args.mode,
            keep_checkpoints_without_metrics=False)))
    for label, options in rules:
        # the newest epoch is in every rule's set; it is labelled by the simple rules only
        for epoch in sorted(retained_epochs(options, metrics, superseded=superseded)
                            - {epochs[-1]}):
            reasons[epoch].append(label)
    if args.keep_last:
        reasons[epochs[-1]].append(f"last {args.keep_last}")
    if args.keep_every and epochs[-1] % args.keep_every == 0:
        reasons[epochs[-1]].append(f"every {args.keep_every}")
    if args.keep_best:
        for epoch in epochs:
            if not metrics[epoch]:
                reasons[epoch].append("has no metrics")
    if not rules:
        for epoch in metrics:
            reasons[epoch].append("no --keep-* option given")
    return reasons


def cmd_gc(ctx: Context, args: argparse.Namespace) -> tuple[Document, int]:
    store, found = open_prefix(ctx, args.prefix)
    location = store.location
    if not is_checkpoint_prefix(store):
        raise CLIError(f"{location.display()!r} does not look like a checkpoint prefix (it has "
                       f"no {COMMITS_DIR}/ or {CLAIMS_DIR}/ directory); gc removes nothing there",
                       EXIT_NOT_FOUND)
    options = retention_options(args)
    wanted = set(args.node) if args.node else None
    managed: dict[int, list[str]] = {}  # epoch -> the nodes gc may delete
    shared: dict[int, list[str]] = {}  # epoch -> other nodes saved together with those
    for epoch, step in sorted(found.steps.items()):
        own = [n for n in step.nodes if wanted is None or n in wanted]
        if own:
            managed[epoch] = own
            partners = set().union(*(step.records[n].nodes for n in own)) - set(own)
            if wanted is not None and partners:
                shared[epoch] = sorted(partners)
    if wanted is not None:
        unknown = sorted(wanted - known_nodes(location))
        if unknown:
            raise CLIError(f"node(s) {', '.join(map(repr, unknown))} have neither commit records "
                           f"nor data under {location.display()!r}", EXIT_NOT_FOUND)
    metrics = {e: found.steps[e].metrics for e in managed}
    if args.keep_best and managed and not any(args.metric in m for m in metrics.values()):
        names = sorted({k for m in metrics.values() for k in m})
        raise CLIError(f"metric {args.metric!r} is in no committed epoch's metrics under "
                       f"{location.display()!r} (metrics found: {', '.join(names) or 'none'})",
                       EXIT_USAGE)
    superseded = found.superseded & set(managed)
    keep = retained_epochs(options, metrics, superseded=superseded)
    reasons = keep_reasons(args, metrics, superseded)
    for epoch in sorted(set(managed) - keep):
        if epoch in shared:  # deleting part of a save would uncommit the other nodes' epoch
            keep.add(epoch)
            reasons[epoch] = [(f"saved together with {', '.join(shared[epoch])} (not given with "
                              "--node): deleting part of it would uncommit theirs")]

    def entry(epoch: int) -> Document:
        step = found.steps[epoch]
        return {"epoch": epoch, "nodes": managed[epoch],
                "bytes": sum(step.records[n].nbytes for n in managed[epoch]),
                "metrics": json_metrics(step.metrics)}

    delete = [entry(e) for e in sorted(set(managed) - keep)]
    refusal = _check_newest(store, found, max(keep, default=None)) if delete else None
    if refusal:  # never delete older epochs in favour of a damaged newest one
        reasons = {**reasons, **{d["epoch"]: ["the newest epoch is damaged"] for d in delete}}
        keep |= {d["epoch"] for d in delete}
        delete = []
    kept = [{**entry(e), "reasons": reasons[e]} for e in sorted(keep)]
    items = find_leftovers(store, min_age=args.min_age, nodes=wanted, found=found)
    damaged = {(ref.epoch, ref.save_id) for ref, _ in found.unreadable}
    skipped = [{"kind": "partial save", "epoch": p.epoch,
                "path": ", ".join(f"{n}.{p.epoch}" for n in p.have),
                "reason": "another record of this save is unreadable; inspect it with "
                          "`caffe2ckpt verify` first"}
               for p in found.partial if (p.epoch, p.save_id) in damaged
               and (wanted is None or set(p.have) <= wanted)]
    leftovers = [(item, leftover_doc(location, item)) for item in items]
    code = EXIT_OK
    if args.yes:
        ctx.progress.start("gc", len(leftovers) + len(delete), unit="items")
        for item, doc in leftovers:
            code = _attempt(doc, code, lambda i=item: remove_leftovers(store, [i]))
            ctx.progress.advance(1, item.path)
        for doc in delete:
            code = _attempt(doc, code, lambda d=doc: delete_step(store, d["epoch"], d["nodes"]))
            ctx.progress.advance(1, f"epoch {doc['epoch']}")
        ctx.progress.close()
    left_docs = [doc for _, doc in leftovers]
    freed = sum(d["bytes"] for d in delete if not d.get("error")) + sum(
        d["bytes"] or 0 for d in left_docs if not d.get("error"))
    doc = {"prefix": location.display(), "dry_run": not args.yes,
           "min_age_seconds": args.min_age, "nodes": sorted(wanted) if wanted else None,
           "retention": {"keep_last": args.keep_last, "keep_every": args.keep_every,
                         "keep_best": args.keep_best, "metric": args.metric, "mode": args.mode},
           "leftovers": left_docs, "skipped": skipped, "delete": delete, "keep": kept,
           "bytes_freed": freed, **({"refused": refusal} if refusal else {})}
    return doc, EXIT_DAMAGED if refusal else code


def _check_newest(store, found, newest: int | None) -> str | None:
    """Why the newest kept epoch cannot be trusted (it is read and verified in full), or None."""
    if newest is None:
        return None
    try:
        for node in found.steps[newest].nodes:
            store.load_node(node, newest)
    except CheckpointError as exc:
        return (f"not deleting any committed epoch: the newest one, {newest}, fails "
                f"verification ({exc})")
    return None


def _attempt(doc: Document, code: int, action: Callable[[], None]) -> int:
    try:
        action()
    except (OSError, CheckpointError) as exc:
        doc["error"] = str(exc) or type(exc).__name__
        return EXIT_IO
    return code
