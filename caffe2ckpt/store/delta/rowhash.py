"""Keyed digests of an array's rows, 8 bytes per block of rows: how a differential save finds the
rows that changed since the save it builds on without keeping a copy of them.

A blob's rows (along axis 0, in stored form: C order, little-endian) are cut into *blocks* of
:func:`block_rows` rows: one row when a row has at least ``block_bytes`` bytes
(``StepManagerOptions.delta_block_bytes``, default :data:`BLOCK_BYTES`), else as many rows as
make that many bytes, so the digests take at most 8 / ``block_bytes`` of the blob's memory. A
block whose digest differs from the one of the last save changed; every row of it is written.

The digest of a block is two 32-bit halves, each the top half of a *multilinear* hash
``(k0 + k1*w1 + ... + kn*wn) mod 2**64`` of the block's words ``w`` (32-bit where the block's
size allows, else 16- or 8-bit) with its own random 64-bit keys. Each half is a strongly
universal family (Lemire and Kaser, "Strongly universal string hashing is fast", The Computer
Journal 57(11), 2014): for any two different blocks of one length, the chance over the keys that
their halves agree is at most 2**-32, so that both agree is at most **2**-64**. The keys are
drawn from the operating system's randomness when a :class:`RowHasher` is made (one per node and
process), live only in memory and are never stored, so no data can be chosen to collide.
Blocks wider than :data:`MAX_WORDS` words (about 16 KiB) are hashed with seeded XXH3-64 instead
(fast for few wide blocks; a well-tested hash with no proven bound).

The sums are computed by compiled code (:mod:`caffe2ckpt.store.delta.rowjit`, llvmlite) when the
``fast`` extra is installed, else by numpy: the same digests, about 4x faster compiled
(:func:`kernel`).
"""

from __future__ import annotations

import functools
import logging
import secrets
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np
import xxhash

__all__ = ["BLOCK_BYTES", "MAX_WORDS", "RowHasher", "block_rows", "kernel"]

_log = logging.getLogger(__name__)
Kernel = Callable[[np.ndarray, np.ndarray, np.ndarray, np.ndarray], None]

BLOCK_BYTES = 64  # the default: 8 bytes of digest per row of 64 bytes or more (12.5% at most)
MAX_WORDS = 4096  # widest block hashed with the multilinear family (keys: 64 KiB per width)
_BATCH_BYTES = 4 << 20  # blocks hashed at a time: the 64-bit words stay in the CPU's caches
_HIGH = np.uint64(32)


def block_rows(row_bytes: int, block_bytes: int = BLOCK_BYTES) -> int:
    """How many rows of ``row_bytes`` bytes each digest covers."""
    return max(1, -(-block_bytes // max(row_bytes, 1)))


class RowHasher:
    """Per-block digests of arrays (see the module docstring), with keys of its own, over
    blocks of at least ``block_bytes`` bytes."""

    def __init__(self, seed: int | None = None, block_bytes: int = BLOCK_BYTES) -> None:
        self.block_bytes = block_bytes
        self._rng = np.random.default_rng(secrets.randbits(128) if seed is None else seed)
        self._keys: dict[int, np.ndarray] = {}  # words per block -> (2, words) uint64 keys
        self._seed = int(self._rng.integers(0, 2**63))
        self._offsets = self._rng.integers(0, 2**64, 2, np.uint64, endpoint=False)  # k0 each

    def digests(self, stored: np.ndarray,
                run: Callable[[Iterable[Callable[[], Any]]], Any] = lambda calls: [
                    call() for call in calls]) -> np.ndarray:
        """The digest (uint64) of every block of rows of ``stored`` (C-contiguous, at least
        one axis), in order: ``ceil(rows / block_rows)`` of them. ``run(calls)`` runs the
        calls of one batch of blocks each (both kernels release the GIL: give it threads)."""
        out = np.empty(self.count(stored), np.uint64)
        run(self.calls(stored, out, 0, out.size))
        return out

    def block_rows(self, stored: np.ndarray) -> int:
        """How many rows of ``stored`` each of its digests covers."""
        rows = stored.shape[0]
        return block_rows(stored.nbytes // rows if rows else 0, self.block_bytes)

    def count(self, stored: np.ndarray) -> int:
        """How many blocks (digests) ``stored`` has."""
        return -(-stored.shape[0] // self.block_rows(stored))

    def calls(self, stored: np.ndarray, out: np.ndarray, first: int, stop: int,
              changed: list[np.ndarray] | None = None) -> list[Callable[[], None]]:
        """Calls that write the digests of blocks ``[first, stop)`` of ``stored`` into their
        places in ``out`` (:meth:`count` digests), a batch of blocks each. With ``changed``,
        ``out`` holds digests to compare with: each call appends to it the indices (ascending)
        of its blocks whose digest differs, then overwrites them, so no second copy is held."""
        flat = stored.reshape(stored.shape[0], -1).view(np.uint8)
        rows, row_bytes = flat.shape
        per = block_rows(row_bytes, self.block_bytes)
        full = rows // per  # blocks of ``per`` rows; a shorter last one after them
        calls: list[Callable[[], None]] = []
        start, end = first, min(stop, full)
        if start < end:
            calls += self._batches(flat[start * per:end * per].reshape(end - start, per * row_bytes),
                                   out, start, changed)
        if full * per < rows and first <= full < stop:  # the last, shorter block
            calls += self._batches(flat[full * per:].reshape(1, -1), out, full, changed)
        return calls

    def _batches(self, blocks: np.ndarray, out: np.ndarray, at: int,
                 changed: list[np.ndarray] | None) -> Iterator[Callable[[], None]]:
        """Calls that each write the digests of a batch of ``blocks`` (a 2-d uint8 array, one
        block per row) into their places in ``out``, from ``out[at]`` on (comparing them first,
        with ``changed``: :meth:`calls`)."""
        count = blocks.shape[0]
        words = _words(blocks)
        if words.shape[1] > MAX_WORDS:
            yield lambda: _store(out, at, self._wide(blocks), changed)
            return
        keys, multilinear = self._keys_for(words.shape[1]), kernel()[1]
        batch = max(1, _BATCH_BYTES // (8 * words.shape[1]))
        for start in range(0, count, batch):
            part = words[start:start + batch]
            if changed is None:
                yield lambda p=part, s=at + start: multilinear(p, keys, self._offsets,
                                                                out[s:s + p.shape[0]])
            else:
                yield lambda p=part, s=at + start: _store(out, s, _digests(
                    multilinear, p, keys, self._offsets), changed)

    def _wide(self, blocks: np.ndarray) -> np.ndarray:
        return np.fromiter((xxhash.xxh3_64_intdigest(memoryview(np.ascontiguousarray(b)),
                                                     seed=self._seed) for b in blocks),
                           np.uint64, blocks.shape[0])

    def _keys_for(self, words: int) -> np.ndarray:
        keys = self._keys.get(words)
        if keys is None:
            keys = self._keys[words] = self._rng.integers(0, 2**64, (2, words), np.uint64,
                                                          endpoint=False)
        return keys


@functools.cache
def kernel() -> tuple[str, Kernel]:
    """The multilinear kernel this process uses, and its name: ``"compiled"`` when the
    ``fast`` extra (llvmlite) imports and its kernel loads, else ``"numpy"`` (both compute
    :func:`numpy_multilinear`'s sums)."""
    try:
        from caffe2ckpt.store.delta.rowjit import multilinear, warm_up

        warm_up(numpy_multilinear)  # loads (or compiles) the kernel and checks it now: a
        # failure falls back here
    except ModuleNotFoundError as exc:
        if (exc.name or "").partition(".")[0] == "caffe2ckpt":
            raise  # our own module missing is a broken install, not a missing extra
        if exc.name != "llvmlite":
            return _fall_back(exc)  # llvmlite is there, but not all of it
        _log.info("row digests computed with numpy: `pip install 'caffe2ckpt[fast]'` (llvmlite) "
                  "computes them about 4x faster")
        return "numpy", numpy_multilinear
    except Exception as exc:  # noqa: BLE001 (e.g. an llvmlite that cannot compile for this CPU)
        return _fall_back(exc)
    return "compiled", multilinear


def _fall_back(exc: BaseException) -> tuple[str, Kernel]:
    _log.warning("row digests fall back to numpy: llvmlite is installed but the compiled kernel "
                 "failed to import, compile or load (%s: %s)", type(exc).__name__, exc)
    return "numpy", numpy_multilinear


def numpy_multilinear(words: np.ndarray, keys: np.ndarray, offsets: np.ndarray,
                      out: np.ndarray) -> None:
    """``out[i]``: the two halves' top 32 bits of ``offsets[h] + sum(keys[h] * words[i])``
    modulo 2**64, for each row ``i`` of ``words`` (numpy releases the GIL in it)."""
    wide = words.astype(np.uint64)
    # wraps modulo 2**64, as the family needs. einsum's integer loop (keys as 2 rows) beats
    # ``wide @ keys`` (a 256 MiB table's digests 117 ms against 156 ms on the 2 cores of
    # 2026-12-01, numpy 2.4; 48-50 ms on those of 2026-12-06, where numba took 11.5 ms)
    sums = np.einsum("ij,kj->ik", wide, keys)
    sums += offsets
    out[:] = ((sums[:, 0] >> _HIGH) << _HIGH) | (sums[:, 1] >> _HIGH)


def _digests(multilinear: Kernel, words: np.ndarray, keys: np.ndarray, offsets: np.ndarray
             ) -> np.ndarray:
    out = np.empty(words.shape[0], np.uint64)
    multilinear(words, keys, offsets, out)
    return out


def _store(out: np.ndarray, at: int, digests: np.ndarray,
           changed: list[np.ndarray] | None) -> None:
    """Put ``digests`` into ``out`` from ``out[at]`` on, first noting in ``changed`` (if
    given) the indices of those that differ from what is there."""
    place = out[at:at + digests.size]
    if changed is not None:
        differ = np.flatnonzero(place != digests)
        if differ.size:
            changed.append(differ + at)
    place[:] = digests


def _words(blocks: np.ndarray) -> np.ndarray:
    """``blocks`` (2-d uint8) as the widest unsigned words its rows divide into (<= 32-bit)."""
    width = blocks.shape[1]
    for dtype in (np.uint32, np.uint16):
        if width % np.dtype(dtype).itemsize == 0:
            return blocks.view(dtype)
    return blocks
