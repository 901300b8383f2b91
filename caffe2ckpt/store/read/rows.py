"""Some rows of one blob of a committed node checkpoint: what an elastic restore and a
consolidation read of an old node, a window at a time, instead of its whole blob."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from caffe2ckpt.store.format.manifest import BlobInfo, Manifest, stored_spec
from caffe2ckpt.store.format.records import CommitRecord
from caffe2ckpt.store.format.zarrgroup import GROUP_FILE
from caffe2ckpt.store.read.chain import read_chained
from caffe2ckpt.store.read.group import RowRead, destination, restored, row_reads
from caffe2ckpt.store.read.rounds import run_reads

if TYPE_CHECKING:
    from caffe2ckpt.store.read.source import ReadableStore

__all__ = ["load_rows"]


def load_rows(store: ReadableStore, record: CommitRecord, name: str, start: int, stop: int,
              manifest: Manifest | None = None) -> np.ndarray:
    """Rows ``[start, stop)`` (axis 0) of blob ``name`` of the node checkpoint ``record``
    commits: of its own array, read from the chunks holding them (all of the first and last);
    of a differential save, rebuilt from its chain for those rows only; of a replicated blob
    another node wrote, from that node's save; of a packed blob, read whole. Verified as a
    restore is (but for a chain's digest of the whole blob, see
    :func:`~caffe2ckpt.store.read.chain.read_chained`). ``manifest``: the group's, as
    :meth:`~caffe2ckpt.store.commit.protocol.CheckpointStore.manifest` read it already.

    Raises:
        CheckpointCorruptedError: the group is damaged (names node, epoch and blob).
    """
    manifest = manifest or store.manifest(record)
    lent = record.layout.written_by if record.layout is not None else {}
    if name not in manifest.blobs and name in lent:
        record = store.writer_record(record, lent[name], name)
        manifest = store.manifest(record)
    if name in manifest.inherited:
        return read_chained(store, record, manifest, [name], (start, stop))[name]
    stored = manifest.stored_blobs.get(name)
    if stored is None or stored.path is None:  # packed (small), or absent: read as ever
        return store.read_own(record, manifest, [name])[name][start:stop].copy()
    return _read_window(store, record, manifest, stored, start, stop)


def _read_window(store: ReadableStore, record: CommitRecord, manifest: Manifest,
                 info: BlobInfo, start: int, stop: int) -> np.ndarray:
    """Rows ``[start, stop)`` of ``info``'s own array in ``record``'s group."""
    dtype, shape = stored_spec(info)
    if not shape or not 0 <= start <= stop <= shape[0]:
        raise ValueError(f"rows {start}..{stop} are not rows of blob {info.name!r}")
    data = destination(store.location, (stop - start, *shape[1:]), dtype)
    flat = data.reshape(stop - start, -1).view(np.uint8)
    files = {f"{info.path}/{GROUP_FILE}"}
    crcs = store.chunk_crcs(record, manifest)
    run_reads(row_reads(store.location, store.group_path(record), manifest,
                        {info.path: crcs[info.path]},  # type: ignore[index]
                        [RowRead(info, flat, -start, [(start, stop)])],
                        {f: d for f, d in record.metadata.items() if f in files}))
    return restored(data, info._replace(shape=(stop - start, *info.shape[1:])))
