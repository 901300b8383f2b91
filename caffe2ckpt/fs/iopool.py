"""The threads a process uses for chunk I/O: writing, reading and flushing checkpoint files.

The work is system calls and CRC32C, which release the GIL, so threads overlap it. One process
uses :data:`IO_THREADS`; processes that share a machine (Dask workers holding nodes) split that
budget (:func:`set_io_threads`), since their threads share its cores and disks: on 2 cores and
one disk, two worker processes saving 256 MiB each at once took about 5% longer with 8 threads
each than with 4 (or 2) each, while one process saved as fast with 4 threads as with 8 (measured
with ``benchmarks/bench_dask.py``; see docs/performance.md).
"""

from __future__ import annotations

import functools
from concurrent.futures import ThreadPoolExecutor

__all__ = ["IO_THREADS", "check_io_threads", "io_threads", "pool", "set_io_threads"]

IO_THREADS = 8
_threads = IO_THREADS


def check_io_threads(count: int) -> int:
    """``count`` if it is a thread count (an int >= 1), else ``ValueError`` saying so."""
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ValueError(f"I/O threads must be an int >= 1, got {count!r}")
    return count


def set_io_threads(count: int) -> None:
    """Use ``count`` threads for chunk I/O in this process from now on (saves already running
    finish on the threads they started with)."""
    global _threads
    _threads = check_io_threads(count)


@functools.lru_cache(maxsize=None)
def _pool_of(threads: int) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=threads, thread_name_prefix="caffe2ckpt-io")


def pool() -> ThreadPoolExecutor:
    """This process's chunk I/O threads."""
    return _pool_of(_threads)


def io_threads() -> int:
    """How many threads :func:`pool` has."""
    return _threads
