"""The run log: which runs wrote to a prefix, in what order, and where each one started.

A *run* is one writer's stretch of saves: a :class:`~caffe2ckpt.JobRunner` training, a manager
saving on its own, a :class:`~caffe2ckpt.StepCheckpointManager` saving. Before its first save a
run claims the prefix by creating its entry exclusively::

    _runs/<generation:012d>.json   {"format": 1, "generation": 7, "parent": [12, 6] | null,
                                    "nodes": ["trainer_0", "trainer_1"], "writer": {...},
                                    "created": 1764000000.0}

``parent`` is the committed save the run started from (epoch and generation; null for a fresh
start) and ``nodes`` its job family (the nodes it saves together). Entries are never edited or
deleted, so the history of runs outlives their records: a damaged or deleted record uncommits
only its own save (:mod:`caffe2ckpt.history.lineage`).

Numbers: a claim takes one more than the highest entry, so entries have no gaps and the newest
claim owns the prefix. On a prefix of storage model 2 (no ``_runs/`` yet) the first claim takes
one more than its highest ``_claims/`` number and record generation, so generations keep
growing across the upgrade.

Fencing: a run whose next number exists (``_runs/<generation + 1>``) has been overtaken; its
saves and removals refuse to go on (:func:`check_fence`: one existence check, no listing).
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from caffe2ckpt.errors import (
    CheckpointCorruptedError,
    CheckpointError,
    CheckpointFencedError,
    CheckpointNotFoundError,
    CheckpointWriteError,
)
from caffe2ckpt.fs import strictjson
from caffe2ckpt.fs.location import Location
from caffe2ckpt.naming import MAX_EPOCH, check_node_name
from caffe2ckpt.store.layout import (
    COMMITS_DIR,
    LEGACY_CLAIMS_DIR,
    MAX_GENERATION,
    RUNS_DIR,
    legacy_claim_number,
    parse_run_name,
    run_name,
    save_generation,
)

__all__ = ["Run", "check_fence", "claim", "fenced", "list_runs", "newest_generation",
           "read_run"]

logger = logging.getLogger(__name__)

_FORMAT = 1


@dataclass(frozen=True, kw_only=True)
class Run:
    """One entry of the run log."""

    generation: int
    parent: tuple[int, int] | None  # (epoch, generation) of the save it started from
    nodes: tuple[str, ...]  # its job family, sorted
    writer: dict[str, Any] = field(default_factory=dict)
    created: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"format": _FORMAT, "generation": self.generation,
                "parent": None if self.parent is None else list(self.parent),
                "nodes": list(self.nodes), "writer": self.writer, "created": self.created}

    @classmethod
    def from_dict(cls, data: dict[str, Any], generation: int) -> Run:
        """Parse and check an entry (ValueError, KeyError or TypeError if it is not valid)."""
        if data.get("format") != _FORMAT or data.get("generation") != generation:
            raise ValueError(f"not the entry of run {generation}")
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
                   writer=dict(data["writer"]), created=float(created))


def _path(location: Location, generation: int) -> str:
    return location.path(RUNS_DIR, run_name(generation))


def list_runs(location: Location) -> list[int]:
    """The generations in the run log, oldest first (one listing)."""
    names = location.list_names(location.path(RUNS_DIR))
    return sorted(g for g in map(parse_run_name, names) if g is not None)


def _legacy_floor(location: Location) -> int:
    """The highest generation storage model 2 used here: its claims and its records."""
    claims = (legacy_claim_number(n)
              for n in location.list_names(location.path(LEGACY_CLAIMS_DIR)))
    records = (save_generation(n.split(".")[-2]) for n in
               location.list_names(location.path(COMMITS_DIR)) if n.count(".") >= 3)
    return max((g for g in (*claims, *records) if g is not None), default=0)


def newest_generation(location: Location) -> int:
    """The generation of the newest run that claimed the prefix (0 if none ever did); the
    next claim takes the number after it."""
    runs = list_runs(location)
    return runs[-1] if runs else _legacy_floor(location)


def claim(location: Location, *, nodes: list[str] | tuple[str, ...],
          parent: tuple[int, int] | None, writer: dict[str, Any] | None = None) -> Run:
    """Start a run: create its entry with the next number. Older runs are fenced from now on.

    Raises:
        CheckpointWriteError: the prefix cannot be claimed (the highest number is taken, or an
            entry exists that listings do not show).
        OSError: the storage failed.
    """
    number = newest_generation(location) + 1
    for _ in range(100):  # bounded: a name that exists but is never listed must not spin
        if number > MAX_GENERATION:
            raise CheckpointWriteError(
                f"cannot claim checkpoint prefix {location.display()!r}: run "
                f"{location.display(RUNS_DIR)!r} has reached the highest number a run may have")
        run = Run(generation=number, parent=parent, nodes=tuple(sorted(nodes)),
                  writer=dict(writer or {}), created=time.time())
        data = json.dumps(run.to_dict(), sort_keys=True, default=str).encode()
        try:
            location.create_exclusive(_path(location, number), data)
            return run
        except FileExistsError:  # another run took that number first: take the next
            number += 1
    raise CheckpointWriteError(
        f"cannot claim checkpoint prefix {location.display()!r}: run entries up to {number} "
        f"exist under {location.display(RUNS_DIR)!r} but are not listed")


def read_run(location: Location, generation: int) -> Run:
    """The entry of run ``generation``.

    Raises:
        CheckpointNotFoundError: there is none.
        CheckpointCorruptedError: it is not a valid entry.
    """
    where = location.display(RUNS_DIR, run_name(generation))
    try:
        raw = location.read_bytes(_path(location, generation), limit=strictjson.MAX_BYTES)
    except CheckpointNotFoundError as exc:
        raise CheckpointNotFoundError(f"run log entry {where!r} does not exist") from exc
    try:
        return Run.from_dict(strictjson.loads(raw), generation)
    except (CheckpointError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CheckpointCorruptedError(f"run log entry {where!r} is unreadable: {exc}",
                                       blob=run_name(generation)) from exc


def fenced(location: Location, generation: int) -> bool:
    """Whether a run newer than ``generation`` has claimed the prefix."""
    return location.file_exists(_path(location, generation + 1))


def check_fence(location: Location, generation: int, doing: str) -> None:
    """Raise :class:`CheckpointFencedError` if a run newer than ``generation`` has claimed the
    prefix (``doing`` says what was refused, for the message)."""
    if not fenced(location, generation):
        return
    try:
        who = read_run(location, generation + 1).writer
    except CheckpointError:  # only shown: any damage is fine
        who = {}
    raise CheckpointFencedError(
        f"a newer run took over checkpoint prefix {location.display()!r} (run "
        f"{generation + 1}, writer {who}); run {generation} must not {doing} there")
