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
the old group stores whole: :func:`~caffe2ckpt.store.read.group.row_reads`, the rows asked for
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

A job may also declare a blob another kind than the save did (``kinds``, decided by
:func:`~caffe2ckpt.history.placement.place`): a blob saved replicated and declared ``rows`` is
its one value cut over the new nodes; one saved ``rows`` and declared replicated is its global
array, put back together once and copied to every new node. A local blob stays with its node
when the nodes and their order are the save's (a kind changed elsewhere), and is refused
otherwise.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
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
from caffe2ckpt.store.format.manifest import BlobInfo
from caffe2ckpt.store.format.records import CommitRecord
from caffe2ckpt.store.format.zarrgroup import GROUP_FILE
from caffe2ckpt.store.read.group import RowRead, destination, row_reads
from caffe2ckpt.store.read.rounds import run_reads
from caffe2ckpt.units import nodes_text

if TYPE_CHECKING:
    from caffe2ckpt.store.read.source import SavedSource

__all__ = ["GLOBAL", "Reshard", "read_cut", "saved_layout"]

GLOBAL = "\0global"  # the "node" a rows blob is put back together for (never a node's name)


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


def read_cut(reader: SavedSource, order: Sequence[str], partition: str,
             nodes: Sequence[str] | None = None, names: Sequence[str] | None = None,
             kinds: Mapping[str, str] | None = None) -> dict[str, dict[str, np.ndarray]]:
    """``{new node: {blob: array}}`` of ``reader``'s save for the nodes ``order`` (the new
    job's, in its order) split by ``partition``: of ``nodes`` (default all), all blobs or only
    ``names``. ``kinds``: the blobs the job declares another kind than the save did, with the
    job's kind (see the module docstring). What is read whole is read once per the reader's
    shared reads.

    Raises:
        JobDefinitionError: the save holds local blobs (or has no layout) and the nodes or
            their order differ, or a blob saved as a single value is declared rows.
        CheckpointCorruptedError: the save's records or groups are damaged, or its nodes' rows
            do not fit its layout.
    """
    reshard = Reshard(reader, list(order), partition, kinds)
    reshard.streams = reader.owned  # rows every k-th: copied to this call's nodes chunk by chunk
    wanted = list(order) if nodes is None else list(nodes)
    blobs = reshard.blobs(names)
    out: dict[str, dict[str, np.ndarray]] = {node: {} for node in wanted}
    direct: list[Callable[[], Any]] = []
    finish: list[Callable[[], None]] = []
    for name, kind in blobs.items():
        if kind == ROWS and reshard.kinds.get(name) != REPLICATED:
            finish.append(reshard.split(name, reshard.targets(wanted, name), out, direct))
    run_reads(direct)
    for step in finish:
        step()
    for name, kind in blobs.items():
        receivers = [node for node in wanted if node in reshard.receivers(name)]
        if not receivers or (kind == ROWS and name not in reshard.kinds):
            continue
        if kind == LOCAL:
            for node in receivers:
                out[node][name] = reshard.own(node, name)
            continue
        value = reshard.global_array(name) if kind == ROWS else reshard.whole(
            reshard.holder(name), name)
        reshard.give(name, value, receivers, out, reader.owned)
    return out


class Reshard:
    """One elastic read of one save (see the module docstring)."""

    def __init__(self, reader: SavedSource, order: list[str], partition: str,
                 kinds: Mapping[str, str] | None = None) -> None:
        self.reader, self.store, self.records = reader, reader.store, reader.records
        self.order, self.partition, self.shared = order, partition, reader.shared
        self.streams = False  # strided rows of an old array: scattered as each chunk is read
        self.record = next(iter(self.records.values()))
        layout = saved_layout(self.records)
        self.layouts = {node: r.layout for node, r in self.records.items()}
        self.old = list(layout.order) if layout is not None else sorted(self.records)
        self.old_partition = layout.partition if layout is not None else "range"
        self.kinds = dict(kinds or {})  # blob -> the job's kind, where it is not the save's
        self.saved: dict[str, str] = {}  # blob -> its kind in the save (see blobs())
        self.manifest = reader.manifest
        self._sourced: dict[str, tuple[list[BlobInfo], list[range], int]] = {}

    def damage(self, node: str, blob: str, why: str) -> CheckpointCorruptedError:
        record = self.records[node]
        return CheckpointCorruptedError(
            f"checkpoint {self.store.where(record)!r} (node {node!r}, epoch {record.epoch}): "
            f"blob {blob!r}: {why}", node=node, epoch=record.epoch, blob=blob)

    def blobs(self, names: Sequence[str] | None) -> dict[str, str]:
        """Each blob asked for, with its kind in the save (:attr:`kinds` says where the job's
        differs); refused (before any data is read) when a local blob would have to move or a
        single value is declared rows."""
        for node in self.old:
            layout = self.layouts[node]
            for name in self.manifest(node).blobs:
                if names is None or name in names:
                    kind = LOCAL if layout is None else layout.kind(name)
                    self.saved[name] = LOCAL if self.saved.get(name, kind) != kind else kind
        missing = sorted(set(names or ()) - set(self.saved))
        if missing:
            raise CheckpointNotFoundError(f"epoch {self.record.epoch} under "
                                          f"{self.store.location.display()!r} has no blobs "
                                          f"{missing}")
        local = sorted(n for n, k in self.saved.items() if k == LOCAL)
        if local and self.order != self.old:
            raise JobDefinitionError(self._refusal(local))
        for name, kind in self.saved.items():
            if kind == REPLICATED and self.kinds.get(name) == ROWS:
                self._check_cut(name)
            elif kind == REPLICATED:
                self.receivers(name)  # refused here when it has nowhere to go
        return dict(self.saved)

    def _check_cut(self, name: str) -> None:
        """A replicated blob the job declares rows needs an axis 0 to be cut along."""
        info = self.manifest(self.holder(name)).blobs[name]
        if not info.shape:
            raise JobDefinitionError(
                f"epoch {self.record.epoch} under {self.store.location.display()!r}: blob "
                f"{name!r} was saved replicated as a single value (shape ()); the job's layout "
                "declares it rows, which needs an axis 0 to split: declare it replicated")

    def _refusal(self, local: list[str]) -> str:
        how = ("it was saved without a layout" if self.layouts[self.old[0]] is None
               else f"blobs {local[:10]}{' ...' if len(local) > 10 else ''} are local to "
               "their nodes")
        return (f"epoch {self.record.epoch} under {self.store.location.display()!r} was saved "
                f"by {nodes_text(len(self.old))} {self.old}; it cannot be restored on "
                f"{nodes_text(len(self.order))} {self.order}: {how}. Declare how each blob is "
                "spread when saving: caffe2ckpt.Layout(rows=[...]) for blobs split along axis 0 "
                "across the nodes, replicated=[...] for blobs every node holds alike; or resume "
                "on the nodes that saved it, in the same order")

    def holder(self, name: str) -> str:
        """The old node that wrote the replicated blob ``name``."""
        return next(n for n in self.old if name in self.manifest(n).blobs)

    def receivers(self, name: str) -> list[str]:
        """The new nodes given the blob ``name``: all, for a blob the job declares rows and
        for one every old node held; a replicated blob held by some (an epoch counter on the
        first node) to the new nodes at the holders' positions in the order (the first to the
        first); a local blob, its own node."""
        saved, kind = self.saved[name], self.kinds.get(name)
        if saved == LOCAL:
            return [n for n in self.order if name in self.manifest(n).blobs]
        if saved == ROWS or kind == ROWS:
            return self.order
        holders = [k for k, n in enumerate(self.old) if name in self.manifest(n).blobs
                   or name in (self.layouts[n].written_by if self.layouts[n] else {})]
        if len(holders) == len(self.old):
            return self.order
        kept = [self.order[k] for k in holders if k < len(self.order)]
        if not kept:
            raise JobDefinitionError(
                f"epoch {self.record.epoch} under {self.store.location.display()!r}: "
                f"replicated blob {name!r} was held only by nodes "
                f"{[self.old[k] for k in holders]} (positions {holders} of {self.old}); the "
                f"job's {nodes_text(len(self.order))} {self.order} have no node at those "
                "positions: hold it on every node, or on the first")
        return kept

    def info_of(self, node: str, name: str) -> BlobInfo:
        """The dtype, shape and order of new node ``node``'s blob ``name`` (manifests only)."""
        saved, kind = self.saved[name], self.kinds.get(name, self.saved[name])
        if saved == LOCAL:
            return self.manifest(node).blobs[name]
        if saved == REPLICATED:
            info = self.manifest(self.holder(name)).blobs[name]
            if kind == ROWS:
                rows = new_rows(self.partition, self.order.index(node), len(self.order),
                                info.shape[0])
                return info._replace(shape=(len(rows), *info.shape[1:]))
            return info
        whole = self.global_info(name)
        if kind == REPLICATED:
            return whole
        rows = new_rows(self.partition, self.order.index(node), len(self.order), whole.shape[0])
        return whole._replace(shape=(len(rows), *whole.shape[1:]))

    def give(self, name: str, value: np.ndarray, receivers: list[str],
             out: dict[str, dict[str, np.ndarray]], owned: bool) -> None:
        """A global array ``value`` (a replicated blob's, read once from its writer, or a rows
        blob's put back together) to ``receivers``: a copy each, in its memory order (the last
        the array itself when this read ``owned`` it), or, declared rows, each its rows."""
        if self.kinds.get(name) == ROWS:
            for node in receivers:
                rows = new_rows(self.partition, self.order.index(node), len(self.order),
                                value.shape[0])
                out[node][name] = value[_slice(rows)].copy(order="K")
            return
        count = len(receivers)
        copies = list(pool().map(lambda _: value.copy(order="K"),
                                 range(count - 1 if owned else count)))
        for node, copy in zip(receivers, [*copies, value]):
            out[node][name] = copy

    def whole(self, node: str, name: str) -> np.ndarray:
        """Old node ``node``'s blob ``name``, read whole once per ``shared`` (never written
        into: its rows are copied out)."""
        record = self.records[node]
        return self.shared.get((self.store.location.url, record.save_id, node, name),
                               lambda: self.reader.own(record, self.manifest(node), [name])[name])

    def own(self, node: str, name: str) -> np.ndarray:
        """Node ``node``'s local blob ``name``, which stays with it (the nodes and their order
        are the save's)."""
        return self.reader.blobs(node, [name])[name]

    def global_array(self, name: str) -> np.ndarray:
        """The rows blob ``name`` put back together (its global array), once per ``shared``
        (never written into: it is copied to each node taking it)."""
        return self.shared.get((self.store.location.url, self.record.save_id, GLOBAL, name),
                               lambda: self.window(name, range(self._sources(name)[2])))

    def window(self, name: str, rows: range) -> np.ndarray:
        """Rows ``rows`` (consecutive) of the rows blob ``name``'s global array."""
        out: dict[str, dict[str, np.ndarray]] = {GLOBAL: {}}
        direct: list[Callable[[], Any]] = []
        finish = self.split(name, {GLOBAL: rows}, out, direct)
        run_reads(direct)
        finish()
        return out[GLOBAL][name]

    def global_info(self, name: str) -> BlobInfo:
        """The dtype, shape and memory order of the rows blob ``name``'s global array."""
        infos, _, total = self._sources(name)
        order = "F" if orders_of([(i.shape, i.order) for i in infos]) == {"F"} else "C"
        return infos[0]._replace(shape=(total, *infos[0].shape[1:]), order=order)

    def targets(self, nodes: list[str], name: str) -> dict[str, range]:
        """The global rows of the rows blob ``name`` each new node of ``nodes`` takes."""
        total = self._sources(name)[2]
        return {node: new_rows(self.partition, self.order.index(node), len(self.order), total)
                for node in nodes}

    def _sources(self, name: str) -> tuple[list[BlobInfo], list[range], int]:
        """Each old node's blob ``name`` (rows of one dtype and width, in one memory order), the
        global rows it holds, and the global array's row count (worked out once)."""
        if name not in self._sourced:
            self._sourced[name] = self._source_rows(name)
        return self._sourced[name]

    def _source_rows(self, name: str) -> tuple[list[BlobInfo], list[range], int]:
        infos = [self._row_info(node, name) for node in self.old]
        orders = orders_of([(i.shape, i.order) for i in infos])
        if len(orders) > 1:
            raise self.damage(self.old[0], name, "its nodes hold their rows in both C and "
                              "Fortran order")
        try:
            sources = old_rows(self.old_partition, [i.shape[0] for i in infos])
        except ValueError as exc:
            raise self.damage(self.old[0], name, str(exc)) from exc
        return infos, sources, sum(len(r) for r in sources)

    def split(self, name: str, targets: dict[str, range], out: dict[str, dict[str, np.ndarray]],
              direct: list[Callable[[], Any]]) -> Callable[[], None]:
        """Allocate, for each new node of ``targets`` (:data:`GLOBAL`: a window of the global
        array), its global rows of the rows blob ``name``, add the reads straight into place to
        ``direct``, and return what copies the other rows once those reads ran."""
        infos, sources, _ = self._sources(name)
        first = infos[0]
        copies: list[tuple[str, np.ndarray, range, range]] = []
        scattered: dict[str, list[tuple[np.ndarray, range, range]]] = {}
        for node, target in targets.items():
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
            if orders_of([(i.shape, i.order) for i in infos]) == {"F"}:
                for node in targets:
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
        (:meth:`~caffe2ckpt.store.read.save.SaveReader.rows`), every k-th one (a
        ``mod`` split) out of the whole blob, read once per ``shared``."""
        if rows.step == 1:
            return self.reader.rows(node, name, rows.start, rows.stop)
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
        with its ``zarr.json`` checked by the first of them."""
        record, manifest = self.records[node], self.manifest(node)
        path = manifest.stored_blobs[name].path
        crcs = self.store.chunk_crcs(record, manifest)
        first = self.shared.first((self.store.location.url, record.save_id, node, path))
        files = {f"{path}/{GROUP_FILE}"} if first else set()  # once per old array and process
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
