"""Any committed epoch as plain Zarr, for readers that do not use caffe2ckpt's managers.

A whole save's node group is already an ordinary Zarr v3 group. A differential save's group
holds only what changed (row overlays) and names the older groups it builds on, so plain Zarr
cannot read its blobs alone. Two ways to read any epoch, delta or not, verified as a restore is
(every checksum, every chain's digests):

- :func:`materialize` writes ``<dest>/<node>.<epoch>``, an ordinary whole group that
  ``zarr.open_group`` and TensorStore read like any other;
- :func:`zarr_store` gives a read-only Zarr store that serves the node's whole group without
  writing anything: each large blob is rebuilt when one of its chunks is first read.

Example:
    >>> import numpy as np, zarr, caffe2ckpt
    >>> opts = caffe2ckpt.StepManagerOptions(delta_saves=True, delta_min_bytes=1024)
    >>> with caffe2ckpt.StepCheckpointManager("memory://doc/plain", options=opts) as mgr:
    ...     table = np.zeros((1024, 4), np.float32)
    ...     for step in range(3):
    ...         table[step] = step + 1
    ...         _ = mgr.save(step, {"trainer_0": {"table": table}})
    >>> group = zarr.open_group(store=caffe2ckpt.zarr_store("memory://doc/plain", 2, "trainer_0"),
    ...                         mode="r")
    >>> group["table"][:3, 0].tolist()
    [1.0, 2.0, 3.0]
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from caffe2ckpt.errors import InvalidLocationError
from caffe2ckpt.fs.location import Location
from caffe2ckpt.history.lineage import Save
from caffe2ckpt.history.scan import require_save, scan
from caffe2ckpt.naming import check_epoch, check_node_name
from caffe2ckpt.store.layout import group_name
from caffe2ckpt.store.manifest import BlobInfo
from caffe2ckpt.store.protocol import CheckpointStore
from caffe2ckpt.store.zarrgroup import (
    DEFAULT_PACK_THRESHOLD,
    epoch_store,
    plan_group,
    write_group,
)

__all__ = ["materialize", "zarr_store"]


def _save(store: CheckpointStore, epoch: int, nodes: Sequence[str]) -> Save:
    """The committed save ``epoch`` means under ``store`` for ``nodes`` (as the command line
    takes it): the save of the job holding every one of ``nodes``, its lineage's before a
    superseded one; without nodes, the current lineage's (the newer job's), else a superseded
    one."""
    return require_save(scan(store), store, check_epoch(epoch),
                        [check_node_name(n) for n in nodes])


def materialize(url: str, epoch: int, dest: str, *, nodes: Sequence[str] | None = None,
                storage_options: dict[str, Any] | None = None,
                dest_storage_options: dict[str, Any] | None = None) -> list[str]:
    """Write every node (or ``nodes``) of committed ``epoch`` under ``url`` as an ordinary
    whole group ``<dest>/<node>.<epoch>``; return their URLs. Each is read and verified first
    (a differential epoch's chain resolved and its digests checked). With ``nodes``, the epoch
    is the save of the job holding them (jobs with other nodes may share the prefix), a
    superseded one if their lineage has none of that epoch.

    Raises:
        CheckpointNotFoundError: the epoch, or a node, is not committed there.
        CheckpointCorruptedError: the epoch is damaged (nothing of that node is written).
        FileExistsError: ``<dest>/<node>.<epoch>`` exists already (never overwritten).
    """
    store = CheckpointStore(Location(url, storage_options))
    save = _save(store, epoch, nodes or ())
    return write_plain(store, save, dest, nodes=nodes,
                       dest_storage_options=dest_storage_options)


def write_plain(store: CheckpointStore, save: Save, dest: str, *,
                nodes: Sequence[str] | None = None,
                dest_storage_options: dict[str, Any] | None = None) -> list[str]:
    """:func:`materialize` of ``save`` (every node, or ``nodes``), read from ``store``."""
    out = Location(dest, dest_storage_options)
    written = []
    for node in sorted(set(nodes or save.records)):
        record = save.records[node]
        blobs = store.load_node(record)
        plan = plan_group(node=node, epoch=save.epoch, save_id=save.save_id, blobs=blobs)
        path = group_name(node, save.epoch)
        try:
            write_group(out, out.path(path), plan)
        except FileExistsError:
            raise FileExistsError(
                f"{out.display(path)} exists already: materialize never overwrites a group "
                "(one it left unfinished lacks array metadata: delete it); choose another "
                "destination") from None
        written.append(out.display(path))
    return written


def small_blobs(infos: dict[str, BlobInfo]) -> list[str]:
    """The blobs a whole group packs together (smaller than the default pack threshold, 0-d
    or empty): those read together at once."""
    return [n for n, i in infos.items()
            if i.nbytes < DEFAULT_PACK_THRESHOLD or not i.shape or 0 in i.shape]


def zarr_store(url: str, epoch: int, node: str, *,
               storage_options: dict[str, Any] | None = None) -> Any:
    """A read-only Zarr store (``zarr.open_group(store=..., mode="r")``) holding node
    ``node``'s committed ``epoch`` under ``url`` as an ordinary whole group. Small blobs are
    read at once; each large one when one of its chunks is first read, verified as a restore
    is (a differential epoch's chain resolved, its digests checked).

    Raises:
        CheckpointNotFoundError: the epoch, or the node, is not committed there.
        CheckpointCorruptedError: its manifest, or a blob when it is read, is damaged.
    """
    store = CheckpointStore(Location(url, storage_options))
    if not isinstance(node, str):
        raise InvalidLocationError(f"zarr_store: node must be a node name, got {node!r}")
    record = _save(store, epoch, [node]).records[node]
    infos = store.manifest(record).blobs
    small = small_blobs(infos)
    blobs: dict[str, Any] = store.load_node(record, small) if small else {}
    blobs.update({n: i for n, i in infos.items() if n not in blobs})
    plan = plan_group(node=node, epoch=record.epoch, save_id=record.save_id, blobs=blobs)
    return epoch_store(plan, lambda name: store.load_node(record, [name])[name])
