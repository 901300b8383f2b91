"""Differential saves, writer side: what one planned save holds (:class:`DeltaWrite`: the
blobs it writes whole, the rest as :mod:`caffe2ckpt.store.delta.plan` planned them, and what is
left to compute while its data is made durable) and what the tracker holds once its record is
written (:class:`Saved`, the base of the next save: computed by :meth:`DeltaWrite.seal` before
the record is written, so that nothing after the commit can fail)."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

import numpy as np
import xxhash

from caffe2ckpt.fs.iopool import pool
from caffe2ckpt.store.delta.links import Link
from caffe2ckpt.store.format.chains import ChainGroup, DeltaRecord
from caffe2ckpt.store.format.manifest import PACKED_ARRAY, Manifest
from caffe2ckpt.store.format.paths import parse_group_name
from caffe2ckpt.store.format.records import CommitRecord, RecordRef
from caffe2ckpt.store.format.zarrgroup import GROUP_FILE, DeltaLayout

__all__ = ["DeltaWrite", "Info", "Saved", "info_of", "stored_digest"]

Info = tuple[str, tuple[int, ...], str]  # a blob's dtype, shape and memory order


def stored_digest(stored: np.ndarray) -> str:
    """The xxh3-128 of a blob's bytes in stored form (``stored``: C order, little-endian, code
    units; :func:`~caffe2ckpt.store.format.zarrgroup.stored_form`): what a record keeps per blob a
    differential save does not store whole."""
    return xxhash.xxh3_128_hexdigest(memoryview(stored.reshape(-1).view(np.uint8)))


@dataclass(frozen=True)
class Saved:
    """What the last save this tracker wrote holds (its base for the next save). Frozen, but
    ``rows``' arrays are overwritten by the next plan (``DeltaTracker._block_digests`` in
    :mod:`caffe2ckpt.store.delta.plan`), which then takes the tracker's base away until its own save
    commits."""

    save_id: str
    group: str
    depth: int
    infos: dict[str, Info]
    digests: dict[str, str]
    links: dict[str, list[Link]]  # blob -> the groups holding its rows, oldest first
    rows: dict[str, np.ndarray]  # large blob -> its block digests

    def ref(self, node: str) -> RecordRef:
        """The record of this save for ``node``."""
        return RecordRef(epoch=parse_group_name(self.group).epoch,  # type: ignore[union-attr]
                         node=node, save_id=self.save_id)


@dataclass
class DeltaWrite:
    """One planned save: the blobs written whole, and (differential) the rest."""

    whole: dict[str, np.ndarray]
    infos: dict[str, Info]  # every blob's dtype, shape, order
    digests: dict[str, str]  # every blob's
    layout: DeltaLayout | None = None
    base: RecordRef | None = None  # the record of the save it builds on (this node's)
    manifest: Manifest | None = None  # the group's, once planned (set by the store)
    links: dict[str, list[Link]] = field(default_factory=dict)  # chained blobs: older groups
    depth: int = 0
    hints: dict[str, np.ndarray] = field(default_factory=dict)  # taken for this save
    rows: dict[str, np.ndarray] = field(default_factory=dict)  # large blobs' block digests
    # by blob: the part this save writes as a span, those its overlay touches, its bytes
    gives: dict[str, tuple[int | None, frozenset[int], int]] = field(default_factory=dict)
    why: dict[str, str] = field(default_factory=dict)  # large blobs written whole: why
    found: dict[str, list[np.ndarray]] = field(default_factory=dict)  # blocks that differ
    reused: bool = False  # the base's block digests were overwritten with this save's
    sealed: Saved | None = None  # what the tracker holds once the record is written
    later: dict[str, tuple[int, int]] = field(default_factory=dict)  # blocks digested later
    deferred: list[Callable[[], None]] = field(default_factory=list)  # what computes them
    pending: Future[None] | None = None  # those calls, running

    def start(self) -> None:
        """Start computing what the plan left for later (:meth:`DeltaTracker.plan`'s
        ``defer``) on one I/O thread: the save calls it once its data is written, while that
        data is made durable (the processor is idle then, and the writes need the threads)."""
        if self.deferred and self.pending is None:
            self.pending = pool().submit(_run_all, self.deferred)

    def settle(self) -> None:
        """Finish what the plan left for later, raising its failure: before the record."""
        self.start()
        self.abandon()

    def abandon(self) -> None:
        """Wait for what the plan left for later, if it started, and drop the rest (on every
        path that ends the save: nothing reads the workspace after the save returns)."""
        pending, self.pending, self.deferred = self.pending, None, []
        if pending is not None:
            pending.result()

    def record(self, written: int) -> DeltaRecord | None:
        """The record's description of this save (None: everything is whole); settles it."""
        self.settle()
        if not self.links:
            return None
        groups: dict[str, Link] = {}
        for chain in self.links.values():
            for link in chain:
                seen = groups.setdefault(link.group, Link(link.group, link.save_id, {}, {}))
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

    def seal(self, record: CommitRecord) -> None:
        """Compute, before ``record`` (this node's, for this plan) is written, what the tracker
        holds once it is: so nothing that runs after the commit can fail."""
        self.settle()
        own = own_links(record, self)
        links = {name: [*([] if name in self.whole else self.links.get(name, [])),
                        *own.get(name, [])] for name in self.infos}
        self.sealed = Saved(record.save_id, record.group, self.depth, self.infos, self.digests,
                             links, self.rows)


def info_of(arr: np.ndarray) -> Info:
    """A blob's dtype, shape and memory order (as the manifest gives them)."""
    flags = arr.flags
    return arr.dtype.str, arr.shape, "C" if flags.c_contiguous or not flags.f_contiguous else "F"


def _run_all(calls: list[Callable[[], None]]) -> None:
    for call in calls:
        call()


def own_links(record: CommitRecord, plan: DeltaWrite) -> dict[str, list[Link]]:
    """The links into ``record``'s own group, by blob: blobs written whole there (an empty
    packed blob needs only the group's ``zarr.json``), and spans and overlays."""
    manifest = plan.manifest
    if manifest is None:
        raise ValueError(f"the group of {record.group!r} was not planned")

    def link(name: str, *paths: str, **gives: object) -> list[Link]:
        paths = tuple(p for p in paths if p in record.crcs)  # no array: nothing to read
        files = {GROUP_FILE: record.metadata[GROUP_FILE],
                 **{f"{p}/{GROUP_FILE}": record.metadata[f"{p}/{GROUP_FILE}"] for p in paths}}
        return [Link(record.group, record.save_id, files, {p: record.crcs[p] for p in paths},
                     **gives)]  # type: ignore[arg-type]

    links = {name: link(name, info.path or PACKED_ARRAY, whole=True)
             for name, info in manifest.stored_blobs.items()}
    parts: dict[str, list[str]] = {}
    for name, pair in manifest.overlays.items():
        parts.setdefault(name, []).extend(info.path for info in pair)  # type: ignore[misc]
    for name, (_, info) in manifest.spans.items():
        parts.setdefault(name, []).append(info.path)  # type: ignore[arg-type]
    for name, paths in parts.items():
        span, touched, overlay = plan.gives[name]
        links[name] = link(name, *paths, span=span, touched=touched, overlay_bytes=overlay)
    return links
