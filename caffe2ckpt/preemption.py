"""Preemption: turn SIGTERM into a flag the epoch loop reads between epochs.

The signal handler only records the signal. The runner (or a training loop using
:class:`~caffe2ckpt.steps.StepCheckpointManager`) checks :attr:`PreemptionWatch.requested`
after each epoch, saves and commits that epoch, and stops. Handlers are installed only in the
main thread (Python allows no other) and the previous handlers come back on exit.

Imports: nothing from caffe2ckpt.
"""

from __future__ import annotations

import logging
import signal
import threading
from types import FrameType
from typing import Any

__all__ = ["PreemptionWatch"]

logger = logging.getLogger(__name__)


class PreemptionWatch:
    """Context manager: while active, ``signals`` (default SIGTERM) set :attr:`requested`."""

    def __init__(self, signals: tuple[int, ...] = (signal.SIGTERM,)) -> None:
        self.signals = signals
        self.received: int | None = None
        self._previous: dict[int, Any] = {}

    @property
    def requested(self) -> bool:
        return self.received is not None

    @property
    def signal_name(self) -> str:
        return signal.Signals(self.received).name if self.received is not None else ""

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.received = signum  # nothing else: the loop acts on it between epochs

    def __enter__(self) -> PreemptionWatch:
        if threading.current_thread() is not threading.main_thread():
            logger.debug("not in the main thread: preemption signals are not watched")
            return self
        for signum in self.signals:
            self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for signum, previous in self._previous.items():
            if previous is not None:  # None: installed outside Python, cannot be restored
                signal.signal(signum, previous)
        self._previous = {}
