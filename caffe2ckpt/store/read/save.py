"""The one read path: a committed save's blobs, for the nodes, blobs and rows asked for, as
verified arrays.

Every reader of a stored save goes through :class:`SaveReader`: a restore (each node its own
blobs, or the save cut anew for other nodes: :class:`Cut`), ``read_epoch``, ``materialize``
and its consolidation (a window of a rows blob's global array at a time), ``zarr_store``, and
the command line. Given the records of one save (or one node's record of it), it reads the
groups they commit: each manifest once, each blob as the node saved it (the node's own arrays,
a differential save's chain, a replicated blob from the node that wrote it) with every byte
checked before it is returned (:mod:`~caffe2ckpt.store.read.group`,
:mod:`~caffe2ckpt.store.read.chain`); cut anew by :mod:`~caffe2ckpt.store.read.reshard`.
What several nodes of one process read (a replicated blob, an old node's whole blob) is read
once per :class:`~caffe2ckpt.store.read.shared.SharedReads`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from caffe2ckpt.errors import CheckpointCorruptedError, CheckpointNotFoundError
from caffe2ckpt.store.format.manifest import PACKED_ARRAY, BlobInfo, Manifest, stored_spec
from caffe2ckpt.store.format.records import CommitRecord, RecordRef
from caffe2ckpt.store.format.zarrgroup import GROUP_FILE
from caffe2ckpt.store.read.chain import read_chained
from caffe2ckpt.store.read.group import RowRead, destination, read_node, restored, row_reads
from caffe2ckpt.store.read.reshard import Reshard, read_cut, saved_layout
from caffe2ckpt.store.read.rounds import run_reads
from caffe2ckpt.store.read.shared import SharedReads

if TYPE_CHECKING:
    from caffe2ckpt.store.read.source import ReadableStore

__all__ = ["Cut", "SaveReader", "read_shares", "share_infos", "shared_names"]


class Cut(NamedTuple):
    """How a save reaches nodes other than its own, or in another order, partition or kind (an
    elastic restore): the job's nodes in order, its partition, and the blobs it declares
    another kind than the save did, with the job's kind."""

    order: tuple[str, ...]
    partition: str
    kinds: Mapping[str, str] = {}


class SaveReader:
    """One committed save's records (by node; one node's record will do), read and verified
    (see the module docstring). ``shared``: what this reader shares with others reading the
    same save in this process (None: nobody else takes what it reads)."""

    def __init__(self, store: ReadableStore, records: Mapping[str, CommitRecord],
                 shared: SharedReads | None = None,
                 manifests: Mapping[str, Manifest] | None = None) -> None:
        self.store, self.records = store, dict(records)
        self.owned = shared is None  # the last user of an array this reader read may keep it
        self.shared = SharedReads() if shared is None else shared
        self._manifests = dict(manifests or {})

    def manifest(self, node: str) -> Manifest:
        """The verified manifest of ``node``'s group, read once."""
        if node not in self._manifests:
            self._manifests[node] = self.store.manifest(self.records[node])
        return self._manifests[node]

    def check_metadata(self, node: str) -> Manifest:
        """The manifest of ``node``'s group, once every metadata file of the group (each
        array's ``zarr.json``, overlays' included) has the digest its record gives.

        Raises:
            CheckpointCorruptedError: one is missing or changed (names node, epoch and file).
        """
        record, manifest = self.records[node], self.manifest(node)
        read_node(self.store.location, self.store.group_path(record), manifest,
                  self.store.chunk_crcs(record, manifest), [],
                  metadata={f: d for f, d in record.metadata.items() if f != GROUP_FILE})
        return manifest

    def read(self, nodes: Sequence[str] | None = None, names: Sequence[str] | None = None,
             cut: Cut | None = None) -> dict[str, dict[str, np.ndarray]]:
        """``{node: {blob: array}}`` for ``nodes`` (default: all), all blobs or ``names``: as
        each node saved them, or with ``cut`` for the job's nodes ``cut.order`` cut anew.

        Raises:
            CheckpointNotFoundError: a node is not the save's (nor the cut's); cut anew, a
                blob of ``names`` is missing (else each node gives those it has).
            JobDefinitionError: the save cannot be cut so (before any data is read).
            CheckpointCorruptedError: what it read is damaged (names node, epoch and blob).
        """
        if cut is not None:
            return read_cut(self, cut.order, cut.partition, nodes, names, cut.kinds)
        wanted = sorted(self.records) if nodes is None else [str(n) for n in nodes]
        unknown = sorted(set(wanted) - set(self.records))
        if unknown:
            record = next(iter(self.records.values()))
            raise CheckpointNotFoundError(
                f"epoch {record.epoch} under {self.store.location.display()!r} has no nodes "
                f"{unknown}; it has {sorted(self.records)}")
        return {node: self.blobs(node, names) for node in wanted}

    def blobs(self, node: str, names: Sequence[str] | None = None) -> dict[str, np.ndarray]:
        """``node``'s blobs (all, or those of ``names`` it has) as it saved them: its own, and
        the replicated ones another node of its save wrote (read from that node's group; once
        per :attr:`shared`, each caller getting a copy of its own)."""
        record, manifest = self.records[node], self.manifest(node)
        layout = record.layout
        lent = layout.written_by if layout is not None else {}
        wanted = [*manifest.blobs, *lent] if names is None else list(names)
        replicas = {n: lent.get(n, node) for n in wanted
                    if layout is not None and n in layout.replicated
                    and (n in manifest.blobs or n in lent)}
        out = self.own(record, manifest, [n for n in wanted if n not in replicas])
        for name, writer in replicas.items():
            value = self.shared.get((self.store.location.url, record.save_id, writer, name),
                                    lambda n=name, w=writer: self._replica(record, w, n))
            out[name] = value.copy()
        return out

    def rows(self, node: str, name: str, start: int, stop: int) -> np.ndarray:
        """Rows ``[start, stop)`` (axis 0) of ``node``'s blob ``name``: of its own array, read
        from the chunks holding them (all of the first and last); of a differential save,
        rebuilt from its chain for those rows only; of a replicated blob another node wrote,
        from that node's group; of a packed blob, read whole. Verified as a restore is (but for
        a chain's digest of the whole blob, see
        :func:`~caffe2ckpt.store.read.chain.read_chained`)."""
        record, manifest = self.records[node], self.manifest(node)
        lent = record.layout.written_by if record.layout is not None else {}
        if name not in manifest.blobs and name in lent:
            record = self.writer_record(record, lent[name], name)
            manifest = self.store.manifest(record)
        if name in manifest.inherited:
            return read_chained(self.store, record, manifest, [name], (start, stop))[name]
        stored = manifest.stored_blobs.get(name)
        if stored is None or stored.path is None:  # packed (small), or absent: read as ever
            return self.own(record, manifest, [name])[name][start:stop].copy()
        return self._window(record, manifest, stored, start, stop)

    def global_rows(self, name: str, start: int, stop: int) -> np.ndarray:
        """Rows ``[start, stop)`` of the rows blob ``name``'s global array (the save's nodes'
        rows in their global places, as its layout says)."""
        reshard = self._as_saved()
        reshard.streams = self.owned
        return reshard.window(name, range(start, stop))

    def global_info(self, name: str) -> BlobInfo:
        """The dtype, shape and memory order of the rows blob ``name``'s global array
        (manifests only)."""
        return self._as_saved().global_info(name)

    def _as_saved(self) -> Reshard:
        """The save cut for its own nodes, as its layout says."""
        layout = saved_layout(self.records)
        if layout is None:
            return Reshard(self, sorted(self.records), "range")
        return Reshard(self, list(layout.order), layout.partition)

    def own(self, record: CommitRecord, manifest: Manifest,
            wanted: list[str]) -> dict[str, np.ndarray]:
        """The blobs ``wanted`` of ``record``'s own group (and the chains of a differential
        save), with the metadata files of the arrays they are read from checked."""
        stored = manifest.stored_blobs
        files = {f"{stored[n].path or PACKED_ARRAY}/{GROUP_FILE}" for n in wanted if n in stored}
        metadata = {f: d for f, d in record.metadata.items() if f in files}
        chained = [n for n in wanted if n in manifest.inherited]  # their overlays: read_chained
        out = read_node(self.store.location, self.store.group_path(record), manifest,
                        self.store.chunk_crcs(record, manifest), wanted, metadata=metadata)
        if chained:
            out.update(read_chained(self.store, record, manifest, chained))
        return out

    def writer_record(self, record: CommitRecord, node: str, name: str) -> CommitRecord:
        """The record of ``node`` in ``record``'s save, which wrote the blob ``name`` that
        ``record``'s node holds too."""
        ref = RecordRef(epoch=record.epoch, node=node, save_id=record.save_id)
        try:
            writer = self.store.read_record(ref)
        except (CheckpointNotFoundError, CheckpointCorruptedError) as exc:
            raise CheckpointCorruptedError(
                f"checkpoint {self.store.where(record)!r} (node {record.node!r}, epoch "
                f"{record.epoch}): blob {name!r}, written by node {node!r} of the same save: "
                f"{exc}", node=record.node, epoch=record.epoch, blob=name) from exc
        if name not in self.store.manifest(writer).blobs:
            raise CheckpointCorruptedError(
                f"checkpoint {self.store.where(record)!r} (node {record.node!r}, epoch "
                f"{record.epoch}): blob {name!r} is written by node {node!r} of the same save, "
                "whose checkpoint does not hold it", node=record.node, epoch=record.epoch,
                blob=name)
        return writer

    def _replica(self, record: CommitRecord, node: str, name: str) -> np.ndarray:
        """Blob ``name`` of ``record``'s save as node ``node``, which wrote it, saved it."""
        if node == record.node:
            return self.own(record, self.manifest(node), [name])[name]
        writer = self.writer_record(record, node, name)
        return self.own(writer, self.store.manifest(writer), [name])[name]

    def _window(self, record: CommitRecord, manifest: Manifest, info: BlobInfo, start: int,
                stop: int) -> np.ndarray:
        """Rows ``[start, stop)`` of ``info``'s own array in ``record``'s group."""
        dtype, shape = stored_spec(info)
        if not shape or not 0 <= start <= stop <= shape[0]:
            raise ValueError(f"rows {start}..{stop} are not rows of blob {info.name!r}")
        data = destination(self.store.location, (stop - start, *shape[1:]), dtype)
        flat = data.reshape(stop - start, -1).view(np.uint8)
        files = {f"{info.path}/{GROUP_FILE}"}
        crcs = self.store.chunk_crcs(record, manifest)
        run_reads(row_reads(self.store.location, self.store.group_path(record), manifest,
                            {info.path: crcs[info.path]},  # type: ignore[index]
                            [RowRead(info, flat, -start, [(start, stop)])],
                            {f: d for f, d in record.metadata.items() if f in files}))
        return restored(data, info._replace(shape=(stop - start, *info.shape[1:])))


def read_shares(store: ReadableStore, records: dict[str, CommitRecord], order: Sequence[str],
                partition: str, nodes: Sequence[str] | None = None,
                names: Sequence[str] | None = None, shared: SharedReads | None = None,
                kinds: Mapping[str, str] | None = None) -> dict[str, dict[str, np.ndarray]]:
    """``{new node: {blob: array}}`` of the save ``records`` cut anew for the nodes ``order``
    by ``partition`` (:meth:`SaveReader.read` with a :class:`Cut`; see
    :mod:`~caffe2ckpt.store.read.reshard`)."""
    return SaveReader(store, records, shared).read(nodes, names,
                                                   Cut(tuple(order), partition, kinds or {}))


def shared_names(store: ReadableStore, records: dict[str, CommitRecord],
                 order: Sequence[str], kinds: Mapping[str, str] | None = None
                 ) -> dict[str, list[str]]:
    """The blobs of the save ``records`` each of the nodes ``order`` restores a share or a
    copy of (read from the manifests only), by node; ``kinds`` as in :class:`Cut`.

    Raises:
        JobDefinitionError: the save holds local blobs (or has no layout) and the nodes or
            their order differ, or a kind cannot change: refused before anything is read.
    """
    reshard = Reshard(SaveReader(store, records), list(order), "range", kinds)
    blobs = reshard.blobs(None)
    return {node: sorted(n for n in blobs if node in reshard.receivers(n)) for node in order}


def share_infos(store: ReadableStore, records: dict[str, CommitRecord], order: Sequence[str],
                partition: str, kinds: Mapping[str, str] | None = None
                ) -> dict[str, dict[str, BlobInfo]]:
    """What :func:`read_shares` returns, from the manifests only: each new node's blobs with
    their dtype, shape and memory order.

    Raises:
        JobDefinitionError: as :func:`shared_names`.
    """
    reshard = Reshard(SaveReader(store, records), list(order), partition, kinds)
    out: dict[str, dict[str, BlobInfo]] = {node: {} for node in order}
    for name in reshard.blobs(None):
        for node in reshard.receivers(name):
            out[node][name] = reshard.info_of(node, name)
    return out

