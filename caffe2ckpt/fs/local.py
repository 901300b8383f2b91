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
that holds it. Deletes never follow a symbolic link either.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import posixpath
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

    def _checked_root(self, root: str) -> str:
        segments = root.strip("/").split("/")
        if "." in segments or ".." in segments:
            root = os.path.realpath(root)  # as the OS would resolve it, without creating
        return root.rstrip("/") or "/"

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

    def create_exclusive(self, path: str, data: bytes, *,
                         batch: localio.SyncBatch | None = None) -> None:
        directory = posixpath.dirname(path)
        self.makedirs(directory, batch=batch)
        tmp = posixpath.join(directory, f".tmp-{uuid.uuid4().hex}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.link(tmp, path)  # fails with FileExistsError if a record is already there
        finally:
            os.unlink(tmp)
        _sync_dirs([directory], batch)

    def create_group(self, path: str, first: str, data: bytes, *,
                     batch: localio.SyncBatch | None = None) -> None:
        """The directory itself must be new (``mkdir``): a leftover directory of an
        interrupted writer or a removal in progress is never shared."""
        self.makedirs(posixpath.dirname(path), batch=batch)
        os.mkdir(path)  # FileExistsError: taken
        _sync_dirs([posixpath.dirname(path), path], batch)
        self.write_file(f"{path}/{first}", [data], batch=batch, exclusive=True)

    def replace_file(self, path: str, data: bytes) -> None:
        directory = posixpath.dirname(path)
        self.makedirs(directory)
        tmp = posixpath.join(directory, f".tmp-{uuid.uuid4().hex}")
        try:
            self.write_file(tmp, [data], exclusive=True)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
        localio.fsync_dir(directory)

    def write_file(self, path: str, buffers: list[Any], *,
                   batch: localio.SyncBatch | None = None, exclusive: bool = False) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | (os.O_EXCL if exclusive else os.O_TRUNC),
                     0o644)
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
