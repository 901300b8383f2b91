"""One node's workspace as one Zarr v3 group: plan it, write it, read it back verified.

This is the only module that imports zarr. It knows the group layout and nothing about commits:

- the group's ``zarr.json`` holds ``attributes["caffe2ckpt"]``, the manifest
  (:mod:`caffe2ckpt.store.manifest`): node, epoch, save id and, per blob, its exact name, dtype,
  shape, memory order and where its bytes are. It is known before any byte is written
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
record keeps them). Reads go straight into the destination array, verify every checksum, file
size and the CRC the record holds, and stop at the first damage; any mismatch raises
:class:`CheckpointCorruptedError` naming node, epoch and blob. Before a large read every chunk
file's size is checked against the manifest, so a manifest claiming more bytes than are stored is
corruption, not a ``MemoryError``.

Numeric arrays are stored little-endian (big-endian ones are byte-swapped and swapped back);
unicode (``U``) and byte-string (``S``) arrays are stored as their code units (uint32 / uint8)
with one extra trailing axis, and restored to the exact original dtype.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
import math
import mmap
import os
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import FIRST_EXCEPTION, Future, wait
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import google_crc32c
import numpy as np
import zarr
from zarr.codecs import Crc32cCodec

from caffe2ckpt.errors import (
    CheckpointCorruptedError,
    CheckpointNotFoundError,
    InvalidBlobError,
    StorageCredentialsError,
)
from caffe2ckpt.fs import localio, strictjson
from caffe2ckpt.fs.iopool import io_threads
from caffe2ckpt.fs.iopool import pool as _pool
from caffe2ckpt.fs.localio import aligned_empty
from caffe2ckpt.fs.location import Location
from caffe2ckpt.naming import blob_path
from caffe2ckpt.store.manifest import (
    PACKED_ARRAY,
    BlobInfo,
    BlobManifestError,
    Manifest,
    chunk_key,
    chunk_keys,
    chunk_rows,
    stored_spec,
)

__all__ = ["ATTRS_KEY", "DEFAULT_PACK_THRESHOLD", "GROUP_FILE", "GroupPlan", "parse_manifest",
           "plan_group", "read_node", "write_arrays"]

ATTRS_KEY = "caffe2ckpt"
GROUP_FILE = "zarr.json"
DEFAULT_PACK_THRESHOLD = 64 * 1024
# A read claiming more than this (a quarter of the machine's memory) checks every chunk file's
# size before allocating its destination, so a crafted manifest claiming petabytes is corruption,
# not a MemoryError. Smaller local destinations are only address space until read, and each
# file's size is checked as it is read anyway; checking them first as well cost W2 (256 MiB in
# 177 files) about 30% of its restore time. Destinations of object stores (and memory://) of
# _POPULATE_BYTES or more are populated when allocated: their files are checked first
# (_prechecked).
try:
    _PRECHECK_BYTES = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 4
except (ValueError, OSError, AttributeError):  # not a POSIX system that says
    _PRECHECK_BYTES = 1 << 30
_POPULATE_BYTES = 4 << 20  # _copy_target maps destinations this large with MAP_POPULATE
_ALIGN = 64
_CRC = 4
# Reads submitted and not done at once (_run_bounded): at least this many, and 4 per I/O thread.
# The main thread refills the window only when it gets the GIL (behind busy I/O threads, up to
# the 5 ms switch interval), so a window of 32 starved the threads on warm restores of many
# small files (W2 took 1.5-2x as long); 256 is as fast as submitting everything at once was.
_WINDOW = 256


def _wait_all(futures: list[Future[Any]]) -> None:
    """Wait for every future (no thread keeps writing after we return), then raise the first
    failure."""
    wait(futures)
    for future in futures:
        future.result()


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


def _stored(arr: np.ndarray) -> np.ndarray:
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


def _restored(data: np.ndarray, info: BlobInfo) -> np.ndarray:
    dtype = np.dtype(info.dtype)
    if dtype.kind == "U" and dtype.byteorder == ">":
        out = data.byteswap().view(dtype).reshape(info.shape)
    elif dtype.kind in "US":
        out = data.view(dtype).reshape(info.shape)
    elif dtype.byteorder == ">":
        out = data.byteswap().view(dtype)
    else:
        out = data
    return np.asfortranarray(out) if info.order == "F" else out


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
    data: np.ndarray  # (rows, bytes per row) uint8 view of the stored array
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


def _array_plan(path: str, data: np.ndarray, rows: int) -> _ArrayPlan:
    metadata = _array_metadata(data.dtype, data.shape, (rows, *data.shape[1:]))
    return _ArrayPlan(path, data.shape, data.reshape(data.shape[0], -1).view(np.uint8), rows,
                      metadata)


def plan_group(*, node: str, epoch: int, save_id: str, blobs: dict[str, np.ndarray],
               pack_threshold: int = DEFAULT_PACK_THRESHOLD) -> GroupPlan:
    """How ``blobs`` are written as a group: nothing is copied but the packed small blobs.

    Raises:
        InvalidBlobError: the manifest would be larger than readers accept.
    """
    pack_threshold = max(1, pack_threshold)
    arrays: dict[str, BlobInfo] = {}
    packed: list[BlobInfo] = []
    pieces: list[np.ndarray] = []
    plans: list[_ArrayPlan] = []
    offset = 0
    for name, arr in blobs.items():
        flags = arr.flags
        order = "F" if flags.f_contiguous and not flags.c_contiguous else "C"
        if arr.nbytes < pack_threshold or arr.ndim == 0 or arr.size == 0:
            offset = -(-offset // _ALIGN) * _ALIGN
            packed.append(BlobInfo(name, arr.dtype.str, arr.shape, order, None, 0, offset))
            pieces.append(arr if flags.c_contiguous else np.ascontiguousarray(arr))
            offset += arr.nbytes
        else:
            data = _stored(arr)
            rows = chunk_rows(data.shape, data.dtype.itemsize)
            info = BlobInfo(name, arr.dtype.str, arr.shape, order, path=blob_path(name),
                            chunk_rows=rows)
            arrays[name] = info
            plans.append(_array_plan(info.path, data, rows))
    packed_chunk = chunk_rows((offset,), 1) if offset else 0
    if offset:
        plans.append(_array_plan(PACKED_ARRAY, _pack(packed, pieces, offset), packed_chunk))
    manifest = Manifest(node=node, epoch=epoch, save_id=save_id, arrays=arrays, packed=packed,
                        packed_nbytes=offset, packed_chunk=packed_chunk,
                        packed_blob_bytes=sum(p.nbytes for p in pieces))
    group = {"attributes": {ATTRS_KEY: manifest.to_dict()}, "zarr_format": 3,
             "node_type": "group"}
    try:
        data = strictjson.check_size(json.dumps(group, separators=(",", ":")).encode(),
                                     f"the manifest of node {node!r} epoch {epoch}")
    except ValueError as exc:  # readers would refuse it: never write what cannot be read
        raise InvalidBlobError(f"{exc} (too many blobs, or too long names)") from exc
    return GroupPlan(manifest, data, plans)


def write_arrays(location: Location, root: str, plan: GroupPlan,
                 batch: localio.SyncBatch | None) -> dict[str, tuple[int, ...]]:
    """Write every array of ``plan`` into the group at ``root`` (whose ``zarr.json`` exists):
    metadata files and chunks concurrently, each handed to ``batch`` for its flush (local
    disks; the caller makes the batch durable). Returns every chunk's CRC32C, by array path.
    Every write has finished when this returns, also when it raises."""
    if location.is_local:
        for array in plan.arrays:
            location.makedirs(f"{root}/{array.path}", batch=batch)
        if batch is not None:  # their new entries: each array's files
            batch.add_dirs([f"{root}/{array.path}" for array in plan.arrays])
    futures: list[Future[Any]] = []
    chunks: list[tuple[str, Future[int]]] = []
    for array in plan.arrays:
        futures.append(_pool().submit(location.write_file, f"{root}/{array.path}/zarr.json",
                                      [array.metadata], batch=batch))
        for key, rows, padding in _chunks(array.shape, array.rows, array.data.shape[1],
                                          padded=True):
            future = _pool().submit(_write_chunk, location, f"{root}/{array.path}/{key}",
                                    array.data[rows], padding, batch)
            chunks.append((array.path, future))
    _wait_all([*futures, *(f for _, f in chunks)])
    crcs: dict[str, list[int]] = {}
    for path, future in chunks:
        crcs.setdefault(path, []).append(future.result())
    return {path: tuple(values) for path, values in crcs.items()}


def _write_chunk(location: Location, path: str, data: np.ndarray, padding: int,
                 batch: localio.SyncBatch | None) -> int:
    chunk = np.ascontiguousarray(data).reshape(-1)
    crc = google_crc32c.value(chunk)
    buffers: list[Any] = [chunk]
    if padding:
        buffers.append(bytes(padding))
        crc = google_crc32c.extend(crc, buffers[-1])
    buffers.append(crc.to_bytes(_CRC, "little"))
    location.write_file(path, buffers, batch=batch)
    return crc


def _pack(infos: list[BlobInfo], arrays: list[np.ndarray], nbytes: int) -> np.ndarray:
    """One uint8 buffer holding the C-contiguous ``arrays`` at their manifest offsets."""
    parts: list[Any] = []  # the blobs' bytes and the zero padding between them, joined in C
    end = 0
    for info, arr in zip(infos, arrays):
        if arr.nbytes:
            if info.offset > end:
                parts.append(bytes(info.offset - end))
            parts.append(arr)  # C-contiguous: its buffer is its bytes
            end = info.offset + arr.nbytes
    parts.append(bytes(nbytes - end))
    return np.frombuffer(b"".join(parts), np.uint8)  # read-only: it is only written out


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


def read_node(
    location: Location, path: str, manifest: Manifest, crcs: dict[str, tuple[int, ...]],
    names: list[str] | None = None, *, metadata: dict[str, str] | None = None,
) -> dict[str, np.ndarray]:
    """Read and verify blobs ``names`` (default: all) of the group at ``path``.

    ``crcs`` gives every chunk's CRC32C by array path (:meth:`Manifest.chunk_crcs`): a chunk
    must hold its own checksum and that one. ``metadata`` maps metadata files of the group
    (relative paths) to the SHA-256 they must have; they are read and checked together with
    the chunks (one round of concurrent reads, submitted a bounded number at a time, which
    stops at the first damage). Small blobs come back as views into one buffer (disjoint,
    writable).

    Raises:
        CheckpointCorruptedError: a chunk is missing, truncated or fails its checksum, or a
            metadata file is missing or changed.
    """
    blobs = manifest.blobs
    wanted = [blobs[n] for n in (blobs if names is None else names) if n in blobs]
    where = f"checkpoint {location.display(path)!r} (node {manifest.node!r}, epoch {manifest.epoch})"
    with_packed = bool(manifest.packed_nbytes) and any(info.path is None for info in wanted)
    files = _Files(path, manifest, [info for info in wanted if info.path is not None],
                   with_packed, crcs)
    least = _prechecked(location, files)
    if least is not None:  # before anything that large is allocated, or populated
        sizes = location.sizes_under(path)  # object stores: one listing, not a HEAD per file
        _run_bounded(functools.partial(_check_size, location, manifest, where, span, sizes)
                     for span in files.spans(least))
    arrays, flats = _destinations(location, manifest, wanted, with_packed)
    owners = manifest.metadata_files()
    _run_bounded(itertools.chain(
        (functools.partial(_read_chunk, location, manifest, where, span.blob, span.chunk,
                           flats[span.array][span.rows], span.padding, span.crc)
         for span in files.spans()),
        (functools.partial(_check_metadata, location, manifest, where, f"{path}/{rel}",
                           owners.get(rel) or rel, digest)
         for rel, digest in (metadata or {}).items())))
    out: dict[str, np.ndarray] = {}
    for info in wanted:
        if info.path is not None:
            out[info.name] = _restored(arrays[info.name], info)
        else:
            view = np.ndarray(info.shape, _dtype(info.dtype), buffer=flats[PACKED_ARRAY],
                              offset=info.offset)
            out[info.name] = np.asfortranarray(view) if info.order == "F" else view
    return out


def _destinations(location: Location, manifest: Manifest, wanted: list[BlobInfo],
                  with_packed: bool) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """The uninitialised arrays the blobs ``wanted`` are read into, by blob name, and their
    bytes by array path (the packed array's too: empty unless ``with_packed``)."""
    empty = aligned_empty if location.is_local else _copy_target
    arrays: dict[str, np.ndarray] = {}
    flats: dict[str, np.ndarray] = {}  # destination bytes by array path
    for info in wanted:
        if info.path is not None:
            dtype, shape = stored_spec(info)
            arrays[info.name] = data = empty(shape, dtype)
            flats[info.path] = data.reshape(shape[0], -1).view(np.uint8)
    flats[PACKED_ARRAY] = empty((manifest.packed_nbytes if with_packed else 0,),
                                np.dtype(np.uint8))
    return arrays, flats


def _run_bounded(calls: Iterable[Callable[[], Any]]) -> None:
    """Run ``calls`` on the I/O threads in order, at most :data:`_WINDOW` (or 4 per thread)
    submitted and not yet done. At the first failure nothing more is submitted, the calls not
    started are cancelled and the failure (the earliest submitted, if several) is raised; calls
    already running finish on their own. So a manifest claiming a million chunks costs what the
    first few of them show, not a future per claimed chunk."""
    runner = _Bounded(max(_WINDOW, 4 * io_threads()))
    for index, call in enumerate(calls):
        if not runner.submit(index, call):
            break
    runner.finish()


class _Bounded:
    """Calls on the I/O threads, at most ``window`` submitted and not done (:func:`_run_bounded`):
    a semaphore slot per call, released by the call's done-callback, which also notes its
    failure (O(1) per call, unlike a ``wait()`` on the window per call)."""

    def __init__(self, window: int) -> None:
        self.slots = threading.Semaphore(window)
        self.lock = threading.Lock()
        self.pending: dict[Future[Any], int] = {}  # submitted, not done: submission order
        self.failures: list[tuple[int, BaseException]] = []

    def submit(self, index: int, call: Callable[[], Any]) -> bool:
        """Submit ``call`` once a slot is free; False (nothing submitted) after a failure."""
        self.slots.acquire()
        if self.failures:
            self.slots.release()
            return False
        future = _pool().submit(call)
        with self.lock:
            self.pending[future] = index
        future.add_done_callback(self._done)  # at once if it is done already
        return True

    def _done(self, future: Future[Any]) -> None:
        with self.lock:
            index = self.pending.pop(future)
            if not future.cancelled() and future.exception() is not None:
                self.failures.append((index, future.exception()))  # type: ignore[arg-type]
        self.slots.release()

    def finish(self) -> None:
        """Wait for every call, or until one failed; raise the earliest failure, if any."""
        with self.lock:
            pending = dict(self.pending)
        done = set() if self.failures else wait(pending, return_when=FIRST_EXCEPTION).done
        # a failure's callback may not have run yet when wait() returns: look at them too
        failures = [*self.failures, *((pending[f], f.exception()) for f in done
                                      if not f.cancelled() and f.exception() is not None)]
        if failures:
            with self.lock:
                queued = list(self.pending)
            for future in queued:
                future.cancel()  # its callback takes the lock: not held here
            raise min(failures, key=lambda failure: failure[0])[1]


def _copy_target(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """An uninitialised array that chunks read from an object store are copied into: anonymous
    memory of its own, not ``np.empty``, which advises MADV_HUGEPAGE on allocations of 4 MiB
    and more; where the kernel's THP defrag is "madvise" (a common default) the first touch of
    such memory may compact memory synchronously (measured: ~0.5 s of system time per 256 MiB
    restored from S3 in a process whose heap the HTTP client had fragmented). Its pages are
    populated when it is mapped (``MAP_POPULATE``, where the OS has it): one call instead of a
    page fault per 4 KiB taken by eight copying threads at once (W1 from S3: restore 0.80-0.86x
    raw faulting, 1.01-1.04x populated, in one run). So it is allocated only after every chunk
    file it is read from was found as large as the manifest says (:func:`_prechecked`).
    ``madvise(MADV_POPULATE_WRITE)`` per chunk after its size check was tried instead and
    dropped: memory:// W2 restores took 1.6x the CPU time. Local reads keep
    :func:`aligned_empty`: O_DIRECT into huge pages costs less CPU there."""
    count = math.prod(shape)
    nbytes = count * dtype.itemsize
    if nbytes < _POPULATE_BYTES:
        return np.empty(shape, dtype)
    if hasattr(mmap, "MAP_POPULATE"):
        memory = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
                           | mmap.MAP_POPULATE)
    else:
        memory = mmap.mmap(-1, nbytes)
    return np.frombuffer(memory, dtype, count).reshape(shape)


def _prechecked(location: Location, files: _Files) -> int | None:
    """Which chunk files to check the size of before the destinations are allocated: those of
    arrays of at least the returned number of bytes (None: none). Every file when the claim is
    large (:data:`_PRECHECK_BYTES`); else, on object stores and ``memory://``, the files of the
    arrays :func:`_copy_target` populates up front, so a claim is never paid for in memory
    before the bytes are known to be there (one ``info`` each: a dictionary
    lookup on ``memory://``; on S3 one listing of the group gives them all). Local destinations
    are address space until read."""
    if files.nbytes >= _PRECHECK_BYTES:
        return 0
    return None if location.is_local else _POPULATE_BYTES


class _Span(NamedTuple):
    """One chunk file to read: whose it is, where, which rows of the destination, and what the
    file must hold (the rows' bytes, then ``padding`` bytes, then the CRC32C)."""

    blob: str  # the blob's name, or PACKED_ARRAY
    array: str  # its array's path in the group (unique, unlike names: a blob may be "_packed")
    chunk: str
    rows: slice
    padding: int
    crc: int
    row_bytes: int

    @property
    def file_bytes(self) -> int:
        return (self.rows.stop - self.rows.start) * self.row_bytes + self.padding + _CRC


class _Array(NamedTuple):
    blob: str  # the blob's name, or PACKED_ARRAY
    path: str  # in the group
    ndim: int
    length: int  # rows
    rows: int  # per chunk
    row_bytes: int
    crcs: tuple[int, ...]  # one per chunk


class _Files:
    """The chunk files holding blobs ``infos`` (and the packed array, if ``packed``) of the
    group at ``path``: their total size, and the files one by one (:meth:`spans`, generated as
    they are read: a crafted manifest's million claimed chunks are never all in memory)."""

    def __init__(self, path: str, manifest: Manifest, infos: list[BlobInfo], packed: bool,
                 crcs: dict[str, tuple[int, ...]]) -> None:
        self.path, self.padded = path, manifest.padded_edges
        arrays = []
        for info in infos:
            dtype, shape = stored_spec(info)
            arrays.append(_Array(info.name, info.path, len(shape), shape[0], info.chunk_rows,
                                 dtype.itemsize * math.prod(shape[1:]), crcs[info.path]))
        if packed:
            arrays.append(_Array(PACKED_ARRAY, PACKED_ARRAY, 1, manifest.packed_nbytes,
                                 manifest.packed_chunk, 1, crcs[PACKED_ARRAY]))
        # largest chunks first: the disk is busy from the start
        self.arrays = sorted(arrays, key=lambda a: -a.rows * a.row_bytes)

    @property
    def nbytes(self) -> int:
        """The size of all the files together."""
        return sum(len(a.crcs) * (a.rows * a.row_bytes + _CRC) if self.padded
                   else a.length * a.row_bytes + len(a.crcs) * _CRC for a in self.arrays)

    def spans(self, least: int = 0) -> Iterator[_Span]:
        """The files, one by one; only those of arrays of at least ``least`` bytes."""
        for a in self.arrays:
            if a.length * a.row_bytes < least:
                continue
            for i, crc in enumerate(a.crcs):
                stop = min((i + 1) * a.rows, a.length)
                padding = ((i + 1) * a.rows - stop) * a.row_bytes if self.padded else 0
                yield _Span(a.blob, a.path, f"{self.path}/{a.path}/{chunk_key(a.ndim, i)}",
                            slice(i * a.rows, stop), padding, crc, a.row_bytes)


def _check_size(location: Location, manifest: Manifest, where: str, span: _Span,
                sizes: dict[str, int] | None = None) -> None:
    """Before a large allocation: the chunk file is as large as the manifest claims (else a
    crafted manifest claiming petabytes would raise MemoryError instead of corruption). With
    ``sizes`` (one listing of the group), the size is looked up there."""
    try:
        if sizes is None:
            size = location.size(span.chunk)
        elif span.chunk in sizes:
            size = sizes[span.chunk]
        else:
            raise CheckpointNotFoundError(span.chunk)
        if size is None or size == span.file_bytes:  # None: the filesystem does not say
            return
        why = f"the chunk is damaged ({size} bytes where {span.file_bytes} were expected)"
    except CheckpointNotFoundError:
        why = "the chunk is missing"
    except StorageCredentialsError:  # a ValueError, but the store refused: not damage
        raise
    except ValueError as exc:  # not a regular file, or reached through a symlink
        why = f"the chunk is damaged ({exc})"
    raise CheckpointCorruptedError(
        f"{where}: blob {span.blob!r}, chunk {location.display(span.chunk)!r}: {why}",
        node=manifest.node, epoch=manifest.epoch, blob=span.blob)


@functools.lru_cache(maxsize=256)
def _dtype(dtype: str) -> np.dtype:
    return np.dtype(dtype)


def _check_metadata(location: Location, manifest: Manifest, where: str, file: str, blob: str,
                    digest: str) -> None:
    try:
        raw = location.read_bytes(file, limit=strictjson.MAX_BYTES)
    except StorageCredentialsError:  # a ValueError, but the store refused: not damage
        raise
    except (CheckpointNotFoundError, ValueError):  # gone, too large, or not a regular file
        raw = b""
    if hashlib.sha256(raw).hexdigest() != digest:
        raise CheckpointCorruptedError(
            f"{where}: metadata file {location.display(file)!r} of blob {blob!r} was changed "
            "or lost", node=manifest.node, epoch=manifest.epoch, blob=blob,
        )


def _read_chunk(location: Location, manifest: Manifest, where: str, blob: str, chunk: str,
                out: np.ndarray, padding: int, expected: int) -> None:
    def corrupted(msg: str) -> CheckpointCorruptedError:
        return CheckpointCorruptedError(
            f"{where}: blob {blob!r}, chunk {location.display(chunk)!r}: {msg}",
            node=manifest.node, epoch=manifest.epoch, blob=blob,
        )

    flat = out.reshape(-1)
    try:
        tail = location.read_exact(chunk, memoryview(flat), padding + _CRC)
    except CheckpointNotFoundError as exc:
        raise corrupted("the chunk is missing") from exc
    except StorageCredentialsError:  # a ValueError, but the store refused: not damage
        raise
    except ValueError as exc:
        raise corrupted(f"the chunk is damaged ({exc})") from exc
    except OSError as exc:  # an I/O failure is not evidence of corruption: do not fall back
        raise OSError(exc.errno, f"{where}: cannot read chunk {location.display(chunk)!r} of "
                      f"blob {blob!r}: {exc.strerror or exc}") from exc
    crc = google_crc32c.value(flat)
    if padding:
        crc = google_crc32c.extend(crc, tail[:padding])
    stored = tail[padding:]
    if crc.to_bytes(_CRC, "little") != stored:
        raise corrupted("checksum mismatch (the data was changed or torn)")
    if int.from_bytes(stored, "little") != expected:
        raise corrupted("the chunk is not the one this checkpoint wrote (its checksum differs "
                        "from the one recorded: written by another save?)")
