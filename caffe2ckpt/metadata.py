"""Metadata handlers: where a checkpoint manager asks which epoch to resume from.

:class:`MetadataHandler` is Caffe2's implied protocol. :class:`ZarrMetadataHandler` answers from
the commit records under the checkpoint prefix, so a retried or re-run job resumes from the
newest epoch every one of its nodes committed.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol, runtime_checkable

from caffe2ckpt.errors import (
    CheckpointCorruptedError,
    CheckpointNotFoundError,
    JobDefinitionError,
)
from caffe2ckpt.fs.location import Location
from caffe2ckpt.history.scan import family_history, newest_save
from caffe2ckpt.naming import check_epoch
from caffe2ckpt.store.commit.protocol import CheckpointStore

__all__ = ["MetadataHandler", "ZarrMetadataHandler"]

logger = logging.getLogger(__name__)


@runtime_checkable
class MetadataHandler(Protocol):
    """Caffe2's metadata handler protocol, called by the checkpoint managers."""

    def set_params(
        self,
        db_prefix: str,
        db_type: str,
        node_names: list[str],
        path_prefix: str | None = None,
        path_type: str | None = None,
    ) -> None: ...

    def last_epoch(self, user_epoch: int | None = None) -> int | None: ...

    def write(self, epoch: int) -> None: ...

    def cp_accessible(self, epoch: int | None = None) -> bool: ...

    def report(self, action_name: str, stats: dict[str, int]) -> None: ...


class ZarrMetadataHandler:
    """Resume from the commit records of a caffe2ckpt prefix.

    ``last_epoch()`` is the newest committed epoch of the job's current lineage (see
    :mod:`caffe2ckpt.history.lineage`: epochs of a run that a later resume from an earlier epoch
    superseded never count; records of other nodes under the same prefix are ignored);
    ``last_epoch(user_epoch=k)`` returns k if a save of k is committed (a superseded one only
    when asked for by number) and raises otherwise.

    Args:
        storage_options: fsspec options for the prefix (the managers pass theirs on if unset).
    """

    def __init__(self, storage_options: dict[str, Any] | None = None) -> None:
        self.storage_options = storage_options
        self.filesystem: Any = None
        self.reports: list[tuple[str, dict[str, int]]] = []
        self.last_error: OSError | None = None  # why cp_accessible last said no
        self._store: CheckpointStore | None = None
        self._nodes: list[str] = []

    def set_params(
        self,
        db_prefix: str,
        db_type: str,
        node_names: list[str],
        path_prefix: str | None = None,
        path_type: str | None = None,
        **options: Any,
    ) -> None:
        """Bind to a prefix and the job's node names. ``options`` may carry the manager's
        ``storage_options`` and ``filesystem``."""
        storage_options = self.storage_options or options.get("storage_options")
        filesystem = self.filesystem or options.get("filesystem")
        self._store = CheckpointStore(Location(db_prefix, storage_options, filesystem))
        self._nodes = [str(n) for n in node_names]

    @property
    def store(self) -> CheckpointStore:
        if self._store is None:
            raise JobDefinitionError("ZarrMetadataHandler used before set_params()")
        return self._store

    def last_epoch(self, user_epoch: int | None = None) -> int | None:
        """The epoch to resume from: ``user_epoch`` if a save of it is committed (on the
        current lineage, or superseded: a resume from it on purpose makes its history current
        again), else the newest committed epoch of the lineage (None: nothing to resume from).

        Raises:
            CheckpointNotFoundError: ``user_epoch`` is not committed for every node.
            CheckpointCorruptedError: records exist but not one save of the nodes is committed
                (refusing to start from scratch over them).
        """
        store, where = self.store, self.store.location.display()
        if user_epoch is None:
            newest = newest_save(store, self._nodes)
            if newest is not None:
                return newest.epoch
            history = family_history(store, self._nodes)
            damaged = history.recorded_epochs()
            if damaged and not history.all_committed():
                raise CheckpointCorruptedError(
                    f"every epoch with commit records under {where!r} for nodes {self._nodes} "
                    f"is damaged: {damaged}; refusing to start from scratch over them "
                    "(inspect them, or use another prefix)")
            return None
        epoch = check_epoch(user_epoch)
        history = family_history(store, self._nodes)
        if history.saves_at(epoch):  # on the lineage, or superseded and asked for on purpose
            return epoch
        raise CheckpointNotFoundError(
            f"epoch {epoch} is not committed for nodes {self._nodes} under {where!r}; epochs "
            f"with records: {history.recorded_epochs()}")

    def write(self, epoch: int) -> None:
        """Nothing to do: every node's save already wrote its commit record (a
        check here could only fail spuriously, reporting a committed epoch as failed)."""
        logger.debug("epoch %d committed under %s", epoch, self.store.location.display())

    def cp_accessible(self, epoch: int | None = None) -> bool:
        """Whether the prefix can be created and reached."""
        try:
            self.store.location.makedirs(self.store.location.root)
        except OSError as exc:
            self.last_error = exc
            return False
        self.last_error = None
        return True

    def report(self, action_name: str, stats: dict[str, int]) -> None:
        """Keep ``stats`` (``{db path: nanoseconds}``) in ``self.reports`` and log them."""
        self.reports.append((action_name, dict(stats)))
        logger.debug("%s: %s", action_name, stats)
