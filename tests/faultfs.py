"""FaultyFileSystem: an fsspec filesystem that delegates to a real one, counts operations by kind
and raises OSError on chosen ones (fault injection for the checkpoint protocol tests).

Kinds counted:

- ``write``: ``pipe_file``, ``open`` in a write/append/exclusive mode (counted at open; a failing
  open creates nothing), ``mkdir``, ``makedirs``, ``cp_file``, and ``mv`` when the inner
  filesystem has its own (a local rename: one op). Otherwise ``mv`` is fsspec's generic one run
  on this wrapper, as on an object store: one counted ``cp_file`` per file, then an ``rm``;
- ``delete``: ``rm``, ``rm_file``, ``rmdir``;
- ``list``: ``ls``, ``find``;
- ``stat``: ``info``, ``exists`` (``isdir``/``isfile`` go through ``info``);
- ``read``: ``cat_file``, ``open`` for reading.

zarr's ``FsspecStore`` wraps a synchronous filesystem in fsspec's ``AsyncFileSystemWrapper``, which
turns every public method into ``_<name>`` running in a thread (``_pipe_file``, ``_cat_file``,
``_rm``, ``_find``, ``_ls``, ``_info``, ``_exists``, ``_cat_ranges`` -> ``cat_file``), so chunk and
metadata writes land in :meth:`pipe_file` here. Calls come from several threads: counting is
locked.

A failing op raises ``OSError(errno)`` before touching the inner filesystem, unless the fault is
``torn``: then a failing ``pipe_file`` or write-mode file first stores the first half of its
bytes (a disk that fills up mid-write leaves a truncated file behind).
"""

from __future__ import annotations

import errno as errno_mod
import io
import os
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from fsspec import AbstractFileSystem

__all__ = ["FaultyFileSystem", "InjectedFault"]

_WRITE_MODES = set("wax+")


@dataclass
class InjectedFault:
    kind: str
    n: int  # 1-based index among ops of this kind since arm()
    errno: int
    sticky: bool  # also fail every later op of this kind
    torn: bool  # a failing write leaves the first half of its data behind
    match: Callable[[str, str], bool] | None = None  # only ops it accepts count (and fail)
    matched: int = 0  # ops accepted by ``match`` since arm()


class FaultyFileSystem(AbstractFileSystem):
    """Delegate every operation to ``inner``; fail the armed ones with ``OSError``."""

    protocol = "faulty"
    cachable = False

    def __init__(self, inner: AbstractFileSystem, **kwargs):
        super().__init__(**kwargs)
        self.inner = inner
        # paths are normalised exactly like the inner filesystem does it
        self._strip_protocol = inner._strip_protocol
        self._parent = inner._parent
        self.root_marker = inner.root_marker
        self.sep = inner.sep
        self._lock = threading.Lock()
        self.counts: Counter[str] = Counter()
        self.log: list[tuple[str, str, str]] = []  # (kind, method, path) of every counted op
        self.failed: list[tuple[str, str, str]] = []  # the ops that raised
        self._fault: InjectedFault | None = None
        self._base = 0

    # -- control ---------------------------------------------------------------------------------

    def reset(self) -> None:
        """Forget counts, log and faults."""
        with self._lock:
            self.counts.clear()
            self.log.clear()
            self.failed.clear()
            self._fault = None

    def arm(self, kind: str, n: int, errno: int = errno_mod.EIO, *, sticky: bool = False,
            torn: bool = False, match: Callable[[str, str], bool] | None = None) -> None:
        """Fail the ``n``-th op of ``kind`` from now on (and all later ones if ``sticky``). With
        ``match``, only the ops for which ``match(method, path)`` is true are counted towards
        ``n`` (and fail): e.g. the first exclusive create, whichever thread does it."""
        with self._lock:
            self._fault = InjectedFault(kind, n, errno, sticky, torn, match)
            self._base = self.counts[kind]

    def ops(self, kind: str) -> list[tuple[str, str]]:
        """(method, path) of every op of ``kind`` logged so far."""
        with self._lock:
            return [(m, p) for k, m, p in self.log if k == kind]

    def _count(self, kind: str, method: str, path, torn_data: bytes | None = None) -> None:
        """Count the op; raise its injected fault (after a torn write of ``torn_data``)."""
        path = str(path)
        with self._lock:
            self.counts[kind] += 1
            self.log.append((kind, method, path))
            f = self._fault
            if f is None or f.kind != kind:
                return
            if f.match is not None:
                if not f.match(method, path):
                    return
                f.matched += 1
                index = f.matched
            else:
                index = self.counts[kind] - self._base
            if not (index == f.n or (f.sticky and index > f.n)):
                return
            self.failed.append((kind, method, path))
        if f.torn and torn_data is not None:
            self.inner.pipe_file(path, bytes(torn_data[: len(torn_data) // 2]))
        raise OSError(f.errno, f"{os.strerror(f.errno)} (injected into {method})", path)

    # -- writes ----------------------------------------------------------------------------------

    def pipe_file(self, path, value, mode="overwrite", **kwargs):
        self._count("write", "pipe_file", path, torn_data=value)
        return self.inner.pipe_file(path, value, mode=mode, **kwargs)

    def open(self, path, mode="rb", **kwargs):
        if not _WRITE_MODES & set(mode):
            self._count("read", f"open({mode})", path)
            return self.inner.open(path, mode, **kwargs)
        if self._fault is not None and self._fault.torn:
            return _Deferred(self, path, mode, kwargs)  # counted at close, with the data
        self._count("write", f"open({mode})", path)
        return self.inner.open(path, mode, **kwargs)

    def mkdir(self, path, create_parents=True, **kwargs):
        self._count("write", "mkdir", path)
        return self.inner.mkdir(path, create_parents=create_parents, **kwargs)

    def makedirs(self, path, exist_ok=False):
        self._count("write", "makedirs", path)
        return self.inner.makedirs(path, exist_ok=exist_ok)

    def mv(self, path1, path2, recursive=False, maxdepth=None, **kwargs):
        if type(self.inner).mv is AbstractFileSystem.mv:  # copy + delete, through this wrapper
            return super().mv(path1, path2, recursive=recursive, maxdepth=maxdepth, **kwargs)
        self._count("write", "mv", f"{path1} -> {path2}")
        return self.inner.mv(path1, path2, recursive=recursive, maxdepth=maxdepth, **kwargs)

    def cp_file(self, path1, path2, **kwargs):
        self._count("write", "cp_file", f"{path1} -> {path2}")
        return self.inner.cp_file(path1, path2, **kwargs)

    # -- deletes ---------------------------------------------------------------------------------

    def rm(self, path, recursive=False, maxdepth=None):
        self._count("delete", "rm", path)
        return self.inner.rm(path, recursive=recursive, maxdepth=maxdepth)

    def rm_file(self, path):
        self._count("delete", "rm_file", path)
        return self.inner.rm_file(path)

    def rmdir(self, path):
        self._count("delete", "rmdir", path)
        return self.inner.rmdir(path)

    # -- listings, metadata and reads --------------------------------------------------------------

    def ls(self, path, detail=True, **kwargs):
        self._count("list", "ls", path)
        return self.inner.ls(path, detail=detail, **kwargs)

    def find(self, path, maxdepth=None, withdirs=False, detail=False, **kwargs):
        self._count("list", "find", path)
        return self.inner.find(path, maxdepth=maxdepth, withdirs=withdirs, detail=detail, **kwargs)

    def info(self, path, **kwargs):
        self._count("stat", "info", path)
        return self.inner.info(path, **kwargs)

    def exists(self, path, **kwargs):
        self._count("stat", "exists", path)
        return self.inner.exists(path, **kwargs)

    def cat_file(self, path, start=None, end=None, **kwargs):
        self._count("read", "cat_file", path)
        return self.inner.cat_file(path, start=start, end=end, **kwargs)


class _Deferred(io.BytesIO):
    """A write-mode file for torn faults: buffered, counted and written at close."""

    def __init__(self, fs: FaultyFileSystem, path, mode: str, kwargs: dict):
        super().__init__()
        self._args = (fs, path, mode, kwargs)

    def close(self) -> None:
        if self.closed:
            return
        fs, path, mode, kwargs = self._args
        data = self.getvalue()
        super().close()
        # an exclusive create of a file that exists fails before writing anything (O_EXCL):
        # an injected fault there must not tear the existing file
        taken = "x" in mode and fs.inner.exists(path)
        fs._count("write", f"open({mode})", path, torn_data=None if taken else data)
        with fs.inner.open(path, mode, **kwargs) as f:
            f.write(data)
