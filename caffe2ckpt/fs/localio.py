"""Local-disk file I/O with Linux fast paths, and portable fallbacks where they are missing.

- Durability: :class:`SyncBatch` flushes the files of one save, each on the file descriptor it
  was written through (the rule below); ``sync_file_range()`` starts each file's write-out as
  soon as it is written, so the final flush waits for less.
- Reads: a large file that is not in the page cache is read with ``O_DIRECT``, straight from
  the disk into the destination array. Through the page cache the kernel allocates a page for
  every 4 KiB, fills it and copies it out: reading 238 MiB of cold chunk files took 74-84 ms of
  system time that way against 7-17 ms directly (measured here, destinations already faulted
  in), and that was what capped cold restores. A file that ``cachestat()`` (or ``mincore()``)
  finds mostly cached is still read through the cache, because that is then a plain memory
  copy. Filesystems that refuse ``O_DIRECT`` (tmpfs before Linux 6.6, some FUSE filesystems)
  are remembered and read buffered.

The durability rule (local disks): a save never commits data whose write-back failed.

1. Each file is created, written and handed to a :class:`SyncBatch` by one thread, which starts
   its write-out at once (``sync_file_range(SYNC_FILE_RANGE_WRITE)``, Linux) and keeps the
   file descriptor open.
2. When every file is written, each one is ``fdatasync``'ed on that same descriptor and closed,
   and every directory in which the save created an entry is ``fsync``'ed (each array's
   directory, the group's, the group's parent, and the parent of any directory created on the
   way). The flushes run concurrently on the I/O threads: concurrent flushes share journal
   commits and device cache flushes, and the data is mostly on the disk already (step 1).
   ``fdatasync`` of a new file covers its data and the size and block map needed to read it
   back; its name is made durable by the directory's fsync.
3. Only after all of them succeeded may the commit record be written (the caller's job). Any
   failure fails the save; every descriptor is closed either way.

Why per file and not one ``syncfs()``: the kernel reports a write-back error (errseq, Linux >=
4.13) to every descriptor of the file that was open when the error happened, and since 4.16
once to a later opener if nobody has seen it yet. A descriptor kept open from the write to the
``fdatasync`` therefore always sees the error, whoever else flushes the file. ``syncfs()``
reports no write-back error before Linux 5.8; since then it reports the errors that happen
after its descriptor was opened plus one nobody has seen yet, so an error another process's
``syncfs`` saw first is lost. Nor can a file be closed and reopened for the flush: its error
goes once to whoever looks first, and an inode evicted meanwhile forgets it. Directories are
opened at flush time: their entries are journalled metadata on ext4/XFS/btrfs, where a failed
journal write fails every later flush of the filesystem.

Open descriptors are bounded: at most :data:`MAX_PENDING` (a quarter of ``RLIMIT_NOFILE``, 64 to
1024) wait for their flush in the whole process; a thread that writes one more file flushes
and closes the oldest waiting one first (its write-out started earliest).

Direct reads need the destination address, file offset and length aligned to the device's
logical block; :data:`DIRECT_ALIGN` (4 KiB) covers the devices in use. :func:`aligned_empty`
allocates such destinations. Files must end with a small trailer (a checksum) or an unaligned
tail, which the buffered read after the direct body picks up.

Opening: files are opened only through :func:`open_regular`, which follows no symlink below the
checkpoint prefix and accepts only regular files: a FIFO would block the open (or the read)
forever, and a symlink could lead out of the prefix (its target's content or size must never be
read or reported). The prefix itself may be reached through symlinks: the user chose it.

The system calls the ``os`` module lacks are loaded with ctypes; each is None where the C
library does not have it."""

from __future__ import annotations

import ctypes
import errno
import fcntl
import math
import mmap
import os
import posixpath
import stat
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Executor, Future, wait
from typing import Any

import numpy as np

__all__ = [
    "DIRECT_ALIGN",
    "DIRECT_MIN_BYTES",
    "DIR_FLAGS",
    "MAX_PENDING",
    "RefusedPathError",
    "SyncBatch",
    "aligned_empty",
    "fdatasync",
    "fsync_dir",
    "named",
    "open_dir",
    "open_entry",
    "open_regular",
    "read_into",
    "start_writeback",
]

DIRECT_ALIGN = 4096
DIRECT_MIN_BYTES = 1 << 20  # smaller files: one buffered read, not worth a second open

_O_DIRECT = getattr(os, "O_DIRECT", 0)
_SYNC_FILE_RANGE_WRITE = 2  # <fcntl.h>: start write-out of dirty pages not yet under write-out
_no_direct_devices: set[int] = set()  # st_dev of filesystems that refused O_DIRECT
# O_NONBLOCK: opening a FIFO for reading would otherwise wait for a writer
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY
DIR_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_DIRECTORY
_KINDS = {stat.S_IFIFO: "a FIFO", stat.S_IFCHR: "a character device", stat.S_IFBLK:
          "a block device", stat.S_IFSOCK: "a socket", stat.S_IFDIR: "a directory",
          stat.S_IFLNK: "a symbolic link (checkpoint files are never read or written through "
                        "symlinks)"}


def _libc_function(name: str, restype: Any, *argtypes: Any) -> Any:
    try:
        function = getattr(ctypes.CDLL(None, use_errno=True), name)
    except (OSError, AttributeError):  # not Linux/glibc
        return None
    function.restype = restype
    function.argtypes = list(argtypes)
    return function


_sync_file_range = _libc_function("sync_file_range", ctypes.c_int, ctypes.c_int, ctypes.c_int64,
                                  ctypes.c_int64, ctypes.c_uint)
_mmap = _libc_function("mmap", ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                       ctypes.c_int, ctypes.c_int, ctypes.c_long)
_munmap = _libc_function("munmap", ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t)
_mincore = _libc_function("mincore", ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t,
                          ctypes.c_void_p)
_MAP_FAILED = ctypes.c_void_p(-1).value
_syscall = _libc_function("syscall", ctypes.c_long, ctypes.c_long, ctypes.c_int, ctypes.c_void_p,
                          ctypes.c_void_p, ctypes.c_uint)
_SYS_CACHESTAT = 451  # Linux >= 6.5; one number on every architecture with the unified table
_cachestat_missing = False  # set once the kernel answered ENOSYS

def start_writeback(fd: int) -> None:
    """Start writing the file's dirty pages to disk without waiting (no-op off Linux)."""
    if _sync_file_range is not None:
        _sync_file_range(fd, 0, 0, _SYNC_FILE_RANGE_WRITE)


def fsync_dir(path: str) -> None:
    """fsync directory ``path`` (its entries become durable); a missing one is skipped."""
    try:
        fd = os.open(path or ".", os.O_RDONLY | os.O_DIRECTORY)
    except FileNotFoundError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


fdatasync: Callable[[int], None] = getattr(os, "fdatasync", os.fsync)  # macOS has only fsync


def _max_pending() -> int:
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (ImportError, OSError, ValueError):  # no resource module (Windows)
        return 256
    if soft == resource.RLIM_INFINITY or soft <= 0:
        return 1024
    return max(64, min(1024, soft // 4))


MAX_PENDING = _max_pending()  # written files waiting for their flush, in the whole process
_KEPT_DIRS = MAX_PENDING // 4  # directory descriptors one batch keeps open (16 to 256)
_pending_lock = threading.Lock()  # guards every batch's queue and the count
_pending_count = 0


def _flush_file(path: str, fd: int) -> None:
    """fdatasync ``fd`` (file ``path``) and close it, closing it even when the flush fails."""
    try:
        fdatasync(fd)
    except OSError as exc:
        raise OSError(exc.errno, f"flushing {path} to disk failed: {exc.strerror}", path) from exc
    finally:
        os.close(fd)


def _flush_dir(path: str) -> None:
    """fsync directory ``path``; unlike :func:`fsync_dir`, a missing one is an error."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    except OSError as exc:
        raise OSError(exc.errno, f"flushing directory {path} to disk failed: {exc.strerror}",
                      path) from exc
    finally:
        os.close(fd)


class SyncBatch:
    """The files and directories one save wrote, made durable together (the module's rule).

    Thread-safe: files are added from the writing threads. Use each batch once: :meth:`sync`
    when everything is written, or :meth:`close` to give up (a failed save). It also keeps
    descriptors of the directories the save writes files into (:meth:`keep_dir`), so each
    file is created with one ``openat`` in its directory instead of a walk from the prefix;
    both close them.
    """

    def __init__(self) -> None:
        self._files: deque[tuple[str, int]] = deque()  # (path, fd) in the order written
        self._dirs: dict[str, None] = {}
        self._kept: dict[str, int] = {}  # directory descriptors kept for writes into them

    def add_file(self, path: str, fd: int) -> None:
        """Take over ``fd``, the descriptor file ``path`` was just written through: start its
        write-out and keep it open until :meth:`sync` (or until :data:`MAX_PENDING` files wait:
        then this thread flushes the oldest one of the batch now).

        Raises:
            OSError: that early flush failed.
        """
        global _pending_count
        start_writeback(fd)
        with _pending_lock:
            self._files.append((path, fd))
            _pending_count += 1
            oldest = self._files.popleft() if _pending_count > MAX_PENDING else None
            if oldest is not None:
                _pending_count -= 1
        if oldest is not None:
            _flush_file(*oldest)

    def add_dirs(self, paths: list[str]) -> None:
        """Directories to fsync in :meth:`sync` (each once)."""
        with _pending_lock:
            self._dirs.update(dict.fromkeys(paths))

    def keep_dir(self, path: str, fd: int) -> bool:
        """Keep ``fd``, a descriptor of directory ``path`` (reached by :func:`open_dir`'s walk),
        for this batch's writes into it (:meth:`kept_dir`: one ``openat`` per file, no walk),
        until :meth:`sync` or :meth:`close` closes it. False when it is not kept (one is
        already, or :data:`_KEPT_DIRS` are): the caller closes it."""
        with _pending_lock:
            if path in self._kept or len(self._kept) >= _KEPT_DIRS:
                return False
            self._kept[path] = fd
            return True

    def kept_dir(self, path: str) -> int | None:
        """The descriptor kept for directory ``path``, if any (open until the batch ends)."""
        return self._kept.get(path)  # one dict lookup: atomic, no lock needed

    def _take(self) -> tuple[list[tuple[str, int]], list[str]]:
        global _pending_count
        with _pending_lock:
            files, dirs, kept = list(self._files), list(self._dirs), list(self._kept.values())
            self._files.clear()
            self._dirs.clear()
            self._kept.clear()
            _pending_count -= len(files)
        for fd in kept:  # every write into them has finished (the batch's rule)
            os.close(fd)
        return files, dirs

    def sync(self, executor: Executor | None = None) -> None:
        """fdatasync and close every file, fsync every directory (concurrently on ``executor``
        when given); every file is closed when this returns.

        Raises:
            OSError: a flush failed (the first failure; all the others were attempted).
        """
        files, dirs = self._take()
        jobs: list[tuple[Callable[..., None], tuple[Any, ...]]] = [
            *((_flush_file, file) for file in files), *((_flush_dir, (d,)) for d in dirs)]
        futures: list[Future[None]] = []
        error: BaseException | None = None
        for fn, args in jobs:
            if executor is not None:
                try:
                    futures.append(executor.submit(fn, *args))
                    continue
                except BaseException as exc:  # e.g. shut down: flush the rest here
                    error, executor = exc, None
            try:
                fn(*args)
            except OSError as exc:
                error = error or exc
        wait(futures)
        for future in futures:
            error = error or future.exception()
        if error is not None:
            raise error

    def close(self) -> None:
        """Close every file without flushing it (the save failed; nothing will commit them)."""
        files, _ = self._take()
        for _, fd in files:
            try:
                os.close(fd)
            except OSError:
                pass


def aligned_empty(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """An uninitialised C-contiguous array whose data starts on a :data:`DIRECT_ALIGN` boundary
    when it is large enough to be read directly (a view into a slightly larger buffer)."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes < DIRECT_MIN_BYTES or not _O_DIRECT:
        return np.empty(shape, dtype)
    raw = np.empty(nbytes + DIRECT_ALIGN, np.uint8)
    start = -raw.ctypes.data % DIRECT_ALIGN
    return raw[start:start + nbytes].view(dtype).reshape(shape)


def _below(path: str, root: str) -> list[str]:
    """The components of ``path`` below directory ``root`` ([] for ``root`` itself).

    Raises:
        ValueError: ``path`` is not ``root`` or a path under it, or has empty, ``.`` or ``..``
            components.
    """
    base = root.rstrip("/") + "/"
    if path.rstrip("/") == root.rstrip("/"):
        return []
    parts = path[len(base):].split("/") if path.startswith(base) else []
    if not parts or any(p in ("", ".", "..") for p in parts):
        raise ValueError(f"{path} is not a path under {root}")
    return parts


class RefusedPathError(ValueError):
    """A part of a path below the prefix is a symlink or not what it must be (a directory, a
    regular file). Readers report it as damage; writers as an ``OSError`` with ``errno``
    (``ELOOP`` for a symlink, else the system's answer, e.g. ``ENOTDIR``)."""

    def __init__(self, message: str, error: int) -> None:
        super().__init__(message)
        self.errno = error


def _refusal(fd: int, name: str, shown: str, error: int) -> RefusedPathError:
    """Why entry ``name`` of directory ``fd`` (shown as ``shown``) cannot be passed through
    (``error``: what the open said; a symlink is ``ELOOP`` whatever it said)."""
    mode = os.lstat(name, dir_fd=fd).st_mode
    return RefusedPathError(f"{shown} is {_KINDS.get(stat.S_IFMT(mode), 'not a directory')}",
                            errno.ELOOP if stat.S_ISLNK(mode) else error)


def open_entry(fd: int, name: str, flags: int, shown: str, mode: int = 0o777) -> int:
    """Open (or create, with ``mode``) entry ``name`` of directory ``fd`` with ``flags``,
    which include ``O_NOFOLLOW``; return the descriptor.

    Raises:
        RefusedPathError: the entry is a symlink, or not a directory where ``flags`` ask for
            one (the message names it as ``shown``).
    """
    try:
        return os.open(name, flags, mode, dir_fd=fd)
    except OSError as exc:  # ELOOP: a symlink; ENOTDIR: not a directory; ENXIO: socket
        if exc.errno not in (errno.ELOOP, errno.ENOTDIR, errno.EMLINK, errno.ENXIO):
            raise named(exc, shown) from None
        raise _refusal(fd, name, shown, exc.errno) from None


def named(exc: OSError, path: str) -> OSError:
    """``exc`` (of a call relative to a directory descriptor) naming the whole ``path``: the
    same class (``FileNotFoundError``, ``PermissionError`` ...) and errno."""
    return OSError(exc.errno, exc.strerror, path)


def open_dir(path: str, root: str, *, created: list[str] | None = None) -> int:
    """Open directory ``path`` (``root`` or below it), following no symlink below ``root``;
    return the descriptor. ``root`` itself may be reached through symlinks (the user chose
    it), and must exist. With ``created`` (a list), missing directories below ``root`` are
    made on the way (each by ``mkdirat`` in its parent's descriptor) and appended to it,
    outermost first; their parents' entries are the caller's to flush.

    Raises:
        FileNotFoundError: ``root``, or (without ``created``) some part of the path, does not
            exist.
        RefusedPathError: a part of the path below ``root`` is a symlink or not a directory
            (the message names it).
        ValueError: ``path`` is not under ``root``.
    """
    parts = _below(path, root)
    shown = root.rstrip("/")
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for name in parts:
            shown = f"{shown}/{name}"
            try:
                child = open_entry(fd, name, DIR_FLAGS, shown)
            except FileNotFoundError:
                if created is None:
                    raise
                try:
                    os.mkdir(name, 0o777, dir_fd=fd)
                    created.append(shown)
                except FileExistsError:  # made meanwhile by another writer
                    pass
                except OSError as exc:  # EACCES, ENOSPC, ...
                    raise named(exc, shown) from None
                child = open_entry(fd, name, DIR_FLAGS, shown)
            os.close(fd)
            fd = child
        return fd
    except BaseException:
        os.close(fd)
        raise


def open_regular(path: str, root: str | None = None) -> int:
    """Open regular file ``path`` for reading, following no symlink in the part of the path
    below directory ``root`` (default: the file's own directory); return the descriptor.

    Raises:
        FileNotFoundError: some part of the path does not exist.
        ValueError: a part of it is a symlink or not a directory, or the file is not a regular
            file (a FIFO, device, socket, directory). The message names the part, nothing more.
    """
    root = posixpath.dirname(path) if root is None else root
    if not _below(path, root):
        raise ValueError(f"{path} is not a file path under {root}")
    directory, name = posixpath.split(path)
    dir_fd = open_dir(directory, root)
    try:
        fd = open_entry(dir_fd, name, _FILE_FLAGS, path)
    finally:
        os.close(dir_fd)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise ValueError(f"{path} is {_KINDS.get(stat.S_IFMT(mode), 'not a regular file')}, "
                             "not a regular file")
        os.set_blocking(fd, True)
        return fd
    except BaseException:
        os.close(fd)
        raise


def read_into(path: str, out: memoryview, trailer: int, *, root: str | None = None) -> bytes:
    """Read local file ``path``: its first ``len(out)`` bytes into ``out``; return the
    ``trailer`` bytes after them. ``root``: as for :func:`open_regular`.

    Raises:
        FileNotFoundError: no such file.
        ValueError: the file's size is not ``len(out) + trailer``, or it shrank while read, or
            it is not a regular file reached without symlinks (:func:`open_regular`).
    """
    with open(open_regular(path, root), "rb", buffering=0) as f:
        st = os.fstat(f.fileno())
        expected = len(out) + trailer
        if st.st_size != expected:
            raise ValueError(f"{st.st_size} bytes where {expected} were expected")
        done = _read_direct(f.fileno(), out, st) if _direct_pays(f.fileno(), out, st) else 0
        f.seek(done)
        view = out[done:]
        while view:
            n = f.readinto(view)
            if not n:
                raise ValueError("the file ended early")
            view = view[n:]
        tail = f.read(trailer)
        if len(tail) != trailer:
            raise ValueError("the file ended early")
        return tail


def _direct_pays(fd: int, out: memoryview, st: os.stat_result) -> bool:
    """Whether to read ``out``'s body with O_DIRECT: possible here, large, aligned, not cached."""
    return (bool(_O_DIRECT) and len(out) >= DIRECT_MIN_BYTES
            and st.st_dev not in _no_direct_devices
            and np.frombuffer(out, np.uint8).ctypes.data % DIRECT_ALIGN == 0
            and not _mostly_cached(fd, st.st_size))


def _mostly_cached(fd: int, size: int) -> bool:
    """Whether at least half of the file's bytes are in the page cache (True when unknown).

    ``cachestat()`` asks the page cache directly. Older kernels get ``mincore()`` on a mapping
    of the file: that answers too, but ``mmap`` waits for the process's address-space lock,
    which other threads hold while they fault in destination pages.
    """
    cached = _cachestat_pages(fd, size)
    if cached is None:
        cached = _mincore_pages(fd, size)
    return cached is None or 2 * cached * mmap.PAGESIZE >= size


def _cachestat_pages(fd: int, size: int) -> int | None:
    global _cachestat_missing
    if _syscall is None or _cachestat_missing:
        return None
    span = (ctypes.c_uint64 * 2)(0, size)  # struct cachestat_range {off, len}
    stat = (ctypes.c_uint64 * 5)()  # struct cachestat; nr_cache first
    if _syscall(_SYS_CACHESTAT, fd, ctypes.byref(span), ctypes.byref(stat), 0) != 0:
        _cachestat_missing = ctypes.get_errno() == errno.ENOSYS
        return None
    return int(stat[0])


def _mincore_pages(fd: int, size: int) -> int | None:
    if _mmap is None or _mincore is None or _munmap is None:
        return None
    addr = _mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
    if addr in (None, _MAP_FAILED):
        return None
    try:
        pages = np.zeros(-(-size // mmap.PAGESIZE), np.uint8)
        if _mincore(addr, size, pages.ctypes.data) != 0:
            return None
        return int(np.count_nonzero(pages & 1))
    finally:
        _munmap(addr, size)


def _read_direct(fd: int, out: memoryview, st: os.stat_result) -> int:
    """Read the largest aligned prefix of ``out`` from open file ``fd`` with O_DIRECT; return
    how many bytes were read (a multiple of :data:`DIRECT_ALIGN`; 0 when the filesystem refuses
    direct I/O). O_DIRECT is set on ``fd`` itself (Linux allows that with F_SETFL) and cleared
    again: opening the path a second time could reach another file than the checked one."""
    body = len(out) - len(out) % DIRECT_ALIGN
    done = 0
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, flags | _O_DIRECT)
        try:
            while done < body:
                n = os.preadv(fd, [out[done:body]], done)
                if n <= 0:  # the file shrank: the buffered read after this one reports it
                    break
                done += n
        finally:
            fcntl.fcntl(fd, fcntl.F_SETFL, flags)
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
        _no_direct_devices.add(st.st_dev)  # the filesystem or device refuses direct I/O
    return done - done % DIRECT_ALIGN
