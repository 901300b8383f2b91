"""What is committed, and which committed saves make up the current history of a job: the one
definition that resume, retention, the step manager, the CLI and the Prefect table share.

* A **save** is one ``(epoch, save_id)``: the nodes saved together for an epoch, each with its
  own commit record. It is **committed** when every node its records name has a readable record
  of it (a save with a missing or unreadable record is partial: it commits nothing, and a bad
  record uncommits only its own save). Whether the bytes are intact is a separate question,
  answered by reading them, never by the records alone.
* A **family** is the set of nodes a job saves together; each family has its own history on a
  shared prefix. A save belongs to the family its records name.
* A **run** is one entry of the run log (:mod:`caffe2ckpt.store.commit.runs`): its generation (the
  generation in each of its save ids), its family and its **parent**, the committed save it
  started from (or a fresh start). Runs of storage model 2 have no entry: the records of their
  saves say where they started.
* The **lineage** of a family starts at its **head**, the newest run of the family that has
  committed a save (its committed mark in the run log, or a committed save of it, says so; a run
  whose entry is of format 1 counts from its claim): that run's committed saves, then those of
  the run it started from up to the epoch it started from, and so on back to a fresh start.
  Every run saves only above where it started, so along the lineage epochs grow with time and
  the **newest** save is the lineage's first (and its highest epoch). A run that commits nothing
  changes no history: going back supersedes only once the run commits.
* A committed save outside the lineage is **superseded**: a later run went back to an earlier
  epoch (or started fresh). A superseded save is never a resume point, never restored, never
  kept by retention; nothing brings it back.

The chain comes from the run log, which records are never needed for: a damaged, deleted or
missing record uncommits its own save and nothing else — it never revives a superseded save and
never makes current history superseded. Only for model-2 runs does the walk read their records'
``parent``; a model-2 run with no readable record left continues with the newest older run that
has a save at or below the epoch reached.

This module does no I/O of its own: it reads through the functions it is given.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Iterator
from dataclasses import dataclass, field

from caffe2ckpt.store.commit.runs import Run
from caffe2ckpt.store.format.paths import save_generation
from caffe2ckpt.store.format.records import CommitRecord, RecordRef

__all__ = ["History", "RecordReader", "RunReader", "Save"]

RecordReader = Callable[[RecordRef], "CommitRecord | str"]  # a record, or why it is unreadable
RunReader = Callable[[int], "Run | str | None"]  # an entry, why it is unreadable, or None


@dataclass(frozen=True)
class Save:
    """One committed save of an epoch, with the records of every node it names."""

    epoch: int
    save_id: str
    records: dict[str, CommitRecord]

    @property
    def generation(self) -> int:
        return save_generation(self.save_id)

    @property
    def nodes(self) -> frozenset[str]:
        """Every node saved together in this save (its family)."""
        return frozenset().union(*(r.nodes for r in self.records.values()), self.records)

    @property
    def first(self) -> CommitRecord:
        return self.records[min(self.records)]

    def closure(self) -> dict[str, str]:
        """Every group the save's records need (differential saves build on older groups),
        with the save id each belongs to."""
        out: dict[str, str] = {}
        for record in self.records.values():
            out.update(record.closure)
        return out

    @property
    def parent(self) -> tuple[int, int] | None:
        """Where its run started, as its records say (model-2 runs only; see the run log)."""
        return self.first.parent

    @property
    def metrics(self) -> dict[str, float]:
        """The epoch's metrics (every node of a save records the same ones)."""
        merged: dict[str, float] = {}
        for node in sorted(self.records):
            merged.update(self.records[node].metrics)
        return merged

    @property
    def nbytes(self) -> int:
        return sum(r.nbytes for r in self.records.values())

    @property
    def created(self) -> float:
        return max(r.created for r in self.records.values())

    @property
    def started(self) -> float:
        """When the save began (its earliest node's start; records of model 2: created)."""
        return min(r.started or r.created for r in self.records.values())

    @property
    def stop(self) -> bool:
        return any(r.stop for r in self.records.values())


@dataclass
class History:
    """The saves and runs of one family under a prefix, found from a listing of its records.

    Args:
        refs: record files under the prefix (a listing; other families' may be among them).
        nodes: the family: only saves of exactly these nodes (and runs of them) count.
        read: reads one record (or says why it cannot), called lazily and at most once per
            record, so finding the newest save reads only the records it needs.
        read_run: reads one run log entry (None: no entry, e.g. a model-2 run).
        runs: the generations in the run log.
        marked: the runs the run log marks as having committed a save.
    """

    refs: Iterable[RecordRef]
    nodes: Collection[str]
    read: RecordReader
    read_run: RunReader
    runs: Collection[int] = ()
    marked: Collection[int] = ()
    _saves: dict[tuple[int, str], dict[str, RecordRef]] = field(init=False)
    _checked: dict[tuple[int, str], Save | None] = field(init=False, default_factory=dict)
    _records: dict[RecordRef, CommitRecord | str] = field(init=False, default_factory=dict)
    _entries: dict[int, Run | str | None] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        saves: dict[tuple[int, str], dict[str, RecordRef]] = {}
        for ref in self.refs:
            saves.setdefault((ref.epoch, ref.save_id), {})[ref.node] = ref
        self.nodes = frozenset(self.nodes)
        self.runs, self.marked = frozenset(self.runs), frozenset(self.marked)
        # a save with a record for one of the family's nodes may be the family's; whether it
        # is (its records name exactly the family) is known once a record is read
        self._saves = {key: refs for key, refs in saves.items() if self.nodes & set(refs)}

    # -- reading, lazily and once --------------------------------------------------------------

    def record(self, ref: RecordRef) -> CommitRecord | str:
        if ref not in self._records:
            self._records[ref] = self.read(ref)
        return self._records[ref]

    def run(self, generation: int) -> Run | None:
        """The run log entry of ``generation`` if there is a readable one."""
        if generation not in self._entries:
            self._entries[generation] = (self.read_run(generation) if generation in self.runs
                                         else None)
        entry = self._entries[generation]
        return entry if isinstance(entry, Run) else None

    # -- committed -------------------------------------------------------------------------------

    def committed(self, epoch: int, save_id: str) -> Save | None:
        """The save if it is a committed save of this family (see the module docstring)."""
        key = (epoch, save_id)
        if key not in self._checked:
            self._checked[key] = self._check(key)
        return self._checked[key]

    def _check(self, key: tuple[int, str]) -> Save | None:
        refs = self._saves.get(key)
        if refs is None or set(refs) < self.nodes:
            return None
        records = {node: self.record(ref) for node, ref in refs.items()}
        if any(isinstance(r, str) for r in records.values()):
            return None
        save = Save(key[0], key[1], records)  # type: ignore[arg-type]
        return save if save.nodes == self.nodes == set(refs) else None

    def saves_at(self, epoch: int) -> list[Save]:
        """The committed saves of ``epoch``, newest generation first."""
        keys = sorted((k for k in self._saves if k[0] == epoch),
                      key=lambda k: -save_generation(k[1]))
        return [s for k in keys if (s := self.committed(*k)) is not None]

    def recorded_epochs(self) -> list[int]:
        """Epochs with a save that has a record file for exactly the family's nodes, committed
        or not (listing only)."""
        return sorted({k[0] for k, refs in self._saves.items() if self.nodes == set(refs)})

    def all_committed(self) -> list[Save]:
        """Every committed save of the family, newest epoch first."""
        return [s for key in sorted(self._saves, reverse=True)
                if (s := self.committed(*key)) is not None]

    # -- the lineage -----------------------------------------------------------------------------

    def _by_generation(self) -> dict[int, list[tuple[int, str]]]:
        gens: dict[int, list[tuple[int, str]]] = {}
        for key in sorted(self._saves, reverse=True):  # newest epoch first
            gens.setdefault(save_generation(key[1]), []).append(key)
        return gens

    def _took_over(self, generation: int, run: Run, gens: dict[int, list[tuple[int, str]]]
                   ) -> bool:
        """Whether run ``generation`` of this family has taken over its history (see the module
        docstring)."""
        return (run.supersedes_at_claim or generation in self.marked
                or any(self.committed(*k) is not None for k in gens.get(generation, ())))

    def head(self) -> int | None:
        """The generation of the family's newest run that took over its history: the newest
        entry of the run log for this family that did, or the newest run with a committed save
        (model 2, or an unreadable entry)."""
        gens = self._by_generation()
        newest = next((g for g in sorted(self.runs, reverse=True)
                       if (run := self.run(g)) is not None and set(run.nodes) == self.nodes
                       and self._took_over(g, run, gens)), None)
        for generation in sorted(gens, reverse=True):
            if newest is not None and generation <= newest:
                break
            if any(self.committed(*k) is not None for k in gens[generation]):
                return generation
        return newest

    def _parent(self, generation: int,
                keys: list[tuple[int, str]]) -> tuple[bool, tuple[int, int] | None]:
        """Whether it is known where run ``generation`` started, and where: (epoch,
        generation), or None for a fresh start. The run log says; for a run without a
        readable entry, its first readable record does."""
        run = self.run(generation)
        if run is not None:
            return True, run.parent
        for key in keys:
            for ref in self._saves[key].values():
                record = self.record(ref)
                if not isinstance(record, str):
                    return True, record.parent
        return False, None

    def lineage(self) -> Iterator[Save]:
        """The committed saves of the current lineage, newest first (read lazily)."""
        return self._walk(self.head())

    def _walk(self, generation: int | None, limit: int | None = None) -> Iterator[Save]:
        """The lineage from run ``generation`` (its committed saves up to epoch ``limit``),
        then those of the run it started from up to where it started, and so on (newest first,
        read lazily)."""
        gens = self._by_generation()
        while generation is not None:
            keys = gens.get(generation, [])
            epochs: set[int] = set()
            for key in keys:
                if ((limit is None or key[0] <= limit) and key[0] not in epochs
                        and (save := self.committed(*key))):
                    epochs.add(key[0])
                    yield save
            known, parent = self._parent(generation, keys)
            if known:
                if parent is None or parent[1] >= generation:  # fresh start, or crafted
                    return
                limit, generation = parent
                continue
            generation = max((g for g in gens if g < generation
                              and any(limit is None or k[0] <= limit for k in gens[g])),
                             default=None)

    def newest(self) -> Save | None:
        """The newest committed save of the lineage (the one a job resumes from)."""
        return next(self.lineage(), None)

    def left_behind(self, parent: tuple[int, int] | None) -> list[Save]:
        """The committed saves a run starting from ``parent`` (the save it resumed from, as
        (epoch, generation); None: a fresh start) supersedes once it commits, newest first: those
        of the lineage that the chain from ``parent`` (that save, the earlier ones of its run, and
        so on back) does not hold. Both are read newest first, in step, only until they meet
        (below a save they share they are the same), so a run that goes back a few epochs reads
        the records of those epochs, not the whole history. Also exact for a run resuming from
        a superseded save: what it leaves behind may lie below where it starts."""
        chain = iter(()) if parent is None else self._walk(parent[1], limit=parent[0])
        shared = next(chain, None)
        out = []
        for save in self.lineage():
            while shared is not None and shared.epoch > save.epoch:
                shared = next(chain, None)
            if shared is not None and (shared.epoch, shared.save_id) == (save.epoch,
                                                                         save.save_id):
                break
            out.append(save)
        return out

    def superseded(self, lineage: Collection[Save]) -> list[Save]:
        """Committed saves outside ``lineage`` (all of :meth:`lineage`), newest epoch first."""
        inside = {(s.epoch, s.save_id) for s in lineage}
        return [s for s in self.all_committed() if (s.epoch, s.save_id) not in inside]
