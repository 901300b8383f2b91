"""A checkpoint prefix on a local disk, through ``os`` with the Linux fast paths of
:mod:`caffe2ckpt.fs.localio`.

Durability: every file is flushed on the descriptor it was written through, never by a
filesystem-wide ``syncfs()`` (which reports no write-back error before Linux 5.8, and after that
only once per filesystem, to whoever asks first). :meth:`LocalLocation.write_file` either
``fdatasync``'s the file before returning, or hands its open descriptor to a
:class:`~caffe2ckpt.fs.localio.SyncBatch` that :meth:`~caffe2ckpt.fs.location.Location.make_durable`
flushes together with the directories the save created entries in, so a write-back error of any
file reaches the save that wrote it (``localio``'s module docstring has the full rule). Every
directory created is fsync'ed in its parent (:meth:`LocalLocation.makedirs`), whoever creates it.
An exclusive create is an fsync'ed temp file hard-linked to its name, then its directory
fsync'ed; a group's path is taken by ``mkdir``.

Reads: a file is read only if it is a regular file reached without following a symlink below the
prefix (:func:`caffe2ckpt.fs.localio.open_regular`); a FIFO, device, socket or symlink there is
refused as ``ValueError`` naming the file, which callers report as corruption of the checkpoint
that holds it. Writes take the same walk (:func:`caffe2ckpt.fs.localio.open_dir`): every
directory, file, temp file and link below the prefix is made relative to a descriptor of its
directory, reached from the prefix without following a symlink, so a symlinked ``_commits/``,
``_runs/``, ``_hints/`` or group directory fails the write with an ``OSError`` (``ELOOP``) naming
it as a read of it would, and nothing is written outside the prefix. The prefix itself, and what
is above it, may be reached through symlinks: the user chose it. Deletes never follow a
symbolic link either.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import posixpath
import re
import shutil
import stat
import uuid
from typing import Any

from caffe2ckpt.errors import CheckpointNotFoundError
from caffe2ckpt.fs import localio
from caffe2ckpt.fs.location import Location, subdirectories

__all__ = ["LocalLocation"]

logger = logging.getLogger(__name__)

_MISSING = (FileNotFoundError, NotADirectoryError)  # a path under a file does not exist either


class LocalLocation(Location):
    """A checkpoint prefix on a local disk (see the module docstring)."""

    is_local = True
    atomic_creates = True  # a complete, flushed temp file hard-linked to its name

    def _checked_root(self, root: str) -> str:
        """``..`` and ``.`` resolved as the OS resolves them; repeated slashes (which the OS
        reads as one, e.g. from joining ``DirFileSystem`` paths) written as one."""
        segments = root.strip("/").split("/")
        if "." in segments or ".." in segments:
            root = os.path.realpath(root)  # as the OS would resolve it, without creating
        return re.sub("/{2,}", "/", root).rstrip("/") or "/"

    # -- reads -----------------------------------------------------------------------------------

    def read_bytes(self, path: str, *, limit: int | None = None) -> bytes:
        try:
            with open(localio.open_regular(path, self.root), "rb") as f:
                size = os.fstat(f.fileno()).st_size
                too_large = limit is not None and size > limit
                # read what fstat says, plus one byte: a file growing meanwhile is caught (a
                # limit + 1 request would allocate limit bytes for every small file)
                data = b"" if too_large else f.read(size + 1)
        except _MISSING as exc:
            raise CheckpointNotFoundError(f"{path} does not exist") from exc
        if limit is not None and max(size, len(data)) > limit:
            raise ValueError(f"{self.display(path)} is larger than the {limit} bytes such a "
                             "file may have")
        return data

    def size(self, path: str) -> int | None:
        try:
            fd = localio.open_regular(path, self.root)
        except _MISSING as exc:
            raise CheckpointNotFoundError(f"{path} does not exist") from exc
        try:
            return os.fstat(fd).st_size
        finally:
            os.close(fd)

    def read_exact(self, path: str, out: memoryview, trailer: int) -> bytes:
        try:
            return localio.read_into(path, out, trailer, root=self.root)
        except _MISSING as exc:
            raise CheckpointNotFoundError(f"{path} does not exist") from exc

    def list_names(self, path: str) -> list[str]:
        try:
            return os.listdir(path)
        except _MISSING:
            return []

    def exists(self, path: str) -> bool:
        try:  # not os.path.lexists, which answers False on EIO or EACCES
            os.lstat(path)
        except _MISSING:
            return False
        return True

    def modified(self, path: str) -> float | None:
        try:
            return os.lstat(path).st_mtime
        except _MISSING as exc:
            raise CheckpointNotFoundError(f"{path} does not exist") from exc

    # -- writes ----------------------------------------------------------------------------------

    def makedirs(self, path: str, *, batch: localio.SyncBatch | None = None) -> list[str]:
        if not path.startswith(f"{self.root.rstrip('/')}/"):  # the prefix or above: the user's
            return _makedirs_plain(path, batch)
        fd, created = self._open_dir(path, batch)
        if batch is None or not batch.keep_dir(path, fd):  # kept: the save writes files there
            os.close(fd)
        return created

    def _open_dir(self, path: str, batch: localio.SyncBatch | None) -> tuple[int, list[str]]:
        """Open directory ``path`` (the prefix or under it), making it and its missing parents
        durably as :meth:`makedirs` does, following no symlink below the prefix: the walk reads
        take (:func:`localio.open_dir`). Returns the descriptor and the directories made.

        Raises:
            OSError: a part of the path below the prefix is a symlink or not a directory.
        """
        made: list[str] = []  # by the walk
        try:
            fd = _walk(path, self.root, made)
        except FileNotFoundError:  # the prefix is missing: made as the user named it
            prefix = _makedirs_plain(self.root, batch)
            fd = _walk(path, self.root, made)
        else:
            prefix = []
        _sync_dirs([posixpath.dirname(d) for d in made], batch)
        return fd, prefix + made

    def create_exclusive(self, path: str, data: bytes, *,
                         batch: localio.SyncBatch | None = None) -> None:
        directory, name = posixpath.split(path)
        dir_fd, _ = self._open_dir(directory, batch)
        try:
            tmp = f".tmp-{uuid.uuid4().hex}"
            fd = _open_at(dir_fd, f"{directory}/{tmp}", _CREATE | os.O_EXCL, 0o644)
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
                try:  # FileExistsError if a record is already there
                    os.link(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd,
                            follow_symlinks=False)
                except OSError as exc:
                    raise localio.named(exc, path) from None
            finally:
                os.unlink(tmp, dir_fd=dir_fd)
            _sync_dir(directory, dir_fd, batch)
        finally:
            os.close(dir_fd)

    def create_group(self, path: str, first: str, data: bytes, *,
                     batch: localio.SyncBatch | None = None) -> None:
        """The directory itself must be new (``mkdir``): a leftover directory of an
        interrupted writer or a removal in progress is never shared; a symlink there is
        taken too (``mkdir`` does not follow it)."""
        parent, name = posixpath.split(path)
        parent_fd, _ = self._open_dir(parent, batch)
        try:
            try:
                os.mkdir(name, 0o777, dir_fd=parent_fd)  # FileExistsError: taken
            except OSError as exc:
                raise localio.named(exc, path) from None
            group_fd = _open_at(parent_fd, path, localio.DIR_FLAGS)
        finally:
            os.close(parent_fd)
        try:
            _sync_dirs([parent, path], batch)
            _write_at(group_fd, f"{path}/{first}", [data], batch, os.O_EXCL)
        finally:
            os.close(group_fd)

    def replace_file(self, path: str, data: bytes) -> None:
        directory, name = posixpath.split(path)
        dir_fd, _ = self._open_dir(directory, None)
        try:
            tmp = f".tmp-{uuid.uuid4().hex}"
            try:
                _write_at(dir_fd, f"{directory}/{tmp}", [data], None, os.O_EXCL)
                try:
                    os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
                except OSError as exc:
                    raise localio.named(exc, path) from None
            except BaseException:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp, dir_fd=dir_fd)
                raise
            _sync_dir(directory, dir_fd, None)
        finally:
            os.close(dir_fd)

    def write_file(self, path: str, buffers: list[Any], *,
                   batch: localio.SyncBatch | None = None, exclusive: bool = False) -> None:
        directory = posixpath.dirname(path)
        kept = None if batch is None else batch.kept_dir(directory)  # walked by makedirs
        dir_fd = _walk(directory, self.root) if kept is None else kept  # parents must exist
        try:
            _write_at(dir_fd, path, buffers, batch, os.O_EXCL if exclusive else os.O_TRUNC)
        finally:
            if kept is None:
                os.close(dir_fd)

    def sync_batch(self) -> localio.SyncBatch:
        return localio.SyncBatch()

    # -- deletes ---------------------------------------------------------------------------------

    def remove(self, path: str) -> None:
        link = _first_link(self.root, path)
        if link is not None:
            logger.warning("%s is a symbolic link: deleting the link itself, not what it points "
                           "to (%s), instead of %s", link, os.path.realpath(link), path)
            path = link
        try:
            if stat.S_ISDIR(os.lstat(path).st_mode):
                shutil.rmtree(path)  # removes links inside it, never follows them
            else:
                os.unlink(path)
        except FileNotFoundError:
            return
        localio.fsync_dir(posixpath.dirname(path))

    def remove_files(self, directory: str, names: list[str]) -> None:
        if _first_link(self.root, directory) is not None:
            self.remove(directory)  # the link goes, never what it points to
            return
        for name in names:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(f"{directory}/{name}")
        for sub in [*(f"{directory}/{d}" for d in subdirectories(names)), directory]:
            with contextlib.suppress(FileNotFoundError, OSError):
                os.rmdir(sub)  # ENOTEMPTY: something unnamed is there; it stays
        localio.fsync_dir(posixpath.dirname(directory))


_CREATE = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW  # a symlink at the name is refused (ELOOP)


def _walk(path: str, root: str, created: list[str] | None = None) -> int:
    """:func:`localio.open_dir` for a write: a refused part of the path is an ``OSError``
    (a write that cannot be done, as callers of writes expect) naming it."""
    try:
        return localio.open_dir(path, root, created=created)
    except localio.RefusedPathError as exc:
        raise OSError(exc.errno, str(exc)) from None


def _open_at(dir_fd: int, path: str, flags: int, mode: int = 0o777) -> int:
    """Open (or create) ``path``, the entry of directory ``dir_fd`` named by its last part,
    with ``flags`` (which include ``O_NOFOLLOW``); a refusal is an ``OSError`` as in
    :func:`_walk`."""
    try:
        return localio.open_entry(dir_fd, posixpath.basename(path), flags, path, mode)
    except localio.RefusedPathError as exc:
        raise OSError(exc.errno, str(exc)) from None


def _write_at(dir_fd: int, path: str, buffers: list[Any], batch: localio.SyncBatch | None,
              mode: int) -> None:
    """Write the concatenation of ``buffers`` to file ``path``, created in directory
    ``dir_fd`` (``mode``: ``O_EXCL`` or ``O_TRUNC``), durably: ``fdatasync``'ed before this
    returns, or with ``batch`` handed over open for its flush."""
    fd = _open_at(dir_fd, path, _CREATE | mode, 0o644)
    try:
        for buf in buffers:
            view = memoryview(buf).cast("B")
            while view:
                view = view[os.write(fd, view):]
    except BaseException:
        os.close(fd)
        raise
    if batch is not None:
        batch.add_file(path, fd)  # the batch owns the descriptor now
        return
    try:
        localio.fdatasync(fd)
    finally:
        os.close(fd)


def _makedirs_plain(path: str, batch: localio.SyncBatch | None) -> list[str]:
    """Create directory ``path`` and its missing parents by their paths, following symlinks
    (the prefix and above it: the user named them), durably (:meth:`LocalLocation.makedirs`)."""
    missing, parent = [], path
    while parent and not os.path.exists(parent):
        missing.append(parent)
        parent = os.path.dirname(parent)
    created = []
    for directory in reversed(missing):  # fails as os.makedirs does (ENOTDIR, EACCES, ...)
        try:
            os.mkdir(directory)
            created.append(directory)
        except FileExistsError:  # created meanwhile by someone else
            pass
    if not os.path.isdir(path):
        # not FileExistsError: callers retry an exclusive create on that
        raise NotADirectoryError(errno.ENOTDIR, "exists and is not a directory", path)
    _sync_dirs([posixpath.dirname(d) for d in created], batch)
    return created


def _sync_dir(path: str, fd: int, batch: localio.SyncBatch | None) -> None:
    """fsync directory ``path``, open as ``fd``, now, or hand it to ``batch``."""
    if batch is not None:
        batch.add_dirs([path])
        return
    os.fsync(fd)


def _sync_dirs(dirs: list[str], batch: localio.SyncBatch | None) -> None:
    """fsync ``dirs`` now, or hand them to ``batch``."""
    if batch is not None:
        batch.add_dirs(dirs)
        return
    for directory in dirs:
        localio.fsync_dir(directory)


def _first_link(root: str, path: str) -> str | None:
    """The first symbolic link on the way from ``root`` (not included: a prefix may well be a
    link) down to ``path`` (included), or None."""
    rel = path[len(root):] if path.startswith(f"{root.rstrip('/')}/") else None
    if rel is None:  # not under the prefix: only the path itself is ours to check
        return path if os.path.islink(path) else None
    current = root.rstrip("/")
    for part in rel.strip("/").split("/"):
        current = f"{current}/{part}"
        try:
            if stat.S_ISLNK(os.lstat(current).st_mode):
                return current
        except _MISSING:
            return None
    return None
