"""Removing things from a prefix: saves that retention (or ``gc``, or a step manager's
``delete``) decided on, and leftovers no record references.

Every removal names saves, never "whatever sits at epoch e", and is fenced:

* a save is removed by its records first (exact names: its epoch, nodes and save id), then by
  the groups those records name that no other readable record needs (a differential save
  needs the groups it builds on), each only after its ``zarr.json`` says it is that save's, file
  by file as its manifest lists them (no listing, no pattern), the ``zarr.json`` last. At
  ``<node>.<epoch>`` the ``zarr.json`` is replaced by a tombstone instead
  (:mod:`caffe2ckpt.store.commit.tombstone`): that path is never freed, so no later save can be met
  there by a remover that checked the old one. A crash in between leaves only unreferenced
  files, which ``gc`` finds later;
* before each save it removes, the remover checks that no newer run has claimed the prefix
  (:func:`caffe2ckpt.store.commit.runs.check_fence`; a run's own removals: no newer run of its
  family; ``gc``: no run started since it listed): a fenced run removes nothing, and ``gc`` stops;
* leftovers are found by reachability: a group no readable record names, a partial save, a
  temporary file of an interrupted create, or a model-2 staged copy; each is removed only when
  it is older than a grace period counted from the save's start (its ``zarr.json``, the first
  object a save writes), after checking again that no record of it appeared meanwhile. A save of
  a run that no newer run of its family has overtaken is never a leftover, however old: that
  run may still be writing it (or be about to commit it).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass, replace

from caffe2ckpt.errors import CheckpointError, CheckpointNotFoundError
from caffe2ckpt.fs.location import Location
from caffe2ckpt.history.lineage import Save
from caffe2ckpt.history.scan import PrefixScan, scan
from caffe2ckpt.store.commit import retired, runs
from caffe2ckpt.store.commit.protocol import CheckpointStore
from caffe2ckpt.store.commit.tombstone import is_tombstone, tombstone
from caffe2ckpt.store.format.manifest import Manifest
from caffe2ckpt.store.format.paths import (
    COMMITS_DIR,
    HINTS_DIR,
    LEGACY_CLAIMS_DIR,
    LEGACY_STAGING_DIR,
    RETIRED_DIR,
    RUNS_DIR,
    parse_group_name,
    save_generation,
)
from caffe2ckpt.store.format.records import CommitRecord, RecordRef, delete_record, record_path
from caffe2ckpt.store.format.zarrgroup import GROUP_FILE, parse_manifest

__all__ = ["Leftover", "References", "find_leftovers", "is_checkpoint_prefix",
           "remove_leftovers", "remove_saves"]

logger = logging.getLogger(__name__)

TEMPORARY_PREFIX = ".tmp-"  # local exclusive creates and replacements write these first
_TEMPORARY_DIRS = ("", COMMITS_DIR, RUNS_DIR, HINTS_DIR, RETIRED_DIR)


def is_checkpoint_prefix(store: CheckpointStore) -> bool:
    """Whether caffe2ckpt ever wrote here (a commit record, a run, or a model-2 claim)."""
    location = store.location
    return any(location.exists(location.path(d))
               for d in (COMMITS_DIR, RUNS_DIR, LEGACY_CLAIMS_DIR))


TOMBSTONE = "tombstone"
STALE_NOTE = "stale retire note"  # a Leftover kind: see _stale_notes


def _identity(store: CheckpointStore, group: str) -> Manifest | str | None:
    """What the ``zarr.json`` of the group at ``group`` (relative path) says: the manifest of
    the save it belongs to, :data:`TOMBSTONE` (a removed save's path), or None (missing or
    unreadable)."""
    parsed = parse_group_name(group.rpartition("/")[2])
    if parsed is None:
        return None
    try:
        raw = store.location.read_bytes(f"{store.location.path(group)}/{GROUP_FILE}",
                                        limit=64 << 20)
    except (CheckpointError, ValueError):
        return None
    if is_tombstone(raw):
        return TOMBSTONE
    try:
        return parse_manifest(raw, group, node=parsed.node, epoch=parsed.epoch)
    except CheckpointError:
        return None


def _remove_group(store: CheckpointStore, group: str, save_id: str) -> bool:
    """Remove the group at ``group`` if it is save ``save_id``'s: exactly the files its
    manifest lists, and its ``zarr.json`` (at ``<node>.<epoch>``: replaced by a tombstone). A
    group of another save, or one that cannot say whose it is, stays."""
    manifest = _identity(store, group)
    location = store.location
    if not isinstance(manifest, Manifest) or manifest.save_id != save_id:
        if manifest != TOMBSTONE and location.exists(location.path(group)):
            logger.warning("left %s in place: it is not (or no longer says it is) save %s",
                           location.display(group), save_id)
        return False
    parsed = parse_group_name(group.rpartition("/")[2])
    if parsed is not None and parsed.save_id is None:  # <node>.<epoch>: never freed
        location.remove_files(location.path(group),
                              [f for f in manifest.files() if f != GROUP_FILE])
        location.replace_file(f"{location.path(group)}/{GROUP_FILE}",
                              tombstone(parsed.node, parsed.epoch, save_id))
        if location.is_local:  # a replacement cut short by an earlier, killed removal
            for leftover in _temporaries(store, group, 0.0):
                location.remove(location.path(leftover.path))
    else:
        location.remove_files(location.path(group), manifest.files())
    return True


class References:
    """Which groups readable records need (:attr:`CommitRecord.closure`), kept up to date as
    saves are removed: a group is deleted only once no record needs it."""

    def __init__(self, records: Iterable[CommitRecord]) -> None:
        self._needed: dict[str, set[RecordRef]] = {}
        for record in records:
            for group in record.closure:
                self._needed.setdefault(group, set()).add(record.ref)

    def drop(self, records: Iterable[CommitRecord]) -> None:
        """``records`` are gone."""
        for record in records:
            for group in record.closure:
                needed = self._needed.get(group)
                if needed is not None:
                    needed.discard(record.ref)
                    if not needed:
                        del self._needed[group]

    def __contains__(self, group: object) -> bool:
        return group in self._needed


def remove_saves(store: CheckpointStore, saves: Iterable[Save], *, fence: int,
                 nodes: Collection[str] | None = None, doing: str = "remove checkpoints",
                 references: References | None = None) -> list[Save]:
    """Remove ``saves``, each after checking that no run of the family ``nodes`` (None: of any
    family) newer than ``fence`` (a generation) has claimed the prefix: its records first,
    then each group of its closure that no readable record needs any longer (a group a kept
    differential save builds on stays until that save goes too). Returns those removed.

    ``references`` are the records' references as the caller knows them (the run that holds
    the family, or ``gc``, which keeps every family's newest save: nothing newer can need more
    than those saves need); without it they are read again after each save's records are
    deleted, so a differential save committed meanwhile on top of a removed save is seen (or
    finds its base gone and takes its record back:
    :meth:`~caffe2ckpt.store.commit.protocol.CheckpointStore.save_node`).

    Raises:
        CheckpointFencedError: a newer run claimed the prefix; the saves not removed yet stay.
    """
    removed = []
    for save in saves:
        runs.check_fence(store.location, fence, f"{doing} (epoch {save.epoch}, save "
                         f"{save.save_id})", nodes)
        _delete_records(store, list(save.records.values()))
        _remove_unneeded(store, save.closure(), list(save.records.values()), references, nodes)
        for record in save.records.values():
            retired.forget(store.location, record.ref)
        removed.append(save)
        logger.info("deleted epoch %d (save %s, nodes %s) under %s", save.epoch, save.save_id,
                    sorted(save.records), store.location.display())
    return removed


def _delete_records(store: CheckpointStore, records: list[CommitRecord]) -> None:
    """Note each record's groups (its retire note: a kill from here on leaves a removal to
    finish), then delete the records. If a step fails, the notes of the records still there
    are taken back before the error is raised: a record that stands is a save that stays, and
    no removal would ever finish (or remove) its note. A note that cannot be taken back either
    is a stale note, which ``gc`` reports and removes (:func:`find_leftovers`)."""
    location = store.location
    try:
        for record in records:
            retired.retire(location, record)
        for record in records:
            delete_record(location, record.ref)
    except BaseException:
        for record in records:
            _take_back(location, record)
        raise


def _take_back(location: Location, record: CommitRecord) -> None:
    """Delete ``record``'s retire note if the record is still there (best effort)."""
    try:
        if location.exists(record_path(location, record.ref)):
            retired.forget(location, record.ref)
    except (OSError, CheckpointError) as exc:
        logger.warning("could not take back the retire note of %s under %s (gc reports it "
                       "as a stale retire note): %s", record.ref.filename, location.display(),
                       exc)


def _stale_notes(store: CheckpointStore, now: float,
                 wanted: set[str] | None) -> Iterator[Leftover]:
    """Retire notes whose record still stands (:func:`retired.standing`): left by a removal
    whose record delete failed and whose note could not be taken back. Whatever the run, as
    leftovers once older than the grace period (a removal in progress holds its note for an
    instant); removing one removes only the note."""
    for ref in retired.standing(store.location):
        if wanted is None or ref.node in wanted:
            path = retired.note_path(ref)
            age = _age(store, store.location.path(path), now)
            if age is not None:
                yield Leftover(STALE_NOTE, path, age, ref.save_id, retired=ref)


def _forget_stale(location: Location, ref: RecordRef) -> bool:
    """Remove the stale retire note of the record ``ref`` while that record stands (if it is
    gone, the note is a removal to finish now: kept)."""
    if not location.exists(record_path(location, ref)):
        return False
    retired.forget(location, ref)
    return True


def _unfinished_removals(store: CheckpointStore, found: PrefixScan,
                         now: float) -> Iterator[Leftover]:
    """Removals cut short (:mod:`caffe2ckpt.store.commit.retired`): the groups their records named
    that no readable record needs are leftovers whatever their run (none is written again),
    once the newest of them is older than the grace period, like any leftover (a crafted note
    naming a save in progress cannot reach it in time)."""
    for ref, groups in retired.unfinished(store.location):
        left = sorted(g for g, i in groups.items()
                      if g not in found.referenced and not _has_record(store, g, i))
        age = min((a for g in left if (a := _save_age(store, g, now)) is not None),
                  default=math.inf)
        yield Leftover("unfinished removal", ", ".join(left), age, ref.save_id,
                       retired=ref, groups=tuple((g, groups[g]) for g in left))


def _remove_unneeded(store: CheckpointStore, groups: dict[str, str],
                     gone: Collection[CommitRecord], references: References | None,
                     nodes: Collection[str] | None) -> None:
    """Remove each of ``groups`` (path -> save id) that no readable record needs now that the
    records ``gone`` were deleted (``references``: as the caller knows them; None: read the
    records again). A group of another save (one ``gone`` built on) whose own record is still
    there, unreadable, stays too: like that save's, it is left for a person to inspect."""
    if references is None:
        needed: References | frozenset[str] = scan(store, nodes).referenced
    else:
        references.drop(gone)
        needed = references
    own = {r.group for r in gone}
    for group, save_id in groups.items():
        if group not in needed and (group in own or not _has_record(store, group, save_id)):
            _remove_group(store, group, save_id)


def _has_record(store: CheckpointStore, group: str, save_id: str) -> bool:
    """Whether a record file of the save ``save_id`` for the group ``group``'s node and epoch
    exists (readable or not)."""
    parsed = parse_group_name(group)
    if parsed is None:
        return False
    ref = RecordRef(epoch=parsed.epoch, node=parsed.node, save_id=save_id)
    return store.location.exists(record_path(store.location, ref))


@dataclass(frozen=True)
class Leftover:
    """Something under a prefix that no commit record references."""

    kind: str  # "uncommitted save", "partial save", "unidentified data", "temporary file",
    #            "staged copy", "unfinished removal", "stale retire note"
    path: str  # relative to the prefix (a partial save: its groups, comma-separated)
    age: float  # seconds since the save started (inf if the filesystem does not say)
    save_id: str | None = None
    records: tuple[CommitRecord, ...] = ()  # the records of a partial save
    live: bool = False  # a save of a run no newer run has overtaken: never removed
    retired: RecordRef | None = None  # an unfinished removal (or a stale note): its note
    groups: tuple[tuple[str, str], ...] = ()  # ... and the groups (path, save id) it removes

    @property
    def refs(self) -> tuple[RecordRef, ...]:
        return tuple(r.ref for r in self.records)


def _age(store: CheckpointStore, path: str, now: float) -> float | None:
    """Seconds since anything under ``path`` was written (inf if the filesystem cannot say);
    None when nothing is there any more (gone since it was listed: a create or removal that
    finished meanwhile, not a leftover)."""
    fs = store.location.fs
    try:
        infos = fs.find(path, detail=True) or {path: fs.info(path)}
    except FileNotFoundError:
        return None
    times, seen = [], False
    for file in infos:
        try:
            stamp = store.location.modified(file)
        except CheckpointNotFoundError:
            continue
        seen = True
        if stamp is not None:
            times.append(stamp)
    if not seen:
        return None
    return now - max(times) if times else math.inf


def _save_age(store: CheckpointStore, group: str, now: float) -> float | None:
    """Seconds since the save of ``group`` started: its ``zarr.json`` is its first object
    (None: the group is gone, see :func:`_age`)."""
    try:
        stamp = store.location.modified(f"{store.location.path(group)}/{GROUP_FILE}")
    except CheckpointNotFoundError:
        return _age(store, store.location.path(group), now)
    return math.inf if stamp is None else now - stamp


class _Runs:
    """Which runs may still be writing: those no newer run of their family has overtaken (or
    whose entry cannot be read). Asked once per generation."""

    def __init__(self, store: CheckpointStore) -> None:
        self.location = store.location
        self._live: dict[int, bool] = {}

    def live(self, save_id: str | None) -> bool:
        generation = save_generation(save_id or "")
        if not generation:
            return False  # a save of no run (format 1): only its age counts
        if generation not in self._live:
            self._live[generation] = self._ask(generation)
        return self._live[generation]

    def _ask(self, generation: int) -> bool:
        try:
            run = runs.read_run(self.location, generation)
        except CheckpointNotFoundError:
            return False  # a model-2 run: only its age counts
        except CheckpointError:
            return True  # cannot tell: left for a person to inspect
        return runs.fenced_by(self.location, generation, run.nodes) is None


def _group_leftovers(store: CheckpointStore, found: PrefixScan, now: float,
                     keep: set[str], wanted: set[str] | None,
                     retiring: set[str]) -> Iterator[Leftover]:
    """Groups no readable record names (``keep``: save ids left for a person, a record of
    theirs being unreadable, which keeps the groups their differential chains read too: those
    saves' own records may be gone; ``retiring``: groups of unfinished removals, listed as
    those)."""
    location = store.location
    unnamed = list(_unnamed_groups(store, found, wanted, retiring))
    chained = {group for _, m in unnamed if isinstance(m, Manifest) and m.save_id in keep
               for inherited in m.inherited.values() for group in inherited.chain}
    for name, manifest in unnamed:
        if manifest == TOMBSTONE:  # a removal's replacement of its zarr.json cut short
            if location.is_local:
                yield from _temporaries(store, name, now)
            continue
        save_id = (manifest.save_id if isinstance(manifest, Manifest)
                   else parse_group_name(name).save_id)  # type: ignore[union-attr]
        if save_id in keep or name in chained:
            continue
        kind = "uncommitted save" if isinstance(manifest, Manifest) else "unidentified data"
        age = _save_age(store, name, now)
        if age is not None:
            yield Leftover(kind, name, age, save_id)


def _unnamed_groups(store: CheckpointStore, found: PrefixScan, wanted: set[str] | None,
                    retiring: set[str]) -> Iterator[tuple[str, Manifest | str | None]]:
    """The group directories no readable record names (of the nodes ``wanted``, and not being
    removed: ``retiring``), each with what its ``zarr.json`` says (:func:`_identity`)."""
    location = store.location
    partial_groups = {r.group for p in found.partial for r in p.records.values()}
    for name in sorted(location.list_names(location.root)):
        parsed = parse_group_name(name)
        if (parsed is None or name in found.referenced or name in partial_groups
                or name in retiring
                or (wanted and parsed.node not in wanted)
                or not location.fs.isdir(location.path(name))):
            continue
        yield name, _identity(store, name)


def _partial_leftovers(found: PrefixScan, now: float, keep: set[str],
                       wanted: set[str] | None) -> Iterator[Leftover]:
    for part in found.partial:
        if (wanted and not set(part.have) <= wanted) or part.save_id in keep:
            continue
        yield Leftover("partial save", ", ".join(part.records[n].group for n in part.have),
                       now - part.started, part.save_id, tuple(part.records.values()))


def _temporary_leftovers(store: CheckpointStore, now: float) -> Iterator[Leftover]:
    """Temporary files of exclusive creates and replacements that were interrupted."""
    for directory in _TEMPORARY_DIRS:
        yield from _temporaries(store, directory, now)


def _temporaries(store: CheckpointStore, directory: str, now: float) -> Iterator[Leftover]:
    """The temporary files in ``directory`` (relative to the prefix; "" for the prefix)."""
    location = store.location
    for name in location.list_names(location.path(directory) if directory else location.root):
        if name.startswith(TEMPORARY_PREFIX):
            path = f"{directory}/{name}" if directory else name
            age = _age(store, location.path(path), now)
            if age is not None:
                yield Leftover("temporary file", path, age)


def _staged_leftovers(store: CheckpointStore, now: float,
                      wanted: set[str] | None) -> Iterator[Leftover]:
    location = store.location
    for name in sorted(location.list_names(location.path(LEGACY_STAGING_DIR))):
        parsed = parse_group_name(name.rpartition(".")[0])
        if parsed is None or (wanted and parsed.node not in wanted):
            continue
        path = f"{LEGACY_STAGING_DIR}/{name}"
        age = _age(store, location.path(path), now)
        if age is not None:
            yield Leftover("staged copy", path, age)


def find_leftovers(store: CheckpointStore, found: PrefixScan, *, min_age: float = 3600.0,
                   nodes: Iterable[str] | None = None, live: bool = False) -> list[Leftover]:
    """What :func:`remove_leftovers` would remove: data no record references, older than
    ``min_age`` seconds. Only under a caffe2ckpt prefix (:func:`is_checkpoint_prefix`). Left
    alone: a save one of whose records is unreadable (for a person to inspect, with the older
    groups a differential save of it reads), and every save of a run no newer run of its
    family has overtaken (it may still be writing): with ``live`` those are listed too, marked
    ``live`` (``ls`` shows them; nothing removes them). A removal that a kill cut short (its
    retire note: :mod:`caffe2ckpt.store.commit.retired`) is finished whatever the run."""
    if not is_checkpoint_prefix(store):
        return []
    now = time.time()
    wanted = None if nodes is None else set(nodes)
    damaged = {ref.save_id for ref, _ in found.unreadable}
    unfinished = [item for item in _unfinished_removals(store, found, now)
                  if wanted is None or item.retired.node in wanted]  # type: ignore[union-attr]
    retiring = {group for item in unfinished for group, _ in item.groups}
    unfinished = [item for item in (*unfinished, *_stale_notes(store, now, wanted))
                  if item.age >= min_age]
    items = [*_group_leftovers(store, found, now, damaged, wanted, retiring),
             *_partial_leftovers(found, now, damaged, wanted),
             *(_temporary_leftovers(store, now) if wanted is None else ()),
             *_staged_leftovers(store, now, wanted)]
    runs_now = _Runs(store)
    items = [replace(item, live=True) if runs_now.live(item.save_id) else item
             for item in items if item.age >= min_age]
    items += unfinished  # a removal's notes and groups are never written again: never live
    return [item for item in items if live or not item.live]


def _recorded(store: CheckpointStore, group: str, save_id: str) -> bool:
    """Whether a record of the save ``save_id`` naming the group at ``group`` exists now (a
    record of that save naming another path does not reference this one)."""
    parsed = parse_group_name(group)
    ref = RecordRef(epoch=parsed.epoch, node=parsed.node, save_id=save_id)  # type: ignore[union-attr]
    try:
        return store.read_record(ref).group == group
    except CheckpointNotFoundError:
        return False
    except CheckpointError:
        return True  # unreadable: it may name this group; left for a person to inspect


def _remove_leftover(store: CheckpointStore, item: Leftover,
                     references: References | None) -> bool:
    location = store.location
    if item.kind == STALE_NOTE:
        return _forget_stale(location, item.retired)  # type: ignore[arg-type]
    if item.retired is not None:  # finish the removal: its groups, then its note
        for group, save_id in item.groups:
            _remove_group(store, group, save_id)
        retired.forget(location, item.retired)
        return True
    if item.kind == "partial save":
        for ref in item.refs:
            delete_record(location, ref)
        # its groups, and those it built on, each unless a record that stays needs it
        groups = dict.fromkeys(item.path.split(", "), item.save_id)
        for record in item.records:
            groups.update(record.closure)
        _remove_unneeded(store, groups, item.records, references, None)
        return True
    if item.kind == "uncommitted save":
        if _recorded(store, item.path, item.save_id):  # type: ignore[arg-type]
            logger.info("kept %s: it was committed meanwhile", location.display(item.path))
            return False
        return _remove_group(store, item.path, item.save_id)  # type: ignore[arg-type]
    if item.kind == "unidentified data" and _identity(store, item.path) is not None:
        return False  # it says whose it is now: a save started writing there meanwhile
    location.remove(location.path(item.path))
    return True


def remove_leftovers(store: CheckpointStore, leftovers: Sequence[Leftover], *,
                     fence: int, references: References | None = None) -> list[Leftover]:
    """Remove what :func:`find_leftovers` found, each after checking the fence (no run newer
    than ``fence`` claimed the prefix) and, for a save's group, that it still is the save's and
    that no record of it appeared meanwhile; a partial save's groups only once no readable
    record needs them (``references`` as :func:`remove_saves` takes them). Returns the
    leftovers removed.

    Raises:
        CheckpointFencedError: a run started; the leftovers not removed yet stay.
    """
    removed = []
    for item in leftovers:
        runs.check_fence(store.location, fence, f"remove leftover {item.path}")
        if _remove_leftover(store, item, references):
            removed.append(item)
            logger.info("removed %s %s under %s", item.kind, item.path,
                        store.location.display())
    return removed
