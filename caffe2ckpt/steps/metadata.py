"""What :class:`~caffe2ckpt.steps.StepCheckpointManager` tells about its steps and its prefix
without reading data: a blob's, a step's and the prefix's metadata, and the custom root
metadata stored once in ``_metadata.json``."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from typing import Any

from caffe2ckpt.errors import (
    CheckpointCorruptedError,
    CheckpointNotFoundError,
    JobDefinitionError,
    StorageCredentialsError,
)
from caffe2ckpt.fs import strictjson
from caffe2ckpt.fs.location import Location
from caffe2ckpt.history.lineage import Save
from caffe2ckpt.store.commit.protocol import CheckpointStore
from caffe2ckpt.store.format.manifest import BlobInfo
from caffe2ckpt.store.format.paths import ROOT_METADATA

__all__ = ["BlobMetadata", "RootMetadata", "StepMetadata", "as_metadata", "blob_metadata",
           "read_root_metadata", "step_metadata", "write_root_metadata"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class BlobMetadata:
    dtype: str
    shape: tuple[int, ...]
    nbytes: int


@dataclass(frozen=True)
class StepMetadata:
    """What the commit records of a step say (no data is read)."""

    step: int
    nodes: list[str]
    nbytes: int  # its blobs' bytes, a replicated blob once (a restore gives each node a copy)
    metrics: dict[str, float]
    created: float
    writer: dict[str, Any]
    stop: bool
    kind: str = "full"  # "delta": a differential save (it builds on older saves)
    bytes_written: int = 0  # the bytes of data its save wrote (nbytes unless a delta)


@dataclass(frozen=True)
class RootMetadata:
    """The prefix as a whole: its committed steps and the custom metadata given at creation."""

    directory: str  # the prefix as given
    steps: list[int]
    custom: dict[str, Any] = field(default_factory=dict)


def step_metadata(info: Save) -> StepMetadata:
    """The :class:`StepMetadata` of the committed save ``info``, from its records."""
    records = info.records.values()
    return StepMetadata(step=info.epoch, nodes=sorted(info.records), nbytes=info.nbytes,
                        metrics=info.metrics, created=info.created,
                        writer=dict(info.first.writer), stop=info.stop,
                        kind="delta" if any(r.delta for r in records) else "full",
                        bytes_written=sum(r.bytes_written for r in records))


def blob_metadata(store: CheckpointStore, info: Save) -> dict[str, dict[str, BlobMetadata]]:
    """Every node's blobs of the committed save ``info`` as a restore by its own nodes gives
    them, from the manifests only: a node's own blobs and the replicated blobs another node
    wrote for it."""
    manifests: dict[str, dict[str, BlobInfo]] = {}

    def blobs(node: str) -> dict[str, BlobInfo]:
        if node not in manifests:
            manifests[node] = store.manifest(info.records[node]).blobs
        return manifests[node]

    def lent(node: str, name: str, writer: str) -> BlobInfo:
        found = blobs(writer).get(name) if writer in info.records else None
        if found is None:
            raise CheckpointCorruptedError(
                f"epoch {info.epoch} under {store.location.display()!r}: node {node!r}'s "
                f"record says node {writer!r} wrote its replicated blob {name!r}, which that "
                "node's checkpoint does not hold", node=node, epoch=info.epoch, blob=name)
        return found

    out = {}
    for node, record in sorted(info.records.items()):
        borrowed = record.layout.written_by if record.layout is not None else {}
        out[node] = as_metadata({**{name: lent(node, name, writer)
                                    for name, writer in borrowed.items()}, **blobs(node)})
    return out


def as_metadata(blobs: dict[str, BlobInfo]) -> dict[str, BlobMetadata]:
    """``blobs`` as :class:`BlobMetadata`, by name in order."""
    return {name: BlobMetadata(b.dtype, tuple(b.shape), b.nbytes)
            for name, b in sorted(blobs.items())}


def write_root_metadata(location: Location, custom: dict[str, Any]) -> None:
    """Store ``custom`` as the prefix's root metadata, once: metadata already there is kept
    (a WARNING when it differs).

    Raises:
        JobDefinitionError: ``custom`` is not strict JSON of a size readers accept.
    """
    try:  # stored as strict JSON (no NaN), of a size readers accept
        data = strictjson.check_size(json.dumps(custom, sort_keys=True, default=str,
                                                allow_nan=False).encode(), "root metadata")
    except ValueError as exc:
        raise JobDefinitionError(f"cannot store root metadata {custom!r:.200}: {exc}") from exc
    try:
        location.create_exclusive(location.path(ROOT_METADATA), data)
    except FileExistsError:
        try:
            stored = read_root_metadata(location)
        except CheckpointCorruptedError:
            stored = None
        if stored != json.loads(data):
            logger.warning("%s already has other root metadata; keeping it",
                           location.display(ROOT_METADATA))


def read_root_metadata(location: Location) -> dict[str, Any]:
    """The prefix's root metadata ({} when none was stored).

    Raises:
        CheckpointCorruptedError: it is there but unreadable.
    """
    try:
        return location.read_created_json(location.path(ROOT_METADATA))
    except CheckpointNotFoundError:
        return {}
    except StorageCredentialsError:  # a ValueError, but the store refused: not damage
        raise
    except ValueError as exc:
        raise CheckpointCorruptedError(
            f"root metadata {location.display(ROOT_METADATA)!r} is unreadable: {exc}",
            blob=ROOT_METADATA) from exc
