"""Local file reads: O_DIRECT for large files the page cache does not hold, buffered reads
otherwise, and the fallbacks (unaligned destinations, filesystems without O_DIRECT).

Real files only. A file leaves the page cache through ``posix_fadvise(DONTNEED)`` after an
fsync, which needs no privileges. Which path a read took shows in the page cache afterwards: a
direct read leaves the file out of it, a buffered read brings the file in.
"""

from __future__ import annotations

import errno
import math
import mmap
import os
import time

import numpy as np
import pytest

from caffe2ckpt import CheckpointCorruptedError
from caffe2ckpt.fs import localio
from caffe2ckpt.fs.location import Location
from caffe2ckpt.store.commit.protocol import CheckpointStore, SaveInfo
from caffe2ckpt.store.format.manifest import CHUNK_BYTES, chunk_rows
from caffe2ckpt.store.format.paths import new_save_id

pytestmark = pytest.mark.skipif(not getattr(os, "O_DIRECT", 0), reason="O_DIRECT is Linux-only")

TRAILER = b"\x01\x02\x03\x04"


def write(path, payload: bytes) -> None:
    with open(path, "wb") as f:
        f.write(payload + TRAILER)
        f.flush()
        os.fsync(f.fileno())


def cached_pages(path) -> int:
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        pages = localio._cachestat_pages(fd, size)
        return localio._mincore_pages(fd, size) if pages is None else pages
    finally:
        os.close(fd)


def evict(*paths) -> None:
    """Drop ``paths`` from the page cache (a page just written back may need another try)."""
    for path in paths:
        for _ in range(20):
            os.sync()
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
            if not cached_pages(path):
                break
            time.sleep(0.05)
        else:
            pytest.skip(f"the page cache keeps {path} (cannot test cold reads here)")


@pytest.fixture
def disk(tmp_path):
    """A folder on a filesystem that takes O_DIRECT (tmp_path may be a tmpfs elsewhere)."""
    probe = tmp_path / "probe"
    probe.write_bytes(b"x")
    try:
        os.close(os.open(probe, os.O_RDONLY | os.O_DIRECT))
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
        pytest.skip(f"{tmp_path} is on a filesystem without O_DIRECT")
    return tmp_path


def payload(nbytes: int) -> bytes:
    return np.random.default_rng(nbytes).integers(0, 256, nbytes, dtype=np.uint8).tobytes()


def test_a_large_file_outside_the_page_cache_is_read_directly(disk):
    data = payload(4 * localio.DIRECT_MIN_BYTES + 1000)  # an unaligned tail, too
    path = disk / "chunk"
    write(path, data)
    evict(path)
    out = localio.aligned_empty((len(data),), np.dtype(np.uint8))
    assert localio.read_into(str(path), memoryview(out), len(TRAILER)) == TRAILER
    assert out.tobytes() == data
    # only the last, partial block and the trailer went through the page cache
    assert cached_pages(path) <= 1


def test_a_cached_file_is_read_through_the_page_cache(disk):
    data = payload(2 * localio.DIRECT_MIN_BYTES)
    path = disk / "chunk"
    write(path, data)
    assert path.read_bytes()[:len(data)] == data  # cached now
    out = localio.aligned_empty((len(data),), np.dtype(np.uint8))
    assert localio.read_into(str(path), memoryview(out), len(TRAILER)) == TRAILER
    assert out.tobytes() == data
    assert cached_pages(path) == math.ceil((len(data) + len(TRAILER)) / mmap.PAGESIZE)


@pytest.mark.parametrize("nbytes, shift", [(2 * 1024 * 1024, 1), (64 * 1024, 0)],
                         ids=["unaligned-destination", "small-file"])
def test_unaligned_or_small_reads_go_through_the_page_cache(disk, nbytes, shift):
    data = payload(nbytes)
    path = disk / "chunk"
    write(path, data)
    evict(path)
    buffer = localio.aligned_empty((nbytes + shift,), np.dtype(np.uint8))
    out = buffer[shift:]
    assert localio.read_into(str(path), memoryview(out), len(TRAILER)) == TRAILER
    assert out.tobytes() == data
    assert cached_pages(path) == math.ceil((nbytes + len(TRAILER)) / mmap.PAGESIZE)


def test_a_device_that_refuses_direct_reads_is_remembered_and_read_buffered(disk, monkeypatch):
    """The kernel's EINVAL (here: for a misaligned buffer; elsewhere, a filesystem without
    O_DIRECT) makes every later read on that filesystem a buffered one."""
    monkeypatch.setattr(localio, "_no_direct_devices", set())
    data = payload(2 * localio.DIRECT_MIN_BYTES)
    path = disk / "chunk"
    write(path, data)
    evict(path)
    misaligned = localio.aligned_empty((len(data) + 1,), np.dtype(np.uint8))[1:]
    fd = os.open(path, os.O_RDONLY)
    try:
        assert localio._read_direct(fd, memoryview(misaligned), os.stat(path)) == 0
    finally:
        os.close(fd)
    assert localio._no_direct_devices == {os.stat(path).st_dev}
    out = localio.aligned_empty((len(data),), np.dtype(np.uint8))
    assert localio.read_into(str(path), memoryview(out), len(TRAILER)) == TRAILER
    assert out.tobytes() == data
    assert cached_pages(path) == math.ceil((len(data) + len(TRAILER)) / mmap.PAGESIZE)


@pytest.mark.parametrize("extra", [-1, 1])
def test_a_file_of_the_wrong_size_is_refused_before_any_read(disk, extra):
    data = payload(localio.DIRECT_MIN_BYTES)
    path = disk / "chunk"
    write(path, data)
    evict(path)
    out = localio.aligned_empty((len(data) + extra,), np.dtype(np.uint8))
    expected = len(data) + extra + len(TRAILER)
    with pytest.raises(ValueError, match=f"{len(data) + len(TRAILER)} bytes where {expected}"):
        localio.read_into(str(path), memoryview(out), len(TRAILER))


@pytest.mark.parametrize("shape, dtype", [((3, 1 << 20), "<f4"), ((1000,), "<i8"), ((0,), "<f8"),
                                          ((5, 7, 1 << 16), "<c16")])
def test_aligned_empty_gives_writable_arrays_aligned_when_large(shape, dtype):
    arr = localio.aligned_empty(shape, np.dtype(dtype))
    assert arr.shape == shape and arr.dtype == np.dtype(dtype)
    assert arr.flags.c_contiguous and arr.flags.writeable
    if arr.nbytes >= localio.DIRECT_MIN_BYTES:
        assert arr.ctypes.data % localio.DIRECT_ALIGN == 0
    arr[...] = 1
    assert arr.sum() == arr.size


@pytest.mark.parametrize("shape, itemsize", [
    ((50257, 768), 4), ((6144, 1024), 4), ((1 << 28,), 4), ((100_000, 3), 1), ((40, 3 << 20), 1),
    ((9_999_991,), 2), ((10, 10), 8), ((3_000_000, 7), 1), ((3, 6 << 20), 1), ((6001, 768), 4),
])
def test_chunks_are_even_whole_disk_blocks_of_at_most_16_mib(shape, itemsize):
    rows = chunk_rows(shape, itemsize)
    n, row_bytes = shape[0], itemsize * math.prod(shape[1:])
    step = localio.DIRECT_ALIGN // math.gcd(row_bytes, localio.DIRECT_ALIGN)
    assert 1 <= rows <= n
    assert rows * row_bytes <= max(CHUNK_BYTES, row_bytes)
    if rows < n and CHUNK_BYTES // row_bytes >= step:
        assert rows * row_bytes % localio.DIRECT_ALIGN == 0
    padding = (math.ceil(n / rows) * rows - n) * row_bytes  # the last chunk is stored whole
    assert padding <= max(n * row_bytes // 100, 64 * 1024)


def test_a_checkpoint_read_directly_is_bit_exact_and_damage_is_caught(disk):
    """Through the store: a cold load takes the direct path, and its checksums still catch a
    flipped byte in the middle of a chunk."""
    rng = np.random.default_rng(7)
    blobs = {"emb": rng.random((6000, 768), dtype=np.float32),  # 2 chunks of 3000 rows
             "bias": rng.random(300, dtype=np.float32)}
    prefix = str(disk / "ckpt")
    record = CheckpointStore(Location(prefix)).save_node(
        "trainer_0", 1, blobs, SaveInfo(save_id=new_save_id(1), nodes=["trainer_0"]))
    group = os.path.join(prefix, "trainer_0.1")
    files = [os.path.join(d, f) for d, _, names in os.walk(group) for f in names]
    chunks = sorted(f for f in files if os.path.basename(f).startswith("c.")
                    and os.path.getsize(f) >= localio.DIRECT_MIN_BYTES)
    assert len(chunks) == 2  # emb: 2 x 9.2 MB, both read directly
    evict(*files)
    loaded = CheckpointStore(Location(prefix)).load_node(record)
    assert all(loaded[k].tobytes() == v.tobytes() and loaded[k].dtype == v.dtype
               for k, v in blobs.items())
    assert all(cached_pages(c) <= 1 for c in chunks)  # read directly, not through the cache
    with open(chunks[0], "r+b") as f:
        f.seek(CHUNK_BYTES // 2)
        byte = f.read(1)
        f.seek(CHUNK_BYTES // 2)
        f.write(bytes([byte[0] ^ 0x10]))
        os.fsync(f.fileno())
    evict(*files)
    with pytest.raises(CheckpointCorruptedError, match="checksum mismatch") as info:
        CheckpointStore(Location(prefix)).load_node(record)
    assert (info.value.node, info.value.epoch, info.value.blob) == ("trainer_0", 1, "emb")
