"""Where checkpoints live: a checkpoint prefix on some filesystem, and the contract of the few
file operations the commit protocol needs. One class per backend implements it:

* :class:`~caffe2ckpt.fs.local.LocalLocation`: a local disk, through ``os`` with the Linux fast
  paths of :mod:`caffe2ckpt.fs.localio`: real durability (each file flushed on the descriptor it
  was written through, every new directory entry fsync'ed), exclusive creates by ``O_EXCL`` /
  ``mkdir`` / ``link``, reads that never follow a symbolic link below the prefix;
* :class:`~caffe2ckpt.fs.remote.FsspecLocation`: any other fsspec filesystem (wrappers other
  than ``DirFileSystem``, sftp, ...), through its own API; an exclusive create is
  ``open(path, "xb")``;
* :class:`~caffe2ckpt.fs.remote.ObjectStoreLocation` (``s3://``, ``gs://``): the same, and its
  bucket is checked once (object stores have no directories);
* :class:`~caffe2ckpt.fs.remote.MemoryLocation` (``memory://``): fsspec's exclusive create there
  is not atomic, so it is a check and a whole-file write under one process lock.

``Location(url, storage_options, filesystem)`` picks the class from the filesystem, and from the
filesystem *underneath* fsspec's ``DirFileSystem`` (given as ``filesystem=`` or as a
``dir::<url>`` URL): that wrapper only joins its root to every path, so the location works on
the inner filesystem at the joined path, with the inner filesystem's class. A wrapped s3fs is
then an object store (exclusive creates by ``If-None-Match`` PUT, exact-key deletes, and the
``<path>/`` key of an emptied directory deleted where the store keeps one, as SeaweedFS does),
and a wrapped local disk a local disk (creates by hard link, durability). Other wrappers (a
cache, a logging or fault-injecting layer) may change what each call does, so they are used as
they are, through :class:`~caffe2ckpt.fs.remote.FsspecLocation`.

Capabilities: ``is_local`` (os-level I/O and durability; everything else has nothing to flush);
``atomic_creates`` (:meth:`Location.create_exclusive` publishes a file whole; where it does not,
:meth:`Location.read_created_json` gives a file being created time to be complete). Nothing in
the contract relies on a rename.

Prefixes: a local path may contain ``.`` and ``..`` segments; they are resolved the way the
operating system resolves them (``os.path.realpath``) before anything is written, so nothing
lands outside the resolved prefix and no directory named in a ``..`` step is created. A URL of
any other filesystem (``memory://``, ``s3://``, ...) must not contain ``.``, ``..`` or empty
segments, nor be empty: object stores keep such segments as literal key parts, while HTTP
clients and other tools may resolve them, so the same URL could name two different places. They
are refused with :class:`InvalidLocationError`.

Errors (see :mod:`caffe2ckpt.fs.clienterrors`): a filesystem failure that is not an ``OSError``
(e.g. botocore's ``NoCredentialsError``, which s3fs passes through), and the ``OSError`` s3fs
makes of an answer rejecting the credentials (``SignatureDoesNotMatch``, ``InvalidAccessKeyId``,
``AccessDenied``, ``InvalidToken``, ``ExpiredToken``, a bare 403), are re-raised naming the
prefix: missing or rejected credentials as :class:`~caffe2ckpt.errors.StorageCredentialsError`
(an :class:`InvalidLocationError`), other configuration problems (profile, region, parameters,
storage options the filesystem does not take) as :class:`InvalidLocationError`, anything else
(e.g. ``EndpointConnectionError`` after s3fs's retries) as an ``OSError`` (``EIO``), so callers
see an I/O failure, not corruption. A path under a file counts as missing, like a missing one.

Reads of metadata take a size ``limit`` and never read more than that. This package is the only
code that turns URLs into filesystems; it does not import zarr or prefect.
"""

from __future__ import annotations

import json
import posixpath
import re
import reprlib
import time
from collections.abc import Callable
from concurrent.futures import Executor
from typing import Any

import fsspec
from fsspec.implementations.dirfs import DirFileSystem
from fsspec.implementations.local import LocalFileSystem
from fsspec.implementations.memory import MemoryFileSystem

from caffe2ckpt.errors import CheckpointError, InvalidLocationError
from caffe2ckpt.fs import localio, strictjson
from caffe2ckpt.fs.clienterrors import credentials_rejected, is_credentials_error, translate
from caffe2ckpt.fs.prefixurl import canonical, check_secrets, logs_in_from_url
from caffe2ckpt.urls import public_url, redact

__all__ = ["CREATE_GRACE", "Location", "canonical_prefix", "register_source", "resolve_source"]

_OBJECT_STORES = frozenset({"s3", "s3a", "gs", "gcs"})

# Seconds after it was written during which a file made by ``create_exclusive`` that does not
# parse is taken for one still being created, where creates are not atomic (see
# Location.read_created_json). A create is one small write and a close: milliseconds, seconds
# on a slow link; the grace also covers a writer stalled that long (paused, swapping).
CREATE_GRACE = 10.0
# what a file cut short (empty, or a prefix of one JSON object) fails to parse with
_INCOMPLETE = (json.JSONDecodeError, UnicodeDecodeError)


# Where a checkpoint prefix may come from besides a path or URL: resolvers that turn a source
# (e.g. a Prefect storage block, or a "prefect-block://<type>/<name>" reference) into a URL and
# its storage options, or return None for a source they do not know. caffe2ckpt.prefect
# registers one when it is imported.
SourceResolver = Callable[[Any], "tuple[str, dict[str, Any]] | None"]
BLOCK_REFERENCE = "prefect-block://"  # what caffe2ckpt.prefect.blocks resolves
_SOURCES: list[SourceResolver] = []


def register_source(resolver: SourceResolver) -> None:
    """Accept the sources ``resolver`` knows wherever a checkpoint prefix is taken."""
    if resolver not in _SOURCES:
        _SOURCES.append(resolver)


def resolve_source(url: Any, storage_options: dict[str, Any] | None = None
                   ) -> tuple[str, dict[str, Any] | None]:
    """``(url, storage_options)`` for a checkpoint prefix given as a path or URL, or as a
    source a registered resolver knows (its options first, ``storage_options`` over them).

    Raises:
        InvalidLocationError: ``url`` is neither a string nor a known source.
    """
    for resolver in tuple(_SOURCES):
        found = resolver(url)
        if found is not None:
            resolved, options = found
            merged = {**options, **(storage_options or {})}
            return resolved, merged or None
    if isinstance(url, str) and url.startswith(BLOCK_REFERENCE):
        raise InvalidLocationError(
            f"checkpoint prefix {url!r} names a Prefect block: it is read once "
            "caffe2ckpt.prefect is imported (the caffe2ckpt command: with PREFECT_API_URL set "
            "to the server holding the block)")
    if isinstance(url, str):
        return url, storage_options
    raise InvalidLocationError(
        f"a checkpoint prefix must be a path or URL (a str), or a storage block once its "
        f"integration is imported (Prefect blocks: import caffe2ckpt.prefect); got "
        f"{reprlib.repr(url)} (of type {type(url).__name__})")


def _resolve(url: str, storage_options: dict[str, Any] | None,
             filesystem: fsspec.AbstractFileSystem | None) -> tuple[Any, str]:
    """The filesystem and the path on it that ``url`` names."""
    _check_url(url)
    if filesystem is not None:
        return _see_through(url, filesystem, filesystem._strip_protocol(url))
    try:
        fs, path = fsspec.core.url_to_fs(url, **(storage_options or {}))
    except CheckpointError:
        raise
    except Exception as exc:  # unknown protocol, missing package, bad options
        if is_credentials_error(exc):
            raise translate(url, exc) from exc
        raise InvalidLocationError(
            f"cannot open checkpoint prefix {public_url(url)!r}: {type(exc).__name__}: "
            f"{redact(str(exc), url)}{_install_hint(url, exc)}") from exc
    return _see_through(url, fs, path)


def _check_url(url: str) -> None:
    """Refuse what cannot be a prefix before any filesystem is opened (see the module
    docstring)."""
    if not isinstance(url, str) or not url.strip():
        raise InvalidLocationError(f"a checkpoint prefix must be a non-empty string, got {url!r}")
    if "\x00" in url:
        raise InvalidLocationError(f"checkpoint prefix {public_url(url)!r} contains a NUL "
                                   "character")
    _check_scheme(url)
    check_secrets(url)


def canonical_prefix(url: Any, storage_options: dict[str, Any] | None = None) -> str:
    """The canonical URL of the prefix ``url`` names (:attr:`Location.canonical_url`: how events
    name it), without connecting to the server of a filesystem that logs in to one (ftp, sftp).

    Raises:
        InvalidLocationError: ``url`` cannot be a checkpoint prefix.
    """
    url, storage_options = resolve_source(url, storage_options)
    _check_url(url)
    protocol = url.partition("://")[0].lower() if "://" in url else ""
    if "::" in url or not logs_in_from_url(protocol):
        return Location(url, storage_options).canonical_url
    cls = fsspec.get_filesystem_class(protocol)
    return canonical(cls.protocol, checked_root(public_url(url), cls._strip_protocol(url)), url)


# the extras that bring a scheme's filesystem package
_EXTRAS = {"s3": "s3", "s3a": "s3"}


def _install_hint(url: str, exc: Exception) -> str:
    """For a missing filesystem package that an extra of caffe2ckpt brings: how to install it."""
    extra = _EXTRAS.get(url.partition("://")[0].lower()) if "://" in url else None
    if extra is None or not isinstance(exc, ImportError):
        return ""
    return f' (pip install "caffe2ckpt[{extra}]")'


def _see_through(url: str, fs: Any, path: str) -> tuple[Any, str]:
    """The filesystem under any ``DirFileSystem`` layers of ``fs``, and the path on it that
    ``path`` on ``fs`` names (joined exactly as the wrapper joins it), so the backend class is
    the inner filesystem's (see the module docstring). Any other filesystem is returned as it
    is."""
    while isinstance(fs, DirFileSystem):
        try:
            path, fs = fs._join(path), fs.fs
        except ValueError as exc:  # a path climbing out of the wrapper's root (local disks)
            raise InvalidLocationError(f"checkpoint prefix {public_url(url)!r}: {exc}") from exc
    return fs, path


# a scheme and one slash ("s3:/bucket"): a local path no one means; "<scheme>://" with HTTP(S)
_ONE_SLASH = re.compile(r"([A-Za-z][A-Za-z0-9+.-]+):/(?!/)")
_READ_ONLY = frozenset({"http", "https"})


def _check_scheme(url: str) -> None:
    """Refuse URLs that cannot be what the user meant: ``s3:/x`` (one slash: read as a local
    folder named ``s3:``) and ``http(s)://`` (fsspec's HTTP filesystem cannot list or write)."""
    one = _ONE_SLASH.match(url)
    if one:
        scheme, fixed = one.group(1), public_url(f"{one.group(1)}://{url[one.end():]}")
        raise InvalidLocationError(
            f"a checkpoint prefix has one slash after '{scheme}:': it would be a local folder "
            f"named '{scheme}:'; did you mean {fixed!r}?")
    scheme = url.partition("://")[0].lower() if "://" in url else ""
    if scheme in _READ_ONLY:
        raise InvalidLocationError(
            f"checkpoint prefix {public_url(url)!r}: {scheme}:// cannot be a checkpoint prefix "
            "(an HTTP server can be neither listed nor written); use a local folder, s3://, gs:// or "
            "memory://, or the S3 endpoint of an object store with --storage-options "
            "'{\"client_kwargs\": {\"endpoint_url\": \"http://...\"}}'")


def _backend(fs: Any) -> type[Location]:
    from caffe2ckpt.fs.local import LocalLocation
    from caffe2ckpt.fs.remote import FsspecLocation, MemoryLocation, ObjectStoreLocation

    if type(fs) is LocalFileSystem:  # a plain local disk; wrappers go through fsspec
        return LocalLocation
    if isinstance(fs, MemoryFileSystem):
        return MemoryLocation
    protocols = fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)
    return ObjectStoreLocation if _OBJECT_STORES & set(protocols) else FsspecLocation


def checked_root(url: str, root: str) -> str:
    """The path ``root`` of the prefix ``url`` (public) on a filesystem other than a local disk,
    checked: no empty, ``.`` or ``..`` segments (see the module docstring)."""
    segments = root.strip("/").split("/")
    if not root.strip("/"):
        raise InvalidLocationError(
            f"checkpoint prefix {url!r} names no path on its filesystem (e.g. "
            "'s3://bucket/run', 'memory://run')")
    bad = sorted({s for s in segments if s in ("", ".", "..")})
    if bad:
        shown = ", ".join(repr(s) if s else "empty" for s in bad)
        raise InvalidLocationError(
            f"checkpoint prefix {url!r} has {shown} path segments: on this filesystem "
            "they would be literal key parts that other tools may resolve differently; "
            "write the normalised path")
    return root.rstrip("/")


class Location:
    """A checkpoint prefix on some filesystem (the contract; see the module docstring).

    Args:
        url: a local path or an fsspec URL (``memory://runs/a``, ``s3://bucket/run``), or a
            source a registered resolver knows (:func:`resolve_source`: a Prefect block).
        storage_options: passed to the fsspec filesystem (credentials, endpoint, ...).
        filesystem: use this fsspec filesystem instance instead of one made from the URL's
            protocol; ``url`` is then a path on it.
    """

    is_local = False  # os-level I/O: real durability and no-follow reads
    atomic_creates = False  # create_exclusive publishes a file whole (never seen incomplete)
    # every object written or read is a request of its own (object stores): write few, large
    per_object_requests = False

    def __new__(cls, url: str | None = None, storage_options: dict[str, Any] | None = None,
                filesystem: fsspec.AbstractFileSystem | None = None) -> Location:
        if cls is not Location:  # a backend's own class (also when unpickling)
            return super().__new__(cls)
        url, storage_options = resolve_source(url, storage_options)
        fs, root = _resolve(url, storage_options, filesystem)
        location = super().__new__(_backend(fs))
        location._resolved = (fs, root)
        return location

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None,
                 filesystem: fsspec.AbstractFileSystem | None = None) -> None:
        resolved = self.__dict__.pop("_resolved", None)
        url, storage_options = resolve_source(url, storage_options)
        self.fs, root = resolved or _resolve(url, storage_options, filesystem)
        self.url = public_url(url)  # what every message names (the filesystem has the rest)
        self._given = url  # only to hide its secrets in a client's messages (_guard)
        self.root = self._checked_root(str(root))

    def _checked_root(self, root: str) -> str:
        """The prefix's path on the filesystem (checked: see the module docstring)."""
        return checked_root(self.url, root)

    def _guard(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """Call filesystem method ``fn``; a failure that is not an OSError (e.g. botocore's
        ``NoCredentialsError``), or an OSError for credentials the store rejected, is re-raised
        naming the prefix (see the module docstring)."""
        try:
            return fn(*args, **kwargs)
        except CheckpointError:
            raise
        except Exception as exc:
            if isinstance(exc, OSError) and not credentials_rejected(exc):
                raise
            raise translate(self._given, exc) from exc

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"

    def path(self, *parts: str) -> str:
        """The filesystem path of ``parts`` under the prefix."""
        return posixpath.join(self.root, *parts)

    @property
    def canonical_url(self) -> str:
        """The prefix as one URL whatever form it was given in (a relative path, ``file://``,
        a trailing slash), without credentials (:mod:`caffe2ckpt.fs.prefixurl`)."""
        return canonical(self.fs.protocol, self.root, self._given)

    def display(self, *parts: str) -> str:
        """A user-facing URL for ``parts`` under the prefix, or for one filesystem path under
        it (for messages and artifacts)."""
        if len(parts) == 1 and (parts[0] == self.root or parts[0].startswith(self.root + "/")):
            parts = (parts[0][len(self.root):].lstrip("/"),)
        parts = tuple(p for p in parts if p)
        return posixpath.join(self.url.rstrip("/"), *parts) if parts else self.url

    # -- the contract: reads ---------------------------------------------------------------------

    def read_bytes(self, path: str, *, limit: int | None = None) -> bytes:
        """The content of file ``path`` (at most ``limit`` bytes are read, if given).

        Raises:
            CheckpointNotFoundError: there is no such file.
            ValueError: it is larger than ``limit``, or (locally) not a regular file or reached
                through a symlink; the message names the file.
        """
        raise NotImplementedError

    def size(self, path: str) -> int | None:
        """The size of file ``path`` (None if the filesystem does not say), checked like
        :meth:`read_bytes` checks a file.

        Raises:
            CheckpointNotFoundError: there is no such file.
            ValueError: (locally) it is not a regular file, or is reached through a symlink.
        """
        raise NotImplementedError

    def sizes_under(self, path: str) -> dict[str, int] | None:
        """The size of every file below ``path`` by its path, if one listing gives them all
        (object stores); None: ask :meth:`size` file by file."""
        return None

    def read_exact(self, path: str, out: memoryview, trailer: int) -> bytes:
        """Read file ``path`` into ``out`` and return its last ``trailer`` bytes. Nothing is
        written into ``out`` (so none of its pages is touched) before the file's size is known
        to be ``len(out) + trailer``.

        Raises:
            CheckpointNotFoundError: no such file.
            ValueError: the file's size is not ``len(out) + trailer``, or (locally) it is not a
                regular file reached without a symlink below the prefix.
        """
        raise NotImplementedError

    def list_names(self, path: str) -> list[str]:
        """Base names of the entries directly under ``path`` ([] if it does not exist)."""
        raise NotImplementedError

    def list_names_after(self, path: str, after: str) -> list[str]:
        """Base names of the files directly under ``path`` that sort after ``after``, sorted
        (object stores: one listing that starts there, whatever came before)."""
        return sorted(n for n in self.list_names(path) if n > after)

    def exists(self, path: str) -> bool:
        """Whether ``path`` exists, as a file or a directory. Only "no such file" answers
        False: any other error (EIO, EACCES, a timeout) is raised, since callers decide on it
        (a fence check that cannot see the fence must not read as "not fenced")."""
        raise NotImplementedError

    def file_exists(self, path: str) -> bool:
        """Whether file ``path`` exists (the fence check and record checks: one request on
        object stores, where :meth:`exists` of a missing key also lists ``<path>/``)."""
        return self.exists(path)

    def modified(self, path: str) -> float | None:
        """When file ``path`` was last written, as a POSIX timestamp by the filesystem's (or
        object store's) clock; None if it does not say.

        Raises:
            CheckpointNotFoundError: there is no such file.
        """
        raise NotImplementedError

    def read_created_json(self, path: str) -> Any:
        """The strict JSON content of file ``path``, made by :meth:`create_exclusive` (a commit
        record, a run log entry, the root metadata).

        Where creates are atomic (``atomic_creates``) a reader sees such a file whole or not at
        all. Elsewhere (fsspec's local filesystem behind a wrapper, sftp, smb, hdfs: ``"xb"``
        makes the file empty at open and fills it at close), a file being created is visible
        empty or cut short for as long as its writer takes, and must not be taken for damage: a
        fence check would call it a newer run. Every writer writes one JSON object, of which no
        proper prefix parses; so a file that does not parse as JSON and is younger than
        :data:`CREATE_GRACE` seconds (by its modification time) may be one being created: it is
        read again, with growing pauses, until it parses, disappears, or is that old. Waiting
        is bounded by :data:`CREATE_GRACE` seconds whatever the clocks say, and a file that is
        older (a writer that died between open and close, a stray or damaged file) is refused
        at once, as before. A file that parses but is not valid is damage at once everywhere.

        Raises:
            CheckpointNotFoundError: there is no such file (also: it went while waiting).
            ValueError: it is not strict JSON (also after the grace), or is larger than
                :data:`~caffe2ckpt.fs.strictjson.MAX_BYTES`.
        """
        deadline, pause = None, 0.005
        while True:
            raw = self.read_bytes(path, limit=strictjson.MAX_BYTES)
            try:
                return strictjson.loads(raw)
            except _INCOMPLETE as exc:
                if deadline is None:
                    deadline = self._creation_deadline(path)
                if time.monotonic() >= deadline:
                    raise _incomplete(exc, waited=pause > 0.005) from exc
            time.sleep(pause)
            pause = min(2 * pause, 0.2)

    def _creation_deadline(self, path: str) -> float:
        """Until when (``time.monotonic()``) file ``path``, which does not parse, may still be
        being created (see :meth:`read_created_json`): never where creates are atomic; else
        until it is :data:`CREATE_GRACE` seconds old (the whole grace if the filesystem gives
        no time, never more)."""
        if self.atomic_creates:
            return -float("inf")
        stamp = self.modified(path)
        age = 0.0 if stamp is None else time.time() - stamp
        return time.monotonic() + min(max(CREATE_GRACE - age, 0.0), CREATE_GRACE)

    # -- the contract: writes --------------------------------------------------------------------

    def makedirs(self, path: str, *, batch: localio.SyncBatch | None = None) -> list[str]:
        """Create directory ``path`` and its missing parents, durably: on local disks the
        parent of every directory this call created is fsync'ed (with ``batch``, when
        :meth:`make_durable` flushes it). Every writer creates directories through here, so
        none is left to chance on a power failure. Returns the directories created, outermost
        first (local disks; elsewhere [])."""
        raise NotImplementedError

    def create_exclusive(self, path: str, data: bytes, *,
                         batch: localio.SyncBatch | None = None) -> None:
        """Write ``data`` to a new file ``path`` in one step, durably (with ``batch``, its
        directory's entry becomes durable when :meth:`make_durable` flushes the batch; the
        file itself is flushed before it gets its name).

        Every caller's ``data`` is unique to its writer (a save id, a timestamp), so a file
        holding exactly ``data`` is this call's own. On object stores an exclusive create is an
        ``If-None-Match: *`` PUT, and "exists" is decided from the store's 412 to it, whatever
        the client library makes of that answer. When the first PUT is applied but its answer
        is lost, the client retries and gets 412, although the object is this call's: so on
        every backend but a local disk (``O_EXCL``/``link``, no retries), "exists" is settled
        by reading the file back (at most ``len(data) + 1`` bytes); if it holds exactly
        ``data``, the create succeeded (a failure to read it back is raised as it is).

        Raises:
            FileExistsError: ``path`` already exists, holding other bytes; nothing was changed.
        """
        raise NotImplementedError

    def create_group(self, path: str, first: str, data: bytes, *,
                     batch: localio.SyncBatch | None = None) -> None:
        """Take directory ``path`` for one writer: create it with its file ``first`` holding
        ``data``, or raise ``FileExistsError`` if anyone took it before (also an interrupted
        writer or a removal in progress: the path is then never shared). The file is flushed
        with ``batch`` (local disks)."""
        self.create_exclusive(f"{path}/{first}", data)

    def replace_file(self, path: str, data: bytes) -> None:
        """Write ``data`` to ``path`` whole, replacing what is there (a reader sees the old or
        the new content, never a mix), durably on local disks."""
        raise NotImplementedError

    def write_file(self, path: str, buffers: list[Any], *,
                   batch: localio.SyncBatch | None = None, exclusive: bool = False) -> None:
        """Write the concatenation of ``buffers`` to ``path`` (parents must exist locally);
        with ``exclusive``, a file that exists is ``FileExistsError`` (local disks).

        On local disks the file is made durable on the descriptor it was written through:
        ``fdatasync``'ed before returning, or with ``batch`` handed over open (its write-out
        started) for :meth:`make_durable` to flush. Elsewhere ``batch`` is ignored.
        """
        raise NotImplementedError

    def sync_batch(self) -> localio.SyncBatch | None:
        """A batch for :meth:`write_file` and :meth:`make_durable` on local disks; None
        elsewhere (nothing to flush there)."""
        return None

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

    # -- the contract: deletes -------------------------------------------------------------------

    def remove(self, path: str) -> None:
        """Delete file or tree ``path``, exactly; a missing path is not an error (any other is).

        Never through fsspec's ``rm``: it expands glob characters, so removing node ``w[12]``'s
        group would also remove ``w1``'s and ``w2``'s. A symbolic link is deleted itself, never
        followed (on local disks also one on the way from the prefix to ``path``), so nothing
        outside the prefix is ever deleted.
        """
        raise NotImplementedError

    def remove_files(self, directory: str, names: list[str]) -> None:
        """Delete exactly the files ``names`` (paths relative to ``directory``), then the
        subdirectories they leave empty and ``directory`` itself if it is empty. No listing and
        no pattern is ever involved, so only what was named goes, and a missing file is fine."""
        raise NotImplementedError


def _incomplete(exc: ValueError, *, waited: bool) -> ValueError:
    """The error of a file that does not parse; after a wait, saying it was not being created."""
    if not waited:
        return exc
    return ValueError(f"{exc} (still so {CREATE_GRACE:g} s after it was written: not a file "
                      "being created)")


def subdirectories(names: list[str]) -> list[str]:
    """The directories of relative paths ``names`` and the directories above them, deepest
    first."""
    dirs = set()
    for name in names:
        parent = posixpath.dirname(name)
        while parent:
            dirs.add(parent)
            parent = posixpath.dirname(parent)
    return sorted(dirs, key=lambda d: -d.count("/"))
