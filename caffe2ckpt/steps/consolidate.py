"""One global checkpoint out of a save of N nodes: ``materialize(..., consolidate=True)``.

The save's layout (:class:`caffe2ckpt.Layout`, stored in its records) says how its blobs are
spread: each ``rows`` blob becomes one global array (the nodes' rows in their global places:
concatenated for ``range``, interleaved for ``mod``), each ``replicated`` blob is written once
(from the node that saved it), and each local blob goes under ``<node>/``, a group of its own.

It streams: a global array is written one output chunk (at most 16 MiB) at a time, each read
from the old nodes' rows it covers by the one read path
(:meth:`~caffe2ckpt.store.read.save.SaveReader.global_rows`: the chunks holding them, or a
differential save's chain for those rows only) and verified as a restore is, so what is held
stays under one chunk's worth of reads and writes, whatever the table's size. Replicated and
local blobs are streamed the same way from the node holding them (small, packed or 0-d ones,
and Fortran-ordered ones, are read whole).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import numpy as np

from caffe2ckpt.fs.location import Location
from caffe2ckpt.history.lineage import Save
from caffe2ckpt.naming import blob_path
from caffe2ckpt.sharding import LOCAL, REPLICATED, ROWS
from caffe2ckpt.store.commit.protocol import CheckpointStore
from caffe2ckpt.store.format.zarrgroup import (
    PLAIN_GROUP_KEY,
    mark_complete,
    remove_plain_groups,
    taken_error,
    write_plain_group,
)
from caffe2ckpt.store.read.reshard import saved_layout
from caffe2ckpt.store.read.save import SaveReader

__all__ = ["CONSOLIDATED", "write_consolidated"]

CONSOLIDATED = "consolidated.{epoch}"  # the group written under DEST


class GlobalRows:
    """A ``rows`` blob's global array, read a window of rows at a time when sliced (what the
    plain-group writer asks of an array: its shape, dtype, memory order and one chunk at a
    time)."""

    def __init__(self, shape: tuple[int, ...], dtype: np.dtype,
                 read: Callable[[int, int], np.ndarray]) -> None:
        self.shape, self.dtype, self.ndim = shape, dtype, len(shape)
        self.size = math.prod(shape)
        self.flags = SimpleNamespace(c_contiguous=True, f_contiguous=self.ndim <= 1)
        self._read = read

    def __getitem__(self, selection: Any) -> np.ndarray:
        rows = selection[0] if isinstance(selection, tuple) else selection
        start, stop, _ = rows.indices(self.shape[0])
        return self._read(start, stop)


def write_consolidated(store: CheckpointStore, save: Save, dest: str, *,
                       dest_storage_options: dict[str, Any] | None = None) -> list[str]:
    """Write ``save`` as one plain Zarr group ``<dest>/consolidated.<epoch>`` (see the module
    docstring); return its URL and those of its nodes' local groups.

    Raises:
        JobDefinitionError: never; a save without a layout has only local blobs (each node's
            under ``<node>/``).
        CheckpointCorruptedError: the save is damaged, or its nodes' rows do not fit its layout.
        FileExistsError: the group exists already (never overwritten).
    """
    out = Location(dest, dest_storage_options)
    root = out.path(CONSOLIDATED.format(epoch=save.epoch))
    if out.exists(root):
        raise taken_error(out, root)
    plan = _Consolidation(store, save)
    attributes = {PLAIN_GROUP_KEY: plan.describe()}
    write_plain_group(out, root, attributes, plan.global_blobs(), complete=False)
    written = [out.display(CONSOLIDATED.format(epoch=save.epoch))]
    try:
        for node in plan.order:
            local = plan.local(node)
            if local:
                write_plain_group(out, f"{root}/{node}", {PLAIN_GROUP_KEY: {"node": node}},
                                  plan.local_blobs(node, local))
                written.append(out.display(f"{CONSOLIDATED.format(epoch=save.epoch)}/{node}"))
        mark_complete(out, root, attributes)  # the last step: the nodes' groups are in it
    except BaseException:
        remove_plain_groups(out, [root])  # the group this call created, with what it holds
        raise
    return written


class _Consolidation:
    """What one save's consolidation writes, blob by blob."""

    def __init__(self, store: CheckpointStore, save: Save) -> None:
        self.store, self.save = store, save
        self.reader = SaveReader(store, save.records)
        layout = saved_layout(save.records)
        self.order = list(layout.order) if layout is not None else sorted(save.records)
        self.partition = layout.partition if layout is not None else "range"
        self.manifests = {n: self.reader.manifest(n) for n in self.order}
        self.kinds: dict[str, str] = {}
        for node in self.order:
            record = save.records[node]
            for name in [*self.manifests[node].blobs, *(record.layout.written_by
                                                        if record.layout else {})]:
                kind = record.layout.kind(name) if record.layout else LOCAL
                self.kinds.setdefault(name, kind)

    def describe(self) -> dict[str, Any]:
        return {"prefix": self.store.location.display(), "epoch": self.save.epoch,
                "save_id": self.save.save_id, "nodes": self.order, "partition": self.partition,
                "created": time.time(),  # the group's zarr.json is this call's own
                "blobs": {n: {"kind": k, "path": blob_path(n) if k != LOCAL else None}
                          for n, k in sorted(self.kinds.items())}}

    def local(self, node: str) -> list[str]:
        return sorted(n for n in self.manifests[node].blobs if self.kinds[n] == LOCAL)

    def local_blobs(self, node: str, names: list[str]) -> Iterator[dict[str, Any]]:
        for name in names:
            yield {name: self._streamed(node, name)}

    def global_blobs(self) -> Iterator[dict[str, Any]]:
        for name, kind in sorted(self.kinds.items()):
            if kind == ROWS:
                yield {name: self._global_rows(name)}
            elif kind == REPLICATED:
                writer = next(n for n in self.order if name in self.manifests[n].blobs)
                yield {name: self._streamed(writer, name)}

    def _streamed(self, node: str, name: str) -> Any:
        """Node ``node``'s blob ``name``: read a window of rows at a time when it has rows and
        an array of its own (C order), else read whole (small, packed, 0-d)."""
        info = self.manifests[node].blobs[name]
        stored = self.manifests[node].stored_blobs.get(name)
        if not info.shape or info.order != "C" or stored is None or stored.path is None:
            return self.store.load_node(self.save.records[node], [name],
                                        manifest=self.manifests[node])[name]
        return GlobalRows(tuple(info.shape), np.dtype(info.dtype),
                          lambda a, b: self.reader.rows(node, name, a, b))

    def _global_rows(self, name: str) -> GlobalRows:
        """The rows blob ``name``'s global array, read a window at a time."""
        info = self.reader.global_info(name)
        return GlobalRows(tuple(info.shape), np.dtype(info.dtype),
                          lambda a, b: self.reader.global_rows(name, a, b))
