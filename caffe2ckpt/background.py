"""Background saves: snapshot a node's blobs, then write and commit them in another thread.

At most one epoch's saves are in flight. A snapshot copies every blob into buffers that are
reused from one epoch to the next (a memcpy, no new allocations once shapes settle), so the
next epoch may change the workspace freely while the previous one is written. A node's buffers
belong to one save until its write has finished and been waited for: a second snapshot of that
node before then is refused, before any buffer is touched. Errors are kept and raised by
:meth:`BackgroundSaves.wait` (or :meth:`BackgroundSaves.close`) — at the next save, at the end
of ``train`` or when the caller waits — never dropped.

Each save runs in a thread of its own that ends with it: nothing idles (or leaks) between
epochs, whether or not the owner is closed.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, Self

import numpy as np

from caffe2ckpt.errors import CheckpointError, CheckpointWriteError

__all__ = ["BackgroundSaves", "ClosedOnExit"]

logger = logging.getLogger(__name__)


class ClosedOnExit:
    """Context manager for an owner of background saves: :meth:`close` on exit. A save's
    failure raised by ``close`` while another error propagates is logged, not raised over it."""

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: Any, *exc: object) -> None:
        try:
            self.close()
        except CheckpointError:
            if exc_type is None:
                raise
            logger.exception("a background save failed while another error was propagating")


class BackgroundSaves:
    """One epoch's node saves running in background threads, and the buffers they write from."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._epoch: int | None = None
        self._futures: dict[str, Future[Any]] = {}
        self._buffers: dict[str, dict[str, np.ndarray]] = {}

    @property
    def pending_epoch(self) -> int | None:
        """The epoch being written in the background, if any."""
        return self._epoch

    def submit(self, epoch: int, node: str, blobs: dict[str, np.ndarray],
               save: Callable[[dict[str, np.ndarray]], Any]) -> None:
        """Copy ``blobs`` into ``node``'s reusable buffers, then run ``save(copies)`` for
        ``node`` of ``epoch`` in the background. Returns once the copies are taken.

        Raises:
            CheckpointWriteError: a save of another epoch, or of this node, has not been waited
                for yet (its buffers may still be read); nothing was copied.
        """
        future: Future[Any] = Future()
        with self._lock:  # reserve the node's buffers for this save before touching them
            if self._epoch is not None and self._epoch != epoch:
                raise CheckpointWriteError(
                    f"the save of epoch {self._epoch} is still in flight; wait for it before "
                    f"saving epoch {epoch} (node {node!r})")
            if node in self._futures:
                raise CheckpointWriteError(
                    f"node {node!r}'s save of epoch {epoch} is already in flight; wait for it "
                    "before saving that node again")
            self._epoch = epoch
            self._futures[node] = future
            buffers = self._buffers.setdefault(node, {})

        def run(copies: dict[str, np.ndarray]) -> None:
            future.set_running_or_notify_cancel()
            try:
                future.set_result(save(copies))
            except BaseException as exc:  # noqa: BLE001 - kept for wait(), never dropped
                future.set_exception(exc)

        try:
            copies = _copy_into(buffers, blobs)
            threading.Thread(target=run, args=(copies,),
                             name=f"caffe2ckpt-save-{node}-{epoch}").start()
        except BaseException:
            with self._lock:  # nothing runs: release the reservation
                del self._futures[node]
                if not self._futures:
                    self._epoch = None
            raise

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
            except BaseException as exc:  # noqa: BLE001 - reported below, with its epoch
                errors.append((node, exc))  # (even SystemExit in a save: the slot is freed)
        with self._lock:
            self._epoch, self._futures = None, {}
        if errors:
            node, exc = errors[0]
            raise CheckpointWriteError(
                f"background save of epoch {epoch} failed on node {node!r}: {exc}",
                epoch=epoch) from exc
        return epoch, results

    def close(self) -> None:
        """Wait for the saves in flight and free the buffers.

        Raises:
            CheckpointWriteError: a save that was not waited for yet failed (as :meth:`wait`).
        """
        try:
            self.wait()
        finally:
            self._buffers.clear()


def _copy_into(buffers: dict[str, np.ndarray],
               blobs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Copies of ``blobs`` in ``buffers`` (same dtype, shape and order), reusing what fits."""
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
