"""The async-save side of the checkpoint managers (``async_save=True``, or a JobRunner's
``StepManagerOptions(enable_async_checkpointing=True)``: Orbax's name for the same switch).

A background save lives in the process that holds its node: the flow process with a
``LocalSession``, a Dask worker with a ``DaskSession``. So waiting for it and freeing its snapshot
buffers happen there too: here, or as ``checkpoint_wait`` / ``checkpoint_release`` groups run on
the remote session that ran the save.
"""

from __future__ import annotations

import uuid
import weakref
from functools import partial
from typing import Any

from caffe2ckpt.errors import CheckpointWriteError, JobDefinitionError
from caffe2ckpt.manager import _nodeops as nodeops
from caffe2ckpt.store.format.records import CommitRecord

__all__ = ["AsyncSaving"]


class AsyncSaving:
    """Mixed into the managers, which provide ``url``, ``_group``, ``_require_files`` and
    ``_record_save``, call :meth:`_note_pending` for each node a save left in the background
    and set ``_save_group_ran`` to the save group that ran."""

    def _init_async(self, async_save: bool | None) -> None:
        # this manager's key for its background saves (and differential state) in each process
        # running its nodes
        self._key = f"manager-{uuid.uuid4().hex}"
        self._async_save = async_save  # as given: None leaves it to a JobRunner's options
        self._background = self._key if async_save else None
        # a manager never closed leaves no buffers behind here
        weakref.finalize(self, nodeops.forget_saves, self._key)
        # the epoch in flight, its save id and its nodes
        self._pending: tuple[int, str, set[str]] | None = None
        self._save_group_ran: Any = None  # the last save group run: its session holds the saves

    def use_async_option(self, enable_async_checkpointing: bool) -> None:
        """A JobRunner's ``StepManagerOptions.enable_async_checkpointing`` (Orbax's name for
        the same switch): True is ``async_save=True``. It turns background saves on for a
        manager made without ``async_save`` (from then on) and is refused for one made with
        ``async_save=False``; False (the options' default) changes nothing.

        Raises:
            JobDefinitionError: ``enable_async_checkpointing=True`` for a manager made with
                ``async_save=False``.
        """
        if not enable_async_checkpointing or self._background is not None:
            return
        if self._async_save is False:
            raise JobDefinitionError(
                f"{type(self).__name__}({self.url!r}, async_save=False) saves synchronously, "
                "but the JobRunner's options say enable_async_checkpointing=True (the same "
                "switch, Orbax's name): drop one of them")
        self._background = self._key

    def _note_pending(self, epoch: int, node: str, save_id: str) -> None:
        if self._background is not None:
            if self._pending is None:
                self._pending = (epoch, save_id, set())
            self._pending[2].add(node)

    def _saves_session(self) -> Any:
        """The session whose nodes hold this manager's background saves, if it is remote."""
        group = self._save_group_ran
        session = group.tasks[0].last_session if group is not None and group.tasks else None
        return session if getattr(session, "remote", False) else None

    @property
    def pending_epoch(self) -> int | None:
        """The epoch an ``async_save`` manager is still writing in the background, if any."""
        return None if self._pending is None else self._pending[0]

    def wait_until_finished(self) -> dict[str, CommitRecord]:
        """Wait for a background save (if any) and return its records by node. The wait runs
        where the save ran: here, or as a ``checkpoint_wait`` group on the session that ran it.

        Raises:
            CheckpointWriteError: the background save failed (``.epoch`` names the epoch).
        """
        if self._pending is None:
            return {}
        epoch, save_id, nodes = self._pending
        self._pending = None
        records: dict[str, CommitRecord] = {}
        record, session = self._record_save(epoch, save_id, records), self._saves_session()
        if session is not None:
            session.run(self._group("checkpoint_wait", lambda node, _: partial(
                nodeops.wait_saves, self._background, node, epoch if node in nodes else None),
                record, epoch=epoch))
        else:
            errors = []
            for node, file_node in self._require_files().items():
                try:  # every node is waited for before the first failure is raised
                    record(node, file_node, nodeops.wait_saves(
                        self._background, node, epoch if node in nodes else None, None))
                except CheckpointWriteError as exc:
                    errors.append(exc)
            if errors:
                raise errors[0]
        return records

    def close(self) -> None:
        """Wait for a background save (raising its failure) and release its buffers, also on
        the nodes of a remote session. The manager stays usable."""
        try:
            self.wait_until_finished()
        finally:  # buffers and differential state, where the nodes ran and here
            session = self._saves_session()
            if session is not None and not getattr(session, "closed", False):
                session.run(self._group("checkpoint_release", lambda node, _: partial(
                    nodeops.release_saves, self._key, node)))
            nodeops.release_saves(self._key)
