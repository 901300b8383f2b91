"""One node's workspace as one Zarr v3 group: write it, read it back verified, describe it.

This is the only module that imports zarr. It knows the group layout and nothing about commits:

- the group's attributes hold ``{"caffe2ckpt": manifest}``: format version, node, epoch, save id
  and, per blob, its exact name, dtype, shape, memory order and where its bytes are;
- a blob of at least ``pack_threshold`` bytes is its own array at ``naming.blob_path(name)``,
  chunked along its first axis, readable by name with plain ``zarr.open_group``;
- smaller blobs (and every 0-d or empty one) are packed into one uint8 array ``_packed``; the
  manifest gives each one's ``[offset, nbytes]`` in it;
- every chunk ends with Zarr's ``crc32c`` checksum, no compression; restores verify checksums,
  dtypes, shapes and that no chunk is missing, raising :class:`CheckpointCorruptedError` that
  names node, epoch and blob.

Numeric arrays are stored little-endian (big-endian ones are byte-swapped and swapped back);
unicode (``U``) and byte-string (``S``) arrays are stored as their code units (uint32 / uint8)
with one extra trailing axis, and restored to the exact original dtype.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import zarr
from fsspec.implementations.asyn_wrapper import AsyncFileSystemWrapper
from zarr.codecs import Crc32cCodec

from caffe2ckpt.errors import CheckpointCorruptedError, CheckpointNotFoundError
from caffe2ckpt.location import Location
from caffe2ckpt.naming import blob_path

__all__ = [
    "DEFAULT_PACK_THRESHOLD",
    "FORMAT_VERSION",
    "PACKED_ARRAY",
    "BlobInfo",
    "Manifest",
    "read_manifest",
    "read_node",
    "write_node",
]

FORMAT_VERSION = 1
ATTRS_KEY = "caffe2ckpt"
PACKED_ARRAY = "_packed"
DEFAULT_PACK_THRESHOLD = 64 * 1024
_CHUNK_BYTES = 16 * 1024 * 1024
_ALIGN = 16


@dataclass(frozen=True, kw_only=True)
class BlobInfo:
    """Where and how one blob is stored."""

    name: str
    dtype: str  # numpy dtype.str of the original array, e.g. "<f4", ">i8", "<U5"
    shape: tuple[int, ...]
    order: str  # "C" or "F": restored with the same memory layout
    path: str | None = None  # array path for a large blob
    packed: tuple[int, int] | None = None  # (offset, nbytes) in the packed array

    @property
    def nbytes(self) -> int:
        return int(np.dtype(self.dtype).itemsize * math.prod(self.shape))

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"dtype": self.dtype, "shape": list(self.shape), "order": self.order}
        if self.path is not None:
            out["path"] = self.path
        if self.packed is not None:
            out["packed"] = list(self.packed)
        return out

    @classmethod
    def from_dict(cls, name: str, data: dict[str, Any]) -> BlobInfo:
        """Parse and validate one manifest entry (raises ValueError/TypeError/KeyError)."""
        packed = data.get("packed")
        info = cls(
            name=name,
            dtype=np.dtype(str(data["dtype"])).str,
            shape=tuple(int(s) for s in data["shape"]),
            order=str(data["order"]),
            path=data.get("path"),
            packed=(int(packed[0]), int(packed[1])) if packed is not None else None,
        )
        if info.dtype != data["dtype"] or np.dtype(info.dtype).kind not in "biufcSU":
            raise ValueError(f"blob {name!r}: bad dtype {data['dtype']!r}")
        if min(info.shape, default=0) < 0 or info.order not in ("C", "F"):
            raise ValueError(f"blob {name!r}: bad shape or order")
        if (info.path is None) == (info.packed is None):
            raise ValueError(f"blob {name!r}: must be either an array or packed")
        if info.packed is not None and (info.packed[1] != info.nbytes or info.packed[0] < 0):
            raise ValueError(f"blob {name!r}: packed size {info.packed[1]} != {info.nbytes}")
        if info.path is not None and info.path != blob_path(name):
            raise ValueError(f"blob {name!r}: unexpected array path {info.path!r}")
        return info


@dataclass(frozen=True, kw_only=True)
class Manifest:
    """What a node's group holds; stored in the group's attributes."""

    node: str
    epoch: int
    save_id: str
    blobs: dict[str, BlobInfo]
    packed_nbytes: int = 0

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
            "blobs": {name: info.to_dict() for name, info in self.blobs.items()},
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Manifest:
        if data.get("format") != FORMAT_VERSION:
            raise ValueError(f"unknown format version {data.get('format')!r}")
        manifest = cls(
            node=str(data["node"]),
            epoch=int(data["epoch"]),
            save_id=str(data["save_id"]),
            packed_nbytes=int(data["packed_nbytes"]),
            blobs={n: BlobInfo.from_dict(n, d) for n, d in data["blobs"].items()},
        )
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


def metadata_digests(location: Location, path: str, manifest: Manifest) -> dict[str, str]:
    """SHA-256 of every Zarr metadata file of the group at ``path``.

    Commit records keep these, so a restore detects any change to the manifest or to an array's
    metadata (chunk grid, key encoding, codecs), which chunk checksums alone would not.
    """
    digests = {}
    for name in manifest.metadata_files():
        try:
            digests[name] = hashlib.sha256(location.read_bytes(f"{path}/{name}")).hexdigest()
        except CheckpointNotFoundError:
            digests[name] = "missing"
    return digests


def _store(location: Location, path: str, *, read_only: bool) -> Any:
    if location.is_local:
        return zarr.storage.LocalStore(path, read_only=read_only)
    fs = location.fs
    if not fs.async_impl:
        fs = AsyncFileSystemWrapper(fs, asynchronous=True)
    elif not fs.asynchronous:
        fs = type(fs)(**{**fs.storage_options, "asynchronous": True})
    return zarr.storage.FsspecStore(fs=fs, path=path, read_only=read_only)


def _stored_form(arr: np.ndarray) -> np.ndarray:
    """The C-contiguous little-endian numeric array that Zarr stores for ``arr``."""
    arr = np.ascontiguousarray(arr)
    kind = arr.dtype.kind
    if kind == "U":
        return arr.view("<u4" if arr.dtype.byteorder != ">" else ">u4").reshape(
            arr.shape + (arr.dtype.itemsize // 4,)
        ).astype("<u4", copy=False)
    if kind == "S":
        return arr.view(np.uint8).reshape(arr.shape + (arr.dtype.itemsize,))
    if arr.dtype.byteorder == ">":
        return arr.byteswap().view(arr.dtype.newbyteorder("<"))
    return arr


def _stored_spec(info: BlobInfo) -> tuple[np.dtype, tuple[int, ...]]:
    """The dtype and shape of the Zarr array that stores blob ``info``."""
    dtype = np.dtype(info.dtype)
    if dtype.kind == "U":
        return np.dtype("<u4"), info.shape + (dtype.itemsize // 4,)
    if dtype.kind == "S":
        return np.dtype(np.uint8), info.shape + (dtype.itemsize,)
    return dtype.newbyteorder("<") if dtype.byteorder == ">" else dtype, info.shape


def _from_stored(data: np.ndarray, info: BlobInfo) -> np.ndarray:
    dtype = np.dtype(info.dtype)
    if dtype.kind == "U":
        data = np.ascontiguousarray(data, dtype="<u4")
        if dtype.byteorder == ">":
            data = data.byteswap()
        out = data.view(dtype).reshape(info.shape)
    elif dtype.kind == "S":
        out = np.ascontiguousarray(data).view(dtype).reshape(info.shape)
    elif dtype.byteorder == ">":
        out = data.byteswap().view(dtype)
    else:
        out = data
    return np.asfortranarray(out) if info.order == "F" else out


def _chunks(shape: tuple[int, ...], itemsize: int) -> tuple[int, ...]:
    row_bytes = itemsize * math.prod(shape[1:])
    rows = max(1, min(shape[0], _CHUNK_BYTES // max(row_bytes, 1)))
    return (rows, *shape[1:])


def write_node(
    location: Location,
    path: str,
    *,
    node: str,
    epoch: int,
    save_id: str,
    blobs: dict[str, np.ndarray],
    pack_threshold: int = DEFAULT_PACK_THRESHOLD,
) -> Manifest:
    """Write ``blobs`` as a new Zarr group at ``path`` (which must not hold data) and return
    its manifest. Nothing is made durable here: the caller syncs before committing."""
    pack_threshold = max(1, pack_threshold)
    infos: dict[str, BlobInfo] = {}
    large: list[tuple[str, np.ndarray]] = []
    pieces: list[np.ndarray] = []
    offset = 0
    for name, arr in blobs.items():
        order = "F" if arr.flags.f_contiguous and not arr.flags.c_contiguous else "C"
        if arr.ndim == 0 or arr.size == 0 or arr.nbytes < pack_threshold:
            raw = np.ascontiguousarray(arr).reshape(-1).view(np.uint8)
            pad = -offset % _ALIGN
            if pad:
                pieces.append(np.zeros(pad, np.uint8))
                offset += pad
            infos[name] = BlobInfo(
                name=name, dtype=arr.dtype.str, shape=arr.shape, order=order,
                packed=(offset, raw.size),
            )
            pieces.append(raw)
            offset += raw.size
        else:
            infos[name] = BlobInfo(
                name=name, dtype=arr.dtype.str, shape=arr.shape, order=order,
                path=blob_path(name),
            )
            large.append((name, arr))
    manifest = Manifest(node=node, epoch=epoch, save_id=save_id, blobs=infos, packed_nbytes=offset)
    store = _store(location, path, read_only=False)
    try:
        zarr.create_group(store, attributes={ATTRS_KEY: manifest.to_dict()}, overwrite=True)
        if offset:
            packed = np.concatenate(pieces)
            _write_array(store, PACKED_ARRAY, packed)
        for name, arr in large:
            _write_array(store, infos[name].path, _stored_form(arr))
    finally:
        store.close()
    return manifest


def _write_array(store: Any, name: str, data: np.ndarray) -> None:
    zarr.create_array(
        store,
        name=name,
        data=data,
        chunks=_chunks(data.shape, data.dtype.itemsize),
        compressors=[Crc32cCodec()],
        filters=None,
        fill_value=0,
        config={"write_empty_chunks": True},
    )


def read_manifest(location: Location, path: str, *, node: str, epoch: int) -> Manifest:
    """The manifest of the group at ``path`` (one small read).

    Raises:
        CheckpointNotFoundError: no group there.
        CheckpointCorruptedError: the group metadata is not a caffe2ckpt manifest.
    """
    raw = location.read_bytes(f"{path}/zarr.json")
    try:
        meta = json.loads(raw)
        return Manifest.from_dict(meta["attributes"][ATTRS_KEY])
    except (ValueError, KeyError, TypeError, IndexError) as exc:
        raise CheckpointCorruptedError(
            f"checkpoint {location.display(path)!r} (node {node!r}, epoch {epoch}): "
            f"group metadata is unreadable: {exc}",
            node=node, epoch=epoch, blob="zarr.json",
        ) from exc


def read_node(
    location: Location, path: str, manifest: Manifest, names: list[str] | None = None
) -> dict[str, np.ndarray]:
    """Read (and verify) blobs ``names`` (default: all) of the group at ``path``.

    Raises:
        CheckpointCorruptedError: a checksum, dtype, shape or chunk count does not match.
    """
    wanted = [n for n in (manifest.blobs if names is None else names) if n in manifest.blobs]
    out: dict[str, np.ndarray] = {}
    store = _store(location, path, read_only=True)
    try:
        packed = None
        for name in wanted:
            info = manifest.blobs[name]
            if info.packed is not None and info.packed[1] == 0:
                out[name] = np.empty(info.shape, dtype=info.dtype,
                                     order="F" if info.order == "F" else "C")
            elif info.packed is not None:
                if packed is None:
                    packed = _read_array(location, store, path, manifest, PACKED_ARRAY,
                                         np.dtype(np.uint8), (manifest.packed_nbytes,))
                start, size = info.packed
                raw = packed[start:start + size]
                arr = raw.view(np.dtype(info.dtype)).reshape(info.shape).copy(
                    order="F" if info.order == "F" else "C")
                out[name] = arr
            else:
                dtype, shape = _stored_spec(info)
                data = _read_array(location, store, path, manifest, info.path,
                                   dtype, shape, blob=name)
                out[name] = _from_stored(data, info)
    finally:
        store.close()
    return out


def _read_array(
    location: Location,
    store: Any,
    group_path: str,
    manifest: Manifest,
    name: str,
    dtype: np.dtype,
    shape: tuple[int, ...],
    *,
    blob: str | None = None,
) -> np.ndarray:
    where = f"checkpoint {location.display(group_path)!r} (node {manifest.node!r}, epoch {manifest.epoch})"
    blob = blob if blob is not None else name

    def corrupted(msg: str, exc: BaseException | None = None) -> CheckpointCorruptedError:
        err = CheckpointCorruptedError(
            f"{where}: blob {blob!r} ({name}): {msg}",
            node=manifest.node, epoch=manifest.epoch, blob=blob,
        )
        if exc is not None:
            err.__cause__ = exc
        return err

    try:
        arr = zarr.open_array(store, path=name, mode="r")
    except Exception as exc:  # missing or garbage array metadata
        raise corrupted(f"array metadata is missing or unreadable ({exc})", exc) from exc
    if arr.dtype != dtype or tuple(arr.shape) != tuple(shape):
        raise corrupted(f"expected {dtype}{list(shape)}, found {arr.dtype}{list(arr.shape)}")
    expected_chunks = math.prod(math.ceil(s / c) for s, c in zip(arr.shape, arr.chunks))
    found = location.count_files(f"{group_path}/{name}/c")
    if found != expected_chunks:
        raise corrupted(f"{found} of {expected_chunks} chunks present")
    try:
        return arr[...]
    except Exception as exc:  # checksum mismatch, truncated chunk, decode failure
        raise corrupted(f"chunk data failed verification ({exc})", exc) from exc


def check_exists(location: Location, path: str, *, node: str, epoch: int) -> None:
    """Raise :class:`CheckpointNotFoundError` unless a group exists at ``path``."""
    if not location.exists(f"{path}/zarr.json"):
        raise CheckpointNotFoundError(
            f"no checkpoint for node {node!r} at epoch {epoch} in {location.display(path)!r}"
        )
