"""How a committed save reaches a job's nodes: decided once, here, from the whole saved layout
against the job's, for every reader that restores onto a job (JobRunner and the Caffe2
managers, StepCheckpointManager).

A save with a layout records its nodes in order, its partition and each blob's kind
(:class:`~caffe2ckpt.sharding.SavedLayout`); a job declares the same (its nodes in order and a
:class:`~caffe2ckpt.Layout`). :func:`place` compares them:

* **The same** (same nodes in the same order, the same partition when the save has rows blobs,
  every rows and replicated blob of the save declared the same kind): each node reads its own
  group, and its replicated blobs from the node that wrote them.
* **Anything else reshards**: the global arrays the save defines are cut anew for the job's
  nodes (:mod:`~caffe2ckpt.store.read.reshard`, through the one read path). A rows blob's global array is its
  shares put back together, a replicated blob's is its one value; so a blob saved replicated
  and declared rows is split over the job's nodes, one saved rows and declared replicated
  reaches every node whole.
* **What cannot be cut anew is refused** with a :class:`~caffe2ckpt.errors.JobDefinitionError`
  naming the blob and both kinds, before anything is read or written: a blob saved rows or
  replicated that the job declares local (it matches none of the job's patterns), and a save
  without a layout on other nodes; found once the manifests are read, still before any data:
  local blobs when the nodes or their order change, and a single value declared rows.

A job without a layout reads node by node, as Caffe2 does: each node its own group; it never
reshards (its next save records no layout), so a save with a layout reaches it only on the
nodes that saved it in the same order (a node-count change, a reorder, a subset would drop or
move what the layout spreads): elsewhere it is refused, asking for the layout. Blobs saved
local, and every blob of a save without a layout, that the job declares rows or replicated are
*adopted* on the nodes that saved them (in the same order, when the save records one): each
node keeps what it saved and its next save records the declared kind; a WARNING names them
(:meth:`Placement.adoption`).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from caffe2ckpt.errors import JobDefinitionError
from caffe2ckpt.history.lineage import Save
from caffe2ckpt.sharding import LOCAL, REPLICATED, ROWS, Layout, SavedLayout
from caffe2ckpt.store.read.reshard import saved_layout
from caffe2ckpt.store.read.save import Cut
from caffe2ckpt.units import nodes_text

__all__ = ["Placement", "place"]


@dataclass(frozen=True)
class Placement:
    """A committed save and how the job's nodes ``order`` get its blobs."""

    save: Save
    order: tuple[str, ...]  # the job's nodes, in its order
    layout: Layout | None  # the job's (None: node by node)
    saved: SavedLayout | None  # the save's, as its records agree on it
    kinds: dict[str, str] = field(default_factory=dict)  # blobs whose kind the job changes
    changes: tuple[str, ...] = ()  # what differs from the save; empty: each node its own

    @property
    def reshards(self) -> bool:
        return bool(self.changes)

    @property
    def cut(self) -> Cut | None:
        """How the one read path cuts the save for the job's nodes (None: each node reads its
        own)."""
        return Cut(self.order, self.partition, self.kinds) if self.reshards else None

    @property
    def partition(self) -> str:
        return self.layout.partition if self.layout is not None else "range"

    def describe(self) -> str:
        """What differs from the save, for log lines: ``"saved by 4 nodes, on 2 nodes"`` when
        the node count does, then every other difference."""
        nodes, changes = self.save.nodes, list(self.changes)
        if nodes != frozenset(self.order):
            changes = [f"saved by {nodes_text(len(nodes))}, on {nodes_text(len(self.order))}",
                       *(c for c in changes if not c.startswith("nodes "))]
        return ("resharded: " if nodes == frozenset(self.order) else "") + "; ".join(changes)

    def adoption(self, names: Mapping[str, Iterable[str]]) -> str | None:
        """The WARNING for the blobs of ``names`` (each node's, as its group holds them) that
        were saved local (or without a layout) and that the job declares rows or replicated:
        each node keeps its own, and its next save records the declared kind. None when there
        are none, or the job has no layout; local blobs that would move are refused instead
        (:mod:`~caffe2ckpt.store.read.reshard`)."""
        if self.layout is None:
            return None
        held = {name for blobs in names.values() for name in blobs} - _spread(self.save)
        adopted = sorted(name for name in held if self.layout.kind(name) != LOCAL)
        if not adopted:
            return None
        return (f"epoch {self.save.epoch} holds {adopted} saved local to their nodes (or "
                "without a layout), which the job's layout declares spread over them: each node "
                "keeps its own, as saved, and its next save records the declared kinds; make "
                "sure each node holds its share as the layout declares it")


def place(save: Save, order: Sequence[str], layout: Layout | None, where: str,
          names: Collection[str] | None = None) -> Placement:
    """How the job's nodes ``order`` with ``layout`` get the blobs of ``save`` (all, or only
    ``names``: the kinds of the others are not compared) (see the module docstring); ``where``
    names the prefix in refusals.

    Raises:
        JobDefinitionError: the save cannot reach these nodes as declared (a blob the job
            declares local that was saved spread, a save without a layout on other nodes, a
            save with a layout on other nodes or another order for a job without one).
        CheckpointCorruptedError: the save's records disagree on its layout.
    """
    order = tuple(order)
    saved = saved_layout(save.records)
    if saved is None or layout is None:  # node by node
        if (saved is None and layout is not None and save.nodes != frozenset(order)) or (
                saved is not None and saved.order != order):
            raise JobDefinitionError(_refusal(save, saved, order, where))
        return Placement(save, order, layout, saved)
    kinds, changes = _kind_changes(save, layout, where, names)
    if saved.order != order:
        changes.insert(0, _order_change(saved.order, order))
    if saved.rows and len(order) > 1 and saved.partition != layout.partition:
        changes.insert(0, f"partition {saved.partition!r} -> {layout.partition!r}")
    return Placement(save, order, layout, saved, kinds, tuple(changes))


def _spread(save: Save) -> set[str]:
    """The blobs the save's layout spreads over its nodes: rows, and replicated on any node."""
    return {n for r in save.records.values() if r.layout
            for n in (*r.layout.rows, *r.layout.replicated)}


def _kind_changes(save: Save, layout: Layout, where: str, names: Collection[str] | None
                  ) -> tuple[dict[str, str], list[str]]:
    """The blobs (of ``names``, if given) whose kind ``layout`` changes from the saved one,
    and the changes as text."""
    saved = saved_layout(save.records)
    assert saved is not None
    kinds: dict[str, str] = {}
    for name in sorted(n for n in _spread(save) if names is None or n in names):
        was, now = (ROWS if name in saved.rows else REPLICATED), layout.kind(name)
        if now == LOCAL:
            raise JobDefinitionError(
                f"epoch {save.epoch} under {where!r}: blob {name!r} was saved {was}, but the "
                f"job's layout declares it local (it matches none of the layout's patterns): "
                f"declare it {was} as saved ({was}=[...] of caffe2ckpt.Layout); a local blob "
                "cannot be made of a blob spread over nodes")
        if now != was:
            kinds[name] = now
    return kinds, [f"blob {n!r} {'rows' if k == REPLICATED else 'replicated'} -> {k}"
                   for n, k in kinds.items()]


def _order_change(old: tuple[str, ...], new: tuple[str, ...]) -> str:
    if set(old) == set(new):
        return f"node order {list(old)} -> {list(new)}"
    return f"nodes {list(old)} -> {list(new)}"


def _refusal(save: Save, saved: SavedLayout | None, order: tuple[str, ...], where: str) -> str:
    """Why a save without a layout, or a job without one, cannot read the save on ``order``."""
    nodes = list(saved.order) if saved is not None else sorted(save.nodes)
    head = (f"epoch {save.epoch} under {where!r} was saved by {nodes_text(len(nodes))} {nodes}"
            f" {'with' if saved is not None else 'without'} a layout; it cannot be restored "
            f"on {nodes_text(len(order))} {list(order)}")
    if saved is None:
        return (f"{head}: only the nodes that saved it can read it. Declare caffe2ckpt.Layout("
                "rows=[...], replicated=[...]) when saving to change the node count later, or "
                "resume on the nodes that saved it")
    return (f"{head} by a job that declares no layout (node by node, it would drop or move what "
            "the layout spreads over the nodes): give the manager the layout it was saved with "
            f"(layout=caffe2ckpt.Layout(rows={list(saved.rows)}, replicated=[...], "
            f"partition={saved.partition!r})), or resume on the nodes that saved it, in that "
            "order")
