"""One node's workspace as one Zarr v3 group: plan it and write it (reading it back, verified, is
:mod:`caffe2ckpt.store.read.group`).

This is the only module that imports zarr. It knows the group layout and nothing about commits:

- the group's ``zarr.json`` holds ``attributes["caffe2ckpt"]``, the manifest
  (:mod:`caffe2ckpt.store.format.manifest`): node, epoch, save id and, per blob, its exact name,
  dtype, shape, memory order and where its bytes are. It is known before any byte is written
  (:func:`plan_group`), so a save writes it first: the group says whose it is from its first
  object on;
- a blob of at least ``pack_threshold`` bytes is its own array at ``naming.blob_path(name)``,
  chunked along its first axis into chunks of at most 16 MiB, as even as possible and a whole
  number of 4 KiB blocks where the row size allows (so each can be read straight from the disk),
  readable by name with plain zarr;
- smaller blobs (and every 0-d or empty one) are packed, 64-byte aligned, into one uint8 array
  ``_packed``; the manifest gives each one's ``[offset, nbytes]``;
- every chunk is the raw little-endian bytes followed by their CRC32C — exactly Zarr's
  ``bytes`` + ``crc32c`` codec pipeline, no compression — under Zarr's default chunk key
  encoding with the ``.`` separator (``<array>/c.3.0``). As in Zarr, the last chunk is stored
  at the full chunk shape: zero padding after its rows, covered by the checksum.

Zarr itself writes the array metadata (one template per dtype); the chunks are written and read
here directly, because Zarr's pipeline copies every chunk once more on the way out (to append the
checksum) and twice on the way in. :func:`write_arrays` returns every chunk's CRC32C (the commit
record keeps them).

Numeric arrays are stored little-endian (big-endian ones are byte-swapped and swapped back);
unicode (``U``) and byte-string (``S``) arrays are stored as their code units (uint32 / uint8)
with one extra trailing axis, and restored to the exact original dtype.

A *plain* group (:func:`write_plain_group`, what ``materialize`` writes) is for readers that know
nothing of caffe2ckpt: no manifest, no packing, every blob an ordinary array at its blob path in
its own dtype (unicode and byte strings as Zarr's fixed-length string types), byte order and
memory layout, encoded by Zarr itself; it is never read back here.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator, MutableMapping
from concurrent.futures import Future, wait
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import google_crc32c
import numpy as np
import zarr
from zarr.codecs import BytesCodec, Crc32cCodec, TransposeCodec

from caffe2ckpt.errors import (
    CheckpointCorruptedError,
    CheckpointError,
    InvalidBlobError,
)
from caffe2ckpt.fs import localio, strictjson
from caffe2ckpt.fs.iopool import pool as _pool
from caffe2ckpt.fs.iopool import results
from caffe2ckpt.fs.location import Location
from caffe2ckpt.naming import blob_path
from caffe2ckpt.store.format import manifest as manifest_rules
from caffe2ckpt.store.format.chains import overlay_paths, span_path
from caffe2ckpt.store.format.manifest import (
    CHUNK_BYTES,
    FINE_CHUNK_BYTES,
    PACKED_ARRAY,
    BlobInfo,
    BlobManifestError,
    Inherited,
    Manifest,
    chunk_keys,
    chunk_rows,
    stored_spec,
)
from caffe2ckpt.store.format.packing import Packed

__all__ = [
    "ATTRS_KEY",
    "CRC_BYTES",
    "DEFAULT_PACK_THRESHOLD",
    "GROUP_FILE",
    "PLAIN_BLOB_KEY",
    "PLAIN_GROUP_KEY",
    "DeltaLayout",
    "GroupPlan",
    "epoch_store",
    "is_complete",
    "mark_complete",
    "parse_manifest",
    "plan_group",
    "remove_plain_groups",
    "stored_form",
    "taken_error",
    "write_arrays",
    "write_plain_group",
]

ATTRS_KEY = "caffe2ckpt"
GROUP_FILE = "zarr.json"
# Blobs smaller than this are packed into one array. An array of its own costs files (or
# objects) of its own: a create, a flush and a directory entry on save, an open and a read on
# restore, which made most of the time of a workspace of many medium arrays (W2s, 69 MiB in 200
# arrays, benchmarks/bench_phases.py: 144 files and 76 fsyncs at 64 KiB, save 0.80x raw, restore
# 0.62x; 21 files and 14 fsyncs at 1 MiB, 0.94-1.03x and 1.06-1.08x). Packing copies a blob
# once, a chunk at a time on the I/O threads (Packed); restored packed blobs share one buffer.
DEFAULT_PACK_THRESHOLD = 1 << 20
CRC_BYTES = 4  # every chunk file ends with the CRC32C of its bytes

logger = logging.getLogger(__name__)


@functools.lru_cache(maxsize=64)
def _metadata_template(dtype: str) -> dict[str, Any]:
    """Zarr's own array metadata for ``dtype`` with our codecs (shape filled in later)."""
    array = zarr.create_array(zarr.storage.MemoryStore(), shape=(1,), chunks=(1,), dtype=dtype,
                              compressors=[Crc32cCodec()], filters=None, fill_value=0)
    return json.loads(json.dumps(array.metadata.to_dict()))


def _array_metadata(dtype: np.dtype, shape: tuple[int, ...], chunks: tuple[int, ...]) -> bytes:
    meta = json.loads(json.dumps(_metadata_template(dtype.str)))
    meta["shape"] = list(shape)
    meta["chunk_grid"]["configuration"]["chunk_shape"] = list(chunks)
    # "c.0.0" instead of "c/0/0": no directory per array for its chunks (fewer files to create)
    meta["chunk_key_encoding"] = {"name": "default", "configuration": {"separator": "."}}
    return json.dumps(meta, indent=2).encode()


def stored_form(arr: np.ndarray) -> np.ndarray:
    """The C-contiguous little-endian numeric array that stores ``arr`` (no copy if possible)."""
    arr = np.ascontiguousarray(arr)
    kind = arr.dtype.kind
    if kind == "U":
        units = arr.view(">u4" if arr.dtype.byteorder == ">" else "<u4")
        return units.reshape(arr.shape + (arr.dtype.itemsize // 4,)).astype("<u4", copy=False)
    if kind == "S":
        return arr.view(np.uint8).reshape(arr.shape + (arr.dtype.itemsize,))
    if arr.dtype.byteorder == ">":
        return arr.byteswap().view(arr.dtype.newbyteorder("<"))
    return arr




def _chunks(shape: tuple[int, ...], rows: int, row_bytes: int,
            padded: bool) -> list[tuple[str, slice, int]]:
    """Per chunk (chunks split axis 0 only): its key, the rows it holds, and how many bytes of
    padding follow them in its file (the last chunk of a padded array is stored at the full
    chunk shape, as Zarr v3 stores edge chunks)."""
    keys = chunk_keys(len(shape), -(-shape[0] // rows))
    chunks = []
    for i, key in enumerate(keys):
        stop = min((i + 1) * rows, shape[0])
        padding = ((i + 1) * rows - stop) * row_bytes if padded else 0
        chunks.append((key, slice(i * rows, stop), padding))
    return chunks


class _ArrayPlan(NamedTuple):
    path: str  # relative to the group
    shape: tuple[int, ...]  # of the stored array
    data: np.ndarray | Packed | None  # (rows, bytes per row) uint8 view of the stored array
    rows: int  # per chunk
    metadata: bytes  # its zarr.json


@dataclass(frozen=True)
class GroupPlan:
    """A node group before anything is written: the manifest, the group's ``zarr.json``
    (written first) and every array (its metadata, then its chunks)."""

    manifest: Manifest
    group_json: bytes
    arrays: list[_ArrayPlan] = field(default_factory=list)

    def digests(self) -> dict[str, str]:
        """The SHA-256 of every Zarr metadata file, by path relative to the group."""
        out = {GROUP_FILE: hashlib.sha256(self.group_json).hexdigest()}
        out.update({f"{a.path}/zarr.json": hashlib.sha256(a.metadata).hexdigest()
                    for a in self.arrays})
        return out


def _deferred_plan(info: BlobInfo) -> tuple[BlobInfo, _ArrayPlan]:
    """A blob's own array planned from its dtype and shape alone (no data yet)."""
    dtype, shape = stored_spec(info)
    rows = chunk_rows(shape, dtype.itemsize)
    info = BlobInfo(info.name, info.dtype, info.shape, info.order, path=blob_path(info.name),
                    chunk_rows=rows)
    metadata = _array_metadata(dtype, shape, (rows, *shape[1:]))
    return info, _ArrayPlan(info.path, shape, None, rows, metadata)  # type: ignore[arg-type]


def _array_plan(path: str, data: np.ndarray, rows: int) -> _ArrayPlan:
    metadata = _array_metadata(data.dtype, data.shape, (rows, *data.shape[1:]))
    return _ArrayPlan(path, data.shape, data.reshape(data.shape[0], -1).view(np.uint8), rows,
                      metadata)


@dataclass(frozen=True)
class DeltaLayout:
    """What a differential save's group holds besides its whole blobs: the blobs it does not
    store whole (kind and logical info), the row overlays it stores (row ids, then values, by
    blob; values in the blob's own dtype), the spans it stores (a first row and that many
    consecutive rows, by blob), and the group of the save it builds on."""

    inherited: dict[str, Inherited]
    overlays: dict[str, tuple[np.ndarray, np.ndarray]]
    base: str
    spans: dict[str, tuple[int, np.ndarray]] = field(default_factory=dict)


def _row_array(name: str, path: str, arr: np.ndarray, plans: list[_ArrayPlan],
               target: int = CHUNK_BYTES) -> BlobInfo:
    """Plan ``arr`` (C-contiguous rows of a blob, or row ids) as the array at ``path``, in
    chunks of about ``target`` bytes."""
    data = stored_form(arr)
    count = chunk_rows(data.shape, data.dtype.itemsize, target)
    plans.append(_array_plan(path, data, count))
    return BlobInfo(name, arr.dtype.str, arr.shape, "C", path=path, chunk_rows=count)


def _delta_plans(delta: DeltaLayout, fine: bool, row_blobs: frozenset[str]
                 ) -> tuple[dict[str, Any], list[_ArrayPlan]]:
    """The manifest's delta fields and the arrays of ``delta``'s overlays and spans (with
    ``fine``, overlay values in chunks of :data:`~.manifest.FINE_CHUNK_BYTES`; the spans of
    ``row_blobs`` in chunks of :data:`~.manifest.ROWS_CHUNK_BYTES`)."""
    overlays, spans, plans = {}, {}, []
    target = FINE_CHUNK_BYTES if fine else CHUNK_BYTES
    for name, (rows, values) in delta.overlays.items():
        rows_path, values_path = overlay_paths(blob_path(name))
        overlays[name] = (_row_array(name, rows_path, rows, plans),
                          _row_array(name, values_path, values, plans, target))
    for name, (start, values) in delta.spans.items():
        spans[name] = (start, _row_array(name, span_path(blob_path(name)), values, plans,
                                         _target(name, row_blobs)))
    return {"inherited": delta.inherited, "overlays": overlays, "spans": spans,
            "base": delta.base}, plans


def _target(name: str, row_blobs: frozenset[str]) -> int:
    return manifest_rules.ROWS_CHUNK_BYTES if name in row_blobs else CHUNK_BYTES


def plan_group(*, node: str, epoch: int, save_id: str,
               blobs: dict[str, np.ndarray | BlobInfo],
               pack_threshold: int = DEFAULT_PACK_THRESHOLD,
               delta: DeltaLayout | None = None, fine_overlays: bool = False,
               row_blobs: frozenset[str] = frozenset()) -> GroupPlan:
    """How ``blobs`` are written as a group: nothing is copied but the packed small blobs.
    With ``delta``, the group of a differential save (manifest format 4 or 5; with
    ``fine_overlays``, its overlays' values in small chunks, for filesystems where a file
    costs no request of its own). A blob given as a
    :class:`BlobInfo` (dtype, shape, order; at least ``pack_threshold`` bytes) is planned as an
    array of its own without its data (``data`` None: :func:`epoch_store` fills it later).
    ``row_blobs`` (split by rows across the nodes) are chunked finer
    (:data:`~.manifest.ROWS_CHUNK_BYTES`), so another node count reads little past its rows.

    Raises:
        InvalidBlobError: the manifest would be larger than readers accept.
    """
    pack_threshold = max(1, pack_threshold)
    arrays: dict[str, BlobInfo] = {}
    packed: list[BlobInfo] = []
    pieces = Packed()
    plans: list[_ArrayPlan] = []
    packed_bytes = 0
    dtypes: dict[np.dtype, str] = {}  # dtype.str makes a new string on every call
    for name, arr in blobs.items():  # per blob: this loop is most of a save of 10,000 tiny ones
        if isinstance(arr, BlobInfo):
            arrays[name], plan = _deferred_plan(arr)
            plans.append(plan)
            continue
        nbytes, flags = arr.nbytes, arr.flags
        order = "C" if flags.c_contiguous or not flags.f_contiguous else "F"
        dtype = dtypes.get(arr.dtype) or dtypes.setdefault(arr.dtype, arr.dtype.str)
        if nbytes < pack_threshold or arr.ndim == 0 or arr.size == 0:
            offset = pieces.add(arr if flags.c_contiguous else np.ascontiguousarray(arr))
            packed.append(BlobInfo._make((name, dtype, arr.shape, order, None, 0, offset, ())))
            packed_bytes += nbytes
        else:
            data = stored_form(arr)
            rows = chunk_rows(data.shape, data.dtype.itemsize, _target(name, row_blobs))
            info = BlobInfo(name, dtype, arr.shape, order, path=blob_path(name),
                            chunk_rows=rows)
            arrays[name] = info
            plans.append(_array_plan(info.path, data, rows))
    offset = pieces.nbytes
    packed_chunk = chunk_rows((offset,), 1) if offset else 0
    if offset:
        metadata = _array_metadata(np.dtype(np.uint8), (offset,), (packed_chunk,))
        plans.append(_ArrayPlan(PACKED_ARRAY, (offset,), pieces, packed_chunk, metadata))
    extra: dict[str, Any] = {}
    if delta is not None:
        extra, delta_plans = _delta_plans(delta, fine_overlays, row_blobs)
        plans.extend(delta_plans)
    manifest = Manifest(node=node, epoch=epoch, save_id=save_id, arrays=arrays, packed=packed,
                        packed_nbytes=offset, packed_chunk=packed_chunk,
                        packed_blob_bytes=packed_bytes, **extra)
    group = {"attributes": {ATTRS_KEY: manifest.to_dict()}, "zarr_format": 3,
             "node_type": "group"}
    try:
        data = strictjson.check_size(json.dumps(group, separators=(",", ":")).encode(),
                                     f"the manifest of node {node!r} epoch {epoch}")
    except ValueError as exc:  # readers would refuse it: never write what cannot be read
        raise InvalidBlobError(f"{exc} (too many blobs, or too long names)") from exc
    return GroupPlan(manifest, data, plans)


def write_arrays(location: Location, root: str, plan: GroupPlan,
                 batch: localio.SyncBatch | None, *,
                 metadata: bool = True) -> dict[str, tuple[int, ...]]:
    """Write every array of ``plan`` into the group at ``root`` (whose ``zarr.json`` exists):
    metadata files (unless not ``metadata``) and chunks concurrently, each handed to ``batch``
    for its flush (local disks; the caller makes the batch durable). Returns every chunk's
    CRC32C, by array path. Every write has finished when this returns, also when it raises."""
    if location.is_local:
        for array in plan.arrays:
            location.makedirs(f"{root}/{array.path}", batch=batch)
        if batch is not None:  # their new entries: each array's files
            batch.add_dirs([f"{root}/{array.path}" for array in plan.arrays])
    futures: list[Future[Any]] = []
    chunks: list[tuple[str, Future[int]]] = []
    for array in plan.arrays:
        if metadata:
            futures.append(_pool().submit(location.write_file,
                                          f"{root}/{array.path}/zarr.json", [array.metadata],
                                          batch=batch))
        for key, rows, padding in _chunks(array.shape, array.rows, array.data.shape[1],
                                          padded=True):
            future = _pool().submit(_write_chunk, location, f"{root}/{array.path}/{key}",
                                    array.data, rows, padding, batch)
            chunks.append((array.path, future))
    results([*futures, *(f for _, f in chunks)])
    crcs: dict[str, list[int]] = {}
    for path, future in chunks:
        crcs.setdefault(path, []).append(future.result())
    return {path: tuple(values) for path, values in crcs.items()}


def _write_chunk(location: Location, path: str, data: np.ndarray | Packed, rows: slice,
                 padding: int, batch: localio.SyncBatch | None) -> int:
    """Write one chunk file: rows ``rows`` of ``data`` (taken here, on an I/O thread: a packed
    chunk is assembled by the thread that writes it), then ``padding`` zero bytes, then the
    CRC32C of both. Returns the CRC32C."""
    chunk = data[rows]  # an array, or the byte buffers of a packed chunk
    buffers: list[Any] = ([np.ascontiguousarray(chunk).reshape(-1)]
                          if isinstance(chunk, np.ndarray) else chunk)
    crc = 0
    for buffer in buffers:
        crc = google_crc32c.extend(crc, buffer)
    if padding:
        buffers.append(bytes(padding))
        crc = google_crc32c.extend(crc, buffers[-1])
    buffers.append(crc.to_bytes(CRC_BYTES, "little"))
    location.write_file(path, buffers, batch=batch)
    return crc


def write_group(location: Location, root: str, plan: GroupPlan) -> dict[str, tuple[int, ...]]:
    """Write the group ``plan`` describes at ``root`` (which must not exist: its ``zarr.json``
    is created exclusively first), durably; return every chunk's CRC32C by array path. Each
    array's ``zarr.json`` is written once every chunk is durable, so a group cut short lacks
    array metadata (a reader fails) instead of missing chunks (read as zeros)."""
    batch = location.sync_batch()
    try:
        location.create_group(root, GROUP_FILE, plan.group_json, batch=batch)
        crcs = write_arrays(location, root, plan, batch, metadata=False)
        location.make_durable(batch, [], _pool())
        batch = location.sync_batch()
        if batch is not None:
            batch.add_dirs([f"{root}/{array.path}" for array in plan.arrays])
        results([_pool().submit(location.write_file, f"{root}/{array.path}/{GROUP_FILE}",
                                  [array.metadata], batch=batch) for array in plan.arrays])
        location.make_durable(batch, [], _pool())
    except BaseException:
        if batch is not None:
            batch.close()
        raise
    return crcs


# -- plain groups (materialize): every blob an ordinary array of its own -----------------------

PLAIN_GROUP_KEY = "caffe2ckpt_materialized"  # a plain group's attribute: where it came from
PLAIN_BLOB_KEY = "caffe2ckpt_blob"  # each of its arrays': the blob's exact name, dtype, order


def _group_json(attributes: dict[str, Any]) -> bytes:
    return json.dumps({"attributes": attributes, "zarr_format": 3,
                       "node_type": "group"}).encode()


def mark_complete(location: Location, root: str, attributes: dict[str, Any]) -> None:
    """Rewrite the ``zarr.json`` of the plain group ``root`` (written by
    :func:`write_plain_group` with ``complete=False``) with ``attributes`` saying it is complete
    (``complete: true`` beside the source), once everything in it is durable."""
    location.replace_file(f"{root}/{GROUP_FILE}", _group_json(_completed(attributes, True)))


def is_complete(location: Location, root: str) -> bool:
    """Whether the plain group ``root`` says it was finished: not when its mark says
    ``complete: false`` (stopped part way, e.g. a killed materialize) or its ``zarr.json``
    cannot be read; a group written before the mark existed (none there) counts as finished."""
    try:
        attributes = json.loads(location.read_bytes(f"{root}/{GROUP_FILE}"))["attributes"]
        return attributes[PLAIN_GROUP_KEY].get("complete", True) is True
    except (CheckpointError, OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


def taken_error(location: Location, root: str) -> FileExistsError:
    """The refusal to write the plain group ``root`` where one exists already (never
    overwritten), saying whether that one is unfinished (:func:`is_complete`)."""
    shown = location.display(root)
    if is_complete(location, root):
        return FileExistsError(f"{shown} exists already: materialize never overwrites; choose "
                               "another DEST (or delete that group)")
    return FileExistsError(f"{shown} exists already but is unfinished (a materialize stopped "
                           "part way, e.g. killed): delete it and run materialize again")


def _completed(attributes: dict[str, Any], complete: bool) -> dict[str, Any]:
    return {**attributes, PLAIN_GROUP_KEY: {**attributes[PLAIN_GROUP_KEY], "complete": complete}}


def write_plain_group(location: Location, root: str, attributes: dict[str, Any],
                      batches: Iterable[dict[str, np.ndarray]], *,
                      complete: bool = True) -> None:
    """Write an ordinary Zarr v3 group at ``root`` for readers that know nothing of caffe2ckpt:
    its ``zarr.json`` (holding ``attributes``) is created exclusively first (``FileExistsError``
    if the path is taken: nothing is changed then), then every blob of ``batches`` becomes an
    array of its own at :func:`~caffe2ckpt.naming.blob_path` of its name (:func:`_plain_array`).
    Batches are asked for one at a time and each is written before the next, so only one is
    held. As in :func:`write_group`, each array's ``zarr.json`` is written once every chunk is
    durable. If anything fails after the group was created (a batch that cannot be read
    included), the files this call wrote are removed again (best effort) and the error raised.
    The group's ``attributes[PLAIN_GROUP_KEY]`` say ``complete: false`` until the last step,
    which rewrites them with ``complete: true`` (:func:`mark_complete`; with ``complete=False``
    the caller does, once what it writes inside the group is done too): a group a kill
    stopped part way says so (:func:`is_complete`).
    """
    batch = location.sync_batch()
    try:
        location.create_group(root, GROUP_FILE, _group_json(_completed(attributes, False)),
                              batch=batch)
    except BaseException:
        if batch is not None:
            batch.close()
        raise
    written = [GROUP_FILE]
    try:
        _write_plain_arrays(location, root, batches, batch, written)
        if complete:
            mark_complete(location, root, attributes)
    except BaseException:
        try:
            location.remove_files(root, written)
        except Exception as exc:  # noqa: BLE001 - the failure that stopped the write matters
            logger.warning("cannot remove the unfinished group %s: %s (delete it)",
                           location.display(root), exc)
        raise


def remove_plain_groups(location: Location, roots: list[str]) -> None:
    """Remove the plain groups ``roots`` that one call wrote whole before a later part of it
    failed (best effort: a group that cannot be removed is named in a WARNING), so that the
    call leaves nothing behind."""
    for root in roots:
        try:
            location.remove(root)
        except Exception as exc:  # noqa: BLE001 - the failure that stopped the call matters
            logger.warning("cannot remove %s, written before the call failed: %s (delete it)",
                           location.display(root), exc)


def _write_plain_arrays(location: Location, root: str, batches: Iterable[dict[str, np.ndarray]],
                        batch: localio.SyncBatch | None, written: list[str]) -> None:
    """The arrays of :func:`write_plain_group`: every chunk, made durable, then every array's
    ``zarr.json``, made durable. ``written`` gets the path of every file written (or tried)."""
    metadata: list[tuple[str, bytes]] = []
    writes = _Writes(written)
    try:
        for blobs in batches:
            for name, arr in blobs.items():
                metadata.append(_write_plain_array(location, root, name, arr, batch, writes))
        writes.finish()
        location.make_durable(batch, [], _pool())
        batch = location.sync_batch()
        if batch is not None:
            batch.add_dirs([f"{root}/{path}" for path, _ in metadata])
        results([_pool().submit(location.write_file, f"{root}/{path}/{GROUP_FILE}", [data],
                                  batch=batch) for path, data in metadata])
        location.make_durable(batch, [], _pool())
    except BaseException:
        writes.finish(raising=False)  # no thread writes on once this returns
        if batch is not None:
            batch.close()
        raise


class _Writes:
    """Chunk writes in flight on the I/O threads: at most 64 of them, and 8 MiB unless it is
    one chunk (the oldest is waited for first). ``paths`` gets every file submitted, relative
    to the group."""

    COUNT, NBYTES = 64, 8 << 20

    def __init__(self, paths: list[str]) -> None:
        self.paths = paths
        self._pending: deque[tuple[Future[Any], int]] = deque()
        self._nbytes = 0

    def submit(self, location: Location, root: str, path: str, data: np.ndarray,
               batch: localio.SyncBatch | None) -> None:
        while self._pending and (len(self._pending) >= self.COUNT
                                 or self._nbytes + data.nbytes > self.NBYTES):
            future, nbytes = self._pending.popleft()
            self._nbytes -= nbytes
            future.result()
        self.paths.append(path)
        self._pending.append((_pool().submit(location.write_file, f"{root}/{path}", [data],
                                             batch=batch), data.nbytes))
        self._nbytes += data.nbytes

    def finish(self, raising: bool = True) -> None:
        futures = [f for f, _ in self._pending]
        self._pending.clear()
        self._nbytes = 0
        if raising:
            results(futures)
        else:
            wait(futures)


def _write_plain_array(location: Location, root: str, name: str, arr: np.ndarray,
                       batch: localio.SyncBatch | None, writes: _Writes) -> tuple[str, bytes]:
    """Write blob ``name``'s chunks as Zarr encodes them, each handed to ``writes`` as soon as
    it is encoded; return its array's path and ``zarr.json`` (written last by the caller)."""
    path, files = blob_path(name), {}
    array = _plain_array(files, name, arr)
    metadata = files.pop(GROUP_FILE).to_bytes()
    # named before anything is written: a failure from here on removes it and its directory
    writes.paths.append(f"{path}/{GROUP_FILE}")
    if location.is_local:
        location.makedirs(f"{root}/{path}", batch=batch)
        if batch is not None:  # its new entries: the chunks
            batch.add_dirs([f"{root}/{path}"])
    for selection in _plain_selections(arr, array.chunks):
        array[selection] = arr[selection]  # zarr encodes the chunk into ``files``
        for key in list(files):
            writes.submit(location, root, f"{path}/{key}", files.pop(key).as_numpy_array(),
                          batch)
    return path, metadata


def _plain_array(files: dict[str, Any], name: str, arr: np.ndarray) -> zarr.Array:
    """An empty Zarr array in ``files`` (a dict of Zarr buffers) for ``arr``: its own dtype
    (byte strings, fixed-width unicode and bool included) and shape; ``bytes`` in the blob's own
    byte order + ``crc32c``, no compression; chunks of at most 16 MiB along the axis its memory
    is laid out by (a Fortran-ordered blob is stored as its memory through Zarr's ``transpose``
    codec); every chunk written, also one equal to the fill value (so -0.0 and NaN payloads stay
    bits). Its attributes keep the exact name, dtype (byte order included) and memory order,
    which Zarr v3 data types do not."""
    fortran = arr.ndim > 1 and arr.flags.f_contiguous and not arr.flags.c_contiguous
    order = tuple(reversed(range(arr.ndim)))
    return zarr.create_array(
        zarr.storage.MemoryStore(files), shape=arr.shape, dtype=arr.dtype,
        chunks=_plain_chunk_shape(arr, fortran),
        filters=[TransposeCodec(order=order)] if fortran else None,
        serializer=BytesCodec(endian="big") if arr.dtype.byteorder == ">" else "auto",
        compressors=[Crc32cCodec()],
        chunk_key_encoding={"name": "default", "separator": "."},
        attributes={PLAIN_BLOB_KEY: {"name": name, "dtype": arr.dtype.str,
                                     "order": "F" if fortran else "C"}},
        config={"write_empty_chunks": True})


def _plain_chunk_shape(arr: np.ndarray, fortran: bool) -> tuple[int, ...]:
    """Chunks split the outermost axis of the blob's memory (axis 0, or the last one of a
    Fortran-ordered blob) as a checkpoint's arrays do; an empty blob gets chunks of 1 (none is
    written)."""
    if arr.size == 0:
        return tuple(max(1, n) for n in arr.shape)
    shape = arr.shape[::-1] if fortran else arr.shape
    chunks = (chunk_rows(shape, arr.dtype.itemsize), *shape[1:]) if shape else ()
    return chunks[::-1] if fortran else chunks


def _plain_selections(arr: np.ndarray, chunks: tuple[int, ...]) -> Iterator[Any]:
    """The selections of ``arr`` that are one chunk each (none for an empty blob)."""
    if arr.size == 0:
        return
    if arr.ndim == 0:
        yield ...
        return
    axis = next((i for i, (n, c) in enumerate(zip(arr.shape, chunks)) if c < n), 0)
    for start in range(0, arr.shape[axis], chunks[axis]):
        yield (slice(None),) * axis + (slice(start, start + chunks[axis]),)


def epoch_store(plan: GroupPlan, load: Callable[[str], np.ndarray]) -> zarr.abc.store.Store:
    """A read-only Zarr store holding the group ``plan`` describes (blobs planned without their
    data are read with ``load(name)`` when one of their keys is first asked for)."""
    from zarr.core.buffer import default_buffer_prototype

    return zarr.storage.MemoryStore(_LazyGroup(plan, load, default_buffer_prototype().buffer),
                                    read_only=True)


class _LazyGroup(MutableMapping[str, Any]):
    """A group's files by key, as Zarr buffers; an array planned without data is read whole
    (``load``) and cut into its chunk files the first time one of its keys is looked up."""

    def __init__(self, plan: GroupPlan, load: Callable[[str], np.ndarray], buffer: Any) -> None:
        self._buffer, self._load, self._lock = buffer, load, threading.Lock()
        self._files: dict[str, Any] = {GROUP_FILE: buffer.from_bytes(plan.group_json)}
        self._pending: dict[str, tuple[str, _ArrayPlan]] = {}  # chunk key -> (blob, array)
        names = {info.path: name for name, info in plan.manifest.arrays.items()}
        for array in plan.arrays:
            self._files[f"{array.path}/{GROUP_FILE}"] = buffer.from_bytes(array.metadata)
            row_bytes = 1 if array.data is None else array.data.shape[1]  # keys only: any
            for key, rows, padding in _chunks(array.shape, array.rows, row_bytes, padded=True):
                if array.data is None:
                    self._pending[f"{array.path}/{key}"] = (names[array.path], array)
                else:
                    self._files[f"{array.path}/{key}"] = buffer.from_bytes(
                        _chunk_bytes(array.data, rows, padding))

    def _fill(self, key: str) -> None:
        with self._lock:
            if key not in self._pending:
                return
            name, array = self._pending[key]
            data = stored_form(self._load(name))
            flat = data.reshape(data.shape[0], -1).view(np.uint8)
            for chunk, rows, padding in _chunks(array.shape, array.rows, flat.shape[1],
                                                padded=True):
                path = f"{array.path}/{chunk}"
                self._files[path] = self._buffer.from_bytes(_chunk_bytes(flat, rows, padding))
                self._pending.pop(path, None)

    def __getitem__(self, key: str) -> Any:
        self._fill(key)
        return self._files[key]

    def __contains__(self, key: object) -> bool:
        return key in self._files or key in self._pending

    def __iter__(self) -> Iterator[str]:
        return iter([*self._files, *self._pending])

    def __len__(self) -> int:
        return len(self._files) + len(self._pending)

    def __setitem__(self, key: str, value: Any) -> None:
        raise TypeError("this store is read-only")

    def __delitem__(self, key: str) -> None:
        raise TypeError("this store is read-only")


def _chunk_bytes(data: np.ndarray | Packed, rows: slice, padding: int) -> bytes:
    """One chunk file's bytes: the rows, ``padding`` zeros, then their CRC32C."""
    chunk = data[rows]
    raw = (np.ascontiguousarray(chunk).tobytes() if isinstance(chunk, np.ndarray)
           else b"".join(bytes(part) for part in chunk)) + bytes(padding)
    return raw + google_crc32c.value(raw).to_bytes(CRC_BYTES, "little")


def parse_manifest(raw: bytes, where: str, *, node: str, epoch: int) -> Manifest:
    """Parse a group's ``zarr.json`` into its manifest (strictly: :mod:`caffe2ckpt.fs.strictjson`).

    Raises:
        CheckpointCorruptedError: it is not a valid caffe2ckpt manifest.
    """
    try:
        return Manifest.from_dict(strictjson.loads(raw)["attributes"][ATTRS_KEY])
    except (ValueError, KeyError, TypeError, IndexError, AttributeError) as exc:
        blob = exc.blob if isinstance(exc, BlobManifestError) else GROUP_FILE
        raise CheckpointCorruptedError(
            f"checkpoint {where!r} (node {node!r}, epoch {epoch}): group metadata is "
            f"unreadable: {exc}", node=node, epoch=epoch, blob=blob,
        ) from exc


























