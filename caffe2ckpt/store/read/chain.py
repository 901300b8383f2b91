"""Differential saves, reader side: rebuild the blobs a save does not store whole.

For each such blob the save's commit record gives its chain (:mod:`caffe2ckpt.store.format.chains`):
the older groups that hold rows of it, oldest first; the save's own group comes last. Each
group holds the blob whole, or a *span* (consecutive rows) and/or a *row overlay* (row ids and
values) of it. A row's value is the one of the newest group holding it. So the blob is built
in two rounds. First each row is read from the newest span or whole copy holding it, straight
from its chunk into its place (a chunk holding rows a newer span gave is read into a buffer of
its own and only its other rows copied); every row must be in some span or whole copy, else the
chain is damaged. Then each row that an overlay newer than that span holds is copied into place
from the newest such overlay, as the overlay's chunk is read into the I/O thread's buffer: no
copy of an overlay is held, and the rounds never write a row in the wrong order.

Every group's ``zarr.json`` must have the digest the record gives and say it is the save the
record names; every array read is checked as any restore checks it (metadata digests, chunk
sizes and CRC32Cs). Once built, each blob's digest must be the one recorded at save time: any
wrong reconstruction is :class:`~caffe2ckpt.errors.CheckpointCorruptedError` naming node,
epoch, blob and the group, never wrong data.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from caffe2ckpt.errors import CheckpointCorruptedError
from caffe2ckpt.fs.iopool import read_pool, results
from caffe2ckpt.store.delta.write import stored_digest
from caffe2ckpt.store.format.chains import ChainGroup
from caffe2ckpt.store.format.manifest import PACKED_ARRAY, BlobInfo, Manifest, stored_spec
from caffe2ckpt.store.format.records import CommitRecord
from caffe2ckpt.store.format.zarrgroup import GROUP_FILE, stored_form
from caffe2ckpt.store.read.group import (
    RowRead,
    check_chunk_sizes,
    destination,
    needs_precheck,
    read_arrays,
    read_node,
    restored,
    row_calls,
)
from caffe2ckpt.store.read.rounds import Rounds

if TYPE_CHECKING:
    from caffe2ckpt.store.read.source import ReadableStore

__all__ = ["read_chained"]

@dataclass
class _Source:
    """One group a chain reads, with what vouches for it."""

    group: str
    manifest: Manifest
    crcs: dict[str, tuple[int, ...]]
    metadata: dict[str, str]  # relative metadata file -> SHA-256 (those the record names)
    reads: list[RowRead] = field(default_factory=list)  # rows to read straight into place
    late: list[RowRead] = field(default_factory=list)  # overlay rows: after ``reads`` under them
    whole: set[str] = field(default_factory=set)  # blobs it holds whole, to read as they are
    overlays: set[str] = field(default_factory=set)  # blobs whose overlay to read


class _Part:
    """What one group holds of a blob: whole, a span, an overlay (any of the last two)."""

    def __init__(self, source: _Source, name: str) -> None:
        manifest = source.manifest
        self.source = source
        self.whole: BlobInfo | None = manifest.stored_blobs.get(name)
        self.span = manifest.spans.get(name)
        self.overlay = manifest.overlays.get(name)
        self.needs_overlay = False  # some of the overlay's rows may be no newer group's

    @property
    def empty(self) -> bool:
        return self.whole is None and self.span is None and self.overlay is None

    def dense(self, rows: int) -> list[tuple[int, int]]:
        """The rows it holds as consecutive rows: all (whole), its span's, or none."""
        if self.whole is not None:
            return [(0, rows)]
        return [(self.span[0], self.span[0] + self.span[1].shape[0])] if self.span else []


def read_chained(store: ReadableStore, record: CommitRecord, manifest: Manifest,
                 names: list[str], window: tuple[int, int] | None = None
                 ) -> dict[str, np.ndarray]:
    """Rebuild the blobs ``names`` of ``record``'s differential save (whose verified manifest
    is ``manifest``): every group's manifest; the packed copies and the overlays' row ids
    (small); then every span and whole array, straight into place, while the overlays are
    planned; then each overlay chunk holding rows to copy, as soon as the spans and whole
    arrays under those rows are in place (:class:`~caffe2ckpt.store.read.rounds.Rounds`); then each
    blob's digest is checked.

    With ``window`` (``[start, stop)`` rows along axis 0), only those rows of each blob are
    read and rebuilt: every chunk and manifest read is checked as ever, but the blob's digest,
    which covers all its rows, is checked only when the window is the whole blob."""
    reader = _Reader(store, record, manifest)
    direct, builds = _plan(reader, names, window)
    fetched = reader.fetch()  # small: packed copies, overlays' row ids
    with Rounds() as rounds, reader.naming_this_save():
        rounds.first(reader.calls("reads"))  # spans and whole arrays, straight into place
        for build in builds:  # planned meanwhile
            build.plan_overlays(fetched)
            build.copy_packed(fetched)
        rounds.then(reader.calls("late"))  # overlays' rows, copied in as read
        rounds.finish()
    out = {name: fetched[(id(part.source), name)] for name, part in direct.items()}
    out.update({build.name: build.finish() for build in builds})
    return out


def _plan(reader: _Reader, names: list[str], window: tuple[int, int] | None
          ) -> tuple[dict[str, _Part], list[_Build]]:
    """The blobs one older group holds whole (read as they are, by part; not with a
    ``window``) and the others' builds, their reads planned."""
    direct, builds = {}, []
    for name in names:
        parts = reader.parts(name)
        if window is None and len(parts) == 1 and parts[0].whole is not None:
            direct[name] = parts[0]
            parts[0].source.whole.add(name)
        else:
            _plan_reads(name, parts, reader.manifest.inherited[name].info)
            builds.append(_Build(reader, name, parts, window))
    return direct, builds


def _plan_reads(name: str, chain: list[_Part], info: BlobInfo) -> None:
    """Which packed copies and overlays of ``chain`` (newest first) a rebuild of ``name``
    reads: every packed copy, and every overlay but those whose rows all lie in spans (or a
    whole copy) of newer groups or in their own group's span (a save's overlay holds only rows
    outside its span): the oldest group of a full chain's, whose rows every newer span took."""
    rows = info.shape[0] if info.shape else 1
    covered: list[tuple[int, int]] = []
    for part in chain:
        if part.overlay is not None and not _covers(covered + part.dense(rows), rows):
            part.needs_overlay = True
            part.source.overlays.add(name)
        if part.whole is not None and part.whole.path is None:
            part.source.whole.add(name)
        covered += part.dense(rows)


def _covers(intervals: list[tuple[int, int]], rows: int) -> bool:
    """Whether ``intervals`` (``[start, stop)``, in any order) cover rows ``0 .. rows - 1``."""
    reached = 0
    for start, stop in sorted(intervals):
        if start > reached:
            return False
        reached = max(reached, stop)
    return reached >= rows


class _Reader:
    """Reads the groups of one record's chains, naming the record's node and epoch in errors."""

    def __init__(self, store: ReadableStore, record: CommitRecord, manifest: Manifest) -> None:
        self.store, self.record, self.manifest = store, record, manifest
        delta = record.delta
        assert delta is not None
        self.own = _Source(record.group, manifest, record.crcs, record.metadata)
        self._groups = delta.groups
        self._sources: dict[int, _Source] = {}

    def damage(self, blob: str, group: str, why: str) -> CheckpointCorruptedError:
        record = self.record
        return CheckpointCorruptedError(
            f"checkpoint of node {record.node!r} epoch {record.epoch} (save "
            f"{record.save_id!r}): blob {blob!r}, from "
            f"{self.store.location.display(group)!r}: {why}", node=record.node,
            epoch=record.epoch, blob=blob)

    def parts(self, name: str) -> list[_Part]:
        """What each group of ``name``'s chain holds of it, newest first (the own group's
        part first, when it holds one)."""
        chain = self.record.delta.chains[name]  # type: ignore[union-attr]
        self._load_sources(chain)
        logical = self.manifest.inherited[name].info
        parts = [] if (own := _Part(self.own, name)).empty else [own]
        for index in reversed(chain):
            part = _Part(self._sources[index], name)
            self._check_part(part, name, logical)
            parts.append(part)
        return parts

    def _check_part(self, part: _Part, name: str, logical: BlobInfo) -> None:
        """A group of the chain holds the blob as this save describes it."""
        source = part.source
        held = part.whole
        if held is None and not part.empty:  # a span or an overlay: of the blob it describes
            held = source.manifest.inherited[name].info
        if held is None or (held.dtype, held.shape, held.order) != (
                logical.dtype, logical.shape, logical.order):
            raise self.damage(name, source.group, "that group does not hold the blob as this "
                              "save describes it")

    def _load_sources(self, chain: tuple[int, ...]) -> None:
        """The manifests of the groups ``chain`` names that are not read yet, read at once."""
        missing = [i for i in chain if i not in self._sources]
        if not missing:
            return
        manifests = list(read_pool().map(lambda i: self._source(self._groups[i]), missing))
        for index, manifest in zip(missing, manifests):
            group = self._groups[index]
            self._sources[index] = _Source(group.group, manifest, group.crcs, group.metadata)

    def _source(self, group: ChainGroup) -> Manifest:
        return self.store.group_manifest(group.group, group.metadata.get(GROUP_FILE),
                                         group.save_id, node=self.record.node,
                                         epoch=self.record.epoch)

    def _all_sources(self) -> list[_Source]:
        return [self.own, *self._sources.values()]

    def fetch(self) -> dict[tuple[int, str], Any]:
        """Every source's packed blobs and overlays' row ids asked for, read at once (one read
        per group): ``(id(source), blob)`` -> the blob, or its overlay's row ids."""
        calls = [(s, self._fetch_one) for s in self._all_sources() if s.whole or s.overlays]
        out: dict[tuple[int, str], Any] = {}
        if not calls:
            return out
        for part in results([read_pool().submit(fn, source) for source, fn in calls]):
            out.update(part)  # (the first failure, in chain order, is raised)
        return out

    def _fetch_one(self, source: _Source) -> dict[tuple[int, str], Any]:
        out: dict[tuple[int, str], Any] = {}
        manifest, location = source.manifest, self.store.location
        path = location.path(source.group)
        with self.naming_this_save():
            if source.whole:
                names = sorted(source.whole)
                paths = {manifest.stored_blobs[n].path or PACKED_ARRAY for n in names}
                blobs = read_node(location, path, manifest,
                                  self._crcs(source, paths, names[0]), names,
                                  metadata=_files(source, paths))
                out.update({(id(source), n): blobs[n] for n in names})
            if source.overlays:
                names = sorted(source.overlays)
                infos = [manifest.overlays[n][0] for n in names]
                paths = {info.path for info in infos}
                arrays = read_arrays(location, path, manifest,
                                     self._crcs(source, paths, names[0]),  # type: ignore[arg-type]
                                     infos, metadata=_files(source, paths))  # type: ignore[arg-type]
                out.update({(id(source), n): arrays[manifest.overlays[n][0].path]
                            for n in names})
        return out

    def calls(self, which: str) -> Iterator[tuple[Callable[[], Any], int, Any]]:
        """The reads asked for in ``which`` of each source (``reads``: spans and whole arrays
        straight into place; ``late``: the live rows of overlays), each with the rows it
        writes: its destination (``id`` of the blob's bytes) and, for ``reads``, its
        ``[start, stop)`` pieces; for ``late``, the ``[start, stop)`` holding them (or None)."""
        location = self.store.location
        for source in self._all_sources():
            reads = getattr(source, which)
            if not reads:
                continue
            setattr(source, which, [])
            paths = {read.info.path for read in reads}
            crcs = self._crcs(source, paths, reads[0].info.name)  # type: ignore[arg-type]
            for call, read, pieces in row_calls(location, location.path(source.group),
                                                source.manifest, crcs, reads,
                                                _files(source, paths)):  # type: ignore[arg-type]
                if read is None:  # a metadata check
                    yield call, 0, None if which == "late" else []
                elif isinstance(read.sink, _Scatter):
                    yield call, id(read.sink.flat), read.sink.rows_of(*pieces[0])
                else:
                    yield call, id(read.dest), [(read.offset + a, read.offset + b)
                                                for a, b in pieces]

    def precheck(self, name: str, parts: list[_Part]) -> None:
        """Before a large blob is allocated: the chunk files of the arrays it is read from
        (the spans and whole copies of ``parts``) are there and of their sizes (a crafted
        manifest's claim costs no memory)."""
        wanted = [(p.source, i) for p in parts for i in (p.whole, p.span and p.span[1])
                  if i and i.path]
        location = self.store.location
        with self.naming_this_save():
            for source, info in wanted:
                check_chunk_sizes(location, location.path(source.group), source.manifest,
                                  self._crcs(source, {info.path}, name),  # type: ignore[arg-type]
                                  [info])

    def _crcs(self, source: _Source, paths: set[str], blob: str) -> dict[str, tuple[int, ...]]:
        try:
            return source.manifest.chunk_crcs(source.crcs, only=paths)
        except ValueError as exc:
            raise self.damage(blob, source.group, str(exc)) from exc

    @contextmanager
    def naming_this_save(self) -> Iterator[None]:
        """Damage found in an older group is reported as damage of the checkpoint being
        read (which needs it), with the older group's own message."""
        try:
            yield
        except CheckpointCorruptedError as exc:
            if exc.epoch == self.record.epoch:
                raise
            raise CheckpointCorruptedError(
                f"checkpoint of node {self.record.node!r} epoch {self.record.epoch} (save "
                f"{self.record.save_id!r}) builds on epoch {exc.epoch}, which is damaged: {exc}",
                node=self.record.node, epoch=self.record.epoch, blob=exc.blob,
                blobs=exc.blobs) from exc


def _files(source: _Source, paths: set[str]) -> dict[str, str]:
    """The metadata digests the record gives for the arrays ``paths`` of ``source``."""
    files = {f"{p}/{GROUP_FILE}" for p in paths}
    return {f: d for f, d in source.metadata.items() if f in files}


class _Build:
    """One blob built from its chain (newest part first, see the module docstring): each row
    is read once, straight into place, from the newest span or whole copy holding it; then
    the overlays' rows are copied in (:class:`_Scatter`), each row from one overlay at most:
    the newest holding it, where it is newer than that span. Every row must be in some span or
    whole copy, checked before anything is allocated."""

    def __init__(self, reader: _Reader, name: str, parts: list[_Part],
                 window: tuple[int, int] | None = None) -> None:
        self.reader, self.name, self.parts = reader, name, parts
        self.info = reader.manifest.inherited[name].info
        dtype, shape = stored_spec(self.info)
        rows, self.cols = (shape[0], math.prod(shape[1:])) if shape else (1, 1)
        self.rows = rows
        self.lo, self.hi = window if window is not None else (0, rows)
        if not 0 <= self.lo <= self.hi <= rows or (window is not None and not shape):
            raise ValueError(f"rows {self.lo}..{self.hi} are not rows of blob {name!r}")
        # (start, stop, age of its part), ascending, within the window
        self.dense = [(max(a, self.lo), min(b, self.hi), age) for a, b, age in self._assign()
                      if a < self.hi and b > self.lo]
        count = self.hi - self.lo
        if needs_precheck(reader.store.location, count * self.cols * dtype.itemsize):
            reader.precheck(name, parts)
        self.data = destination(reader.store.location, (count, *shape[1:]) if shape else shape,
                                dtype)
        self.flat = self.data.reshape(count, self.cols).view(np.uint8)
        for age, part in enumerate(parts):
            if part.whole is not None and part.whole.path is None:
                continue  # a packed copy: read already, copied in finish()
            info, offset = (part.whole, 0) if part.whole is not None else (
                part.span[1] if part.span else None, part.span[0] if part.span else 0)
            wanted = [(a - offset, b - offset) for a, b, held in self.dense if held == age]
            if wanted:  # one read per array, however many intervals of it are wanted
                part.source.reads.append(RowRead(
                    info, self.flat, offset - self.lo, wanted))  # type: ignore[arg-type]

    def _assign(self) -> list[tuple[int, int, int]]:
        """Which part's span or whole copy each row is read from (the newest holding it), as
        intervals; damage unless they cover every row."""
        covered: list[tuple[int, int]] = []
        out = []
        for age, part in enumerate(self.parts):
            for start, stop in part.dense(self.rows):
                out += [(a, b, age) for a, b in _minus((start, stop), covered)]
                covered = _union(covered, (start, stop))
        if not _covers(covered, self.rows):
            held = sum(b - a for a, b in covered)
            raise self.reader.damage(self.name, self.reader.record.group,
                                     f"its chain holds {held} of its {self.rows} rows in spans "
                                     "or whole copies")
        return sorted(out)

    def copy_packed(self, fetched: dict[tuple[int, str], Any]) -> None:
        """Copy the rows a packed copy gives (read whole beside the spans)."""
        for start, stop, age in self.dense:
            part = self.parts[age]
            if part.whole is not None and part.whole.path is None:
                stored = stored_form(np.ascontiguousarray(fetched[(id(part.source), self.name)]))
                self.flat[start - self.lo:stop - self.lo] = stored.reshape(
                    self.rows, self.cols).view(np.uint8)[start:stop]

    def plan_overlays(self, fetched: dict[tuple[int, str], Any]) -> None:
        """Given each overlay's row ids, newest first: the rows it gives (no newer span, whole
        copy or overlay holds them: each row is taken from one overlay at most), and the reads
        of the chunks holding their values, for the second round (copied into place as read).
        Nothing is allocated: a crafted overlay costs reads, checked chunk by chunk."""
        starts = np.array([start for start, _, _ in self.dense])
        ages = np.array([age for _, _, age in self.dense])
        taken = np.zeros(self.hi - self.lo, bool)
        for age, part in enumerate(self.parts):
            if not part.needs_overlay:
                continue
            ids = fetched[(id(part.source), self.name)]
            self._check(part.source.group, ids)
            first, stop = np.searchsorted(ids, (self.lo, self.hi))  # ascending: one run inside
            rows = ids[first:stop] - self.lo
            # the age of the span or whole copy each row is read from: the newest holding it
            held = np.diff(np.searchsorted(rows, starts - self.lo), append=rows.size)
            take = np.repeat(ages, held) > age
            take &= ~taken[rows]
            if not take.any():
                continue
            given = rows[take]
            taken[given] = True
            info = part.overlay[1]  # type: ignore[index]
            values = np.flatnonzero(take) + first  # the overlay's value rows given
            part.source.late.append(RowRead(info, None, 0, _chunks(values, info.chunk_rows),
                                            sink=_Scatter(self.flat, values, given)))

    def finish(self) -> np.ndarray:
        """The blob (its window's rows), once its digest is the one recorded at save time
        (checked when the window is the whole blob)."""
        record = self.reader.record
        whole = (self.lo, self.hi) == (0, self.rows)
        if whole and stored_digest(self.data) != record.delta.digests[  # type: ignore[union-attr]
                self.name]:
            raise self.reader.damage(self.name, record.group, "rebuilt from the saves it "
                                     "builds on, it differs from what was saved (a damaged or "
                                     "wrong source)")
        info = self.info if whole else self.info._replace(
            shape=(self.hi - self.lo, *self.info.shape[1:]))
        return restored(self.data, info)

    def _check(self, group: str, ids: np.ndarray) -> None:
        """An overlay's row ids fit the blob: ascending, within its rows."""
        if ids.ndim != 1 or ids.size and (ids[0] < 0 or ids[-1] >= self.rows
                                          or np.any(ids[1:] <= ids[:-1])):
            raise self.reader.damage(self.name, group, "its row overlay does not fit the blob")


class _Scatter:
    """Copies an overlay's taken rows into place (rows of ``flat``, a blob's bytes) as each
    chunk of its values is read: value row ``taken[i]`` is row ``rows[i]`` of the blob
    (``taken`` and ``rows`` ascending; rows disjoint from any other overlay's, so chunks may
    land in any order, on any thread)."""

    def __init__(self, flat: np.ndarray, taken: np.ndarray, rows: np.ndarray) -> None:
        self.flat, self.dest, self.taken, self.rows = flat, _as_rows(flat), taken, rows

    def rows_of(self, first: int, stop: int) -> tuple[int, int] | None:
        """The ``[start, stop)`` rows of the blob holding those the value rows ``first ..
        stop - 1`` give (None: they give none)."""
        lo, hi = np.searchsorted(self.taken, (first, stop))
        return (int(self.rows[lo]), int(self.rows[hi - 1]) + 1) if hi > lo else None

    def __call__(self, first: int, chunk: np.ndarray) -> None:
        lo, hi = np.searchsorted(self.taken, (first, first + chunk.shape[0]))
        if hi <= lo:
            return
        start, stop = int(self.taken[lo]) - first, int(self.taken[hi - 1]) - first + 1
        values = _as_rows(chunk)
        # rows taken one after another (most, in young overlays): a view, not a gathered copy
        values = values[start:stop] if stop - start == hi - lo else values[
            self.taken[lo:hi] - first]
        self.dest[self.rows[lo:hi]] = values


def _minus(interval: tuple[int, int], covered: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The parts of ``interval`` outside ``covered`` (sorted, disjoint intervals)."""
    start, stop = interval
    out = []
    for a, b in covered:
        if b <= start or a >= stop:
            continue
        if a > start:
            out.append((start, a))
        start = max(start, b)
    if start < stop:
        out.append((start, stop))
    return out


def _union(covered: list[tuple[int, int]], interval: tuple[int, int]) -> list[tuple[int, int]]:
    """``covered`` with ``interval`` added, merged (sorted, disjoint)."""
    out: list[tuple[int, int]] = []
    for a, b in sorted([*covered, interval]):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        elif b > a:
            out.append((a, b))
    return out


def _chunks(rows: np.ndarray, chunk_rows: int) -> list[tuple[int, int]]:
    """The chunks of ``chunk_rows`` rows holding ``rows`` (ascending), as ``[start, stop)`` row
    intervals (sorted, disjoint): what a :class:`RowRead` with a sink reads."""
    chunks = rows // chunk_rows
    chunks = chunks[np.flatnonzero(np.diff(chunks, prepend=-1))]  # ascending: each once
    return [(int(c) * chunk_rows, (int(c) + 1) * chunk_rows) for c in chunks]


def _as_rows(flat: np.ndarray) -> np.ndarray:
    """A (rows, bytes) uint8 array as one item per row (copied a row at a time, not a byte)."""
    if not flat.shape[1]:
        return flat
    return flat.view(np.dtype((np.void, flat.shape[1]))).reshape(flat.shape[0])
