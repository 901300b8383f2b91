"""What a reader needs of the store whose saves it reads (in practice the commit protocol's
:class:`~caffe2ckpt.store.commit.protocol.CheckpointStore`), named here so that reading
imports nothing above it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import numpy as np

    from caffe2ckpt.fs.location import Location
    from caffe2ckpt.store.format.manifest import Manifest
    from caffe2ckpt.store.format.records import CommitRecord
    from caffe2ckpt.store.read.shared import SharedReads

__all__ = ["ReadableStore"]


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

    def load_node(self, record: CommitRecord, names: list[str] | None = None,
                  shared: SharedReads | None = None, manifest: Manifest | None = None
                  ) -> dict[str, np.ndarray]:
        """The blobs ``names`` (all: None) of ``record``'s node."""

    def writer_record(self, record: CommitRecord, node: str, name: str) -> CommitRecord:
        """The record of ``node``, which wrote blob ``name`` of ``record``'s save."""

    def read_own(self, record: CommitRecord, manifest: Manifest,
                 wanted: list[str]) -> dict[str, np.ndarray]:
        """The blobs ``wanted`` that ``record``'s own group holds, or rebuilds from its
        chains."""
