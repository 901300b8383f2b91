"""The packed array is assembled a chunk at a time when it is written (store/format/zarrgroup.py,
``Packed`` in store/format/packing.py): every chunk holds exactly the bytes a whole packed
buffer would, and a packed array of several chunks round-trips and reads with plain zarr."""

from __future__ import annotations

import math

import numpy as np
import pytest
import zarr

from caffe2ckpt import LocalSession, MultiNodeCheckpointManager
from caffe2ckpt.store.format import zarrgroup
from caffe2ckpt.store.format.manifest import CHUNK_BYTES


def whole(infos, arrays, nbytes: int) -> bytes:
    """The packed array's bytes, joined the plain way."""
    out = bytearray(nbytes)
    for info, arr in zip(infos, arrays, strict=True):
        out[info.offset:info.offset + arr.nbytes] = arr.tobytes()
    return bytes(out)


def window_bytes(window) -> bytes:
    """A window of the packed array as bytes: one (bytes, 1) uint8 array, or buffers."""
    if isinstance(window, np.ndarray):
        assert window.dtype == np.uint8 and window.ndim == 2 and window.shape[1] == 1
        return window.tobytes()
    assert all(memoryview(part).format == "B" for part in window)
    return b"".join(bytes(part) for part in window)


@pytest.mark.parametrize("large", [False, True], ids=["joined", "own-buffers"])
@pytest.mark.parametrize("seed", range(5))
def test_every_window_of_the_packed_array_is_the_joined_bytes(seed, large):
    """Small pieces come back joined; pieces of 16 KiB and more on average as the blobs' own
    buffers (written as they are): the bytes are the same either way."""
    rng = np.random.default_rng(seed)
    dtypes = [np.float32, np.int8, np.float64, np.uint16, "<U3", "S5"]
    blobs = {}
    for i in range(int(rng.integers(1, 60))):
        dtype = np.dtype(dtypes[int(rng.integers(len(dtypes)))])
        shape = tuple(int(n) for n in rng.integers(0, 9, size=int(rng.integers(0, 3))))
        if large:
            shape = (int(rng.integers(0, 40_000)),)
        blobs[f"b{i}"] = np.zeros(shape, dtype) if dtype.kind in "US" else \
            rng.integers(0, 100, size=shape).astype(dtype)
    plan = zarrgroup.plan_group(node="n", epoch=1, save_id="g1-x", blobs=blobs,
                                pack_threshold=1 << 20)
    (packed,) = [a for a in plan.arrays if a.path == "_packed"]
    pieces = [np.ascontiguousarray(blobs[info.name]) for info in plan.manifest.packed]
    expected = whole(plan.manifest.packed, pieces, packed.shape[0])
    for _ in range(200):
        start = int(rng.integers(0, packed.shape[0]))
        stop = int(rng.integers(start + 1, packed.shape[0] + 1))
        assert window_bytes(packed.data[slice(start, stop)]) == expected[start:stop], (start, stop)
    whole_window = packed.data[slice(0, packed.shape[0])]
    assert isinstance(whole_window, list) == large


def test_a_packed_array_of_several_chunks_round_trips_and_reads_with_plain_zarr(tmp_path):
    rng = np.random.default_rng(3)
    blobs = {f"p{i:03d}": rng.random(int(rng.integers(1, 15_000)), dtype=np.float32)
             for i in range(700)}  # each under 64 KiB: all packed, ~20 MiB in all
    blobs["odd"] = np.arange(7, dtype=np.int8)  # offsets that need alignment padding after it
    prefix = str(tmp_path / "ckpt")
    session = LocalSession()
    session.workspace("n").update(blobs)
    cm = MultiNodeCheckpointManager(prefix)
    session.run(cm.init(["n"]))
    session.run(cm.save(1))

    group = zarr.open_group(f"{prefix}/n.1", mode="r")
    manifest = group.attrs["caffe2ckpt"]
    packed = group["_packed"]
    assert packed.shape[0] > CHUNK_BYTES and math.ceil(packed.shape[0] / packed.chunks[0]) >= 2
    data = packed[...]
    columns = manifest["packed"]
    for name, dtype, shape, offset in zip(columns["names"], columns["dtypes"], columns["shapes"],
                                          columns["offsets"], strict=True):
        size = np.dtype(dtype).itemsize * math.prod(shape)
        np.testing.assert_array_equal(data[offset:offset + size].view(dtype).reshape(shape),
                                      blobs[name])

    restored = LocalSession()
    rcm = MultiNodeCheckpointManager(prefix)
    restored.run(rcm.init(["n"], retrieve_from_epoch=1))
    restored.run(rcm.load(1))
    for name, arr in blobs.items():
        np.testing.assert_array_equal(restored.workspace("n")[name], arr)
