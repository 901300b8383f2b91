"""The row digests of differential saves (caffe2ckpt/store/rowhash.py) compute exactly the
multilinear family of the module's docstring, for every word width, batch boundary and block
shape: checked against the formula in Python integers, so a faster kernel cannot change what is
hashed or lose the modular wrap the bound relies on."""

from __future__ import annotations

import logging
import subprocess
import sys
import types

import numpy as np
import pytest

from caffe2ckpt.store import rowhash
from caffe2ckpt.store.rowhash import BLOCK_BYTES, RowHasher, block_rows

KERNELS = {
    "numpy": lambda: rowhash.numpy_multilinear,
    # the `fast` extra, which the test extra installs: CI checks the compiled kernel too
    "numba": lambda: pytest.importorskip("caffe2ckpt.store.rowjit").multilinear,
}


def test_the_fast_extra_is_the_kernel_in_use():
    assert rowhash.kernel()[0] == "numba", "the test extra installs numba (the `fast` extra)"


@pytest.mark.parametrize(("numba", "level", "says"), [
    (None, logging.INFO, "pip install 'caffe2ckpt[fast]'"),  # not installed
    (types.ModuleType("numba"), logging.WARNING, "numba is installed but failed"),
], ids=["missing", "broken"])
def test_without_a_usable_numba_the_digests_fall_back_to_numpy_saying_why(
        numba, level, says, monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "numba", numba)
    monkeypatch.delitem(sys.modules, "caffe2ckpt.store.rowjit", raising=False)
    rowhash.kernel.cache_clear()
    try:
        with caplog.at_level(logging.INFO, logger=rowhash.__name__):
            assert rowhash.kernel() == ("numpy", rowhash.numpy_multilinear)
    finally:
        rowhash.kernel.cache_clear()
    assert [r.levelno for r in caplog.records] == [level] and says in caplog.text


def test_a_numba_without_what_it_imports_falls_back_too():
    """numba installed, its llvmlite not importable (in a process of its own: a failed import
    of numba would leave half of it in this one)."""
    code = ("import logging, sys; sys.modules['llvmlite'] = None; logging.basicConfig(); "
            "from caffe2ckpt.store import rowhash; print(rowhash.kernel()[0])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True)
    assert out.stdout.split() == ["numpy"]
    assert "fall back to numpy" in out.stderr and "llvmlite" in out.stderr, out.stderr


def reference(hasher: RowHasher, stored: np.ndarray) -> list[int]:
    """Each block's digest from the formula: per half h, the top 32 bits of
    ``(k0[h] + sum(keys[h][i] * word[i])) mod 2**64`` over the block's widest words."""
    flat = stored.reshape(stored.shape[0], -1).view(np.uint8)
    per = block_rows(flat.shape[1])
    digests = []
    for start in range(0, flat.shape[0], per):
        block = flat[start:start + per].reshape(-1)
        words = rowhash._words(block.reshape(1, -1))[0]
        keys = hasher._keys_for(words.size)
        halves = [(int(hasher._offsets[h]) + sum(int(k) * int(w) for k, w in
                                                  zip(keys[h], words))) % 2**64 >> 32
                  for h in (0, 1)]
        digests.append(halves[0] << 32 | halves[1])
    return digests


@pytest.mark.parametrize(("dtype", "shape"), [
    (np.float32, (37, 64)),  # 256-byte rows: a block per row, 32-bit words
    (np.float32, (101, 3)),  # 12-byte rows: 14 rows a block, a shorter last block
    (np.int16, (50, 5)),  # 10-byte rows: 16-bit words
    (np.uint8, (77, 7)),  # 7-byte rows: bytes
    (np.float64, (9,)),  # 8-byte rows of a vector
], ids=lambda v: getattr(v, "__name__", str(v)))
@pytest.mark.parametrize("kernel", ["numpy", "numba"])
def test_digests_are_the_multilinear_family(dtype, shape, kernel, monkeypatch):
    monkeypatch.setattr(rowhash, "_BATCH_BYTES", 1024)  # several batches, a partial last one
    monkeypatch.setattr(rowhash, "kernel", lambda: (kernel, KERNELS[kernel]()))
    rng = np.random.default_rng(7)
    stored = (rng.random(shape) * 1000).astype(dtype)
    hasher = RowHasher(seed=11)
    got = hasher.digests(stored)
    assert got.dtype == np.uint64
    assert got.tolist() == reference(hasher, stored)
    changed = stored.copy()
    changed.reshape(-1).view(np.uint8)[-1] ^= 1  # one bit of the last row
    after = hasher.digests(changed)
    assert np.flatnonzero(after != got).tolist() == [got.size - 1]


def test_blocks_wider_than_the_multilinear_keys_use_seeded_xxh3():
    rows = np.arange(3 * (rowhash.MAX_WORDS + 1), dtype=np.uint32).reshape(3, -1)
    hasher = RowHasher(seed=3)
    got = hasher.digests(rows)
    again = RowHasher(seed=3).digests(rows)
    assert got.tolist() == again.tolist() and len(set(got.tolist())) == 3
    assert block_rows(rows.shape[1] * 4) == 1 and rows.shape[1] * 4 > BLOCK_BYTES


@pytest.mark.parametrize(("row_bytes", "block_bytes", "per"), [
    (64, 64, 1), (16, 64, 4), (12, 64, 6), (64, 160, 3), (256, 160, 1), (4, 8, 2)])
def test_blocks_cover_the_rows_that_make_block_bytes(row_bytes, block_bytes, per):
    """``delta_block_bytes`` sets the block: one row when a row has that many bytes, else as
    many as make them; a digest per block, a shorter last one."""
    stored = np.zeros((101, row_bytes), np.uint8)
    hasher = RowHasher(seed=1, block_bytes=block_bytes)
    assert hasher.block_rows(stored) == block_rows(row_bytes, block_bytes) == per
    assert hasher.count(stored) == hasher.digests(stored).size == -(-101 // per)
