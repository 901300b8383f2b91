"""Differential saves, reader side: rebuild the blobs a save does not store whole.

For each such blob the save's commit record gives its chain (:mod:`caffe2ckpt.store.chains`):
the group holding it whole, then the groups whose row overlays apply, oldest first; the save's
own overlay, if any, applies last. Every group's ``zarr.json`` must have the digest the record
gives and say it is the save the record names; every array read is checked as any restore checks
it (metadata digests, chunk sizes and CRC32Cs). Once its overlays are applied, each blob's digest
must be the one recorded at save time: a changed-rows hint that missed rows, or any other wrong
reconstruction, is :class:`~caffe2ckpt.errors.CheckpointCorruptedError` naming node, epoch, blob
and the group, never wrong data.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor, wait
from contextlib import contextmanager
from typing import TYPE_CHECKING

import numpy as np

from caffe2ckpt.errors import CheckpointCorruptedError
from caffe2ckpt.store.chains import ChainGroup
from caffe2ckpt.store.delta import digest
from caffe2ckpt.store.groupread import read_arrays, read_node
from caffe2ckpt.store.manifest import PACKED_ARRAY, Manifest
from caffe2ckpt.store.records import CommitRecord
from caffe2ckpt.store.zarrgroup import GROUP_FILE

if TYPE_CHECKING:
    from caffe2ckpt.store.protocol import CheckpointStore

__all__ = ["read_chained"]


def read_chained(store: CheckpointStore, record: CommitRecord, manifest: Manifest,
                 names: list[str]) -> dict[str, np.ndarray]:
    """Rebuild the blobs ``names`` of ``record``'s differential save (whose verified manifest
    is ``manifest``). Every group of the chains is read at once (the sources whole, the
    overlays beside them: one round of reads, not one per save of the chain); the overlays are
    then applied oldest first, and each blob's digest checked."""
    delta = record.delta
    assert delta is not None
    chains = {name: delta.chains[name] for name in names}
    reader = _Reader(store, record)
    sources = sorted({c[0] for c in chains.values()})
    overlaid = sorted({i for c in chains.values() for i in c[1:]},
                      key=lambda i: delta.groups[i].epoch)  # oldest first
    own = [n for n in names if n in manifest.overlays]
    with ThreadPoolExecutor(max_workers=len(sources) + len(overlaid) + 1) as threads:
        wholes = [threads.submit(reader.whole, delta.groups[i],
                                 [n for n, c in chains.items() if c[0] == i], manifest)
                  for i in sources]
        overlays = [threads.submit(reader.overlays, delta.groups[i],
                                   [n for n, c in chains.items() if i in c[1:]])
                    for i in overlaid]
        if own:
            overlays.append(threads.submit(reader.own_overlays, manifest, own))
        wait([*wholes, *overlays])
    out: dict[str, np.ndarray] = {}
    for future in wholes:  # the first failure in chain order is raised
        out.update(future.result())
    for future in overlays:
        for name, (group, rows, values) in future.result().items():
            reader.apply(name, group, rows, values, out[name])
    for name in names:
        if digest(out[name]) != delta.digests[name]:
            raise reader.damage(name, record.group, "rebuilt from the saves it builds on, it "
                                "differs from what was saved (a changed-rows hint that missed "
                                "rows, or a damaged or wrong source)")
    return out


class _Reader:
    """Reads the parts of one record's chains, naming the record's node and epoch in errors."""

    def __init__(self, store: CheckpointStore, record: CommitRecord) -> None:
        self.store, self.record = store, record

    def damage(self, blob: str, group: str, why: str) -> CheckpointCorruptedError:
        record = self.record
        return CheckpointCorruptedError(
            f"checkpoint of node {record.node!r} epoch {record.epoch} (save "
            f"{record.save_id!r}): blob {blob!r}, from "
            f"{self.store.location.display(group)!r}: {why}", node=record.node,
            epoch=record.epoch, blob=blob)

    def source(self, group: ChainGroup) -> Manifest:
        return self.store.group_manifest(group.group, group.metadata.get(GROUP_FILE),
                                         group.save_id, node=self.record.node,
                                         epoch=self.record.epoch)

    def _crcs(self, group: str, manifest: Manifest, crcs: dict[str, tuple[int, ...]],
              paths: set[str], blob: str) -> dict[str, tuple[int, ...]]:
        try:
            return manifest.chunk_crcs(crcs, only=paths)
        except ValueError as exc:
            raise self.damage(blob, group, str(exc)) from exc

    def whole(self, group: ChainGroup, blobs: list[str], target: Manifest
              ) -> dict[str, np.ndarray]:
        """Read ``blobs`` from ``group``, which stores them whole, as ``target`` describes
        them."""
        manifest = self.source(group)
        paths = set()
        for name in blobs:
            info = manifest.stored_blobs.get(name)
            logical = target.inherited[name].info
            if info is None or (info.dtype, info.shape, info.order) != (
                    logical.dtype, logical.shape, logical.order):
                raise self.damage(name, group.group, "that group does not hold the blob as "
                                  "this save describes it")
            paths.add(info.path or PACKED_ARRAY)
        files = {f"{p}/{GROUP_FILE}" for p in paths}
        crcs = self._crcs(group.group, manifest, group.crcs, paths, blobs[0])
        with self.naming_this_save():
            return read_node(self.store.location, self.store.location.path(group.group),
                             manifest, crcs, blobs,
                             metadata={f: d for f, d in group.metadata.items() if f in files})

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
                node=self.record.node, epoch=self.record.epoch, blob=exc.blob) from exc

    def overlays(self, group: ChainGroup, blobs: list[str]
                 ) -> dict[str, tuple[str, np.ndarray, np.ndarray]]:
        """The row overlays of ``blobs`` in ``group``: by blob, (group, row ids, values)."""
        return self._read_overlays(group.group, self.source(group), group.crcs, group.metadata,
                                   blobs)

    def own_overlays(self, manifest: Manifest, blobs: list[str]
                     ) -> dict[str, tuple[str, np.ndarray, np.ndarray]]:
        record = self.record
        return self._read_overlays(record.group, manifest, record.crcs, record.metadata, blobs)

    def _read_overlays(self, group: str, manifest: Manifest, crcs: dict[str, tuple[int, ...]],
                       metadata: dict[str, str], blobs: list[str]
                       ) -> dict[str, tuple[str, np.ndarray, np.ndarray]]:
        infos = []
        for name in blobs:
            if name not in manifest.overlays:
                raise self.damage(name, group, "that group holds no row overlay of the blob")
            infos.extend(manifest.overlays[name])
        paths = {i.path for i in infos}
        files = {f"{p}/{GROUP_FILE}" for p in paths}
        checksums = self._crcs(group, manifest, crcs, paths, blobs[0])  # type: ignore[arg-type]
        with self.naming_this_save():
            arrays = read_arrays(self.store.location, self.store.location.path(group), manifest,
                                 checksums, infos,
                                 metadata={f: d for f, d in metadata.items() if f in files})
        return {name: (group, arrays[manifest.overlays[name][0].path],  # type: ignore[index]
                       arrays[manifest.overlays[name][1].path])  # type: ignore[index]
                for name in blobs}

    def apply(self, name: str, group: str, rows: np.ndarray, values: np.ndarray,
              target: np.ndarray) -> None:
        """Write ``values`` at ``rows`` of ``target`` (checked to fit first)."""
        if (target.ndim == 0 or rows.size and (rows[0] < 0 or rows[-1] >= target.shape[0]
                                               or np.any(rows[1:] <= rows[:-1]))
                or values.shape[1:] != target.shape[1:] or values.dtype != target.dtype):
            raise self.damage(name, group, "its row overlay does not fit the blob")
        target[rows] = values
