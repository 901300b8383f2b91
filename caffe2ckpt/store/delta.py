"""Differential saves, writer side: what one node's next save writes, given what its previous
save (the one it builds on) holds.

A :class:`DeltaTracker` lives beside the node's workspace (in the process that holds the node:
a thread of the flow, or a Dask worker) and remembers what the last save it wrote holds: each
blob's logical dtype and shape, its digest, the chain of groups that rebuild it, and (with
``delta_detection="compare"``) a copy of each large blob as saved. :meth:`DeltaTracker.plan`
chooses per blob (:mod:`caffe2ckpt.store.chains` describes what is stored):

- **whole**: the first save, a save whose base is not the last save this tracker wrote (the
  previous save failed on another node, or a new run started), a save after
  ``max_delta_chain`` differential saves in a row (everything is written whole again, so a
  restore never reads more than that many overlays and a kept save never needs more than that
  many older groups), a blob whose dtype, shape or order changed, or whose overlays would pass
  ``max_delta_fraction`` of its bytes;
- **same** (nothing written): a blob bit-identical to the base's: for a large blob, no changed
  row; for a small one (under ``delta_min_bytes``), an equal digest;
- **rows**: a large blob's changed rows, found by comparing rows bit for bit with the copy
  (``"compare"``: NaN payloads and -0.0 count as changes) or taken from the caller's hints
  (``"hints"``: rows not listed are promised unchanged; a blob without a hint is compared by
  digest).

The tracker moves on only once the save's record is written (:meth:`DeltaTracker.committed`):
a failed save leaves it at the last save it wrote, and hints taken for it are given back.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import xxhash

from caffe2ckpt.policy import StepManagerOptions
from caffe2ckpt.store.chains import ChainGroup, DeltaRecord
from caffe2ckpt.store.layout import parse_group_name
from caffe2ckpt.store.manifest import PACKED_ARRAY, BlobInfo, Inherited, Manifest
from caffe2ckpt.store.records import CommitRecord, RecordRef
from caffe2ckpt.store.zarrgroup import GROUP_FILE, DeltaLayout, stored_form

__all__ = ["DeltaTracker", "DeltaWrite", "changed_rows", "digest"]

_BLOCK_ROWS = 16384  # rows compared at a time: the temporaries stay small
_ID_BYTES = 8


def digest(arr: np.ndarray) -> str:
    """The xxh3-128 of ``arr``'s bytes in stored form (C order, little-endian, code units)."""
    return xxhash.xxh3_128_hexdigest(memoryview(stored_form(arr).reshape(-1).view(np.uint8)))


def _row_words(stored: np.ndarray) -> np.ndarray:
    """``stored`` (C-contiguous) as one row of the widest whole words per row of axis 0."""
    flat = stored.reshape(stored.shape[0], -1).view(np.uint8)
    width = flat.shape[1]
    for dtype in (np.uint64, np.uint32):
        if width % np.dtype(dtype).itemsize == 0:
            return flat.view(dtype)
    return flat


def changed_rows(new: np.ndarray, old: np.ndarray) -> np.ndarray:
    """The indices (int64, ascending) of the rows along axis 0 in which two stored arrays of
    one shape and dtype differ in any bit."""
    a, b = _row_words(new), _row_words(old)
    found = []
    for start in range(0, a.shape[0], _BLOCK_ROWS):
        stop = start + _BLOCK_ROWS
        rows = np.flatnonzero(np.not_equal(a[start:stop], b[start:stop]).any(axis=1))
        if rows.size:
            found.append(rows + start)
    return np.concatenate(found) if found else np.empty(0, np.int64)


@dataclass(frozen=True)
class _Link:
    """One group's part in rebuilding a blob: the arrays used from it and what vouches for
    them."""

    group: str
    save_id: str
    files: dict[str, str]  # relative metadata file -> SHA-256 (the group's zarr.json first)
    crcs: dict[str, tuple[int, ...]]


@dataclass
class _Saved:
    """What the last save this tracker wrote holds (its base for the next save)."""

    save_id: str
    group: str
    depth: int
    infos: dict[str, tuple[str, tuple[int, ...], str]]  # blob -> dtype, shape, order
    digests: dict[str, str]
    links: dict[str, list[_Link]]  # blob -> the groups that rebuild it, whole source first
    overlay_bytes: dict[str, int]  # blob -> bytes of the overlays in its chain

    def ref(self, node: str) -> RecordRef:
        """The record of this save for ``node``."""
        return RecordRef(epoch=parse_group_name(self.group).epoch,  # type: ignore[union-attr]
                         node=node, save_id=self.save_id)


@dataclass
class DeltaWrite:
    """One planned save: the blobs written whole, and (differential) the rest."""

    whole: dict[str, np.ndarray]
    infos: dict[str, tuple[str, tuple[int, ...], str]]  # every blob's dtype, shape, order
    digests: dict[str, str]  # every blob's
    layout: DeltaLayout | None = None
    base: RecordRef | None = None  # the record of the save it builds on (this node's)
    manifest: Manifest | None = None  # the group's, once planned (set by the store)
    links: dict[str, list[_Link]] = field(default_factory=dict)  # chained blobs
    depth: int = 0
    hints: dict[str, np.ndarray] = field(default_factory=dict)  # taken for this save
    shadow_rows: dict[str, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)

    def record(self, written: int) -> DeltaRecord | None:
        """The record's description of this save (None: everything is whole)."""
        if not self.links:
            return None
        groups: dict[str, _Link] = {}
        for chain in self.links.values():
            for link in chain:
                seen = groups.setdefault(link.group, _Link(link.group, link.save_id, {}, {}))
                seen.files.update(link.files)
                seen.crcs.update(link.crcs)
        ordered = sorted(groups.values(), key=lambda g: g.group)
        index = {g.group: i for i, g in enumerate(ordered)}
        return DeltaRecord(
            depth=self.depth, written=written,
            groups=tuple(ChainGroup(g.group, g.save_id, g.files, g.crcs) for g in ordered),
            chains={b: tuple(index[link.group] for link in chain)
                    for b, chain in self.links.items()},
            digests={b: self.digests[b] for b in self.links})


class DeltaTracker:
    """One node's differential state (see the module docstring)."""

    def __init__(self, node: str, options: StepManagerOptions) -> None:
        self.node = node
        self.options = options
        self._lock = threading.Lock()
        self._saved: _Saved | None = None
        self._shadow: dict[str, np.ndarray] = {}  # compare: large blobs as last saved (stored)
        self._hints: dict[str, list[np.ndarray]] = {}  # hints: rows changed since that save

    def mark_changed(self, blob: str, rows: np.ndarray) -> None:
        """Note that rows ``rows`` (int64 ids, checked by the caller against the blob:
        :func:`caffe2ckpt.workspace.check_rows`) of ``blob`` changed since the last save."""
        with self._lock:
            self._hints.setdefault(blob, []).append(np.array(rows, np.int64))

    def plan(self, base: str | None, blobs: dict[str, np.ndarray],
             stands: Callable[[RecordRef], bool]) -> DeltaWrite:
        """What a save of ``blobs`` writes if it builds on the save ``base`` (its save id;
        None: a new run's first save, written whole). ``stands(ref)`` says whether the record
        ``ref`` of the base is still there (someone may have deleted or damaged it): if not,
        everything is written whole."""
        with self._lock:
            hints = {b: np.unique(np.concatenate(r)) for b, r in self._hints.items()}
            self._hints = {}
        digests = {name: digest(arr) for name, arr in blobs.items()}
        infos = {name: _info(arr) for name, arr in blobs.items()}
        saved = self._saved
        if (saved is None or base is None or saved.save_id != base
                or saved.depth >= self.options.max_delta_chain
                or not stands(saved.ref(self.node))):
            return DeltaWrite(dict(blobs), infos, digests, hints=hints)
        try:
            return _Planner(self, saved, blobs, DeltaWrite({}, infos, digests,
                                                           hints=hints)).plan()
        except BaseException:
            self._give_back(hints)
            raise

    def failed(self, plan: DeltaWrite) -> None:
        """The save of ``plan`` was not committed: its hints count for the next save, and
        after a failed differential save (its base may be gone) the next one is whole."""
        self._give_back(plan.hints)
        if plan.layout is not None:
            self._saved = None

    def _give_back(self, hints: dict[str, np.ndarray]) -> None:
        with self._lock:
            for blob, rows in hints.items():
                self._hints.setdefault(blob, []).insert(0, rows)

    def committed(self, record: CommitRecord, plan: DeltaWrite,
                  snapshot: dict[str, np.ndarray]) -> None:
        """``record`` (this node's) was written for ``plan``: it is the base of the next
        save. ``snapshot`` holds the blobs written whole, as written."""
        own = _own_links(record, plan)
        before = self._saved.overlay_bytes if self._saved is not None else {}
        links, overlay_bytes = {}, {}
        for name in plan.infos:
            if name in plan.whole:
                links[name], overlay_bytes[name] = own[name], 0
                continue
            links[name] = [*plan.links[name], *own.get(name, [])]
            overlay = plan.layout.overlays.get(name) if plan.layout else None
            overlay_bytes[name] = before.get(name, 0) + (0 if overlay is None
                                                         else _overlay_nbytes(*overlay))
        self._update_shadow(plan, snapshot)
        self._saved = _Saved(record.save_id, record.group, plan.depth, plan.infos,
                             plan.digests, links, overlay_bytes)

    def _update_shadow(self, plan: DeltaWrite, snapshot: dict[str, np.ndarray]) -> None:
        """Keep the compared copies at what was just saved: whole blobs copied, overlays'
        rows written into the copy, unchanged blobs kept."""
        if self.options.delta_detection != "compare":
            return
        shadow = {}
        for name in plan.infos:
            kept = self._shadow.get(name)
            if name in plan.whole:
                if self._eligible(snapshot[name]):
                    shadow[name] = _copy_into(kept, stored_form(snapshot[name]))
            elif kept is not None:
                if name in plan.shadow_rows:
                    rows, values = plan.shadow_rows[name]
                    kept[rows] = values
                shadow[name] = kept
        self._shadow = shadow

    def _eligible(self, arr: np.ndarray) -> bool:
        """Whether ``arr`` may be saved as a row overlay."""
        return arr.ndim >= 1 and arr.shape[0] > 0 and arr.nbytes >= self.options.delta_min_bytes


class _Planner:
    """One differential plan (:meth:`DeltaTracker.plan`)."""

    def __init__(self, tracker: DeltaTracker, saved: _Saved, blobs: dict[str, np.ndarray],
                 out: DeltaWrite) -> None:
        self.tracker, self.saved, self.blobs, self.out = tracker, saved, blobs, out
        self.options = tracker.options
        self.inherited: dict[str, Inherited] = {}
        self.overlays: dict[str, tuple[np.ndarray, np.ndarray]] = {}

    def plan(self) -> DeltaWrite:
        for name, arr in self.blobs.items():
            kind = self._kind(name, arr)
            if kind == "whole":
                self.out.whole[name] = arr
                continue
            links = self.saved.links[name]
            self.inherited[name] = Inherited(kind, BlobInfo(name, *self.out.infos[name]),
                                             tuple(link.group for link in links))
            self.out.links[name] = links
        if self.inherited:
            group = self.saved.group
            self.out.layout = DeltaLayout(self.inherited, self.overlays, group)
            self.out.depth = self.saved.depth + 1
            self.out.base = self.saved.ref(self.tracker.node)
        return self.out

    def _kind(self, name: str, arr: np.ndarray) -> str:
        saved = self.saved
        if name not in saved.links or saved.infos.get(name) != self.out.infos[name]:
            return "whole"
        if not self.tracker._eligible(arr):
            return "same" if self.out.digests[name] == saved.digests.get(name) else "whole"
        rows = self._changed(name, arr)
        if rows is None:
            return "same" if self.out.digests[name] == saved.digests.get(name) else "whole"
        if not rows.size:  # no changed row: the digests agree (a hint of none is checked here)
            return "same" if self.out.digests[name] == saved.digests.get(name) else "whole"
        values = arr[rows]
        cost = _overlay_nbytes(rows, values)
        # (the chain's length is bounded by the save's depth: plan() writes a save whole then)
        if (cost >= arr.nbytes or saved.overlay_bytes.get(name, 0) + cost
                > self.options.max_delta_fraction * arr.nbytes):
            return "whole"
        ids = rows.astype(np.int32 if arr.shape[0] < 2**31 else np.int64)
        self.overlays[name] = (ids, values)
        if self.options.delta_detection == "compare":
            self.out.shadow_rows[name] = (rows, stored_form(values))
        return "rows"

    def _changed(self, name: str, arr: np.ndarray) -> np.ndarray | None:
        """The changed rows of a large blob (None: not known; compare by digest)."""
        if self.options.delta_detection == "compare":
            shadow = self.tracker._shadow.get(name)
            if shadow is None:
                return None
            return changed_rows(stored_form(arr), shadow)
        rows = self.out.hints.get(name)
        if rows is None or (rows.size and not (0 <= rows[0] and rows[-1] < arr.shape[0])):
            return None  # no hint, or one for another shape of the blob: compare digests
        return rows


def _info(arr: np.ndarray) -> tuple[str, tuple[int, ...], str]:
    """A blob's dtype, shape and memory order (as the manifest gives them)."""
    flags = arr.flags
    return arr.dtype.str, arr.shape, "C" if flags.c_contiguous or not flags.f_contiguous else "F"


def _overlay_nbytes(rows: np.ndarray, values: np.ndarray) -> int:
    return rows.size * _ID_BYTES + values.nbytes


def _copy_into(buffer: np.ndarray | None, stored: np.ndarray) -> np.ndarray:
    """A copy of ``stored``, reusing ``buffer`` when it fits."""
    if buffer is not None and buffer.shape == stored.shape and buffer.dtype == stored.dtype:
        np.copyto(buffer, stored)
        return buffer
    return stored.copy()


def _own_links(record: CommitRecord, plan: DeltaWrite) -> dict[str, list[_Link]]:
    """The links into ``record``'s own group: blobs written whole there, and overlays."""
    group, meta, manifest = record.group, record.metadata, plan.manifest
    assert manifest is not None  # set when the group was planned

    def link(*paths: str) -> list[_Link]:
        files = {GROUP_FILE: meta[GROUP_FILE],
                 **{f"{p}/{GROUP_FILE}": meta[f"{p}/{GROUP_FILE}"] for p in paths}}
        return [_Link(group, record.save_id, files, {p: record.crcs[p] for p in paths})]

    links = {name: link(info.path or PACKED_ARRAY) for name, info in manifest.stored_blobs.items()}
    links.update({name: link(rows.path, values.path)  # type: ignore[arg-type]
                  for name, (rows, values) in manifest.overlays.items()})
    return links
