"""The manifest of a node's checkpoint: which blobs it holds and where their bytes are.

It is stored as ``attributes["caffe2ckpt"]`` of the node's Zarr group. Pure data: no I/O, no zarr.
Parsing validates every entry, so a damaged manifest fails loudly instead of misplacing bytes.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["FORMAT_VERSION", "PACKED_ARRAY", "BlobInfo", "Manifest"]

FORMAT_VERSION = 1
PACKED_ARRAY = "_packed"
_KINDS = frozenset("biufcSU")


@functools.lru_cache(maxsize=256)
def _itemsize(dtype: str) -> int:
    parsed = np.dtype(dtype)
    if parsed.str != dtype or parsed.kind not in _KINDS:
        raise ValueError(f"bad dtype {dtype!r}")
    return parsed.itemsize


@dataclass(frozen=True, kw_only=True, slots=True)
class BlobInfo:
    """Where and how one blob is stored: its own array (``path``, ``chunk_rows``) or a slice of
    the packed array (``packed`` = offset, nbytes)."""

    name: str
    dtype: str  # numpy dtype.str of the original array, e.g. "<f4", ">i8", "<U5"
    shape: tuple[int, ...]
    order: str  # "C" or "F": restored with the same memory layout
    path: str | None = None
    chunk_rows: int = 0
    packed: tuple[int, int] | None = None

    @property
    def nbytes(self) -> int:
        return _itemsize(self.dtype) * math.prod(self.shape)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"dtype": self.dtype, "shape": list(self.shape), "order": self.order}
        if self.path is not None:
            out["path"] = self.path
            out["chunk_rows"] = self.chunk_rows
        if self.packed is not None:
            out["packed"] = list(self.packed)
        return out

    @classmethod
    def from_dict(cls, name: str, data: dict[str, Any]) -> BlobInfo:
        """Parse and validate one entry (raises ValueError, TypeError or KeyError)."""
        packed = data.get("packed")
        info = cls(
            name=name,
            dtype=data["dtype"],
            shape=tuple(int(s) for s in data["shape"]),
            order=data["order"],
            path=data.get("path"),
            chunk_rows=int(data.get("chunk_rows", 0)),
            packed=(int(packed[0]), int(packed[1])) if packed is not None else None,
        )
        nbytes = info.nbytes  # validates the dtype
        if min(info.shape, default=0) < 0 or info.order not in ("C", "F"):
            raise ValueError(f"blob {name!r}: bad shape {info.shape} or order {info.order!r}")
        if info.packed is not None:
            if info.path is not None or info.packed[0] < 0 or info.packed[1] != nbytes:
                raise ValueError(f"blob {name!r}: bad packed entry {info.packed}")
        elif not (isinstance(info.path, str) and info.path and info.shape
                  and 0 < info.chunk_rows <= max(info.shape[0], 1)):
            raise ValueError(f"blob {name!r}: bad array entry")
        return info


@dataclass(frozen=True, kw_only=True)
class Manifest:
    """What a node's group holds."""

    node: str
    epoch: int
    save_id: str
    blobs: dict[str, BlobInfo]
    packed_nbytes: int = 0
    packed_chunk: int = 0  # bytes per chunk of the packed array

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.blobs.values())

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT_VERSION,
            "node": self.node,
            "epoch": self.epoch,
            "save_id": self.save_id,
            "packed_nbytes": self.packed_nbytes,
            "packed_chunk": self.packed_chunk,
            "blobs": {name: info.to_dict() for name, info in self.blobs.items()},
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Manifest:
        """Parse and validate a manifest (raises ValueError, TypeError or KeyError)."""
        if data.get("format") != FORMAT_VERSION:
            raise ValueError(f"unknown format version {data.get('format')!r}")
        manifest = cls(
            node=str(data["node"]),
            epoch=int(data["epoch"]),
            save_id=str(data["save_id"]),
            packed_nbytes=int(data["packed_nbytes"]),
            packed_chunk=int(data["packed_chunk"]),
            blobs={n: BlobInfo.from_dict(n, d) for n, d in data["blobs"].items()},
        )
        if manifest.packed_nbytes and manifest.packed_chunk <= 0:
            raise ValueError("bad packed chunk size")
        paths = [b.path for b in manifest.blobs.values() if b.path is not None]
        if len(set(paths)) != len(paths) or PACKED_ARRAY in paths:
            raise ValueError("two blobs share an array path")
        for info in manifest.blobs.values():
            if info.packed is not None and sum(info.packed) > manifest.packed_nbytes:
                raise ValueError(f"blob {info.name!r} lies outside the packed array")
        return manifest

    def metadata_files(self) -> dict[str, str | None]:
        """The group's Zarr metadata files (relative paths) and the blob each belongs to."""
        files: dict[str, str | None] = {"zarr.json": None}
        if self.packed_nbytes:
            files[f"{PACKED_ARRAY}/zarr.json"] = None
        for info in self.blobs.values():
            if info.path is not None:
                files[f"{info.path}/zarr.json"] = info.name
        return files
