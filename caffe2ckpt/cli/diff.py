"""``caffe2ckpt diff``: which blobs changed between two epochs, and by how much.

When both epochs' saves carry a layout (:class:`caffe2ckpt.Layout`), the global arrays are
compared: each ``rows`` blob as the whole table (all nodes' rows in their global order), each
replicated blob once, and each node's local blobs with the same node's (a node that only one
save has: its local blobs are added or removed). So a job saved by 4 nodes and resumed
bit-exactly on 3 diffs as identical, and a changed value is reported at its global row. A blob
``rows`` in one save and replicated in the other is compared by its global value too. This
holds for two saves of the same nodes as well: their output is the same whatever the node
counts, and a save whose node order or partition differs (each node holding other rows under
the same name) is still compared row for row. Otherwise (a save without a layout, or
``--node``) each node's blobs are compared with the same node's, and the document says why.

Blobs are read (and their checksums verified) one array at a time (a global array: through
:func:`~caffe2ckpt.store.read.save.read_shares`, restored onto one node), the small blobs
together, so memory stays at about one blob (or one global array) per side. Equality is
NaN-aware: NaN against NaN (in the same place) is the same, and so are 0.0 and -0.0.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from caffe2ckpt.cli._context import (
    EXIT_NOT_FOUND,
    EXIT_OK,
    CLIError,
    Context,
    Document,
    checked_manifest,
    layout_doc,
    open_prefix,
    require_save,
)
from caffe2ckpt.cli.render import Progress
from caffe2ckpt.errors import CheckpointCorruptedError
from caffe2ckpt.history.lineage import Save
from caffe2ckpt.history.scan import PrefixScan
from caffe2ckpt.sharding import LOCAL, REPLICATED, ROWS, SavedLayout
from caffe2ckpt.store.commit.protocol import CheckpointStore
from caffe2ckpt.store.format.manifest import BlobInfo
from caffe2ckpt.store.format.records import CommitRecord
from caffe2ckpt.store.format.zarrgroup import DEFAULT_PACK_THRESHOLD
from caffe2ckpt.store.read.group import chained_together
from caffe2ckpt.store.read.reshard import saved_layout
from caffe2ckpt.store.read.save import SaveReader, read_shares

__all__ = ["GLOBAL", "PER_NODE", "cmd_diff", "compare", "diff_node"]

GLOBAL = "global arrays (layouts)"  # the document's "compared"
PER_NODE = "per node"
FIRST_ROWS = 20  # the differing global rows of a rows blob listed by index (the first ones)
SMALL_BATCH = 16 << 20  # global blobs under the pack threshold are read together, up to this


class _Reader:
    """Reads the blobs of one committed node checkpoint on demand: each array alone, the
    packed blobs together, and (a differential save) the small blobs other groups hold
    together, so each source group's packed array is read once."""

    def __init__(self, store: CheckpointStore, record: CommitRecord) -> None:
        self.record = record
        self.manifest = checked_manifest(store, record)
        self.reader = SaveReader(store, {record.node: record}, manifests={
            record.node: self.manifest})
        self._packed: dict[str, np.ndarray] | None = None
        self._together = chained_together(self.manifest)
        self._chained: dict[str, np.ndarray] | None = None

    def read(self, name: str) -> np.ndarray:
        if name in self._together:  # a differential save's small blobs: through their chains
            if self._chained is None:
                self._chained = self._own(self._together)
            return self._chained[name]
        if name in self.manifest.inherited or self.manifest.blobs[name].path is not None:
            return self._own([name])[name]
        if self._packed is None:
            self._packed = self._own([b.name for b in self.manifest.packed])
        return self._packed[name]

    def _own(self, names: list[str]) -> dict[str, np.ndarray]:
        return self.reader.own(self.record, self.manifest, names)

    def forget(self) -> None:
        """Drop the blobs read together (packed, or through a chain) that :meth:`read` keeps."""
        self._packed = self._chained = None



def _side(info: BlobInfo | None, kind: str | None = None) -> dict[str, Any] | None:
    if info is None:
        return None
    out = {"dtype": info.dtype, "shape": list(info.shape), "bytes": info.nbytes}
    return out if kind is None else {**out, "kind": kind}


def _json_float(value: float) -> float | str:
    return value if math.isfinite(value) else repr(value)


def _equal(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Where ``a`` and ``b`` (one dtype and shape) hold the same value, NaN == NaN."""
    if a.dtype.kind in "fc":
        return np.asarray((a == b) | (np.isnan(a) & np.isnan(b)))
    return np.asarray(a == b)


def compare(a: np.ndarray, b: np.ndarray) -> dict[str, Any]:
    """Element-wise comparison of two arrays of one dtype and shape.

    Returns ``elements``, ``differing`` (count), ``max_abs_diff`` (the largest ``|b - a|`` over
    differing elements where both are numbers: float for floats and complex, exact int for
    ints, 1 for bools, None for strings or when every difference involves a NaN) and
    ``nan_mismatches`` (elements that are NaN on one side only).
    """
    return _stats(a, b, _equal(a, b))


def _stats(a: np.ndarray, b: np.ndarray, equal: np.ndarray) -> dict[str, Any]:
    """:func:`compare`'s result, given where the arrays are equal."""
    kind = a.dtype.kind
    differing = int(equal.size - np.count_nonzero(equal))
    out: dict[str, Any] = {"elements": int(a.size), "differing": differing,
                           "max_abs_diff": None, "nan_mismatches": 0}
    if not differing:
        return out
    mask = ~equal
    da, db = a[mask], b[mask]
    if kind in "fc":
        wide = np.complex128 if kind == "c" else np.float64
        delta = np.abs(db.astype(wide) - da.astype(wide))
        nan = np.isnan(delta)
        out["nan_mismatches"] = int(np.count_nonzero(nan))
        if not nan.all():
            out["max_abs_diff"] = _json_float(float(delta[~nan].max()))
    elif kind == "b":
        out["max_abs_diff"] = 1
    elif kind in "iu":
        if a.dtype.itemsize <= 4:
            out["max_abs_diff"] = int(np.abs(db.astype(np.int64) - da.astype(np.int64)).max())
        else:  # exact for int64 / uint64 (no overflow)
            out["max_abs_diff"] = max(abs(y - x) for x, y in zip(da.tolist(), db.tolist()))
    return out


def _row_stats(equal: np.ndarray) -> dict[str, Any]:
    """How many rows (along axis 0) of a global array differ anywhere, and the first
    :data:`FIRST_ROWS` of them by global index."""
    if not equal.ndim:
        return {}
    per_row = equal.reshape(equal.shape[0], math.prod(equal.shape[1:]))
    rows = np.flatnonzero(~per_row.all(axis=1))
    return {"rows_differing": int(rows.size),
            "rows_differing_first": rows[:FIRST_ROWS].tolist()}


def _kind_text(kinds: Sequence[str | None]) -> str | None:
    """A blob's kind in a global comparison: ``"rows"``, or ``"rows -> replicated"`` when the
    two saves differ (None: a per-node comparison)."""
    known = [k for k in kinds if k is not None]
    if not known:
        return None
    return known[0] if len(set(known)) == 1 or len(known) == 1 else " -> ".join(known)


def _entry(node: str | None, name: str, ia: BlobInfo | None, ib: BlobInfo | None,
           kinds: Sequence[str | None] = (None, None)) -> dict[str, Any]:
    """One blob's entry, its status set unless both sides must be read (None)."""
    entry: dict[str, Any] = {
        "node": node, "name": name, "kind": _kind_text(kinds),
        "a": _side(ia, kinds[0]), "b": _side(ib, kinds[1]), "elements": None, "differing": None,
        "max_abs_diff": None, "nan_mismatches": None, "rows_differing": None,
        "rows_differing_first": None, "status": None}
    if ia is None or ib is None:
        entry["status"] = "added" if ia is None else "removed"
    elif (ia.dtype, ia.shape) != (ib.dtype, ib.shape):
        entry["status"] = "changed"
    return entry


def _settle(entry: dict[str, Any], a: np.ndarray, b: np.ndarray, rows: bool = False) -> None:
    """Compare ``a`` and ``b`` into ``entry`` (``rows``: also which global rows differ)."""
    equal = _equal(a, b)
    entry.update(_stats(a, b, equal))
    if rows:
        entry.update(_row_stats(equal))
    entry["status"] = "changed" if entry["differing"] else "same"


def _nbytes(*infos: BlobInfo | None) -> int:
    return sum(i.nbytes for i in infos if i is not None)


def _names(*blobs: Iterable[str]) -> list[str]:
    """The names of each in turn, each once, in order."""
    return list(dict.fromkeys(n for names in blobs for n in names))


def _diff_blobs(node: str, readers: Sequence[_Reader | None],
                blobs: Sequence[dict[str, BlobInfo]], progress: Progress,
                kind: str | None = None) -> list[dict[str, Any]]:
    """One entry per blob of ``node`` in either ``blobs`` (each side's, read by its reader)."""
    out = []
    for name in _names(*blobs):
        ia, ib = (side.get(name) for side in blobs)
        entry = _entry(node, name, ia, ib, [None if i is None else kind for i in (ia, ib)])
        if entry["status"] is None:
            _settle(entry, readers[0].read(name), readers[1].read(name))  # type: ignore[union-attr]
        progress.advance(_nbytes(ia, ib), f"{node}: {name}")
        out.append(entry)
    return out


def diff_node(store: CheckpointStore, node: str, records: Sequence[CommitRecord | None],
              progress: Progress) -> list[dict[str, Any]]:
    """One entry per blob of ``node`` in either save: added, removed, changed or same."""
    readers = [_Reader(store, r) if r is not None else None for r in records]
    blobs = [r.manifest.blobs if r is not None else {} for r in readers]
    return _diff_blobs(node, readers, blobs, progress)


class _GlobalSave:
    """One save with a layout as global arrays: its blobs' kinds, each ``rows`` and replicated
    blob's global dtype and shape (from the nodes' manifests, checked as ``verify`` checks
    them), and their values read through :func:`read_shares` onto one node."""

    def __init__(self, store: CheckpointStore, save: Save, layout: SavedLayout) -> None:
        self.store, self.save = store, save
        self.readers = {node: _Reader(store, save.records[node]) for node in layout.order}
        self.kinds: dict[str, str] = {}
        for node, reader in self.readers.items():
            saved = save.records[node].layout
            assert saved is not None  # saved_layout() found one in every record
            for name in _names(reader.manifest.blobs, saved.written_by):
                self.kinds.setdefault(name, saved.kind(name))
        self.infos = {name: self._info(name, kind) for name, kind in self.kinds.items()
                      if kind != LOCAL}

    def kind(self, name: str) -> str | None:
        """The kind of the global blob ``name`` (None: none of this save)."""
        return self.kinds[name] if name in self.infos else None

    def local(self, node: str) -> dict[str, BlobInfo]:
        """The local blobs of ``node`` (none if the save has no such node)."""
        reader = self.readers.get(node)
        return {} if reader is None else {
            n: i for n, i in reader.manifest.blobs.items() if self.kinds[n] == LOCAL}

    def read(self, names: list[str]) -> dict[str, np.ndarray]:
        """The global arrays of ``names``: each rows blob whole, each replicated blob once."""
        return read_shares(self.store, self.save.records, ["global"], "range",
                           names=names)["global"]

    def _info(self, name: str, kind: str) -> BlobInfo:
        """The global dtype and shape of the blob ``name`` of kind ``kind``."""
        infos = {n: r.manifest.blobs.get(name) for n, r in self.readers.items()}
        if kind == REPLICATED:
            return self._replicated_info(name, infos)
        lacking = next((n for n, i in infos.items() if i is None or not i.shape), None)
        if lacking is not None:
            raise self._damage(lacking, name, "its layout splits it by rows, but that node "
                               "holds no such blob with rows")
        return self._rows_info(name, [(n, i) for n, i in infos.items() if i is not None])

    def _replicated_info(self, name: str, infos: dict[str, BlobInfo | None]) -> BlobInfo:
        """The replicated blob ``name`` as the first node holding it (its writer) stored it."""
        held = next((i for i in infos.values() if i is not None), None)
        if held is not None:
            return held
        node, writer = next((n, r.layout.written_by[name]) for n, r in self.save.records.items()
                            if r.layout is not None and name in r.layout.written_by)
        raise self._damage(writer, name, f"node {node!r}'s record names {writer!r} as the node "
                           "that wrote this replicated blob, but no node's group holds it")

    def _rows_info(self, name: str, holding: list[tuple[str, BlobInfo]]) -> BlobInfo:
        """The global dtype and shape of the rows blob ``name`` (each node's rows put together)."""
        first_node, first = holding[0]
        for node, info in holding:
            if (info.dtype, info.shape[1:]) != (first.dtype, first.shape[1:]):
                raise self._damage(node, name, f"its rows ({info.dtype}, {info.shape}) do not "
                                   f"fit those of node {first_node!r} ({first.dtype}, "
                                   f"{first.shape})")
        return first._replace(shape=(sum(i.shape[0] for _, i in holding), *first.shape[1:]))

    def _damage(self, node: str, name: str, why: str) -> CheckpointCorruptedError:
        record = self.save.records[node]
        return CheckpointCorruptedError(
            f"checkpoint {self.store.where(record)!r} (node {node!r}, epoch {record.epoch}): "
            f"blob {name!r}: {why}", node=node, epoch=record.epoch, blob=name)


def _units(names: list[str], sides: Sequence[_GlobalSave]) -> list[list[str]]:
    """The global blobs read together: each of the pack threshold or more alone, the smaller
    ones together up to :data:`SMALL_BATCH` bytes (one reading of each save's manifests)."""
    units: list[list[str]] = []
    small: list[str] = []
    held = 0
    for name in names:
        size = max(side.infos[name].nbytes for side in sides)
        if size >= DEFAULT_PACK_THRESHOLD:
            units.append([name])
            continue
        if small and held + size > SMALL_BATCH:
            units.append(small)
            small, held = [], 0
        small.append(name)
        held += size
    return units + ([small] if small else [])


def diff_global(sides: Sequence[_GlobalSave], progress: Progress) -> list[dict[str, Any]]:
    """One entry per global blob of either save (node None, with its kind), then one per local
    blob of each node of either save."""
    a, b = sides
    entries = {name: _entry(None, name, a.infos.get(name), b.infos.get(name),
                            [a.kind(name), b.kind(name)])
               for name in _names(a.infos, b.infos)}
    for name, entry in entries.items():
        if entry["status"] is not None:
            progress.advance(_nbytes(a.infos.get(name), b.infos.get(name)), name)
    for unit in _units([n for n, e in entries.items() if e["status"] is None], sides):
        values = [side.read(unit) for side in sides]
        for name in unit:
            _settle(entries[name], values[0][name], values[1][name],
                    rows=ROWS in (a.kind(name), b.kind(name)))
            progress.advance(a.infos[name].nbytes + b.infos[name].nbytes, name)
        del values
    return [*entries.values(), *_diff_locals(sides, progress)]


def _diff_locals(sides: Sequence[_GlobalSave], progress: Progress) -> list[dict[str, Any]]:
    """One entry per local blob of each node of either save, compared with that node's."""
    a, b = sides
    out = []
    for node in sorted(set(a.readers) | set(b.readers)):
        readers = [a.readers.get(node), b.readers.get(node)]
        out += _diff_blobs(node, readers, [a.local(node), b.local(node)], progress, LOCAL)
        for reader in filter(None, readers):  # one node's small blobs held at a time
            reader.forget()
    return out


def _save(store: CheckpointStore, found: PrefixScan, epoch: int,
          nodes: list[str] | None) -> Save:
    """The save of ``epoch`` holding ``nodes`` (jobs with other nodes may share the prefix),
    else the one ``epoch`` means without nodes (in which those nodes are added or removed)."""
    return found.save_at(epoch, nodes or ()) or require_save(store, found, epoch)


def _layouts_text(epochs: Sequence[int], layouts: Sequence[SavedLayout]) -> str:
    """``"epoch 1: range over 4 nodes, epoch 2: mod over 3 nodes"``."""
    return ", ".join(f"epoch {e}: {lay.partition} over {len(lay.order)} node"
                     f"{'' if len(lay.order) == 1 else 's'}" for e, lay in zip(epochs, layouts))


def _how(saves: Sequence[Save], epochs: Sequence[int], nodes: list[str] | None
         ) -> tuple[list[SavedLayout] | None, str]:
    """Whether the global arrays are compared (both saves' layouts, else None), and why."""
    if nodes:
        return None, ("--node given: only those nodes' own blobs are compared, each with that "
                      "node's in the other epoch (without --node, two saves with a layout are "
                      "compared as global arrays)")
    layouts = [saved_layout(s.records) for s in saves]
    both = [lay for lay in layouts if lay is not None]
    if len(both) == 2:
        return both, (f"both saves have a layout ({_layouts_text(epochs, both)}): rows blobs "
                      "compared as whole tables, replicated blobs once, local blobs per node")
    missing = sorted({e for e, lay in zip(epochs, layouts) if lay is None})
    whose = (f"epoch {missing[0]}'s save has no layout" if len(missing) == 1
             else "neither save has a layout")
    return None, (f"{whose} (saved without caffe2ckpt.Layout), so its blobs cannot be put "
                  "together as global arrays: each node's blobs are compared with that node's "
                  "in the other epoch")


def _checked_nodes(store: CheckpointStore, saves: Sequence[Save], epochs: Sequence[int],
                   wanted: list[str] | None) -> list[str]:
    """The nodes of either save (only ``wanted``, each of which one of them must hold)."""
    nodes = sorted(set(saves[0].records) | set(saves[1].records))
    unknown = [n for n in wanted or () if n not in nodes]
    if unknown:
        raise CLIError(f"neither epoch {epochs[0]} nor epoch {epochs[1]} under "
                       f"{store.location.display()!r} has node {', '.join(map(repr, unknown))}; "
                       f"their nodes: {', '.join(nodes)}", EXIT_NOT_FOUND)
    return [n for n in nodes if n in wanted] if wanted else nodes


def _diff_blobs_of(store: CheckpointStore, saves: Sequence[Save],
                   layouts: list[SavedLayout] | None, nodes: list[str],
                   progress: Progress) -> list[dict[str, Any]]:
    """Every entry: of the global arrays (``layouts``), else of ``nodes`` one by one."""
    if layouts is not None:
        return diff_global([_GlobalSave(store, s, lay) for s, lay in zip(saves, layouts)],
                           progress)
    out: list[dict[str, Any]] = []
    for node in nodes:
        out += diff_node(store, node, [s.records.get(node) for s in saves], progress)
    return out


def cmd_diff(ctx: Context, args: argparse.Namespace) -> tuple[Document, int]:
    store, found = open_prefix(ctx, args.prefix)
    epochs = [args.epoch_a, args.epoch_b]
    saves = [_save(store, found, epoch, args.node) for epoch in epochs]
    nodes = _checked_nodes(store, saves, epochs, args.node)
    layouts, why = _how(saves, epochs, args.node)
    total = sum(s.records[n].nbytes for s in saves for n in nodes if n in s.records)
    ctx.progress.start(f"diff {epochs[0]} {epochs[1]}", total)
    blobs = _diff_blobs_of(store, saves, layouts, nodes, ctx.progress)
    ctx.progress.close()
    summary = {k: sum(x["status"] == k for x in blobs)
               for k in ("changed", "added", "removed", "same")}
    a_nodes, b_nodes = (set(s.records) for s in saves)
    doc = {"prefix": store.location.display(), "epochs": epochs,
           "compared": PER_NODE if layouts is None else GLOBAL, "compared_why": why,
           "layouts": [layout_doc(list(s.records.values())) for s in saves], "nodes": nodes,
           "nodes_added": sorted((b_nodes - a_nodes) & set(nodes)),
           "nodes_removed": sorted((a_nodes - b_nodes) & set(nodes)),
           "summary": summary, "blobs": blobs, "show_same": bool(args.all)}
    return doc, EXIT_OK
