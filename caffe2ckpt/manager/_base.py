"""Caffe2's checkpoint managers: build the tasks that init, save and load node workspaces.

As in Caffe2, ``init``, ``save`` and ``load`` return a runnable (a :class:`TaskGroup` with one
task per node) that the caller runs with ``session.run(...)``; the other methods act directly.
The tasks are functions of :mod:`caffe2ckpt.manager._nodeops` bound to their arguments: they run wherever
the session runs the node (a thread here, a Dask actor elsewhere) and return blob lists,
records and timings, which the manager records once the group ran (``Task.on_result``).
:class:`CheckpointManager` is the one-node case of :class:`MultiNodeCheckpointManager`'s
machinery: the same code with one node whose files carry ``node_name``.
"""

from __future__ import annotations

import abc
import logging
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from typing import Any

import numpy as np

from caffe2ckpt.manager import _nodeops as nodeops
from caffe2ckpt.manager._async import AsyncSaving
from caffe2ckpt.background import ClosedOnExit
from caffe2ckpt.store.protocol import CheckpointStore, SaveInfo, claim_generation
from caffe2ckpt.store.records import CommitRecord, new_save_id
from caffe2ckpt.errors import InvalidLocationError, JobDefinitionError, writing
from caffe2ckpt.job import Node, Task, TaskGroup
from caffe2ckpt.fs.location import Location
from caffe2ckpt.metadata import MetadataHandler, ZarrMetadataHandler
from caffe2ckpt.naming import check_epoch, check_node_name, db_name
from caffe2ckpt.manager._nodeops import DB_EXISTS, Timed
from caffe2ckpt.session import Session
from caffe2ckpt.store.zarrgroup import DEFAULT_PACK_THRESHOLD
from caffe2ckpt.workspace import WorkspaceType

__all__ = ["BaseCheckpointManager", "CheckpointManager", "MultiNodeCheckpointManager",
           "UploadTaskGroupBuilder"]

logger = logging.getLogger(__name__)

_UNSET = object()
_DB_TYPES = ("zarr",)


class BaseCheckpointManager(AsyncSaving, ClosedOnExit):
    """Everything both managers share; ``_files`` maps workspace node -> node name in files."""

    def __init__(
        self,
        db_prefix: str,
        db_type: str = "zarr",
        metadata_handler: MetadataHandler | None = None,
        *,
        storage_options: dict[str, Any] | None = None,
        filesystem: Any = None,
        pack_threshold: int = DEFAULT_PACK_THRESHOLD,
        async_save: bool = False,
        auto_resume: bool = True,
    ) -> None:
        if db_type not in _DB_TYPES:
            raise InvalidLocationError(f"db_type {db_type!r} is not supported; use 'zarr'")
        self._db_prefix = db_prefix
        self._db_type = db_type
        if metadata_handler is None and auto_resume:
            metadata_handler = ZarrMetadataHandler()
        self._metadata_handler = metadata_handler
        self._storage_options = storage_options
        self._filesystem = filesystem
        self._location = Location(db_prefix, storage_options, filesystem)
        self._store = CheckpointStore(self._location, pack_threshold=pack_threshold)
        self._files: dict[str, str] | None = None
        self._blob_names: dict[str, list[str]] = {}
        self._path_prefix: str | None = None
        self._path_type: str | None = None
        self._stats: dict[str, int] = {}
        self._param_nodes: list[str] = []
        self._init_async(async_save)
        self._claim: str | None = None  # this manager's run: its claim and where it started
        self._parent: Any = _UNSET  # (epoch, generation) or None once claim() said
        self.last_records: dict[str, CommitRecord] = {}

    # -- properties ------------------------------------------------------------------------------

    @property
    def url(self) -> str:
        """The checkpoint prefix as given."""
        return self._db_prefix

    @property
    def store(self) -> CheckpointStore:
        return self._store

    @property
    def run_claim(self) -> str | None:
        """This manager's claim on the prefix (see :meth:`claim`), once it has one."""
        return self._claim

    def file_nodes(self) -> list[str]:
        """Node names as they appear in checkpoint files, in node order (from ``init``, else
        from ``set_params``)."""
        if self._files is None and self._param_nodes:
            return list(self._param_nodes)
        return list(self._require_files().values())

    def _require_files(self) -> dict[str, str]:
        if self._files is None:
            raise JobDefinitionError(f"{type(self).__name__}.init() must be called first")
        return self._files

    def _bind_nodes(self, files: dict[str, str]) -> bool:
        """Record the node mapping; False if it was already bound to the same nodes."""
        if not files:
            raise JobDefinitionError("no nodes to checkpoint: the init group has no tasks and "
                                     "no nodes_to_checkpoint were given")
        for name in files.values():
            check_node_name(name)
        if self._files is not None:
            if self._files != files:
                raise JobDefinitionError(
                    f"this manager was initialised for nodes {list(self._files)}, not "
                    f"{list(files)}; use a new manager"
                )
            return False
        self._files = files
        return True

    def _group(self, name: str, make_fn: Callable[[str, str], Any],
               collect: Callable[[str, str, Any], None] | None = None, *,
               epoch: int | None = None) -> TaskGroup:
        """A GLOBAL group with one task per node, acting on ``epoch``: ``make_fn(node,
        file_node)`` gives its fn; ``collect(node, file_node, result)`` records what it
        returned."""
        group = TaskGroup(WorkspaceType.GLOBAL, name=name, epoch=epoch)
        for node, file_node in self._require_files().items():
            on_result = None if collect is None else partial(collect, node, file_node)
            with Node(node):
                Task(make_fn(node, file_node), name=name, group=group, on_result=on_result)
        return group

    def _record_time(self, epoch: int) -> Callable[[str, str, Timed | None], None]:
        def collect(node: str, file_node: str, result: Timed | None) -> None:
            if result is not None:
                self._stats[db_name(epoch, file_node, self._db_prefix)] = result.ns
        return collect

    def _record_save(self, epoch: int) -> Callable[[str, str, Timed | None], None]:
        timed = self._record_time(epoch)

        def collect(node: str, file_node: str, result: Timed | None) -> None:
            if result is not None:
                self.last_records[node] = result.value
                timed(node, file_node, result)
        return collect

    # -- Caffe2 API ------------------------------------------------------------------------------

    def _init(self, files: dict[str, str], retrieve_from_epoch: int | None,
              path_prefix: str | None, path_type: str | None) -> TaskGroup:
        if not self._bind_nodes(files) and retrieve_from_epoch is None:
            return TaskGroup(WorkspaceType.GLOBAL, name="checkpoint_init")  # reuse: keep lists
        store = self._source(path_prefix, path_type)
        epoch = None if retrieve_from_epoch is None else check_epoch(retrieve_from_epoch)

        def make(node: str, file_node: str) -> Any:
            if epoch is None:
                return nodeops.blob_names
            return partial(nodeops.manifest_names, store, file_node, epoch)

        return self._group("checkpoint_init", make,
                           lambda node, _, names: self._blob_names.__setitem__(node, names))

    def _source(self, path_prefix: str | None, path_type: str | None) -> CheckpointStore:
        if path_type not in (None, *_DB_TYPES):
            raise InvalidLocationError(f"path_type {path_type!r} is not supported; use 'zarr'")
        path_prefix = path_prefix or self._path_prefix
        if not path_prefix:
            return self._store
        if not path_prefix.endswith("/"):
            raise InvalidLocationError(
                f"path_prefix {path_prefix!r} must end with '/' (files are <path_prefix><node>.<epoch>)"
            )
        return CheckpointStore(Location(path_prefix, self._storage_options, self._filesystem))

    def _names(self, node: str) -> list[str]:
        if node not in self._blob_names:
            raise JobDefinitionError(
                f"no blob list for node {node!r}: run the runnable returned by init() first"
            )
        return self._blob_names[node]

    def load(self, epoch: int, path_prefix: str | None = None,
             path_type: str | None = None) -> TaskGroup:
        """A runnable that restores every node's checkpointed blobs from ``epoch``."""
        epoch = check_epoch(epoch)
        store = self._source(path_prefix, path_type)
        return self._group("checkpoint_load", lambda node, file_node: partial(
            nodeops.load, store, file_node, epoch, self._names(node), True),
            self._record_time(epoch), epoch=epoch)

    def load_blobs_from_checkpoint(self, blob_names: Sequence[str], epoch: int) -> TaskGroup:
        """A runnable that loads only ``blob_names`` (those present) from ``epoch``."""
        epoch = check_epoch(epoch)
        names = list(blob_names)
        return self._group("checkpoint_partial_load", lambda _, file_node: partial(
            nodeops.load, self._store, file_node, epoch, names, False), self._record_time(epoch),
            epoch=epoch)

    def check_db_exists(self, epoch: int) -> TaskGroup:
        """A runnable whose per-node output ``caffe2ckpt/db_exists`` says whether that node's
        checkpoint of ``epoch`` is committed."""
        epoch = check_epoch(epoch)
        group = TaskGroup(WorkspaceType.GLOBAL, name="check_db_exists", epoch=epoch)
        for node, file_node in self._require_files().items():
            Task(partial(nodeops.db_exists, self._store, file_node, epoch),
                 name="check_db_exists", group=group, node=node, outputs=[DB_EXISTS])
        return group

    def _committed(self, file_node: str, epoch: int) -> bool:
        return nodeops.committed(self._store, file_node, epoch)

    def save(self, epoch: int, *, stop: bool = False, stop_conditions: Sequence[str] = (),
             metrics: dict[str, float] | None = None, writer: dict[str, Any] | None = None,
             claim: str | None = None) -> TaskGroup:
        """A runnable that saves and commits every node's checkpointed blobs as ``epoch``.

        The keyword arguments are kept in the commit records (the runner passes the epoch's stop
        decision and the session's writer info). Saves belong to this manager's run (see
        :meth:`claim`; claimed here on the first save if not before, continuing the lineage from
        the newest committed epoch below ``epoch``): they refuse to commit once a newer run has
        claimed the prefix. An explicit ``claim`` from another manager's :meth:`claim` makes the
        save part of that run instead.

        With ``async_save``, running it only snapshots the blobs; they are written and committed
        in the background (see :meth:`wait_until_finished`). A previous background save is
        waited for first, and its failure is raised here.
        """
        epoch = check_epoch(epoch)
        self.wait_until_finished()
        if claim is None:
            if self._claim is None:  # a save never goes without a claim: unfenced, and of no
                # generation, its epochs would rank below every claimed run's
                parent = (self._parent if self._parent is not _UNSET
                          else self._store.parent_before(epoch, self.file_nodes()))
                with writing(f"claiming {self.url!r} to save epoch {epoch}", epoch):
                    self.claim(writer, parent=parent)
            claim = self._claim
        parent = (self._parent if claim == self._claim
                  else self._store.parent_before(epoch, self.file_nodes()))
        info = SaveInfo(save_id=new_save_id(claim_generation(claim)), nodes=self.file_nodes(),
                        stop=bool(stop), stop_conditions=tuple(stop_conditions), metrics=metrics,
                        writer=writer, claim=claim, parent=parent)
        self.last_records = {}
        record = self._record_save(epoch)

        def collect(node: str, file_node: str, result: Timed | None) -> None:
            self._save_group = group
            if result is None:
                self._note_pending(epoch, node)
            record(node, file_node, result)

        group = self._group("checkpoint_save", lambda node, file_node: partial(
            nodeops.save, self._store, node, file_node, epoch, self._names(node), info,
            self._background), collect, epoch=epoch)
        return group

    def write_checkpoint_metadata(self, epoch: int) -> None:
        if self._metadata_handler is not None:
            self._metadata_handler.write(epoch=epoch)

    def get_resume_from_epoch_id(self, user_epoch: int | None = None) -> int | None:
        """``user_epoch``, or with a metadata handler, the epoch it says to resume from."""
        if self._metadata_handler is None:
            return user_epoch
        if not self._param_nodes and self._files is not None:  # bound by init() alone
            self._set_params(self.file_nodes(), None, None)
        return self._metadata_handler.last_epoch(user_epoch=user_epoch)

    def _set_params(self, node_names: list[str], path_prefix: str | None,
                    path_type: str | None) -> None:
        self._param_nodes = list(node_names)
        if path_prefix:
            self._path_prefix = path_prefix
        if path_type:
            self._path_type = path_type
        if self._metadata_handler is None:
            return
        extra = {k: v for k, v in (("storage_options", self._storage_options),
                                   ("filesystem", self._filesystem)) if v is not None}
        self._metadata_handler.set_params(
            db_prefix=self._db_prefix, db_type=self._db_type, node_names=node_names,
            path_prefix=self._path_prefix, path_type=self._path_type, **extra,
        )

    def cp_accessible(self, epoch: int | None = None) -> bool:
        if self._metadata_handler is None:
            return True
        return bool(self._metadata_handler.cp_accessible(epoch))

    @property
    def access_error(self) -> BaseException | None:
        """Why the metadata handler last found the prefix inaccessible, if it says."""
        return getattr(self._metadata_handler, "last_error", None)

    def collect_checkpoint_stats(self, stats: dict[str, int]) -> None:
        """Add ``{db path: nanoseconds}`` of the last init/save/load actions to ``stats``."""
        stats.update(self._stats)

    def report_checkpoint_stats(self, action_name: str) -> None:
        stats: dict[str, int] = {}
        self.collect_checkpoint_stats(stats)
        self._stats = {}
        if self._metadata_handler is not None:
            self._metadata_handler.report(action_name, stats)

    # -- beyond Caffe2: what the runner needs to resume safely ------------------------------------

    def claim(self, writer: dict[str, Any] | None = None, *,
              parent: tuple[int, int] | None = None) -> str:
        """Start a run: claim the prefix (see :meth:`CheckpointStore.claim`; older runs are
        fenced off) for the saves that follow. ``parent`` is the committed save the run
        resumed from, as (epoch, generation), or None for a fresh start, which supersedes every
        earlier run's epochs (see :mod:`caffe2ckpt.history.lineage`)."""
        self._parent = parent  # kept even if claiming fails: the first save claims again
        self._claim = self._store.claim(writer)
        return self._claim

    def epoch_records(self, epoch: int) -> dict[str, CommitRecord] | None:
        """The records committing ``epoch`` for every node, or None."""
        return self._store.epoch_records(epoch, self.file_nodes())

    def committed_epochs(self) -> Iterator[int]:
        """The committed epochs of the current lineage, newest first (read lazily)."""
        return self._store.lineage_epochs(self.file_nodes())


class MultiNodeCheckpointManager(BaseCheckpointManager):
    """Checkpoints every node of a job: ``<db_prefix>/<node>.<epoch>`` per node and epoch.

    Args:
        db_prefix: a local path or any fsspec URL.
        db_type: ``"zarr"``.
        metadata_handler: decides the resume epoch. Default: a :class:`ZarrMetadataHandler`,
            so a retried or re-run job resumes from its newest committed epoch.
        storage_options: fsspec options for ``db_prefix``.
        filesystem: an fsspec filesystem to use instead of one made from the URL.
        pack_threshold: blobs smaller than this many bytes are packed together.
        async_save: write and commit in the background after a snapshot (see ``save``).
        auto_resume: with ``False`` and no ``metadata_handler``, Caffe2's behaviour: a job
            resumes only from an explicit ``resume_from_epoch`` and otherwise starts from
            scratch; its fresh start then supersedes the epochs already committed.

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
        """Where ``node_name``'s checkpoint of ``epoch`` lives, or None for an unknown node."""
        file_node = self._require_files().get(str(node_name))
        return None if file_node is None else db_name(check_epoch(epoch), file_node,
                                                      self._db_prefix)

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
        missing = [n for n in files.values() if not self._committed(n, epoch)]
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
    manager.
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
        async_save: bool = False,
        auto_resume: bool = True,
    ) -> None:
        super().__init__(db_prefix, db_type, metadata_handler, storage_options=storage_options,
                         filesystem=filesystem, pack_threshold=pack_threshold,
                         async_save=async_save, auto_resume=auto_resume)
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
