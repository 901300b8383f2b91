"""Pure naming functions: where a node's checkpoint lives and how names become path segments.

Nothing here touches a filesystem. The on-disk names are a protocol: change them only with the
format version in :mod:`caffe2ckpt.store.format.zarrgroup`.

``<prefix>/<node>.<epoch>`` (:func:`db_name`) is where the first save of a node's epoch lands;
every other name under a prefix is built in :mod:`caffe2ckpt.store.format.paths`.

Blob names become array paths by :func:`blob_path`: characters other than ``A-Z a-z 0-9 _ . -``
are percent-encoded as UTF-8 bytes (``/`` -> ``%2F``, ``:`` -> ``%3A``, ``%`` -> ``%25``), a
leading ``.`` or ``_`` is encoded too (so no path is ``.``, ``..`` or reserved), the name
``zarr.json`` becomes ``zarr%2Ejson`` (it would clash with the group's metadata), and an encoded
name longer than 120 characters is cut to 80 and followed by ``~`` and 32 hex digits of its
SHA-256 (``~`` never appears otherwise). The exact name is always in the group's manifest.
"""

from __future__ import annotations

import hashlib
import re

import numpy as np

from caffe2ckpt.errors import InvalidLocationError

__all__ = [
    "blob_path",
    "check_epoch",
    "check_node_name",
    "db_name",
    "get_ckpt_filename",
]

MAX_EPOCH = 10**12 - 1
_MAX_NODE_LEN = 128  # bytes in UTF-8
_SAFE = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_.-")
_MAX_SEGMENT = 120
_NODE_FORBIDDEN = re.compile(r"[/\\\x00-\x1f\x7f]")


def get_ckpt_filename(node_name: str, epoch: int) -> str:
    """``"<node>.<epoch>"``: the name of a node's checkpoint for an epoch (epoch not padded)."""
    return f"{node_name}.{epoch}"


def db_name(epoch: int, node_name: str, db_prefix: str, path_prefix: str | None = None) -> str:
    """Where node ``node_name``'s checkpoint of ``epoch`` lives (note: epoch comes first).

    With ``path_prefix`` the result is the plain concatenation ``path_prefix + "<node>.<epoch>"``
    (as in Caffe2); otherwise ``"<db_prefix>/<node>.<epoch>"`` without doubling a trailing ``/``.

    >>> db_name(5, "trainer_1", "/tmp/x")
    '/tmp/x/trainer_1.5'
    """
    filename = get_ckpt_filename(node_name, epoch)
    if path_prefix:
        return path_prefix + filename
    return db_prefix + filename if db_prefix.endswith("/") else f"{db_prefix}/{filename}"


def check_node_name(node: object) -> str:
    """Return ``node`` if it can name checkpoint files, else raise :class:`InvalidLocationError`.

    A node name is a non-empty string of at most 128 bytes in UTF-8 (so that every file name
    built from it stays under the usual 255-byte limit), without ``/``, ``\\``, control
    characters or lone surrogates, that is not ``.`` or ``..`` and does not start with ``_``
    (reserved).
    """
    if not isinstance(node, str) or not node:
        raise InvalidLocationError(f"node names must be non-empty strings, got {node!r}")
    try:
        size = len(node.encode("utf-8"))
    except UnicodeEncodeError:
        raise InvalidLocationError(
            f"node name {node!r} is not valid unicode (lone surrogate)") from None
    if (
        size > _MAX_NODE_LEN
        or node in (".", "..")
        or node.startswith("_")
        or _NODE_FORBIDDEN.search(node)
    ):
        raise InvalidLocationError(
            f"node name {node!r} cannot name checkpoint files: use at most {_MAX_NODE_LEN} "
            "bytes in UTF-8, no '/', '\\' or control characters, not '.' or '..', no leading '_'"
        )
    return node


def check_epoch(epoch: object) -> int:
    """Return ``epoch`` as an int if it is a valid epoch number (0 .. 10**12-1)."""
    if isinstance(epoch, (bool, np.bool_)) or not isinstance(epoch, (int, np.integer)):
        raise InvalidLocationError(f"epochs must be non-negative ints, got {epoch!r}")
    if not 0 <= epoch <= MAX_EPOCH:
        raise InvalidLocationError(f"epoch {epoch} is out of range 0..{MAX_EPOCH}")
    return int(epoch)


def blob_path(name: str) -> str:
    """The array path (one segment) that stores blob ``name`` inside a node's group."""
    out = []
    for i, ch in enumerate(name):
        if ch in _SAFE and not (i == 0 and ch in "._"):
            out.append(ch)
        else:
            out.extend(f"%{b:02X}" for b in ch.encode("utf-8"))
    encoded = "".join(out)
    if encoded == "zarr.json":  # the group's own metadata file
        encoded = "zarr%2Ejson"
    if len(encoded) > _MAX_SEGMENT:
        digest = hashlib.sha256(name.encode("utf-8")).hexdigest()[:32]
        encoded = f"{encoded[:80]}~{digest}"
    return encoded
