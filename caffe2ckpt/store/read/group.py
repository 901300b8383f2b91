"""Reading one node's group back, verified: the other half of
:mod:`caffe2ckpt.store.format.zarrgroup` (which plans and writes it, and is the only module that imports zarr; this one reads the files
zarr's layout puts there, directly).

:func:`read_node` reads the blobs asked for straight into their destination arrays, verifies
every chunk's size, its own CRC32C and the CRC32C the commit record holds, and every metadata
file's digest, and stops at the first damage: any mismatch raises
:class:`~caffe2ckpt.errors.CheckpointCorruptedError` naming node, epoch and blob. It pays for what
is stored, not for what a manifest claims: chunk files are checked before a large destination is
allocated (or, on object stores, populated), and reads are submitted a bounded window at a time.
"""

from __future__ import annotations

import bisect
import functools
import hashlib
import itertools
import math
import mmap
import os
import threading
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import google_crc32c
import numpy as np

from caffe2ckpt.errors import (
    CheckpointCorruptedError,
    CheckpointNotFoundError,
    StorageCredentialsError,
)
from caffe2ckpt.fs import strictjson
from caffe2ckpt.fs.localio import aligned_empty
from caffe2ckpt.fs.location import Location
from caffe2ckpt.store.format.manifest import (
    PACKED_ARRAY,
    BlobInfo,
    Manifest,
    chunk_key,
    stored_spec,
)
from caffe2ckpt.store.format.zarrgroup import CRC_BYTES, DEFAULT_PACK_THRESHOLD
from caffe2ckpt.store.read.rounds import run_reads

__all__ = ["RowRead", "chained_together", "check_chunk_sizes", "destination", "needs_precheck",
           "read_arrays", "read_node", "read_units", "restored", "row_calls", "row_reads",
           "small_blobs"]

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


def restored(data: np.ndarray, info: BlobInfo) -> np.ndarray:
    """``data`` (a blob's array in stored form) as the blob: its dtype, shape and order."""
    return _restored(data, info)


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


def small_blobs(infos: dict[str, BlobInfo]) -> list[str]:
    """The blobs a whole group packs together (smaller than the default pack threshold, 0-d
    or empty): those read together at once."""
    return [n for n, i in infos.items()
            if i.nbytes < DEFAULT_PACK_THRESHOLD or not i.shape or 0 in i.shape]


def chained_together(manifest: Manifest) -> list[str]:
    """The blobs of a differential save that older groups hold and that are read together:
    the small ones (a whole group packs them), whose chains share their sources' packed
    arrays. Each larger one is read alone, so that one array at a time is in memory."""
    return small_blobs({name: i.info for name, i in manifest.inherited.items()})


def read_units(manifest: Manifest) -> list[list[str]]:
    """How blobs are read one part at a time (verify, diff, materialize): each own array alone,
    every packed blob in one read; the blobs a differential save reads through older groups:
    the small ones in one read (every source group's packed array read once, not once per
    blob), each larger one alone."""
    units = [[name] for name in manifest.arrays]
    if manifest.packed:
        units.append([b.name for b in manifest.packed])
    together = chained_together(manifest)
    if together:
        units.append(together)
    alone = set(together)
    return units + [[name] for name in manifest.inherited if name not in alone]


def read_node(
    location: Location, path: str, manifest: Manifest, crcs: dict[str, tuple[int, ...]],
    names: list[str] | None = None, *, metadata: dict[str, str] | None = None,
) -> dict[str, np.ndarray]:
    """Read and verify blobs ``names`` (default: all) stored whole in the group at ``path``.

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
    blobs = manifest.stored_blobs
    wanted = [blobs[n] for n in (blobs if names is None else names) if n in blobs]
    arrays, packed = _read(location, path, manifest, crcs, wanted, metadata)
    out: dict[str, np.ndarray] = {}
    for info in wanted:
        if info.path is not None:
            out[info.name] = _restored(arrays[info.path], info)
        else:
            view = np.ndarray(info.shape, _dtype(info.dtype), buffer=packed, offset=info.offset)
            out[info.name] = np.asfortranarray(view) if info.order == "F" else view
    return out


def read_arrays(location: Location, path: str, manifest: Manifest,
                crcs: dict[str, tuple[int, ...]], infos: list[BlobInfo], *,
                metadata: dict[str, str] | None = None) -> dict[str, np.ndarray]:
    """Read and verify the arrays ``infos`` of the group at ``path`` (each its own array, e.g.
    a row overlay's), restored to their dtype: by array path. As :func:`read_node`."""
    arrays, _ = _read(location, path, manifest, crcs, infos, metadata)
    return {info.path: _restored(arrays[info.path], info) for info in infos}  # type: ignore[index]


def _read(location: Location, path: str, manifest: Manifest, crcs: dict[str, tuple[int, ...]],
          wanted: list[BlobInfo], metadata: dict[str, str] | None
          ) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """Read ``wanted`` into new arrays: by array path, and the packed array's bytes."""
    where = (f"checkpoint {location.display(path)!r} (node {manifest.node!r}, epoch "
             f"{manifest.epoch})")
    with_packed = bool(manifest.packed_nbytes) and any(info.path is None for info in wanted)
    files = _Files(path, manifest, [info for info in wanted if info.path is not None],
                   with_packed, crcs)
    least = _prechecked(location, files)
    checked = iter(()) if least is None else files.spans(least)  # lazy: a claim may be huge
    first = next(checked, None)
    if first is not None:  # before anything that large is allocated, or populated
        sizes = location.sizes_under(path)  # object stores: one listing, not a HEAD per file
        run_reads(functools.partial(_check_size, location, manifest, where, span, sizes)
                  for span in itertools.chain([first], checked))
    arrays, flats = _destinations(location, manifest, wanted, with_packed)
    owners = manifest.metadata_files()
    run_reads(itertools.chain(
        (functools.partial(_read_chunk, location, manifest, where, span.blob, span.chunk,
                           flats[span.array][span.rows], span.padding, span.crc)
         for span in files.spans()),
        (functools.partial(_check_metadata, location, manifest, where, f"{path}/{rel}",
                           owners.get(rel) or rel, digest)
         for rel, digest in (metadata or {}).items())))
    return arrays, flats[PACKED_ARRAY]


def _destinations(location: Location, manifest: Manifest, wanted: list[BlobInfo],
                  with_packed: bool) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """The uninitialised arrays the blobs ``wanted`` are read into, and their bytes, by array
    path (the packed array's too: empty unless ``with_packed``)."""
    empty = aligned_empty if location.is_local else _copy_target
    arrays: dict[str, np.ndarray] = {}
    flats: dict[str, np.ndarray] = {}  # destination bytes by array path
    for info in wanted:
        if info.path is not None:
            dtype, shape = stored_spec(info)
            arrays[info.path] = data = empty(shape, dtype)
            flats[info.path] = data.reshape(shape[0], -1).view(np.uint8)
    flats[PACKED_ARRAY] = empty((manifest.packed_nbytes if with_packed else 0,),
                                np.dtype(np.uint8))
    return arrays, flats


def _copy_target(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """An uninitialised array that chunks read from an object store are copied into (on S3
    block by block as the answer arrives, :mod:`caffe2ckpt.fs.s3read`): anonymous
    memory of its own, not ``np.empty``, which advises MADV_HUGEPAGE on allocations of 4 MiB
    and more; where the kernel's THP defrag is "madvise" (a common default) the first touch of
    such memory may compact memory synchronously (measured: ~0.5 s of system time per 256 MiB
    restored from S3 in a process whose heap the HTTP client had fragmented). Its pages are
    populated when it is mapped (``MAP_POPULATE``, where the OS has it): one call instead of a
    page fault per 4 KiB taken by the copying threads (W1 from S3: restore 0.80-0.86x raw
    faulting, 1.01-1.04x populated, in one run; with the block-by-block reads of s3read.py, on
    SeaweedFS, 0.27 s against 0.29-0.39 s faulting, medians of 11 in two runs each). So it is
    allocated only after every chunk file it is read from was found as large as the manifest
    says (:func:`_prechecked`). ``madvise(MADV_POPULATE_WRITE)`` per chunk after its size check
    was tried instead and dropped: memory:// W2 restores took 1.6x the CPU time. Local reads keep
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
        return (self.rows.stop - self.rows.start) * self.row_bytes + self.padding + CRC_BYTES


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
        return sum(len(a.crcs) * (a.rows * a.row_bytes + CRC_BYTES) if self.padded
                   else a.length * a.row_bytes + len(a.crcs) * CRC_BYTES for a in self.arrays)

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
    raise _damaged(location, manifest, where, span.blob, span.chunk, why)


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


def _blobs_of(manifest: Manifest, blob: str, chunk: str) -> list[str]:
    """The blobs, as the user names them, that damage of ``chunk`` (a path; ``blob``: its
    array's blob) hits: ``blob``, or for a chunk of the packed array every small blob with
    bytes in it. Worked out only once damage is found (a crafted manifest may claim many
    chunks and blobs)."""
    array, _, key = chunk.rpartition("/")
    if blob != PACKED_ARRAY or array.rpartition("/")[2] != PACKED_ARRAY \
            or not manifest.packed_chunk:
        return [blob]
    start = int(key.partition(".")[2]) * manifest.packed_chunk  # 1-d: key c.<index>
    stop = start + manifest.packed_chunk
    return [b.name for b in manifest.packed if b.offset is not None
            and b.offset < stop and b.offset + b.nbytes > start] or [blob]


def _damaged(location: Location, manifest: Manifest, where: str, blob: str, chunk: str,
             why: str) -> CheckpointCorruptedError:
    """The error for damage ``why`` of ``chunk`` of ``blob``'s array: it names the first blob
    it hits, the others of a packed chunk in a parenthesis, and carries them all."""
    names = _blobs_of(manifest, blob, chunk)
    holding = ""
    if blob == PACKED_ARRAY:
        others = names[1:]
        shown = ", ".join(repr(n) for n in others[:8]) + (f" and {len(others) - 8} more"
                                                          if len(others) > 8 else "")
        holding = f" (packed in {PACKED_ARRAY!r}" + (f" with {shown})" if others else ")")
    return CheckpointCorruptedError(
        f"{where}: blob {names[0]!r}{holding}, chunk {location.display(chunk)!r}: {why}",
        node=manifest.node, epoch=manifest.epoch, blob=names[0], blobs=names)


def _read_chunk(location: Location, manifest: Manifest, where: str, blob: str, chunk: str,
                out: np.ndarray, padding: int, expected: int) -> None:
    def corrupted(msg: str) -> CheckpointCorruptedError:
        return _damaged(location, manifest, where, blob, chunk, msg)

    flat = out.reshape(-1)
    try:
        tail = location.read_exact(chunk, memoryview(flat), padding + CRC_BYTES)
    except CheckpointNotFoundError as exc:
        raise corrupted("the chunk is missing") from exc
    except StorageCredentialsError:  # a ValueError, but the store refused: not damage
        raise
    except ValueError as exc:
        raise corrupted(f"the chunk is damaged ({exc})") from exc
    except OSError as exc:  # an I/O failure is not evidence of corruption: do not fall back
        named = _blobs_of(manifest, blob, chunk)[0]
        raise OSError(exc.errno, f"{where}: cannot read chunk {location.display(chunk)!r} of "
                      f"blob {named!r}: {exc.strerror or exc}") from exc
    crc = google_crc32c.value(flat)
    if padding:
        crc = google_crc32c.extend(crc, tail[:padding])
    stored = tail[padding:]
    if crc.to_bytes(CRC_BYTES, "little") != stored:
        raise corrupted("checksum mismatch (the data was changed or torn)")
    if int.from_bytes(stored, "little") != expected:
        raise corrupted("the chunk is not the one this checkpoint wrote (its checksum differs "
                        "from the one recorded: written by another save?)")



class RowRead(NamedTuple):
    """Rows of one array of a group (its own array, not the packed one) to read straight into
    a destination: array row ``r`` goes to row ``offset + r`` of ``dest``; only the rows of
    ``wanted`` (array rows ``[start, stop)``, sorted and disjoint) are written there. With a
    ``sink`` instead, each chunk holding a wanted row is read into a buffer of its own, checked,
    and given to ``sink(first array row, rows)`` (``(rows, row bytes)`` uint8) on the I/O
    thread that read it."""

    info: BlobInfo
    dest: np.ndarray | None  # (rows, row bytes) uint8
    offset: int
    wanted: list[tuple[int, int]]
    sink: Callable[[int, np.ndarray], None] | None = None


def needs_precheck(location: Location, nbytes: int) -> bool:
    """Whether the chunk files of a destination of ``nbytes`` are checked before it is
    allocated (:func:`_prechecked`'s rule for one array)."""
    return nbytes >= (_PRECHECK_BYTES if location.is_local else _POPULATE_BYTES)


def destination(location: Location, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """An uninitialised array for chunks of ``location`` to be read into (as a restore's)."""
    return (aligned_empty if location.is_local else _copy_target)(shape, dtype)


def check_chunk_sizes(location: Location, path: str, manifest: Manifest,
                      crcs: dict[str, tuple[int, ...]], infos: list[BlobInfo]) -> None:
    """Before a large destination is allocated: every chunk file of the arrays ``infos`` of the
    group at ``path`` is there and as large as the manifest says.

    Raises:
        CheckpointCorruptedError: one is missing or of another size.
    """
    where = (f"checkpoint {location.display(path)!r} (node {manifest.node!r}, epoch "
             f"{manifest.epoch})")
    files = _Files(path, manifest, infos, False, crcs)
    sizes = None if location.is_local else location.sizes_under(path)
    run_reads(functools.partial(_check_size, location, manifest, where, span, sizes)
              for span in files.spans())


def row_reads(location: Location, path: str, manifest: Manifest, crcs: dict[str, tuple[int, ...]],
              reads: list[RowRead], metadata: dict[str, str]) -> Iterator[Callable[[], Any]]:
    """The reads of the group at ``path`` that :class:`RowRead` ``reads`` ask for: each chunk
    holding a wanted row (a chunk wanted whole is read straight into its place; one wanted in
    part is read into a buffer of its own, checked, and its wanted rows copied), and the
    metadata files ``metadata`` (relative path -> SHA-256) checked. Run them with
    :func:`~caffe2ckpt.store.read.rounds.run_reads`."""
    return (call for call, _, _ in row_calls(location, path, manifest, crcs, reads, metadata))


def row_calls(location: Location, path: str, manifest: Manifest, crcs: dict[str, tuple[int, ...]],
              reads: list[RowRead], metadata: dict[str, str]
              ) -> Iterator[tuple[Callable[[], Any], RowRead | None, list[tuple[int, int]]]]:
    """:func:`row_reads`, each with the read it serves and the rows of that read's array it
    reads (``[start, stop)`` pieces: the wanted rows of one chunk; with a sink, the chunk's
    rows, all given to it); a metadata check with ``(None, [])``."""
    where = (f"checkpoint {location.display(path)!r} (node {manifest.node!r}, epoch "
             f"{manifest.epoch})")
    files = _Files(path, manifest, [read.info for read in reads], False, crcs)
    targets = {read.info.path: read for read in reads}
    owners = manifest.metadata_files()
    for rel, digest in metadata.items():
        yield functools.partial(_check_metadata, location, manifest, where, f"{path}/{rel}",
                                owners.get(rel) or rel, digest), None, []
    for span in files.spans():
        read = targets[span.array]
        pieces = _overlaps(read.wanted, span.rows.start, span.rows.stop)
        if not pieces:
            continue
        if read.sink is None and pieces == [(span.rows.start, span.rows.stop)]:
            rows = slice(read.offset + span.rows.start, read.offset + span.rows.stop)
            yield functools.partial(_read_chunk, location, manifest, where, span.blob,
                                    span.chunk, read.dest[rows], span.padding,
                                    span.crc), read, pieces
        else:  # a sink is given every row of the chunk: those are the rows it reads
            yield functools.partial(_read_pieces, location, manifest, where, span, read,
                                    pieces), read, pieces if read.sink is None else [
                (span.rows.start, span.rows.stop)]


_SCRATCH_BYTES = 4 << 20  # the largest chunk buffer an I/O thread keeps for its next chunk
_scratch_of = threading.local()


def _scratch(nbytes: int, local: bool) -> np.ndarray:
    """``nbytes`` of uint8 for one chunk read on this thread: this thread's buffer when the
    chunk fits in :data:`_SCRATCH_BYTES` (its pages already mapped), else a new one. The
    buffer is aligned, so a chunk not in the page cache is read into it directly (O_DIRECT,
    :func:`~caffe2ckpt.fs.localio.read_into`), as a restore reads into its destination: read
    through the page cache instead, the kernel's copy doubled the system time of 1 GiB
    ``mod`` reshards 2 -> 4 and 4 -> 2 (0.65-0.67 s against 0.33-0.38 s; wall times within
    this machine's noise). Checking the chunk's CRC brings it into the CPU's cache for the
    copy out. At most :data:`_SCRATCH_BYTES` stays held per I/O thread. A larger chunk (an
    object store's) gets a buffer of its own, as a restore's destination would
    (:func:`_copy_target` off the local disk)."""
    if nbytes > _SCRATCH_BYTES:
        return aligned_empty((nbytes,), np.dtype(np.uint8)) if local \
            else _copy_target((nbytes,), np.dtype(np.uint8))
    held = getattr(_scratch_of, "buffer", None)
    if held is None:
        held = _scratch_of.buffer = aligned_empty((_SCRATCH_BYTES,), np.dtype(np.uint8))
    return held[:nbytes]


def _overlaps(wanted: list[tuple[int, int]], start: int, stop: int) -> list[tuple[int, int]]:
    """The parts of the intervals ``wanted`` (sorted, disjoint) within ``[start, stop)``."""
    first = max(0, bisect.bisect_right(wanted, (start, math.inf)) - 1)
    out = []
    for a, b in wanted[first:]:
        if a >= stop:
            break
        if b > start:
            out.append((max(a, start), min(b, stop)))
    return out


def _read_pieces(location: Location, manifest: Manifest, where: str, span: _Span, read: RowRead,
                 pieces: list[tuple[int, int]]) -> None:
    """Read one chunk into a buffer of its own, checked, and copy rows ``pieces`` (array rows)
    into ``read``'s destination (or give the chunk's rows to its sink)."""
    count = span.rows.stop - span.rows.start
    buffer = _scratch(count * span.row_bytes, location.is_local).reshape(count, span.row_bytes)
    _read_chunk(location, manifest, where, span.blob, span.chunk, buffer, span.padding, span.crc)
    if read.sink is not None:
        read.sink(span.rows.start, buffer)
        return
    assert read.dest is not None
    for a, b in pieces:
        read.dest[read.offset + a:read.offset + b] = buffer[a - span.rows.start:b - span.rows.start]
