"""What every ``caffe2ckpt`` command shares: exit codes, :class:`CLIError`, the :class:`Context`
of a call, opening a prefix, and reading and checking node checkpoints for ``show`` and ``verify``."""

from __future__ import annotations

import datetime
import functools
import math
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

from caffe2ckpt.cli.render import Progress
from caffe2ckpt.errors import (
    CheckpointCorruptedError,
    CheckpointError,
    CheckpointNotFoundError,
)
from caffe2ckpt.fs.location import Location
from caffe2ckpt.history.cleanup import Leftover, is_checkpoint_prefix
from caffe2ckpt.history.lineage import Save
from caffe2ckpt.history.scan import PrefixScan, scan
from caffe2ckpt.history.scan import require_save as scan_require_save
from caffe2ckpt.store.commit.protocol import CheckpointStore
from caffe2ckpt.store.format.manifest import Manifest
from caffe2ckpt.store.format.paths import COMMITS_DIR, RUNS_DIR, parse_group_name
from caffe2ckpt.store.format.records import CommitRecord, list_records
from caffe2ckpt.store.format.zarrgroup import parse_manifest
from caffe2ckpt.store.read.group import read_units
from caffe2ckpt.store.read.save import SaveReader
from caffe2ckpt.urls import public_url

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
            raise CLIError(f"cannot open checkpoint prefix {public_url(url)!r} with "
                           f"--storage-options {self.storage_options}: {exc}",
                           EXIT_USAGE) from exc
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
    if not is_checkpoint_prefix(store):  # e.g. the folder above the prefix
        raise CLIError(f"{location.display()!r} does not look like a checkpoint prefix (it has "
                       f"no {COMMITS_DIR}/ or {RUNS_DIR}/ directory)", EXIT_NOT_FOUND)
    return store, scan(store)


def committed_epochs(found: PrefixScan) -> list[int]:
    """Every epoch with a committed save (superseded ones included)."""
    return sorted({s.epoch for s in found.saves()})


def require_save(store: CheckpointStore, found: PrefixScan, epoch: int,
                 nodes: Sequence[str] | None = None) -> Save:
    """The committed save of ``epoch`` holding every one of ``nodes`` (jobs with other nodes
    may share the prefix): the current lineage's, else a superseded one
    (:class:`CheckpointNotFoundError` saying why there is none: exit 3)."""
    return scan_require_save(found, store, epoch, list(dict.fromkeys(nodes or ())))


def save_nodes(save: Save, nodes: Sequence[str] | None) -> list[str]:
    """The nodes of ``save`` a command acts on: ``nodes`` (as :func:`require_save` checked
    them), else all of them."""
    return list(dict.fromkeys(nodes)) if nodes else sorted(save.records)


def checked_manifest(store: CheckpointStore, record: CommitRecord) -> Manifest:
    """The manifest of a committed node checkpoint after the library checked its record, group
    metadata digests and every array's metadata."""
    return SaveReader(store, {record.node: record}).check_metadata(record.node)


def leftover_bytes(location: Location, item: Leftover) -> int | None:
    total = 0
    for rel in filter(None, item.path.split(", ")):
        try:
            total += int(location.fs.du(location.path(rel), total=True))
        except (OSError, ValueError, TypeError):
            return None
    return total


def leftover_doc(location: Location, item: Leftover) -> Document:
    return {"kind": item.kind, "path": item.path, "url": location.display(item.path),
            "age_seconds": None if math.isinf(item.age) else round(item.age, 3),
            "bytes": leftover_bytes(location, item), "live": item.live,
            "save_id": item.save_id}


def layout_doc(records: Sequence[CommitRecord]) -> Document | None:
    """How a save's blobs are spread over its nodes, as its records store the layout: the
    partition, the nodes in the job's order, the ``rows`` and ``replicated`` blobs (every other
    blob is local to its node); None for a save made without a layout."""
    layouts = [r.layout for r in records if r.layout is not None]
    if not layouts:
        return None
    return {"partition": layouts[0].partition, "order": list(layouts[0].order),
            "rows": sorted({n for lay in layouts for n in lay.rows}),
            "replicated": sorted({n for lay in layouts for n in lay.replicated})}


def save_kind(records: Sequence[CommitRecord], location: Location) -> Document:
    """Whether a save is whole (``full``) or differential (``delta``: it builds on older
    groups), the bytes of data it wrote, for a delta the groups it needs per node, and (made
    with deltas on) the large blobs it wrote whole and why, per node."""
    delta = [r for r in records if r.delta is not None]
    out: Document = {"kind": "delta" if delta else "full",
                     "bytes_written": sum(r.bytes_written for r in records)}
    if any(r.whole for r in records):
        out["written_whole"] = {r.node: dict(r.whole) for r in records if r.whole}
    if delta:
        out["builds_on"] = {r.node: [location.display(g) for g in sorted(r.delta.closure())]
                            for r in delta}  # type: ignore[union-attr]
        out["depth"] = max(r.delta.depth for r in delta)  # type: ignore[union-attr]
    return out


def group_epoch(group: str) -> int | None:
    """The epoch of the group at ``group`` (None: not a group's name)."""
    parsed = parse_group_name(group)
    return None if parsed is None else parsed.epoch


def group_manifest(store: CheckpointStore, group: str) -> Manifest | None:
    """The manifest the ``zarr.json`` of the group at ``group`` holds, not checked against
    any record (None: it cannot be read)."""
    parsed = parse_group_name(group)
    if parsed is None:
        return None
    try:
        raw = store.location.read_bytes(f"{store.location.path(group)}/zarr.json",
                                        limit=64 << 20)
        return parse_manifest(raw, group, node=parsed.node, epoch=parsed.epoch)
    except (CheckpointError, ValueError):
        return None


def group_bytes(store: CheckpointStore, group: str) -> int | None:
    """The bytes of data the group at ``group`` holds, as its manifest says (None: it cannot
    be read)."""
    manifest = group_manifest(store, group)
    return None if manifest is None else manifest.stored_nbytes


def known_nodes(location: Location) -> set[str]:
    """Every node with a commit record or a group under the prefix."""
    nodes = {ref.node for ref in list_records(location)}
    nodes.update(g.node for g in map(parse_group_name, location.list_names(location.root))
                 if g is not None)
    return nodes


@dataclass
class NodeCheck:
    """The result of reading and verifying one node checkpoint."""

    status: str  # "ok", "damaged" or "error" (could not be read: I/O)
    blobs: dict[str, str] = field(default_factory=dict)  # name -> "ok" / "bad" / "error"
    errors: list[Document] = field(default_factory=list)
    manifest: Manifest | None = None
    found: dict[str, Document] = field(default_factory=dict)  # name -> the error hitting it

    def note(self, names: list[str], exc: Exception | None, *, packed: bool = False) -> None:
        """The outcome of reading ``names`` together: ``exc`` (None: they are fine) hits each
        of them."""
        state = "ok" if exc is None else "bad" if _is_damage(exc) else "error"
        self.blobs.update(dict.fromkeys(names, state))
        if exc is not None:
            error = _error_doc(names, exc, packed)
            self.found.update(dict.fromkeys(names, error))
            self.hit(state, error)

    def hit(self, state: str, error: Document) -> None:
        """Damage (``state`` "bad") or a read error (``"error"``) that ``error`` describes."""
        self.errors.append(error)
        if self.status == "ok" or state == "bad":
            self.status = "damaged" if state == "bad" else "error"


def _is_damage(exc: Exception) -> bool:
    return isinstance(exc, CheckpointCorruptedError)


def _error_doc(names: list[str], exc: Exception, packed: bool) -> Document:
    """One damage or I/O error of blobs ``names`` read together: the blob it hits (where
    several were read together: what it names, and the blobs)."""
    error: Document = {"blob": names[0] if len(names) == 1 else getattr(exc, "blob", None),
                       "error": str(exc) or type(exc).__name__}
    if len(names) > 1:
        error["packed_blobs" if packed else "blobs"] = names
    return error


def _attempt(read: Callable[[], object]) -> Exception | None:
    """The damage or I/O error ``read()`` raises (None: it read fine)."""
    try:
        read()
    except (CheckpointCorruptedError, OSError) as exc:
        return exc
    return None


def check_chained(store: CheckpointStore, record: CommitRecord, manifest: Manifest,
                  names: list[str]) -> list[tuple[list[str], Exception | None]]:
    """Read blobs ``names`` of the differential save ``record`` commits, which older groups
    hold, in one ``load_node`` (each source group and overlay read once); outcomes as (blobs,
    error or None). If it fails, the blobs are read again by what they share where they are
    stored (:func:`_by_source`), so that damage is put on the blobs it hits; an error naming
    some of them (``blobs``: those of a damaged packed chunk) hits those."""
    out: list[tuple[list[str], Exception | None]] = []
    todo = [(names, True)]  # blobs read together, and whether they may still be split
    while todo:
        unit, split = todo.pop()
        exc = _attempt(functools.partial(store.load_node, record, unit))
        hit = [n for n in unit if n in getattr(exc, "blobs", ())]
        if exc is None or len(unit) == 1:
            out.append((unit, exc))
        elif hit:
            out.append((hit, exc))
            if len(hit) < len(unit):
                todo.append(([n for n in unit if n not in hit], split))
        elif split:
            todo += [(part, False) for part in _by_source(store, manifest, unit)]
        else:
            out.append((unit, exc))
    return out


def _by_source(store: CheckpointStore, manifest: Manifest, names: list[str]) -> list[list[str]]:
    """``names`` (inherited blobs of ``manifest``'s save) by what they share where they are
    stored whole: each row-overlaid blob alone (its overlays are its own), the others by
    source group and array (that group's packed blobs together; all of a group whose
    manifest cannot be read together)."""
    sources: dict[str, Manifest | None] = {}
    parts: dict[tuple[str, str, str | None], list[str]] = {}
    for name in names:
        inherited = manifest.inherited[name]
        group = inherited.chain[0]
        if group not in sources:
            sources[group] = group_manifest(store, group)
        source = sources[group]
        info = source.stored_blobs.get(name) if source is not None else None
        key = (name if inherited.kind == "rows" else "", group, info and info.path)
        parts.setdefault(key, []).append(name)
    return list(parts.values())


def check_node(store: CheckpointStore, record: CommitRecord, progress: Progress) -> NodeCheck:
    """Read every blob of the node checkpoint ``record`` commits and check every checksum.

    Unlike one ``load_node`` call this finds every damaged blob (not just the first), and holds
    only one array (or the small blobs read together) in memory at a time. It reads only the
    node's own group (and the older groups a differential save builds on): :func:`check_nodes`
    checks what a restore of the node reads from other nodes' groups too.
    """
    check = _opened(store, record)
    if check.manifest is None:
        progress.advance(record.nbytes, record.group)
    else:
        _check_blobs(store, record, check.manifest, check, None, progress)
    return check


def _opened(store: CheckpointStore, record: CommitRecord) -> NodeCheck:
    """A check of ``record``'s group whose manifest is read and metadata checked; else it is
    damaged or could not be read, and has no manifest."""
    try:
        return NodeCheck("ok", manifest=checked_manifest(store, record))
    except CheckpointCorruptedError as exc:
        return NodeCheck("damaged", errors=[{"blob": exc.blob, "error": str(exc)}])
    except (CheckpointNotFoundError, OSError) as exc:
        return NodeCheck("error", errors=[{"blob": None, "error": str(exc)}])


def _check_blobs(store: CheckpointStore, record: CommitRecord, manifest: Manifest,
                 check: NodeCheck, names: Collection[str] | None, progress: Progress) -> None:
    """Read the blobs ``names`` (default: all) of ``record``'s checkpoint (its checked
    ``manifest``), noting each outcome in ``check``."""
    label = record.group
    reader = SaveReader(store, {record.node: record}, manifests={record.node: manifest})
    for unit in read_units(manifest):
        unit = unit if names is None else [n for n in unit if n in names]
        if not unit:
            continue
        if unit[0] in manifest.inherited:  # through their chains, digests checked
            for blobs, exc in check_chained(store, record, manifest, unit):
                check.note(blobs, exc)
        else:
            check.note(unit, _attempt(functools.partial(reader.own, record, manifest, unit)),
                       packed=len(unit) > 1)
        progress.advance(sum(manifest.blobs[n].nbytes for n in unit), label)


def check_nodes(store: CheckpointStore, todo: Sequence[tuple[Save, CommitRecord]],
                progress: Progress) -> list[NodeCheck]:
    """:func:`check_node` of each node checkpoint of ``todo`` (each with its save), and of
    what a restore of the node reads besides: each replicated blob another node of its save
    wrote (its layout's ``written_by``), in that writer's group. Damage found there is the
    node's, naming the blob and the writer's group. A writer's blob is read once per call:
    its outcome is taken from the writer's own check when that node is in ``todo``, else it is
    read alone, once however many nodes hold it."""
    checks = {(record.save_id, record.node): check_node(store, record, progress)
              for _, record in todo}
    borrowed = _Borrowed(store, checks, progress)
    for save, record in todo:
        borrowed.check(save, record, checks[record.save_id, record.node])
    return [checks[record.save_id, record.node] for _, record in todo]


class _Borrowed:
    """The replicated blobs that node checkpoints hold and other nodes of their save wrote,
    checked in the writers' groups: from the writer's whole check (``checks``, by save id and
    node), else read alone (each blob once)."""

    def __init__(self, store: CheckpointStore, checks: dict[tuple[str, str], NodeCheck],
                 progress: Progress) -> None:
        self.store, self.checks, self.progress = store, checks, progress
        self.alone: dict[tuple[str, str], NodeCheck] = {}  # writers not checked whole

    def check(self, save: Save, record: CommitRecord, check: NodeCheck) -> None:
        """Note in ``check`` (``record``'s) the damage of each blob its node borrows."""
        lent = record.layout.written_by if record.layout is not None else {}
        by_writer: dict[str, list[str]] = {}
        for name, writer in sorted(lent.items()):
            by_writer.setdefault(writer, []).append(name)
        for writer, names in by_writer.items():
            source = save.records.get(writer)
            found = None if source is None else self._writer(save, source, names)
            for name in names:
                state, why = _outcome(found, name)
                if state != "ok":
                    check.hit(state, self._error(record, writer, source, name, state, why))

    def _writer(self, save: Save, writer: CommitRecord, names: list[str]) -> NodeCheck:
        """The check of ``writer``'s group that holds the outcome of its blobs ``names``."""
        key = (save.save_id, writer.node)
        if key in self.checks:
            return self.checks[key]
        check = self.alone.get(key) or self.alone.setdefault(key, _opened(self.store, writer))
        manifest = check.manifest
        todo = [] if manifest is None else [n for n in names if n in manifest.blobs
                                             and n not in check.blobs]
        if manifest is not None and todo:
            self.progress.total += sum(manifest.blobs[n].nbytes for n in todo)
            _check_blobs(self.store, writer, manifest, check, todo, self.progress)
        return check

    def _error(self, record: CommitRecord, writer: str, source: CommitRecord | None,
               name: str, state: str, why: str) -> Document:
        """The damage (or read error) ``why`` of blob ``name`` that ``record``'s node borrows
        from node ``writer`` (whose record is ``source``), as the borrowing node's."""
        where = self.store.where(source) if source is not None else None
        group = f"group {where!r}" if where else "group"
        what = "is damaged" if state == "bad" else "could not be read"
        return {"blob": name, "writer": writer, "path": where, "error": (
            f"checkpoint {self.store.where(record)!r} (node {record.node!r}, epoch "
            f"{record.epoch}): replicated blob {name!r}, which this node's restore reads from "
            f"its writer {writer!r}'s {group}, {what} there: {why}")}


def _outcome(check: NodeCheck | None, name: str) -> tuple[str, str]:
    """The state of blob ``name`` in a writer's group that ``check`` checked (``"ok"``,
    ``"bad"`` or ``"error"``), and what is wrong with it."""
    if check is None:
        return "bad", "the save has no commit record of that node"
    if check.manifest is None:  # its group's metadata could not be read or checked
        return ("bad" if check.status == "damaged" else "error",
                "; ".join(e["error"] for e in check.errors))
    if name not in check.manifest.blobs:
        return "bad", "that node's checkpoint does not hold it"
    state = check.blobs.get(name, "ok")
    return state, check.found[name]["error"] if state != "ok" else ""
