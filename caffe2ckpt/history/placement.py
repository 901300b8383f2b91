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
  nodes (:func:`~caffe2ckpt.store.reshard.read_shares`). A rows blob's global array is its
  shares put back together, a replicated blob's is its one value; so a blob saved replicated
  and declared rows is split over the job's nodes, one saved rows and declared replicated
  reaches every node whole.
* **What cannot be cut anew is refused** with a :class:`~caffe2ckpt.errors.JobDefinitionError`
  naming the blob and both kinds, before anything is read or written: a blob saved rows or
  replicated that the job declares local (it matches none of the job's patterns), and a save
  without a layout on other nodes; found once the manifests are read, still before any data:
  local blobs when the nodes or their order change, and a single value declared rows.

A job without a layout reads node by node, as Caffe2 does: each node its own group, whatever
the save's layout; it never reshards (its next save records no layout). Blobs saved local, and
every blob of a save without a layout, that the job declares rows or replicated are *adopted*
on the nodes that saved them in the same order: each node keeps what it saved and its next save
records the declared kind; a WARNING names them (:meth:`Placement.adopted`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from caffe2ckpt.errors import JobDefinitionError
from caffe2ckpt.history.lineage import Save
from caffe2ckpt.sharding import LOCAL, REPLICATED, ROWS, Layout, SavedLayout
from caffe2ckpt.store.reshard import saved_layout
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
    def partition(self) -> str:
        return self.layout.partition if self.layout is not None else "range"

    def describe(self) -> str:
        """``"saved by 4 nodes, on 2 nodes"`` or the differences, for log lines."""
        nodes = self.save.nodes
        if nodes != frozenset(self.order):
            return f"saved by {nodes_text(len(nodes))}, on {nodes_text(len(self.order))}"
        return "resharded: " + "; ".join(self.changes)

    def adopted(self, names: Mapping[str, Iterable[str]]) -> list[str]:
        """Of each node's blob ``names`` (as its group holds them), those saved local (or
        without a layout) that the job declares rows or replicated: each node keeps its own,
        and its next save records the declared kind. Empty when the save reshards (local
        blobs are refused there) or the job has no layout."""
        if self.reshards or self.layout is None:
            return []
        spread = set() if self.saved is None else {*self.saved.rows, *self.saved.replicated}
        held = {name for blobs in names.values() for name in blobs} - spread
        return sorted(name for name in held if self.layout.kind(name) != LOCAL)


def place(save: Save, order: Sequence[str], layout: Layout | None, where: str) -> Placement:
    """How the job's nodes ``order`` with ``layout`` get the blobs of ``save`` (see the module
    docstring); ``where`` names the prefix in refusals.

    Raises:
        JobDefinitionError: the save cannot reach these nodes as declared (a blob the job
            declares local that was saved spread, or a save without a layout on other nodes).
        CheckpointCorruptedError: the save's records disagree on its layout.
    """
    order = tuple(order)
    saved = saved_layout(save.records)
    if layout is None:
        return Placement(save, order, None, saved)
    if saved is None:
        if save.nodes != frozenset(order):
            raise JobDefinitionError(_without_layout(save, order, where))
        return Placement(save, order, layout, None)
    kinds, changes = _kind_changes(save, saved, layout, where)
    if saved.order != order:
        changes.insert(0, _order_change(saved.order, order))
    if saved.rows and saved.partition != layout.partition:
        changes.insert(0, f"partition {saved.partition!r} -> {layout.partition!r}")
    return Placement(save, order, layout, saved, kinds, tuple(changes))


def _kind_changes(save: Save, saved: SavedLayout, layout: Layout, where: str
                  ) -> tuple[dict[str, str], list[str]]:
    """The blobs whose kind ``layout`` changes from the saved one, and the changes as text."""
    replicated = {n for r in save.records.values() if r.layout for n in r.layout.replicated}
    kinds: dict[str, str] = {}
    for name in sorted({*saved.rows, *replicated}):
        was, now = (ROWS if name in saved.rows else REPLICATED), layout.kind(name)
        if now == LOCAL:
            raise JobDefinitionError(
                f"epoch {save.epoch} under {where!r}: blob {name!r} was saved {was}, but the "
                f"job's layout declares it local (it matches none of the layout's patterns): "
                f"declare it {was} as saved ({'rows' if was == ROWS else 'replicated'}=[...] "
                "of caffe2ckpt.Layout); a local blob cannot be made of a blob spread over nodes")
        if now != was:
            kinds[name] = now
    return kinds, [f"blob {n!r} {'rows' if k == REPLICATED else 'replicated'} -> {k}"
                   for n, k in kinds.items()]


def _order_change(old: tuple[str, ...], new: tuple[str, ...]) -> str:
    if set(old) == set(new):
        return f"node order {list(old)} -> {list(new)}"
    return f"nodes {list(old)} -> {list(new)}"


def _without_layout(save: Save, order: tuple[str, ...], where: str) -> str:
    nodes = sorted(save.nodes)
    return (f"epoch {save.epoch} under {where!r} was saved by {nodes_text(len(nodes))} {nodes} "
            f"without a layout; it cannot be restored on {nodes_text(len(order))} "
            f"{list(order)}: only the nodes that saved it can read it. Declare "
            "caffe2ckpt.Layout(rows=[...], replicated=[...]) when saving to change the node "
            "count later, or resume on the nodes that saved it")
