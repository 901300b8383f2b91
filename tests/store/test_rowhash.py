"""The row digests of differential saves (caffe2ckpt/store/delta/rowhash.py) compute exactly the
multilinear family of the module's docstring, for every word width, batch boundary and block
shape: checked against the formula in Python integers, so a faster kernel cannot change what is
hashed or lose the modular wrap the bound relies on."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest

from caffe2ckpt.store.delta import rowhash
from caffe2ckpt.store.delta.rowhash import BLOCK_BYTES, RowHasher, block_rows

KERNELS = {
    "numpy": lambda: rowhash.numpy_multilinear,
    # the `fast` extra, which the test extra installs: CI checks the compiled kernel too
    "compiled": lambda: pytest.importorskip("caffe2ckpt.store.delta.rowjit").multilinear,
}


def test_the_fast_extra_is_the_kernel_in_use():
    assert rowhash.kernel()[0] == "compiled", "the test extra installs llvmlite (`fast`)"


def _broken_warm_up(reference):
    raise RuntimeError("no code for this processor")


@pytest.mark.parametrize(("modules", "level", "says"), [
    ({"llvmlite": None}, logging.INFO, "pip install 'caffe2ckpt[fast]'"),  # not installed
    ({"llvmlite": types.ModuleType("llvmlite")}, logging.WARNING,  # half installed
     "llvmlite is installed but the compiled kernel failed"),
    ({}, logging.WARNING, "no code for this processor"),  # the kernel does not load
], ids=["missing", "broken", "failing"])
def test_without_a_usable_kernel_the_digests_fall_back_to_numpy_saying_why(
        modules, level, says, monkeypatch, caplog):
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
        monkeypatch.delitem(sys.modules, "llvmlite.binding", raising=False)
        monkeypatch.delitem(sys.modules, "caffe2ckpt.store.delta.rowjit", raising=False)
    if not modules:
        from caffe2ckpt.store.delta import rowjit
        monkeypatch.setattr(rowjit, "warm_up", _broken_warm_up)
    rowhash.kernel.cache_clear()
    try:
        with caplog.at_level(logging.INFO, logger=rowhash.__name__):
            assert rowhash.kernel() == ("numpy", rowhash.numpy_multilinear)
    finally:
        rowhash.kernel.cache_clear()
    assert [r.levelno for r in caplog.records] == [level] and says in caplog.text


_LOAD = ("from caffe2ckpt.store.delta import rowhash, rowjit; import sys; {patch}"
         "print(rowhash.kernel()[0], rowjit._cached_path(rowjit.cache_dir()))")


def _kernel_in_a_process(cache: str, patch: str = "") -> list[str]:
    env = {**os.environ, "CAFFE2CKPT_CACHE_DIR": cache}
    out = subprocess.run([sys.executable, "-c", _LOAD.format(patch=patch)], capture_output=True,
                         text=True, timeout=300, check=True, env=env)
    return out.stdout.split()


def test_the_kernel_is_compiled_once_into_the_cache_and_loaded_from_it(tmp_path):
    """A process finds no compiled kernel: a child compiles it into the cache (mode 0600, in a
    0700 folder); the next process loads it and never compiles (its compiler made to fail)."""
    cache = tmp_path / "cache"
    kind, path = _kernel_in_a_process(str(cache))
    assert kind == "compiled" and path.startswith(str(cache))
    stat = os.stat(path)
    assert stat.st_mode & 0o777 == 0o600 and cache.stat().st_mode & 0o777 == 0o700
    failing = "rowjit._compile = lambda: sys.exit('compiled again'); "
    assert _kernel_in_a_process(str(cache), failing) == [kind, path]
    assert os.stat(path).st_mtime_ns == stat.st_mtime_ns
    assert [p.name for p in cache.iterdir()] == [path.rpartition("/")[2]]  # no leftovers


def test_a_cache_that_cannot_be_written_compiles_in_the_process(tmp_path):
    blocked = tmp_path / "file"
    blocked.write_text("not a folder")
    kind, _ = _kernel_in_a_process(str(blocked / "cache"))
    assert kind == "compiled" and not blocked.is_dir()
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)  # others may write there: nothing found there is run, nothing kept
    assert _kernel_in_a_process(str(shared))[0] == "compiled" and not list(shared.iterdir())


_RACE = """
import sys, threading
import numpy as np
from caffe2ckpt.store.delta import rowhash, rowjit
barrier = threading.Barrier(8)
words = np.arange(20000 * 16, dtype=np.uint32).reshape(20000, 16)
keys = np.arange(32, dtype=np.uint64).reshape(2, 16) * np.uint64(0x9E3779B97F4A7C15)
outs = [np.empty(20000, np.uint64) for _ in range(8)]
def first_use(i):
    barrier.wait()  # every thread's first call at once (as a LocalSession's nodes' saves)
    (rowhash.kernel() if i % 2 else (None, None))
    for _ in range(20):
        rowjit.multilinear(words, keys, np.array([1, 2], np.uint64), outs[i])
threads = [threading.Thread(target=first_use, args=(i,)) for i in range(8)]
[t.start() for t in threads]
[t.join() for t in threads]
want = np.empty(20000, np.uint64)
rowhash.numpy_multilinear(words, keys, np.array([1, 2], np.uint64), want)
print(all(np.array_equal(o, want) for o in outs))
"""


def test_threads_that_first_use_the_kernel_at_once_share_one_load(tmp_path):
    """Eight threads' first calls at once: before, each could load the kernel, and the engines
    the cache let go were freed while their threads ran their code (SIGSEGV every time)."""
    pytest.importorskip("caffe2ckpt.store.delta.rowjit")
    env = {**os.environ, "CAFFE2CKPT_CACHE_DIR": str(tmp_path / "cache")}
    _kernel_in_a_process(env["CAFFE2CKPT_CACHE_DIR"])  # compiled into the cache first
    for _ in range(3):
        done = subprocess.run([sys.executable, "-c", _RACE], capture_output=True, text=True,
                              timeout=300, env=env)
        assert (done.returncode, done.stdout.strip()) == (0, "True"), done.stderr[-2000:]


@pytest.mark.parametrize("content", [b"garbage" * 100, "torn"], ids=["foreign", "torn"])
def test_a_torn_or_foreign_cached_kernel_is_never_loaded(tmp_path, content):
    """A file at the kernel's place whose digest does not check (empty, foreign, cut short:
    loading such a file crashed the process) is compiled anew, and replaced."""
    cache = tmp_path / "cache"
    _, path = _kernel_in_a_process(str(cache))
    kept = Path(path)
    good = kept.read_bytes()
    kept.write_bytes(good[:len(good) // 2] if content == "torn" else content)
    assert _kernel_in_a_process(str(cache)) == ["compiled", path]
    assert kept.read_bytes() == good


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
@pytest.mark.parametrize("kernel", ["numpy", "compiled"])
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
