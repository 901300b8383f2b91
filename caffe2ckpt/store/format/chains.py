"""What a differential save's commit record says about the data it needs from other saves.

A save written with ``delta_saves`` stores, per blob, one of three things in its own group: the
whole blob (as any save does), a *row overlay* (the ids of the rows that changed since the save
it builds on and their values: two plain Zarr arrays ``_rows.<blob path>`` and
``_values.<blob path>``), or nothing (the blob did not change). So reading such a blob needs
other, older groups of the same node: the one holding the blob whole, then each overlay on top
of it in epoch order. Its commit record (format 4) carries that whole resolution in
:class:`DeltaRecord`, so a restore and ``gc``'s mark phase read one record, never the records of
the saves it builds on (which retention may have removed):

- ``groups``: every other group the save needs (its *closure*, with its own), each with the
  SHA-256 of its ``zarr.json`` (which names its save) and of the metadata of every array used
  from it, and the CRC32C of those arrays' chunks;
- ``chains``: per blob not stored whole in the save's own group, indices into ``groups``: the
  groups that still give rows of it (a whole copy, spans, overlays), oldest first; a row's
  value is the newest group's holding it (the save's own group, if its manifest lists a span or
  overlay of the blob, last);
- ``digests``: per such blob, the xxh3-128 of its bytes as they were in memory at save time
  (stored form: C order, little-endian), checked once the chain is applied: a changed-rows hint
  that missed rows, or a wrong source, is damage at restore, never wrong data;
- ``depth``: how many saves in a row (this one included) build on one another (the writer's
  turn of parts: :mod:`caffe2ckpt.store.delta.links`); ``written``: the bytes of data this save
  wrote.

Validation is strict and bounded (:meth:`DeltaRecord.from_dict`): a group must be a group of the
same node, of an older epoch, of the same run (version 1: a delta builds only on saves of its
own run), named at most once; chains point into ``groups`` in strictly increasing epochs; at most
:data:`MAX_GROUPS` groups. Anything else is a damaged record.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from caffe2ckpt.store.format.paths import parse_group_name, save_generation

__all__ = ["DIGEST_ALGORITHM", "MAX_GROUPS", "ChainGroup", "DeltaRecord", "overlay_paths",
           "span_path"]

DIGEST_ALGORITHM = "xxh3_128"
MAX_GROUPS = 65  # older groups a save may need (the writer writes blobs whole to stay within)
_DIGEST = re.compile(r"[0-9a-f]{32}")
_SHA256 = re.compile(r"[0-9a-f]{64}")
_MAX_COUNT = 2**63 - 1
OVERLAY_ROWS = "_rows."
OVERLAY_VALUES = "_values."
SPAN = "_span."


def overlay_paths(blob_path: str) -> tuple[str, str]:
    """The array paths of the row overlay of the blob stored at ``blob_path``: its row ids and
    its values. They start with ``_``, which no blob's path does."""
    return OVERLAY_ROWS + blob_path, OVERLAY_VALUES + blob_path


def span_path(blob_path: str) -> str:
    """The array path of the span (consecutive rows) of the blob stored at ``blob_path``."""
    return SPAN + blob_path


@dataclass(frozen=True)
class ChainGroup:
    """Another save's group that a differential save needs, and what it vouches for there."""

    group: str  # relative to the prefix
    save_id: str
    metadata: dict[str, str]  # relative file -> SHA-256 ("zarr.json" always)
    crcs: dict[str, tuple[int, ...]]  # array path -> chunk CRC32Cs

    @property
    def epoch(self) -> int:
        return parse_group_name(self.group).epoch  # type: ignore[union-attr] # checked

    def to_dict(self) -> dict[str, Any]:
        return {"group": self.group, "save_id": self.save_id, "metadata": dict(self.metadata),
                "crcs": {k: list(v) for k, v in self.crcs.items()}}


@dataclass(frozen=True)
class DeltaRecord:
    """The part of a format-4 commit record that resolves a differential save."""

    depth: int
    written: int
    groups: tuple[ChainGroup, ...] = ()
    chains: dict[str, tuple[int, ...]] = field(default_factory=dict)
    digests: dict[str, str] = field(default_factory=dict)

    def closure(self) -> dict[str, str]:
        """The other groups this save needs, with the save id each belongs to."""
        return {g.group: g.save_id for g in self.groups}

    def to_dict(self) -> dict[str, Any]:
        return {"depth": self.depth, "written": self.written,
                "groups": [g.to_dict() for g in self.groups],
                "chains": {k: list(v) for k, v in self.chains.items()},
                "digests": dict(self.digests), "algorithm": DIGEST_ALGORITHM}

    @classmethod
    def from_dict(cls, data: Any, *, node: str, epoch: int, save_id: str,
                  path: str) -> DeltaRecord:
        """Parse and validate (raises ValueError, TypeError or KeyError)."""
        if not isinstance(data, dict) or data.get("algorithm") != DIGEST_ALGORITHM:
            raise ValueError("delta: not a delta description of a known digest algorithm")
        raw_groups = data["groups"]
        if not isinstance(raw_groups, list) or not 0 < len(raw_groups) <= MAX_GROUPS:
            raise ValueError(f"delta: groups must be a list of 1 to {MAX_GROUPS} entries")
        groups = tuple(_group(g, node, epoch, save_id, path) for g in raw_groups)
        if len({g.group for g in groups}) != len(groups):
            raise ValueError("delta: a group is named twice")
        chains = _chains(data["chains"], groups)
        digests = data["digests"]
        if (not isinstance(digests, dict) or set(digests) != set(chains)
                or not all(isinstance(v, str) and _DIGEST.fullmatch(v) for v in digests.values())):
            raise ValueError("delta: digests must give one xxh3-128 per chained blob")
        used = {i for chain in chains.values() for i in chain}
        if used != set(range(len(groups))):
            raise ValueError("delta: a group is named that no chain uses")
        return cls(depth=_count(data["depth"], "depth", 1), written=_count(data["written"],
                                                                           "written", 0),
                   groups=groups, chains=chains, digests=dict(digests))


def _count(value: Any, what: str, least: int) -> int:
    if type(value) is not int or not least <= value <= _MAX_COUNT:
        raise ValueError(f"delta: {what} must be an int >= {least}, got {value!r:.40}")
    return value


def _group(entry: Any, node: str, epoch: int, save_id: str, path: str) -> ChainGroup:
    """One entry of ``groups``: a group of ``node``, older than ``epoch``, of the same run."""
    if not isinstance(entry, dict):
        raise ValueError("delta: a group entry must be an object")
    name, owner = entry["group"], entry["save_id"]
    if not _older_group_of_run(name, owner, node, epoch, save_id, path):
        raise ValueError(f"delta: {name!r:.80} is not an older group of node {node!r} written "
                         "by the same run")
    metadata, crcs = entry["metadata"], entry["crcs"]
    if (not isinstance(metadata, dict) or "zarr.json" not in metadata
            or not all(isinstance(k, str) and isinstance(v, str) and _SHA256.fullmatch(v)
                       for k, v in metadata.items())):
        raise ValueError(f"delta: group {name!r:.80}: bad metadata digests")
    if not isinstance(crcs, dict) or not all(isinstance(k, str) and _is_crc_list(v)
                                             for k, v in crcs.items()):
        raise ValueError(f"delta: group {name!r:.80}: bad chunk checksums")
    return ChainGroup(name, owner, dict(metadata), {k: tuple(v) for k, v in crcs.items()})


def _older_group_of_run(name: Any, owner: Any, node: str, epoch: int, save_id: str,
                        path: str) -> bool:
    """Whether ``name`` is a group of ``node`` below ``epoch`` (not ``path``) holding a save
    ``owner`` of the run that wrote ``save_id``."""
    parsed = parse_group_name(name) if isinstance(name, str) else None
    if parsed is None or not isinstance(owner, str):
        return False
    generation = save_generation(owner)
    return (parsed.node == node and parsed.epoch < epoch and name != path
            and parsed.save_id in (None, owner) and generation > 0
            and generation == save_generation(save_id))


def _is_crc_list(values: Any) -> bool:
    return isinstance(values, list) and all(type(c) is int and 0 <= c < 2**32 for c in values)


def _chains(raw: Any, groups: tuple[ChainGroup, ...]) -> dict[str, tuple[int, ...]]:
    """Per blob: indices into ``groups`` whose epochs strictly increase."""
    if not isinstance(raw, dict):
        raise ValueError("delta: chains must be an object")
    out = {}
    epochs = [g.epoch for g in groups]
    for blob, chain in raw.items():
        if (not isinstance(chain, list) or not 0 < len(chain) <= len(groups)
                or not all(type(i) is int and 0 <= i < len(groups) for i in chain)
                or any(epochs[a] >= epochs[b] for a, b in zip(chain, chain[1:]))):
            raise ValueError(f"delta: blob {blob!r:.80}: bad chain {chain!r:.80}")
        out[str(blob)] = tuple(chain)
    return out
