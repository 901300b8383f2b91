"""Which node sets of a resized job are old: the one definition ``caffe2ckpt gc
--drop-old-node-sets`` applies.

A job that changes its node count (docs/elastic.md) becomes a new family on the same prefix:
its first run's parent, in the run log, is a save of the family it resumed from. Families are
**related by descent**: G descends from F when a run of G started from a save of F. A **job**
is a set of families connected by descent (either way, transitively); jobs that never resumed
from one another (other node names, a fresh start) are separate jobs, never touched here.

Within one job:

* the **current** node set is the family of the job's newest committed save (its lineage's
  newest save of the highest generation): the node set the job runs on now;
* every other family of the job is an **old** node set, and all its committed saves (lineage
  and superseded) may go, but only while no run of another node set started after the current
  node set's newest save (a run of the job, by the run log, or by its saves for a run without
  an entry). Such a run has committed nothing (else its node set would be current): just
  started, or killed before its first save, it may be the job moving to another node set, or
  back to an old one, so until it has committed nothing of the job goes
  (:attr:`NodeSets.waiting` says why). A run log entry that cannot be read, newer than the
  current node set's newest save, may be such a run: nothing goes either.
* the runs of the old node sets all started before the current node set's newest save: their
  uncommitted saves are leftovers like any other (``gc`` sweeps them once older than its grace
  period), not saves a run may still be writing.

So 2 -> 3 -> 1 lets the 2- and the 3-node sets go once the 1-node set has committed, and
4 -> 2 -> 4 (the 4-node set resuming its own newest epoch, docs/elastic.md "Limits") lets the
2-node set go once the 4-node set's new run has committed; between the two, while the 2-node
set is newest, the 4-node set is the old one.

Descent is read from the run log (entries are never removed, so it holds after the saves that
linked two families are gone: a removal cut short is finished by the next run); runs of storage
model 2, which have no entry, from their saves' records. This module decides; removing is
``gc``'s (:mod:`caffe2ckpt.history.cleanup`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from caffe2ckpt.errors import CheckpointCorruptedError, CheckpointNotFoundError
from caffe2ckpt.fs.location import Location
from caffe2ckpt.history.scan import Family, PrefixScan
from caffe2ckpt.store.commit import runs

__all__ = ["NodeSets", "RunLog", "node_sets", "read_run_log"]

NodeSet = frozenset[str]
RunLog = Mapping[int, "runs.Run | str"]  # generation -> its entry, or why it is unreadable


def read_run_log(location: Location) -> dict[int, runs.Run | str]:
    """Every run of the run log by generation (gap marks left out), or why its entry cannot be
    read: one listing and one read per entry not read yet in this process."""
    out: dict[int, runs.Run | str] = {}
    for generation in runs.listing(location).numbers:
        try:
            out[generation] = runs.read_run(location, generation)
        except CheckpointNotFoundError:
            continue  # a gap mark, or gone since the listing
        except CheckpointCorruptedError as exc:
            out[generation] = str(exc)
    return out


@dataclass(frozen=True)
class NodeSets:
    """One job's node sets (see the module docstring)."""

    current: Family  # the node set of the job's newest committed save
    old: list[Family]  # the job's other families with committed saves, oldest first
    newest_run: int  # the generation of the job's newest run (orders jobs)
    waiting: str | None = None  # why the old node sets stay for now (None: they may go)
    old_runs: dict[int, NodeSet] = field(default_factory=dict)  # runs of other node sets

    @property
    def letting_go(self) -> bool:
        """Whether the job's old node sets may go now."""
        return self.waiting is None

    def why(self, family: Family) -> str:
        """Why a save of the old node set ``family`` goes, for ``gc``'s report."""
        newest = self.current.newest
        return (f"old node set {_names(family.nodes)} ({_count(family.nodes)}), replaced by "
                f"{_names(self.current.nodes)} ({_count(self.current.nodes)}), whose newest "
                f"epoch is {newest.epoch if newest else '?'}")


def _names(nodes: Iterable[str]) -> str:
    return ",".join(sorted(nodes))


def _count(nodes: NodeSet) -> str:
    return f"{len(nodes)} node{'s' if len(nodes) != 1 else ''}"


class _Descent:
    """The runs of a prefix (generation -> node set, and the generation each started from)
    and the jobs they make, by union-find over node sets."""

    def __init__(self, found: PrefixScan, run_log: RunLog) -> None:
        self.nodes: dict[int, NodeSet] = {}
        self.parent: dict[int, int] = {}
        self.unreadable = {g: why for g, why in run_log.items() if isinstance(why, str)}
        for generation, entry in run_log.items():
            if isinstance(entry, runs.Run):
                self._add(generation, frozenset(entry.nodes), entry.parent)
        for save in found.saves():  # runs without an entry (storage model 2)
            if save.generation and save.generation not in run_log:
                self._add(save.generation, save.nodes, save.parent)
        self._root: dict[NodeSet, NodeSet] = {}
        for family in [*found.families, *self.nodes.values()]:
            self._root.setdefault(family, family)
        for child, parent in self.parent.items():
            if parent in self.nodes:
                self._join(self.nodes[child], self.nodes[parent])

    def _add(self, generation: int, nodes: NodeSet, parent: tuple[int, int] | None) -> None:
        """Run ``generation`` of ``nodes`` started from a save of run ``parent[1]`` (None: a
        fresh start); the first word on a run counts."""
        self.nodes.setdefault(generation, nodes)
        if parent is not None:
            self.parent.setdefault(generation, parent[1])

    def find(self, nodes: NodeSet) -> NodeSet:
        while self._root[nodes] != nodes:
            self._root[nodes] = self._root[self._root[nodes]]
            nodes = self._root[nodes]
        return nodes

    def _join(self, a: NodeSet, b: NodeSet) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            self._root[max(ra, rb, key=sorted)] = min(ra, rb, key=sorted)

    def jobs(self, families: Iterable[Family]) -> list[list[Family]]:
        """The families grouped by job."""
        out: dict[NodeSet, list[Family]] = {}
        for family in families:
            out.setdefault(self.find(family.nodes), []).append(family)
        return list(out.values())

    def runs_of(self, job: NodeSet) -> dict[int, NodeSet]:
        """The runs of the job ``job`` (a root node set): generation -> node set."""
        return {g: n for g, n in self.nodes.items() if self.find(n) == job}


def node_sets(found: PrefixScan, run_log: RunLog) -> list[NodeSets]:
    """Each job with a committed save: its current node set, its old ones (none for a job
    that never changed its node count, or whose old node sets have no committed save left),
    and whether they may go now (see the module docstring). Oldest job first."""
    descent = _Descent(found, run_log)
    out = []
    for families in descent.jobs(found.families.values()):
        job = _job(descent, families)
        if job is not None:
            out.append(job)
    return sorted(out, key=lambda j: j.newest_run)


def _job(descent: _Descent, families: list[Family]) -> NodeSets | None:
    """The node sets of one job (None: none of its families has a lineage)."""
    with_lineage = [f for f in families if f.newest is not None]
    if not with_lineage:
        return None
    current = max(with_lineage, key=lambda f: f.newest.generation)  # type: ignore[union-attr]
    old = sorted((f for f in families if f is not current and f.saves()),
                 key=lambda f: max(s.generation for s in f.saves()))
    job_runs = descent.runs_of(descent.find(current.nodes))
    return NodeSets(current, old, max(job_runs, default=0),
                    _waiting(descent, current, job_runs),
                    {g: n for g, n in job_runs.items() if n != current.nodes})


def _waiting(descent: _Descent, current: Family, job_runs: dict[int, NodeSet]) -> str | None:
    """Why the job's old node sets must stay for now, or None."""
    head = current.newest.generation  # type: ignore[union-attr]
    newer = [g for g, nodes in job_runs.items() if g > head and nodes != current.nodes]
    if newer:
        run = max(newer)
        return (f"the job's run {run} (nodes {_names(job_runs[run])}) started after the newest "
                f"save of nodes {_names(current.nodes)} and has committed no save yet: it may "
                f"be moving the job to other nodes, so its node sets stay until it has")
    damaged = sorted(g for g in descent.unreadable if g > head)
    if damaged:
        return (f"run log entry {damaged[0]} is unreadable ({descent.unreadable[damaged[0]]}): "
                f"it may be a newer run of this job, so its node sets stay")
    return None
