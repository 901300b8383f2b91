"""Preemption: turn SIGTERM into a flag the epoch loop reads between epochs.

The signal handler only records the signal. The runner (or a training loop using
:class:`~caffe2ckpt.steps.StepCheckpointManager`) checks :attr:`PreemptionWatch.requested`
after each epoch, saves and commits that epoch, and stops. Handlers are installed only in the
main thread (Python allows no other).

One process-wide handler per signal serves every active watch: it is installed when the first
watch starts and the original handler comes back when the last one ends, in whatever order the
watches end — also when a watch is never exited and is garbage-collected. (Each watch saving
and restoring "the previous handler" itself would leave a watch's handler installed for good
when two watches end in creation order.)
"""

from __future__ import annotations

import logging
import signal
import threading
import weakref
from types import FrameType
from typing import Any

__all__ = ["PreemptionWatch"]

logger = logging.getLogger(__name__)

_lock = threading.RLock()  # re-entrant: a finalizer may run while the lock is held
_watches: dict[int, dict[int, weakref.ref[PreemptionWatch]]] = {}  # signal -> {id: watch}
_original: dict[int, Any] = {}  # signal -> the handler installed before the first watch


def _dispatch(signum: int, frame: FrameType | None) -> None:
    watches = [w for ref in list(_watches.get(signum, {}).values()) if (w := ref()) is not None]
    for watch in watches:
        watch.received = signum  # nothing else: the loop acts on it between epochs
    if not watches:  # the last watch ended outside the main thread: act as the original would
        handler = _original.get(signum)
        if callable(handler):
            handler(signum, frame)
        elif handler == signal.SIG_DFL:
            signal.signal(signum, signal.SIG_DFL)
            signal.raise_signal(signum)


def _release(signals: tuple[int, ...], key: int) -> None:
    """Forget watch ``key``; a signal no watch is left for gets its original handler back
    (from the main thread only: elsewhere :func:`_dispatch` stands in for it)."""
    with _lock:
        for signum in signals:
            active = _watches.get(signum, {})
            active.pop(key, None)
            if active or threading.current_thread() is not threading.main_thread():
                continue
            original = _original.pop(signum)
            del _watches[signum]
            # None: installed outside Python, cannot be restored; another handler installed
            # since then is someone else's: leave it
            if original is not None and signal.getsignal(signum) is _dispatch:
                signal.signal(signum, original)


class PreemptionWatch:
    """Context manager: while active, ``signals`` (default SIGTERM) set :attr:`requested`."""

    def __init__(self, signals: tuple[int, ...] = (signal.SIGTERM,)) -> None:
        self.signals = tuple(dict.fromkeys(signals))  # each once: one handler per signal
        self.received: int | None = None
        self._finalizer: weakref.finalize | None = None

    @property
    def requested(self) -> bool:
        return self.received is not None

    @property
    def signal_name(self) -> str:
        return signal.Signals(self.received).name if self.received is not None else ""

    def __enter__(self) -> PreemptionWatch:
        if threading.current_thread() is not threading.main_thread():
            logger.debug("not in the main thread: preemption signals are not watched")
            return self
        if self._finalizer is not None:
            return self  # already watching
        signals = tuple(self.signals)
        with _lock:
            for signum in signals:
                if signum not in _watches:
                    _original[signum] = signal.signal(signum, _dispatch)
                    _watches[signum] = {}
                _watches[signum][id(self)] = weakref.ref(self)
        # a watch that is never exited still gives the handlers back when it is collected
        self._finalizer = weakref.finalize(self, _release, signals, id(self))
        return self

    def __exit__(self, *exc: object) -> None:
        if self._finalizer is not None:
            self._finalizer()  # runs _release once
            self._finalizer = None
