"""Where checkpoints live: a URL turned into an fsspec filesystem, plus the few file operations
the commit protocol needs (exclusive create, durable writes, listing, moves, deletes).

Local disks get real durability and atomic ``os.link``/``os.rename``; every other fsspec
filesystem (``memory://``, ``s3://``, ``gs://``, wrappers) goes through its own API, where an
exclusive create is ``open(path, "xb")`` (an ``If-None-Match`` PUT on S3) and nothing relies on
a rename being atomic.

Durability on local disks: every file is flushed on the descriptor it was written through, never
by a filesystem-wide ``syncfs()`` (which reports no write-back error before Linux 5.8, and after
that only once per filesystem, to whoever asks first). :meth:`Location.write_file` either
``fdatasync``'s the file before returning, or hands its open descriptor to a
:class:`~caffe2ckpt.localio.SyncBatch` (:meth:`Location.sync_batch`) that
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

Errors: a filesystem failure that is not an ``OSError`` (e.g. botocore's ``NoCredentialsError``,
which s3fs passes through untranslated) is re-raised naming the prefix: configuration problems
(credentials, profile, region, parameters, storage options the filesystem does not take) as
:class:`InvalidLocationError`, anything else (e.g. ``EndpointConnectionError`` after s3fs's
retries) as an ``OSError`` (``EIO``), so callers see an I/O failure, not corruption.

This is the only module that turns URLs into filesystems. It does not import zarr or prefect.
"""

from __future__ import annotations

import errno
import os
import posixpath
import shutil
import uuid
from concurrent.futures import Executor
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

from caffe2ckpt import localio
from caffe2ckpt.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    InvalidLocationError,
)

__all__ = ["Location"]


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
                raise InvalidLocationError(
                    f"cannot open checkpoint prefix {url!r}: {type(exc).__name__}: {exc}"
                ) from exc
        # Only a plain local filesystem gets os-level fast paths; wrappers go through fsspec.
        self.is_local = type(self.fs) is LocalFileSystem
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
            raise self._translate(exc) from exc

    def _translate(self, exc: Exception) -> Exception:
        name = type(exc).__name__
        if isinstance(exc, TypeError) or any(  # a TypeError here comes from bad options
                word in name for word in ("Credential", "Profile", "Region", "ParamValidation",
                                          "Unsigned", "Token", "Config")):
            return InvalidLocationError(
                f"cannot use checkpoint prefix {self.url!r}: {name}: {exc} (check the "
                "credentials, region and storage_options of this filesystem)")
        return OSError(errno.EIO, f"checkpoint prefix {self.url!r}: {name}: {exc}")

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

    def read_bytes(self, path: str) -> bytes:
        """The content of file ``path``.

        Raises:
            CheckpointNotFoundError: there is no such file.
        """
        try:
            if self.is_local:
                with open(path, "rb") as f:
                    return f.read()
            return self._guard(self.fs.cat_file, path)
        except FileNotFoundError as exc:
            raise CheckpointNotFoundError(f"{path} does not exist") from exc

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

    def makedirs(self, path: str) -> list[str]:
        """Create directory ``path`` and its missing parents; return those this call created,
        outermost first, on local disks (their parents need an fsync for them to last), else
        []."""
        if not self.is_local:
            self._guard(self.fs.makedirs, path, exist_ok=True)
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
            raise FileExistsError(errno.EEXIST, "exists and is not a directory", path)
        return created

    def create_exclusive(self, path: str, data: bytes) -> None:
        """Write ``data`` to a new file ``path`` in one step, durably.

        Raises:
            FileExistsError: ``path`` already exists; nothing was changed.
        """
        directory = posixpath.dirname(path)
        self.makedirs(directory)
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
        localio.fsync_dir(directory)

    def write_file(self, path: str, buffers: list[Any], *,
                   batch: localio.SyncBatch | None = None) -> None:
        """Write the concatenation of ``buffers`` to ``path`` (parents must exist locally).

        On local disks the file is made durable on the descriptor it was written through:
        ``fdatasync``'ed before returning, or with ``batch`` handed over open (its write-out
        started) for :meth:`make_durable` to flush. Elsewhere ``batch`` is ignored.
        """
        if not self.is_local:
            data = buffers[0] if len(buffers) == 1 else b"".join(memoryview(b) for b in buffers)
            self._guard(self.fs.pipe_file, path,
                        bytes(data) if not isinstance(data, bytes) else data)
            return
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
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
            ValueError: the file's size is not ``len(out) + trailer``.
        """
        if not self.is_local:
            expected = len(out) + trailer
            data = self.read_bytes(path)
            if len(data) != expected:
                raise ValueError(f"{len(data)} bytes where {expected} were expected")
            out[:] = memoryview(data)[: len(out)]
            return data[len(out):]
        try:
            return localio.read_into(path, out, trailer)
        except FileNotFoundError as exc:
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
        """Delete file or tree ``path``; a missing path is not an error (any other is)."""
        if self.is_local:
            if os.path.isdir(path) and not os.path.islink(path):
                _rmtree_local(path)
            else:
                try:
                    os.unlink(path)
                except FileNotFoundError:
                    return
            localio.fsync_dir(posixpath.dirname(path))
            return
        try:
            # not fs.isdir(): it answers False on any error, which would hide an I/O failure
            kind = self._guard(self.fs.info, path).get("type")
        except FileNotFoundError:
            return
        try:
            if kind == "directory":
                self._guard(self.fs.rm, path, recursive=True)
            else:
                self._guard(self.fs.rm_file, path)
        except FileNotFoundError:
            return

    def move(self, src: str, dst: str) -> None:
        """Move tree ``src`` to ``dst``, which must not exist. Atomic only on local disks.

        Raises:
            FileExistsError: ``dst`` exists (fsspec would move ``src`` *into* it).
        """
        if self.exists(dst):
            raise FileExistsError(f"cannot move {src} to {dst}: the destination exists")
        self.makedirs(posixpath.dirname(dst))
        if self.is_local:
            os.rename(src, dst)
            localio.fsync_dir(posixpath.dirname(dst))
            localio.fsync_dir(posixpath.dirname(src))
            return
        # Copy through this process rather than fs.mv: object stores have no rename, and their
        # server-side copy mishandles keys with '%' (escaped blob names) in s3fs.
        root = src.rstrip("/")
        for path in self._guard(self.fs.find, root):
            self._guard(self.fs.pipe_file, dst + path[len(root):],
                        self._guard(self.fs.cat_file, path))
        self._guard(self.fs.rm, root, recursive=True)


def _rmtree_local(path: str) -> None:
    try:
        shutil.rmtree(path)
    except FileNotFoundError:
        return
