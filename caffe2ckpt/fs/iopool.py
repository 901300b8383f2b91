"""The threads a process uses for chunk I/O: writing, reading and flushing checkpoint files.

The work is system calls and CRC32C, which release the GIL, so threads overlap it. One process
uses :data:`IO_THREADS`; processes that share a machine (Dask workers holding nodes) split that
budget (:func:`set_io_threads`), since their threads share its cores and disks: on 2 cores and
one disk, two worker processes saving 256 MiB each at once took about 5% longer with 8 threads
each than with 4 (or 2) each, while one process saved as fast with 4 threads as with 8 (measured
with ``benchmarks/bench_dask.py``; see docs/performance.md).

Small reads that wait on nothing else (commit records, group manifests: many at once when a
prefix is scanned or a chain of groups is opened) go to a second pool, :func:`read_pool`, whose
threads are started once per process instead of once per call. A task of either pool must never
wait on a task of the same pool (that could take every thread and wait forever); a read-pool task
may wait on chunk I/O. After a ``fork`` the child starts pools of its own.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import TypeVar

__all__ = ["IO_THREADS", "READ_THREADS", "check_io_threads", "io_threads", "pool", "read_pool",
           "results", "set_io_threads"]

T = TypeVar("T")

IO_THREADS = 8
READ_THREADS = 16
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


@functools.cache
def _pool_of(threads: int) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=threads, thread_name_prefix="caffe2ckpt-io")


def pool() -> ThreadPoolExecutor:
    """This process's chunk I/O threads."""
    return _pool_of(_threads)


@functools.lru_cache(maxsize=1)
def read_pool() -> ThreadPoolExecutor:
    """This process's threads for small independent reads (records, manifests)."""
    return ThreadPoolExecutor(max_workers=READ_THREADS, thread_name_prefix="caffe2ckpt-read")


def _forget_pools() -> None:  # a forked child has none of its parent's threads
    _pool_of.cache_clear()
    read_pool.cache_clear()


os.register_at_fork(after_in_child=_forget_pools)


def io_threads() -> int:
    """How many threads :func:`pool` has."""
    return _threads


def results(futures: Sequence[Future[T]]) -> list[T]:
    """Every future's result, in order, once all have ended (no thread still works for the
    caller when it gets the answer); the first failure, in order, is raised."""
    wait(futures)
    return [future.result() for future in futures]
