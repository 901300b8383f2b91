"""Commit records: small immutable JSON files under ``<prefix>/_commits/``, the only source of
truth for which checkpoints exist.

A record is created exclusively (never overwritten, never edited) after the data it names is
durable. Its file name carries everything needed to find it by listing alone::

    _commits/<epoch:012d>.<node>.<save_id>.json

``save_id`` is shared by all nodes saved together for an epoch and is also stored in each node's
group manifest; a record is valid only when the group it names carries the same save id, so a
record can never vouch for data written by a different save.

A save id also names the run that wrote it: ``g<generation>-<random hex>``, where the
generation is the run's claim number on the prefix (:mod:`caffe2ckpt.store.protocol`), so the
lineage of runs (:mod:`caffe2ckpt.history.lineage`) can be ordered from a listing alone. Each record
also says which committed save its run started from (``parent``: epoch and generation, or
None for a fresh start). Save ids of another form (records of format 1) are generation 0.

Reading is strict (:mod:`caffe2ckpt.fs.strictjson`, and every field's type and range checked): a
damaged or crafted record — deeply nested, ``NaN``, a 400-digit number, a huge file — is
:class:`CheckpointCorruptedError` for its own node and epoch, so listings skip it and a resume
falls back past it.
"""

from __future__ import annotations

import json
import math
import re
import sys
import time
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any

from caffe2ckpt.fs import strictjson
from caffe2ckpt.errors import CheckpointCorruptedError, CheckpointWriteError
from caffe2ckpt.fs.location import Location
from caffe2ckpt.naming import COMMITS_DIR, MAX_EPOCH

__all__ = ["CommitRecord", "RecordRef", "delete_record", "list_records", "new_save_id",
           "read_record", "save_generation", "write_record"]

RECORD_FORMAT = 2
_READABLE_FORMATS = frozenset({1, 2})
_SUFFIX = ".json"
_SAVE_ID = re.compile(r"g([0-9]{1,18})-[0-9a-f]{8,64}")


def new_save_id(generation: int) -> str:
    """A fresh save id for a save of run ``generation`` (its claim number; 0 if it has none)."""
    if not 0 <= generation < 10**18:
        raise ValueError(f"generation {generation} does not fit a save id")
    return f"g{generation}-{uuid.uuid4().hex}"


def save_generation(save_id: str) -> int:
    """The generation a save id names (0 for ids that name none, e.g. format-1 records)."""
    match = _SAVE_ID.fullmatch(save_id)
    return int(match.group(1)) if match else 0


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
    """What one node's committed checkpoint of one epoch holds and who wrote it."""

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
    format: int = RECORD_FORMAT

    @property
    def generation(self) -> int:
        """The claim number of the run that wrote this record (see :func:`new_save_id`)."""
        return save_generation(self.save_id)

    @property
    def ref(self) -> RecordRef:
        return RecordRef(epoch=self.epoch, node=self.node, save_id=self.save_id)

    def to_dict(self) -> dict[str, Any]:
        """As JSON-ready data; non-finite metrics become the strings "nan", "inf", "-inf"."""
        data = asdict(self)
        data["metrics"] = {k: v if math.isfinite(v) else repr(v) for k, v in self.metrics.items()}
        data["parent"] = None if self.parent is None else list(self.parent)
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
        return cls(
            epoch=_number(data, "epoch", int, MAX_EPOCH),
            node=str(data["node"]),
            save_id=str(data["save_id"]),
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
            format=version,
        )


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


def _path(location: Location, ref: RecordRef) -> str:
    return location.path(COMMITS_DIR, ref.filename)


def write_record(location: Location, record: CommitRecord) -> None:
    """Create ``record``'s file exclusively and durably.

    Raises:
        FileExistsError: a record with the same epoch, node and save id exists already.
    """
    data = json.dumps(record.to_dict(), sort_keys=True, allow_nan=False).encode("utf-8")
    try:
        strictjson.check_size(data, f"commit record {record.ref.filename!r}")
    except ValueError as exc:  # readers would refuse it: never commit what cannot be read
        raise CheckpointWriteError(f"{location.display(COMMITS_DIR)}: {exc}") from exc
    location.create_exclusive(_path(location, record.ref), data)


def list_records(location: Location) -> list[RecordRef]:
    """Every record file under the prefix, sorted by epoch then node (listing only)."""
    refs = (RecordRef.parse(n) for n in location.list_names(location.path(COMMITS_DIR)))
    return sorted(r for r in refs if r is not None)


def read_record(location: Location, ref: RecordRef) -> CommitRecord:
    """Read and validate the record ``ref`` points to.

    Raises:
        CheckpointNotFoundError: the record file is gone.
        CheckpointCorruptedError: it is not a valid record for ``ref`` (garbage, truncated, or
            its content disagrees with its name).
    """
    try:
        raw = location.read_bytes(_path(location, ref), limit=strictjson.MAX_BYTES)
        record = CommitRecord.from_dict(strictjson.loads(raw))
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CheckpointCorruptedError(
            f"commit record {location.display(COMMITS_DIR, ref.filename)!r} is unreadable: {exc}",
            node=ref.node, epoch=ref.epoch, blob=ref.filename,
        ) from exc
    if record.ref != ref:
        raise CheckpointCorruptedError(
            f"commit record {location.display(COMMITS_DIR, ref.filename)!r} names "
            f"node {record.node!r} epoch {record.epoch} save {record.save_id!r}",
            node=ref.node, epoch=ref.epoch, blob=ref.filename,
        )
    return record


def delete_record(location: Location, ref: RecordRef) -> None:
    """Remove a record (it then no longer commits anything); missing is fine."""
    location.remove(_path(location, ref))
