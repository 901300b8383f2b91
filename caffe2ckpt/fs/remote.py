"""Checkpoint prefixes on fsspec filesystems other than a plain local disk: object stores,
``memory://`` and wrappers. Everything goes through the filesystem's own API, and nothing
relies on a rename being atomic; there is nothing to flush (a PUT is durable when it returns).

* :class:`FsspecLocation`: the general case. An exclusive create is ``open(path, "xb")``; on
  S3 (also through a wrapper of s3fs) that is an ``If-None-Match`` PUT, and the store's 412 means
  "exists" (s3fs says ``FileExistsError`` only when the answer names the condition, as AWS's
  does). "Exists" is then settled by reading the file back: its own bytes mean this call's
  create, applied and answered "exists" on a retry (see :meth:`Location.create_exclusive`).
  Such a create is not assumed atomic (fsspec's local filesystem behind a wrapper makes the file
  empty at open and fills it at close; so do sftp, smb, hdfs): readers give a file being created
  time (:meth:`~caffe2ckpt.fs.location.Location.read_created_json`). Behind a wrapper the
  location cannot see through, an object store's emptied directory (SeaweedFS keeps it, s3fs's
  ``rmdir`` refuses it) is removed by its ``<path>/`` key, as :class:`ObjectStoreLocation`
  removes it.
* :class:`ObjectStoreLocation` (``s3://``, ``gs://``, also behind fsspec's ``DirFileSystem``):
  object stores have no directories, and s3fs/gcsfs's ``makedirs`` of a key prefix only checks
  (and creates) the bucket, one request: a location does it once. Some keep a directory once
  its keys are deleted (SeaweedFS lists it as a common prefix): removals delete that too. A PUT
  publishes an object whole: creates are atomic.
* :class:`MemoryLocation` (``memory://``): one store per process, whose own ``"xb"`` open
  checks for the file, publishes it empty, then fills it, so two threads could both create one
  record. Exclusive creates here hold one process-wide lock and publish the file whole.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import posixpath
import threading
from typing import Any

from caffe2ckpt.errors import CheckpointNotFoundError
from caffe2ckpt.fs import localio, s3read
from caffe2ckpt.fs.clienterrors import precondition_failed, s3_answer
from caffe2ckpt.fs.location import Location, subdirectories

__all__ = ["FsspecLocation", "MemoryLocation", "ObjectStoreLocation"]

_MISSING = (FileNotFoundError, NotADirectoryError)


class FsspecLocation(Location):
    """A checkpoint prefix on an fsspec filesystem (see the module docstring)."""

    # -- reads -----------------------------------------------------------------------------------

    def read_bytes(self, path: str, *, limit: int | None = None) -> bytes:
        try:
            if limit is None:
                return self._guard(self.fs.cat_file, path)
            data = self._read_head(path, limit + 1)
        except _MISSING as exc:
            raise CheckpointNotFoundError(f"{path} does not exist") from exc
        if len(data) > limit:
            raise ValueError(f"{self.display(path)} is larger than the {limit} bytes such a "
                             "file may have")
        return data

    def _read_head(self, path: str, count: int) -> bytes:
        """The first ``count`` bytes of file ``path``, in one ranged GET: an object of any size
        costs at most ``count`` bytes of memory."""
        try:
            return self._guard(self.fs.cat_file, path, start=0, end=count)
        except FileNotFoundError:
            raise
        except OSError:  # S3 refuses any range of an empty object (416): is it empty?
            if self._guard(self.fs.info, path).get("size") == 0:
                return b""
            raise

    def size(self, path: str) -> int | None:
        try:
            size = self._guard(self.fs.info, path).get("size")
        except _MISSING as exc:
            raise CheckpointNotFoundError(f"{path} does not exist") from exc
        return None if size is None else int(size)

    def read_exact(self, path: str, out: memoryview, trailer: int) -> bytes:
        expected = len(out) + trailer
        try:
            data = self.read_bytes(path, limit=expected)
        except ValueError:  # larger: not read whole into memory
            raise _wrong_size(expected + 1, expected) from None
        if len(data) != expected:
            raise _wrong_size(len(data), expected)
        out[:] = memoryview(data)[: len(out)]
        return data[len(out):]

    def list_names(self, path: str) -> list[str]:
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
        try:  # not fs.exists, which answers False on any error
            self._guard(self.fs.info, path)
        except _MISSING:
            return False
        return True

    def modified(self, path: str) -> float | None:
        try:
            info = self._guard(self.fs.info, path)
        except _MISSING as exc:
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

    # -- writes ----------------------------------------------------------------------------------

    def makedirs(self, path: str, *, batch: localio.SyncBatch | None = None) -> list[str]:
        self._guard(self.fs.makedirs, path, exist_ok=True)
        return []

    def create_exclusive(self, path: str, data: bytes, *,
                         batch: localio.SyncBatch | None = None) -> None:
        self.makedirs(posixpath.dirname(path))
        try:
            self._guard(self._create_new, path, data)
        except FileExistsError:
            if not self._holds(path, data):
                raise
            # this call's own file: its create was applied, then answered "exists" (a retry)

    def _create_new(self, path: str, data: bytes) -> None:
        """Create file ``path`` holding ``data``; FileExistsError if it exists, also when an
        object store refused the ``If-None-Match`` PUT with 412 and s3fs said something else
        (also through a wrapper of s3fs)."""
        try:
            with self.fs.open(path, "xb") as f:
                f.write(data)
        except FileExistsError:
            raise
        except OSError as exc:
            if not precondition_failed(exc):
                raise
            raise FileExistsError(errno.EEXIST, f"{self.display(path)} exists (the store "
                                  f"refused the If-None-Match PUT: {exc})", path) from exc

    def _holds(self, path: str, data: bytes) -> bool:
        """Whether file ``path`` holds exactly ``data`` (at most ``len(data) + 1`` bytes read)."""
        try:
            return self._read_head(path, len(data) + 1) == data
        except _MISSING:
            return False

    def replace_file(self, path: str, data: bytes) -> None:
        self.makedirs(posixpath.dirname(path))
        self._guard(self.fs.pipe_file, path, data)

    def write_file(self, path: str, buffers: list[Any], *,
                   batch: localio.SyncBatch | None = None, exclusive: bool = False) -> None:
        data = buffers[0] if len(buffers) == 1 else b"".join(memoryview(b) for b in buffers)
        self._guard(self.fs.pipe_file, path, bytes(data) if not isinstance(data, bytes) else data)

    # -- deletes ---------------------------------------------------------------------------------

    def remove(self, path: str) -> None:
        """The exact tree is listed (``find`` does not glob) and its keys are deleted one by
        one; nothing beneath a link (a wrapped local filesystem) is touched."""
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
                continue  # beneath a link: not ours to delete
            is_dir = i.get("type") == "directory" and not i.get("islink")
            (dirs if is_dir else files).append(p)
        self._remove_keys(files, dirs if path in dirs else [*dirs, path])

    def _remove_keys(self, files: list[str], dirs: list[str]) -> None:
        """Delete exactly ``files``, then the directories ``dirs`` if the filesystem still has
        them (object stores have none once their keys are gone; ``memory://`` keeps those made
        by ``makedirs``)."""
        for path in files:
            with contextlib.suppress(FileNotFoundError):
                self._guard(self.fs.rm_file, path)
        if not dirs or not self._guard(self.fs.exists, min(dirs, key=len)):
            return
        for path in sorted(dirs, key=lambda p: -p.count("/")):  # deepest first
            with contextlib.suppress(FileNotFoundError):
                self._rmdir(path)

    def _rmdir(self, path: str) -> None:
        """Remove empty directory ``path``. If the filesystem refuses one that exists, it may be
        an object store behind a wrapper this class cannot see through (s3fs's ``rmdir`` refuses
        every directory that exists, and SeaweedFS's filer keeps an emptied one): a directory
        that lists empty is then removed by its ``<path>/`` key; the refusal stands if that
        does not remove it (a local disk has no such key)."""
        try:
            self._guard(self.fs.rmdir, path)
        except FileExistsError:
            if not self._remove_directory_key(path):
                raise

    def _remove_directory_key(self, path: str) -> bool:
        """Delete the key ``<path>/`` of directory ``path`` if it lists nothing; whether the
        directory is gone."""
        directory = path.rstrip("/")
        try:
            if [e for e in self._guard(self.fs.ls, directory, detail=False)
                    if e.rstrip("/") != directory]:
                return False  # not empty: nothing of it is deleted
            self._guard(self.fs.rm_file, f"{directory}/")
        except FileNotFoundError:
            return True
        except OSError:
            return False
        return not self.exists(directory)

    def remove_files(self, directory: str, names: list[str]) -> None:
        for name in names:
            with contextlib.suppress(FileNotFoundError):
                self._guard(self.fs.rm_file, f"{directory}/{name}")
        if not self._guard(self.fs.exists, directory):  # an object store: no directories left
            return
        for sub in [*(f"{directory}/{d}" for d in subdirectories(names)), directory]:
            with contextlib.suppress(FileNotFoundError, OSError):
                # memory://, wrapped local disks; SeaweedFS lists an empty one as itself
                if not [e for e in self.fs.ls(sub, detail=False) if e.rstrip("/") != sub]:
                    self._rmdir(sub)


class ObjectStoreLocation(FsspecLocation):
    """``s3://``, ``gs://``: the bucket is checked (and created if missing) once; a directory
    left empty is deleted as its key ``<path>/``."""

    per_object_requests = True
    _bucket_checked = False
    atomic_creates = True  # a PUT publishes an object whole

    def _rmdir(self, path: str) -> None:
        """Object stores built on a filesystem (SeaweedFS's filer) keep a directory whose keys
        were all deleted, and list it; deleting its key ``<path>/`` removes it there (a no-op if
        it is not empty) and elsewhere deletes nothing (or a zero-byte "folder" object). s3fs's
        own ``rmdir`` refuses any directory that exists."""
        self._guard(self.fs.rm_file, path.rstrip("/") + "/")

    def read_exact(self, path: str, out: memoryview, trailer: int) -> bytes:
        """On S3 each block of the answer is copied into ``out`` as it arrives
        (:mod:`~caffe2ckpt.fs.s3read`), not joined into one ``bytes`` first."""
        if not s3read.supported(self.fs):
            return super().read_exact(path, out, trailer)
        try:
            size, tail = self._guard(s3read.read_into, self.fs, path, out, trailer)
        except _MISSING as exc:
            raise CheckpointNotFoundError(f"{path} does not exist") from exc
        except s3read.Unsupported:
            return super().read_exact(path, out, trailer)
        except OSError as exc:  # S3 refuses a range starting at 0 only of an empty object
            if s3_answer(exc)[0] != 416:
                raise
            size, tail = 0, None
        if tail is None:
            raise _wrong_size(size, len(out) + trailer)
        return tail

    def file_exists(self, path: str) -> bool:
        try:  # a GET of the first byte: a missing key is one 404, never a listing
            self._read_head(path, 1)
        except _MISSING:
            return False
        return True

    def list_names_after(self, path: str, after: str) -> list[str]:
        """On S3 a listing that starts after ``after`` (``StartAfter``): what came before costs
        nothing, whatever the history's length."""
        if getattr(self.fs, "call_s3", None) is None:  # gcs and others: the general listing
            return super().list_names_after(path, after)
        prefix = f"{self.fs.split_path(path)[1].rstrip('/')}/"
        objects = self._list_objects(path, Delimiter="/", StartAfter=prefix + after)
        return sorted(key[len(prefix):] for key in objects)

    def sizes_under(self, path: str) -> dict[str, int] | None:
        """On S3 one listing (a page per 1,000 files) instead of a HEAD per file."""
        if getattr(self.fs, "call_s3", None) is None:
            return None
        bucket = self.fs.split_path(path)[0]
        return {f"{bucket}/{key}": size for key, size in self._list_objects(path).items()}

    def _list_objects(self, path: str, **options: str) -> dict[str, int]:
        """Keys below ``path`` (``ListObjectsV2``, every page) and their sizes."""
        bucket, key, _ = self.fs.split_path(path)
        kwargs: dict[str, str] = {"Bucket": bucket, "Prefix": f"{key.rstrip('/')}/", **options}
        found: dict[str, int] = {}
        while True:
            page = self._guard(self.fs.call_s3, "list_objects_v2", **kwargs)
            found.update((o["Key"], int(o["Size"])) for o in page.get("Contents", ()))
            if not page.get("IsTruncated"):
                return found
            kwargs["ContinuationToken"] = page["NextContinuationToken"]

    def makedirs(self, path: str, *, batch: localio.SyncBatch | None = None) -> list[str]:
        if not self._bucket_checked:
            self._guard(self.fs.makedirs, path, exist_ok=True)
            self._bucket_checked = True
        return []


def _wrong_size(size: int, expected: int) -> ValueError:
    """What :meth:`Location.read_exact` raises for a file of ``size`` bytes (any size above
    ``expected`` if it was not read whole)."""
    if size > expected:
        return ValueError(f"more than the {expected} bytes expected")
    return ValueError(f"{size} bytes where {expected} were expected")


# memory:// is one store per process: exclusive creates there hold this lock
_MEMORY_CREATES = threading.Lock()


class MemoryLocation(FsspecLocation):
    """``memory://``: exclusive creates under a process-wide lock, the file published whole."""

    atomic_creates = True

    def _create_new(self, path: str, data: bytes) -> None:
        with _MEMORY_CREATES:
            if self.exists(path):
                raise FileExistsError(errno.EEXIST, "file exists", path)
            self.fs.pipe_file(path, data)
