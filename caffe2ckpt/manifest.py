"""The manifest of a node's checkpoint: which blobs it holds and where their bytes are.

It is stored as ``attributes["caffe2ckpt"]`` of the node's Zarr group::

    {"format": 2, "node": "trainer_0", "epoch": 7, "save_id": "...",
     "arrays": {"<blob name>": {"path": "<array>", "dtype": "<f4", "shape": [..],
                                "order": "C", "chunk_rows": 4096}, ...},
     "packed": {"nbytes": N, "chunk": C, "names": [..], "dtypes": [..], "shapes": [[..], ..],
                "offsets": [..], "fortran": [indices of Fortran-ordered blobs]}}

Large blobs are listed by name under ``arrays``; small ones are columns under ``packed`` (ten
thousand tiny blobs must not cost ten thousand JSON objects). Pure data: no I/O, no zarr.
Parsing validates every entry, so a damaged manifest fails loudly instead of misplacing bytes.

Format 2 stores the last chunk of an array padded to the full chunk shape, as Zarr v3 requires;
format 1 (still read) stored only its rows, which plain zarr cannot read.
"""

from __future__ import annotations

import functools
import itertools
import math
import re
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

__all__ = ["FORMAT_VERSION", "PACKED_ARRAY", "BlobInfo", "Manifest", "itemsize"]

FORMAT_VERSION = 2
_READABLE_FORMATS = frozenset({1, 2})
PACKED_ARRAY = "_packed"
_KINDS = frozenset("biufcSU")
# an array path is one segment made by naming.blob_path: never "/", never "." or ".."
_SEGMENT = re.compile(r"[A-Za-z0-9_.%~-]{1,200}")


@functools.lru_cache(maxsize=256)
def itemsize(dtype: str) -> int:
    """The itemsize of numpy dtype string ``dtype``; ValueError unless it is a storable dtype
    spelled canonically (``np.dtype(dtype).str``)."""
    parsed = np.dtype(dtype)
    if parsed.str != dtype or parsed.kind not in _KINDS:
        raise ValueError(f"bad dtype {dtype!r}")
    return parsed.itemsize


class BlobInfo(NamedTuple):
    """Where and how one blob is stored: its own array (``path``, ``chunk_rows``) or a slice of
    the packed array (``offset``)."""

    name: str
    dtype: str  # numpy dtype.str of the original array, e.g. "<f4", ">i8", "<U5"
    shape: tuple[int, ...]
    order: str  # "C" or "F": restored with the same memory layout
    path: str | None = None
    chunk_rows: int = 0
    offset: int | None = None
    crcs: tuple[int, ...] = ()  # CRC32C of each chunk of its array

    @property
    def nbytes(self) -> int:
        return itemsize(self.dtype) * math.prod(self.shape)


@dataclass(frozen=True, kw_only=True)
class Manifest:
    """What a node's group holds: ``arrays`` (own Zarr arrays) and ``packed`` blobs."""

    node: str
    epoch: int
    save_id: str
    arrays: dict[str, BlobInfo] = field(default_factory=dict)
    packed: list[BlobInfo] = field(default_factory=list)
    packed_nbytes: int = 0
    packed_chunk: int = 0  # bytes per chunk of the packed array
    packed_crcs: tuple[int, ...] = ()  # CRC32C of each chunk of the packed array
    format: int = FORMAT_VERSION

    @property
    def padded_edges(self) -> bool:
        """Whether each array's last chunk is stored at the full chunk shape (Zarr v3)."""
        return self.format >= 2

    @functools.cached_property
    def blobs(self) -> dict[str, BlobInfo]:
        """Every blob by name (arrays first, then packed ones, each in saved order)."""
        return {**self.arrays, **{b.name: b for b in self.packed}}

    @functools.cached_property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.arrays.values()) + sum(b.nbytes for b in self.packed)

    def to_dict(self) -> dict[str, Any]:
        packed = self.packed
        return {
            "format": self.format,
            "node": self.node,
            "epoch": self.epoch,
            "save_id": self.save_id,
            "arrays": {b.name: {"path": b.path, "dtype": b.dtype, "shape": list(b.shape),
                                "order": b.order, "chunk_rows": b.chunk_rows,
                                "crc32c": list(b.crcs)}
                       for b in self.arrays.values()},
            "packed": {
                "nbytes": self.packed_nbytes,
                "chunk": self.packed_chunk,
                "crc32c": list(self.packed_crcs),
                "names": [b.name for b in packed],
                "dtypes": [b.dtype for b in packed],
                "shapes": [b.shape for b in packed],
                "offsets": [b.offset for b in packed],
                "fortran": [i for i, b in enumerate(packed) if b.order == "F"],
            },
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Manifest:
        """Parse and validate a manifest (raises ValueError, TypeError or KeyError)."""
        version = data.get("format")
        if type(version) is not int or version not in _READABLE_FORMATS:
            raise ValueError(f"unknown format version {version!r}")
        arrays = {name: _array_info(name, entry) for name, entry in data["arrays"].items()}
        columns = data["packed"]
        names, dtypes = columns["names"], columns["dtypes"]
        shapes, offsets = columns["shapes"], columns["offsets"]
        if not len(names) == len(dtypes) == len(shapes) == len(offsets):
            raise ValueError("packed columns differ in length")
        fortran = set(columns["fortran"])
        nbytes, chunk = int(columns["nbytes"]), int(columns["chunk"])
        if not all(isinstance(n, str) for n in names):
            raise ValueError("packed blob names must be strings")
        if not all(type(x) is int and x >= 0 for shape in shapes for x in shape):
            raise ValueError("packed shapes must be lists of non-negative ints")
        sizes = {d: itemsize(d) for d in set(dtypes)}
        ends = [o + sizes[d] * math.prod(shape) for o, d, shape in zip(offsets, dtypes, shapes)]
        if not all(type(o) is int and o >= 0 for o in offsets) or max(ends, default=0) > nbytes:
            raise ValueError("a packed blob lies outside the packed array")
        orders = ["F" if i in fortran else "C" for i in range(len(names))]
        packed = list(map(BlobInfo._make, zip(names, dtypes, map(tuple, shapes), orders,
                                               itertools.repeat(None), itertools.repeat(0),
                                               offsets, itertools.repeat(()))))
        if len(set(names)) != len(names) or not set(names).isdisjoint(arrays):
            raise ValueError("a blob name appears twice")
        paths = [b.path for b in arrays.values()]
        if len(set(paths)) != len(paths) or PACKED_ARRAY in paths:
            raise ValueError("two arrays share a path")
        if nbytes and chunk <= 0:
            raise ValueError("bad packed chunk size")
        packed_crcs = _crcs(columns["crc32c"], math.ceil(nbytes / chunk) if nbytes else 0)
        return cls(node=str(data["node"]), epoch=int(data["epoch"]),
                   save_id=str(data["save_id"]), arrays=arrays, packed=packed,
                   packed_nbytes=nbytes, packed_chunk=chunk, packed_crcs=packed_crcs,
                   format=version)

    def metadata_files(self) -> dict[str, str | None]:
        """The group's Zarr metadata files (relative paths) and the blob each belongs to."""
        files: dict[str, str | None] = {"zarr.json": None}
        if self.packed_nbytes:
            files[f"{PACKED_ARRAY}/zarr.json"] = None
        for info in self.arrays.values():
            files[f"{info.path}/zarr.json"] = info.name
        return files


def _crcs(values: list[Any], count: int) -> tuple[int, ...]:
    if len(values) != count or not all(type(v) is int and 0 <= v < 2**32 for v in values):
        raise ValueError(f"expected {count} chunk checksums, found {values!r:.80}")
    return tuple(values)


def _array_info(name: str, entry: dict[str, Any]) -> BlobInfo:
    shape = tuple(int(s) for s in entry["shape"])
    rows = int(entry["chunk_rows"])
    crcs = _crcs(entry["crc32c"], math.ceil(shape[0] / rows) if shape and rows > 0 else 0)
    info = BlobInfo(name, entry["dtype"], shape, entry["order"], path=entry["path"],
                    chunk_rows=rows, crcs=crcs)
    info.nbytes  # noqa: B018 - validates the dtype
    if (not info.shape or min(info.shape) <= 0 or info.order not in ("C", "F")
            or not isinstance(info.path, str) or not _SEGMENT.fullmatch(info.path)
            or info.path in (".", "..") or info.path.startswith(".")
            or not 0 < info.chunk_rows <= info.shape[0]):
        raise ValueError(f"bad array entry for blob {name!r}")
    return info
