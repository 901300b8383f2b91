"""HookFS: tests/faultfs.py's FaultyFileSystem plus *triggers* that pause or fail chosen
operations, so a test can force an interleaving (run A stops just before it deletes, run B
commits, A goes on) or a fault at one exact step, without touching caffe2ckpt's internals.

Every operation FaultyFileSystem counts (``write``, ``delete``, ``list``, ``stat``, ``read``,
see its docstring) is offered, after counting and before it reaches the inner filesystem, to
each active :class:`Trigger`; a trigger whose predicate accepts ``(kind, method, path)``
counts the match and, on the ``nth`` one (or on every one from then on if ``every``), acts:

- ``"pause"``: sets :attr:`Trigger.reached` and blocks the calling thread until
  :meth:`Trigger.release` (or ``timeout`` seconds; then :attr:`Trigger.timed_out` is set, so a
  test never hangs);
- ``"fail"``: raises ``OSError(EIO)`` (the op does not happen);
- a callable: called with ``(kind, method, path)`` (e.g. to send a signal).

The same filesystem can be reached by URL: :func:`register` gives it a name and returns
``c2hook://<name>``, an fsspec URL any code opening URLs (the ``caffe2ckpt`` CLI,
``Location(url)``) resolves to a wrapper around it, so ``caffe2ckpt gc`` can be paused too.

:class:`KillOnceFS` is a picklable wrapper of the local filesystem for Dask workers: the first
process that creates a file whose path contains a chosen fragment while a marker file exists
removes the marker and SIGKILLs itself (a worker dying in the middle of a save).
"""

from __future__ import annotations

import errno
import os
import signal
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import fsspec
from fsspec.implementations.local import LocalFileSystem

from tests.faultfs import FaultyFileSystem

__all__ = ["HookFS", "KillOnceFS", "Trigger", "creates", "reached_or_done", "register",
           "wrapped"]

Predicate = Callable[[str, str, str], bool]


def creates(method: str) -> bool:
    """Whether ``method`` (as FaultyFileSystem logs it) creates a file: ``pipe_file`` or an
    ``open`` in a write, append or exclusive mode (not ``mkdir``/``makedirs``/``cp_file``)."""
    return method == "pipe_file" or (method.startswith("open(") and method != "open(rb)"
                                     and any(c in method for c in "wax"))


@dataclass
class Trigger:
    """Acts on the ``nth`` operation ``match`` accepts (see the module docstring)."""

    match: Predicate
    action: str | Callable[[str, str, str], None]
    nth: int = 1
    every: bool = False  # act on every match from the nth on
    timeout: float = 30.0
    active: bool = True
    matched: int = 0
    hits: list[tuple[str, str, str]] = field(default_factory=list)  # the ops it acted on
    reached: threading.Event = field(default_factory=threading.Event)
    released: threading.Event = field(default_factory=threading.Event)
    timed_out: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def offer(self, kind: str, method: str, path: str) -> None:
        with self._lock:
            if not self.active or not self.match(kind, method, path):
                return
            self.matched += 1
            if self.matched < self.nth or (self.matched > self.nth and not self.every):
                return
            self.hits.append((kind, method, path))
        if self.action == "pause":
            self.reached.set()
            if not self.released.wait(self.timeout):
                self.timed_out = True
        elif self.action == "fail":
            self.reached.set()
            raise OSError(errno.EIO, f"{os.strerror(errno.EIO)} (injected by a trigger into "
                          f"{method})", path)
        else:
            self.reached.set()
            self.action(kind, method, path)

    def release(self) -> None:
        self.released.set()

    def wait(self, timeout: float = 30.0) -> bool:
        return self.reached.wait(timeout)


class HookFS(FaultyFileSystem):
    """FaultyFileSystem with :class:`Trigger`s (see the module docstring)."""

    def __init__(self, inner, **kwargs):
        super().__init__(inner, **kwargs)
        self.triggers: list[Trigger] = []

    def on(self, match: Predicate, action, **kwargs) -> Trigger:
        trigger = Trigger(match, action, **kwargs)
        self.triggers.append(trigger)
        return trigger

    def release_all(self) -> None:
        for trigger in self.triggers:
            trigger.active = False
            trigger.release()

    def _count(self, kind, method, path, torn_data=None):
        super()._count(kind, method, path, torn_data)
        for trigger in list(self.triggers):
            trigger.offer(kind, method, str(path))


# -- reaching a HookFS by URL (for the CLI) -------------------------------------------------------

_REGISTRY: dict[str, tuple[HookFS, str]] = {}


class _ByName(FaultyFileSystem):
    """What ``c2hook://<name>`` resolves to: a pass-through wrapper of the registered HookFS
    (whose triggers therefore see every operation), rooted at the registered path."""

    protocol = "c2hook"
    cachable = False

    def __init__(self, name: str, **kwargs):
        super().__init__(_REGISTRY[name][0], **kwargs)

    @classmethod
    def _get_kwargs_from_urls(cls, path):
        return {"name": _name(path)}

    @classmethod
    def _strip_protocol(cls, path):
        if isinstance(path, str) and path.startswith("c2hook://"):
            return _REGISTRY[_name(path)][1]
        return path


def _name(url: str) -> str:
    return url.removeprefix("c2hook://").split("/", 1)[0]


def register(fs: HookFS, root: str) -> str:
    """A URL (``c2hook://<name>``) that opens ``fs`` at path ``root`` through fsspec."""
    fsspec.register_implementation("c2hook", _ByName, clobber=True)
    name = f"h{uuid.uuid4().hex[:12]}"
    _REGISTRY[name] = (fs, root)
    return f"c2hook://{name}"


def wrapped(prefix: str) -> tuple[HookFS, str]:
    """A HookFS over the filesystem of checkpoint URL ``prefix`` and the prefix's path on it
    (what the managers take as ``(root, filesystem=fs)``)."""
    inner, root = fsspec.core.url_to_fs(prefix)
    if isinstance(inner, LocalFileSystem):
        inner = LocalFileSystem(auto_mkdir=True)
    return HookFS(inner), root


def reached_or_done(trigger: Trigger, thread: threading.Thread, timeout: float = 60.0) -> bool:
    """Wait until ``trigger`` acted (True) or ``thread`` ended without it (False)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if trigger.reached.wait(0.02):
            return True
        if not thread.is_alive():
            return trigger.reached.is_set()
    raise AssertionError(f"neither the trigger acted nor the thread ended in {timeout} s")


# -- killing a Dask worker in the middle of a save -----------------------------------------------


class KillOnceFS(FaultyFileSystem):
    """The local filesystem; the first file creation whose path contains ``fragment`` while
    ``marker`` exists removes ``marker`` and SIGKILLs the process doing it. Picklable (fsspec
    rebuilds it from its arguments), so it travels to Dask workers inside a manager's store."""

    protocol = "c2killonce"
    cachable = False

    def __init__(self, marker: str, fragment: str, **kwargs):
        super().__init__(LocalFileSystem(auto_mkdir=True), **kwargs)
        self.marker, self.fragment = marker, fragment

    def _count(self, kind, method, path, torn_data=None):
        super()._count(kind, method, path, torn_data)
        if kind == "write" and creates(method) and self.fragment in str(path):
            try:
                os.unlink(self.marker)
            except FileNotFoundError:
                return
            with open(f"{self.marker}.killed", "w") as f:  # when, for the test's time bound
                f.write(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
