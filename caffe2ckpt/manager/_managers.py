"""Caffe2's checkpoint managers: :class:`MultiNodeCheckpointManager` (every node of a job) and
:class:`CheckpointManager` (its one-node case: the same code with one node whose files carry
``node_name``), and :class:`UploadTaskGroupBuilder`."""

from __future__ import annotations

import abc
import logging
from collections.abc import Sequence
from typing import Any

from caffe2ckpt.errors import JobDefinitionError
from caffe2ckpt.job import Node, Task, TaskGroup
from caffe2ckpt.manager._base import BaseCheckpointManager
from caffe2ckpt.metadata import MetadataHandler
from caffe2ckpt.naming import check_epoch, check_node_name, db_name
from caffe2ckpt.session import Session
from caffe2ckpt.sharding import Layout
from caffe2ckpt.store.format.zarrgroup import DEFAULT_PACK_THRESHOLD

__all__ = ["CheckpointManager", "MultiNodeCheckpointManager", "UploadTaskGroupBuilder"]

logger = logging.getLogger(__name__)


class MultiNodeCheckpointManager(BaseCheckpointManager):
    """Checkpoints every node of a job: ``<db_prefix>/<node>.<epoch>`` per node and epoch.

    Args:
        db_prefix: a local path or any fsspec URL.
        db_type: ``"zarr"``.
        metadata_handler: decides the resume epoch. Default: a :class:`ZarrMetadataHandler`,
            so a retried or re-run job resumes from its newest committed epoch.
        storage_options: fsspec options for ``db_prefix``.
        filesystem: an fsspec filesystem to use instead of one made from the URL.
        pack_threshold: blobs smaller than this many bytes (default 1 MiB) are packed together
            into one array, the others each get an array of their own.
        async_save: write and commit in the background after a snapshot (see ``save``).
            ``StepManagerOptions.enable_async_checkpointing`` (Orbax's name, the step
            manager's switch) given to a :class:`~caffe2ckpt.JobRunner` is the same switch:
            True turns it on when ``async_save`` is not given (None, the default, is off
            otherwise) and is refused with ``async_save=False``.
        auto_resume: with ``False`` and no ``metadata_handler``, Caffe2's behaviour: a job
            resumes only from an explicit ``resume_from_epoch`` and otherwise starts from
            scratch; its fresh start then supersedes the epochs already committed.
        layout: how the blobs are spread over the job's nodes (:class:`~caffe2ckpt.Layout`),
            stored with every save. With a layout, a job whose nodes have no committed epoch
            resumes from the newest epoch of another node count (the newest family of the
            prefix whose saves carry a layout): each node loads its share, split anew.

    Example:
        >>> cm = MultiNodeCheckpointManager("memory://doc/ckpt")
        >>> _ = cm.init(["trainer_0", "trainer_1"])
        >>> cm.get_ckpt_db_name("trainer_1", 5)
        'memory://doc/ckpt/trainer_1.5'
    """

    def init(self, nodes: Sequence[str | Node], retrieve_from_epoch: int | None = None,
             path_prefix: str | None = None, path_type: str | None = None) -> TaskGroup:
        """A runnable that fixes each node's blob list: the blobs in its workspace now (fresh
        start) or those in its checkpoint of ``retrieve_from_epoch``. On a manager already
        initialised for the same nodes it is empty and the lists are kept."""
        if isinstance(nodes, str):
            raise JobDefinitionError(f"nodes must be a list of node names, not the string {nodes!r}")
        names = [_node_str(n) for n in nodes]
        return self._init({n: n for n in names}, retrieve_from_epoch, path_prefix, path_type)

    def blob_list(self) -> dict[str, list[str]]:
        """``{node: [checkpointed blob names]}``."""
        return {node: list(self._names(node)) for node in self._require_files()}

    def set_params(self, nodes: Sequence[str | Node], path_prefix: str | None = None,
                   path_type: str | None = None) -> None:
        self._set_params([_node_str(n) for n in nodes], path_prefix, path_type)

    def get_ckpt_db_name(self, node_name: str, epoch: int) -> str | None:
        """Where ``node_name``'s checkpoint of ``epoch`` lives (None for an unknown node): the
        group its committed save wrote, or, before that save exists, Caffe2's ``db_name``
        (``<db_prefix>/<node>.<epoch>``, where the first save of an epoch lands; a later save
        of the same epoch writes at a path of its own)."""
        file_node = self._require_files().get(str(node_name))
        if file_node is None:
            return None
        record = self._node_record(file_node, check_epoch(epoch))
        if record is None:
            return db_name(epoch, file_node, self.url)
        return self._location.display(record.group)

    def load_blobs_locally(self, nodes: Sequence[str | Node], blob_names: Sequence[str],
                           epoch: int, session: Session) -> bool:
        """Load ``blob_names`` from every node's checkpoint of ``epoch`` into that node's
        workspace. Returns False, loading nothing, if any node's checkpoint is not committed."""
        files = {_node_str(n): _node_str(n) for n in nodes}
        if self._files is None:
            self._bind_nodes(files)
        elif self._files != files:
            raise JobDefinitionError(f"manager is bound to nodes {list(self._files)}, "
                                     f"not {list(files)}")
        epoch = check_epoch(epoch)
        if self._layout is not None:  # the job's save of it, however it reaches the nodes
            missing = [] if self.save_of(epoch) is not None else list(files.values())
        else:
            missing = [n for n in files.values() if self._node_record(n, epoch) is None]
        if missing:
            logger.info("no committed checkpoint of epoch %d for nodes %s", epoch, missing)
            return False
        session.run(self.load_blobs_from_checkpoint(blob_names, epoch))
        found = {b for node in files for b in blob_names if b in session.workspace(node)}
        absent = [b for b in blob_names if b not in found]
        if absent:
            logger.warning("blobs %s were in no node's checkpoint of epoch %d", absent, epoch)
        return True


class CheckpointManager(BaseCheckpointManager):
    """Checkpoints one node: ``<db_prefix>/<node_name>.<epoch>``.

    ``node_name`` names the files; the workspace saved and loaded is that of the node passed to
    ``init(nodes=[...])`` (default: ``node_name``). Same storage and commits as the multi-node
    manager, and the same keyword arguments (``layout=`` among them: see
    :class:`MultiNodeCheckpointManager`).
    """

    def __init__(
        self,
        db_prefix: str,
        node_name: str,
        db_type: str = "zarr",
        metadata_handler: MetadataHandler | None = None,
        *,
        storage_options: dict[str, Any] | None = None,
        filesystem: Any = None,
        pack_threshold: int = DEFAULT_PACK_THRESHOLD,
        async_save: bool | None = None,
        auto_resume: bool = True,
        layout: Layout | None = None,
    ) -> None:
        super().__init__(db_prefix, db_type, metadata_handler, storage_options=storage_options,
                         filesystem=filesystem, pack_threshold=pack_threshold,
                         async_save=async_save, auto_resume=auto_resume, layout=layout)
        self._node_name = check_node_name(node_name)

    def init(self, nodes: Sequence[str | Node] | None = None,
             retrieve_from_epoch: int | None = None, path_prefix: str | None = None,
             path_type: str | None = None) -> TaskGroup:
        """Like :meth:`MultiNodeCheckpointManager.init` for one node."""
        if nodes is not None and len(nodes) != 1:
            raise JobDefinitionError(
                f"CheckpointManager handles a single node, got {list(map(str, nodes))}; "
                "use MultiNodeCheckpointManager"
            )
        ws_node = _node_str(nodes[0]) if nodes else self._node_name
        return self._init({ws_node: self._node_name}, retrieve_from_epoch, path_prefix, path_type)

    def blob_list(self) -> list[str]:
        """The checkpointed blob names."""
        (node,) = self._require_files()
        return list(self._names(node))

    def set_params(self, nodes: Sequence[str | Node] | None = None,
                   path_prefix: str | None = None, path_type: str | None = None) -> None:
        self._set_params([self._node_name], path_prefix, path_type)


def _node_str(node: str | Node) -> str:
    """A node given as a name or a :class:`Node` (anything else is refused, never str()'d)."""
    if isinstance(node, Node):
        return str(node)
    return check_node_name(node)


class UploadTaskGroupBuilder(abc.ABC):
    """Builds the runnable that copies the final epoch's checkpoints elsewhere."""

    @abc.abstractmethod
    def build(self, epoch: int, checkpoint_manager: BaseCheckpointManager | None) -> TaskGroup | Task:
        """Return a runnable that uploads checkpoint ``epoch`` of ``checkpoint_manager``."""
