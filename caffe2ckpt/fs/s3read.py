"""Reading an S3 object straight into memory the caller owns (restores of chunk files).

s3fs's ``cat_file`` gathers the answer's blocks and joins them into one ``bytes``, which the
caller then copies into its array: every byte is copied twice after it leaves the socket, in
the client's CPU time, which on a 2-core machine it shares with the S3 server. :func:`read_into`
copies each block of the answer into the destination as it arrives (what raw s3fs pays for a
``cat``: one copy), and keeps nothing else: no buffer of the object's size besides the
destination.

The object's size is known from the answer's headers before any byte is written into the
destination, so a file that is too short or too long leaves the destination untouched (see
:meth:`caffe2ckpt.fs.location.Location.read_exact`). A request is retried as s3fs retries its
own (``_error_wrapper``: throttling, dropped connections, a body cut short), each attempt from
the start; a read that fails in the end may have written part of the destination (callers
discard it). It needs s3fs's coroutine API (``_call_s3``, ``loop``, ``_error_wrapper``), which
every s3fs this project supports has: :func:`supported` says whether a filesystem offers it,
and :class:`Unsupported` is raised if it turns out different (the caller then reads the
general way), never an error that reads as damage.
"""

from __future__ import annotations

import errno
import functools
import re
from typing import Any

from fsspec.asyn import sync

__all__ = ["Unsupported", "read_into", "supported"]

_CONTENT_RANGE = re.compile(r"bytes \d+-\d+/(\d+)")


class Unsupported(OSError):
    """s3fs's coroutine API is not what this module expects (a ``TypeError`` or
    ``AttributeError`` from it): read the general way instead."""


def supported(fs: Any) -> bool:
    """Whether ``fs`` is an s3fs filesystem (or one with its coroutine API)."""
    return (_retrying() is not None and callable(getattr(fs, "_call_s3", None))
            and getattr(fs, "loop", None) is not None)


@functools.cache
def _retrying() -> Any:
    """s3fs's retry loop of its own requests (``_error_wrapper``), or None without it."""
    try:
        from s3fs.core import _error_wrapper
    except ImportError:
        return None
    return _error_wrapper


def read_into(fs: Any, path: str, out: memoryview, trailer: int) -> tuple[int, bytes | None]:
    """Read object ``path`` into ``out`` if it has ``len(out) + trailer`` bytes: its size and
    its last ``trailer`` bytes, or its size and None (nothing written into ``out``) if not.

    Raises:
        FileNotFoundError: there is no such object (s3fs's translation of the 404).
        OSError: the store failed, after s3fs's retries.
    """
    async def attempt() -> tuple[int, bytes | None]:
        return await _get_into(fs, path, out, trailer)

    try:
        return sync(fs.loop, _retrying(), attempt, retries=fs.retries)
    except (TypeError, AttributeError) as exc:
        raise Unsupported(errno.ENOTSUP, f"s3fs's coroutine API changed ({exc!r})") from exc


async def _get_into(fs: Any, path: str, out: memoryview, trailer: int) -> tuple[int, bytes | None]:
    expected = len(out) + trailer
    bucket, key, version = fs.split_path(path)
    extra = {"VersionId": version} if version else {}
    # one byte more than expected: a longer object says so in its Content-Range
    answer = await fs._call_s3("get_object", Bucket=bucket, Key=key, Range=f"bytes=0-{expected}",
                               **extra)
    body = answer["Body"]
    try:
        size = _object_size(answer)
        return size, (await _fill(body, out, trailer) if size == expected else None)
    finally:
        body.close()


def _object_size(answer: dict[str, Any]) -> int:
    """The whole object's size: from ``Content-Range`` (the ranged answer, 206), or the body's
    length if the store ignored the range (200)."""
    found = _CONTENT_RANGE.fullmatch(answer.get("ContentRange") or "")
    return int(found.group(1)) if found else int(answer["ContentLength"])


async def _fill(body: Any, out: memoryview, trailer: int) -> bytes:
    """Read the answer's bytes into ``out``, then the rest into the returned trailer."""
    tail = bytearray(trailer)
    for into in (out, memoryview(tail)):
        filled = 0
        while filled < len(into):
            # the blocks received so far, up to what is left (what aiobotocore's readinto copies)
            block = await body.read(len(into) - filled)
            if not block:  # aiohttp raises ClientPayloadError (retried) if the connection broke
                raise OSError(errno.EIO, "the answer ended before the object's size")
            into[filled:filled + len(block)] = block
            filled += len(block)
    return bytes(tail)
