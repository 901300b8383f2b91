"""What a checkpoint prefix holds, and the two ways things are removed from it.

:func:`scan` reads every commit record once and sorts the prefix into *steps* (committed epochs,
as :mod:`caffe2ckpt.history.lineage` defines them, each marked when a later run superseded it),
*partial saves* (some nodes' records are missing or unreadable: never a committed epoch) and
unreadable records.

Removal is ordered so that a crash at any instant leaves only unreferenced files, never a
record over missing data:

* :func:`delete_step` removes the records of an epoch (for the given nodes only) first and its
  data after;
* :func:`find_leftovers` / :func:`remove_leftovers` sweep what no record references: node
  groups without a record, ``_staging/`` copies of interrupted re-saves, and partial saves. Only
  things older than ``min_age`` seconds are touched, so a save in progress is left alone.
"""

from __future__ import annotations

import datetime
import logging
import math
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import NamedTuple

from caffe2ckpt.store.protocol import CheckpointStore
from caffe2ckpt.store.records import CommitRecord, RecordRef, delete_record, list_records
from caffe2ckpt.errors import InvalidLocationError
from caffe2ckpt.history.lineage import History
from caffe2ckpt.naming import (
    CLAIMS_DIR,
    COMMITS_DIR,
    STAGING_DIR,
    check_node_name,
    get_ckpt_filename,
)
from caffe2ckpt.policy import StepManagerOptions, retained_epochs

__all__ = ["Leftover", "PartialSave", "PrefixScan", "Step", "apply_retention", "delete_step",
           "find_leftovers", "is_checkpoint_prefix", "remove_leftovers", "scan"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Step:
    """A committed epoch: the records of its complete save(s), by node."""

    epoch: int
    records: dict[str, CommitRecord]

    @property
    def nodes(self) -> list[str]:
        return sorted(self.records)

    @property
    def save_nodes(self) -> set[str]:
        """Every node saved together with these (a scan for some nodes sees only those)."""
        return set().union(*(r.nodes for r in self.records.values()))

    @property
    def nbytes(self) -> int:
        return sum(r.nbytes for r in self.records.values())

    @property
    def generation(self) -> int:
        """The generation (claim number) of the run that saved it."""
        return self.records[self.nodes[0]].generation

    @property
    def metrics(self) -> dict[str, float]:
        """The epoch's metrics (every node of a save records the same ones)."""
        merged: dict[str, float] = {}
        for node in self.nodes:
            merged.update(self.records[node].metrics)
        return merged

    @property
    def created(self) -> float:
        return max(r.created for r in self.records.values())


class PartialSave(NamedTuple):
    """A save some of whose nodes have no record (failed, interrupted, or half deleted)."""

    epoch: int
    save_id: str
    have: list[str]  # nodes with a record
    missing: list[str]  # nodes the save names without one
    records: dict[str, CommitRecord]

    @property
    def created(self) -> float:
        return max(r.created for r in self.records.values())


@dataclass(frozen=True)
class PrefixScan:
    """Everything :func:`scan` found under a prefix."""

    steps: dict[int, Step]  # every committed epoch, superseded ones included
    partial: list[PartialSave]
    unreadable: list[tuple[RecordRef, str]] = field(default_factory=list)
    superseded: frozenset[int] = frozenset()  # committed epochs outside the current lineage

    def epochs(self) -> list[int]:
        return sorted(self.steps)

    def current(self) -> dict[int, Step]:
        """The committed steps of the current lineage (the ones a job resumes along)."""
        return {e: s for e, s in self.steps.items() if e not in self.superseded}


def _read_all(store: CheckpointStore, refs: Sequence[RecordRef]) -> list[CommitRecord | str]:
    if len(refs) < 8:
        return [store.read_or_reason(r) for r in refs]
    with ThreadPoolExecutor(max_workers=16) as pool:
        return list(pool.map(store.read_or_reason, refs))


def _families(refs: Sequence[RecordRef], read: dict[RecordRef, CommitRecord | str],
              wanted: set[str] | None) -> dict[frozenset[str], list[RecordRef]]:
    """The records by job: all of them for the ``wanted`` nodes, else by the set of nodes
    saved together (each job has its own lineage)."""
    if wanted is not None:
        return {frozenset(wanted): list(refs)}
    families: dict[frozenset[str], list[RecordRef]] = {}
    for ref in refs:
        record = read[ref]
        if not isinstance(record, str):
            families.setdefault(frozenset(record.nodes) | {ref.node}, []).append(ref)
    return families


def scan(store: CheckpointStore, nodes: Iterable[str] | None = None) -> PrefixScan:
    """Read every commit record under ``store`` (one listing, one read per record) and sort
    the saves into committed steps (:class:`~caffe2ckpt.history.lineage.History` decides) and partial
    saves, marking the steps a later run superseded.

    With ``nodes``, a step needs all of them and reports only them; saves of other nodes are
    ignored.
    """
    wanted = None if nodes is None else set(nodes)
    refs = list_records(store.location)
    if wanted is not None:  # the saves involving the wanted nodes, with all of their nodes
        keys = {(r.epoch, r.save_id) for r in refs if r.node in wanted}
        refs = [r for r in refs if (r.epoch, r.save_id) in keys]
    read = dict(zip(refs, _read_all(store, refs)))
    committed: set[tuple[int, str]] = set()
    current: set[tuple[int, str]] = set()
    for family_nodes, family in _families(refs, read, wanted).items():
        history = History(family, family_nodes, read.__getitem__)
        committed.update(k for k in {(r.epoch, r.save_id) for r in family}
                         if history.committed(*k) is not None)
        current.update((save.epoch, save.save_id) for save in history.lineage())
    saves: dict[tuple[int, str], dict[str, CommitRecord]] = {}
    unreadable: list[tuple[RecordRef, str]] = []
    for ref, record in read.items():
        if wanted is not None and ref.node not in wanted:
            continue
        if isinstance(record, str):
            unreadable.append((ref, record))
        else:
            saves.setdefault((ref.epoch, ref.save_id), {})[ref.node] = record
    steps: dict[int, dict[str, CommitRecord]] = {}
    in_lineage: set[int] = set()
    partial = []
    for (epoch, save_id), records in sorted(saves.items()):
        if (epoch, save_id) in committed:
            steps.setdefault(epoch, {}).update(records)
            if (epoch, save_id) in current:
                in_lineage.add(epoch)
            continue
        expected = set().union(*(r.nodes for r in records.values()))
        if wanted is not None:
            expected &= wanted
        missing = sorted(expected - set(records))
        partial.append(PartialSave(epoch, save_id, sorted(records), missing, records))
    return PrefixScan(steps={e: Step(e, r) for e, r in steps.items()}, partial=partial,
                      unreadable=unreadable, superseded=frozenset(steps) - in_lineage)


def delete_step(store: CheckpointStore, epoch: int, nodes: Iterable[str]) -> None:
    """Remove ``nodes``' checkpoints of ``epoch``: their records first, then their data.

    Other nodes' records and data are never touched. After a crash in the middle the epoch is
    simply no longer committed for these nodes; :func:`remove_leftovers` removes the rest.
    """
    nodes = [check_node_name(n) for n in nodes]
    refs = [r for r in list_records(store.location) if r.epoch == epoch and r.node in nodes]
    for ref in refs:
        delete_record(store.location, ref)
    for node in nodes:
        store.location.remove(store.group_path(node, epoch))
    logger.info("deleted epoch %d of nodes %s under %s", epoch, nodes,
                store.location.display())


def apply_retention(store: CheckpointStore, options: StepManagerOptions, nodes: Sequence[str],
                    protect: Iterable[int] = ()) -> list[int]:
    """Delete the steps of ``nodes`` that ``options``' retention does not keep; return them.

    The newest step of the current lineage and ``protect`` are always kept; superseded steps
    never are (see :func:`~caffe2ckpt.policy.retained_epochs`). Steps saved together with other
    nodes are left alone: deleting part of a save would un-commit the other nodes' epoch.
    """
    found = scan(store, nodes)
    steps = {e: s for e, s in found.steps.items() if s.save_nodes <= set(nodes)}
    keep = retained_epochs(options, {e: s.metrics for e, s in steps.items()}, set(protect),
                           superseded=found.superseded)
    doomed = sorted(set(steps) - keep)
    for epoch in doomed:
        delete_step(store, epoch, nodes)
    return doomed


@dataclass(frozen=True)
class Leftover:
    """Something under a prefix that no commit record references."""

    kind: str  # "uncommitted data", "interrupted re-save" or "partial save"
    path: str  # relative to the prefix
    age: float  # seconds since it was last written (inf if the filesystem does not say)
    records: tuple[RecordRef, ...] = ()  # the records of a partial save


def _timestamp(info: dict) -> float | None:
    for key in ("mtime", "LastModified", "last_modified", "updated", "created"):
        value = info.get(key)
        if isinstance(value, datetime.datetime):
            return value.timestamp()
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, str):
            try:
                return datetime.datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
            except ValueError:
                continue
    return None


def _age(store: CheckpointStore, path: str, now: float) -> float:
    """Seconds since anything under ``path`` was written (inf if the filesystem cannot say)."""
    fs = store.location.fs
    try:
        infos = fs.find(path, detail=True) or {path: fs.info(path)}
    except FileNotFoundError:
        return math.inf
    times = [t for t in map(_timestamp, infos.values()) if t is not None]
    return now - max(times) if times else math.inf


def _parse_group(name: str) -> tuple[str, int] | None:
    node, dot, epoch = name.rpartition(".")
    if not dot or not epoch.isdigit() or len(epoch) > 12:
        return None
    try:
        check_node_name(node)
    except InvalidLocationError:
        return None
    return node, int(epoch)


def is_checkpoint_prefix(store: CheckpointStore) -> bool:
    """Whether caffe2ckpt ever wrote here (a commit record or a claim exists)."""
    location = store.location
    return any(location.exists(location.path(d)) for d in (COMMITS_DIR, CLAIMS_DIR))


def find_leftovers(store: CheckpointStore, *, min_age: float = 3600.0,
                   nodes: Iterable[str] | None = None,
                   found: PrefixScan | None = None) -> list[Leftover]:
    """What :func:`remove_leftovers` would remove: unreferenced data older than ``min_age``.

    Only under a caffe2ckpt prefix (:func:`is_checkpoint_prefix`) and only directories named
    like node groups; a partial save one of whose records is unreadable is left for a person
    to inspect. ``found`` reuses a :func:`scan` of the prefix.
    """
    if not is_checkpoint_prefix(store):
        return []
    now = time.time()
    wanted = None if nodes is None else set(nodes)
    location = store.location
    referenced = {(r.node, r.epoch) for r in list_records(location)}
    found = found if found is not None else scan(store)
    items: list[Leftover] = []
    for name in sorted(location.list_names(location.root)):
        parsed = _parse_group(name)
        if (parsed is None or parsed in referenced or (wanted and parsed[0] not in wanted)
                or not location.fs.isdir(location.path(name))):
            continue
        items.append(Leftover("uncommitted data", name, _age(store, location.path(name), now)))
    for name in sorted(location.list_names(location.path(STAGING_DIR))):
        parsed = _parse_group(name.rpartition(".")[0])
        if parsed is None or (wanted and parsed[0] not in wanted):
            continue
        items.append(Leftover("interrupted re-save", f"{STAGING_DIR}/{name}",
                              _age(store, location.path(STAGING_DIR, name), now)))
    damaged = {(ref.epoch, ref.save_id) for ref, _ in found.unreadable}
    for part in found.partial:
        if (wanted and not set(part.have) <= wanted) or (part.epoch, part.save_id) in damaged:
            continue
        items.append(Leftover("partial save",
                              ", ".join(get_ckpt_filename(n, part.epoch) for n in part.have),
                              now - part.created, tuple(r.ref for r in part.records.values())))
    return [item for item in items if item.age >= min_age]


def remove_leftovers(store: CheckpointStore, leftovers: Sequence[Leftover]) -> None:
    """Remove what :func:`find_leftovers` found (records of partial saves first)."""
    location = store.location
    for item in leftovers:
        if item.records:
            for ref in item.records:
                delete_record(location, ref)
            still = {(r.node, r.epoch) for r in list_records(location)}
            for ref in item.records:
                if (ref.node, ref.epoch) not in still:
                    location.remove(store.group_path(ref.node, ref.epoch))
        else:
            location.remove(location.path(item.path))
        logger.info("removed %s %s under %s", item.kind, item.path, location.display())
