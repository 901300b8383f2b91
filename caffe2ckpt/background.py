"""Background saves: snapshot a node's blobs, then write and commit them in another thread.

At most one epoch's saves are in flight. A snapshot copies every blob into buffers that are
reused from one epoch to the next (a memcpy, no new allocations once shapes settle), so the
next epoch may change the workspace freely while the previous one is written. Errors are kept
and raised by :meth:`BackgroundSaves.wait` — at the next save, at the end of ``train`` or when
the caller waits — never dropped.

Imports: errors only (it runs whatever save function it is given).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from caffe2ckpt.errors import CheckpointWriteError

__all__ = ["BackgroundSaves"]


class BackgroundSaves:
    """One epoch's node saves running in background threads, and the buffers they write from."""

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self._epoch: int | None = None
        self._futures: dict[str, Future[Any]] = {}
        self._buffers: dict[str, dict[str, np.ndarray]] = {}

    @property
    def pending_epoch(self) -> int | None:
        """The epoch being written in the background, if any."""
        return self._epoch

    def snapshot(self, node: str, blobs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Copies of ``blobs`` in this node's reusable buffers (same dtype, shape and order)."""
        with self._lock:
            buffers = self._buffers.setdefault(node, {})
        for stale in set(buffers) - set(blobs):
            del buffers[stale]
        copies = {}
        for name, arr in blobs.items():
            buf = buffers.get(name)
            if (buf is None or buf.shape != arr.shape or buf.dtype != arr.dtype
                    or buf.flags.f_contiguous != arr.flags.f_contiguous):
                buf = buffers[name] = np.empty_like(arr, order="K")
            np.copyto(buf, arr)
            copies[name] = buf
        return copies

    def submit(self, epoch: int, node: str, save: Callable[[], Any]) -> None:
        """Run ``save`` for ``node`` of ``epoch`` in the background."""
        with self._lock:
            if self._epoch is not None and self._epoch != epoch:
                raise CheckpointWriteError(
                    f"the save of epoch {self._epoch} is still in flight; wait for it before "
                    f"saving epoch {epoch}")
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="caffe2ckpt-save")
            self._epoch = epoch
            self._futures[node] = self._pool.submit(save)

    def done(self) -> bool:
        """Whether every save in flight has finished (successfully or not)."""
        with self._lock:
            return all(f.done() for f in self._futures.values())

    def wait(self) -> tuple[int | None, dict[str, Any]]:
        """Wait for the saves in flight; return (their epoch, {node: result}).

        Raises:
            CheckpointWriteError: a node's save failed (``.epoch`` says which epoch); the other
                nodes' saves were still waited for.
        """
        with self._lock:
            epoch, futures = self._epoch, dict(self._futures)
        results, errors = {}, []
        for node, future in futures.items():
            try:
                results[node] = future.result()
            except Exception as exc:  # noqa: BLE001 - reported below, with its epoch
                errors.append((node, exc))
        with self._lock:
            self._epoch, self._futures = None, {}
        if errors:
            node, exc = errors[0]
            error = CheckpointWriteError(
                f"background save of epoch {epoch} failed on node {node!r}: {exc}")
            error.epoch = epoch
            raise error from exc
        return epoch, results

    def close(self) -> None:
        """Wait for the saves in flight (ignoring their outcome) and stop the threads."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
