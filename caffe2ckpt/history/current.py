"""A writer's run on one family, and the family's lineage as that run sees it.

Both checkpoint managers and the step manager write through a :class:`CurrentRun`, so where a
save's run starts, which saves it continues, what "committed at epoch e" means to a loader and
what retention removes are decided here once:

* A run starts (:meth:`CurrentRun.start`) with the committed save it resumed from as its parent,
  or a fresh start; the run log entry is written before its first save
  (:mod:`caffe2ckpt.store.runs`). A save joins the current run only above the run's parent and
  above the run's newest save; otherwise it starts a new run whose parent is the newest lineage
  save below it (:meth:`CurrentRun.run_for`): along a lineage epochs only grow, so "newest" is
  one thing everywhere.
* While a run is held, the lineage view is read once (:func:`caffe2ckpt.history.scan.scan`)
  when something needs it, then follows the run's own commits, branches and removals: while the
  run owns the head nobody else can add to the lineage (a newer run would fence it), so a save
  or a retention pass costs the same with ten or ten thousand committed epochs. Without a run
  (before the first claim, after :meth:`CurrentRun.end`) nothing read is kept from one call to
  the next: any writer may change the prefix meanwhile, and the family's hint keeps the common
  lookups at a few requests. The exceptions: a resume (:meth:`CurrentRun.resuming`), whose
  questions (which save an epoch means, whether it is on the lineage, the run's parent) are
  answered from one reading, so what is loaded and what the new run continues are one save;
  and a step manager's view (``steady=True``), kept until it is told to read again, as an
  Orbax ``CheckpointManager`` caches its steps until ``reload()``. A view read before a claim
  still decides safely after it: the new run's lineage is its parent's ancestry, which never
  changes, and what the view held as superseded stays superseded.
* Retention is :func:`~caffe2ckpt.history.retention.plan_retention` on that view, carried out by
  :func:`~caffe2ckpt.history.cleanup.remove_saves`, fenced by the run's generation.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

from caffe2ckpt.history.cleanup import remove_saves
from caffe2ckpt.history.lineage import Save
from caffe2ckpt.history.retention import plan_retention
from caffe2ckpt.history.scan import Family, family_history, newest_save, scan
from caffe2ckpt.policy import StepManagerOptions
from caffe2ckpt.store import runs
from caffe2ckpt.store.protocol import CheckpointStore

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
        self._family: Family | None = None  # the lineage view, once read
        self._looked_up: dict[int, Save | None] = {}  # lineage saves by epoch, while held
        self._resolved: Save | None = None  # the last save a lookup gave (for _vouch only)
        self._resuming = False  # inside resuming(): what is read is kept, run or not
        self._steady = steady  # what is read is kept until forget(), run or not

    # -- runs ------------------------------------------------------------------------------------

    def start(self, parent: tuple[int, int] | None, writer: dict[str, Any] | None = None
              ) -> runs.Run:
        """Start a new run from ``parent`` ((epoch, generation) of the committed save it
        resumed from; None: a fresh start, which supersedes the whole history). If claiming
        fails the error is raised, no run is held, and the next save claims again with the
        same parent."""
        self.run, self._next_parent = None, parent
        run = self._claim(parent, writer)
        try:
            self._vouch(parent, run.generation)
        except OSError as exc:
            # that hint may still land later, naming the parent for a run that has saved since:
            # claim once more, which fences that run and so its late hint
            logger.debug("cannot write the hint of %s: %s", sorted(self.nodes), exc)
            run = self._claim(parent, writer)
            self._vouch(parent, run.generation)  # failing twice: the claim fails
        self.run, self._next_parent, self._last_epoch = run, _UNSET, None
        self._branch(parent)
        return run

    def _claim(self, parent: tuple[int, int] | None, writer: dict[str, Any] | None
               ) -> runs.Run:
        return runs.claim(self.store.location, nodes=sorted(self.nodes), parent=parent,
                          writer=writer)

    def _vouch(self, parent: tuple[int, int] | None, generation: int) -> None:
        """Until the new run ``generation`` saves, its parent is the family's newest save:
        say so in the family's hint (on the run's behalf, so the next lookup stays O(1)), when
        this writer knows that save's id. Only a hint: lookups check it, and ask the records
        when it is not there."""
        known = [self._resolved, *(self._family.saves() if self._family else ())]
        save = next((s for s in known if s is not None and (s.epoch, s.generation) == parent),
                    None)
        if save is not None:
            self.store.write_hint(sorted(self.nodes), save.epoch, save.save_id, run=generation)

    def end(self) -> None:
        """The run is over (a new one is about to choose where to resume): forget it and the
        lineage view, which other writers may change from now on; the next save claims
        again."""
        self.run, self._next_parent, self._last_epoch = None, _UNSET, None
        if not self._resuming:
            self.forget()

    @contextmanager
    def resuming(self) -> Iterator[None]:
        """One resume: the current run ends, the prefix is read afresh, and what is read is
        kept until the end of the block (then kept on only if the block started a run)."""
        self.end()
        self._resuming = True
        try:
            yield
        finally:
            self._resuming = False
            if self.run is None:
                self.forget()

    def _keeps(self) -> bool:
        """Whether what is read now may be kept for the next question (see the module
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

    def parent_below(self, epoch: int) -> tuple[int, int] | None:
        """Where a run that saves ``epoch`` without having resumed continues from: the newest
        lineage save below ``epoch`` (None: a fresh start)."""
        save = next((s for s in self.lineage() if s.epoch < epoch), None)
        return None if save is None else (save.epoch, save.generation)

    def _branch(self, parent: tuple[int, int] | None) -> None:
        """The view after a run started from ``parent``: the lineage above it is superseded."""
        self._looked_up = {}
        if self._family is None:
            return
        family = self._family
        if parent is not None and not any((s.epoch, s.generation) == parent
                                          for s in family.lineage):
            self._family = None  # started from a save the view does not hold: read again
            return
        limit = -1 if parent is None else parent[0]
        self._family = Family(family.nodes, [s for s in family.lineage if s.epoch <= limit],
                              [*family.superseded, *(s for s in family.lineage if s.epoch > limit)])

    def committed(self, save: Save) -> None:
        """``save`` was committed: by the current run, or (an explicit claim) by another one,
        after which the view is read again when needed."""
        if self.run is None or save.generation != self.run.generation:
            self.forget()
            return
        self._last_epoch = save.epoch
        self._looked_up[save.epoch] = save
        if self._family is not None:
            self._family = self._family.with_newest(save)

    # -- the lineage -----------------------------------------------------------------------------

    def family(self) -> Family:
        """The family's lineage and superseded saves (while a run is held: read once, then
        kept up to date; else read now)."""
        family = self._family if self._keeps() else None
        if family is None:
            found = scan(self.store, self.nodes).families.get(self.nodes)
            family = found or Family(self.nodes, [], [])
            if self._keeps():
                self._family = family
        return family

    def forget(self) -> None:
        """Read the prefix again when next asked (it may have changed outside this run)."""
        self._family, self._looked_up = None, {}

    def _held(self) -> Family | None:
        """The lineage view, if one is held (while a run is, or in a resume: see the module
        docstring)."""
        if not self._keeps():
            self.forget()
        return self._family

    def lineage(self) -> Iterable[Save]:
        """The lineage's committed saves, newest first (read lazily when no view is held)."""
        family = self._held()
        if family is not None:
            return family.lineage
        return family_history(self.store, self.nodes).lineage()

    def newest(self) -> Save | None:
        """The newest save of the lineage (a few requests when the family's hint is good)."""
        family = self._held()
        save = family.newest if family is not None else newest_save(self.store, self.nodes)
        self._resolved = save or self._resolved
        return save

    def lineage_save(self, epoch: int) -> Save | None:
        """The lineage's committed save of ``epoch`` (None: not committed, or superseded)."""
        family = self._held()
        if family is not None:
            return family.lineage_save(epoch)
        if epoch not in self._looked_up:
            found = self.newest()
            if found is None or found.epoch != epoch:
                found = next((s for s in self.lineage() if s.epoch <= epoch), None)
                found = found if found is not None and found.epoch == epoch else None
            if self._keeps():
                self._looked_up[epoch] = found
            self._resolved = found or self._resolved
            return found
        return self._looked_up[epoch]

    def save_of(self, epoch: int) -> Save | None:
        """The committed save an explicitly chosen ``epoch`` means: the lineage's, else the
        newest superseded one of that epoch (a run that resumes from it on purpose makes its
        history current again); None when no save of ``epoch`` is committed."""
        save = self.lineage_save(epoch)
        if save is None:
            if self._family is not None:
                save = next((s for s in sorted(self._family.superseded,
                                               key=lambda s: -s.generation)
                             if s.epoch == epoch), None)
            else:
                save = next(iter(family_history(self.store, self.nodes).saves_at(epoch)), None)
        self._resolved = save or self._resolved
        return save

    # -- removal ---------------------------------------------------------------------------------

    def _fence(self) -> int:
        """The generation removals act for: this run's, or (a reader that never saved) the
        newest run's now."""
        return self.run.generation if self.run is not None else (
            runs.newest_generation(self.store.location))

    def retain(self, options: StepManagerOptions | None,
               protect: Collection[int] = ()) -> list[Save]:
        """Apply ``options``' retention to the lineage; return the saves removed.

        Raises:
            CheckpointFencedError: a newer run claimed the prefix (this run removes nothing
                more).
        """
        if options is None or not options.has_retention:
            return []
        family = self.family()
        removed = remove_saves(self.store, plan_retention(family, options, protect).delete,
                               fence=self._fence(), doing="apply retention")
        self._family = family.without(removed) if self._keeps() else None
        self._looked_up = {}
        return removed

    def remove(self, saves: Iterable[Save]) -> list[Save]:
        """Remove ``saves`` (fenced like retention)."""
        removed = remove_saves(self.store, list(saves), fence=self._fence())
        self._family = self.family().without(removed) if self._family is not None else None
        self._looked_up = {}
        return removed
