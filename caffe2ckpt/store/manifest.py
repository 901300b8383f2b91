"""The manifest of a node's checkpoint: which blobs it holds and where their bytes are.

It is stored as ``attributes["caffe2ckpt"]`` of the node's Zarr group::

    {"format": 2, "node": "trainer_0", "epoch": 7, "save_id": "...",
     "arrays": {"<blob name>": {"path": "<array>", "dtype": "<f4", "shape": [..],
                                "order": "C", "chunk_rows": 4096}, ...},
     "packed": {"nbytes": N, "chunk": C, "names": [..], "dtypes": [..], "shapes": [[..], ..],
                "offsets": [..], "fortran": [indices of Fortran-ordered blobs]}}

Large blobs are listed by name under ``arrays``; small ones are columns under ``packed`` (ten
thousand tiny blobs must not cost ten thousand JSON objects). Pure data: no I/O, no zarr.
Parsing validates every entry, so a damaged manifest fails loudly instead of misplacing bytes,
and every size it claims is one numpy can allocate (each blob at most :data:`MAX_BLOB_BYTES`,
numpy's number of axes): a crafted claim fails here as ValueError, not later as MemoryError.
Whether the claimed bytes are really stored is checked by the reader, against the files.

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

__all__ = ["FORMAT_VERSION", "MAX_BLOB_BYTES", "PACKED_ARRAY", "BlobInfo", "Manifest",
           "itemsize"]

FORMAT_VERSION = 2
_READABLE_FORMATS = frozenset({1, 2})
PACKED_ARRAY = "_packed"
_KINDS = frozenset("biufcSU")
# an array path is one segment made by naming.blob_path: never "/", never "." or ".."
_SEGMENT = re.compile(r"[A-Za-z0-9_.%~-]{1,200}")
MAX_BLOB_BYTES = 2**62  # also bounds each axis: numpy refuses sizes near 2**63
_MAX_NDIM = 64 if np.lib.NumpyVersion(np.__version__) >= "2.0.0" else 32  # NPY_MAXDIMS


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
    # the packed blobs' bytes when the parser already added them up (else computed on demand)
    packed_blob_bytes: int | None = field(default=None, repr=False, compare=False)

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
        packed = self.packed_blob_bytes
        if packed is None:
            packed = sum(b.nbytes for b in self.packed)
        return sum(b.nbytes for b in self.arrays.values()) + packed

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
        nbytes, chunk = _size(columns["nbytes"], "packed nbytes"), _size(columns["chunk"],
                                                                         "packed chunk")
        if not all(isinstance(n, str) for n in names):
            raise ValueError("packed blob names must be strings")
        shapes, end, packed_bytes = _packed_shapes(names, dtypes, shapes, offsets)
        if end > nbytes:
            raise ValueError("a packed blob lies outside the packed array")
        orders = ["F" if i in fortran else "C" for i in range(len(names))]
        packed = list(map(BlobInfo._make, zip(names, dtypes, shapes, orders,
                                               itertools.repeat(None), itertools.repeat(0),
                                               offsets, itertools.repeat(()))))
        if len(set(names)) != len(names) or not set(names).isdisjoint(arrays):
            raise ValueError("a blob name appears twice")
        paths = [b.path for b in arrays.values()]
        if len(set(paths)) != len(paths) or PACKED_ARRAY in paths:
            raise ValueError("two arrays share a path")
        if nbytes and not 0 < chunk <= nbytes:
            raise ValueError(f"bad packed chunk size {chunk} for {nbytes} bytes")
        packed_crcs = _crcs(columns["crc32c"], math.ceil(nbytes / chunk) if nbytes else 0)
        return cls(node=str(data["node"]), epoch=int(data["epoch"]),
                   save_id=str(data["save_id"]), arrays=arrays, packed=packed,
                   packed_nbytes=nbytes, packed_chunk=chunk, packed_crcs=packed_crcs,
                   format=version, packed_blob_bytes=packed_bytes)

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


def _size(value: Any, what: str) -> int:
    """``value`` if it is an int (not a bool) from 0 to :data:`MAX_BLOB_BYTES`."""
    if type(value) is not int or not 0 <= value <= MAX_BLOB_BYTES:
        raise ValueError(f"{what} must be an int from 0 to {MAX_BLOB_BYTES}, got {value!r:.40}")
    return value


def _packed_shapes(names: list[str], dtypes: list[Any], shapes: list[Any],
                   offsets: list[Any]) -> tuple[list[tuple[int, ...]], int, int]:
    """The packed blobs' shapes, checked as :func:`_shape` checks one (in one pass: ten
    thousand packed blobs are parsed on every restore), where the last of them ends and how
    many bytes they hold."""
    kinds = {d: (itemsize(d), _MAX_NDIM - (np.dtype(d).kind in "US")) for d in set(dtypes)}
    out, end, total = [], 0, 0
    for shape, dtype, offset, name in zip(shapes, dtypes, offsets, names):
        size, ndim = kinds[dtype]
        if type(shape) is not list or len(shape) > ndim:
            raise ValueError(f"blob {name!r:.80}: bad shape {shape!r:.80}")
        for x in shape:  # a loop, not all(...): no generator per blob
            if type(x) is not int or not 0 <= x <= MAX_BLOB_BYTES:
                raise ValueError(f"blob {name!r:.80}: bad shape {shape!r:.80}")
        nbytes = size * math.prod(shape)
        if nbytes > MAX_BLOB_BYTES:
            raise ValueError(f"blob {name!r:.80}: shape {shape!r:.80} of {dtype} is more than "
                             f"{MAX_BLOB_BYTES} bytes")
        if type(offset) is not int or offset < 0:
            raise ValueError(f"blob {name!r:.80}: bad offset {offset!r:.40}")
        out.append(tuple(shape))
        total += nbytes
        if offset + nbytes > end:
            end = offset + nbytes
    return out, end, total


def _shape(shape: Any, dtype: str, name: str) -> tuple[int, ...]:
    """``shape`` as a tuple if numpy can hold such an array of ``dtype``: a list of sizes, at
    most numpy's number of axes (unicode and byte strings are stored with one more), and at most
    :data:`MAX_BLOB_BYTES` in all."""
    extra = np.dtype(dtype).kind in "US" if isinstance(dtype, str) else 0
    if not isinstance(shape, list) or len(shape) + extra > _MAX_NDIM:
        raise ValueError(f"blob {name!r:.80}: bad shape {shape!r:.80}")
    dims = tuple(_size(x, f"blob {name!r:.80}: an axis") for x in shape)
    if itemsize(dtype) * math.prod(dims) > MAX_BLOB_BYTES:
        raise ValueError(f"blob {name!r:.80}: shape {dims!r:.80} of {dtype} is more than "
                         f"{MAX_BLOB_BYTES} bytes")
    return dims


def _array_info(name: str, entry: dict[str, Any]) -> BlobInfo:
    shape = _shape(entry["shape"], entry["dtype"], name)
    rows = _size(entry["chunk_rows"], f"blob {name!r:.80}: chunk_rows")
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
