"""Removing things from a prefix: saves that retention (or ``gc``, or a step manager's
``delete``) decided on, and leftovers no record references.

Every removal names saves, never "whatever sits at epoch e", and is fenced:

* a save is removed by its records first (exact names: its epoch, nodes and save id), then by
  the groups those records name, each only after its ``zarr.json`` says it is that save's, file
  by file as its manifest lists them (no listing, no pattern), the ``zarr.json`` last. A crash
  in between leaves only unreferenced files, which ``gc`` finds later;
* before each save it removes, the remover checks that no run newer than the one it acts for
  has claimed the prefix (:func:`caffe2ckpt.store.runs.check_fence`): a fenced run removes
  nothing, and ``gc``, which acts for the newest run it listed, stops when another run starts;
* leftovers are found by reachability: a group no readable record names, a partial save, or
  a model-2 staged copy; each is removed only when it is older than a grace period counted
  from the save's start (its ``zarr.json``, the first object a save writes), after checking
  again that no record of it appeared meanwhile.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from caffe2ckpt.errors import CheckpointError, CheckpointNotFoundError
from caffe2ckpt.history.lineage import Save
from caffe2ckpt.history.scan import PrefixScan
from caffe2ckpt.store import runs
from caffe2ckpt.store.layout import (
    COMMITS_DIR,
    LEGACY_CLAIMS_DIR,
    LEGACY_STAGING_DIR,
    RUNS_DIR,
    parse_group_name,
)
from caffe2ckpt.store.manifest import Manifest
from caffe2ckpt.store.protocol import CheckpointStore
from caffe2ckpt.store.records import RecordRef, delete_record, record_path
from caffe2ckpt.store.zarrgroup import GROUP_FILE, parse_manifest

__all__ = ["Leftover", "find_leftovers", "is_checkpoint_prefix", "remove_leftovers",
           "remove_saves"]

logger = logging.getLogger(__name__)


def is_checkpoint_prefix(store: CheckpointStore) -> bool:
    """Whether caffe2ckpt ever wrote here (a commit record, a run, or a model-2 claim)."""
    location = store.location
    return any(location.exists(location.path(d))
               for d in (COMMITS_DIR, RUNS_DIR, LEGACY_CLAIMS_DIR))


def _identity(store: CheckpointStore, group: str) -> Manifest | None:
    """The manifest of the group at ``group`` (relative path), if its ``zarr.json`` reads as
    one: it names the save the group belongs to."""
    parsed = parse_group_name(group.rpartition("/")[2])
    if parsed is None:
        return None
    try:
        raw = store.location.read_bytes(f"{store.location.path(group)}/{GROUP_FILE}",
                                        limit=64 << 20)
        return parse_manifest(raw, group, node=parsed.node, epoch=parsed.epoch)
    except (CheckpointError, ValueError):
        return None


def _remove_group(store: CheckpointStore, group: str, save_id: str) -> bool:
    """Remove the group at ``group`` if it is save ``save_id``'s: exactly the files its
    manifest lists. A group of another save, or one that cannot say whose it is, stays (a
    leftover of a path of its own is removed whole by :func:`remove_leftovers`)."""
    manifest = _identity(store, group)
    if manifest is None or manifest.save_id != save_id:
        if store.location.exists(store.location.path(group)):
            logger.warning("left %s in place: it is not (or no longer says it is) save %s",
                           store.location.display(group), save_id)
        return False
    store.location.remove_files(store.location.path(group), manifest.files())
    return True


def remove_saves(store: CheckpointStore, saves: Iterable[Save], *, fence: int,
                 doing: str = "remove checkpoints") -> list[Save]:
    """Remove ``saves`` (records first, then their groups), each after checking that no run
    newer than ``fence`` (a generation) has claimed the prefix. Returns those removed.

    Raises:
        CheckpointFencedError: a newer run claimed the prefix; the saves not removed yet stay.
    """
    removed = []
    for save in saves:
        runs.check_fence(store.location, fence, f"{doing} (epoch {save.epoch}, save "
                         f"{save.save_id})")
        for record in save.records.values():
            delete_record(store.location, record.ref)
        for record in save.records.values():
            _remove_group(store, record.group, save.save_id)
        removed.append(save)
        logger.info("deleted epoch %d (save %s, nodes %s) under %s", save.epoch, save.save_id,
                    sorted(save.records), store.location.display())
    return removed


@dataclass(frozen=True)
class Leftover:
    """Something under a prefix that no commit record references."""

    kind: str  # "uncommitted save", "partial save", "unidentified data", "staged copy"
    path: str  # relative to the prefix (a partial save: its groups, comma-separated)
    age: float  # seconds since the save started (inf if the filesystem does not say)
    save_id: str | None = None
    records: tuple[RecordRef, ...] = ()  # the records of a partial save


def _age(store: CheckpointStore, path: str, now: float) -> float:
    """Seconds since anything under ``path`` was written (inf if the filesystem cannot say)."""
    fs = store.location.fs
    try:
        infos = fs.find(path, detail=True) or {path: fs.info(path)}
    except FileNotFoundError:
        return math.inf
    times = []
    for file in infos:
        try:
            stamp = store.location.modified(file)
        except CheckpointNotFoundError:
            continue
        if stamp is not None:
            times.append(stamp)
    return now - max(times) if times else math.inf


def _save_age(store: CheckpointStore, group: str, now: float) -> float:
    """Seconds since the save of ``group`` started: its ``zarr.json`` is its first object."""
    try:
        stamp = store.location.modified(f"{store.location.path(group)}/{GROUP_FILE}")
    except CheckpointNotFoundError:
        return _age(store, store.location.path(group), now)
    return math.inf if stamp is None else now - stamp


def find_leftovers(store: CheckpointStore, found: PrefixScan, *, min_age: float = 3600.0,
                   nodes: Iterable[str] | None = None) -> list[Leftover]:
    """What :func:`remove_leftovers` would remove: data no record references, older than
    ``min_age`` seconds. Only under a caffe2ckpt prefix (:func:`is_checkpoint_prefix`); a save
    one of whose records is unreadable is left for a person to inspect."""
    if not is_checkpoint_prefix(store):
        return []
    now, location = time.time(), store.location
    wanted = None if nodes is None else set(nodes)
    damaged = {ref.save_id for ref, _ in found.unreadable}
    partial_groups = {r.group for p in found.partial for r in p.records.values()}
    items: list[Leftover] = []
    for name in sorted(location.list_names(location.root)):
        parsed = parse_group_name(name)
        if (parsed is None or name in found.referenced or name in partial_groups
                or (wanted and parsed.node not in wanted)
                or not location.fs.isdir(location.path(name))):
            continue
        manifest = _identity(store, name)
        save_id = manifest.save_id if manifest is not None else parsed.save_id
        if save_id is not None and save_id in damaged:
            continue
        kind = "uncommitted save" if manifest is not None else "unidentified data"
        items.append(Leftover(kind, name, _save_age(store, name, now), save_id))
    for part in found.partial:
        if (wanted and not set(part.have) <= wanted) or part.save_id in damaged:
            continue
        items.append(Leftover("partial save",
                              ", ".join(part.records[n].group for n in part.have),
                              now - part.started, part.save_id,
                              tuple(r.ref for r in part.records.values())))
    for name in sorted(location.list_names(location.path(LEGACY_STAGING_DIR))):
        parsed = parse_group_name(name.rpartition(".")[0])
        if parsed is None or (wanted and parsed.node not in wanted):
            continue
        path = f"{LEGACY_STAGING_DIR}/{name}"
        items.append(Leftover("staged copy", path, _age(store, location.path(path), now)))
    return [item for item in items if item.age >= min_age]


def _recorded(store: CheckpointStore, group: str, save_id: str) -> bool:
    """Whether a record of the save ``save_id`` of ``group`` exists now (one check)."""
    parsed = parse_group_name(group)
    ref = RecordRef(epoch=parsed.epoch, node=parsed.node, save_id=save_id)  # type: ignore[union-attr]
    return store.location.file_exists(record_path(store.location, ref))


def remove_leftovers(store: CheckpointStore, leftovers: Sequence[Leftover], *,
                     fence: int) -> None:
    """Remove what :func:`find_leftovers` found, each after checking the fence (no run newer
    than ``fence`` claimed the prefix) and, for a save's group, that it still is the save's and
    that no record of it appeared meanwhile."""
    location = store.location
    for item in leftovers:
        runs.check_fence(location, fence, f"remove leftover {item.path}")
        if item.kind == "partial save":
            for ref in item.records:
                delete_record(location, ref)
            for group in item.path.split(", "):
                _remove_group(store, group, item.save_id)  # type: ignore[arg-type]
        elif item.kind == "uncommitted save":
            if _recorded(store, item.path, item.save_id):  # type: ignore[arg-type]
                logger.info("kept %s: it was committed meanwhile", location.display(item.path))
                continue
            if not _remove_group(store, item.path, item.save_id):  # type: ignore[arg-type]
                continue
        elif item.kind == "unidentified data" and _identity(store, item.path) is not None:
            continue  # it says whose it is now: a save started writing there meanwhile
        else:
            location.remove(location.path(item.path))
        logger.info("removed %s %s under %s", item.kind, item.path, location.display())
