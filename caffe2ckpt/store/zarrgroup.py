"""One node's workspace as one Zarr v3 group: write it, read it back verified.

This is the only module that imports zarr. It knows the group layout and nothing about commits:

- the group's ``zarr.json`` holds ``attributes["caffe2ckpt"]``, the manifest
  (:mod:`caffe2ckpt.store.manifest`): node, epoch, save id and, per blob, its exact name, dtype, shape,
  memory order and where its bytes are;
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
checksum) and twice on the way in. Reads go straight into the destination array and verify
every checksum and file size; any mismatch raises :class:`CheckpointCorruptedError` naming node,
epoch and blob. Before a large read every chunk file's size is checked against the manifest, so
a manifest claiming more bytes than are stored is corruption, not a ``MemoryError``.

Numeric arrays are stored little-endian (big-endian ones are byte-swapped and swapped back);
unicode (``U``) and byte-string (``S``) arrays are stored as their code units (uint32 / uint8)
with one extra trailing axis, and restored to the exact original dtype.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import posixpath
from concurrent.futures import Future, wait
from typing import Any, NamedTuple

import google_crc32c
import numpy as np
import zarr
from zarr.codecs import Crc32cCodec

from caffe2ckpt.fs import strictjson
from caffe2ckpt.errors import CheckpointCorruptedError, CheckpointNotFoundError, InvalidBlobError
from caffe2ckpt.fs.iopool import pool as _pool
from caffe2ckpt.fs.localio import DIRECT_ALIGN, aligned_empty
from caffe2ckpt.fs.location import Location
from caffe2ckpt.store.manifest import PACKED_ARRAY, BlobInfo, Manifest
from caffe2ckpt.naming import blob_path

__all__ = ["ATTRS_KEY", "DEFAULT_PACK_THRESHOLD", "parse_manifest", "read_node", "write_node"]

ATTRS_KEY = "caffe2ckpt"
DEFAULT_PACK_THRESHOLD = 64 * 1024
CHUNK_BYTES = 16 * 1024 * 1024
# A read claiming more than this (a quarter of the machine's memory) checks every chunk file's
# size before allocating its destination, so a crafted manifest claiming petabytes is corruption,
# not a MemoryError. Smaller destinations are only reserved address space until read, and each
# file's size is checked as it is read anyway; checking them first as well cost W2 (256 MiB in
# 177 files) about 30% of its restore time.
try:
    _PRECHECK_BYTES = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 4
except (ValueError, OSError, AttributeError):  # not a POSIX system that says
    _PRECHECK_BYTES = 1 << 30
_ALIGN = 64
_CRC = 4


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


def _stored_spec(info: BlobInfo) -> tuple[np.dtype, tuple[int, ...]]:
    dtype = np.dtype(info.dtype)
    if dtype.kind == "U":
        return np.dtype("<u4"), info.shape + (dtype.itemsize // 4,)
    if dtype.kind == "S":
        return np.dtype(np.uint8), info.shape + (dtype.itemsize,)
    return (dtype.newbyteorder("<") if dtype.byteorder == ">" else dtype), info.shape


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


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _chunks(shape: tuple[int, ...], rows: int, row_bytes: int,
            padded: bool) -> list[tuple[str, slice, int]]:
    """Per chunk (chunks split axis 0 only): its key (Zarr's default encoding, "." separator),
    the rows it holds, and how many bytes of padding follow them in its file (the last chunk of
    a padded array is stored at the full chunk shape, as Zarr v3 stores edge chunks)."""
    zeros = ".0" * (len(shape) - 1)
    chunks = []
    for i in range(_ceil_div(shape[0], rows)):
        stop = min((i + 1) * rows, shape[0])
        padding = ((i + 1) * rows - stop) * row_bytes if padded else 0
        chunks.append((f"c.{i}{zeros}", slice(i * rows, stop), padding))
    return chunks


def _chunk_rows(shape: tuple[int, ...], itemsize: int) -> int:
    """Rows per chunk: at most about CHUNK_BYTES each; a whole number of DIRECT_ALIGN blocks
    where the row size allows (every chunk can then be read straight from the disk into its
    place); and chunks as even as that allows, because the last one is padded to full size."""
    n = shape[0]
    row_bytes = max(1, itemsize * math.prod(shape[1:]))
    most = max(1, CHUNK_BYTES // row_bytes)
    if n <= most:
        return n
    step = DIRECT_ALIGN // math.gcd(row_bytes, DIRECT_ALIGN)
    step = step if step <= most else 1
    most -= most % step
    fewest = _ceil_div(n, most)

    def rows(chunks: int) -> int:
        return _ceil_div(_ceil_div(n, chunks), step) * step

    # a few more chunks than the fewest often divide the rows evenly: no padding at all
    return min((rows(k) for k in range(fewest, fewest + 8)),
               key=lambda r: (_ceil_div(n, r) * r, -r))


class _Writer:
    """The files of one group: array metadata and chunks first (concurrently), then the group's
    ``zarr.json``, whose manifest records every chunk's CRC32C; then all of them are flushed to
    the disk together (:meth:`Location.make_durable`), each on the descriptor it was written
    through, so a write-back error of any of them fails this save."""

    def __init__(self, location: Location, root: str) -> None:
        self.location = location
        self.root = root
        self.metadata_files: list[tuple[str, bytes]] = []
        self.chunks: list[tuple[str, str, np.ndarray, int]] = []  # (array, path, data, padding)
        self.dirs: list[str] = [root]
        self.digests: dict[str, str] = {}
        self.batch = location.sync_batch()
        # directories whose entries this save creates: the group's parent, the group, its arrays
        self.sync_dirs: list[str] = [posixpath.dirname(root), root]

    def metadata(self, rel: str, data: bytes) -> None:
        self.digests[rel] = hashlib.sha256(data).hexdigest()
        self.metadata_files.append((f"{self.root}/{rel}", data))

    def array(self, rel: str, data: np.ndarray, rows: int) -> None:
        self.dirs.append(f"{self.root}/{rel}")
        self.metadata(f"{rel}/zarr.json", _array_metadata(data.dtype, data.shape,
                                                          (rows, *data.shape[1:])))
        flat = data.reshape(data.shape[0], -1).view(np.uint8)
        for key, rows_slice, padding in _chunks(data.shape, rows, flat.shape[1], padded=True):
            self.chunks.append((rel, f"{self.root}/{rel}/{key}", flat[rows_slice], padding))

    def write_arrays(self) -> dict[str, list[int]]:
        """Write every array; return the CRC32C of each chunk, by array path."""
        if self.location.is_local:
            for directory in self.dirs:
                created = self.location.makedirs(directory)
                self.sync_dirs += [posixpath.dirname(d) for d in created]
            self.sync_dirs += self.dirs[1:]
        futures = [_pool().submit(self.location.write_file, path, [data], batch=self.batch)
                   for path, data in self.metadata_files]
        chunk_futures = [(rel, _pool().submit(self._write_chunk, path, data, padding))
                         for rel, path, data, padding in self.chunks]
        _wait_all([*futures, *(f for _, f in chunk_futures)])
        crcs: dict[str, list[int]] = {}
        for rel, future in chunk_futures:
            crcs.setdefault(rel, []).append(future.result())
        return crcs

    def _write_chunk(self, path: str, data: np.ndarray, padding: int) -> int:
        chunk = np.ascontiguousarray(data).reshape(-1)
        crc = google_crc32c.value(chunk)
        buffers: list[Any] = [chunk]
        if padding:
            buffers.append(bytes(padding))
            crc = google_crc32c.extend(crc, buffers[-1])
        buffers.append(crc.to_bytes(_CRC, "little"))
        self.location.write_file(path, buffers, batch=self.batch)
        return crc

    def finish(self, group: bytes) -> None:
        """Write the group's ``zarr.json`` last, then make the whole group durable."""
        self.metadata("zarr.json", group)
        path, data = self.metadata_files[-1]
        self.location.write_file(path, [data], batch=self.batch)
        self.location.make_durable(self.batch, self.sync_dirs, _pool())

    def abandon(self) -> None:
        """Close the files still open for their flush (the save failed)."""
        if self.batch is not None:
            self.batch.close()


def write_node(
    location: Location,
    path: str,
    *,
    node: str,
    epoch: int,
    save_id: str,
    blobs: dict[str, np.ndarray],
    pack_threshold: int = DEFAULT_PACK_THRESHOLD,
) -> tuple[Manifest, dict[str, str]]:
    """Write ``blobs`` durably as a new Zarr group at ``path`` (which must hold no data).

    Returns:
        The manifest and the SHA-256 of every Zarr metadata file written (relative paths).
    """
    pack_threshold = max(1, pack_threshold)
    arrays: dict[str, BlobInfo] = {}
    packed: list[BlobInfo] = []
    pieces: list[np.ndarray] = []
    writer = _Writer(location, path)
    offset = 0
    for name, arr in blobs.items():
        nbytes = arr.nbytes
        flags = arr.flags
        order = "F" if flags.f_contiguous and not flags.c_contiguous else "C"
        if nbytes < pack_threshold or arr.ndim == 0 or arr.size == 0:
            offset = -(-offset // _ALIGN) * _ALIGN
            packed.append(BlobInfo(name, arr.dtype.str, arr.shape, order, None, 0, offset))
            pieces.append(arr if flags.c_contiguous else np.ascontiguousarray(arr))
            offset += nbytes
        else:
            data = _stored(arr)
            rows = _chunk_rows(data.shape, data.dtype.itemsize)
            info = BlobInfo(name, arr.dtype.str, arr.shape, order, path=blob_path(name),
                            chunk_rows=rows)
            arrays[name] = info
            writer.array(info.path, data, rows)
    packed_chunk = _chunk_rows((offset,), 1) if offset else 0
    if offset:
        writer.array(PACKED_ARRAY, _pack(packed, pieces, offset), packed_chunk)
    try:
        crcs = writer.write_arrays()
        arrays = {name: info._replace(crcs=tuple(crcs[info.path]))
                  for name, info in arrays.items()}
        manifest = Manifest(node=node, epoch=epoch, save_id=save_id, arrays=arrays,
                            packed=packed, packed_nbytes=offset, packed_chunk=packed_chunk,
                            packed_crcs=tuple(crcs.get(PACKED_ARRAY, ())))
        group = {"attributes": {ATTRS_KEY: manifest.to_dict()}, "zarr_format": 3,
                 "node_type": "group"}
        try:
            data = strictjson.check_size(json.dumps(group, separators=(",", ":")).encode(),
                                         f"the manifest of node {node!r} epoch {epoch}")
        except ValueError as exc:  # readers would refuse it: never write what cannot be read
            raise InvalidBlobError(f"{exc} (too many blobs, or too long names)") from exc
        writer.finish(data)
    except BaseException:
        writer.abandon()  # no descriptor outlives a failed save
        raise
    return manifest, writer.digests


def _pack(infos: list[BlobInfo], arrays: list[np.ndarray], nbytes: int) -> np.ndarray:
    """One uint8 buffer holding the C-contiguous ``arrays`` at their manifest offsets."""
    buffer = np.zeros(nbytes, np.uint8)
    view = memoryview(buffer)
    for info, arr in zip(infos, arrays):
        if arr.nbytes:
            view[info.offset:info.offset + arr.nbytes] = memoryview(arr.reshape(-1)).cast("B")
    return buffer


def parse_manifest(raw: bytes, where: str, *, node: str, epoch: int) -> Manifest:
    """Parse a group's ``zarr.json`` into its manifest (strictly: :mod:`caffe2ckpt.fs.strictjson`).

    Raises:
        CheckpointCorruptedError: it is not a valid caffe2ckpt manifest.
    """
    try:
        return Manifest.from_dict(strictjson.loads(raw)["attributes"][ATTRS_KEY])
    except (ValueError, KeyError, TypeError, IndexError, AttributeError) as exc:
        raise CheckpointCorruptedError(
            f"checkpoint {where!r} (node {node!r}, epoch {epoch}): group metadata is "
            f"unreadable: {exc}", node=node, epoch=epoch, blob="zarr.json",
        ) from exc


def read_node(
    location: Location, path: str, manifest: Manifest, names: list[str] | None = None, *,
    metadata: dict[str, str] | None = None,
) -> dict[str, np.ndarray]:
    """Read and verify blobs ``names`` (default: all) of the group at ``path``.

    ``metadata`` maps metadata files of the group (relative paths) to the SHA-256 they must
    have; they are read and checked together with the chunks (one round of concurrent reads).
    Small blobs come back as views into one buffer (disjoint, writable).

    Raises:
        CheckpointCorruptedError: a chunk is missing, truncated or fails its checksum, or a
            metadata file is missing or changed.
    """
    blobs = manifest.blobs
    wanted = [blobs[n] for n in (blobs if names is None else names) if n in blobs]
    where = f"checkpoint {location.display(path)!r} (node {manifest.node!r}, epoch {manifest.epoch})"
    with_packed = manifest.packed_nbytes and any(info.path is None for info in wanted)
    spans = _spans(manifest, path, [info for info in wanted if info.path is not None],
                   bool(with_packed))
    if sum(span.file_bytes for span in spans) >= _PRECHECK_BYTES:
        _wait_all([_pool().submit(_check_size, location, manifest, where, span)
                   for span in spans])
    arrays: dict[str, np.ndarray] = {}
    flats: dict[str, np.ndarray] = {}  # destination bytes by array path
    for info in wanted:
        if info.path is not None:
            dtype, shape = _stored_spec(info)
            arrays[info.name] = data = aligned_empty(shape, dtype)
            flats[info.path] = data.reshape(shape[0], -1).view(np.uint8)
    flats[PACKED_ARRAY] = packed = aligned_empty(
        (manifest.packed_nbytes if with_packed else 0,), np.dtype(np.uint8))
    # (blob, chunk path, destination, bytes of padding after it, crc)
    reads = [(span.blob, span.chunk, flats[span.array][span.rows], span.padding, span.crc)
             for span in spans]
    owners = manifest.metadata_files()
    reads.sort(key=lambda read: -read[2].nbytes)  # largest first: the disk is busy from the start
    _wait_all([*(_pool().submit(_read_chunk, location, manifest, where, *read) for read in reads),
               *(_pool().submit(_check_metadata, location, manifest, where, f"{path}/{rel}",
                                owners.get(rel) or rel, digest)
                 for rel, digest in (metadata or {}).items())])
    out: dict[str, np.ndarray] = {}
    for info in wanted:
        if info.path is not None:
            out[info.name] = _restored(arrays[info.name], info)
        else:
            view = np.ndarray(info.shape, _dtype(info.dtype), buffer=packed, offset=info.offset)
            out[info.name] = np.asfortranarray(view) if info.order == "F" else view
    return out


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


def _spans(manifest: Manifest, path: str, infos: list[BlobInfo], packed: bool) -> list[_Span]:
    """The chunk files holding blobs ``infos`` (and the packed array, if ``packed``)."""
    spans = []
    for info in infos:
        dtype, shape = _stored_spec(info)
        row_bytes = dtype.itemsize * math.prod(shape[1:])
        chunks = _chunks(shape, info.chunk_rows, row_bytes, manifest.padded_edges)
        spans += [_Span(info.name, info.path, f"{path}/{info.path}/{key}", rows, padding, crc,
                        row_bytes)
                  for (key, rows, padding), crc in zip(chunks, info.crcs)]
    if packed:
        chunks = _chunks((manifest.packed_nbytes,), manifest.packed_chunk, 1,
                         manifest.padded_edges)
        spans += [_Span(PACKED_ARRAY, PACKED_ARRAY, f"{path}/{PACKED_ARRAY}/{key}", rows,
                        padding, crc, 1)
                  for (key, rows, padding), crc in zip(chunks, manifest.packed_crcs)]
    return spans


def _check_size(location: Location, manifest: Manifest, where: str, span: _Span) -> None:
    """Before a large allocation: the chunk file is as large as the manifest claims (else a
    crafted manifest claiming petabytes would raise MemoryError instead of corruption)."""
    try:
        size = location.size(span.chunk)
        if size is None or size == span.file_bytes:  # None: the filesystem does not say
            return
        why = f"the chunk is damaged ({size} bytes where {span.file_bytes} were expected)"
    except CheckpointNotFoundError:
        why = "the chunk is missing"
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
                        "from the manifest's: written by another save?)")
