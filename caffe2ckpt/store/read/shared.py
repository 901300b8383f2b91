"""Reads shared by the nodes one process restores: a replicated blob one node of a save wrote
for all, or an old node's whole blob that several new nodes take rows of (an elastic resume),
is read once per process and handed to each of them.

One :class:`SharedReads` lives as long as one restore (a step manager's ``restore`` call, a
job's load group): what it holds is freed with it. Sent to another process (a Dask worker), it
arrives empty: each process reads for itself.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable
from typing import Any

import numpy as np

__all__ = ["SharedReads"]


class SharedReads:
    """Arrays read once by key (see the module docstring); thread-safe: a second asker of a
    key being read waits for the first read."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._keys: dict[Hashable, threading.Lock] = {}
        self._data: dict[Hashable, np.ndarray] = {}
        self._once: set[Hashable] = set()

    def get(self, key: Hashable, read: Callable[[], np.ndarray]) -> np.ndarray:
        """The array of ``key``, read by ``read()`` the first time it is asked for (shared:
        never write into it)."""
        with self._lock:
            lock = self._keys.setdefault(key, threading.Lock())
        with lock:
            if key not in self._data:
                self._data[key] = read()
            return self._data[key]

    def first(self, key: Hashable) -> bool:
        """Whether this is the first time ``key`` is asked (a check done once per process)."""
        with self._lock:
            if key in self._once:
                return False
            self._once.add(key)
            return True

    def __getstate__(self) -> dict[str, Any]:
        return {}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__()  # type: ignore[misc]
