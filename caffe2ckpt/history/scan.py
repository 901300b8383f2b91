"""A whole prefix at once: every family's lineage and superseded saves, partial saves and
unreadable records, from one listing and one read per record (for the CLI, ``gc``, the step
manager and the Prefect table), and the newest save of one family in O(1) requests (for resume).

Both are views of :mod:`caffe2ckpt.history.lineage`; neither decides anything of its own.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from caffe2ckpt.errors import CheckpointCorruptedError, CheckpointError, CheckpointNotFoundError
from caffe2ckpt.fs.iopool import read_pool
from caffe2ckpt.history.lineage import History, Save
from caffe2ckpt.store.commit import runs
from caffe2ckpt.store.commit.protocol import CheckpointStore
from caffe2ckpt.store.format.paths import COMMITS_DIR, save_generation
from caffe2ckpt.store.format.records import CommitRecord, RecordRef, list_records
from caffe2ckpt.units import epochs_summary

__all__ = ["Family", "PartialSave", "PrefixScan", "elastic_steps", "family_history",
           "LeftBehindWarning", "left_behind", "newest_save", "origin", "other_saves",
           "require_save", "scan"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Family:
    """One job family's committed saves: its lineage (newest first) and superseded saves."""

    nodes: frozenset[str]
    lineage: list[Save]
    superseded: list[Save]

    @property
    def newest(self) -> Save | None:
        return self.lineage[0] if self.lineage else None

    def current(self) -> dict[int, Save]:
        """The lineage by epoch."""
        return {s.epoch: s for s in self.lineage}

    def saves(self) -> list[Save]:
        """Every committed save, lineage and superseded, by epoch (newest first)."""
        return sorted([*self.lineage, *self.superseded], key=lambda s: -s.epoch)

    def lineage_save(self, epoch: int) -> Save | None:
        return next((s for s in self.lineage if s.epoch == epoch), None)

    def with_newest(self, save: Save) -> Family:
        """The family after its head run committed ``save`` (a run saves only above its
        lineage's newest epoch, so it goes first; a view read after the commit has it
        already)."""
        if any((s.epoch, s.save_id) == (save.epoch, save.save_id) for s in self.lineage):
            return self
        return Family(self.nodes, [save, *self.lineage], self.superseded)

    def without(self, saves: Iterable[Save]) -> Family:
        """The family after ``saves`` were removed."""
        gone = {(s.epoch, s.save_id) for s in saves}
        return Family(self.nodes, [s for s in self.lineage if (s.epoch, s.save_id) not in gone],
                      [s for s in self.superseded if (s.epoch, s.save_id) not in gone])


class PartialSave(NamedTuple):
    """A save some of whose nodes have no record (failed, interrupted, or half deleted)."""

    epoch: int
    save_id: str
    have: list[str]  # nodes with a readable record
    missing: list[str]  # nodes the save names without one
    records: dict[str, CommitRecord]

    @property
    def started(self) -> float:
        return min(r.started or r.created for r in self.records.values())


@dataclass(frozen=True)
class PrefixScan:
    """Everything :func:`scan` found under a prefix."""

    families: dict[frozenset[str], Family]
    partial: list[PartialSave] = field(default_factory=list)
    unreadable: list[tuple[RecordRef, str]] = field(default_factory=list)
    newest_generation: int = 0  # the run log's newest run when the scan listed it
    referenced: frozenset[str] = frozenset()  # group paths readable records need

    def records(self) -> list[CommitRecord]:
        """Every readable record: of committed saves and of partial ones."""
        return [*(r for s in self.saves() for r in s.records.values()),
                *(r for p in self.partial for r in p.records.values())]

    def saves(self) -> list[Save]:
        """Every committed save of every family, newest epoch first."""
        return sorted((s for f in self.families.values() for s in f.saves()),
                      key=lambda s: (-s.epoch, s.save_id))

    def is_superseded(self, save: Save) -> bool:
        family = self.families.get(save.nodes)
        return family is not None and save in family.superseded

    def _newer_first(self) -> list[Family]:
        """The families, the one whose newest save is of the newest run first."""
        return sorted(self.families.values(),
                      key=lambda f: -(f.newest.generation if f.newest else 0))

    def current(self) -> dict[int, Save]:
        """The lineage saves of every family by epoch (with several families on one prefix,
        the family with the newer run wins an epoch they share)."""
        out: dict[int, Save] = {}
        for family in reversed(self._newer_first()):
            out.update(family.current())
        return out

    def saves_at(self, epoch: int) -> list[Save]:
        """The committed saves of ``epoch``: lineage saves first (the family of the newer run
        first, as :meth:`current` picks), then superseded ones (the newer run first)."""
        current = (f.lineage_save(epoch) for f in self._newer_first())
        superseded = sorted((s for f in self.families.values() for s in f.superseded
                             if s.epoch == epoch), key=lambda s: -s.generation)
        return [*(s for s in current if s is not None), *superseded]

    def save_at(self, epoch: int, nodes: Iterable[str] = ()) -> Save | None:
        """The save ``epoch`` means for ``nodes``, in :meth:`saves_at`'s order: a lineage save
        before a superseded one and, among either, one made by exactly those nodes before one
        that holds them with others (two jobs with overlapping node names: ``[t0, t1]`` reaches
        the two-node job's save even when a four-node job's comes first); without ``nodes``,
        the one :meth:`current` gives, else the newest superseded one. None if there is none."""
        wanted = set(nodes)
        held = [s for s in self.saves_at(epoch) if wanted <= set(s.records)]
        return min(held, key=lambda s: (self.is_superseded(s), set(s.records) != wanted),
                   default=None)  # min keeps the first of equals: saves_at's order

    def newest_epoch(self, nodes: Iterable[str] = ()) -> int | None:
        """The newest lineage epoch of the families holding every one of ``nodes`` (never a
        superseded one); None if there is none."""
        wanted = set(nodes)
        return max((f.newest.epoch for f in self.families.values()
                    if f.newest is not None and wanted <= f.nodes), default=None)

    def describe_saves(self, saves: Iterable[Save]) -> str:
        """``"trainer_0, trainer_1; solo_0 (superseded)"``: each save's nodes, for messages."""
        return "; ".join(", ".join(sorted(s.records))
                         + (" (superseded)" if self.is_superseded(s) else "") for s in saves)


def _with_layout(families: Iterable[Family]) -> list[Family]:
    """The families whose newest save carries a layout (and could be resumed elsewhere)."""
    return [f for f in families if f.newest is not None
            and all(r.layout is not None for r in f.newest.records.values())]


def elastic_steps(found: PrefixScan, nodes: Iterable[str], *,
                  warned: set[str] | None = None) -> dict[int, Save]:
    """The lineage, by epoch, that a job on ``nodes`` whose nodes have saved nothing resumes
    from on another node count: that of the family (of other nodes) whose newest save carries a
    layout and is of the newest run among such families; empty when there is none. A WARNING
    names each family of a newer run passed over because its newest save has no layout (once
    per such save into ``warned``, when given; else every time)."""
    own = frozenset(nodes)
    others = [f for f in found.families.values() if f.nodes != own and f.newest is not None]
    families = _with_layout(others)
    chosen = max(families, key=lambda f: f.newest.generation, default=None)  # type: ignore[union-attr]
    floor = 0 if chosen is None else chosen.newest.generation  # type: ignore[union-attr]
    for family in sorted((f for f in others if f not in families), key=lambda f: sorted(f.nodes)):
        newest = family.newest
        assert newest is not None
        if newest.generation > floor and (warned is None or newest.save_id not in warned):
            _passed_over(own, family, chosen)
            if warned is not None:
                warned.add(newest.save_id)
    return {} if chosen is None else chosen.current()


def _passed_over(own: frozenset[str], family: Family, chosen: Family | None) -> None:
    newest = family.newest
    assert newest is not None
    instead = ("" if chosen is None or chosen.newest is None else
               f"; it resumes from the newest save of nodes {sorted(chosen.nodes)} with a "
               f"layout, epoch {chosen.newest.epoch}, instead")
    logger.warning(
        "not resuming nodes %s from epoch %d of nodes %s: that save has no layout, so it can be "
        "restored only on those nodes (declare caffe2ckpt.Layout(...) when saving to change the "
        "node count)%s", sorted(own), newest.epoch, sorted(family.nodes), instead)


def other_saves(found: PrefixScan, family: Family, *, warned: set[str] | None = None
                ) -> dict[int, Save]:
    """The saves of other node sets, by epoch, that a job with a layout on ``family``'s nodes
    reaches besides its own lineage: while that lineage is empty, the lineage it resumes on
    another node count (:func:`elastic_steps`); after, the save its lineage starts from
    (:func:`origin`), which it may go back to. Every reader of a job's saves (the managers,
    the step manager) asks this, then :func:`~caffe2ckpt.history.placement.place`."""
    if not family.lineage:
        return elastic_steps(found, family.nodes, warned=warned)
    start = origin(found, found.families.get(family.nodes, family))
    return {} if start is None else {start.epoch: start}


def origin(found: PrefixScan, family: Family) -> Save | None:
    """The committed save of other nodes that ``family``'s lineage starts from (the epoch it
    resumed on another node count), None when it started on its own nodes or that save is
    gone."""
    oldest = family.lineage[-1] if family.lineage else None
    parent = None if oldest is None else oldest.parent
    if parent is None:
        return None
    return next((s for s in found.saves_at(parent[0]) if s.generation == parent[1]
                 and s.nodes != family.nodes), None)


def left_behind(store: CheckpointStore, own: Save, found: PrefixScan | None = None
                ) -> Save | None:
    """The newest save of another node set (with a layout) made in a later run than ``own``,
    the newest save of a job that resumes from it: a job changes its node count only while its
    nodes have saved nothing under the prefix, so scaling 4 -> 2 -> 4 takes the 4-node job back
    to its own newest epoch. None if there is none. Without ``found`` (a reading of the
    prefix), one listing of the run log answers when no later run exists; only then are the
    records read."""
    if found is None:
        if max(runs.listing(store.location).numbers, default=0) <= own.generation:
            return None
        found = scan(store)
    newer = [s for f in _with_layout(found.families.values())
             if f.nodes != own.nodes and (s := f.newest) is not None
             and s.generation > own.generation]
    return max(newer, key=lambda s: s.generation, default=None)


class LeftBehindWarning:
    """Warns when a job resumes from its own newest save although another node count saved
    later (:func:`left_behind`), once per such save: a manager keeps one."""

    def __init__(self) -> None:
        self._warned: str | None = None  # the save of another node count last warned of

    def check(self, store: CheckpointStore, own: Save | None,
              found: PrefixScan | None = None) -> None:
        if own is None:
            return
        other = left_behind(store, own, found)
        if other is None or other.save_id == self._warned:
            return
        self._warned = other.save_id
        logger.warning(
            "nodes %s resume from their own newest epoch %d, not from epoch %d that nodes %s "
            "saved later: a job changes its node count only while its own nodes have saved "
            "nothing under the prefix", sorted(own.nodes), own.epoch, other.epoch,
            sorted(other.nodes))


def require_save(found: PrefixScan, store: CheckpointStore, epoch: int,
                 nodes: Sequence[str] = ()) -> Save:
    """The save ``epoch`` means for ``nodes`` under ``store`` (:meth:`PrefixScan.save_at`),
    as ``materialize``, ``zarr_store`` and the command line take it.

    Raises:
        CheckpointNotFoundError: there is none. The message says why: the nodes each save of
            the epoch holds or, when it has no committed save, its unreadable records, its
            partial save or the committed epochs.
    """
    save = found.save_at(epoch, nodes)
    if save is not None:
        return save
    where, saves = store.location.display(), found.saves_at(epoch)
    if saves:
        together = " in one save" if len(nodes) > 1 else ""
        raise CheckpointNotFoundError(
            f"epoch {epoch} under {where!r} has no node(s) {list(nodes)}{together}; its "
            f"saves: {found.describe_saves(saves)}")
    raise CheckpointNotFoundError(f"epoch {epoch} is not committed under {where!r}; "
                                  f"{_not_committed(found, store, epoch)}")


def _not_committed(found: PrefixScan, store: CheckpointStore, epoch: int) -> str:
    """Why ``epoch`` has no committed save, for :func:`require_save`."""
    bad = [ref for ref, _ in found.unreadable if ref.epoch == epoch]
    if bad:
        return ("its commit record(s) " + ", ".join(repr(r.filename) for r in bad)
                + f" are unreadable (see `caffe2ckpt verify {store.location.url} --epoch "
                f"{epoch}`)")
    missing = sorted({n for p in found.partial if p.epoch == epoch for n in p.missing})
    if missing:
        return f"its save is partial: node(s) {', '.join(missing)} have no commit record"
    return epochs_summary(s.epoch for s in found.saves())


def _run_reader(store: CheckpointStore):
    """Reads run log entries once per store (entries are never edited)."""
    cache: dict[int, runs.Run | str | None] = {}

    def read(generation: int) -> runs.Run | str | None:
        if generation not in cache:
            try:
                cache[generation] = runs.read_run(store.location, generation)
            except CheckpointNotFoundError:
                cache[generation] = None
            except CheckpointCorruptedError as exc:
                logger.warning("%s", exc)
                cache[generation] = str(exc)
        return cache[generation]
    return read


def _read_or_warn(store: CheckpointStore):
    def read(ref: RecordRef) -> CommitRecord | str:
        record = store.read_or_reason(ref)
        if isinstance(record, str):
            logger.warning("epoch %d is not committed for node %r: %s", ref.epoch, ref.node,
                           record)
        return record
    return read


def family_history(store: CheckpointStore, nodes: Iterable[str]) -> History:
    """The history of the family ``nodes`` (one listing of records and one of the run log;
    records and entries are read lazily)."""
    run_log = runs.listing(store.location)
    return History(list_records(store.location), frozenset(nodes), _read_or_warn(store),
                   _run_reader(store), run_log.numbers, run_log.committed)


def newest_save(store: CheckpointStore, nodes: Iterable[str]) -> Save | None:
    """The newest save of the family's lineage (:meth:`History.newest`), in a few requests when
    the family's hint names it (:func:`_hinted`); else the records decide."""
    family = frozenset(nodes)
    hinted = _hinted(store, family)
    return hinted if hinted is not None else family_history(store, family).newest()


def _hinted(store: CheckpointStore, family: frozenset[str]) -> Save | None:
    """The save the family's hint names, if the hint holds: the run vouching for it is the
    family's newest run and is either the save's own run or one that started from that save
    (its run log entry says so), every node's record of the save is there, and no run as new
    as the save's has a record of a newer save (records decide; a hint only shortcuts)."""
    hint = store.read_hint(sorted(family))
    if hint is None:
        return None
    epoch, save_id, run = hint
    generation = save_generation(save_id)
    location = store.location
    if not generation or runs.fenced_by(location, run, family) is not None:
        return None
    if run != generation:
        try:
            entry = runs.read_run(location, run)
        except CheckpointError:
            return None
        if entry.parent != (epoch, generation) or frozenset(entry.nodes) != family:
            return None
    records = {}
    for node in family:
        try:
            records[node] = store.read_record(RecordRef(epoch=epoch, node=node, save_id=save_id))
        except CheckpointError:
            return None
    save = Save(epoch, save_id, records)
    if save.nodes != family or _newer_record(store, save):
        return None
    return save


def _newer_record(store: CheckpointStore, save: Save) -> bool:
    """Whether a node of ``save`` has a record of a later epoch, or of the same epoch made
    later, by ``save``'s run or a newer one: one listing from ``save``'s epoch on. Runs between
    the save's and the one vouching for it count too: a run overtaken in the instant between
    its fence check and its commit writes its record after the newer run vouched, and is the
    family's head until that run commits (a record of an older run is never newer)."""
    names = store.location.list_names_after(store.location.path(COMMITS_DIR),
                                            f"{save.epoch:012d}")  # records of that epoch on
    refs = (RecordRef.parse(name) for name in names)
    here = (save.epoch, save.generation, save.save_id)
    return any(ref is not None and ref.node in save.nodes and ref.generation >= save.generation
               and (ref.epoch, ref.generation, ref.save_id) > here for ref in refs)


def _read_all(store: CheckpointStore, refs: Sequence[RecordRef]) -> list[CommitRecord | str]:
    if len(refs) < 8:
        return [store.read_or_reason(r) for r in refs]
    return list(read_pool().map(store.read_or_reason, refs))


def scan(store: CheckpointStore, nodes: Iterable[str] | None = None) -> PrefixScan:
    """Read every commit record under ``store`` (one listing, one read per record) and sort the
    saves into each family's lineage and superseded saves, partial saves and unreadable records.
    With ``nodes``, only that family (saves of other nodes are ignored)."""
    location = store.location
    wanted = None if nodes is None else frozenset(nodes)
    run_log = runs.listing(location)
    generation = runs.newest_generation(location, run_log.numbers)
    refs = list_records(location)
    if wanted is not None:  # the saves involving the wanted nodes, with all of their nodes
        keys = {(r.epoch, r.save_id) for r in refs if r.node in wanted}
        refs = [r for r in refs if (r.epoch, r.save_id) in keys]
    read = dict(zip(refs, _read_all(store, refs)))
    by_save, unreadable = _sorted_records(read)
    families = {frozenset(r.nodes) | {r.node} for recs in by_save.values()
                for r in recs.values()} if wanted is None else {wanted}
    run_reader = _run_reader(store)
    found: dict[frozenset[str], Family] = {}
    for family_nodes in families:
        history = History(refs, family_nodes, read.__getitem__, run_reader, run_log.numbers,
                          run_log.committed)
        lineage = list(history.lineage())
        superseded = history.superseded(lineage)
        if lineage or superseded:
            found[family_nodes] = Family(family_nodes, lineage, superseded)
    referenced = frozenset(group for recs in by_save.values() for r in recs.values()
                           for group in r.closure)
    return PrefixScan(found, _partial_saves(by_save, found, wanted), unreadable, generation,
                      referenced)


def _sorted_records(read: dict[RecordRef, CommitRecord | str]
                    ) -> tuple[dict[tuple[int, str], dict[str, CommitRecord]],
                               list[tuple[RecordRef, str]]]:
    """The readable records by save (epoch, save id) and node, and the unreadable ones."""
    by_save: dict[tuple[int, str], dict[str, CommitRecord]] = {}
    unreadable: list[tuple[RecordRef, str]] = []
    for ref, record in read.items():
        if isinstance(record, str):
            unreadable.append((ref, record))
        else:
            by_save.setdefault((ref.epoch, ref.save_id), {})[ref.node] = record
    return by_save, unreadable


def _partial_saves(by_save: dict[tuple[int, str], dict[str, CommitRecord]],
                   families: dict[frozenset[str], Family],
                   wanted: frozenset[str] | None) -> list[PartialSave]:
    """Saves with readable records that are not committed (some node's record is missing)."""
    committed = {(s.epoch, s.save_id) for f in families.values() for s in f.saves()}
    partial = []
    for (epoch, save_id), records in sorted(by_save.items()):
        if (epoch, save_id) in committed:
            continue
        expected = set().union(*(r.nodes for r in records.values()))
        if wanted is not None and not expected & wanted:
            continue
        partial.append(PartialSave(epoch, save_id, sorted(records),
                                   sorted(expected - set(records)), records))
    return partial
