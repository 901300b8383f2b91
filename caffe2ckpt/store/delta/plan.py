"""Differential saves, writer side: what one node's next save writes, given what its previous
save (the one it builds on) holds.

A :class:`DeltaTracker` lives beside the node's workspace (in the process that holds the node:
a thread of the flow, or a Dask worker) and remembers what the last save it wrote holds: each
blob's logical dtype and shape, its digest, the groups that hold its rows (its *chain*), and,
for large blobs, a keyed 8-byte digest per block of rows (:mod:`caffe2ckpt.store.delta.rowhash`: 8
bytes per ``delta_block_bytes`` of the blob at most, never a copy; the next plan compares its
digests with those and writes them over them, so a plan that reuses them leaves the tracker with
no base until its save commits). :meth:`DeltaTracker.plan` chooses per blob
(:mod:`caffe2ckpt.store.format.chains` describes what is stored):

- **whole**: the first save, a save whose base is not the last save this tracker wrote (the
  previous save failed on another node, or a new run started), a new blob, one whose dtype,
  shape or order changed, a small blob (under ``delta_min_bytes``) that changed, a large blob
  whose overlays would pass ``max_delta_fraction`` of its bytes, or whose save would otherwise
  need more than :data:`~caffe2ckpt.store.format.chains.MAX_GROUPS` older groups; a large blob
  written whole says why (:attr:`DeltaWrite.why`: the record, and a log line at commit);
- **same** (nothing written): a small blob of :data:`INHERIT_MIN_BYTES` or more bit-identical
  to the base's (equal digest), as long as naming such blobs adds at most
  :data:`INHERITED_BYTES` to the manifest and record (past that, the smallest are written
  whole); or a large blob nothing in which changed since its parts were written;
- **rows**: a large blob's *span* and *overlay*. Its rows are cut into ``max_delta_chain + 1``
  parts, and the save at depth ``d`` (``d`` saves since the last whole one) writes part
  ``d mod (max_delta_chain + 1)`` whole (the span) if it changed since it was last written
  whole, and, of the other parts, the rows whose digest changed (the overlay: their ids and
  values). So a changed row is rewritten whole within ``max_delta_chain + 1`` saves: a save
  needs at most ``max_delta_chain`` older groups for the rows that changed, and what did not
  change stays in the group that wrote it, named by the record
  (:mod:`~caffe2ckpt.store.delta.links` decides which groups still give rows).

Row changes are found by digest: a block whose digest differs from the last save's changed
(2**-64 per block that changed, see :mod:`~caffe2ckpt.store.delta.rowhash`). With
``delta_detection="hints"`` the hinted rows are written too; changed rows that no hint named
are found the same way, written, and reported (a WARNING naming node, blob and count), so a
hint that misses rows can no longer commit an epoch that does not restore.

The plan is a :class:`~caffe2ckpt.store.delta.write.DeltaWrite`. A save that writes before it
returns leaves what only its record and the next save need (the large blobs' xxh3-128, and the
row digests of what it writes whole) to one I/O thread while its data is made durable
(:meth:`DeltaWrite.start`), and waits for it before the record.

The tracker moves on only once the save's record is written (:meth:`DeltaTracker.committed`,
which only assigns what :meth:`DeltaWrite.seal` computed before the record was written, so it
cannot fail): a failed save leaves it at the last save it wrote, and hints taken for it are
given back.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
from collections.abc import Callable

import numpy as np

from caffe2ckpt.fs.iopool import pool, results
from caffe2ckpt.policy import StepManagerOptions
from caffe2ckpt.store.delta.links import Link, live, parts_of, span_rows, turn
from caffe2ckpt.store.delta.rowhash import RowHasher
from caffe2ckpt.store.delta.write import DeltaWrite, Saved, info_of, stored_digest
from caffe2ckpt.store.format.chains import MAX_GROUPS
from caffe2ckpt.store.format.manifest import BlobInfo, Inherited
from caffe2ckpt.store.format.paths import parse_group_name
from caffe2ckpt.store.format.records import RecordRef
from caffe2ckpt.store.format.zarrgroup import DeltaLayout, stored_form
from caffe2ckpt.workspace import merge_rows, sorted_unique

__all__ = ["DeltaTracker", "span_rows"]

logger = logging.getLogger(__name__)

# A small blob under this many bytes is written whole even when unchanged: naming it as
# inherited (manifest entry with its chain, digest in the record: about 150 bytes or more)
# would cost about what writing it does, and its restore would read one more group.
INHERIT_MIN_BYTES = 1024
# At most this much of a differential save's manifest and record names inherited small blobs
# (past it, the smallest are written whole; a whole save lists them in compact columns): so a
# workspace whose whole save's metadata is this much under the readers' limit (64 MiB) saves
# differentially too, the large blobs' few spans and overlays aside.
INHERITED_BYTES = 16 << 20


class DeltaTracker:
    """One node's differential state (see the module docstring)."""

    def __init__(self, node: str, options: StepManagerOptions) -> None:
        self.node = node
        self.options = options
        self._lock = threading.Lock()
        self._saved: Saved | None = None
        self._hints: dict[str, np.ndarray] = {}  # rows changed since that save: their union
        self.hasher = RowHasher(block_bytes=options.delta_block_bytes)

    def mark_changed(self, blob: str, rows: np.ndarray) -> None:
        """Note that rows ``rows`` (int64 ids, checked by the caller against the blob:
        :func:`caffe2ckpt.workspace.check_rows`) of ``blob`` changed since the last save. Only
        their union is kept: at most 8 bytes per row of the blob, however often rows are
        marked."""
        with self._lock:
            merge_rows(self._hints, blob, np.asarray(rows, np.int64))

    def plan(self, base: str | None, blobs: dict[str, np.ndarray],
             stands: Callable[[RecordRef], bool], defer: bool = False) -> DeltaWrite:
        """What a save of ``blobs`` writes if it builds on the save ``base`` (its save id;
        None: a new run's first save, written whole). ``stands(ref)`` says whether the record
        ``ref`` of the base is still there (someone may have deleted or damaged it): if not,
        everything is written whole. With ``defer`` (a save that writes before it returns),
        what only the record and the next save need is left for later (:meth:`DeltaWrite.start`
        runs it while the save's data is made durable, :meth:`DeltaWrite.settle` before the
        record): the large blobs' xxh3, and the digests of the rows this save writes whole
        whatever they hold (with ``compare``, its span when its part changed before; every row,
        when the save is whole); and the plan's spans are
        views of ``blobs``, not copies: ``blobs`` must not change until the save returns, as in
        any save that writes before it returns."""
        with self._lock:
            hints, self._hints = self._hints, {}
        try:
            saved = self._saved
            if saved is None or base is None or saved.save_id != base:
                saved = None  # nothing this save may build on: it is whole
            later = self._later(blobs, saved) if defer else {}
            out = self._measure(blobs, hints, later, defer, saved)
            why = _why_whole(base, self._saved, saved, stands, self.node)
            if why:
                out.whole = dict(blobs)
                out.why = {name: why for name in out.rows}
            else:
                _Planner(self, saved, blobs, out, copy_spans=not defer).plan()
            if out.reused:  # the base's row digests are this save's now: no other plan may
                self._saved = None  # build on the base, and only this one's commit sets it
            return out
        except BaseException:
            self._give_back(hints)
            if saved is not None:  # its row digests may be half overwritten: the next is whole
                self._saved = None
            raise

    def _later(self, blobs: dict[str, np.ndarray], saved: Saved | None
               ) -> dict[str, tuple[int, int]]:
        """The blocks of each large blob whose digests the plan does not need: every one when
        nothing is built on (the save is whole), else with ``compare`` those inside the span
        the save writes whole whatever they hold (its part changed since its last whole copy;
        with hints, every block is checked against them)."""
        later = {}
        for name, arr in blobs.items():
            if not self.eligible(arr):
                continue
            count = self.hasher.count(arr)
            if saved is None:
                later[name] = (0, count)
            elif (self.options.delta_detection == "compare"
                  and self._turn_is_dirty(name, arr, saved)):
                later[name] = _span_blocks(arr, self.options.max_delta_chain + 1,
                                           saved.depth + 1, self.hasher.block_rows(arr), count)
        return later

    def _turn_is_dirty(self, name: str, arr: np.ndarray, saved: Saved) -> bool:
        """Whether a save on ``saved`` writes the part whose turn it is of blob ``name`` whole
        whatever its rows' digests say (an overlay changed it since it was written whole)."""
        links = saved.links.get(name)
        if not links or saved.infos.get(name) != info_of(arr):
            return False
        return turn(arr.shape[0], arr.nbytes // arr.shape[0], self.options.max_delta_chain + 1,
                    saved.depth + 1, links)[2]

    def _measure(self, blobs: dict[str, np.ndarray], hints: dict[str, np.ndarray],
                 later: dict[str, tuple[int, int]], defer: bool, saved: Saved | None
                 ) -> DeltaWrite:
        """Every blob's digest and logical info, and the large blobs' block digests but those
        of ``later``; with ``defer``, the large blobs' digests and ``later``'s are left to the
        plan's ``deferred`` calls. A large blob ``saved`` (the base) holds block digests of, as
        it is now, has its new digests compared with those and written over them (one copy in
        memory): the blocks that differ are the plan's ``found``."""
        out = DeltaWrite({}, {}, {}, hints=hints)
        for name, arr in blobs.items():
            stored = stored_form(arr)
            out.infos[name] = info_of(arr)
            if not self.eligible(arr):
                out.digests[name] = stored_digest(stored)
                continue
            if defer:
                out.deferred.append(lambda d=out.digests, n=name, s=stored: d.__setitem__(
                    n, stored_digest(s)))
            else:
                out.digests[name] = stored_digest(stored)
            self._block_digests(out, name, stored, later.get(name, (0, 0)), saved)
        out.later = {name: span for name, span in later.items() if span[1] > span[0]}
        return out

    def _block_digests(self, out: DeltaWrite, name: str, stored: np.ndarray,
                       later: tuple[int, int], saved: Saved | None) -> None:
        """Blob ``name``'s block digests (those of ``later`` left to ``out.deferred``), over
        the base's when it has them for the blob as it is now (comparing them first)."""
        count = self.hasher.count(stored)
        base = None if saved is None or saved.infos.get(name) != out.infos[name] else \
            saved.rows.get(name)
        found = None
        if base is not None and base.shape == (count,):
            digests, found = base, out.found.setdefault(name, [])
            out.reused = True
        else:
            digests = np.empty(count, np.uint64)
        out.rows[name] = digests
        first, stop = later
        _on_threads([*self.hasher.calls(stored, digests, 0, first, found),
                     *self.hasher.calls(stored, digests, stop, count, found)])
        out.deferred += self.hasher.calls(stored, digests, first, stop)

    def failed(self, plan: DeltaWrite) -> None:
        """The save of ``plan`` was not committed (or its outcome is not known): its hints count
        for the next save, and after a failed differential save (its base may be gone) the next
        one is whole."""
        with contextlib.suppress(BaseException):  # the save's failure is what is reported
            plan.abandon()
        self._give_back(plan.hints)
        if plan.layout is not None or plan.reused:  # its base may be gone, or its digests
            self._saved = None

    def _give_back(self, hints: dict[str, np.ndarray]) -> None:
        with self._lock:
            for blob, rows in hints.items():
                merge_rows(self._hints, blob, rows)

    def committed(self, plan: DeltaWrite) -> None:
        """``plan``'s record (sealed, :meth:`DeltaWrite.seal`) was written: it is the base of
        the next save. An assignment, and a log line saying why large blobs were written
        whole, if some were: it cannot fail."""
        self._saved = plan.sealed
        if plan.why and plan.sealed is not None:
            with contextlib.suppress(Exception):
                logger.info("node %r, epoch %d: written whole although delta_saves is on: %s",
                            self.node, plan.sealed.ref(self.node).epoch, "; ".join(
                                f"blob {name!r} ({why})" for name, why in sorted(plan.why.items())))

    def eligible(self, arr: np.ndarray) -> bool:
        """Whether ``arr`` may be saved as spans and row overlays."""
        return arr.ndim >= 1 and arr.shape[0] > 0 and arr.nbytes >= self.options.delta_min_bytes


class _Planner:
    """One differential plan (:meth:`DeltaTracker.plan`)."""

    def __init__(self, tracker: DeltaTracker, saved: Saved, blobs: dict[str, np.ndarray],
                 out: DeltaWrite, copy_spans: bool) -> None:
        self.tracker, self.saved, self.blobs, self.out = tracker, saved, blobs, out
        self.copy_spans = copy_spans  # an async save writes them while the workspace moves on
        self.options = tracker.options
        self.depth = saved.depth + 1
        self.inherited: dict[str, Inherited] = {}
        self.overlays: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        self.spans: dict[str, tuple[int, np.ndarray]] = {}

    def plan(self) -> DeltaWrite:
        kinds = {name: self._kind(name, arr, self._older(name))
                 for name, arr in self.blobs.items()}
        self._name_within_budget(kinds)
        self._within_group_limit(kinds)
        for name, (kind, older) in kinds.items():
            if kind == "whole":
                self.out.whole[name] = self.blobs[name]
                continue
            self.inherited[name] = Inherited(kind, BlobInfo(name, *self.out.infos[name]),
                                             tuple(link.group for link in older))
            self.out.links[name] = older
        if self.inherited:
            self.out.layout = DeltaLayout(self.inherited, self.overlays, self.saved.group,
                                          self.spans)
            self.out.depth = self.depth
            self.out.base = self.saved.ref(self.tracker.node)
        return self.out

    def _older(self, name: str) -> list[Link] | None:
        """The base's groups of blob ``name`` (None: the base does not hold it as it is now)."""
        links = self.saved.links.get(name)
        if links is None or self.saved.infos.get(name) != self.out.infos[name]:
            return None
        return links

    def _kind(self, name: str, arr: np.ndarray, older: list[Link] | None
              ) -> tuple[str, list[Link]]:
        """Whether blob ``name`` is written whole, as "rows" or not at all ("same"), and the
        older groups it then needs."""
        if not older:
            return self._whole(name, "new blob" if name not in self.saved.infos else
                               "dtype, shape or order changed")
        if name not in self.out.rows:  # a small blob: its one copy, if unchanged
            if (self.out.digests[name] == self.saved.digests.get(name)
                    and arr.nbytes >= INHERIT_MIN_BYTES):
                return "same", older
            return "whole", []
        if name not in self.out.found:  # compared with the base's while computed
            return self._whole(name, "no row digests of the save it builds on")
        return self._rows(name, arr, older, self._changed(name, arr))

    def _whole(self, name: str, why: str) -> tuple[str, list[Link]]:
        """Write ``name`` whole (a large blob: say why), dropping a span or overlay planned."""
        self.overlays.pop(name, None)
        self.spans.pop(name, None)
        self.out.gives.pop(name, None)
        if name in self.out.rows:
            self.out.why[name] = why
        return "whole", []

    def _name_within_budget(self, kinds: dict[str, tuple[str, list[Link]]]) -> None:
        """Write whole the smallest of the small blobs planned as "same" while naming them would
        add more than :data:`INHERITED_BYTES` to the manifest and record (a whole save lists
        small blobs in compact columns; an inherited one is named with its chain and digest)."""
        same = [(self.blobs[name].nbytes, name) for name, (kind, _) in kinds.items()
                if kind == "same" and name not in self.out.rows]
        costs = {name: _naming_bytes(name, self.blobs[name], kinds[name][1]) for _, name in same}
        excess = sum(costs.values()) - INHERITED_BYTES
        for _, name in sorted(same):
            if excess <= 0:
                return
            kinds[name] = ("whole", [])
            excess -= costs[name]

    def _within_group_limit(self, kinds: dict[str, tuple[str, list[Link]]]) -> None:
        """While the save would need more than :data:`~caffe2ckpt.store.format.chains.MAX_GROUPS`
        older groups (what did not change stays where it was written, however old), write whole
        every blob that needs the oldest of them."""
        while True:
            epochs = {link.group: parse_group_name(link.group).epoch  # type: ignore[union-attr]
                      for kind, older in kinds.values() if kind != "whole" for link in older}
            if len(epochs) <= MAX_GROUPS:
                return
            oldest = min(epochs, key=epochs.__getitem__)
            for name, (kind, older) in kinds.items():
                if kind != "whole" and any(link.group == oldest for link in older):
                    kinds[name] = self._whole(name, f"its save would need more than "
                                              f"{MAX_GROUPS} older groups")

    def _rows(self, name: str, arr: np.ndarray, older: list[Link], changed: np.ndarray
              ) -> tuple[str, list[Link]]:
        """A large blob's span (its turn's part, if that part changed since its newest whole
        copy) and overlay (the changed rows of the other parts), unless writing it whole costs
        less or its live overlays would pass ``max_delta_fraction`` of it; and the older groups
        that still give rows of it then (:func:`~caffe2ckpt.store.delta.links.live`)."""
        row_bytes = arr.nbytes // arr.shape[0]
        edges, part, dirty = turn(arr.shape[0], row_bytes, self.options.max_delta_chain + 1,
                                  self.depth, older)
        start, stop = edges[part], edges[part + 1]
        if not (dirty or part in parts_of(changed, edges)):
            start = stop  # nothing in that part changed since it was written: no span
        ids = changed[(changed < start) | (changed >= stop)]
        ids = ids.astype(np.int32 if arr.shape[0] < 2**31 else np.int64)
        overlay = ids.size * (ids.itemsize + row_bytes)
        own = Link("", "", {}, {}, span=part if stop > start else None,
                   touched=parts_of(ids, edges), overlay_bytes=overlay)
        kept = live([*older, own], edges)
        if kept is None:
            return self._whole(name, "its rows are not all in the saves it builds on")
        if overlay + (stop - start) * row_bytes >= arr.nbytes:
            return self._whole(name, "its changed rows cost as much as the whole blob")
        if kept[1] > self.options.max_delta_fraction * arr.nbytes:
            return self._whole(name, f"its row overlays would pass max_delta_fraction="
                               f"{self.options.max_delta_fraction:g} of its bytes")
        if ids.size:
            self.overlays[name] = (ids, arr[ids])
        if stop > start:  # a view when the save writes before it returns
            span = arr[start:stop]
            self.spans[name] = (start, span.copy(order="C") if self.copy_spans else span)
        links = [link for link in kept[0] if link is not own]
        if own.span is None and not own.touched:
            return "same", links
        self.out.gives[name] = (own.span, own.touched, overlay)
        return "rows", links

    def _changed(self, name: str, arr: np.ndarray) -> np.ndarray:
        """The rows of a large blob to write (int64, ascending): those of every block whose
        digest changed, and (hints) every hinted row."""
        pieces = self.out.found[name]
        blocks = np.unique(np.concatenate(pieces)) if pieces else np.array([], np.int64)
        count = arr.shape[0]
        per = self.tracker.hasher.block_rows(arr)
        found = (blocks if per == 1 else
                 (blocks[:, None] * per + np.arange(per)).reshape(-1))
        found = found[found < count]
        hint = self.out.hints.get(name)
        if self.options.delta_detection != "hints" or hint is None or not hint.size:
            return found
        if hint[-1] >= count:  # a hint for another shape of the blob: no hint
            return found
        missed = np.setdiff1d(blocks, hint // per, assume_unique=True)
        if missed.size:
            logger.warning("node %r, blob %r: %d changed row(s) were not in the changed-rows "
                           "hints (found by row digest and saved; check the hints)",
                           self.tracker.node, name, min(missed.size * per, count))
        return sorted_unique(np.concatenate([found, hint]))


def _span_blocks(arr: np.ndarray, parts: int, depth: int, per: int, count: int
                 ) -> tuple[int, int]:
    """The blocks (of ``count``, ``per`` rows each) that lie wholly inside the span a save at
    ``depth`` writes."""
    rows = arr.shape[0]
    start, stop = span_rows(rows, arr.nbytes // rows, parts, depth)
    first, last = -(-start // per), count if stop == rows else stop // per
    return (first, last) if first < last else (0, 0)  # none: every block is digested now


def _why_whole(base: str | None, tracked: Saved | None, saved: Saved | None,
               stands: Callable[[RecordRef], bool], node: str) -> str | None:
    """Why a save that would build on ``base`` (the save this tracker holds: ``tracked``;
    ``saved`` if it is ``base``) is written whole, if it is."""
    if base is None:
        return "first save of its run"
    if tracked is None:
        return "no earlier save of this run written by this process (a failed save, or a new one)"
    if saved is None:
        return "the save it follows was not the last this process wrote for the node"
    if not stands(saved.ref(node)):
        return "the record of the save it builds on is gone"
    return None


def _naming_bytes(name: str, arr: np.ndarray, chain: list[Link]) -> int:
    """No less than what naming inherited blob ``name`` adds to a manifest (its entry: kind,
    dtype, shape, order, chain; 60 bytes besides those) and a record (its xxh3-128: 38 bytes
    besides its name), as JSON."""
    return (2 * _json_len(name) + sum(len(str(d)) + 2 for d in arr.shape) + 2
            + len(arr.dtype.str) + sum(_json_len(link.group) + 1 for link in chain) + 128)


def _json_len(text: str) -> int:
    """The length of ``text`` as a JSON string (as :func:`json.dumps` writes it)."""
    if text.isascii() and text.isprintable() and '"' not in text and "\\" not in text:
        return len(text) + 2  # nothing to escape: the common case, without encoding it
    return len(json.dumps(text))


def _on_threads(calls: list[Callable[[], None]]) -> None:
    """Run ``calls`` on the I/O threads (numpy and the compiled kernel release the GIL in
    them), raising the first failure once all have ended."""
    results([pool().submit(call) for call in calls])


