"""What is committed, and which committed saves make up the current history of a job.

This module is the one definition of "committed" that resume, retention, the CLI and the Prefect
artifacts share:

* A **save** is one ``(epoch, save_id)``: the nodes saved together for an epoch, each with its
  own commit record. It is **committed** when every node its records name has a readable record
  of it (a save with a missing or unreadable record is partial: it commits nothing, and a bad
  record uncommits only its own save). Whether the bytes are intact is a separate question,
  answered by reading them (digests and checksums), never by the records alone.
* A **run** (a :class:`~caffe2ckpt.JobRunner` training, a step manager saving) claims the prefix
  before its first save; its claim number is the **generation** in each of its save ids, and each
  of its records names the save it started from (``parent``: epoch and generation, or None for a
  fresh start).
* The **lineage** is the chain of runs that led to the newest run that committed anything: that
  run's saves, then the saves of the run it started from up to the epoch it started from, and so
  on. A committed save outside the lineage is **superseded**: a later run went back to an
  earlier epoch (a resume from an older epoch, or a fresh start) and committed from there. A
  superseded save is never a resume point and never outranks the lineage in retention, however
  high its epoch number.

Within a lineage epochs only grow with time, so "newest" there is simply the highest epoch.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Iterator
from dataclasses import dataclass, field

from caffe2ckpt.store.records import CommitRecord, RecordRef, save_generation

__all__ = ["History", "Save"]

Reader = Callable[[RecordRef], "CommitRecord | str"]  # a record, or why it cannot be read


@dataclass(frozen=True)
class Save:
    """One save of an epoch, with the records of every node it names (a committed save)."""

    epoch: int
    save_id: str
    records: dict[str, CommitRecord]

    @property
    def generation(self) -> int:
        return save_generation(self.save_id)

    @property
    def parent(self) -> tuple[int, int] | None:
        return self.records[min(self.records)].parent

    @property
    def nodes(self) -> frozenset[str]:
        """Every node saved together in this save."""
        return frozenset().union(*(r.nodes for r in self.records.values()), self.records)


@dataclass
class History:
    """The saves of one set of nodes under a prefix, found from a listing of its records.

    Args:
        refs: record files under the prefix (a listing; others' nodes may be among them).
        nodes: the job's nodes: only saves with a record for every one of them are considered.
        read: reads one record (or returns why it cannot), called lazily and at most once per
            record, so finding the newest resumable epoch reads only the records it needs.
    """

    refs: Iterable[RecordRef]
    nodes: Collection[str]
    read: Reader
    _saves: dict[tuple[int, str], dict[str, RecordRef]] = field(init=False)
    _checked: dict[tuple[int, str], Save | None] = field(init=False, default_factory=dict)
    _records: dict[RecordRef, CommitRecord | str] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        saves: dict[tuple[int, str], dict[str, RecordRef]] = {}
        for ref in self.refs:
            saves.setdefault((ref.epoch, ref.save_id), {})[ref.node] = ref
        wanted = set(self.nodes)
        self._saves = {key: refs for key, refs in saves.items() if wanted <= set(refs)}

    def _record(self, ref: RecordRef) -> CommitRecord | str:
        if ref not in self._records:
            self._records[ref] = self.read(ref)
        return self._records[ref]

    def committed(self, epoch: int, save_id: str) -> Save | None:
        """The save if it is committed (see the module docstring), else None."""
        key = (epoch, save_id)
        if key not in self._checked:
            self._checked[key] = self._check(key)
        return self._checked[key]

    def _check(self, key: tuple[int, str]) -> Save | None:
        refs = self._saves.get(key)
        if refs is None:
            return None
        records = {node: self._record(ref) for node, ref in refs.items()}
        if any(isinstance(r, str) for r in records.values()):
            return None
        save = Save(key[0], key[1], records)  # type: ignore[arg-type]
        return save if save.nodes <= set(refs) else None

    def saves_at(self, epoch: int) -> list[Save]:
        """The committed saves of ``epoch`` (normally one), newest generation first."""
        keys = sorted((k for k in self._saves if k[0] == epoch),
                      key=lambda k: -save_generation(k[1]))
        return [s for k in keys if (s := self.committed(*k)) is not None]

    def _by_generation(self) -> dict[int, list[tuple[int, str]]]:
        gens: dict[int, list[tuple[int, str]]] = {}
        for key in sorted(self._saves, reverse=True):  # newest epoch first
            gens.setdefault(save_generation(key[1]), []).append(key)
        return gens

    def _parent(self, keys: list[tuple[int, str]]) -> tuple[bool, tuple[int, int] | None]:
        """Whether a readable record of the run that wrote ``keys`` says where it started, and
        where: (epoch, generation), or None for a fresh start."""
        for key in keys:
            for ref in self._saves[key].values():
                record = self._record(ref)
                if not isinstance(record, str):
                    return True, record.parent
        return False, None

    def lineage(self) -> Iterator[Save]:
        """The committed saves of the current lineage, newest first (lazily read).

        A run on the chain of which no readable record is left (retention or a person deleted
        its saves, or its records are damaged) cannot say where it started; the walk then goes
        on with the newest older run that has a save at or below the epoch the chain came down
        to, so a gap never turns the older history into superseded saves.
        """
        gens = self._by_generation()
        generation = next((g for g in sorted(gens, reverse=True)
                           if any(self.committed(*k) is not None for k in gens[g])), None)
        limit: int | None = None
        while generation is not None:
            keys = gens.get(generation, [])
            for key in keys:
                if (limit is None or key[0] <= limit) and (save := self.committed(*key)):
                    yield save
            known, parent = self._parent(keys)
            if known and parent is None:  # a fresh start: nothing older belongs to it
                return
            if known and parent is not None and parent[1] < generation:
                limit, generation = parent
                continue
            if known:  # a parent that is not older (a crafted record): stop here
                return
            generation = max((g for g in gens if g < generation
                              and any(limit is None or k[0] <= limit for k in gens[g])),
                             default=None)

    def superseded(self, lineage: Collection[Save]) -> list[Save]:
        """Committed saves outside ``lineage`` (all of :meth:`lineage`), newest epoch first."""
        inside = {(s.epoch, s.save_id) for s in lineage}
        return [s for key in sorted(self._saves, reverse=True)
                if key not in inside and (s := self.committed(*key)) is not None]
