"""The commit protocol: write one node's checkpoint as an immutable group, commit it with a
record, read it back verified.

A save never moves, rewrites or shares a path, so no remover can ever mistake it for something
else and no reader can see a mix of two saves. :meth:`CheckpointStore.save_node` runs its
phases in this order (each named after what it does):

0. **hint** (beside phases 1-4, by the first of the save's nodes in sorted order): the family's
   hint (:meth:`CheckpointStore.write_hint`) is rewritten to name this save; it must be
   written, durably, before that node's phase 6, so before the save is committed;
1. **plan**: the manifest and the group's ``zarr.json`` are computed in memory;
2. **take a path**: the group's ``zarr.json`` — which names the save — is its first object,
   created exclusively: at ``<node>.<epoch>`` (Caffe2's ``db_name``) if no save ever took that
   path, else at ``<node>.<epoch>.<save id>``, a path of its own. From then on the group says
   whose it is;
3. **write** every array (metadata and chunks, concurrently) and 4. **make durable**: on local
   disks every file is flushed on the descriptor it was written through and every directory
   the save created an entry in is fsync'ed (:mod:`caffe2ckpt.fs.localio`);
5. **check the fence**: a run overtaken by a newer run of its family
   (:mod:`caffe2ckpt.store.commit.runs`) stops here with :class:`CheckpointFencedError`;
6. **commit**: the record — naming the group's path, the digests of its metadata files and
   every chunk's CRC32C — is created exclusively and durably. It is the last step: a save that
   raised never leaves its record behind (:func:`~caffe2ckpt.store.format.records.write_record`).

Nothing is read back after the commit: the save downloads nothing it wrote. A record written
by a run that a newer run overtook in the instant between 5 and 6 is harmless: the newer run
started from an earlier save, so the lineage (:mod:`caffe2ckpt.history.lineage`) counts the
late save as superseded.

Readers find data only through records: the one read path
(:class:`~caffe2ckpt.store.read.save.SaveReader`; :meth:`CheckpointStore.load_node` for one
node) reads the group a record names and checks record → ``zarr.json`` digest → manifest
(node, epoch, save id) → metadata digests → every chunk's size and CRC32C.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from caffe2ckpt.errors import (
    CheckpointCorruptedError,
    CheckpointError,
    CheckpointNotFoundError,
    CheckpointWriteError,
    StorageCredentialsError,
)
from caffe2ckpt.fs import strictjson
from caffe2ckpt.fs.iopool import pool
from caffe2ckpt.fs.location import Location
from caffe2ckpt.naming import check_epoch, check_node_name
from caffe2ckpt.sharding import ROWS, Layout, SavedLayout
from caffe2ckpt.store.commit import runs
from caffe2ckpt.store.delta.write import DeltaWrite
from caffe2ckpt.store.format.manifest import Manifest
from caffe2ckpt.store.format.paths import (
    HINTS_DIR,
    group_name,
    hint_name,
    parse_group_name,
    save_generation,
)
from caffe2ckpt.store.format.records import (
    CommitRecord,
    RecordRef,
    delete_record,
    read_record,
    write_record,
)
from caffe2ckpt.store.format.zarrgroup import (
    DEFAULT_PACK_THRESHOLD,
    GROUP_FILE,
    GroupPlan,
    parse_manifest,
    plan_group,
    write_arrays,
)
from caffe2ckpt.store.read.save import SaveReader
from caffe2ckpt.store.read.shared import SharedReads

__all__ = ["CheckpointStore", "SaveInfo"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class SaveInfo:
    """What a save writes besides the blobs: its id (which names its run), the nodes saved
    together, the epoch's outcome, its writer and where its run started."""

    save_id: str
    nodes: list[str]
    stop: bool = False
    stop_conditions: tuple[str, ...] = ()
    metrics: dict[str, float] | None = None
    writer: dict | None = None
    parent: tuple[int, int] | None = None  # the save the run started from: (epoch, generation)
    layout: Layout | None = None  # how the blobs are spread over ``order``, when declared
    order: tuple[str, ...] = ()  # the nodes in the job's order (default: ``nodes``)
    writers: dict[str, str] = field(default_factory=dict)  # replicated blob -> node writing it

    def borrowed(self, node: str, names: Iterable[str]) -> dict[str, str]:
        """Of ``node``'s blobs ``names``, the replicated ones another node writes (blob ->
        that node): ``node`` does not write them, its record names the writer."""
        return {n: self.writers[n] for n in names if self.writers.get(n, node) != node}

    def row_blobs(self, blobs: dict[str, np.ndarray], delta: DeltaWrite | None
                  ) -> frozenset[str]:
        """Which of a node's blobs (written whole, or by ``delta``) its layout splits by
        rows."""
        if self.layout is None:
            return frozenset()
        inherited = delta.layout.inherited if delta is not None and delta.layout else {}
        names = set(blobs) | set(inherited)
        return frozenset(n for n in names if self.layout.kind(n) == ROWS)

    def saved_layout(self, names: Iterable[str], borrowed: dict[str, str]
                     ) -> SavedLayout | None:
        """What the record of a node holding the blobs ``names`` (and ``borrowed``, written
        by other nodes) says of the layout."""
        if self.layout is None:
            return None
        return self.layout.saved(self.order or tuple(self.nodes), [*names, *borrowed], borrowed)

    @property
    def generation(self) -> int:
        return save_generation(self.save_id)


class CheckpointStore:
    """Node checkpoints and their commit records under one prefix.

    Args:
        location: the prefix.
        pack_threshold: blobs smaller than this many bytes are packed together.
    """

    def __init__(self, location: Location, *, pack_threshold: int = DEFAULT_PACK_THRESHOLD) -> None:
        self.location = location
        self.pack_threshold = pack_threshold

    # -- saving ----------------------------------------------------------------------------------

    def save_node(self, node: str, epoch: int, blobs: dict[str, np.ndarray],
                  info: SaveInfo, delta: DeltaWrite | None = None,
                  borrowed: dict[str, str] | None = None) -> CommitRecord:
        """Write and commit ``blobs`` as ``node``'s checkpoint of ``epoch`` (see the module
        docstring for the phases). With ``delta`` (a differential save), ``blobs`` are the
        blobs it writes whole and ``delta`` says what the rest are; once the record is written
        the save checks that the save it builds on still stands (:meth:`_check_base`).
        ``borrowed`` are the node's replicated blobs another node of the save writes (blob ->
        node): the record names them (:meth:`load_node` reads them from that node's save)."""
        check_node_name(node)
        check_epoch(epoch)
        started, start = time.time(), time.perf_counter()
        hint = None  # one PUT per save: object stores limit the updates of one object
        if node == min(info.nodes):
            hint = pool().submit(self.write_hint, list(info.nodes), epoch, info.save_id)
        batch = None
        try:
            batch = self.location.sync_batch()
            plan = plan_group(node=node, epoch=epoch, save_id=info.save_id, blobs=blobs,
                              pack_threshold=self.pack_threshold,
                              delta=None if delta is None else delta.layout,
                              fine_overlays=not self.location.per_object_requests,
                              row_blobs=info.row_blobs(blobs, delta))
            if delta is not None:
                delta.manifest = plan.manifest
            path = self._take_path(node, epoch, info.save_id, plan, batch)
            crcs = write_arrays(self.location, self.location.path(path), plan, batch)
            if delta is not None:
                delta.start()  # what its plan left for later, while the data is made durable
            self.location.make_durable(batch, [], pool())
        except BaseException:
            if batch is not None:
                batch.close()  # no descriptor outlives a failed save
            raise
        finally:
            # waited for on every path: nothing outlives the save
            hint_error = None if hint is None else hint.exception()
        if hint_error is not None:
            raise hint_error
        runs.check_fence(self.location, info.generation, f"commit epoch {epoch} of node {node!r}",
                         info.nodes)
        record = CommitRecord(
            epoch=epoch, node=node, save_id=info.save_id, nodes=list(info.nodes),
            nbytes=plan.manifest.nbytes,
            blob_count=len(plan.manifest.blobs),
            seconds=time.perf_counter() - start, stop=info.stop,
            stop_conditions=list(info.stop_conditions), metrics=dict(info.metrics or {}),
            metadata=plan.digests(), writer=dict(info.writer or {}), parent=info.parent,
            path=path, crcs=crcs, started=started,
            delta=None if delta is None else delta.record(plan.manifest.stored_nbytes),
            layout=info.saved_layout(plan.manifest.blobs, borrowed or {}),
            whole={} if delta is None else dict(delta.why))
        if delta is not None:  # before the record: nothing after the commit may fail the save
            delta.seal(record)
        write_record(self.location, record)
        if record.delta is not None:
            self._check_base(record, delta.base)  # type: ignore[union-attr]
        logger.debug("committed %s (%d bytes, %.3f s)", self.location.display(path),
                     record.nbytes, record.seconds)
        return record

    def _check_base(self, record: CommitRecord, base: RecordRef | None) -> None:
        """After a differential save's record is written: the record of the save it builds on
        must still be there, else the record is taken back and the save fails. A remover
        deletes a save's records first and then reads the records to see which groups are
        still referenced, so either it finds this record (and keeps the groups it needs) or
        this check finds the base's record gone."""
        try:
            if base is not None:
                self.read_record(base)
                return
            why = "names no base"
        except CheckpointError as exc:
            why = f"cannot be confirmed: {exc}"
        except OSError as exc:
            why = f"cannot be confirmed: {type(exc).__name__}: {exc}"
        what = (f"checkpoint {self.where(record)!r} (node {record.node!r}, epoch "
                f"{record.epoch}): the save it builds on (epoch {base.epoch if base else '?'}, "
                f"save {base.save_id if base else '?'}) {why}")
        try:
            delete_record(self.location, record.ref)
        except Exception as undo:  # reported: its record may stand, naming data that is gone
            raise CheckpointWriteError(
                f"{what}, and taking its record back failed ({type(undo).__name__}: {undo}): "
                "it may be committed but unreadable; the next save is written whole",
                epoch=record.epoch, maybe_committed=True) from undo
        raise CheckpointWriteError(f"{what}: it is not committed; the next save is written "
                                   "whole", epoch=record.epoch)

    def _take_path(self, node: str, epoch: int, save_id: str, plan: GroupPlan,
                   batch: object) -> str:
        """Create the group's ``zarr.json`` first and exclusively: at ``<node>.<epoch>`` if that
        path is free, else at this save's own path. Returns the path taken."""
        for path in (group_name(node, epoch), group_name(node, epoch, save_id)):
            try:
                self.location.create_group(self.location.path(path), GROUP_FILE,
                                           plan.group_json, batch=batch)  # type: ignore[arg-type]
                return path
            except FileExistsError:
                continue
        raise FileExistsError(  # a save id is fresh: only a crafted or copied group is there
            f"{self.location.display(group_name(node, epoch, save_id))} exists already")

    # -- hints -----------------------------------------------------------------------------------

    def write_hint(self, nodes: list[str], epoch: int, save_id: str,
                   run: int | None = None) -> None:
        """Say that the save ``save_id`` of ``epoch`` is about to commit for the family
        ``nodes``: the save's first node writes it (durably, beside its data) before its
        record, so a hint never lags behind a commit. With
        ``run``: that run, which resumed from that committed save, is newer than it and has
        saved nothing yet (written right after the run's claim)."""
        hint = {"nodes": sorted(nodes), "epoch": epoch, "save_id": save_id}
        if run is not None:
            hint["run"] = run
        self.location.replace_file(self.location.path(HINTS_DIR, hint_name(nodes)),
                                   json.dumps(hint).encode())

    def read_hint(self, nodes: list[str]) -> tuple[int, str, int] | None:
        """The (epoch, save id) of the family's newest save as its hint says, and the run
        that vouches for it (the save's own, or a newer run that resumed from it), or None when
        there is no usable hint (the caller then asks the records)."""
        try:
            raw = self.location.read_bytes(self.location.path(HINTS_DIR, hint_name(nodes)),
                                           limit=4096 + 160 * len(nodes))
            data = strictjson.loads(raw)
            epoch, save_id = data["epoch"], data["save_id"]
            if (data["nodes"] != sorted(nodes) or type(epoch) is not int
                    or not isinstance(save_id, str)):
                return None
            run = data.get("run", save_generation(save_id))
            if type(run) is not int or run < save_generation(save_id):
                return None
            return check_epoch(epoch), save_id, run
        except (CheckpointError, ValueError, KeyError, TypeError):
            return None

    # -- reading ---------------------------------------------------------------------------------

    def read_record(self, ref: RecordRef) -> CommitRecord:
        return read_record(self.location, ref)

    def has_record(self, ref: RecordRef) -> bool:
        """Whether the record ``ref`` is there and readable (False also when it cannot be
        read now)."""
        try:
            read_record(self.location, ref)
        except (CheckpointError, OSError):
            return False
        return True

    def read_or_reason(self, ref: RecordRef) -> CommitRecord | str:
        """The record ``ref`` names, or why it is not a valid record (I/O errors propagate)."""
        try:
            return read_record(self.location, ref)
        except (CheckpointCorruptedError, CheckpointNotFoundError) as exc:
            return str(exc)

    def group_path(self, record: CommitRecord) -> str:
        """The filesystem path of the group ``record`` commits."""
        return self.location.path(record.group)

    def where(self, record: CommitRecord) -> str:
        """``record``'s group as a URL, for messages."""
        return self.location.display(record.group)

    def _group_json(self, group: str, digest: str | None, node: str, epoch: int,
                    save_id: str) -> bytes:
        """The ``zarr.json`` of ``group`` (of ``node``'s save ``save_id``, for the checkpoint of
        ``epoch``), which must have the SHA-256 ``digest`` a commit record vouches for."""
        where = self.location.display(group)
        try:
            raw = self.location.read_bytes(f"{self.location.path(group)}/{GROUP_FILE}",
                                           limit=strictjson.MAX_BYTES)
        except CheckpointNotFoundError as exc:
            raise CheckpointCorruptedError(
                f"checkpoint {where!r} (node {node!r}, epoch {epoch}) is committed but its "
                "group metadata is missing", node=node, epoch=epoch, blob=GROUP_FILE) from exc
        except StorageCredentialsError:  # a ValueError, but the store refused: not damage
            raise
        except ValueError as exc:  # too large, not a regular file, or through a symlink
            raise CheckpointCorruptedError(
                f"checkpoint {where!r} (node {node!r}, epoch {epoch}): its group metadata is "
                f"unreadable: {exc}", node=node, epoch=epoch, blob=GROUP_FILE) from exc
        if hashlib.sha256(raw).hexdigest() != digest:
            raise CheckpointCorruptedError(
                f"checkpoint {where!r} (node {node!r}, epoch {epoch}) holds group metadata "
                f"that its commit record (save {save_id!r}) does not name",
                node=node, epoch=epoch, blob=GROUP_FILE)
        return raw

    def group_manifest(self, group: str, digest: str | None, save_id: str, *, node: str,
                       epoch: int) -> Manifest:
        """The manifest of ``group``, which must be the one a record of the checkpoint of
        ``node`` at ``epoch`` vouches for (``digest``) and say it is save ``save_id``'s."""
        where = self.location.display(group)
        manifest = parse_manifest(self._group_json(group, digest, node, epoch, save_id), where,
                                  node=node, epoch=epoch)
        parsed = parse_group_name(group)
        if (parsed is None or (manifest.node, manifest.epoch, manifest.save_id)
                != (node, parsed.epoch, save_id)):
            raise CheckpointCorruptedError(
                f"checkpoint {where!r} says it is node {manifest.node!r} epoch "
                f"{manifest.epoch} save {manifest.save_id!r}", node=node, epoch=epoch,
                blob=GROUP_FILE)
        return manifest

    def manifest(self, record: CommitRecord) -> Manifest:
        """The manifest of the group ``record`` commits, checked against the record."""
        node, epoch = record.node, record.epoch
        manifest = self.group_manifest(record.group, record.metadata.get(GROUP_FILE),
                                       record.save_id, node=node, epoch=epoch)
        if manifest.nbytes != record.nbytes:  # before anything is allocated for the blobs
            raise CheckpointCorruptedError(
                f"checkpoint {self.where(record)!r} (node {node!r}, epoch {epoch}): its "
                f"manifest claims {manifest.nbytes} bytes of blobs, its commit record "
                f"{record.nbytes}", node=node, epoch=epoch, blob=GROUP_FILE)
        if set(manifest.metadata_files()) != set(record.metadata):
            raise CheckpointCorruptedError(
                f"checkpoint {self.where(record)!r} (node {node!r}, epoch {epoch}): its "
                "manifest lists other arrays than its commit record", node=node, epoch=epoch,
                blob=GROUP_FILE)
        delta = record.delta
        chains = {} if delta is None else {name: tuple(delta.groups[i].group for i in chain)
                                           for name, chain in delta.chains.items()}
        if chains != {name: i.chain for name, i in manifest.inherited.items()}:
            raise CheckpointCorruptedError(
                f"checkpoint {self.where(record)!r} (node {node!r}, epoch {epoch}): its "
                "manifest and its commit record disagree on which blobs come from other saves",
                node=node, epoch=epoch, blob=GROUP_FILE)
        return manifest

    def chunk_crcs(self, record: CommitRecord, manifest: Manifest) -> dict[str, tuple[int, ...]]:
        """Every chunk's CRC32C for ``record``'s group, by array."""
        try:
            return manifest.chunk_crcs(record.crcs)
        except ValueError as exc:
            raise CheckpointCorruptedError(
                f"checkpoint {self.where(record)!r} (node {record.node!r}, epoch "
                f"{record.epoch}): {exc}", node=record.node, epoch=record.epoch,
                blob=GROUP_FILE) from exc

    def load_node(self, record: CommitRecord, names: list[str] | None = None,
                  shared: SharedReads | None = None, manifest: Manifest | None = None
                  ) -> dict[str, np.ndarray]:
        """Read and verify the blobs (only ``names`` if given) of the group ``record`` commits,
        and the replicated blobs of the node that another node of its save wrote (once per
        ``shared``): :meth:`~caffe2ckpt.store.read.save.SaveReader.blobs`. ``manifest``: the
        group's, as :meth:`manifest` read it already.

        Raises:
            CheckpointCorruptedError: the group is damaged (names node, epoch and blob).
        """
        known = {record.node: manifest} if manifest is not None else None
        return SaveReader(self, {record.node: record}, shared, known).blobs(record.node, names)
