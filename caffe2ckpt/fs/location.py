"""Where checkpoints live: a URL turned into an fsspec filesystem, plus the few file operations
the commit protocol needs (exclusive create, durable writes, listing, moves, deletes).

Local disks get real durability and atomic ``os.link``/``os.rename``; every other fsspec
filesystem (``memory://``, ``s3://``, ``gs://``, wrappers) goes through its own API, where an
exclusive create is ``open(path, "xb")`` (an ``If-None-Match`` PUT on S3; on ``memory://`` a
check and a whole-file write under one lock) and nothing relies on a rename being atomic.

Durability on local disks: every file is flushed on the descriptor it was written through, never
by a filesystem-wide ``syncfs()`` (which reports no write-back error before Linux 5.8, and after
that only once per filesystem, to whoever asks first). :meth:`Location.write_file` either
``fdatasync``'s the file before returning, or hands its open descriptor to a
:class:`~caffe2ckpt.fs.localio.SyncBatch` (:meth:`Location.sync_batch`) that
:meth:`Location.make_durable` flushes together with the directories the save created entries
in, so a write-back error of any file reaches the save that wrote it; the save writes its
commit record only after that (``localio``'s module docstring has the full rule). The record
itself is an fsync'ed temp file, hard-linked to its name, then its directory is fsync'ed.

Prefixes: a local path may contain ``.`` and ``..`` segments; they are resolved the way the
operating system resolves them (``os.path.realpath``) before anything is written, so nothing
lands outside the resolved prefix and no directory named in a ``..`` step is created. A URL of
any other filesystem (``memory://``, ``s3://``, ...) must not contain ``.``, ``..`` or empty
segments, nor be empty: object stores keep such segments as literal key parts, while HTTP
clients and other tools may resolve them, so the same URL could name two different places. They
are refused with :class:`InvalidLocationError`.

Errors (see :mod:`caffe2ckpt.fs.clienterrors`): a filesystem failure that is not an ``OSError`` (e.g.
botocore's ``NoCredentialsError``, which s3fs passes through) is re-raised naming the prefix: missing credentials as
:class:`~caffe2ckpt.errors.StorageCredentialsError` (an :class:`InvalidLocationError`), other
configuration problems (profile, region, parameters, storage options the filesystem does not
take) as :class:`InvalidLocationError`, anything else (e.g. ``EndpointConnectionError`` after s3fs's
retries) as an ``OSError`` (``EIO``), so callers see an I/O failure, not corruption.

Reads: a local file is read only if it is a regular file reached without following a symlink
below the prefix (:func:`caffe2ckpt.fs.localio.open_regular`); a FIFO, device, socket or symlink
there is refused as ``ValueError`` naming the file, which callers report as corruption of the
checkpoint that holds it. Reads of metadata take a size ``limit`` and never read more than that.

This is the only module that turns URLs into filesystems. It does not import zarr or prefect.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import logging
import os
import posixpath
import shutil
import stat
import threading
import uuid
from concurrent.futures import Executor
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem
from fsspec.implementations.memory import MemoryFileSystem

from caffe2ckpt.fs import localio
from caffe2ckpt.errors import CheckpointError, CheckpointNotFoundError, InvalidLocationError
from caffe2ckpt.fs.clienterrors import is_credentials_error, translate

__all__ = ["Location"]

logger = logging.getLogger(__name__)

# memory:// is one store per process, and its own "xb" open checks for the file, then publishes
# it empty, then fills it: two threads could both create one record. Exclusive creates there
# hold this lock and publish the file whole.
_MEMORY_CREATES = threading.Lock()


class Location:
    """A checkpoint prefix on some filesystem.

    Args:
        url: a local path or an fsspec URL (``memory://runs/a``, ``s3://bucket/run``).
        storage_options: passed to the fsspec filesystem (credentials, endpoint, ...).
        filesystem: use this fsspec filesystem instance instead of one made from the URL's
            protocol; ``url`` is then a path on it.
    """

    def __init__(
        self,
        url: str,
        storage_options: dict[str, Any] | None = None,
        filesystem: fsspec.AbstractFileSystem | None = None,
    ) -> None:
        if not isinstance(url, str) or not url.strip():
            raise InvalidLocationError(f"a checkpoint prefix must be a non-empty string, got {url!r}")
        if "\x00" in url:
            raise InvalidLocationError(f"checkpoint prefix {url!r} contains a NUL character")
        self.url = url
        if filesystem is not None:
            self.fs = filesystem
            root = filesystem._strip_protocol(url)
        else:
            try:
                self.fs, root = fsspec.core.url_to_fs(url, **(storage_options or {}))
            except CheckpointError:
                raise
            except Exception as exc:  # unknown protocol, missing package, bad options
                if is_credentials_error(exc):
                    raise translate(url, exc) from exc
                raise InvalidLocationError(
                    f"cannot open checkpoint prefix {url!r}: {type(exc).__name__}: {exc}"
                ) from exc
        # Only a plain local filesystem gets os-level fast paths; wrappers go through fsspec.
        self.is_local = type(self.fs) is LocalFileSystem
        # Object stores have no directories: their makedirs only checks that the bucket exists
        # (creating it if not), one request per call, before every exclusive create. Once per
        # Location is enough (see makedirs).
        protocols = self.fs.protocol if isinstance(self.fs.protocol, tuple) else (self.fs.protocol,)
        self._bucket_only_dirs = bool({"s3", "s3a", "gs", "gcs"} & set(protocols))
        self._bucket_checked = False
        self.root = self._checked_root(str(root))

    def _checked_root(self, root: str) -> str:
        """The prefix's path on the filesystem: local ``.``/``..`` resolved, others checked."""
        segments = root.strip("/").split("/")
        if self.is_local:
            if "." in segments or ".." in segments:
                root = os.path.realpath(root)  # as the OS would resolve it, without creating
            return root.rstrip("/") or "/"
        if not root.strip("/"):
            raise InvalidLocationError(
                f"checkpoint prefix {self.url!r} names no path on its filesystem (e.g. "
                "'s3://bucket/run', 'memory://run')")
        bad = sorted({s for s in segments if s in ("", ".", "..")})
        if bad:
            shown = ", ".join(repr(s) if s else "empty" for s in bad)
            raise InvalidLocationError(
                f"checkpoint prefix {self.url!r} has {shown} path segments: on this filesystem "
                "they would be literal key parts that other tools may resolve differently; "
                "write the normalised path")
        return root.rstrip("/")

    def _guard(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """Call filesystem method ``fn``; a failure that is not an OSError (e.g. botocore's
        ``NoCredentialsError``) is re-raised naming the prefix (see the module docstring)."""
        try:
            return fn(*args, **kwargs)
        except (OSError, CheckpointError):
            raise
        except Exception as exc:
            raise translate(self.url, exc) from exc

    def __repr__(self) -> str:
        return f"Location({self.url!r})"

    def path(self, *parts: str) -> str:
        """The filesystem path of ``parts`` under the prefix."""
        return posixpath.join(self.root, *parts)

    def display(self, *parts: str) -> str:
        """A user-facing URL for ``parts`` under the prefix, or for one filesystem path under
        it (for messages and artifacts)."""
        if len(parts) == 1 and (parts[0] == self.root or parts[0].startswith(self.root + "/")):
            parts = (parts[0][len(self.root):].lstrip("/"),)
        parts = tuple(p for p in parts if p)
        return posixpath.join(self.url.rstrip("/"), *parts) if parts else self.url

    # -- reads ---------------------------------------------------------------------------------

    def read_bytes(self, path: str, *, limit: int | None = None) -> bytes:
        """The content of file ``path`` (at most ``limit`` bytes are read, if given).

        Local files are read only if they are regular files reached without a symlink below
        the prefix (see :func:`caffe2ckpt.fs.localio.open_regular`).

        Raises:
            CheckpointNotFoundError: there is no such file.
            ValueError: it is larger than ``limit``, or (locally) not a regular file or reached
                through a symlink; the message names the file.
        """
        try:
            if self.is_local:
                with open(localio.open_regular(path, self.root), "rb") as f:
                    size = os.fstat(f.fileno()).st_size
                    too_large = limit is not None and size > limit
                    # read what fstat says, plus one byte: a file growing meanwhile is caught
                    # (a limit + 1 request would allocate limit bytes for every small file)
                    data = b"" if too_large else f.read(size + 1)
            elif limit is None:
                return self._guard(self.fs.cat_file, path)
            else:
                data = self._read_head(path, limit + 1)
                size = len(data)
        except (FileNotFoundError, NotADirectoryError) as exc:  # nothing there
            raise CheckpointNotFoundError(f"{path} does not exist") from exc
        if limit is not None and max(size, len(data)) > limit:
            raise ValueError(f"{self.display(path)} is larger than the {limit} bytes such a "
                             "file may have")
        return data

    def _read_head(self, path: str, count: int) -> bytes:
        """The first ``count`` bytes of non-local file ``path``, in one ranged GET: an object of
        any size costs at most ``count`` bytes of memory."""
        try:
            return self._guard(self.fs.cat_file, path, start=0, end=count)
        except FileNotFoundError:
            raise
        except OSError:  # S3 refuses any range of an empty object (416): is it empty?
            if self._guard(self.fs.info, path).get("size") == 0:
                return b""
            raise

    def size(self, path: str) -> int | None:
        """The size of file ``path`` (None if the filesystem does not say), checked like
        :meth:`read_bytes` checks a file locally.

        Raises:
            CheckpointNotFoundError: there is no such file.
            ValueError: (locally) it is not a regular file, or is reached through a symlink.
        """
        try:
            if not self.is_local:
                size = self._guard(self.fs.info, path).get("size")
                return None if size is None else int(size)
            fd = localio.open_regular(path, self.root)
        except (FileNotFoundError, NotADirectoryError) as exc:  # nothing there
            raise CheckpointNotFoundError(f"{path} does not exist") from exc
        try:
            return os.fstat(fd).st_size
        finally:
            os.close(fd)

    def list_names(self, path: str) -> list[str]:
        """Base names of the entries directly under ``path`` ([] if it does not exist)."""
        if self.is_local:
            try:
                return os.listdir(path)
            except (FileNotFoundError, NotADirectoryError):
                return []
        def ls() -> list[str]:
            try:
                return self.fs.ls(path, detail=False, refresh=True)
            except TypeError:  # filesystems whose ls takes no refresh argument
                return self.fs.ls(path, detail=False)
        try:
            entries = self._guard(ls)
        except FileNotFoundError:
            return []
        return [posixpath.basename(e.rstrip("/")) for e in entries]

    def exists(self, path: str) -> bool:
        if self.is_local:
            return os.path.lexists(path)
        return self._guard(self.fs.exists, path)

    # -- writes --------------------------------------------------------------------------------

    def makedirs(self, path: str, *, batch: localio.SyncBatch | None = None) -> list[str]:
        """Create directory ``path`` and its missing parents, durably: on local disks the
        parent of every directory this call created is fsync'ed (with ``batch``, when
        :meth:`make_durable` flushes it). Every writer creates directories through here, so
        none is left to chance on a power failure. Returns the directories created, outermost
        first (local disks; elsewhere [])."""
        if not self.is_local:
            if self._bucket_checked:  # an object store whose bucket this Location has seen
                return []
            self._guard(self.fs.makedirs, path, exist_ok=True)
            self._bucket_checked = self._bucket_only_dirs
            return []
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
        self._sync_dirs([posixpath.dirname(d) for d in created], batch)
        return created

    @staticmethod
    def _sync_dirs(dirs: list[str], batch: localio.SyncBatch | None) -> None:
        """fsync ``dirs`` now, or hand them to ``batch`` (local disks only)."""
        if batch is not None:
            batch.add_dirs(dirs)
            return
        for directory in dirs:
            localio.fsync_dir(directory)

    def create_exclusive(self, path: str, data: bytes, *,
                         batch: localio.SyncBatch | None = None) -> None:
        """Write ``data`` to a new file ``path`` in one step, durably (with ``batch``, its
        directory's entry becomes durable when :meth:`make_durable` flushes the batch; the
        file itself is flushed before it gets its name).

        Raises:
            FileExistsError: ``path`` already exists; nothing was changed.
        """
        directory = posixpath.dirname(path)
        self.makedirs(directory, batch=batch)
        if isinstance(self.fs, MemoryFileSystem):
            with _MEMORY_CREATES:
                if self.fs.exists(path):
                    raise FileExistsError(errno.EEXIST, "file exists", path)
                self.fs.pipe_file(path, data)
            return
        if not self.is_local:
            def create() -> None:
                with self.fs.open(path, "xb") as f:
                    f.write(data)
            self._guard(create)
            return
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
        self._sync_dirs([directory], batch)

    def create_group(self, path: str, first: str, data: bytes, *,
                     batch: localio.SyncBatch | None = None) -> None:
        """Take directory ``path`` for one writer: create it with its file ``first`` holding
        ``data``, or raise ``FileExistsError`` if anyone took it before (also an interrupted
        writer or a removal in progress: the path is then never shared). On local disks the
        directory itself must be new (``mkdir``); elsewhere ``first`` is created exclusively.
        The file is flushed with ``batch`` (local disks)."""
        if not self.is_local:
            self.create_exclusive(f"{path}/{first}", data)
            return
        self.makedirs(posixpath.dirname(path), batch=batch)
        os.mkdir(path)  # FileExistsError: taken
        self._sync_dirs([posixpath.dirname(path), path], batch)
        self.write_file(f"{path}/{first}", [data], batch=batch, exclusive=True)

    def replace_file(self, path: str, data: bytes) -> None:
        """Write ``data`` to ``path`` whole, replacing what is there (a reader sees the old or
        the new content, never a mix), durably on local disks."""
        if not self.is_local:
            self._guard(self.fs.pipe_file, path, data)
            return
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
        """Write the concatenation of ``buffers`` to ``path`` (parents must exist locally);
        with ``exclusive``, a file that exists is ``FileExistsError`` (local disks).

        On local disks the file is made durable on the descriptor it was written through:
        ``fdatasync``'ed before returning, or with ``batch`` handed over open (its write-out
        started) for :meth:`make_durable` to flush. Elsewhere ``batch`` is ignored.
        """
        if not self.is_local:
            data = buffers[0] if len(buffers) == 1 else b"".join(memoryview(b) for b in buffers)
            self._guard(self.fs.pipe_file, path,
                        bytes(data) if not isinstance(data, bytes) else data)
            return
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

    def read_exact(self, path: str, out: memoryview, trailer: int) -> bytes:
        """Read file ``path`` into ``out`` and return its last ``trailer`` bytes.

        Raises:
            CheckpointNotFoundError: no such file.
            ValueError: the file's size is not ``len(out) + trailer``, or (locally) it is not a
                regular file reached without a symlink below the prefix.
        """
        if not self.is_local:
            expected = len(out) + trailer
            try:
                data = self.read_bytes(path, limit=expected)
            except ValueError:  # larger: not read whole into memory
                raise ValueError(f"more than the {expected} bytes expected") from None
            if len(data) != expected:
                raise ValueError(f"{len(data)} bytes where {expected} were expected")
            out[:] = memoryview(data)[: len(out)]
            return data[len(out):]
        try:
            return localio.read_into(path, out, trailer, root=self.root)
        except (FileNotFoundError, NotADirectoryError) as exc:  # nothing there
            raise CheckpointNotFoundError(f"{path} does not exist") from exc

    def sync_batch(self) -> localio.SyncBatch | None:
        """A batch for :meth:`write_file` and :meth:`make_durable` on local disks; None
        elsewhere (nothing to flush there)."""
        return localio.SyncBatch() if self.is_local else None

    def make_durable(self, batch: localio.SyncBatch | None, dirs: list[str],
                     executor: Executor | None = None) -> None:
        """Make the files written into ``batch`` durable (``fdatasync`` each on its own
        descriptor, then close it) and the entries of directories ``dirs`` (``fsync`` each),
        concurrently on ``executor`` when given. No-op without a batch (not a local disk).

        Raises:
            OSError: a flush failed: some of the data may not be on the disk.
        """
        if batch is None:
            return
        batch.add_dirs(dirs)
        batch.sync(executor)

    def remove(self, path: str) -> None:
        """Delete file or tree ``path``, exactly; a missing path is not an error (any other is).

        Never through fsspec's ``rm``: it expands glob characters, so removing node ``w[12]``'s
        group would also remove ``w1``'s and ``w2``'s. The exact tree is listed (``find`` does
        not glob) and its keys are deleted one by one. A symbolic link is deleted itself, never
        followed: on local disks also one on the way from the prefix to ``path`` (e.g. a
        symlinked ``_staging``), so nothing outside the prefix is ever deleted.
        """
        if self.is_local:
            _remove_local(self.root, path)
            return
        try:
            # not fs.isdir(): it answers False on any error, which would hide an I/O failure
            info = self._guard(self.fs.info, path)
        except FileNotFoundError:
            return
        if info.get("type") != "directory" or info.get("islink"):
            self._remove_keys([path], [])
            return
        entries = self._guard(self.fs.find, path, withdirs=True, detail=True)
        links = [p for p, i in entries.items() if i.get("islink") and p != path]
        files, dirs = [], []
        for p, i in entries.items():
            if any(p.startswith(f"{link}/") for link in links):
                continue  # beneath a link (a wrapped local filesystem): not ours to delete
            is_dir = i.get("type") == "directory" and not i.get("islink")
            (dirs if is_dir else files).append(p)
        self._remove_keys(files, dirs if path in dirs else [*dirs, path])

    def _remove_keys(self, files: list[str], dirs: list[str]) -> None:
        """Delete exactly ``files``, then the directories ``dirs`` if the filesystem still has
        them (object stores have none once their keys are gone; ``memory://`` keeps those made
        by ``makedirs``)."""
        for path in files:
            try:
                self._guard(self.fs.rm_file, path)
            except FileNotFoundError:
                pass
        if not dirs or not self._guard(self.fs.exists, min(dirs, key=len)):
            return
        for path in sorted(dirs, key=lambda p: -p.count("/")):  # deepest first
            try:
                self._guard(self.fs.rmdir, path)
            except FileNotFoundError:
                pass

    def remove_files(self, directory: str, names: list[str]) -> None:
        """Delete exactly the files ``names`` (paths relative to ``directory``), then the
        subdirectories they leave empty and ``directory`` itself if it is empty. No listing and
        no pattern is ever involved, so only what was named goes (also when another writer
        shares the directory), and a missing file is fine. On local disks a symbolic link on
        the way from the prefix to ``directory`` is deleted itself, as :meth:`remove` does."""
        subdirs = sorted({posixpath.dirname(n) for n in names if "/" in n},
                         key=lambda d: -d.count("/"))
        if self.is_local:
            if _first_link(self.root, directory) is not None:
                _remove_local(self.root, directory)
                return
            for name in names:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(f"{directory}/{name}")
            for sub in [*(f"{directory}/{d}" for d in subdirs), directory]:
                with contextlib.suppress(FileNotFoundError, OSError):
                    os.rmdir(sub)  # ENOTEMPTY: something unnamed is there; it stays
            localio.fsync_dir(posixpath.dirname(directory))
            return
        for name in names:
            with contextlib.suppress(FileNotFoundError):
                self._guard(self.fs.rm_file, f"{directory}/{name}")
        if not self._guard(self.fs.exists, directory):  # an object store: no directories left
            return
        for sub in [*(f"{directory}/{d}" for d in subdirs), directory]:
            with contextlib.suppress(FileNotFoundError, OSError):
                if not self.fs.ls(sub, detail=False):  # memory://, wrapped local disks
                    self.fs.rmdir(sub)

    def modified(self, path: str) -> float | None:
        """When file ``path`` was last written, as a POSIX timestamp by the filesystem's (or
        object store's) clock; None if it does not say.

        Raises:
            CheckpointNotFoundError: there is no such file.
        """
        try:
            if self.is_local:
                return os.lstat(path).st_mtime
            info = self._guard(self.fs.info, path)
        except (FileNotFoundError, NotADirectoryError) as exc:  # nothing there
            raise CheckpointNotFoundError(f"{path} does not exist") from exc
        for key in ("mtime", "LastModified", "last_modified", "updated", "created"):
            value = info.get(key)
            if isinstance(value, datetime.datetime):
                return value.timestamp()
            if isinstance(value, (int, float)):
                return float(value)
            if isinstance(value, str):
                with contextlib.suppress(ValueError):
                    return datetime.datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
        return None


def _remove_local(root: str, path: str) -> None:
    """Delete ``path`` on a local disk without following a symbolic link: if ``path`` or a
    directory between ``root`` and it is a link, that link is deleted instead (what it points
    to, possibly outside the prefix, is left alone)."""
    link = _first_link(root, path)
    if link is not None:
        logger.warning("%s is a symbolic link: deleting the link itself, not what it points to "
                       "(%s), instead of %s", link, os.path.realpath(link), path)
        path = link
    try:
        is_dir = stat.S_ISDIR(os.lstat(path).st_mode)
        if is_dir:
            shutil.rmtree(path)  # removes links inside it, never follows them
        else:
            os.unlink(path)
    except FileNotFoundError:
        return
    localio.fsync_dir(posixpath.dirname(path))


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
        except (FileNotFoundError, NotADirectoryError):
            return None
    return None
