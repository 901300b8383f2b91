"""The multilinear row digests of :mod:`caffe2ckpt.store.rowhash` compiled with numba, when the
``fast`` extra (``pip install 'caffe2ckpt[fast]'``) is installed: one pass over each block's
words instead of numpy's three (widen, multiply-add per key row, combine), about 4x faster on a
256 MiB table (docs/performance.md). Same function, same bits: tests/store/test_rowhash.py checks
both kernels against the formula.

Importing this module imports numba; :mod:`rowhash` does so lazily, at the first digest, and
falls back to numpy when it cannot, or when :func:`warm_up` fails. Compiled code is cached on
disk (numba's ``cache=True``: beside this file, or in numba's per-user cache directory when that
is read-only), so each kind of array (word width, read-only or not) is compiled once per
installation, not once per run.
"""

from __future__ import annotations

import numba
import numpy as np

__all__ = ["multilinear", "warm_up"]


@numba.njit(nogil=True, cache=True)
def multilinear(words: np.ndarray, keys: np.ndarray, offsets: np.ndarray,
                out: np.ndarray) -> None:
    """``out[i]``: the two halves' top 32 bits of ``offsets[h] + sum(keys[h] * words[i])``
    modulo 2**64 (uint64 arithmetic wraps), for each row ``i`` of ``words``. Releases the GIL."""
    high = np.uint64(32)
    for i in range(words.shape[0]):
        first, second = offsets[0], offsets[1]
        for j in range(words.shape[1]):
            word = np.uint64(words[i, j])
            first += keys[0, j] * word
            second += keys[1, j] * word
        out[i] = ((first >> high) << high) | (second >> high)


def warm_up() -> None:
    """Compile (or load from the cache) :func:`multilinear` for each word width the digests use,
    so that a failure to compile shows here, at the choice of kernel, not in a save."""
    keys, offsets, out = np.zeros((2, 1), np.uint64), np.zeros(2, np.uint64), np.empty(1, np.uint64)
    for dtype in (np.uint32, np.uint16, np.uint8):
        multilinear(np.zeros((1, 1), dtype), keys, offsets, out)
