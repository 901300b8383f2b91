"""Elastic restores: the blobs of a save made by N nodes, as M nodes hold them under a new split.

The save's records say how its blobs were spread (:class:`~caffe2ckpt.sharding.SavedLayout`):
the node order, the partition, which blobs are split by rows and which are replicated. Each
``rows`` blob's global array is what the reference defines (the old nodes' rows put back in
their global places: concatenated for ``range``, interleaved for ``mod``), split anew over the
new nodes (:func:`~caffe2ckpt.sharding.new_rows`); a replicated blob is read once, from the
node of the old order that wrote it, and given to every new node if every old node held it,
else (held by some, such as an epoch counter on the first node) to the first new node; a local
blob cannot move and is refused before anything is read.

What is read: the rows a new node takes of an old node, when they are consecutive there, are
read alone: straight from the chunks holding them into place (``range`` to ``range``, an array
the old group stores whole: :func:`~caffe2ckpt.store.groupread.row_reads`, the rows asked for
plus the rest of the first and last chunk), else into a buffer of their own and copied (a
differential save's blob is rebuilt from its chain for those rows only; a small packed blob is
read whole). Rows an old node holds every k-th of (to or from a ``mod`` split that does not
line up) are copied out of each chunk of that node's array as the chunk is read, into a buffer
of its own, to every new node of the call taking rows of it: each chunk read once, by the I/O
threads, with no copy of the whole blob. When the nodes of one process are restored by calls
sharing their reads (a session's), or the old array cannot be read in place (packed, rebuilt
from a differential chain, Fortran order, big-endian or not numeric), that node's whole blob is
read once per process instead, and the rows copied out of it. Every byte read is
checked as any restore checks it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from caffe2ckpt.errors import CheckpointCorruptedError, CheckpointNotFoundError, JobDefinitionError
from caffe2ckpt.fs.iopool import pool
from caffe2ckpt.sharding import (
    LOCAL,
    REPLICATED,
    ROWS,
    SavedLayout,
    new_rows,
    old_rows,
    orders_of,
    overlap,
)
from caffe2ckpt.store.groupread import RowRead, destination, row_reads
from caffe2ckpt.store.manifest import BlobInfo, Manifest
from caffe2ckpt.store.records import CommitRecord
from caffe2ckpt.store.rounds import run_reads
from caffe2ckpt.store.rowread import load_rows
from caffe2ckpt.store.shared import SharedReads
from caffe2ckpt.store.zarrgroup import GROUP_FILE
from caffe2ckpt.units import nodes_text

if TYPE_CHECKING:
    from caffe2ckpt.store.protocol import CheckpointStore

__all__ = ["read_shares", "saved_layout", "share_infos", "shared_names"]


def saved_layout(records: dict[str, CommitRecord]) -> SavedLayout | None:
    """The layout one save's records agree on (None: saved without one)."""
    layouts = [r.layout for r in records.values()]
    if any(layout is None for layout in layouts):
        return None
    first = layouts[0]
    assert first is not None
    if any((lay.partition, lay.order) != (first.partition, first.order) for lay in layouts  # type: ignore[union-attr]
           ) or sorted(first.order) != sorted(records):
        record = next(iter(records.values()))
        raise CheckpointCorruptedError(
            f"epoch {record.epoch} (save {record.save_id!r}): its nodes' records disagree on "
            "the layout (node order or partition)", node=record.node, epoch=record.epoch,
            blob="layout")
    return first


def shared_names(store: CheckpointStore, records: dict[str, CommitRecord],
                 order: Sequence[str]) -> dict[str, list[str]]:
    """The blobs of the save ``records`` each of the nodes ``order`` restores a share or a
    copy of (read from the manifests only), by node.

    Raises:
        JobDefinitionError: the save holds local blobs (or has no layout): refused before
            anything is read or written.
    """
    reader = _Reshard(store, records, list(order), "range", SharedReads())
    kinds = reader.blobs(None)
    return {node: sorted(n for n, k in kinds.items()
                         if k == ROWS or node in reader.receivers(n)) for node in order}


def share_infos(store: CheckpointStore, records: dict[str, CommitRecord], order: Sequence[str],
                partition: str) -> dict[str, dict[str, BlobInfo]]:
    """What :func:`read_shares` returns, from the manifests only: each new node's blobs (of
    the nodes ``order`` split by ``partition``) with their dtype, shape and memory order.

    Raises:
        JobDefinitionError: the save holds local blobs (or has no layout).
    """
    reader = _Reshard(store, records, list(order), partition, SharedReads())
    out: dict[str, dict[str, BlobInfo]] = {node: {} for node in order}
    for name, kind in reader.blobs(None).items():
        if kind != ROWS:
            info = reader.manifest(reader.holder(name)).blobs[name]
            for node in reader.receivers(name):
                out[node][name] = info
            continue
        infos = [reader._row_info(node, name) for node in reader.old]
        total = sum(info.shape[0] for info in infos)
        for k, node in enumerate(order):
            rows = len(new_rows(partition, k, len(order), total))
            out[node][name] = infos[0]._replace(shape=(rows, *infos[0].shape[1:]))
    return out


def read_shares(store: CheckpointStore, records: dict[str, CommitRecord], order: Sequence[str],
                partition: str, nodes: Sequence[str] | None = None,
                names: Sequence[str] | None = None, shared: SharedReads | None = None
                ) -> dict[str, dict[str, np.ndarray]]:
    """``{new node: {blob: array}}`` of the save ``records`` (by old node) for the nodes
    ``order`` (the new job's, in its order) split by ``partition``: of ``nodes`` (default all),
    all blobs or only ``names``. What is read whole (see the module docstring) is read once
    per ``shared``.

    Raises:
        JobDefinitionError: the save holds local blobs (or has no layout), which cannot be
            given to another set of nodes.
        CheckpointCorruptedError: the save's records or groups are damaged, or its nodes' rows
            do not fit its layout.
    """
    owned = shared is None  # nobody else takes what this call reads: its last user may keep it
    reader = _Reshard(store, records, list(order), partition, shared or SharedReads())
    reader.streams = owned  # rows every k-th: copied to this call's nodes chunk by chunk
    wanted = list(order) if nodes is None else list(nodes)
    blobs = reader.blobs(names)
    out: dict[str, dict[str, np.ndarray]] = {node: {} for node in wanted}
    direct: list[Callable[[], Any]] = []
    finish: list[Callable[[], None]] = []
    for name, kind in blobs.items():
        if kind == ROWS:
            finish.append(reader.split(name, wanted, out, direct))
    run_reads(direct)
    for step in finish:
        step()
    for name in (name for name, kind in blobs.items() if kind == REPLICATED):
        receivers = [node for node in wanted if node in reader.receivers(name)]
        for node, value in zip(receivers, reader.copies(name, len(receivers), owned)):
            out[node][name] = value
    return out


class _Reshard:
    """One elastic read of one save (see the module docstring)."""

    def __init__(self, store: CheckpointStore, records: dict[str, CommitRecord],
                 order: list[str], partition: str, shared: SharedReads) -> None:
        self.store, self.records, self.order, self.partition = store, records, order, partition
        self.shared = shared
        self.streams = False  # strided rows of an old array: scattered as each chunk is read
        self.record = next(iter(records.values()))
        layout = saved_layout(records)
        self.layouts = {node: r.layout for node, r in records.items()}
        self.old = list(layout.order) if layout is not None else sorted(records)
        self.old_partition = layout.partition if layout is not None else "range"
        self._manifests: dict[str, Manifest] = {}

    def manifest(self, node: str) -> Manifest:
        if node not in self._manifests:
            self._manifests[node] = self.store.manifest(self.records[node])
        return self._manifests[node]

    def damage(self, node: str, blob: str, why: str) -> CheckpointCorruptedError:
        record = self.records[node]
        return CheckpointCorruptedError(
            f"checkpoint {self.store.where(record)!r} (node {node!r}, epoch {record.epoch}): "
            f"blob {blob!r}: {why}", node=node, epoch=record.epoch, blob=blob)

    def blobs(self, names: Sequence[str] | None) -> dict[str, str]:
        """Each blob asked for, with its kind; refused when any is local."""
        kinds: dict[str, str] = {}
        for node in self.old:
            layout = self.layouts[node]
            for name in self.manifest(node).blobs:
                if names is None or name in names:
                    kind = LOCAL if layout is None else layout.kind(name)
                    kinds[name] = LOCAL if kinds.get(name, kind) != kind else kind
        missing = sorted(set(names or ()) - set(kinds))
        if missing:
            raise CheckpointNotFoundError(f"epoch {self.record.epoch} under "
                                          f"{self.store.location.display()!r} has no blobs "
                                          f"{missing}")
        local = sorted(n for n, k in kinds.items() if k == LOCAL)
        if local:
            raise JobDefinitionError(self._refusal(local))
        return kinds

    def _refusal(self, local: list[str]) -> str:
        how = ("it was saved without a layout" if self.layouts[self.old[0]] is None
               else f"blobs {local[:10]}{' ...' if len(local) > 10 else ''} are local to "
               "their nodes")
        return (f"epoch {self.record.epoch} under {self.store.location.display()!r} was saved "
                f"by {nodes_text(len(self.old))} {self.old}; it cannot be restored on "
                f"{nodes_text(len(self.order))} {self.order}: {how}. Declare how each blob is "
                "spread when saving: caffe2ckpt.Layout(rows=[...]) for blobs split along axis 0 "
                "across the nodes, replicated=[...] for blobs every node holds alike; or resume "
                "on the nodes that saved it")

    def holder(self, name: str) -> str:
        """The old node that wrote the replicated blob ``name``."""
        return next(n for n in self.old if name in self.manifest(n).blobs)

    def receivers(self, name: str) -> list[str]:
        """The new nodes given the replicated blob ``name``: all, if every old node held it;
        else (held by some, such as an epoch counter on the first node) the first."""
        everywhere = all(name in self.manifest(n).blobs or name in (
            self.layouts[n].written_by if self.layouts[n] else {}) for n in self.old)
        return self.order if everywhere else self.order[:1]

    def copies(self, name: str, count: int, owned: bool) -> list[np.ndarray]:
        """``count`` arrays of the replicated blob ``name`` (read once, from its writer): copies
        made at once, the last the array read itself when this read ``owned`` it."""
        value = self.whole(self.holder(name), name)
        copies = list(pool().map(lambda _: value.copy(), range(count - 1 if owned else count)))
        return [*copies, value][:count]

    def whole(self, node: str, name: str) -> np.ndarray:
        """Old node ``node``'s blob ``name``, read whole once per ``shared`` (never written
        into: its rows are copied out)."""
        record = self.records[node]
        return self.shared.get((self.store.location.url, record.save_id, node, name),
                               lambda: self.store.load_node(record, [name],
                                                            manifest=self.manifest(node))[name])

    def split(self, name: str, wanted: list[str], out: dict[str, dict[str, np.ndarray]],
              direct: list[Callable[[], Any]]) -> Callable[[], None]:
        """Allocate each wanted new node's share of the rows blob ``name``, add the reads
        straight into place to ``direct``, and return what copies the other rows once those
        reads ran."""
        infos = [self._row_info(node, name) for node in self.old]
        first = infos[0]
        orders = orders_of([(i.shape, i.order) for i in infos])
        if len(orders) > 1:
            raise self.damage(self.old[0], name, "its nodes hold their rows in both C and "
                              "Fortran order")
        try:
            sources = old_rows(self.old_partition, [i.shape[0] for i in infos])
        except ValueError as exc:
            raise self.damage(self.old[0], name, str(exc)) from exc
        total = sum(len(r) for r in sources)
        copies: list[tuple[str, np.ndarray, range, range]] = []
        scattered: dict[str, list[tuple[np.ndarray, range, range]]] = {}
        for node in wanted:
            target = new_rows(self.partition, self.order.index(node), len(self.order), total)
            dest = destination(self.store.location, (len(target), *first.shape[1:]),
                               np.dtype(first.dtype))
            out[node][name] = dest
            for old, info, source in zip(self.old, infos, sources):
                pair = overlap(source, target)
                if pair is None:
                    continue
                if not self._readable(old, info):
                    copies.append((old, dest, *pair))
                elif pair[0].step == 1 and pair[1].step == 1:
                    direct.extend(self._direct(old, info, dest, *pair))
                elif self.streams:
                    scattered.setdefault(old, []).append((_flat(dest), *pair))
                else:
                    copies.append((old, dest, *pair))
        for old, jobs in scattered.items():
            direct.extend(self._scatter(old, name, jobs))

        def finish() -> None:
            for old, dest, src, dst in copies:
                dest[_slice(dst)] = self._rows(old, name, src)
            if orders == {"F"}:
                for node in wanted:
                    out[node][name] = np.asfortranarray(out[node][name])
        return finish

    def _scatter(self, node: str, name: str, jobs: list[tuple[np.ndarray, range, range]]
                 ) -> list[Callable[[], Any]]:
        """The reads that copy, for each job ``(dest, src, dst)``, old node ``node``'s rows
        ``src`` of blob ``name`` to rows ``dst`` of ``dest`` (its rows as bytes): each chunk
        holding any is read once, into a buffer of its own, and its rows copied to every job
        taking some (on the I/O thread that read it, while the chunk is in the CPU's cache)."""
        low = min(src.start for _, src, _ in jobs)
        high = max(src[-1] + 1 for _, src, _ in jobs)

        def sink(start: int, rows: np.ndarray) -> None:
            for job in jobs:
                _copy_rows(job, rows, start, start + len(rows))
        return self._reads(node, name, RowRead(self.manifest(node).stored_blobs[name], None, 0,
                                               [(low, high)], sink))

    def _rows(self, node: str, name: str, rows: range) -> np.ndarray:
        """Rows ``rows`` of old node ``node``'s blob ``name``: consecutive ones read alone
        (:func:`~caffe2ckpt.store.rowread.load_rows`), every k-th one (a
        ``mod`` split) out of the whole blob, read once per ``shared``."""
        if rows.step == 1:
            return load_rows(self.store, self.records[node], name, rows.start, rows.stop)
        return self.whole(node, name)[_slice(rows)]

    def _row_info(self, node: str, name: str) -> BlobInfo:
        info = self.manifest(node).blobs.get(name)
        if info is None or not info.shape:
            raise self.damage(node, name, "its layout splits it by rows, but that node "
                              "holds no such blob with rows")
        first = self.manifest(self.old[0]).blobs.get(name)
        if first is not None and (info.dtype, info.shape[1:]) != (first.dtype, first.shape[1:]):
            raise self.damage(node, name, f"its rows ({info.dtype}, {info.shape}) do not fit "
                              f"those of node {self.old[0]!r} ({first.dtype}, {first.shape})")
        return info

    def _readable(self, node: str, info: BlobInfo) -> bool:
        """Whether rows of ``info`` are read straight into place: an array of its own in the
        old group (not packed, not built from older saves), stored as it is restored."""
        dtype = np.dtype(info.dtype)
        stored = self.manifest(node).stored_blobs.get(info.name)
        return (stored is not None and stored.path is not None and dtype.kind in "biufc"
                and dtype.byteorder != ">" and info.order == "C")

    def _direct(self, node: str, info: BlobInfo, dest: np.ndarray, src: range,
                dst: range) -> list[Callable[[], Any]]:
        stored = self.manifest(node).stored_blobs[info.name]
        return self._reads(node, info.name, RowRead(stored, _flat(dest), dst.start - src.start,
                                                    [(src.start, src.stop)]))

    def _reads(self, node: str, name: str, read: RowRead) -> list[Callable[[], Any]]:
        """The chunk reads of ``read`` (of old node ``node``'s own array of blob ``name``),
        with its ``zarr.json`` checked."""
        record, manifest = self.records[node], self.manifest(node)
        path = manifest.stored_blobs[name].path
        crcs = self.store.chunk_crcs(record, manifest)
        files = {f"{path}/{GROUP_FILE}"}
        metadata = {f: d for f, d in record.metadata.items() if f in files}
        return list(row_reads(self.store.location, self.store.group_path(record), manifest,
                              {path: crcs[path]}, [read], metadata))  # type: ignore[index]


def _copy_rows(job: tuple[np.ndarray, range, range], window: np.ndarray, start: int,
               stop: int) -> None:
    """The rows of ``window`` (rows ``[start, stop)`` of an old node's blob) that job ``(dest,
    src, dst)`` takes: those of ``src`` in the window, to their rows ``dst`` of ``dest``."""
    dest, src, dst = job
    first = max(0, -(-(start - src.start) // src.step))
    last = min(len(src), -(-(stop - src.start) // src.step))
    if first < last:
        dest[_slice(dst[first:last])] = window[_slice(range(
            src[first] - start, src[last - 1] - start + 1, src.step))]


def _flat(dest: np.ndarray) -> np.ndarray:
    """``dest`` (C order) as rows of bytes."""
    return dest.reshape(dest.shape[0], -1).view(np.uint8)


def _slice(rows: range) -> slice:
    return slice(rows.start, rows.stop, rows.step)
