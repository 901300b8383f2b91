"""The manifest of a node's checkpoint: which blobs it holds and where their bytes are, and the
chunk layout the writer gives each array.

It is stored as ``attributes["caffe2ckpt"]`` of the node's Zarr group::

    {"format": 3, "node": "trainer_0", "epoch": 7, "save_id": "...",
     "arrays": {"<blob name>": {"path": "<array>", "dtype": "<f4", "shape": [..],
                                "order": "C", "chunk_rows": 4096}, ...},
     "packed": {"nbytes": N, "chunk": C, "names": [..], "dtypes": [..], "shapes": [[..], ..],
                "offsets": [..], "fortran": [indices of Fortran-ordered blobs]}}

Format 3 (storage model 3) is written before any chunk, so it holds no checksums: the commit
record keeps every chunk's CRC32C. Its chunk sizes must be exactly the ones the writer chooses
(:func:`chunk_rows`), so a crafted manifest cannot claim millions of tiny chunks. Formats 1 and 2
hold the CRCs (``"crc32c"``); an array of theirs may have no more chunks than their writers gave
it (:func:`_legacy_chunks`): format 1 cut rows into chunks of at most :data:`CHUNK_BYTES`, format
2 chose :func:`chunk_rows` as format 3 does.

Large blobs are listed by name under ``arrays``; small ones are columns under ``packed`` (ten
thousand tiny blobs must not cost ten thousand JSON objects). Pure data: no I/O, no zarr.
Parsing validates every entry, so a damaged manifest fails loudly instead of misplacing bytes,
and every size it claims is one numpy can allocate (each blob at most :data:`MAX_BLOB_BYTES`,
numpy's number of axes): a crafted claim fails here as ValueError, not later as MemoryError.
Whether the claimed bytes are really stored is checked by the reader, against the files.

Formats 2 and 3 store the last chunk of an array padded to the full chunk shape, as Zarr v3
requires; format 1 (still read) stored only its rows, which plain zarr cannot read.
"""

from __future__ import annotations

import functools
import itertools
import math
import re
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from caffe2ckpt.fs.localio import DIRECT_ALIGN

__all__ = ["CHUNK_BYTES", "FINE_CHUNK_BYTES", "FORMAT_VERSION", "ROWS_CHUNK_BYTES", "MAX_BLOB_BYTES", "PACKED_ARRAY", "BlobInfo",
           "BlobManifestError", "Inherited", "Manifest", "chunk_key", "chunk_keys", "chunk_rows", "itemsize",
           "stored_spec"]

FORMAT_VERSION = 3
DELTA_FORMAT = 4  # a differential save's group: format 3 plus a "delta" section
SPAN_FORMAT = 5  # format 4 plus row spans; a chain need not start with the blob stored whole
_READABLE_FORMATS = frozenset({1, 2, 3, 4, 5})
CHUNK_BYTES = 16 * 1024 * 1024
# the values of a row overlay on a filesystem where files are cheap (not an object store): small
# chunks, so a restore reads only those holding rows no newer span replaced
FINE_CHUNK_BYTES = 1024 * 1024
# a blob split by rows across a job's nodes (caffe2ckpt.Layout): another node count reads its
# rows from these chunks, all of the first and last it touches; 2 MiB keeps that within 5% of
# a share of 80 MiB and more (a 1 GiB table on up to 12 nodes)
ROWS_CHUNK_BYTES = 2 * 1024 * 1024
PACKED_ARRAY = "_packed"
_KINDS = frozenset("biufcSU")
# an array path is one segment made by naming.blob_path: never "/", never "." or ".."
_SEGMENT = re.compile(r"[A-Za-z0-9_.%~-]{1,200}")
MAX_BLOB_BYTES = 2**62  # also bounds each axis: numpy refuses sizes near 2**63
_MAX_NDIM = 64 if np.lib.NumpyVersion(np.__version__) >= "2.0.0" else 32  # NPY_MAXDIMS


class BlobManifestError(ValueError):
    """The manifest's entry of one blob (``blob``: its name, or :data:`PACKED_ARRAY`) is not
    one its writer could have made."""

    def __init__(self, message: str, blob: str) -> None:
        super().__init__(message)
        self.blob = blob


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


class Inherited(NamedTuple):
    """A blob a differential save does not store whole: ``kind`` "same" (nothing of it here)
    or "rows" (rows of it here: a row overlay, a span, or both), its logical ``info`` (dtype,
    shape, order) and the ``chain`` of older groups that hold the rest of its rows, oldest
    first: each holds the blob whole, or a span and/or an overlay of it (format 4: the first
    holds it whole, the others overlays). Its rows are, each, those of the newest group holding
    them (this save's own last): what a plain-zarr reader follows. The commit record holds the
    same chain with the digests that vouch for it."""

    kind: str
    info: BlobInfo
    chain: tuple[str, ...]


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
    # format 4 (a differential save): blobs not stored whole here, by name: their kind ("same":
    # nothing here; "rows": a row overlay here), their logical dtype, shape and order; the
    # overlays' arrays (row ids, values); and the group of the save this one builds on
    inherited: dict[str, Inherited] = field(default_factory=dict)
    overlays: dict[str, tuple[BlobInfo, BlobInfo]] = field(default_factory=dict)
    # format 5: rows [start, start + len) of a blob stored here as one array, by blob
    spans: dict[str, tuple[int, BlobInfo]] = field(default_factory=dict)
    base: str = ""

    def __post_init__(self) -> None:
        if self.inherited and self.format < DELTA_FORMAT:
            object.__setattr__(self, "format", SPAN_FORMAT if self.spans else DELTA_FORMAT)

    @property
    def padded_edges(self) -> bool:
        """Whether each array's last chunk is stored at the full chunk shape (Zarr v3)."""
        return self.format >= 2

    @functools.cached_property
    def stored_blobs(self) -> dict[str, BlobInfo]:
        """The blobs stored whole in this group (arrays first, then packed ones, each in saved
        order)."""
        return {**self.arrays, **{b.name: b for b in self.packed}}

    @functools.cached_property
    def blobs(self) -> dict[str, BlobInfo]:
        """Every blob of the node's checkpoint by name: those stored whole here, then (a
        differential save) those read through other groups, with their logical dtype and
        shape."""
        if not self.inherited:
            return self.stored_blobs
        return {**self.stored_blobs, **{n: i.info for n, i in self.inherited.items()}}

    @functools.cached_property
    def nbytes(self) -> int:
        """The bytes of every blob of the node's checkpoint (not only those stored here)."""
        packed = self.packed_blob_bytes
        if packed is None:
            packed = sum(b.nbytes for b in self.packed)
        return (sum(b.nbytes for b in self.arrays.values()) + packed
                + sum(i.info.nbytes for i in self.inherited.values()))

    @property
    def stored_nbytes(self) -> int:
        """The bytes of data this group holds: its whole blobs, overlays and spans."""
        return (self.nbytes - sum(i.info.nbytes for i in self.inherited.values())
                + sum(info.nbytes for info in self.delta_arrays()))

    def delta_arrays(self) -> list[BlobInfo]:
        """The arrays of this group's row overlays (ids, then values, per blob) and spans."""
        return [*(info for pair in self.overlays.values() for info in pair),
                *(info for _, info in self.spans.values())]

    def to_dict(self) -> dict[str, Any]:
        packed = self.packed
        legacy = self.format < 3  # checksums lived in the manifest before the record kept them
        return {
            "format": self.format,
            "node": self.node,
            "epoch": self.epoch,
            "save_id": self.save_id,
            "arrays": {b.name: {"path": b.path, "dtype": b.dtype, "shape": list(b.shape),
                                "order": b.order, "chunk_rows": b.chunk_rows,
                                **({"crc32c": list(b.crcs)} if legacy else {})}
                       for b in self.arrays.values()},
            "packed": {
                "nbytes": self.packed_nbytes,
                "chunk": self.packed_chunk,
                **({"crc32c": list(self.packed_crcs)} if legacy else {}),
                "names": [b.name for b in packed],
                "dtypes": [b.dtype for b in packed],
                "shapes": [b.shape for b in packed],
                "offsets": [b.offset for b in packed],
                "fortran": [i for i, b in enumerate(packed) if b.order == "F"],
            },
            **({"delta": self._delta_dict()} if self.format >= DELTA_FORMAT else {}),
        }

    def _delta_dict(self) -> dict[str, Any]:
        def entry(info: BlobInfo) -> dict[str, Any]:
            return {"path": info.path, "dtype": info.dtype, "shape": list(info.shape),
                    "order": info.order, "chunk_rows": info.chunk_rows}
        spans = ({"spans": {n: {"start": start, **entry(info)}
                            for n, (start, info) in self.spans.items()}}
                 if self.format >= SPAN_FORMAT else {})
        return {"base": self.base,
                "blobs": {n: {"kind": b.kind, "dtype": b.info.dtype, "shape": list(b.info.shape),
                              "order": b.info.order, "chain": list(b.chain)}
                          for n, b in self.inherited.items()},
                "overlays": {n: {"rows": entry(r), "values": entry(v)}
                             for n, (r, v) in self.overlays.items()}, **spans}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Manifest:
        """Parse and validate a manifest (raises ValueError, TypeError or KeyError)."""
        version = data.get("format")
        if type(version) is not int or version not in _READABLE_FORMATS:
            raise ValueError(f"unknown format version {version!r}")
        arrays = {name: _array_info(name, entry, version)
                  for name, entry in data["arrays"].items()}
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
        _check_chunks(PACKED_ARRAY, "the packed array", (nbytes,), 1, chunk, version)
        packed_crcs = (_crcs(columns["crc32c"], _ceil_div(nbytes, chunk) if nbytes else 0)
                       if version < 3 else ())
        inherited, overlays, spans, base = (
            _delta_section(data["delta"], set(arrays) | set(names), set(paths), version)
            if version >= DELTA_FORMAT else ({}, {}, {}, ""))
        return cls(node=str(data["node"]), epoch=int(data["epoch"]),
                   save_id=str(data["save_id"]), arrays=arrays, packed=packed,
                   packed_nbytes=nbytes, packed_chunk=chunk, packed_crcs=packed_crcs,
                   format=version, packed_blob_bytes=packed_bytes, inherited=inherited,
                   overlays=overlays, spans=spans, base=base)

    def chunk_crcs(self, recorded: dict[str, tuple[int, ...]],
                   only: Collection[str] | None = None) -> dict[str, tuple[int, ...]]:
        """The CRC32C of every chunk (of the arrays at paths ``only``, if given), by array path:
        from the commit record's ``recorded`` (format 3 on), else from this manifest. Raises
        ValueError if a count is not the array's number of chunks."""
        out = {}
        arrays = [(info.path, stored_spec(info)[1], info.chunk_rows, info.crcs)
                  for info in self.arrays.values()]
        if self.packed_nbytes:
            arrays.append((PACKED_ARRAY, (self.packed_nbytes,), self.packed_chunk,
                           self.packed_crcs))
        arrays += [(info.path, stored_spec(info)[1], info.chunk_rows, ())
                   for info in self.delta_arrays()]
        for path, shape, rows, own in arrays:
            if only is not None and path not in only:
                continue
            crcs = own if self.format < 3 else recorded.get(path, ())
            if len(crcs) != _ceil_div(shape[0], rows):
                raise ValueError(f"array {path!r}: {len(crcs)} chunk checksums recorded for "
                                 f"{_ceil_div(shape[0], rows)} chunks")
            out[path] = tuple(crcs)
        return out

    def files(self) -> list[str]:
        """Every file of the group, relative to it: chunks first, then the arrays' metadata,
        the group's ``zarr.json`` last (exactly what the writer creates)."""
        chunks = [f"{info.path}/{key}"
                  for info in [*self.arrays.values(), *self.delta_arrays()]
                  for key in chunk_keys(len(stored_spec(info)[1]),
                                        _ceil_div(info.shape[0], info.chunk_rows))]
        if self.packed_nbytes:
            chunks += [f"{PACKED_ARRAY}/{key}"
                       for key in chunk_keys(1, _ceil_div(self.packed_nbytes, self.packed_chunk))]
        return chunks + list(reversed(self.metadata_files()))

    def metadata_files(self) -> dict[str, str | None]:
        """The group's Zarr metadata files (relative paths) and the blob each belongs to."""
        files: dict[str, str | None] = {"zarr.json": None}
        if self.packed_nbytes:
            files[f"{PACKED_ARRAY}/zarr.json"] = None
        for info in [*self.arrays.values(), *self.delta_arrays()]:
            files[f"{info.path}/zarr.json"] = info.name
        return files


_MAX_CHAIN = 65  # groups in a chain (caffe2ckpt.store.format.chains.MAX_GROUPS)
_OVERLAY = re.compile(r"_(rows|values|span)\.[A-Za-z0-9_.%~-]{1,200}")


def _delta_section(data: dict[str, Any], stored: set[str], paths: set[str], version: int
                   ) -> tuple[dict[str, Inherited], dict[str, tuple[BlobInfo, BlobInfo]],
                              dict[str, tuple[int, BlobInfo]], str]:
    """A format-4 or -5 manifest's ``delta`` section: inherited blobs (logical info and kind),
    their overlays' arrays (row ids: 1-d int32 or int64; values: the blob's dtype, its row
    shape), their spans (format 5: a start row and an array of the blob's dtype and row shape
    within the blob's rows), and the base group's name (for people and plain-zarr readers;
    records decide). Every blob of kind "rows" has an overlay here (format 4), or an overlay, a
    span or both (format 5), and only those blobs do."""
    inherited = {name: _inherited(name, entry, stored) for name, entry in data["blobs"].items()}
    overlays = {name: _overlay(name, entry, inherited.get(name), paths)
                for name, entry in data["overlays"].items()}
    spans = ({name: _span(name, entry, inherited.get(name), paths)
              for name, entry in data["spans"].items()} if version >= SPAN_FORMAT else {})
    rows = {name for name, i in inherited.items() if i.kind == "rows"}
    if (set(overlays) | set(spans)) != rows or (version < SPAN_FORMAT and set(overlays) != rows):
        raise ValueError("the blobs of kind 'rows' and those with overlays or spans differ")
    base = data["base"]
    if not isinstance(base, str) or len(base) > 400:
        raise ValueError("bad base group")
    return inherited, overlays, spans, base


def _inherited(name: str, entry: dict[str, Any], stored: set[str]) -> Inherited:
    """One blob a differential save does not store whole."""
    kind, chain = entry["kind"], entry["chain"]
    info = BlobInfo(name, entry["dtype"], _shape(entry["shape"], entry["dtype"], name),
                    entry["order"])
    if (kind not in ("same", "rows") or name in stored or info.order not in ("C", "F")
            or not isinstance(chain, list) or not 0 < len(chain) <= _MAX_CHAIN
            or not all(isinstance(g, str) and len(g) <= 400 for g in chain)):
        raise ValueError(f"blob {name!r:.80}: bad delta entry")
    return Inherited(kind, info, tuple(chain))


def _overlay(name: str, entry: dict[str, Any], blob: Inherited | None,
             paths: set[str]) -> tuple[BlobInfo, BlobInfo]:
    """The row overlay of ``blob`` (which must be of kind "rows"): ids, then values."""
    if blob is None or blob.kind != "rows" or not blob.info.shape:
        raise ValueError(f"blob {name!r:.80}: an overlay of a blob that has no rows")
    rows = _overlay_info(name, entry["rows"], "rows", paths)
    values = _overlay_info(name, entry["values"], "values", paths)
    if (rows.dtype not in ("<i4", "<i8") or len(rows.shape) != 1
            or values.dtype != blob.info.dtype or values.shape[0] != rows.shape[0]
            or values.shape[1:] != blob.info.shape[1:]):
        raise ValueError(f"blob {name!r:.80}: its overlay does not fit the blob")
    return rows, values


def _span(name: str, entry: dict[str, Any], blob: Inherited | None,
          paths: set[str]) -> tuple[int, BlobInfo]:
    """The span of ``blob`` (of kind "rows"): where it starts, and its array, which holds
    consecutive rows of the blob in its dtype."""
    if blob is None or blob.kind != "rows" or not blob.info.shape:
        raise ValueError(f"blob {name!r:.80}: a span of a blob that has no rows")
    start = _size(entry["start"], f"blob {name!r:.80}: span start")
    info = _overlay_info(name, entry, "span", paths)
    if (info.dtype != blob.info.dtype or info.shape[1:] != blob.info.shape[1:]
            or start + info.shape[0] > blob.info.shape[0]):
        raise ValueError(f"blob {name!r:.80}: its span does not fit the blob")
    return start, info


def _overlay_info(name: str, entry: dict[str, Any], part: str, paths: set[str]) -> BlobInfo:
    info = _array_info(name, entry, FORMAT_VERSION, pattern=_OVERLAY, fine=part == "values")
    if not info.path.startswith(f"_{part}.") or info.path in paths:  # type: ignore[union-attr]
        raise ValueError(f"blob {name!r:.80}: bad overlay path")
    paths.add(info.path)  # type: ignore[arg-type]
    return info


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


def _array_info(name: str, entry: dict[str, Any], version: int,
                pattern: re.Pattern[str] = _SEGMENT, fine: bool = False) -> BlobInfo:
    shape = _shape(entry["shape"], entry["dtype"], name)
    rows = _size(entry["chunk_rows"], f"blob {name!r:.80}: chunk_rows")
    info = BlobInfo(name, entry["dtype"], shape, entry["order"], path=entry["path"],
                    chunk_rows=rows)
    info.nbytes  # noqa: B018 - validates the dtype
    if (not info.shape or min(info.shape) <= 0 or info.order not in ("C", "F")
            or not isinstance(info.path, str) or not pattern.fullmatch(info.path)
            or info.path in (".", "..") or info.path.startswith(".")
            or not 0 < info.chunk_rows <= info.shape[0]):
        raise ValueError(f"bad array entry for blob {name!r}")
    dtype, stored = stored_spec(info)
    _check_chunks(name, f"blob {name!r:.80}", stored, dtype.itemsize, rows, version, fine)
    if version < 3:
        info = info._replace(crcs=_crcs(entry["crc32c"], _ceil_div(shape[0], rows)))
    return info


def _check_chunks(blob: str, what: str, shape: tuple[int, ...], itemsize: int, rows: int,
                  version: int, fine: bool = False) -> None:
    """Chunks are what the writer makes: exactly :func:`chunk_rows` rows in format 3, or those
    of :data:`ROWS_CHUNK_BYTES` (a blob split by rows across nodes), or with ``fine`` (an
    overlay's values) of :data:`FINE_CHUNK_BYTES`; in formats 1-2, no more chunks than their
    writers made (:func:`_legacy_chunks`).

    Raises:
        BlobManifestError: they are not.
    """
    if not shape[0]:
        return
    if fine and rows == chunk_rows(shape, itemsize, FINE_CHUNK_BYTES):
        return
    if version >= 3:
        if rows != chunk_rows(shape, itemsize) and rows != chunk_rows(shape, itemsize,
                                                                        ROWS_CHUNK_BYTES):
            raise BlobManifestError(f"{what}: {rows} rows per chunk is not the writer's "
                                    f"{chunk_rows(shape, itemsize)}", blob)
        return
    most = _legacy_chunks(shape, itemsize, version)
    if _ceil_div(shape[0], rows) > most:
        raise BlobManifestError(f"{what}: {_ceil_div(shape[0], rows)} chunks claimed where the "
                                f"writer of format {version} made {most}", blob)


def _legacy_chunks(shape: tuple[int, ...], itemsize: int, version: int) -> int:
    """How many chunks the writer of format ``version`` (1 or 2) gave an array of ``shape``:
    format 1 (written before git ba5d572) stored ``CHUNK_BYTES // row bytes`` rows per chunk
    (at least one), format 2 (storage model 2) :func:`chunk_rows` rows, as format 3 does."""
    if version == 1:
        row_bytes = itemsize * math.prod(shape[1:])
        return _ceil_div(shape[0], max(1, min(shape[0], CHUNK_BYTES // max(row_bytes, 1))))
    return _ceil_div(shape[0], chunk_rows(shape, itemsize))


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def stored_spec(info: BlobInfo) -> tuple[np.dtype, tuple[int, ...]]:
    """The dtype and shape a blob's array is stored with: little-endian numbers; unicode and
    byte strings as their code units (uint32 / uint8) with one extra trailing axis."""
    dtype = np.dtype(info.dtype)
    if dtype.kind == "U":
        return np.dtype("<u4"), info.shape + (dtype.itemsize // 4,)
    if dtype.kind == "S":
        return np.dtype(np.uint8), info.shape + (dtype.itemsize,)
    return (dtype.newbyteorder("<") if dtype.byteorder == ">" else dtype), info.shape


def chunk_rows(shape: tuple[int, ...], itemsize: int, target: int = CHUNK_BYTES) -> int:
    """Rows per chunk (chunks split axis 0 only): at most about ``target`` bytes each; a
    whole number of ``DIRECT_ALIGN`` blocks where the row size allows (every chunk can then be
    read straight from the disk into its place); and chunks as even as that allows, because the
    last one is padded to full size."""
    n = shape[0]
    row_bytes = max(1, itemsize * math.prod(shape[1:]))
    most = max(1, target // row_bytes)
    if n <= most:
        return n
    step = DIRECT_ALIGN // math.gcd(row_bytes, DIRECT_ALIGN)
    step = step if step <= most else 1
    most -= most % step
    fewest = _ceil_div(n, most)

    def rows(chunks: int) -> int:
        return _ceil_div(_ceil_div(n, chunks), step) * step

    # a few more chunks than the fewest often divide the rows evenly: no padding at all
    return min((rows(k) for k in range(fewest, fewest + 8)),
               key=lambda r: (_ceil_div(n, r) * r, -r))


def chunk_key(ndim: int, index: int) -> str:
    """The key of an array's chunk ``index`` along axis 0 (Zarr's default chunk key encoding
    with the ``.`` separator: ``c.3.0`` for a 2-d array)."""
    return f"c.{index}{'.0' * (ndim - 1)}"


def chunk_keys(ndim: int, count: int) -> list[str]:
    """The keys of an array's ``count`` chunks along axis 0 (:func:`chunk_key`)."""
    return [chunk_key(ndim, i) for i in range(count)]
