"""What each ``caffe2ckpt`` command does, as a function from parsed arguments to one JSON-ready
document (printed as is with ``--json``, rendered as tables otherwise) and an exit code.

Every read goes through the library's own verification (:class:`CheckpointStore`, commit records
and manifests). ``gc`` is in :mod:`caffe2ckpt.cli.gc`.

Imports: errors, location, naming, checkpoint, catalog, commit, manifest, storage, cli.diff,
cli.leftovers, cli.render.
"""

from __future__ import annotations

import argparse
import datetime
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from caffe2ckpt.catalog import Leftover, PrefixScan, Step, find_leftovers, scan
from caffe2ckpt.checkpoint import CheckpointStore
from caffe2ckpt.cli.diff import diff_node
from caffe2ckpt.cli.render import Progress, epochs_text
from caffe2ckpt.commit import CommitRecord, list_records
from caffe2ckpt.errors import (
    CheckpointCorruptedError,
    CheckpointNotFoundError,
)
from caffe2ckpt.location import Location
from caffe2ckpt.manifest import Manifest
from caffe2ckpt.storage import read_node

__all__ = [
    "EXIT_DAMAGED",
    "EXIT_IO",
    "EXIT_NOT_FOUND",
    "EXIT_OK",
    "EXIT_USAGE",
    "CLIError",
    "Context",
    "cmd_diff",
    "cmd_ls",
    "cmd_show",
    "cmd_verify",
]

EXIT_OK = 0
EXIT_DAMAGED = 1  # verification found damage (verify, show --verify, diff of damaged data)
EXIT_USAGE = 2  # wrong arguments (argparse's own code)
EXIT_NOT_FOUND = 3  # no checkpoints at the prefix, or the epoch / node asked for is not there
EXIT_IO = 4  # the storage could not be read or written (permissions, network, ...)

Document = dict[str, Any]


class CLIError(Exception):
    """An expected failure: printed as one line on stderr, exits with ``code``."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


@dataclass
class Context:
    """What every command needs besides its own arguments."""

    storage_options: dict[str, Any] | None = None
    progress: Progress = field(default_factory=lambda: Progress(enabled=False))

    def store(self, url: str) -> CheckpointStore:
        try:
            location = Location(url, self.storage_options)
        except TypeError as exc:  # a filesystem rejecting an option
            raise CLIError(f"cannot open checkpoint prefix {url!r} with --storage-options "
                           f"{self.storage_options}: {exc}", EXIT_USAGE) from exc
        return CheckpointStore(location)


# -- shared helpers ----------------------------------------------------------------------------


def json_number(value: float) -> float | str:
    """A float JSON can hold: NaN and infinities become "nan", "inf", "-inf"."""
    return value if math.isfinite(value) else repr(value)


def json_metrics(metrics: dict[str, float]) -> dict[str, float | str]:
    return {k: json_number(v) for k, v in sorted(metrics.items())}


def utc(timestamp: float) -> str:
    return datetime.datetime.fromtimestamp(timestamp, datetime.UTC).isoformat(
        timespec="seconds").replace("+00:00", "Z")


def open_prefix(ctx: Context, url: str) -> tuple[CheckpointStore, PrefixScan]:
    """The store at ``url`` and a scan of its records; :class:`CLIError` if nothing is there."""
    store = ctx.store(url)
    location = store.location
    if not location.list_names(location.root):
        if not location.exists(location.root):
            why = "it does not exist"
        elif location.fs.isfile(location.root):
            why = "it is a file, not a directory"
        else:
            why = "it is empty"
        raise CLIError(f"no checkpoints at {location.display()!r}: {why}", EXIT_NOT_FOUND)
    return store, scan(store)


def require_step(store: CheckpointStore, found: PrefixScan, epoch: int) -> Step:
    if epoch in found.steps:
        return found.steps[epoch]
    where = store.location.display()
    bad = [ref for ref, _ in found.unreadable if ref.epoch == epoch]
    partial = [p for p in found.partial if p[0] == epoch]
    if bad:
        why = ("its commit record(s) " + ", ".join(repr(r.filename) for r in bad)
               + f" are unreadable (see `caffe2ckpt verify {store.location.url} --epoch {epoch}`)")
    elif partial:
        missing = sorted({n for p in partial for n in p[3]})
        why = f"its save is partial: node(s) {', '.join(missing)} have no commit record"
    else:
        why = f"committed epochs: {epochs_text(found.epochs())}"
    raise CLIError(f"epoch {epoch} is not committed under {where!r}; {why}", EXIT_NOT_FOUND)


def require_nodes(store: CheckpointStore, step: Step, nodes: list[str] | None) -> list[str]:
    if not nodes:
        return step.nodes
    unknown = [n for n in nodes if n not in step.records]
    if unknown:
        raise CLIError(f"epoch {step.epoch} under {store.location.display()!r} has no node "
                       f"{', '.join(map(repr, unknown))}; its nodes: {', '.join(step.nodes)}",
                       EXIT_NOT_FOUND)
    return list(dict.fromkeys(nodes))


def checked_manifest(store: CheckpointStore, node: str, epoch: int) -> Manifest:
    """The manifest of a committed node checkpoint after the library checked its record, group
    metadata digests and every array's metadata (``load_node`` with no blobs)."""
    store.load_node(node, epoch, names=[])
    return store.manifest(node, epoch)


def read_units(manifest: Manifest) -> list[list[str]]:
    """How blobs are read: each own array alone, every packed blob in one read."""
    units = [[name] for name in manifest.arrays]
    if manifest.packed:
        units.append([b.name for b in manifest.packed])
    return units


def leftover_bytes(location: Location, item: Leftover) -> int | None:
    total = 0
    for rel in item.path.split(", "):
        try:
            total += int(location.fs.du(location.path(rel), total=True))
        except (OSError, ValueError, TypeError):
            return None
    return total


def leftover_doc(location: Location, item: Leftover) -> Document:
    return {"kind": item.kind, "path": item.path, "url": location.display(item.path),
            "age_seconds": None if math.isinf(item.age) else round(item.age, 3),
            "bytes": leftover_bytes(location, item)}


def known_nodes(location: Location) -> set[str]:
    """Every node with a commit record or a group (``<node>.<epoch>``) under the prefix."""
    nodes = {ref.node for ref in list_records(location)}
    for name in location.list_names(location.root):
        node, dot, epoch = name.rpartition(".")
        if dot and node and epoch.isdigit():
            nodes.add(node)
    return nodes


# -- ls ----------------------------------------------------------------------------------------


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


# -- checking blobs (show --verify, verify) ----------------------------------------------------


@dataclass
class NodeCheck:
    """The result of reading and verifying one node checkpoint."""

    status: str  # "ok", "damaged" or "error" (could not be read: I/O)
    blobs: dict[str, str] = field(default_factory=dict)  # name -> "ok" / "bad" / "error"
    errors: list[Document] = field(default_factory=list)
    manifest: Manifest | None = None


def check_node(store: CheckpointStore, node: str, epoch: int, progress: Progress,
               expected_bytes: int = 0) -> NodeCheck:
    """Read every blob of ``node``'s checkpoint of ``epoch`` and check every checksum.

    Unlike one ``load_node`` call this finds every damaged blob (not just the first), and holds
    only one array (or the packed blobs) in memory at a time.
    """
    label = f"{node}.{epoch}"
    try:
        manifest = checked_manifest(store, node, epoch)
    except CheckpointCorruptedError as exc:
        progress.advance(expected_bytes, label)
        return NodeCheck("damaged", errors=[{"blob": exc.blob, "error": str(exc)}])
    except (CheckpointNotFoundError, OSError) as exc:
        progress.advance(expected_bytes, label)
        return NodeCheck("error", errors=[{"blob": None, "error": str(exc)}])
    check = NodeCheck("ok", manifest=manifest)
    path = store.group_path(node, epoch)
    for names in read_units(manifest):
        state, error = "ok", None
        try:
            read_node(store.location, path, manifest, names)
        except CheckpointCorruptedError as exc:
            state, error = "bad", {"blob": exc.blob, "error": str(exc)}
        except OSError as exc:
            state, error = "error", {"blob": names[0] if len(names) == 1 else None,
                                     "error": str(exc)}
        if error is not None:
            if len(names) > 1:
                error["packed_blobs"] = names
            check.errors.append(error)
            if check.status == "ok" or state == "bad":
                check.status = "damaged" if state == "bad" else "error"
        for name in names:
            check.blobs[name] = state
        progress.advance(sum(manifest.blobs[n].nbytes for n in names), label)
    return check


# -- show --------------------------------------------------------------------------------------


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


# -- verify ------------------------------------------------------------------------------------


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


# -- diff --------------------------------------------------------------------------------------


def cmd_diff(ctx: Context, args: argparse.Namespace) -> tuple[Document, int]:
    store, found = open_prefix(ctx, args.prefix)
    a, b = args.epoch_a, args.epoch_b
    step_a, step_b = require_step(store, found, a), require_step(store, found, b)
    nodes = sorted(set(step_a.nodes) | set(step_b.nodes))
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
        sides = [checked_manifest(store, node, e) if node in s.records else None
                 for e, s in ((a, step_a), (b, step_b))]
        blobs += diff_node(store, node, (a, b), sides, ctx.progress)
    ctx.progress.close()
    summary = {k: sum(x["status"] == k for x in blobs)
               for k in ("changed", "added", "removed", "same")}
    doc = {"prefix": store.location.display(), "epochs": [a, b], "nodes": nodes,
           "nodes_added": sorted(set(step_b.nodes) - set(step_a.nodes) & set(nodes)),
           "nodes_removed": sorted(set(step_a.nodes) - set(step_b.nodes) & set(nodes)),
           "summary": summary, "blobs": blobs, "show_same": bool(args.all)}
    return doc, EXIT_OK
