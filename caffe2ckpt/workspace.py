"""Workspaces: a node's named numpy arrays, and the rules for what a blob may be.

A :class:`Workspace` maps blob names (any non-empty string) to numpy arrays. Python and numpy
scalars become 0-d arrays when assigned. Values that cannot be checkpointed exactly (object
arrays, structured dtypes, arbitrary Python objects) are refused at assignment with an error
naming the blob, so a bad value never reaches a save.

A child workspace (``Workspace(parent=ws)``) implements Caffe2's PRIVATE semantics: reads fall
through to the parent, assigning a name the parent has writes it there, and new names stay in
the child.

This module does no I/O and imports nothing but numpy and :mod:`caffe2ckpt.errors`.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator, MutableMapping
from typing import Any

import numpy as np

from caffe2ckpt.errors import InvalidBlobError

__all__ = ["Workspace", "WorkspaceType", "as_blob", "check_blob_name", "check_rows"]

# dtype kinds stored bit-exactly: bool, signed/unsigned int, float, complex, and fixed-width
# byte (S) and unicode (U) strings, which are stored as their raw code units.
_SUPPORTED_KINDS = frozenset("biufcSU")


class WorkspaceType(enum.Enum):
    """Where a task's new blobs live (Caffe2's names and values)."""

    GLOBAL = "global"
    PRIVATE = "private"


def check_blob_name(name: object) -> str:
    """Return ``name`` if it is a usable blob name, else raise :class:`InvalidBlobError`."""
    if not isinstance(name, str):
        raise InvalidBlobError(f"blob names must be str, got {type(name).__name__}: {name!r}")
    if not name:
        raise InvalidBlobError("blob names must be non-empty strings")
    try:
        name.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidBlobError(f"blob name {name!r} is not valid unicode (lone surrogate)") from exc
    return name


def check_rows(where: str, name: str, rows: Any, arr: np.ndarray) -> np.ndarray:
    """``rows`` as int64 row indices of blob ``name`` (``arr``), or :class:`InvalidBlobError`
    naming ``where`` and the blob: not integers, or outside ``0 .. len(arr) - 1``."""
    ids = np.asarray(rows).reshape(-1)
    if ids.size and not np.issubdtype(ids.dtype, np.integer):
        raise InvalidBlobError(f"{where}, blob {name!r}: changed rows must be integers, got "
                               f"dtype {ids.dtype}")
    if ids.size and not arr.ndim:
        raise InvalidBlobError(f"{where}, blob {name!r}: it is a single value (0-d), which has "
                               "no rows to name: give no rows for it (it is compared whole)")
    length = arr.shape[0] if arr.ndim else 0
    if ids.size and not (0 <= ids.min() and ids.max() < length):
        raise InvalidBlobError(f"{where}, blob {name!r}: changed rows must be from 0 to "
                               f"{length - 1}, got {int(ids.min())} .. {int(ids.max())}")
    return ids.astype(np.int64)


def merge_rows(held: dict[str, np.ndarray], name: str, rows: np.ndarray) -> None:
    """Add row ids ``rows`` to ``held[name]``, the union of those noted so far (sorted, each
    once): hints noted many times take the memory of the distinct rows, never one array per
    call."""
    kept = held.get(name)
    held[name] = sorted_unique(rows if kept is None else np.concatenate([kept, rows]))


def sorted_unique(ids: np.ndarray) -> np.ndarray:
    """``ids`` sorted, each once, in a new array: what ``np.unique`` gives, without its cost on
    integer ids (numpy 2.4, 52,428 int64 row ids: 12.5 ms against 1.2 ms; ``np.union1d`` of two
    such arrays 36 ms against 3 ms)."""
    out = np.sort(ids, axis=None)  # flattened, as np.unique
    if out.size > 1:
        keep = np.empty(out.size, bool)
        keep[0] = True
        np.not_equal(out[1:], out[:-1], out=keep[1:])
        out = out[keep]
    return out


def as_blob(name: str, value: Any) -> np.ndarray:
    """Convert ``value`` to the numpy array stored under blob ``name``.

    Scalars (Python or numpy) become 0-d arrays; arrays are kept as they are (no copy); a
    ``np.memmap`` becomes a plain array over the same memory (only its data is state).

    Raises:
        InvalidBlobError: the value is not a numpy array or scalar of a supported dtype, or is
            an ndarray subclass whose state is more than its data: a masked array would lose its
            mask, a ``np.matrix`` would come back as an array (``*`` changing meaning).
    """
    if type(value) is np.ndarray:
        arr = value
    elif isinstance(value, np.memmap):
        arr = value.view(np.ndarray)
    elif isinstance(value, np.ndarray):
        hint = ("store its data (value.filled(...) or value.data) and its mask "
                "(np.ma.getmaskarray(value)) as two blobs" if isinstance(value, np.ma.MaskedArray)
                else "store np.asarray(value) if its data is all that matters")
        raise InvalidBlobError(
            f"blob {name!r}: cannot checkpoint a {type(value).__module__}."
            f"{type(value).__qualname__}: a restore would give back a plain numpy array, losing "
            f"what the subclass adds; {hint}"
        )
    elif isinstance(value, (bool, int, float, complex, np.generic)):
        arr = np.asarray(value)
    else:
        raise InvalidBlobError(
            f"blob {name!r}: cannot checkpoint a value of type {type(value).__name__}; "
            "use a numpy array or a numeric scalar"
        )
    kind = arr.dtype.kind
    if (kind not in _SUPPORTED_KINDS or arr.dtype.fields is not None or arr.dtype.subdtype
            or (kind in "fc" and arr.dtype.itemsize > 8 * (1 + (kind == "c")))):
        raise InvalidBlobError(
            f"blob {name!r}: dtype {arr.dtype} is not supported (object, structured, "
            "datetime and void arrays cannot be stored without pickle; Zarr has no "
            "float128/complex256)"
        )
    return arr


class Workspace(MutableMapping[str, np.ndarray]):
    """A node's blobs: a mutable mapping from blob name to numpy array.

    Args:
        blobs: initial contents.
        parent: makes this a PRIVATE child of ``parent`` (see the module docstring).

    Example:
        >>> ws = Workspace()
        >>> ws["trainer_0/total"] = 100
        >>> ws["trainer_0/total"].shape
        ()
    """

    def __init__(
        self, blobs: dict[str, Any] | None = None, *, parent: Workspace | None = None
    ) -> None:
        self._blobs: dict[str, np.ndarray] = {}
        self._changed: dict[str, np.ndarray] = {}  # mark_changed hints not yet saved: a union
        self.parent = parent
        for name, value in (blobs or {}).items():
            self[name] = value

    def __getitem__(self, name: str) -> np.ndarray:
        if name in self._blobs:
            return self._blobs[name]
        if self.parent is not None:
            return self.parent[name]
        raise KeyError(name)

    def __setitem__(self, name: str, value: Any) -> None:
        arr = as_blob(check_blob_name(name), value)
        if name not in self._blobs and self.parent is not None and name in self.parent:
            self.parent[name] = arr
        else:
            self._blobs[name] = arr

    def __delitem__(self, name: str) -> None:
        if name in self._blobs:
            del self._blobs[name]
        elif self.parent is not None and name in self.parent:
            del self.parent[name]
        else:
            raise KeyError(name)

    def __contains__(self, name: object) -> bool:
        return name in self._blobs or (self.parent is not None and name in self.parent)

    def __iter__(self) -> Iterator[str]:
        yield from self._blobs
        if self.parent is not None:
            yield from (n for n in self.parent if n not in self._blobs)

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def restore(self, blobs: dict[str, np.ndarray]) -> None:
        """Assign arrays that a checkpoint load produced: numpy arrays only, no scalar
        conversion, and each distinct dtype checked once (cheap for ten thousand blobs), so
        an object array can never reach a save this way either.

        Raises:
            InvalidBlobError: a name or value that assignment would refuse; nothing assigned.
        """
        checked: set[np.dtype] = set()
        for name, arr in blobs.items():
            check_blob_name(name)
            if not isinstance(arr, np.ndarray):
                raise InvalidBlobError(
                    f"blob {name!r}: restore() takes numpy arrays, got {type(arr).__name__}")
            if arr.dtype not in checked:
                as_blob(name, arr)
                checked.add(arr.dtype)
        if self.parent is None:
            self._blobs.update(blobs)
        else:  # a child workspace: keep its write-through rules
            self.update(blobs)

    def mark_changed(self, name: str, rows: Any) -> None:
        """Note that rows ``rows`` (indices along axis 0) of blob ``name`` changed since the
        last save: the hints a differential save with ``delta_detection="hints"`` writes
        (accumulated until the next save, so a save every N epochs sees the union). A hint that
        misses changed rows is still found (by row digest), saved and reported. Only the union of
        the rows is kept: at most 8 bytes per row of the blob, however often rows are marked.

        Raises:
            InvalidBlobError: no such blob, or ``rows`` are not row indices of it.
        """
        if name not in self._blobs and self.parent is not None and name in self.parent:
            self.parent.mark_changed(name, rows)
            return
        if name not in self._blobs:
            raise InvalidBlobError(f"mark_changed: the workspace has no blob {name!r}")
        merge_rows(self._changed, name, check_rows("mark_changed", name, rows, self._blobs[name]))

    def take_changed(self) -> dict[str, np.ndarray]:
        """The rows :meth:`mark_changed` noted since the last call, by blob (then forgotten)."""
        changed, self._changed = self._changed, {}
        return changed

    def local_names(self) -> list[str]:
        """Names stored in this workspace itself (not those seen through a parent)."""
        return list(self._blobs)

    def __repr__(self) -> str:
        kind = "child " if self.parent is not None else ""
        return f"<{kind}Workspace with {len(self)} blobs>"
