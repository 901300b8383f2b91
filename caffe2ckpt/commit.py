"""Commit records: small immutable JSON files under ``<prefix>/_commits/``, the only source of
truth for which checkpoints exist.

A record is created exclusively (never overwritten, never edited) after the data it names is
durable. Its file name carries everything needed to find it by listing alone::

    _commits/<epoch:012d>.<node>.<save_id>.json

``save_id`` is shared by all nodes saved together for an epoch and is also stored in each node's
group manifest; a record is valid only when the group it names carries the same save id, so a
record can never vouch for data written by a different save.

Imports: errors, location, naming. Not zarr, not prefect.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from caffe2ckpt.errors import CheckpointCorruptedError
from caffe2ckpt.location import Location
from caffe2ckpt.naming import COMMITS_DIR

__all__ = ["CommitRecord", "RecordRef", "delete_record", "list_records", "read_record",
           "write_record"]

RECORD_FORMAT = 1
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

    @classmethod
    def parse(cls, filename: str) -> RecordRef | None:
        """The ref a record file name encodes, or None for anything else in the directory."""
        if not filename.endswith(_SUFFIX) or filename.startswith("."):
            return None
        stem = filename[: -len(_SUFFIX)]
        epoch, sep, rest = stem.partition(".")
        node, sep2, save_id = rest.rpartition(".")
        if not (sep and sep2 and len(epoch) == 12 and epoch.isdigit() and node and save_id):
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
    format: int = RECORD_FORMAT

    @property
    def ref(self) -> RecordRef:
        return RecordRef(epoch=self.epoch, node=self.node, save_id=self.save_id)

    def to_dict(self) -> dict[str, Any]:
        """As JSON-ready data; non-finite metrics become the strings "nan", "inf", "-inf"."""
        data = asdict(self)
        data["metrics"] = {k: v if math.isfinite(v) else repr(v) for k, v in self.metrics.items()}
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CommitRecord:
        if data.get("format") != RECORD_FORMAT:
            raise ValueError(f"unknown record format {data.get('format')!r}")
        return cls(
            epoch=int(data["epoch"]),
            node=str(data["node"]),
            save_id=str(data["save_id"]),
            nodes=[str(n) for n in data["nodes"]],
            nbytes=int(data["nbytes"]),
            blob_count=int(data["blob_count"]),
            seconds=float(data["seconds"]),
            stop=bool(data["stop"]),
            stop_conditions=[str(k) for k in data["stop_conditions"]],
            metrics={str(k): float(v) for k, v in data["metrics"].items()},
            metadata={str(k): str(v) for k, v in data["metadata"].items()},
            writer=dict(data["writer"]),
            created=float(data["created"]),
        )


def _path(location: Location, ref: RecordRef) -> str:
    return location.path(COMMITS_DIR, ref.filename)


def write_record(location: Location, record: CommitRecord) -> None:
    """Create ``record``'s file exclusively and durably.

    Raises:
        FileExistsError: a record with the same epoch, node and save id exists already.
    """
    data = json.dumps(record.to_dict(), sort_keys=True, allow_nan=False).encode("utf-8")
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
    raw = location.read_bytes(_path(location, ref))
    try:
        record = CommitRecord.from_dict(json.loads(raw))
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
