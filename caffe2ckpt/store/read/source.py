"""What a reader needs of the store whose saves it reads (in practice the commit protocol's
:class:`~caffe2ckpt.store.commit.protocol.CheckpointStore`), named here so that reading
imports nothing above it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from collections.abc import Sequence

    import numpy as np

    from caffe2ckpt.fs.location import Location
    from caffe2ckpt.store.format.manifest import Manifest
    from caffe2ckpt.store.format.records import CommitRecord, RecordRef
    from caffe2ckpt.store.read.shared import SharedReads

__all__ = ["ReadableStore", "SavedSource"]


class ReadableStore(Protocol):
    """A prefix's committed saves, each group verified as it is read."""

    location: Location

    def group_path(self, record: CommitRecord) -> str:
        """Where the group of ``record``'s save is."""

    def where(self, record: CommitRecord) -> str:
        """The group of ``record``'s save, as shown to people."""

    def group_manifest(self, group: str, digest: str | None, save_id: str, *, node: str,
                       epoch: int) -> Manifest:
        """The manifest of ``group``, whose ``zarr.json`` must have ``digest`` and name
        ``save_id``."""

    def manifest(self, record: CommitRecord) -> Manifest:
        """The verified manifest of ``record``'s group."""

    def chunk_crcs(self, record: CommitRecord, manifest: Manifest) -> dict[str, tuple[int, ...]]:
        """Every chunk's CRC32C of ``record``'s arrays, by array path."""

    def read_record(self, ref: RecordRef) -> CommitRecord:
        """The commit record ``ref`` names."""


class SavedSource(Protocol):
    """One save's records as the one read path reads them
    (:class:`~caffe2ckpt.store.read.save.SaveReader`): what cutting a save anew for other nodes
    (:mod:`~caffe2ckpt.store.read.reshard`) reads through."""

    store: ReadableStore
    records: dict[str, CommitRecord]
    shared: SharedReads
    owned: bool  # nobody else shares what it reads

    def manifest(self, node: str) -> Manifest:
        """The verified manifest of ``node``'s group."""

    def blobs(self, node: str, names: Sequence[str] | None = None) -> dict[str, np.ndarray]:
        """``node``'s blobs (all, or ``names``) as it saved them."""

    def rows(self, node: str, name: str, start: int, stop: int) -> np.ndarray:
        """Rows ``[start, stop)`` of ``node``'s blob ``name``."""

    def own(self, record: CommitRecord, manifest: Manifest,
            wanted: list[str]) -> dict[str, np.ndarray]:
        """The blobs ``wanted`` of ``record``'s own group (or its chains)."""
