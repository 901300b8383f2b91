"""The save/commit/load protocol for node checkpoints under one prefix.

:class:`CheckpointStore` combines the group layout (:mod:`caffe2ckpt.store.zarrgroup`) with commit
records (:mod:`caffe2ckpt.store.records`) so that a crash at any instant leaves every committed
checkpoint intact:

1. Every save writes its group aside, under ``_staging/<node>.<epoch>.<save_id>``; never into a
   path that a commit record may name. Only when the group is complete (and the run is still
   the prefix's newest claimant) is the previous copy's record retired, the staged group moved to
   ``<node>.<epoch>`` (a rename on local disks) and the new record written. A crash may
   therefore make that one epoch fall back to the previous one; it can never leave a record over
   data it does not describe, and a fenced run never touches the group a newer run committed.
2. Data is made durable (fsync of files and directories on local disks) before the record.
3. The record is written last, exclusively, and never edited.

Fencing: a run that claims the prefix (:meth:`CheckpointStore.claim`) owns it until a newer
claim appears; its saves check the claim just before committing and raise
:class:`CheckpointFencedError` instead once a newer run (e.g. a duplicate retry) took over.

What counts as committed, and which committed epoch a job resumes from (the lineage of runs), is
defined once in :mod:`caffe2ckpt.history.lineage`; a committed epoch is *usable* when, besides, the
group metadata stored for each node is the one its record names.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from caffe2ckpt.fs import strictjson
from caffe2ckpt.store.records import (
    CommitRecord,
    RecordRef,
    delete_record,
    list_records,
    read_record,
    save_generation,
    write_record,
)
from caffe2ckpt.errors import (
    CheckpointCorruptedError,
    CheckpointError,
    CheckpointFencedError,
    CheckpointNotFoundError,
    CheckpointWriteError,
)
from caffe2ckpt.history.lineage import History, Save
from caffe2ckpt.fs.location import Location
from caffe2ckpt.naming import (
    CLAIMS_DIR,
    STAGING_DIR,
    check_epoch,
    check_node_name,
    get_ckpt_filename,
)
from caffe2ckpt.store.manifest import Manifest
from caffe2ckpt.store.zarrgroup import (
    ATTRS_KEY,
    DEFAULT_PACK_THRESHOLD,
    parse_manifest,
    read_node,
    write_node,
)

__all__ = ["CheckpointStore", "SaveInfo"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class SaveInfo:
    """What the runner hands to a save besides the blobs: the epoch's outcome and its writer."""

    save_id: str
    nodes: list[str]
    stop: bool = False
    stop_conditions: tuple[str, ...] = ()
    metrics: dict[str, float] | None = None
    writer: dict | None = None
    claim: str | None = None  # the run's claim on the prefix: fenced saves never commit
    parent: tuple[int, int] | None = None  # the save the run started from: (epoch, generation)


def _claim_number(name: str) -> int | None:
    digits = name.removeprefix("claim-").removesuffix(".json")
    # isascii: str.isdigit() also accepts digits such as "²" that int() refuses
    # at most 18 digits: a save id carries the number as a generation (commit.save_generation);
    # a planted claim of more digits is not a claim at all
    if (name.startswith("claim-") and name.endswith(".json") and digits.isascii()
            and digits.isdigit() and len(digits.lstrip("0")) <= 18):
        return int(digits)
    return None


def claim_generation(claim: str | None) -> int:
    """The generation of a run's saves: its claim number (0 without a claim)."""
    return (_claim_number(claim) or 0) if claim is not None else 0


class CheckpointStore:
    """Node checkpoints and their commit records under one prefix.

    Args:
        location: the prefix.
        pack_threshold: blobs smaller than this many bytes are packed together.
    """

    def __init__(self, location: Location, *, pack_threshold: int = DEFAULT_PACK_THRESHOLD) -> None:
        self.location = location
        self.pack_threshold = pack_threshold

    def group_path(self, node: str, epoch: int) -> str:
        return self.location.path(get_ckpt_filename(node, epoch))

    # -- saving ----------------------------------------------------------------------------------

    def save_node(
        self, node: str, epoch: int, blobs: dict[str, np.ndarray], info: SaveInfo
    ) -> CommitRecord:
        """Write and commit ``blobs`` as ``node``'s checkpoint of ``epoch``."""
        check_node_name(node)
        check_epoch(epoch)
        if info.claim is not None:  # before touching anything: a fenced run must not delete
            self.check_claim(info.claim)
        start = time.perf_counter()
        target = self.group_path(node, epoch)
        staged = self.location.path(STAGING_DIR, f"{get_ckpt_filename(node, epoch)}.{info.save_id}")
        self._remove_staged(node, epoch, info.save_id)
        try:
            manifest, digests = write_node(
                self.location, staged, node=node, epoch=epoch, save_id=info.save_id, blobs=blobs,
                pack_threshold=self.pack_threshold,
            )
            if info.claim is not None:  # a fenced run never moves its data into place
                self.check_claim(info.claim)
        except BaseException:
            self._discard(staged)
            raise
        generation = save_generation(info.save_id)
        try:
            for ref in self._records_of(node, epoch):  # the old copy stops counting first
                self._refuse_newer(ref.save_id, generation, node, epoch, info)
                delete_record(self.location, ref)
            self._install(staged, target, node, epoch, generation, info)
        except Exception:
            self._discard(staged)
            if info.claim is not None:  # a newer run took over meanwhile: that is the cause
                self.check_claim(info.claim)
            raise
        record = CommitRecord(
            epoch=epoch,
            node=node,
            save_id=info.save_id,
            nodes=list(info.nodes),
            nbytes=manifest.nbytes,
            blob_count=len(manifest.arrays) + len(manifest.packed),
            seconds=time.perf_counter() - start,
            stop=info.stop,
            stop_conditions=list(info.stop_conditions),
            metrics=dict(info.metrics or {}),
            metadata=digests,
            writer=dict(info.writer or {}),
            parent=info.parent,
        )
        write_record(self.location, record)
        if info.claim is not None:
            try:
                self.check_claim(info.claim)
            except Exception:  # fenced meanwhile (or cannot tell): take the commit back
                delete_record(self.location, record.ref)
                raise
        stored = hashlib.sha256(self._group_json(node, epoch)).hexdigest()
        if stored != digests["zarr.json"]:  # the record must vouch for what is stored
            delete_record(self.location, record.ref)
            raise CheckpointWriteError(
                f"checkpoint {self._where(node, epoch)!r} (node {node!r}, epoch {epoch}) does not "
                f"hold the group of save {info.save_id!r} that was just committed", epoch=epoch)
        logger.debug("committed %s (%d bytes, %.3f s)", self.location.display(
            get_ckpt_filename(node, epoch)), record.nbytes, record.seconds)
        return record

    def _records_of(self, node: str, epoch: int) -> list[RecordRef]:
        return [r for r in list_records(self.location) if r.epoch == epoch and r.node == node]

    def _install(self, staged: str, target: str, node: str, epoch: int, generation: int,
                 info: SaveInfo) -> None:
        """Move the staged group to ``target``, which no record names any more."""
        if self.location.exists(target):
            others = self._records_of(node, epoch)
            if others:  # another save committed this group while ours was written: keep it
                raise CheckpointWriteError(
                    f"checkpoint {self._where(node, epoch)!r} (node {node!r}, epoch {epoch}) was "
                    f"committed by save {others[0].save_id!r} while this save was written; "
                    "leaving it in place", epoch=epoch)
            self._refuse_newer(self._stored_save_id(node, epoch), generation, node, epoch, info)
            self.location.remove(target)  # uncommitted: a leftover, or the copy just retired
        self.location.move(staged, target)

    def _refuse_newer(self, save_id: str | None, generation: int, node: str, epoch: int,
                      info: SaveInfo) -> None:
        """Never retire or remove what a newer run saved: this run is fenced, whether or not
        its claim check has seen the newer claim yet (a stalled run wakes up late)."""
        if save_id is not None and save_generation(save_id) > generation:
            raise CheckpointFencedError(
                f"checkpoint {self._where(node, epoch)!r} (node {node!r}, epoch {epoch}) holds "
                f"save {save_id!r} of a newer run; this run ({info.claim}) must not replace it",
                epoch=epoch)

    def _stored_save_id(self, node: str, epoch: int) -> str | None:
        """The save id in the manifest of the group stored at ``(node, epoch)`` (None if it
        has no readable one: an interrupted save's leftover)."""
        try:
            raw = self.location.read_bytes(f"{self.group_path(node, epoch)}/zarr.json",
                                           limit=strictjson.MAX_BYTES)
            save_id = strictjson.loads(raw)["attributes"][ATTRS_KEY]["save_id"]
        except (CheckpointNotFoundError, ValueError, KeyError, TypeError):
            return None
        return save_id if isinstance(save_id, str) else None

    def _discard(self, staged: str) -> None:
        """Remove this save's own staged group after a failure (best effort: ``gc`` too)."""
        try:
            self.location.remove(staged)
        except Exception as exc:  # noqa: BLE001 - the original failure matters more
            logger.debug("could not remove %s: %s", staged, exc)

    def _remove_staged(self, node: str, epoch: int, save_id: str) -> None:
        """Remove staged copies of (node, epoch) left by interrupted saves of this run or older
        runs; a newer run's staged copy (a save in progress) is never touched."""
        staging = self.location.path(STAGING_DIR)
        generation = save_generation(save_id)
        for name in self.location.list_names(staging):
            group, _, other = name.rpartition(".")
            if (group == get_ckpt_filename(node, epoch) and other != save_id
                    and save_generation(other) <= generation):
                self.location.remove(f"{staging}/{name}")

    # -- fencing ---------------------------------------------------------------------------------

    def claim(self, writer: dict | None = None, *, keep: int = 8) -> str:
        """Claim the prefix for a new run; older claimants are fenced off. Returns the claim.

        Claims are numbered in creation order (``claim-<n>.json``, each created exclusively), so
        "newer" never depends on clocks.
        """
        directory = self.location.path(CLAIMS_DIR)
        data = json.dumps(writer or {}, default=str).encode()
        for _ in range(100):  # bounded: a name that exists but is never listed must not spin
            claims = self._claims()
            number = max(map(_claim_number, claims), default=0) + 1
            if number >= 10**18:  # a crafted claim: every later run would be fenced by it
                raise CheckpointWriteError(
                    f"cannot claim checkpoint prefix {self.location.display()!r}: claim "
                    f"{self.location.display(CLAIMS_DIR, claims[-1])!r} has the highest number "
                    "a claim may have; remove it if no run of yours wrote it")
            name = f"claim-{number:012d}.json"
            try:
                self.location.create_exclusive(f"{directory}/{name}", data)
                break
            except FileExistsError:  # another run claimed that number first: take the next
                continue
        else:
            raise CheckpointWriteError(
                f"cannot claim checkpoint prefix {self.location.display()!r}: claim {name} "
                "exists but is not listed in its directory")
        try:  # the claim is made: pruning old ones is housekeeping, never a reason to fail
            for old in self._claims()[:-keep]:
                self.location.remove(f"{directory}/{old}")
        except OSError as exc:
            logger.warning("could not remove old claims under %s: %s",
                           self.location.display(CLAIMS_DIR), exc)
        return name

    def _claims(self) -> list[str]:
        """The claim files, oldest first: ordered by number (past 12 digits the names grow,
        and ``claim-1000000000000`` sorts before ``claim-999999999999`` as a string)."""
        names = self.location.list_names(self.location.path(CLAIMS_DIR))
        return sorted((n for n in names if _claim_number(n) is not None), key=_claim_number)

    def check_claim(self, claim: str) -> None:
        """Raise :class:`CheckpointFencedError` if a newer claim than ``claim`` exists."""
        claims = self._claims()
        newest = claims[-1] if claims else None
        if newest is not None and _claim_number(newest) > (_claim_number(claim) or 0):
            try:
                who = strictjson.loads(self.location.read_bytes(
                    self.location.path(CLAIMS_DIR, newest), limit=strictjson.MAX_BYTES))
            except (CheckpointNotFoundError, ValueError):  # only shown: any damage is fine
                who = {}
            raise CheckpointFencedError(
                f"a newer run took over checkpoint prefix {self.location.display()!r} "
                f"(claim {newest}, writer {who}); this run ({claim}) must not commit there"
            )

    # -- reading ---------------------------------------------------------------------------------

    def _where(self, node: str, epoch: int) -> str:
        return self.location.display(get_ckpt_filename(node, epoch))

    def _group_json(self, node: str, epoch: int) -> bytes:
        try:
            return self.location.read_bytes(f"{self.group_path(node, epoch)}/zarr.json",
                                            limit=strictjson.MAX_BYTES)
        except CheckpointNotFoundError as exc:
            raise CheckpointCorruptedError(
                f"checkpoint {self._where(node, epoch)!r} (node {node!r}, epoch {epoch}) is "
                "committed but its group metadata is missing", node=node, epoch=epoch,
                blob="zarr.json",
            ) from exc
        except ValueError as exc:  # too large, not a regular file, or through a symlink
            raise CheckpointCorruptedError(
                f"checkpoint {self._where(node, epoch)!r} (node {node!r}, epoch {epoch}): its "
                f"group metadata is unreadable: {exc}", node=node, epoch=epoch, blob="zarr.json",
            ) from exc

    def node_record(self, node: str, epoch: int, refs: list[RecordRef] | None = None) -> CommitRecord:
        """The valid commit record of ``node`` at ``epoch``: one whose digest of the group's
        metadata matches the group stored now.

        Raises:
            CheckpointNotFoundError: no record for it.
            CheckpointCorruptedError: records exist but none matches the stored group.
        """
        return self._committed(node, epoch, refs)[0]

    def _committed(self, node: str, epoch: int,
                   refs: list[RecordRef] | None = None) -> tuple[CommitRecord, bytes]:
        """The valid record and the group metadata (``zarr.json`` bytes) it vouches for."""
        refs = [r for r in (refs if refs is not None else list_records(self.location))
                if r.epoch == epoch and r.node == node]
        if not refs:
            raise CheckpointNotFoundError(
                f"no committed checkpoint for node {node!r} at epoch {epoch} under "
                f"{self.location.display()!r}"
            )
        raw = self._group_json(node, epoch)
        digest = hashlib.sha256(raw).hexdigest()
        for ref in refs:
            record = read_record(self.location, ref)
            if record.metadata.get("zarr.json") == digest:
                return record, raw
        raise CheckpointCorruptedError(
            f"checkpoint {self._where(node, epoch)!r} (node {node!r}, epoch {epoch}) holds "
            "group metadata that no commit record names (changed, or an interrupted re-save)",
            node=node, epoch=epoch, blob="zarr.json",
        )

    def manifest(self, node: str, epoch: int) -> Manifest:
        """The manifest of ``node``'s committed group at ``epoch`` (validated against it)."""
        return self._checked_manifest(node, epoch, *self._committed(node, epoch))

    def _checked_manifest(self, node: str, epoch: int, record: CommitRecord,
                          raw: bytes) -> Manifest:
        manifest = parse_manifest(raw, self._where(node, epoch), node=node, epoch=epoch)
        if (manifest.node, manifest.epoch, manifest.save_id) != (node, epoch, record.save_id):
            raise CheckpointCorruptedError(
                f"checkpoint {self._where(node, epoch)!r} says it is node {manifest.node!r} "
                f"epoch {manifest.epoch} save {manifest.save_id!r}",
                node=node, epoch=epoch, blob="zarr.json",
            )
        return manifest

    def load_node(self, node: str, epoch: int, names: list[str] | None = None) -> dict[str, np.ndarray]:
        """Read and verify ``node``'s committed checkpoint of ``epoch`` (only ``names`` if given).

        Raises:
            CheckpointNotFoundError: not committed.
            CheckpointCorruptedError: committed but damaged (names node, epoch and blob).
        """
        record, raw = self._committed(node, epoch)
        manifest = self._checked_manifest(node, epoch, record, raw)
        path = self.group_path(node, epoch)
        files = manifest.metadata_files()
        if manifest.nbytes != record.nbytes:  # before anything is allocated for the blobs
            raise CheckpointCorruptedError(
                f"checkpoint {self._where(node, epoch)!r} (node {node!r}, epoch {epoch}): its "
                f"manifest claims {manifest.nbytes} bytes of blobs, its commit record "
                f"{record.nbytes}", node=node, epoch=epoch, blob="zarr.json",
            )
        if set(files) != set(record.metadata):
            raise CheckpointCorruptedError(
                f"checkpoint {self._where(node, epoch)!r} (node {node!r}, epoch {epoch}): its "
                "manifest lists other arrays than its commit record",
                node=node, epoch=epoch, blob="zarr.json",
            )
        metadata = {name: digest for name, digest in record.metadata.items()
                    if name != "zarr.json"}  # zarr.json: checked above
        return read_node(self.location, path, manifest, names, metadata=metadata)

    def epochs_with_records(self, nodes: list[str]) -> list[int]:
        """Epochs (newest first) for which every node in ``nodes`` has a record file, committed
        or not (listing only: used to refuse starting over damaged checkpoints)."""
        by_epoch: dict[int, set[str]] = {}
        for ref in list_records(self.location):
            by_epoch.setdefault(ref.epoch, set()).add(ref.node)
        wanted = set(nodes)
        return sorted((e for e, have in by_epoch.items() if wanted <= have), reverse=True)

    def history(self, nodes: list[str]) -> History:
        """The saves of ``nodes`` under the prefix (one listing; records are read lazily)."""
        return History(list_records(self.location), nodes, self._read_or_warn)

    def _read_or_warn(self, ref: RecordRef) -> CommitRecord | str:
        record = self.read_or_reason(ref)
        if isinstance(record, str):
            logger.warning("epoch %d is not committed for node %r: %s", ref.epoch, ref.node,
                           record)
        return record

    def read_or_reason(self, ref: RecordRef) -> CommitRecord | str:
        """The record ``ref`` names, or why it is not a valid record (I/O errors propagate)."""
        try:
            return read_record(self.location, ref)
        except CheckpointError as exc:
            return str(exc)

    def _usable(self, save: Save, nodes: list[str]) -> bool:
        """Whether the group stored for each of ``nodes`` is the one ``save`` committed."""
        try:
            for node in nodes:
                raw = self._group_json(node, save.epoch)
                if hashlib.sha256(raw).hexdigest() != save.records[node].metadata.get("zarr.json"):
                    raise CheckpointCorruptedError(
                        f"checkpoint {self._where(node, save.epoch)!r} (node {node!r}, epoch "
                        f"{save.epoch}) holds group metadata its commit record does not name",
                        node=node, epoch=save.epoch, blob="zarr.json")
        except CheckpointCorruptedError as exc:
            logger.warning("epoch %d is not usable: %s", save.epoch, exc)
            return False
        return True

    def epoch_records(self, epoch: int, nodes: list[str]) -> dict[str, CommitRecord] | None:
        """The records of the committed save of ``epoch`` for all ``nodes``, or None if there
        is none whose stored groups are the ones it committed (a damaged one is logged)."""
        for save in self.history(nodes).saves_at(epoch):
            if self._usable(save, nodes):
                return {node: save.records[node] for node in nodes}
        return None

    def lineage_epochs(self, nodes: list[str]) -> Iterator[int]:
        """The committed epochs of the current lineage of ``nodes``, newest first (lazily)."""
        return (save.epoch for save in self.history(nodes).lineage())

    def latest_epoch(self, nodes: list[str]) -> int | None:
        """The newest usable epoch of the current lineage of ``nodes``, or None."""
        for save in self.history(nodes).lineage():
            if self._usable(save, nodes):
                return save.epoch
        return None

    def parent_before(self, epoch: int, nodes: list[str]) -> tuple[int, int] | None:
        """Where a run that saves ``epoch`` without having resumed continues from: the newest
        committed save of the lineage below ``epoch``, as (epoch, generation); None if none."""
        for save in self.history(nodes).lineage():
            if save.epoch < epoch:
                return save.epoch, save.generation
        return None
