"""Commit records: small immutable JSON files under ``<prefix>/_commits/``, the only source of
truth for which checkpoints exist and where their data is.

A record is created exclusively (never overwritten, never edited) after the data it names is
durable. Its file name carries everything needed to find it by listing alone::

    _commits/<epoch:012d>.<node>.<save_id>.json

``save_id`` is shared by all nodes saved together for an epoch (one *save*) and names the run
that wrote it (:func:`caffe2ckpt.store.format.paths.save_generation`). A record of format 3 names
the group it commits (``path``: ``<node>.<epoch>`` or ``<node>.<epoch>.<save_id>``, nothing else)
and vouches for it: the SHA-256 of every Zarr metadata file and the CRC32C of every chunk, by
array. Records of formats 1 and 2 (storage model 2) commit the group at ``<node>.<epoch>``, whose
manifest holds the chunk CRCs. Each record also says which committed save its run started from
(``parent``: epoch and generation, or None for a fresh start); since model 3 the run log
(:mod:`caffe2ckpt.store.commit.runs`) is what the lineage follows, and this copy is for model-2
runs.

Reading is strict (:mod:`caffe2ckpt.fs.strictjson`, and every field's type and range checked): a
damaged or crafted record — deeply nested, ``NaN``, a 400-digit number, a huge file, a path out
of its own group — is :class:`CheckpointCorruptedError` for its own node and epoch, so listings
skip it and a resume falls back past it.
"""

from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from caffe2ckpt.errors import (
    CheckpointCorruptedError,
    CheckpointWriteError,
    StorageCredentialsError,
)
from caffe2ckpt.fs import strictjson
from caffe2ckpt.fs.location import Location
from caffe2ckpt.naming import MAX_EPOCH
from caffe2ckpt.sharding import SavedLayout
from caffe2ckpt.store.format.chains import DeltaRecord
from caffe2ckpt.store.format.paths import COMMITS_DIR, group_name, save_generation

__all__ = ["RECORD_FORMAT", "CommitRecord", "RecordRef", "delete_record", "list_records",
           "read_record", "record_path", "write_record"]

RECORD_FORMAT = 3
DELTA_RECORD_FORMAT = 4  # a differential save (store.format.chains); others stay format 3
_READABLE_FORMATS = frozenset({1, 2, 3, 4})
_SUFFIX = ".json"


@dataclass(frozen=True, kw_only=True, order=True)
class RecordRef:
    """A commit record as seen in a listing: what its file name says."""

    epoch: int
    node: str
    save_id: str

    @property
    def filename(self) -> str:
        return f"{self.epoch:012d}.{self.node}.{self.save_id}{_SUFFIX}"

    @property
    def generation(self) -> int:
        return save_generation(self.save_id)

    @classmethod
    def parse(cls, filename: str) -> RecordRef | None:
        """The ref a record file name encodes, or None for anything else in the directory."""
        if not filename.endswith(_SUFFIX) or filename.startswith("."):
            return None
        stem = filename[: -len(_SUFFIX)]
        epoch, sep, rest = stem.partition(".")
        node, sep2, save_id = rest.rpartition(".")
        if not (sep and sep2 and len(epoch) == 12 and epoch.isascii() and epoch.isdigit()
                and node and save_id):  # isascii: isdigit() also takes "²", which int() refuses
            return None
        return cls(epoch=int(epoch), node=node, save_id=save_id)


@dataclass(frozen=True, kw_only=True)
class CommitRecord:
    """What one node's committed checkpoint of one epoch holds, where, and who wrote it."""

    epoch: int
    node: str
    save_id: str
    nodes: list[str]  # every node saved together with this one for this epoch
    nbytes: int
    blob_count: int
    seconds: float
    stop: bool = False  # the job's stop condition held after this epoch
    stop_conditions: list[str] = field(default_factory=list)  # keys of the conditions that held
    metrics: dict[str, float] = field(default_factory=dict)  # e.g. loss; NaN allowed
    metadata: dict[str, str] = field(default_factory=dict)  # Zarr metadata file -> sha256
    writer: dict[str, Any] = field(default_factory=dict)  # e.g. flow run id and run count
    created: float = field(default_factory=time.time)
    # the committed save the writing run started from: (epoch, generation); None: fresh start
    parent: tuple[int, int] | None = None
    path: str = ""  # the group, relative to the prefix ("" in formats 1-2: <node>.<epoch>)
    crcs: dict[str, tuple[int, ...]] = field(default_factory=dict)  # array -> chunk CRC32Cs
    started: float = 0.0  # when the save began (its leftovers' age counts from here)
    delta: DeltaRecord | None = None  # a differential save: what it needs from other groups
    layout: SavedLayout | None = None  # how the save's blobs are spread over its nodes
    # with delta_saves: the large blobs this save wrote whole, and why (none: an empty field)
    whole: dict[str, str] = field(default_factory=dict)
    format: int = RECORD_FORMAT

    def __post_init__(self) -> None:
        if self.delta is not None and self.format < DELTA_RECORD_FORMAT:
            object.__setattr__(self, "format", DELTA_RECORD_FORMAT)

    @property
    def generation(self) -> int:
        """The claim number of the run that wrote this record (see :mod:`~.layout`)."""
        return save_generation(self.save_id)

    @property
    def ref(self) -> RecordRef:
        return RecordRef(epoch=self.epoch, node=self.node, save_id=self.save_id)

    @property
    def group(self) -> str:
        """The group this record commits, relative to the prefix."""
        return self.path or group_name(self.node, self.epoch)

    @property
    def closure(self) -> dict[str, str]:
        """Every group this record needs (its own and, for a differential save, those it builds
        on), with the save id each belongs to: what a remover must not delete while the record
        stands."""
        own = {self.group: self.save_id}
        return own if self.delta is None else {**self.delta.closure(), **own}

    @property
    def bytes_written(self) -> int:
        """The bytes of data this save wrote (all of them, unless it is differential)."""
        return self.nbytes if self.delta is None else self.delta.written

    def to_dict(self) -> dict[str, Any]:
        """As JSON-ready data; non-finite metrics become the strings "nan", "inf", "-inf"."""
        data = asdict(self)
        data["metrics"] = {k: v if math.isfinite(v) else repr(v) for k, v in self.metrics.items()}
        data["parent"] = None if self.parent is None else list(self.parent)
        data["crcs"] = {k: list(v) for k, v in self.crcs.items()}
        if self.delta is None:
            del data["delta"]
        else:
            data["delta"] = self.delta.to_dict()
        if self.layout is None:
            del data["layout"]
        else:
            data["layout"] = self.layout.to_dict()
        if not self.whole:
            del data["whole"]
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CommitRecord:
        """Parse and validate a record (raises ValueError, TypeError or KeyError)."""
        version = data.get("format")
        if type(version) is not int or version not in _READABLE_FORMATS:
            raise ValueError(f"unknown record format {version!r}")
        parent = data.get("parent") if version >= 2 else None
        if parent is not None:
            if (not isinstance(parent, list) or len(parent) != 2
                    or not all(type(x) is int and 0 <= x < 10**18 for x in parent)):
                raise ValueError(f"bad parent {parent!r}")
            parent = (parent[0], parent[1])
        epoch = _number(data, "epoch", int, MAX_EPOCH)
        node, save_id = str(data["node"]), str(data["save_id"])
        path, crcs, started = "", {}, 0.0
        if version >= 3:
            path = data["path"]
            if path not in (group_name(node, epoch), group_name(node, epoch, save_id)):
                raise ValueError(f"path {path!r:.80} is not a group of this save")
            crcs = {str(k): _crcs(v) for k, v in data["crcs"].items()}
            started = float(_number(data, "started", float, _MAX_TIME))
        delta = None
        if version >= DELTA_RECORD_FORMAT:
            delta = DeltaRecord.from_dict(data["delta"], node=node, epoch=epoch,
                                          save_id=save_id, path=path)
        layout = _layout(data, node)
        return cls(
            epoch=epoch,
            node=node,
            save_id=save_id,
            nodes=[str(n) for n in data["nodes"]],
            nbytes=_number(data, "nbytes", int, _MAX_COUNT),
            blob_count=_number(data, "blob_count", int, _MAX_COUNT),
            seconds=float(_number(data, "seconds", float, _MAX_TIME)),
            stop=_bool(data["stop"]),
            stop_conditions=[str(k) for k in data["stop_conditions"]],
            metrics={str(k): _metric(v) for k, v in data["metrics"].items()},
            metadata={str(k): str(v) for k, v in data["metadata"].items()},
            writer=dict(data["writer"]),
            created=float(_number(data, "created", float, _MAX_TIME)),
            parent=parent,
            path=path,
            crcs=crcs,
            started=started,
            delta=delta,
            layout=layout,
            whole=_reasons(data.get("whole", {})),
            format=version,
        )


def _layout(data: dict[str, Any], node: str) -> SavedLayout | None:
    """The record's layout, if any: of the save's nodes, not naming this node as the writer of
    a blob it holds."""
    if data.get("layout") is None:
        return None
    layout = SavedLayout.from_dict(data["layout"])
    if sorted(layout.order) != sorted(map(str, data["nodes"])) or node in (
            layout.written_by.values()):
        raise ValueError("the layout's node order is not the save's nodes, or names this node "
                         "as the writer of a blob it does not hold")
    return layout


_MAX_COUNT = 2**63 - 1
_MAX_TIME = 253402300799  # 9999-12-31T23:59:59Z: the last second datetime can show


def _number(data: dict[str, Any], key: str, kind: type, high: int) -> int | float:
    """``data[key]`` if it is a number of ``kind`` (an int also counts as a float, a bool as
    neither) in ``[0, high]``: later arithmetic and ``datetime`` must not overflow on it."""
    value = data[key]
    kinds = (int,) if kind is int else (int, float)
    if type(value) not in kinds or not 0 <= value <= high:
        raise ValueError(f"{key} must be {kind.__name__} from 0 to {high}, got {value!r:.40}")
    return value


def _crcs(values: Any) -> tuple[int, ...]:
    """A list of unsigned 32-bit ints, checked at C speed (``map``, ``min``, ``max``: a record may
    list millions of chunks; a per-element generator took 3.4 s for 4 million)."""
    if not isinstance(values, list) or (values and (
            set(map(type, values)) != {int} or min(values) < 0 or max(values) >= 2**32)):
        raise ValueError(f"chunk checksums must be a list of 32-bit ints, got {values!r:.80}")
    return tuple(values)


def _reasons(value: Any) -> dict[str, str]:
    """Why blobs were written whole: blob -> a sentence (of 500 characters at most)."""
    if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                              and len(v) <= 500 for k, v in value.items()):
        raise ValueError(f"whole must map blob names to reasons, got {value!r:.80}")
    return dict(value)


def _bool(value: Any) -> bool:
    if type(value) is not bool:
        raise ValueError(f"stop must be true or false, got {value!r:.40}")
    return value


def _metric(value: Any) -> float:
    """A metric: a finite number, or one of the strings ``to_dict`` writes for the others."""
    if (type(value) in (float, bool) or value in ("nan", "inf", "-inf")
            or (type(value) is int and abs(value) <= sys.float_info.max)):  # float() overflows
        return float(value)
    raise ValueError(f"a metric must be a number, 'nan', 'inf' or '-inf', got {value!r:.40}")


def record_path(location: Location, ref: RecordRef) -> str:
    return location.path(COMMITS_DIR, ref.filename)


def write_record(location: Location, record: CommitRecord) -> None:
    """Create ``record``'s file exclusively and durably.

    If creating it fails after the file may exist (e.g. the directory's flush failed, or an
    object store's PUT timed out after it was stored), the record is taken back before the
    error is raised: a save that raised never leaves its epoch committed. If taking it back
    fails too, the error says the save *may* be committed (``maybe_committed``): the caller
    asks the records before it calls the epoch failed.

    Raises:
        FileExistsError: a record with the same epoch, node and save id exists already, and it
            is not this one (a create answered "exists" after its own first attempt was stored
            is this record: the location settles that by reading it back).
        CheckpointWriteError: the record could not be written (``maybe_committed`` as above).
    """
    data = json.dumps(record.to_dict(), sort_keys=True, allow_nan=False).encode("utf-8")
    try:
        strictjson.check_size(data, f"commit record {record.ref.filename!r}")
    except ValueError as exc:  # readers would refuse it: never commit what cannot be read
        raise CheckpointWriteError(f"{location.display(COMMITS_DIR)}: {exc}") from exc
    path = record_path(location, record.ref)
    try:
        location.create_exclusive(path, data)
    except FileExistsError:
        raise
    except BaseException as exc:
        try:  # the name holds this save's id: nobody else can have created it
            location.remove(path)
        except Exception as undo:  # reported with the original failure
            if not isinstance(exc, Exception):  # an interrupt stays one
                raise exc from undo
            raise CheckpointWriteError(
                f"commit record {location.display(COMMITS_DIR, record.ref.filename)!r} of node "
                f"{record.node!r} epoch {record.epoch} may be committed: writing it failed "
                f"({type(exc).__name__}: {exc}) and taking it back failed too "
                f"({type(undo).__name__}: {undo})", epoch=record.epoch,
                maybe_committed=True) from exc
        raise


def list_records(location: Location) -> list[RecordRef]:
    """Every record file under the prefix, sorted by epoch then node (listing only)."""
    refs = (RecordRef.parse(n) for n in location.list_names(location.path(COMMITS_DIR)))
    return sorted(r for r in refs if r is not None)


def read_record(location: Location, ref: RecordRef) -> CommitRecord:
    """Read and validate the record ``ref`` points to. A record being created where creates
    are not atomic (visible empty or cut short) is read once it is complete
    (:meth:`~caffe2ckpt.fs.location.Location.read_created_json`): until then its save is not
    committed, and it is not damage.

    Raises:
        CheckpointNotFoundError: the record file is gone.
        CheckpointCorruptedError: it is not a valid record for ``ref`` (garbage, truncated, or
            its content disagrees with its name).
    """
    where = location.display(COMMITS_DIR, ref.filename)
    try:
        record = CommitRecord.from_dict(location.read_created_json(record_path(location, ref)))
    except StorageCredentialsError:  # a ValueError, but the store refused: not damage
        raise
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CheckpointCorruptedError(f"commit record {where!r} is unreadable: {exc}",
                                       node=ref.node, epoch=ref.epoch, blob=ref.filename) from exc
    if record.ref != ref:
        raise CheckpointCorruptedError(
            f"commit record {where!r} names node {record.node!r} epoch {record.epoch} save "
            f"{record.save_id!r}", node=ref.node, epoch=ref.epoch, blob=ref.filename)
    return record


def delete_record(location: Location, ref: RecordRef) -> None:
    """Remove a record (it then no longer commits anything); missing is fine."""
    location.remove(record_path(location, ref))
