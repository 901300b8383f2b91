"""How a read's chunk reads run on the I/O threads: a bounded number at a time, stopping at
the first failure (:func:`run_reads`, :class:`Bounded`); and in two rounds into the same arrays,
the second started early where no row can be written out of order (:class:`Rounds`).

A differential restore (:mod:`caffe2ckpt.store.read.chain`) writes each row of a blob first from
the newest span or whole copy holding it (the first round), then, if an overlay newer than that
span holds the row, from that overlay (the second round). A row is written by one read of each
round at most. Starting the second round only once the first is done left the disk half idle
while the first round's last, large chunks were read. :class:`Rounds` starts a second-round read
as soon as every first-round read writing a row it may write is done: each row still gets the
first round's value before the second's, and the second round's reads, whose rows are
disjoint, run in any order.
"""

from __future__ import annotations

import bisect
import threading
from collections import deque
from collections.abc import Callable, Hashable, Iterable
from concurrent.futures import FIRST_EXCEPTION, Future, wait
from typing import Any, Self

from caffe2ckpt.fs.iopool import io_threads
from caffe2ckpt.fs.iopool import pool as _pool

__all__ = ["Bounded", "Rounds", "run_reads"]

Call = Callable[[], Any]

# Reads submitted and not done at once (run_reads): at least this many, and 4 per I/O thread.
# The main thread refills the window only when it gets the GIL (behind busy I/O threads, up to
# the 5 ms switch interval), so a window of 32 starved the threads on warm restores of many
# small files (W2 took 1.5-2x as long); 256 is as fast as submitting everything at once was.
_WINDOW = 256


def run_reads(calls: Iterable[Call]) -> None:
    """Run ``calls`` (reads, of any number of groups) on the I/O threads in order, at most
    :data:`_WINDOW` (or 4 per thread) submitted and not yet done. At the first failure nothing
    more is submitted, the calls not started are cancelled and the failure (the earliest
    submitted, if several) is raised; calls already running finish on their own. So a manifest
    claiming a million chunks costs what the first few of them show, not a future per claimed
    chunk."""
    runner = Bounded()
    for index, call in enumerate(calls):
        if not runner.submit(index, call):
            break
    runner.finish()


class Bounded:
    """Calls on the I/O threads, at most :data:`_WINDOW` (or 4 per thread) submitted and not done
    (:func:`run_reads`): a semaphore slot per call, released by the call's done-callback,
    which also notes its failure (O(1) per call, unlike a ``wait()`` on the window per call).
    Calls are submitted from one thread."""

    def __init__(self) -> None:
        self.slots = threading.Semaphore(max(_WINDOW, 4 * io_threads()))
        self.lock = threading.Lock()
        self.pending: dict[Future[Any], int] = {}  # submitted, not done: submission order
        self.failures: list[tuple[int, BaseException]] = []
        self.closed = False  # abandoned: nothing more is submitted

    def submit(self, index: int, call: Callable[[], Any], block: bool = True) -> bool:
        """Submit ``call`` once a slot is free (or, without ``block``, only if one is free now);
        False when nothing was submitted: no free slot, or after a failure."""
        if not self.slots.acquire(blocking=block):
            return False
        if self.failures or self.closed:
            self.slots.release()
            return False
        future = _pool().submit(call)
        with self.lock:
            self.pending[future] = index
        future.add_done_callback(self._done)  # at once if it is done already
        return True

    def _done(self, future: Future[Any]) -> None:
        with self.lock:
            index = self.pending.pop(future)
            if not future.cancelled() and future.exception() is not None:
                self.failures.append((index, future.exception()))  # type: ignore[arg-type]
        self.slots.release()

    def finish(self) -> None:
        """Wait for every call, or until one failed; raise the earliest failure, if any."""
        with self.lock:
            pending = dict(self.pending)
        done = set() if self.failures else wait(pending, return_when=FIRST_EXCEPTION).done
        # a failure's callback may not have run yet when wait() returns: look at them too
        failures = [*self.failures, *((pending[f], f.exception()) for f in done
                                      if not f.cancelled() and f.exception() is not None)]
        if failures:
            with self.lock:
                queued = list(self.pending)
            for future in queued:
                future.cancel()  # its callback takes the lock: not held here
            raise min(failures, key=lambda failure: failure[0])[1]

    def abandon(self) -> BaseException | None:
        """Submit nothing more: cancel the calls not started and wait for the running ones:
        afterwards no call writes anywhere. Returns the earliest call's failure, if any."""
        self.closed = True
        with self.lock:
            pending = list(self.pending)
        for future in pending:
            future.cancel()
        wait(pending)
        return min(self.failures, key=lambda failure: failure[0])[1] if self.failures else None


class Rounds:
    """Runs reads on the I/O threads in two rounds (a bounded number submitted at a time):
    :meth:`first` takes the first round and submits what the window holds; :meth:`then` names
    the second; :meth:`finish` submits the rest of the first round, and each second-round read
    once the first-round reads it waits for are done, waits for all, and raises the earliest
    failure. Rows are named by a key (the array written) and ``[start, stop)`` rows. Called
    from one thread, in that order. Used as a context manager: if the body raises, nothing more
    is started and the reads running are waited for (none keeps writing into the arrays); a
    read's failure is added to the body's error as a note."""

    def __init__(self) -> None:
        self._runner = Bounded()
        self._cond = threading.Condition()
        self._count = 0  # reads taken so far (their indices)
        self._pieces: dict[Hashable, list[tuple[int, int, int]]] = {}  # key -> (start, stop, read)
        self._queued: deque[tuple[int, Call]] = deque()  # first-round reads not submitted yet
        self._named = False  # the second round is named: the first is complete
        self._left: set[int] = set()  # first-round reads not done
        self._waiting: dict[int, list[int]] = {}  # first-round read -> second-round reads
        self._needs: dict[int, int] = {}  # second-round read -> first-round reads it waits for
        self._calls: dict[int, Call] = {}  # second-round reads not submitted yet
        self._ready: list[int] = []  # ... of which these wait for nothing more
        self._failed = False

    def __enter__(self) -> Self:
        return self

    def __exit__(self, kind: object, error: BaseException | None, *_: object) -> None:
        if error is not None:
            failure = self._runner.abandon()
            if failure is not None and failure is not error:
                error.add_note(f"meanwhile a read failed too: {failure!r}")

    def first(self, reads: Iterable[tuple[Call, Hashable, list[tuple[int, int]]]]) -> None:
        """Take the first round: each read with the rows it writes (its key, its pieces); all
        of it, so :meth:`then` knows every writer. Reads are submitted as they are taken, as
        long as the window has room (the rest by :meth:`finish`)."""
        if self._named:
            raise RuntimeError("the first round must be complete before the second is named")
        for call, key, pieces in reads:
            index = self._next()
            self._pieces.setdefault(key, []).extend((a, b, index) for a, b in pieces)
            with self._cond:
                self._left.add(index)
            self._queued.append((index, self._tracked(call, index)))
            self._submit_queued(block=False)

    def then(self, reads: Iterable[tuple[Call, Hashable, tuple[int, int] | None]]) -> None:
        """Name the second round: each read with the rows it may write (its key and the
        ``[start, stop)`` holding them; None: none). After a failure, nothing more is taken."""
        self._named = True
        for pieces in self._pieces.values():
            pieces.sort()  # disjoint (a row is written by one read at most): by start
        for call, key, rows in reads:
            if self._failed:
                return
            index = self._next()
            with self._cond:
                waits = [] if rows is None else self._writers(key, rows)
                self._calls[index] = call
                if waits:
                    self._needs[index] = len(waits)
                    for writer in waits:
                        self._waiting.setdefault(writer, []).append(index)
                else:
                    self._ready.append(index)

    def finish(self) -> None:
        """Submit the rest of the first round, then the second round as its reads become free
        to start; wait for every read, and raise the earliest failure."""
        self._submit_queued(block=True)
        while not self._failed:
            with self._cond:
                self._cond.wait_for(lambda: self._ready or not self._calls or self._failed)
                ready, self._ready = self._ready, []
                calls = [(index, self._calls.pop(index)) for index in ready]
                last = not self._calls
            for index, call in calls:
                if self._failed or not self._runner.submit(index, self._tracked(call, index)):
                    break
            if last:
                break
        self._runner.finish()

    def _submit_queued(self, block: bool) -> None:
        """Submit the first-round reads not submitted yet (without ``block``, while there is
        room in the window)."""
        while self._queued and not self._failed:
            index, call = self._queued[0]
            if not self._runner.submit(index, call, block=block):
                return
            self._queued.popleft()

    def _next(self) -> int:
        self._count += 1
        return self._count - 1

    def _writers(self, key: Hashable, rows: tuple[int, int]) -> list[int]:
        """The first-round reads not done that write a row of ``rows`` of ``key``."""
        pieces = self._pieces.get(key, [])
        found = set()
        for at in range(max(0, bisect.bisect_right(pieces, (rows[0], rows[0], -1)) - 1),
                        len(pieces)):
            start, stop, index = pieces[at]
            if start >= rows[1]:
                break
            if stop > rows[0] and index in self._left:
                found.add(index)
        return sorted(found)

    def _tracked(self, call: Call, index: int) -> Call:
        """``call``, then: it is done (a first-round read frees the reads waiting for it)."""
        def run() -> None:
            try:
                call()
            except BaseException:
                with self._cond:
                    self._failed = True
                    self._cond.notify()
                raise
            with self._cond:
                self._left.discard(index)
                freed = [w for w in self._waiting.pop(index, ()) if self._freed(w)]
                if freed:
                    self._ready += freed
                    self._cond.notify()
        return run

    def _freed(self, waiting: int) -> bool:
        """One writer less for second-round read ``waiting``: whether that was its last."""
        self._needs[waiting] -= 1
        if self._needs[waiting]:
            return False
        del self._needs[waiting]
        return True
