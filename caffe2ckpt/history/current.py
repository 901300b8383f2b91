"""A writer's run on one family, and the family's lineage as that run sees it.

Both checkpoint managers and the step manager write through a :class:`CurrentRun`, so where a
save's run starts, which saves it continues, what "committed at epoch e" means to a loader and
what retention removes are decided here once:

* A run starts (:meth:`CurrentRun.start`) with the committed save it resumed from as its parent,
  or a fresh start; the run log entry is written before its first save
  (:mod:`caffe2ckpt.store.commit.runs`). A save joins the current run only above the run's parent
  and above the run's newest save; otherwise it starts a new run whose parent is the newest lineage
  save below it (:meth:`CurrentRun.run_for`): along a lineage epochs only grow, so "newest" is
  one thing everywhere. A new run takes over the family's history once it commits: until then
  what it would supersede stays current (:mod:`caffe2ckpt.history.lineage`).
* **Views list; decisions read.** A *view* of the lineage (:meth:`CurrentRun.family`) is kept
  while a run is held (then it follows the run's own commits and removals, so a retention pass
  costs the same with ten or ten thousand committed epochs) and, for a step manager, until it
  is told to read again (``steady=True``, as an Orbax ``CheckpointManager`` caches its steps).
  Views answer listings only. Every decision that writes, loads or deletes reads the prefix as
  it is now: where a new run starts (:meth:`CurrentRun.parent_below`), which save an epoch
  means to a loader (:meth:`CurrentRun.lineage_save`, :meth:`CurrentRun.save_of`), the newest
  save (through the family's hint, a few requests). A kept view may shortcut a load only once
  confirmed by the prefix: no newer run of the family since the view's head, and every record
  of the save still there (:meth:`CurrentRun._confirmed`). The one exception is a resume
  (:meth:`CurrentRun.resuming`): its questions are answered from one reading, so what is loaded
  and what the new run continues are one save.
* Retention is :func:`~caffe2ckpt.history.retention.plan_retention` on the view, carried out by
  :func:`~caffe2ckpt.history.cleanup.remove_saves`, fenced by the run's generation; before it
  deletes anything it checks that the saves it keeps still stand (every record is there), and
  reads the prefix again if one does not.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

from caffe2ckpt.errors import CheckpointError
from caffe2ckpt.history.cleanup import References, remove_saves
from caffe2ckpt.history.lineage import History, Save
from caffe2ckpt.history.retention import RetentionPlan, plan_retention
from caffe2ckpt.history.scan import Family, family_history, newest_save, scan
from caffe2ckpt.policy import StepManagerOptions
from caffe2ckpt.store.commit import runs
from caffe2ckpt.store.commit.protocol import CheckpointStore
from caffe2ckpt.store.format.records import CommitRecord
from caffe2ckpt.units import epochs_text

__all__ = ["CurrentRun"]

logger = logging.getLogger(__name__)

_UNSET: Any = object()


class CurrentRun:
    """A writer's run on the family ``nodes`` under ``store`` (see the module docstring)."""

    def __init__(self, store: CheckpointStore, nodes: Iterable[str], *,
                 steady: bool = False) -> None:
        self.store = store
        self.nodes = frozenset(nodes)
        self.run: runs.Run | None = None
        self._next_parent: Any = _UNSET  # the parent the next run starts from, once given
        self._last_epoch: int | None = None  # the newest epoch the current run saved
        self._last_save: str | None = None  # and the id of that save
        self._family: Family | None = None  # the lineage view, once read
        self._counted: int | None = None  # lineage saves after the last retention, if since
        self._reading: History | None = None  # the one reading of a resume
        self._newest_read: Any = _UNSET  # the newest save as a resume found it
        self._resolved: Save | None = None  # the last save a decision gave (for _vouch only)
        self._resuming = False  # inside resuming()
        self._leaves: list[Save] = []  # what the held run supersedes when it first commits
        self._marked = False  # the held run's first commit is marked in the run log
        self._steady = steady  # the view is kept until forget(), run or not

    # -- runs ------------------------------------------------------------------------------------

    def start(self, parent: tuple[int, int] | None, writer: dict[str, Any] | None = None
              ) -> runs.Run:
        """Start a new run from ``parent`` ((epoch, generation) of the committed save it
        resumed from; None: a fresh start, which supersedes the whole history once the run
        commits). If claiming fails the error is raised, no run is held, and the next save
        claims again with the same parent."""
        self.run, self._next_parent = None, parent
        if not self._resuming:  # a view read before this claim may miss others' saves
            self.forget()
        newest = self._newest_parent(parent)  # asked before the claim: a few requests
        run = self._claim(parent, writer)
        try:
            self._vouch(newest, run.generation)
        except OSError as exc:
            # that hint may still land later, naming the parent for a run that has saved since:
            # claim once more, which fences that run and so its late hint
            logger.debug("cannot write the hint of %s: %s", sorted(self.nodes), exc)
            run = self._claim(parent, writer)
            self._vouch(newest, run.generation)  # failing twice: the claim fails
        self.run, self._next_parent, self._last_epoch, self._last_save = run, _UNSET, None, None
        self._marked = False
        self._leaves = self._left_behind(parent) if newest is None and run.generation > 1 else []
        return run

    def _left_behind(self, parent: tuple[int, int] | None) -> list[Save]:
        """What a run from ``parent`` will supersede (:meth:`History.left_behind`), for the
        line its first commit logs: asked when the run starts, where a resume has read it
        already (a save lists and reads nothing), and only when the run does not continue the
        family's newest save and is not the prefix's first run."""
        try:
            return self._history().left_behind(parent)
        except Exception as exc:  # noqa: BLE001 - only a log line needs it
            logger.debug("cannot tell what a run from %s supersedes: %s", parent, exc)
            return []

    def _claim(self, parent: tuple[int, int] | None, writer: dict[str, Any] | None
               ) -> runs.Run:
        return runs.claim(self.store.location, nodes=sorted(self.nodes), parent=parent,
                          writer=writer)

    def _newest_parent(self, parent: tuple[int, int] | None) -> Save | None:
        """``parent``'s save if it is the family's newest save (the save this writer resolved
        last, confirmed as the newest), else None."""
        save = self._resolved
        if parent is None or save is None or (save.epoch, save.generation) != parent:
            return None
        newest = self.newest()
        same = newest is not None and (newest.epoch, newest.save_id) == (save.epoch, save.save_id)
        return save if same else None

    def _vouch(self, parent: Save | None, generation: int) -> None:
        """Until the new run ``generation`` saves, its parent stays the family's newest save:
        say so in the family's hint (on the run's behalf, so the next lookup stays O(1)), when
        the parent is that save. Only a hint: lookups check it, and ask the records when it is
        not there. A run that goes back vouches for nothing: until it commits, the newest save
        is still the one above."""
        if parent is not None:
            self.store.write_hint(sorted(self.nodes), parent.epoch, parent.save_id,
                                  run=generation)

    def continues(self, run: tuple[int, float], save: Save) -> str | None:
        """Why the work of ``run`` (generation, creation time of its entry) that no save holds
        (copies it left in worker memory) does not continue ``save``, the lineage's newest
        save, or None when it does: the run log's entry of that generation is that run's (a
        prefix made anew numbers its runs from 1 again), no run of any family has claimed the
        prefix since, and ``save`` is the run's own or the one it started from (a run that
        went back to an older epoch continues that one, and its work is not newer than
        ``save`` until it commits)."""
        location, (generation, created) = self.store.location, run
        try:
            entry = runs.read_run(location, generation)
        except CheckpointError as exc:
            return f"run {generation} is not readable in the run log: {exc}"
        if entry.created != created:
            return f"the run log's run {generation} is another run (the prefix was made anew)"
        newer = runs.fenced_by(location, generation)
        if isinstance(newer, runs.Run):
            return f"run {newer.generation} took over after run {generation}"
        if newer is not None:
            return newer
        if save.generation == generation:
            return None
        if frozenset(entry.nodes) != self.nodes or entry.parent != (save.epoch, save.generation):
            started = "a fresh start" if entry.parent is None else f"epoch {entry.parent[0]}"
            return (f"run {generation} (nodes {list(entry.nodes)}) started from {started}, not "
                    f"from epoch {save.epoch} of nodes {sorted(self.nodes)}")
        return None

    def end(self) -> None:
        """The run is over (a new one is about to choose where to resume): forget it and the
        lineage view, which other writers may change from now on; the next save claims
        again."""
        self.run, self._next_parent, self._last_epoch, self._last_save = None, _UNSET, None, None
        self._leaves = []
        if not self._resuming:
            self.forget()

    @contextmanager
    def resuming(self) -> Iterator[None]:
        """One resume: the current run ends, the prefix is read afresh, and what is read is
        kept until the end of the block (the view kept on only if the block started a run)."""
        self.end()
        self._resuming = True
        try:
            yield
        finally:
            self._resuming, self._reading, self._newest_read = False, None, _UNSET
            if self.run is None:
                self.forget()

    def _keeps(self) -> bool:
        """Whether the lineage view may be kept for the next listing (see the module
        docstring)."""
        return self.run is not None or self._resuming or self._steady

    def set_parent(self, parent: tuple[int, int] | None) -> None:
        """Let the next save start a new run from ``parent`` (a step manager restored it)."""
        self.end()
        self._next_parent = parent

    def run_for(self, epoch: int, writer: dict[str, Any] | None = None) -> runs.Run:
        """The run a save of ``epoch`` belongs to: the current one if the epoch is above its
        parent and its newest save, else a new run (claimed now)."""
        run = self.run
        if run is not None and (run.parent is None or epoch > run.parent[0]) and (
                self._last_epoch is None or epoch > self._last_epoch):
            return run
        parent = self._next_parent
        if parent is _UNSET or (parent is not None and parent[0] >= epoch):
            parent = self.parent_below(epoch)
        return self.start(parent, writer)

    def base_for(self, epoch: int) -> str | None:
        """The save a save of ``epoch`` in the held run may build on (differential saves): the
        run's newest committed save, if the save continues the run; None for a new run's
        first save."""
        run = self.run
        if run is None or self._last_epoch is None or epoch <= self._last_epoch:
            return None
        return self._last_save

    def supersedes_above(self) -> int | None:
        """While the held run has not committed yet: the epoch above which its first commit
        will supersede the lineage (-1: a fresh start supersedes it all); else None."""
        if self.run is None or self._last_epoch is not None:
            return None
        return -1 if self.run.parent is None else self.run.parent[0]

    def committed(self, save: Save) -> None:
        """``save`` was committed: by the current run, or (an explicit claim) by another one,
        after which the view is read again when needed. The run's first commit marks it in the
        run log: from then on it has taken over the family's history."""
        self._counted = None  # the next retention counts again
        if self.run is None or save.generation != self.run.generation:
            self.forget()
            return
        first = self._last_epoch is None
        if first or save.epoch > self._last_epoch:  # type: ignore[operator]
            self._last_save = save.save_id
        self._last_epoch = save.epoch if first else max(self._last_epoch, save.epoch)
        if first:
            self._mark(save)
            self._tell_superseded(save)
            self._branch(self.run.parent)
        if self._family is not None:
            self._family = self._family.with_newest(save)

    def _mark(self, save: Save) -> None:
        try:
            runs.mark_committed(self.store.location, save.generation, save.epoch, save.save_id)
            self._marked = True
        except OSError as exc:  # its committed save says the same while it stands
            logger.warning("cannot mark run %d of %s as committed: %s", save.generation,
                           self.store.location.display(), exc)

    def _tell_superseded(self, save: Save) -> None:
        """Say in one INFO line what the run's first commit ``save`` superseded (found when
        the run started: :meth:`_left_behind`)."""
        gone, self._leaves = self._leaves, []
        generations = sorted({s.generation for s in gone})
        if generations:
            logger.info("epoch %d committed under %r; it supersedes epochs %s of run%s %s (they "
                        "stay on disk until retention or gc removes them)", save.epoch,
                        self.store.location.display(), epochs_text(s.epoch for s in gone),
                        "s" if len(generations) > 1 else "", ", ".join(map(str, generations)))

    def _branch(self, parent: tuple[int, int] | None) -> None:
        """The view once a run from ``parent`` has committed: the lineage above it is
        superseded."""
        family = self._family
        if family is None:
            return
        if parent is not None and not any((s.epoch, s.generation) == parent
                                          for s in family.lineage):
            self._family = None  # started from a save the view does not hold: read again
            return
        limit = -1 if parent is None else parent[0]
        own = None if self.run is None else self.run.generation  # read after it committed
        above = [s for s in family.lineage if s.epoch > limit and s.generation != own]
        self._family = Family(family.nodes, [s for s in family.lineage if s not in above],
                              [*family.superseded, *above])

    # -- views (listing) -------------------------------------------------------------------------

    def family(self) -> Family:
        """The family's lineage and superseded saves, for listing (a kept view while a run is
        held or the view is steady; else read now)."""
        family = self._family if self._keeps() else None
        if family is None:
            found = scan(self.store, self.nodes).families.get(self.nodes)
            family = found or Family(self.nodes, [], [])
            if self._keeps():
                self._family = family
        return family

    def forget(self) -> None:
        """Read the prefix again when next asked (it may have changed outside this run)."""
        self._family = None

    def lineage(self) -> Iterable[Save]:
        """The lineage's committed saves, newest first (the kept view if there is one, else
        read lazily now)."""
        if self._family is not None and self._keeps():
            return self._family.lineage
        return self._history().lineage()

    # -- decisions (read now) --------------------------------------------------------------------

    def _history(self) -> History:
        """The family's history as it is now (within a resume: one reading for all of it)."""
        if self._resuming and self._reading is not None:
            return self._reading
        history = family_history(self.store, self.nodes)
        if self._resuming:
            self._reading = history
        return history

    def _resolve(self, save: Save | None) -> Save | None:
        self._resolved = save or self._resolved
        return save

    def newest(self) -> Save | None:
        """The newest save of the lineage as it is now (a few requests when the family's hint
        is good; within a resume, asked once)."""
        if not self._resuming:
            return self._resolve(newest_save(self.store, self.nodes))
        if self._newest_read is _UNSET:
            self._newest_read = newest_save(self.store, self.nodes)
        return self._resolve(self._newest_read)

    def lineage_save(self, epoch: int) -> Save | None:
        """The lineage's committed save of ``epoch`` as it is now (None: not committed, or
        superseded)."""
        if not self._resuming:
            confirmed = self._confirmed(epoch)
            if confirmed is not None:
                return self._resolve(confirmed)
        found = self.newest()
        if found is None:  # no lineage as it was just read: no save of any epoch
            return None
        if found.epoch != epoch:
            found = next((s for s in self._history().lineage() if s.epoch <= epoch), None)
            found = found if found is not None and found.epoch == epoch else None
        return self._resolve(found)

    def _confirmed(self, epoch: int) -> Save | None:
        """The kept view's save of ``epoch`` if the prefix still holds it as the lineage's: no
        run of the family newer than the view's head has claimed since (so no other run can
        have taken over or re-saved below it) and every record of the save is there (so no one
        deleted it). A few requests, whatever the history's length; None: ask the records."""
        family = self._family if self._keeps() else None
        head = None if family is None else family.newest
        save = None if family is None else family.lineage_save(epoch)
        if head is None or save is None:
            return None
        if runs.fenced_by(self.store.location, head.generation, self.nodes) is not None:
            return None
        return save if self._still_committed(save) else None

    def save_of(self, epoch: int) -> Save | None:
        """The committed save an explicitly chosen ``epoch`` means: the lineage's, else the
        newest superseded one of that epoch (a run that resumes from it on purpose makes its
        history current again); None when no save of ``epoch`` is committed."""
        save = self.lineage_save(epoch)
        if save is None:
            save = next(iter(self._history().saves_at(epoch)), None)
        return self._resolve(save)

    def parent_below(self, epoch: int) -> tuple[int, int] | None:
        """Where a run that saves ``epoch`` without having resumed continues from: the newest
        lineage save below ``epoch`` as it is now (None: a fresh start)."""
        save = self.newest()
        if save is None or save.epoch >= epoch:
            save = next((s for s in self._history().lineage() if s.epoch < epoch), None)
        save = self._resolve(save)
        return None if save is None else (save.epoch, save.generation)

    # -- removal ---------------------------------------------------------------------------------

    def _fence(self) -> tuple[int, frozenset[str] | None]:
        """The generation (and family) removals act for: this run's, or (a reader that never
        saved) the newest run's now, of any family."""
        if self.run is not None:
            return self.run.generation, self.nodes
        return runs.newest_generation(self.store.location), None

    def retain(self, options: StepManagerOptions | None,
               protect: Collection[int] = ()) -> list[Save]:
        """Apply ``options``' retention to the lineage; return the saves removed. Nothing is
        removed unless the saves the plan keeps and deletes still stand as the view holds them
        (read again once if not: :meth:`_stands`).

        Raises:
            CheckpointFencedError: a newer run claimed the prefix (this run removes nothing
                more).
        """
        if options is None or not options.has_retention:
            return []
        family = self.family()
        plan = plan_retention(family, options, protect)
        if plan.delete and not self._stands(family, plan):
            logger.info("a save retention keeps or deletes under %s changed (removed or damaged "
                        "since it was read): reading the prefix again",
                        self.store.location.display())
            self.forget()
            family = self.family()
            plan = plan_retention(family, options, protect)
            if plan.delete and not self._stands(family, plan):
                logger.warning("retention under %s deletes nothing this time: the saves it "
                               "would keep keep changing", self.store.location.display())
                return []
        generation, nodes = self._fence()
        removed = remove_saves(self.store, plan.delete, fence=generation, nodes=nodes,
                               doing="apply retention", references=self._references(family))
        left = family.without(removed)
        self._family = left if self._keeps() else None
        self._counted = len(left.lineage)
        return removed

    def known_count(self) -> int | None:
        """How many saves the lineage holds, if known without reading the prefix: from the
        kept view, or from the retention that just ran; else None."""
        if self._family is not None and self._keeps():
            return len(self._family.lineage)
        return self._counted

    def _stands(self, family: Family, plan: RetentionPlan) -> bool:
        """Whether the view ``plan`` was made on still holds where it matters (one small read
        per node and save): the lineage saves it keeps newer than the oldest lineage save it
        deletes (at least the newest save), and the saves it deletes, are still committed as
        the view holds them. A view may hold a save someone else removed or damaged since:
        deleting on a kept save's account could leave no checkpoint, and a save whose record
        was damaged is no longer this plan's to delete (a reading now would not list it: the
        damage stays for ``ls`` to report and ``gc`` to weigh)."""
        oldest = min((s.epoch for s in plan.delete if s in family.lineage), default=None)
        kept = [s for s, _ in plan.keep if oldest is not None and s.epoch > oldest]
        if family.newest is not None and family.newest not in kept:
            kept.append(family.newest)
        return all(self._still_committed(s) for s in [*kept, *plan.delete])

    def _still_committed(self, save: Save) -> bool:
        """Whether every record of ``save`` is still there and reads as it did (one small read
        per node)."""
        return all(_same(self.store.read_or_reason(r.ref), r) for r in save.records.values())

    def remove(self, saves: Iterable[Save]) -> list[Save]:
        """Remove ``saves`` (fenced like retention)."""
        generation, nodes = self._fence()
        references = self._references(self.family()) if self.run is not None else None
        removed = remove_saves(self.store, list(saves), fence=generation, nodes=nodes,
                               references=references)
        self._family = self.family().without(removed) if self._family is not None else None
        if any(s.save_id == self._last_save for s in removed):
            self._last_save = None  # the next save is a new run's or whole: nothing to build on
        return removed

    def _references(self, family: Family) -> References | None:
        """What the family's records need, from the view, once this run holds the family and
        has taken over its history (its first commit marked in the run log): from then on no
        other writer can add a current record that needs its groups (a differential save builds
        only on saves of its own run, and a record an overtaken run writes late is superseded).
        Else None: read again at each removal. Until this run commits, what it would supersede
        stays current, a late record of the run it overtook included, and that record may
        build on a save removed here."""
        if self.run is None or not self._marked:
            return None
        return References(r for s in family.saves() for r in s.records.values())


def _same(read: CommitRecord | str, record: CommitRecord) -> bool:
    """Whether ``read`` is ``record`` (compared as stored: a NaN metric equals itself). Equal
    fields settle it at once; only records that differ there (a NaN metric) are compared as
    stored, which costs a deep copy of each."""
    return isinstance(read, CommitRecord) and (read == record
                                               or read.to_dict() == record.to_dict())
