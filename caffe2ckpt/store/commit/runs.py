"""The run log: which runs wrote to a prefix, in what order, and where each one started.

A *run* is one writer's stretch of saves: a :class:`~caffe2ckpt.JobRunner` training, a manager
saving on its own, a :class:`~caffe2ckpt.StepCheckpointManager` saving. Before its first save a
run claims the prefix by creating its entry exclusively::

    _runs/<generation:012d>.json   {"format": 2, "generation": 7, "parent": [12, 6] | null,
                                    "nodes": ["trainer_0", "trainer_1"], "writer": {...},
                                    "created": 1764000000.0}
    _runs/<generation:012d>.committed.json   written once the run's first save is committed

``parent`` is the committed save the run started from (epoch and generation; null for a fresh
start) and ``nodes`` its job family (the nodes it saves together). Entries are never edited or
deleted, so the history of runs outlives their records: a damaged or deleted record uncommits
only its own save (:mod:`caffe2ckpt.history.lineage`). A run of format 2 takes over its family's
history only once it has committed a save (its mark, or a committed save of it, says so); an
entry of format 1 (written before) took over when it was claimed.

The log is checked, not trusted:

* **Numbers.** A claim takes one more than the newest *readable* entry (a stray, damaged or
  unreadable file never pushes the numbers), and the next free number if that one is taken.
  Before it claims, every gap below its number (entries deleted, or a crafted entry far above
  the others) is closed by a *gap mark* (``{"format": 2, "generation": n, "gap_to": m}``: the
  numbers from ``n`` up to ``m`` name no run), so every run's successor exists and no gap can
  hide a newer run from an older one.
* **Fencing** is per family: a run is overtaken once a newer run *of its own family* has claimed
  the prefix (:func:`fenced_by` walks the entries after it: other families' runs and gap marks
  are passed over, a damaged entry counts as a newer run: it may be one; an entry still being
  created, where creates are not atomic, is waited for: see :func:`read_entry`). Runs of
  different jobs on one prefix never fence each other. In the common case the walk is one
  request (the next number does not exist); valid entries are never edited, so each is read
  once per process.
* On a prefix of storage model 2 (no ``_runs/`` entry yet) the first claim takes one more than
  its highest ``_claims/`` number and record generation, so generations keep growing across the
  upgrade.
"""

from __future__ import annotations

import json
import logging
import time
import weakref
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from caffe2ckpt.errors import (
    CheckpointCorruptedError,
    CheckpointError,
    CheckpointFencedError,
    CheckpointNotFoundError,
    CheckpointWriteError,
    StorageCredentialsError,
)
from caffe2ckpt.fs.location import Location
from caffe2ckpt.naming import MAX_EPOCH, check_node_name
from caffe2ckpt.store.format.paths import (
    COMMITS_DIR,
    LEGACY_CLAIMS_DIR,
    MAX_GENERATION,
    RUNS_DIR,
    committed_name,
    legacy_claim_number,
    parse_committed_name,
    parse_run_name,
    run_name,
    save_generation,
)

__all__ = ["Gap", "Run", "RunListing", "check_fence", "claim", "fenced_by", "list_runs",
           "listing", "mark_committed", "newest_generation", "read_entry", "read_run"]

logger = logging.getLogger(__name__)

_FORMAT = 2
_CLAIM_TRIES = 100  # bounded: a name that exists but is never listed must not spin


@dataclass(frozen=True, kw_only=True)
class Run:
    """One run's entry in the run log."""

    generation: int
    parent: tuple[int, int] | None  # (epoch, generation) of the save it started from
    nodes: tuple[str, ...]  # its job family, sorted
    writer: dict[str, Any] = field(default_factory=dict)
    created: float = 0.0
    format: int = _FORMAT

    @property
    def supersedes_at_claim(self) -> bool:
        """Whether the run took over its family's history when it claimed (format 1), rather
        than once it committed a save."""
        return self.format == 1

    def to_dict(self) -> dict[str, Any]:
        return {"format": self.format, "generation": self.generation,
                "parent": None if self.parent is None else list(self.parent),
                "nodes": list(self.nodes), "writer": self.writer, "created": self.created}

    @classmethod
    def from_dict(cls, data: dict[str, Any], generation: int) -> Run:
        """Parse and check an entry (ValueError, KeyError or TypeError if it is not valid)."""
        parent = data["parent"]
        if parent is not None:
            if (not isinstance(parent, list) or len(parent) != 2
                    or not all(type(x) is int for x in parent)
                    or not 0 <= parent[0] <= MAX_EPOCH or not 0 <= parent[1] < generation):
                raise ValueError(f"bad parent {parent!r:.80}")
            parent = (parent[0], parent[1])
        nodes = data["nodes"]
        if not isinstance(nodes, list) or not nodes:
            raise ValueError("an entry names its nodes")
        created = data["created"]
        if type(created) not in (int, float) or not 0 <= created < 253402300800:
            raise ValueError(f"bad creation time {created!r:.40}")
        return cls(generation=generation, parent=parent,
                   nodes=tuple(sorted(check_node_name(n) for n in nodes)),
                   writer=dict(data["writer"]), created=float(created), format=data["format"])


@dataclass(frozen=True)
class Gap:
    """A gap mark: the numbers from ``generation`` up to ``next`` (excluded) name no run."""

    generation: int
    next: int


def _parse(data: Any, generation: int) -> Run | Gap:
    if not isinstance(data, dict) or data.get("format") not in (1, _FORMAT):
        raise ValueError("unknown entry format")
    if data.get("generation") != generation:
        raise ValueError(f"not the entry of run {generation}")
    if "gap_to" in data:
        end = data["gap_to"]
        if type(end) is not int or not generation < end <= MAX_GENERATION + 1:
            raise ValueError(f"bad gap end {end!r:.40}")
        return Gap(generation, end)
    return Run.from_dict(data, generation)


class RunListing(NamedTuple):
    """What one listing of ``_runs/`` shows: entry numbers (oldest first) and the runs marked
    committed."""

    numbers: tuple[int, ...]
    committed: frozenset[int]


# valid entries by location: they are never edited, so each is read once per process
_entries: weakref.WeakKeyDictionary[Location, dict[int, Run | Gap]] = weakref.WeakKeyDictionary()


def _path(location: Location, generation: int) -> str:
    return location.path(RUNS_DIR, run_name(generation))


def listing(location: Location) -> RunListing:
    """The run log's entries and committed marks (one listing)."""
    names = location.list_names(location.path(RUNS_DIR))
    numbers = sorted(g for g in map(parse_run_name, names) if g is not None)
    committed = frozenset(g for g in map(parse_committed_name, names) if g is not None)
    return RunListing(tuple(numbers), committed)


def list_runs(location: Location) -> list[int]:
    """The generations in the run log, oldest first (one listing)."""
    return list(listing(location).numbers)


def read_entry(location: Location, generation: int) -> Run | Gap:
    """Entry ``generation`` of the run log: a run or a gap mark.

    An entry being created where creates are not atomic (visible empty or cut short) is read
    once it is complete (:meth:`~caffe2ckpt.fs.location.Location.read_created_json`): it is a
    claim in progress, not damage.

    Raises:
        CheckpointNotFoundError: there is none.
        CheckpointCorruptedError: it is not a valid entry (garbage, not a regular file, too
            large, empty or cut short and not being created, ...).
    """
    cache = _entries.setdefault(location, {})
    if generation in cache:
        return cache[generation]
    where = location.display(RUNS_DIR, run_name(generation))
    try:
        entry = _parse(location.read_created_json(_path(location, generation)), generation)
    except CheckpointNotFoundError as exc:
        raise CheckpointNotFoundError(f"run log entry {where!r} does not exist") from exc
    except StorageCredentialsError:  # the store refused: not damage
        raise
    except (CheckpointError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CheckpointCorruptedError(f"run log entry {where!r} is unreadable: {exc}",
                                       blob=run_name(generation)) from exc
    cache[generation] = entry
    return entry


def read_run(location: Location, generation: int) -> Run:
    """The entry of run ``generation``.

    Raises:
        CheckpointNotFoundError: there is none (or the number is part of a gap).
        CheckpointCorruptedError: it is not a valid entry.
    """
    entry = read_entry(location, generation)
    if isinstance(entry, Gap):
        raise CheckpointNotFoundError(
            f"run log entry {location.display(RUNS_DIR, run_name(generation))!r} marks a gap "
            "in the run log, not a run")
    return entry


def _legacy_floor(location: Location) -> int:
    """The highest generation storage model 2 used here: its claims and its records."""
    claims = (legacy_claim_number(n)
              for n in location.list_names(location.path(LEGACY_CLAIMS_DIR)))
    records = (save_generation(n.split(".")[-2]) for n in
               location.list_names(location.path(COMMITS_DIR)) if n.count(".") >= 3)
    return max((g for g in (*claims, *records) if g is not None), default=0)


def newest_generation(location: Location, numbers: Sequence[int] | None = None) -> int:
    """The number of the newest readable entry of the run log (a run's generation, or the end
    of a gap), or with none, the newest generation storage model 2 used here (0 if none): the
    next claim takes the number after it. Unreadable entries are passed over (and reported)."""
    for number in reversed(list_runs(location) if numbers is None else numbers):
        try:
            entry = read_entry(location, number)
        except CheckpointNotFoundError:
            continue
        except CheckpointCorruptedError as exc:
            logger.warning("%s; numbering runs past it", exc)
            continue
        return entry.next - 1 if isinstance(entry, Gap) else number
    return _legacy_floor(location)


def _close_gaps(location: Location, numbers: Sequence[int], below: int) -> bool:
    """Write a gap mark at the start of every gap in the run log below ``below`` (see the
    module docstring). False if another writer created an entry where a mark was to go."""
    listed = [n for n in numbers if n < below]
    closed = True
    for low, high in zip(listed, [*listed[1:], below]):
        if high == low + 1:
            continue
        try:
            entry = read_entry(location, low)
        except CheckpointError:
            entry = None
        if isinstance(entry, Gap) and entry.next >= high:
            continue
        mark = {"format": _FORMAT, "generation": low + 1, "gap_to": high}
        try:
            location.create_exclusive(_path(location, low + 1), json.dumps(mark).encode())
            logger.warning("run log %s has no entries %d to %d (deleted, or an entry written "
                           "by something else): marked them as a gap",
                           location.display(RUNS_DIR), low + 1, high - 1)
        except FileExistsError:
            closed = False
    return closed


def claim(location: Location, *, nodes: Sequence[str],
          parent: tuple[int, int] | None, writer: dict[str, Any] | None = None) -> Run:
    """Start a run: create its entry with the next number. Older runs of the family ``nodes``
    are fenced from now on.

    Raises:
        CheckpointWriteError: the prefix cannot be claimed (no number is left, or entries exist
            that listings do not show).
        OSError: the storage failed.
    """
    for _ in range(10):  # a gap closed meanwhile by another claim: list again
        numbers = listing(location).numbers
        number = newest_generation(location, numbers) + 1
        if _close_gaps(location, numbers, number):
            break
    for _ in range(_CLAIM_TRIES):
        if number > MAX_GENERATION:
            raise CheckpointWriteError(
                f"cannot claim checkpoint prefix {location.display()!r}: run log "
                f"{location.display(RUNS_DIR)!r} has reached the highest number a run may have "
                f"({MAX_GENERATION}); an entry there may be a stray file")
        run = Run(generation=number, parent=parent, nodes=tuple(sorted(nodes)),
                  writer=dict(writer or {}), created=time.time())
        data = json.dumps(run.to_dict(), sort_keys=True, default=str).encode()
        try:
            location.create_exclusive(_path(location, number), data)
        except FileExistsError:  # another run (or a stray file) took that number: the next
            number += 1
            continue
        _entries.setdefault(location, {})[number] = run
        return run
    raise CheckpointWriteError(
        f"cannot claim checkpoint prefix {location.display()!r}: run entries up to {number} "
        f"exist under {location.display(RUNS_DIR)!r} but are not listed")


def fenced_by(location: Location, generation: int,
              nodes: Collection[str] | None = None) -> Run | str | None:
    """The newer run that overtook run ``generation`` of the family ``nodes`` (None: any
    family), why a damaged entry that may be one counts as such, or None if the run is not
    fenced."""
    family = None if nodes is None else frozenset(nodes)
    number = generation + 1
    known = _entries.setdefault(location, {})
    for _ in range(MAX_GENERATION):
        if number not in known and not location.file_exists(_path(location, number)):
            return None  # the common case: one existence check
        try:
            entry = read_entry(location, number)
        except CheckpointNotFoundError:
            return None
        except CheckpointCorruptedError as exc:
            return str(exc)
        if isinstance(entry, Gap):
            number = entry.next
        elif family is None or frozenset(entry.nodes) == family:
            return entry
        else:
            number += 1
    return None  # pragma: no cover - the numbers end before the loop does


def check_fence(location: Location, generation: int, doing: str,
                nodes: Collection[str] | None = None) -> None:
    """Raise :class:`CheckpointFencedError` if a newer run of the family ``nodes`` (None: of
    any family) has claimed the prefix; ``doing`` says what was refused, for the message."""
    newer = fenced_by(location, generation, nodes)
    if newer is None:
        return
    where = location.display()
    if isinstance(newer, str):
        raise CheckpointFencedError(
            f"{newer}; it may be a newer run, so run {generation} must not {doing} under "
            f"{where!r} (if it is a stray file, move it out of {location.display(RUNS_DIR)!r})")
    raise CheckpointFencedError(
        f"a newer run of nodes {list(newer.nodes)} took over checkpoint prefix {where!r} (run "
        f"{newer.generation}, writer {newer.writer}); run {generation} must not {doing} there",
        newer_writers=_writers_from(location, newer, nodes))


def _writers_from(location: Location, first: Run, nodes: Collection[str] | None
                  ) -> list[dict[str, Any]]:
    """The writers of ``first`` and of every later run of its family (an unreadable entry
    ends the list): who may have taken over, for a fenced run to tell apart."""
    out, run = [dict(first.writer)], first
    for _ in range(MAX_GENERATION):
        later = fenced_by(location, run.generation, nodes)
        if not isinstance(later, Run):
            break
        out.append(dict(later.writer))
        run = later
    return out


def mark_committed(location: Location, generation: int, epoch: int, save_id: str) -> None:
    """Record that run ``generation`` has committed a save (its first: ``epoch``,
    ``save_id``); from then on it has taken over its family's history even if every record of
    it is later damaged or deleted. Writing it twice is fine."""
    data = json.dumps({"generation": generation, "epoch": epoch, "save_id": save_id}).encode()
    try:
        location.create_exclusive(location.path(RUNS_DIR, committed_name(generation)), data)
    except FileExistsError:
        pass
