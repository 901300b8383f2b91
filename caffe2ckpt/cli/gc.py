"""``caffe2ckpt gc``: remove uncommitted leftovers and the saves a retention policy does not keep;
a dry run unless ``--yes``.

Arguments become :class:`~caffe2ckpt.policy.StepManagerOptions`; what to keep and why is
:func:`caffe2ckpt.history.retention.plan_retention` per job family (the runner and
``StepCheckpointManager`` apply the same plans), what is left over is
:func:`caffe2ckpt.history.cleanup.find_leftovers`, and removal is
:func:`~caffe2ckpt.history.cleanup.remove_saves` / ``remove_leftovers``: by save id, records
first, fenced by the newest run ``gc`` listed (if a run starts meanwhile, ``gc`` stops, and its
report marks what it did not reach as skipped). On top,
with ``--node`` a family with nodes not given is left alone (deleting some nodes' records of one
save would uncommit the others' epoch), and no save of a family is deleted when its newest one
fails verification.

With ``--drop-old-node-sets``, a job that changed its node count lets the node sets it left go
(:func:`caffe2ckpt.history.nodesets.node_sets` says which, and whether they may go yet): every
save of each old node set is deleted (:func:`~caffe2ckpt.history.retention.plan_letting_go`),
once the current node set's newest save has been read and verified in full; the current node
set keeps its saves (retention options apply to it as to any family), other jobs are ranked as
ever, and a group a kept save needs stays. The newest save of an old node set goes last, its
records read again before its groups go (a run of that node set still saving would build on
it), and the uncommitted saves of the old node sets' runs are leftovers like any other (their
runs count as overtaken by the current node set's).
"""

from __future__ import annotations

import argparse
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import replace

from caffe2ckpt import events
from caffe2ckpt.cli._context import (
    EXIT_DAMAGED,
    EXIT_IO,
    EXIT_NOT_FOUND,
    EXIT_OK,
    EXIT_USAGE,
    CLIError,
    Context,
    Document,
    group_bytes,
    group_manifest,
    json_metrics,
    known_nodes,
    leftover_doc,
    open_prefix,
)
from caffe2ckpt.errors import CheckpointError, CheckpointFencedError, JobDefinitionError
from caffe2ckpt.history.cleanup import (
    Leftover,
    References,
    find_leftovers,
    remove_leftovers,
    remove_saves,
)
from caffe2ckpt.history.lineage import Save
from caffe2ckpt.history.nodesets import NodeSets, node_sets, read_run_log
from caffe2ckpt.history.retention import RetentionPlan, plan_letting_go, plan_retention
from caffe2ckpt.history.scan import Family, PrefixScan
from caffe2ckpt.policy import StepManagerOptions
from caffe2ckpt.store.commit.protocol import CheckpointStore
from caffe2ckpt.store.format.paths import parse_group_name, save_generation
from caffe2ckpt.store.format.records import CommitRecord

__all__ = ["cmd_gc"]


def retention_options(args: argparse.Namespace) -> StepManagerOptions:
    try:
        return StepManagerOptions(max_to_keep=args.keep_last, keep_period=args.keep_every,
                                  keep_best=args.keep_best, best_fn=args.metric,
                                  best_mode=args.mode)
    except JobDefinitionError as exc:
        raise CLIError(str(exc), EXIT_USAGE) from exc


def _entry(save: Save, found: PrefixScan) -> Document:
    return {"epoch": save.epoch, "nodes": sorted(save.records), "bytes": save.nbytes,
            "bytes_written": sum(r.bytes_written for r in save.records.values()),
            "kind": "delta" if any(r.delta for r in save.records.values()) else "full",
            "metrics": json_metrics(save.metrics), "save_id": save.save_id,
            "superseded": found.is_superseded(save)}


def _unverified(store: CheckpointStore, family: Family) -> str | None:
    """What is wrong with the family's newest save (it is read and verified in full)."""
    newest = family.newest
    if newest is None:
        return None
    try:
        for record in newest.records.values():
            store.load_node(record)
    except CheckpointError as exc:
        return str(exc)
    return None


def _newest_fails(store: CheckpointStore, family: Family) -> str | None:
    """Why the family's newest save cannot be trusted (it is read and verified in full)."""
    damage = _unverified(store, family)
    if damage is None:
        return None
    return (f"not deleting any committed epoch of nodes {sorted(family.nodes)}: the newest "
            f"one, {family.newest.epoch}, fails verification ({damage})")  # type: ignore[union-attr]


def _letting_go(store: CheckpointStore, found: PrefixScan, drop: bool
                ) -> tuple[list[NodeSets], dict[frozenset[str], NodeSets], list[str]]:
    """With ``--drop-old-node-sets``: every job's node sets, the old node sets that go now (by
    nodes, with their job), and the refusals (a current node set whose newest save fails
    verification keeps the job's old ones)."""
    if not drop:
        return [], {}, []
    jobs = node_sets(found, read_run_log(store.location))
    going: dict[frozenset[str], NodeSets] = {}
    refusals = []
    for index, job in enumerate(jobs):
        if not job.letting_go or not job.old:
            continue
        damage = _unverified(store, job.current)
        if damage is not None:
            refusal = (f"not deleting the old node sets of the job now on nodes "
                       f"{sorted(job.current.nodes)}: its newest epoch, "
                       f"{job.current.newest.epoch}, fails verification ({damage})")  # type: ignore[union-attr]
            jobs[index] = replace(job, waiting=refusal)
            refusals.append(refusal)
            continue
        going.update((family.nodes, job) for family in job.old)
    return jobs, going, refusals


def _job_doc(job: NodeSets) -> Document:
    return {"current": sorted(job.current.nodes),
            "newest_epoch": job.current.newest.epoch,  # type: ignore[union-attr]
            "old": [sorted(f.nodes) for f in job.old], "letting_go": job.letting_go,
            "waiting": job.waiting}


def _why(save: Save, found: PrefixScan, job: NodeSets | None) -> Document:
    """Why gc deletes ``save``: an old node set's (which one, and which replaced it), a
    superseded save, or one outside the retention policy."""
    if job is None:
        return {"why": "superseded" if found.is_superseded(save)
                else "outside the retention policy"}
    family = found.families[save.nodes]
    return {"why": job.why(family),
            "old_node_set": {"nodes": sorted(family.nodes),
                             "replaced_by": sorted(job.current.nodes),
                             "newest_epoch": job.current.newest.epoch}}  # type: ignore[union-attr]


def _plan(store: CheckpointStore, found: PrefixScan, family: Family, options: StepManagerOptions,
          wanted: set[str] | None, old: bool) -> tuple[RetentionPlan, str | None]:
    """The family's plan (``old``: an old node set that goes), or everything kept with the
    reason deletion is refused."""
    plan = plan_letting_go(family) if old else plan_retention(family, options)
    if not plan.delete:
        return plan, None
    outside = sorted(family.nodes - wanted) if wanted else []
    if outside:
        return _kept(plan, f"saved together with {', '.join(outside)} (not given with --node): "
                           "deleting part of it would uncommit theirs"), None
    refusal = None if old else _newest_fails(store, family)
    if refusal:
        return _kept(plan, "the newest epoch is damaged"), refusal
    return plan, None


def _kept(plan: RetentionPlan, reason: str) -> RetentionPlan:
    """``plan`` with what it deletes kept instead, for ``reason``."""
    return RetentionPlan(plan.keep + [(s, [reason]) for s in plan.delete], [])


def _check_arguments(location, args: argparse.Namespace, found: PrefixScan,
                     wanted: set[str] | None) -> list[Family]:
    """The families ``gc`` acts on; :class:`CLIError` for nodes or a metric that are not
    there."""
    if wanted is not None:
        unknown = sorted(wanted - known_nodes(location))
        if unknown:
            raise CLIError(f"node(s) {', '.join(map(repr, unknown))} have neither commit records "
                           f"nor data under {location.display()!r}", EXIT_NOT_FOUND)
    families = [f for f in found.families.values() if wanted is None or f.nodes & wanted]
    metrics = [s.metrics for f in families for s in f.lineage]
    if args.keep_best and metrics and not any(args.metric in m for m in metrics):
        names = sorted({k for m in metrics for k in m})
        raise CLIError(f"metric {args.metric!r} is in no committed epoch's metrics under "
                       f"{location.display()!r} (metrics found: {', '.join(names) or 'none'})",
                       EXIT_USAGE)
    return families


def _plans(store: CheckpointStore, found: PrefixScan, families: list[Family],
           options: StepManagerOptions, wanted: set[str] | None,
           going: dict[frozenset[str], NodeSets]
           ) -> tuple[list[Document], list[tuple[Save, Document]], list[str]]:
    """What each family keeps (with reasons), what it deletes (in the order gc removes them,
    with why), and why deletion is refused."""
    keep: list[Document] = []
    delete: list[tuple[Save, Document]] = []
    refusals = []
    for family in families:
        job = going.get(family.nodes)
        plan, refusal = _plan(store, found, family, options, wanted, job is not None)
        if refusal:
            refusals.append(refusal)
        keep += [{**_entry(s, found), "reasons": why} for s, why in plan.keep]
        delete += [(s, {**_entry(s, found), **_why(s, found, job)}) for s in plan.delete]
    return keep, delete, refusals


def _staying(found: PrefixScan, delete: list[tuple[Save, Document]]) -> list[CommitRecord]:
    """The readable records gc leaves: of the saves it does not delete, and of partial saves
    (a partial save's removal is a leftover's)."""
    going = {(s.epoch, s.save_id) for s, _ in delete}
    return [*(r for s in found.saves() if (s.epoch, s.save_id) not in going
              for r in s.records.values()),
            *(r for p in found.partial for r in p.records.values())]


def _pinned(store: CheckpointStore, staying: list[CommitRecord]) -> list[Document]:
    """Groups of saves that are gone (or go now) that differential saves which stay still
    build on: their bytes stay."""
    needed: dict[str, set[int]] = {}
    for record in staying:
        for group in record.closure:
            needed.setdefault(group, set()).add(record.epoch)
    own = {r.group for r in staying}
    return [{"path": group, "url": store.location.display(group),
             "bytes": group_bytes(store, group), "pinned_by": sorted(epochs)}
            for group, epochs in sorted(needed.items()) if group not in own]


def _frees(store: CheckpointStore, found: PrefixScan, delete: list[tuple[Save, Document]],
           staying: list[CommitRecord]) -> dict[str, int]:
    """Each delete document learns what removing its save frees, in the order gc removes
    them (as :func:`~caffe2ckpt.history.cleanup.remove_saves` decides): ``groups_freed``, the
    groups whose last need goes with it (its own groups no save that stays needs, and older
    groups, pinned until then, that only saves going needed; not one whose own record is
    there but unreadable), and ``frees``, their stored bytes. Returns the bytes by group."""
    kept = {group for record in staying for group in record.closure}
    unreadable = {(ref.node, ref.epoch, ref.save_id) for ref, _ in found.unreadable}
    sizes = {r.group: r.bytes_written for s, _ in delete for r in s.records.values()}
    waiting = Counter(group for save, _ in delete for group in save.closure())
    for save, doc in delete:
        freed = sorted(_last_needed(save, waiting, kept, unreadable))
        for group in freed:
            if group not in sizes:
                sizes[group] = group_bytes(store, group) or 0
        doc["groups_freed"] = freed
        doc["frees"] = sum(sizes[g] for g in freed)
    return sizes


def _last_needed(save: Save, waiting: Counter[str], kept: set[str],
                 unreadable: set[tuple[str, int, str]]) -> Iterator[str]:
    """The groups of ``save``'s closure whose last need goes with it: no save still to be
    removed (``waiting`` counts them down) nor one that stays (``kept``) needs them, and no
    unreadable record of theirs may."""
    for group, save_id in save.closure().items():
        waiting[group] -= 1
        parsed = parse_group_name(group)
        if (not waiting[group] and group not in kept and parsed is not None
                and (parsed.node, parsed.epoch, save_id) not in unreadable):
            yield group


def _check_freed(store: CheckpointStore, delete: list[tuple[Save, Document]],
                 sizes: dict[str, int]) -> None:
    """After the removals: ``frees`` counts only the groups that are gone (still the save's
    own: ``groups_kept``, e.g. a group gc could not identify as the save's)."""
    for save, doc in delete:
        if not doc.get("done"):
            continue
        closure = save.closure()
        stayed = [g for g in doc["groups_freed"] if _still_there(store, g, closure[g])]
        if stayed:
            doc["groups_kept"] = stayed
            doc["groups_freed"] = [g for g in doc["groups_freed"] if g not in stayed]
            doc["frees"] = sum(sizes[g] for g in doc["groups_freed"])


def _still_there(store: CheckpointStore, group: str, save_id: str) -> bool:
    manifest = group_manifest(store, group)
    return manifest is not None and manifest.save_id == save_id


def _skipped(found: PrefixScan, wanted: set[str] | None) -> list[Document]:
    damaged = {ref.save_id for ref, _ in found.unreadable}
    return [{"kind": "partial save", "epoch": p.epoch,
             "path": ", ".join(r.group for r in p.records.values()),
             "reason": "another record of this save is unreadable; inspect it with "
                       "`caffe2ckpt verify` first"}
            for p in found.partial if p.save_id in damaged
            and (wanted is None or set(p.have) <= wanted)]


def _carry_out(ctx: Context, work: list[tuple[Document, Callable[[], bool]]]) -> int:
    """Do each action in turn, marking its document ``done`` (true: it removed what it names;
    false with ``kept``: it found it in use), ``error``, or ``skipped`` (not reached: a run
    started and ``gc`` stopped); return the exit code."""
    code = EXIT_OK
    ctx.progress.start("gc", len(work), unit="items")
    for index, (doc, action) in enumerate(work):
        try:
            doc["done"] = action()
            if not doc["done"]:
                doc["kept"] = "in use again when gc came to it (committed or taken meanwhile)"
        except CheckpointFencedError as exc:  # a run started: its view decides from now on
            doc["error"], doc["done"], code = str(exc), False, EXIT_IO
            for later, _ in work[index + 1:]:
                later["done"], later["skipped"] = False, "gc stopped: a run started (see error)"
            break
        except (OSError, CheckpointError) as exc:
            doc["error"], doc["done"], code = str(exc) or type(exc).__name__, False, EXIT_IO
        finally:
            ctx.progress.advance(1, doc.get("path") or f"epoch {doc.get('epoch')}")
    ctx.progress.close()
    return code


def _last_of_old_sets(delete: list[tuple[Save, Document]]) -> set[str]:
    """The save ids of the last save gc removes of each old node set (its newest)."""
    last = {save.nodes: save.save_id for save, doc in delete if "old_node_set" in doc}
    return set(last.values())


def _remove_save(store: CheckpointStore, save: Save, fence: int, references: References,
                 reread: bool) -> bool:
    """Remove ``save`` (:func:`remove_saves`); with ``reread`` (the newest save of an old node
    set), the records are read again before its groups go, so that a save a run of that node
    set committed on top of it since gc listed the prefix keeps what it needs (or finds its
    base gone and takes its record back)."""
    if not reread:
        return bool(remove_saves(store, [save], fence=fence, doing="gc", references=references))
    removed = remove_saves(store, [save], fence=fence, doing="gc")
    references.drop(save.records.values())
    return bool(removed)


def _remove(ctx: Context, store: CheckpointStore, found: PrefixScan,
            leftovers: list[tuple[Leftover, Document]],
            delete: list[tuple[Save, Document]]) -> int:
    """Remove the leftovers, then the saves (each marked in its document); the exit code."""
    fence = found.newest_generation
    references = References(found.records())  # what the records need, as gc removes
    reread = _last_of_old_sets(delete)
    work = [(doc, lambda i=item: bool(remove_leftovers(store, [i], fence=fence,
                                                       references=references)))
            for item, doc in leftovers]
    work += [(doc, lambda s=save: _remove_save(store, s, fence, references,
                                               s.save_id in reread))
             for save, doc in delete]
    return _carry_out(ctx, work)


def _overtaken(items: list[Leftover], jobs: list[NodeSets], wanted: set[str] | None
               ) -> list[Leftover]:
    """``items`` with the uncommitted saves of the runs of the old node sets that go no longer
    live: the job's current node set has committed since (with ``--node``, only runs of the
    nodes given)."""
    runs_of_old = {g for job in jobs if job.letting_go
                   for g, nodes in job.old_runs.items() if wanted is None or nodes <= wanted}
    return [replace(item, live=False)
            if item.live and save_generation(item.save_id or "") in runs_of_old else item
            for item in items]


def _publish(url: str, doc: Document) -> None:
    """The ``caffe2ckpt.gc.finished`` event of a gc that removed things (``doc``: its report)."""
    removals = (*doc["delete"], *doc["leftovers"])
    events.publish(events.GC_FINISHED, url, lambda: {
        "deleted": sorted(d["epoch"] for d in doc["delete"] if d.get("done")),
        "kept": sorted({d["epoch"] for d in doc["keep"]}), "bytes_freed": doc["bytes_freed"],
        "leftovers_removed": sum(1 for d in doc["leftovers"] if d.get("done")),
        "errors": sum(1 for d in removals if d.get("error"))})


def _leftovers(store: CheckpointStore, found: PrefixScan, min_age: float,
               wanted: set[str] | None, jobs: list[NodeSets]
               ) -> tuple[list[tuple[Leftover, Document]], list[Document]]:
    """The leftovers gc removes (with their documents), and those it leaves alone because a
    run may still be writing them."""
    items = find_leftovers(store, found, min_age=min_age, nodes=wanted, live=True)
    items = _overtaken(items, jobs, wanted)
    in_use = [{"kind": item.kind, "path": item.path,
               "reason": "a save of a run that no newer run of its job has overtaken: it may "
                         "still be writing it"} for item in items if item.live]
    return [(i, leftover_doc(store.location, i)) for i in items if not i.live], in_use


def _retention_doc(args: argparse.Namespace) -> Document:
    return {"keep_last": args.keep_last, "keep_every": args.keep_every,
            "keep_best": args.keep_best, "metric": args.metric, "mode": args.mode}


def cmd_gc(ctx: Context, args: argparse.Namespace) -> tuple[Document, int]:
    store, found = open_prefix(ctx, args.prefix)
    location = store.location
    options = retention_options(args)
    wanted = set(args.node) if args.node else None
    families = _check_arguments(location, args, found, wanted)
    drop = bool(getattr(args, "drop_old_node_sets", False))
    jobs, going, refusals = _letting_go(store, found, drop)
    keep, delete, refused = _plans(store, found, families, options, wanted, going)
    refusals += refused
    staying = _staying(found, delete)
    pinned = _pinned(store, staying)
    sizes = _frees(store, found, delete, staying)
    leftovers, in_use = _leftovers(store, found, args.min_age, wanted, jobs)
    code = EXIT_OK
    if args.yes:
        code = _remove(ctx, store, found, leftovers, delete)
        _check_freed(store, delete, sizes)
    delete_docs = [doc for _, doc in delete]
    left_docs = [doc for _, doc in leftovers]
    freed = sum(d.get("frees", d["bytes"]) or 0 for d in (*delete_docs, *left_docs)
                if d.get("done", not args.yes))  # planned, or done
    doc = {"prefix": location.display(), "dry_run": not args.yes,
           "min_age_seconds": args.min_age, "nodes": sorted(wanted) if wanted else None,
           "retention": _retention_doc(args), "drop_old_node_sets": drop,
           "node_sets": [_job_doc(j) for j in jobs if j.old],
           "leftovers": left_docs, "skipped": _skipped(found, wanted) + in_use,
           "delete": sorted(delete_docs, key=lambda d: (d["epoch"], d["save_id"])),
           "keep": sorted(keep, key=lambda d: (d["epoch"], d["save_id"])),
           "bytes_freed": freed, "pinned": pinned,
           "bytes_pinned": sum(p["bytes"] or 0 for p in pinned),
           **({"refused": "; ".join(refusals)} if refusals else {})}
    if args.yes:
        _publish(location.canonical_url, doc)
    return doc, EXIT_DAMAGED if refusals else code
