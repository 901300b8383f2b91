"""Any committed epoch as plain Zarr, for readers that do not use caffe2ckpt's managers.

A checkpoint's node group is a Zarr v3 group, but packs its small blobs into one array (found
through its manifest), and a differential save's group holds only what changed (row overlays)
and names the older groups it builds on. Two ways to read any epoch, delta or not, verified as a
restore is (every checksum, every chain's digests):

- :func:`materialize` writes ``<dest>/<node>.<epoch>``, an ordinary group in which every blob is
  an array of its own at its blob path (:func:`caffe2ckpt.naming.blob_path`), in its own dtype
  and shape: ``zarr.open_group(url)[blob_path(name)][...]`` reads it like any other group (and
  TensorStore, but for string blobs: they use zarr-python's fixed-length string data types);
  it reads and writes one blob at a time (the packed small blobs together);
- :func:`zarr_store` gives a read-only Zarr store that serves the node's checkpoint group (its
  manifest and packed small blobs included) without writing anything: each large blob is
  rebuilt when one of its chunks is first read.

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

import time
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from caffe2ckpt.errors import CheckpointNotFoundError, InvalidLocationError
from caffe2ckpt.fs.location import Location
from caffe2ckpt.history.lineage import Save
from caffe2ckpt.history.scan import require_save, scan
from caffe2ckpt.naming import blob_path, check_epoch, check_node_name
from caffe2ckpt.steps.consolidate import write_consolidated
from caffe2ckpt.store.commit.protocol import CheckpointStore
from caffe2ckpt.store.format.paths import group_name
from caffe2ckpt.store.format.records import CommitRecord
from caffe2ckpt.store.format.zarrgroup import (
    PLAIN_GROUP_KEY,
    epoch_store,
    plan_group,
    remove_plain_groups,
    taken_error,
    write_plain_group,
)
from caffe2ckpt.store.read.group import read_units, small_blobs

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
                dest_storage_options: dict[str, Any] | None = None,
                consolidate: bool = False) -> list[str]:
    """Write every node (or ``nodes``) of committed ``epoch`` under ``url`` as an ordinary
    group ``<dest>/<node>.<epoch>``; return their URLs.

    With ``consolidate``, write instead one global group ``<dest>/consolidated.<epoch>`` as
    the save's layout (:class:`~caffe2ckpt.Layout`) says: each ``rows`` blob as one array of
    all nodes' rows in their global order, each replicated blob once, each node's local blobs
    in the group ``<node>`` inside it; streamed a chunk at a time
    (:mod:`caffe2ckpt.steps.consolidate`). ``nodes`` then chooses the save (the job holding
    them), and every node of it is written.

    Every blob is an array of its own at :func:`~caffe2ckpt.naming.blob_path` of its name, in
    its dtype and shape (bool, 0-d, empty, fixed-width unicode and byte strings included), with
    Zarr's ``bytes`` (in the blob's byte order) and ``crc32c`` codecs; a Fortran-ordered blob is
    stored in Fortran order (Zarr's ``transpose`` codec). Zarr v3 data types keep neither byte
    order nor memory order, so plain zarr reads big-endian and Fortran-ordered blobs as native,
    C-ordered arrays of the same values; each array's attribute ``caffe2ckpt_blob`` holds the
    exact ``name``, ``dtype`` and ``order``, and the group's ``caffe2ckpt_materialized`` the
    source (node, epoch, save id) and every blob's path by name.

    Each blob is read and verified as a restore is (a differential epoch's chain resolved and
    its digests checked) and written before the next is read (the small blobs packed together
    in the checkpoint are read together), so the workspace is never held whole. With
    ``nodes``, the epoch is the save of the job holding them (jobs with other nodes may share
    the prefix), a superseded one if their lineage has none of that epoch.

    Raises:
        CheckpointNotFoundError: the epoch, or a node, is not committed there.
        CheckpointCorruptedError: the epoch is damaged (what was written of that node is
            removed again).
        FileExistsError: ``<dest>/<node>.<epoch>`` (with ``consolidate``:
            ``<dest>/consolidated.<epoch>``) exists already (checked before anything is read;
            never overwritten).
    """
    store = CheckpointStore(Location(url, storage_options))
    save = _save(store, epoch, nodes or ())
    if consolidate:
        return write_consolidated(store, save, dest, dest_storage_options=dest_storage_options)
    return write_plain(store, save, dest, nodes=nodes,
                       dest_storage_options=dest_storage_options)


def write_plain(store: CheckpointStore, save: Save, dest: str, *,
                nodes: Sequence[str] | None = None,
                dest_storage_options: dict[str, Any] | None = None) -> list[str]:
    """:func:`materialize` of ``save`` (every node, or ``nodes``), read from ``store``."""
    out = Location(dest, dest_storage_options)
    paths = {node: group_name(node, save.epoch) for node in sorted(nodes or save.records)}
    for path in paths.values():
        if out.exists(out.path(path)):
            raise taken_error(out, out.path(path))
    done: list[str] = []
    try:
        for node, path in paths.items():
            done.append(_materialize_node(store, save.records[node], out, path))
    except BaseException:
        remove_plain_groups(out, [out.path(paths[node]) for node in list(paths)[:len(done)]])
        raise
    return done


def _materialize_node(store: CheckpointStore, record: CommitRecord, out: Location,
                      path: str) -> str:
    """Write the node checkpoint ``record`` commits as the plain group ``path`` under ``out``."""
    manifest = store.manifest(record)
    source = {"prefix": store.location.display(), "node": record.node, "epoch": record.epoch,
              "save_id": record.save_id,
              "created": time.time(),  # makes the group's zarr.json this call's own (see
              # Location.create_exclusive: an object store's "exists" is settled by reading back)
              "blobs": {name: blob_path(name) for name in manifest.blobs}}

    lent = record.layout.written_by if record.layout is not None else {}
    source["blobs"].update({name: blob_path(name) for name in lent})

    def units() -> Iterator[dict[str, Any]]:
        for names in read_units(manifest):
            yield store.load_node(record, names)
        for name in lent:  # a replicated blob another node of the save wrote
            yield store.load_node(record, [name])

    try:
        write_plain_group(out, out.path(path), {PLAIN_GROUP_KEY: source}, units())
    except FileExistsError:  # taken since it was checked
        raise taken_error(out, out.path(path)) from None
    return out.display(path)


def read_epoch(url: str, epoch: int, node: str, *, blobs: Sequence[str] | None = None,
               storage_options: dict[str, Any] | None = None) -> dict[str, np.ndarray]:
    """Node ``node``'s blobs (all, or ``blobs``) of committed ``epoch`` under ``url``, read and
    verified as a restore is, without resuming anything: nothing is written, no run starts
    from it, retention is not told (an evaluation or an export reads this way).

    Raises:
        CheckpointNotFoundError: the epoch, the node or one of ``blobs`` is not there.
        CheckpointCorruptedError: what it read is damaged.
    """
    store = CheckpointStore(Location(url, storage_options))
    if not isinstance(node, str):
        raise InvalidLocationError(f"read_epoch: node must be a node name, got {node!r}")
    record = _save(store, epoch, [node]).records[node]
    wanted = None if blobs is None else [str(b) for b in blobs]
    out = store.load_node(record, wanted)
    missing = sorted(set(wanted or ()) - set(out))
    if missing:
        raise CheckpointNotFoundError(f"epoch {record.epoch} of node {node!r} under "
                                      f"{store.location.display()!r} has no blobs {missing}")
    return out


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
