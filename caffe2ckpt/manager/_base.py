"""What both Caffe2 checkpoint managers share: build the tasks that init, save and load node
workspaces, and keep the run their saves belong to.

As in Caffe2, ``init``, ``save`` and ``load`` return a runnable (a :class:`TaskGroup` with one
task per node) that the caller runs with ``session.run(...)``; the other methods act directly.
The tasks are functions of :mod:`caffe2ckpt.manager._nodeops` bound to their arguments: they run
wherever the session runs the node (a thread here, a Dask actor elsewhere) and return blob
lists, records and timings, which the manager collects as each task ends (``Task.on_result``).

Which committed save "epoch e" means, where a save's run starts and what retention removes are
:class:`~caffe2ckpt.history.current.CurrentRun`'s answers; the runner gets a save's outcome as
the return value of :meth:`BaseCheckpointManager.save_checkpoint` and
:meth:`BaseCheckpointManager.finish_save`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from caffe2ckpt.background import ClosedOnExit
from caffe2ckpt.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CheckpointWriteError,
    InvalidLocationError,
    JobDefinitionError,
    writing,
)
from caffe2ckpt.fs.location import Location, resolve_source
from caffe2ckpt.history.current import CurrentRun
from caffe2ckpt.history.lineage import Save
from caffe2ckpt.history.placement import Placement, place
from caffe2ckpt.history.scan import Family, LeftBehindWarning, PrefixScan, other_saves, scan
from caffe2ckpt.job import Node, Task, TaskGroup
from caffe2ckpt.manager import _nodeops as nodeops
from caffe2ckpt.manager._async import AsyncSaving
from caffe2ckpt.manager._nodeops import DB_EXISTS, Timed
from caffe2ckpt.metadata import MetadataHandler, ZarrMetadataHandler
from caffe2ckpt.naming import check_epoch, check_node_name, db_name
from caffe2ckpt.policy import StepManagerOptions
from caffe2ckpt.session import Session
from caffe2ckpt.sharding import Layout
from caffe2ckpt.store.commit.protocol import CheckpointStore, SaveInfo
from caffe2ckpt.store.commit.runs import Run
from caffe2ckpt.store.format.paths import new_save_id
from caffe2ckpt.store.format.records import CommitRecord, RecordRef
from caffe2ckpt.store.format.zarrgroup import DEFAULT_PACK_THRESHOLD
from caffe2ckpt.store.read.replicas import RowSpec, check_replicas, check_rows
from caffe2ckpt.store.read.save import shared_names
from caffe2ckpt.store.read.shared import SharedReads
from caffe2ckpt.workspace import WorkspaceType

__all__ = ["BaseCheckpointManager", "SaveOutcome"]

logger = logging.getLogger(__name__)

_DB_TYPES = ("zarr",)
NEWEST: Any = object()  # claim(): the run continues from the newest save of the lineage


@dataclass(frozen=True)
class SaveOutcome:
    """What became of one epoch's save: committed (``records`` by node), or still being
    written in the background (``pending``)."""

    epoch: int
    records: dict[str, CommitRecord] = field(default_factory=dict)
    pending: bool = False


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
        async_save: bool | None = None,
        auto_resume: bool = True,
        layout: Layout | None = None,
    ) -> None:
        if db_type not in _DB_TYPES:
            raise InvalidLocationError(f"db_type {db_type!r} is not supported; use 'zarr'")
        if layout is not None and not isinstance(layout, Layout):
            raise JobDefinitionError(f"layout must be a caffe2ckpt.Layout, got "
                                     f"{type(layout).__name__}")
        self._layout = layout
        db_prefix, storage_options = resolve_source(db_prefix, storage_options)
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
        self._runs: dict[tuple[str, frozenset[str]], CurrentRun] = {}
        self._attempt: tuple[int, str] | None = None  # the last save begun: epoch, save id
        self._left_behind = LeftBehindWarning()  # a resume says what it does not resume from
        self._passed_over: set[str] = set()  # newer saves without a layout, warned of
        self._reading: dict[str, PrefixScan] | None = None  # within resuming(): by prefix
        self._init_async(async_save)

    # -- properties ------------------------------------------------------------------------------

    @property
    def url(self) -> str:
        """The checkpoint prefix as given, without user, password, query or fragment (what
        messages name it by: :func:`caffe2ckpt.urls.public_url`)."""
        return self._location.url

    @property
    def store(self) -> CheckpointStore:
        return self._store

    @property
    def run(self) -> Run | None:
        """This manager's current run on the prefix (see :meth:`claim`), once it has one."""
        return self.current().run

    def file_nodes(self) -> list[str]:
        """Node names as they appear in checkpoint files, in node order (from ``init``, else
        from ``set_params``)."""
        if self._files is None and self._param_nodes:
            return list(self._param_nodes)
        return list(self._require_files().values())

    def current(self, store: CheckpointStore | None = None,
                nodes: Collection[str] | None = None) -> CurrentRun:
        """The run and lineage view of the family ``nodes`` (default: this manager's nodes)
        under ``store`` (default: this manager's prefix)."""
        store = store or self._store
        family = frozenset(self.file_nodes() if nodes is None else nodes)
        key = (store.location.url, family)
        if key not in self._runs:
            self._runs[key] = CurrentRun(store, family)
        return self._runs[key]

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
                self._stats[db_name(epoch, file_node, self.url)] = result.ns
        return collect

    def _record_save(self, epoch: int, save_id: str,
                     into: dict[str, CommitRecord]) -> Callable[[str, str, Timed | None], None]:
        """Collect each node's record of a save into ``into``; once every node committed,
        the run learns of the committed save."""
        timed = self._record_time(epoch)

        def collect(node: str, file_node: str, result: Timed | None) -> None:
            if result is None:
                return
            into[file_node] = result.value
            timed(node, file_node, result)
            if len(into) == len(self._require_files()):
                self.current().committed(Save(epoch, save_id, dict(into)))
        return collect

    # -- which save an epoch means -----------------------------------------------------------

    def lineage_save(self, epoch: int, store: CheckpointStore | None = None) -> Save | None:
        """The committed save of ``epoch`` on the current lineage of this manager's nodes (None
        when there is none: never committed, partial, or superseded)."""
        return self.current(store).lineage_save(check_epoch(epoch))

    def continues(self, run: tuple[int, float], epoch: int) -> str | None:
        """Why copies of ``run`` (generation, creation time) in worker memory do not continue
        the committed ``epoch``, the lineage's newest, or None when they do
        (:meth:`CurrentRun.continues <caffe2ckpt.history.current.CurrentRun.continues>`)."""
        save = self.lineage_save(epoch)
        if save is None:
            return f"epoch {epoch} is not on the lineage of nodes {self.file_nodes()}"
        return self.current().continues(run, save)

    def save_of(self, epoch: int, store: CheckpointStore | None = None) -> Save | None:
        """The committed save ``epoch`` means to this job when asked for by number (a load, an
        explicit resume): its lineage's, else the newest superseded save of that epoch of its
        nodes; else, with a layout, one of the saves of other nodes the job reaches
        (:meth:`other_saves`); else, without a layout, a save of the newest run holding all
        its nodes (loading some nodes of a bigger job's checkpoint, node by node, as Caffe2
        allows)."""
        epoch = check_epoch(epoch)
        store = store or self._store
        save = self.current(store).save_of(epoch)
        if save is not None:
            return save
        if self._layout is None:
            return self._scan(store).save_at(epoch, self.file_nodes())
        return self.other_saves(store).get(epoch)

    def other_saves(self, store: CheckpointStore | None = None) -> dict[int, Save]:
        """With a layout, the saves of other node sets this job reaches besides its own
        lineage under ``store`` (:func:`~caffe2ckpt.history.scan.other_saves`): while its
        nodes have none, those it resumes on another node count; after, the one its lineage
        starts from. Without a layout, none."""
        store = store or self._store
        if self._layout is None:
            return {}
        found = self._scan(store)
        nodes = frozenset(self.file_nodes())
        return other_saves(found, found.families.get(nodes) or Family(nodes, [], []),
                           warned=self._passed_over)

    def elastic_saves(self, store: CheckpointStore | None = None) -> dict[int, Save]:
        """With a layout, while this job's nodes have no committed save under ``store``: the
        saves of another node count this job resumes from, split anew over its nodes
        (:func:`~caffe2ckpt.history.scan.elastic_steps`), by epoch; else none."""
        store = store or self._store
        if self._layout is None or self.current(store).newest() is not None:
            return {}
        return self.other_saves(store)

    def _scan(self, store: CheckpointStore) -> PrefixScan:
        """The whole prefix, read once per resume (see :meth:`resuming`), else now."""
        key = store.location.url
        if self._reading is None:
            return scan(store)
        if key not in self._reading:
            self._reading[key] = scan(store)
        return self._reading[key]

    def placement(self, epoch: int, store: CheckpointStore | None = None,
                  names: Collection[str] | None = None) -> Placement:
        """Which committed save ``epoch`` means to this job (:meth:`save_of`) and how its
        blobs (all, or ``names``) reach the job's nodes
        (:func:`~caffe2ckpt.history.placement.place`).

        Raises:
            CheckpointNotFoundError: no such save.
            JobDefinitionError: the save cannot reach the job's nodes as the layout declares.
        """
        store = store or self._store
        save = self.save_of(epoch, store)
        if save is None:
            raise CheckpointNotFoundError(
                f"epoch {epoch} is not committed for nodes {self.file_nodes()} under "
                f"{store.location.display()!r}")
        return place(save, self.file_nodes(), self._layout, store.location.display(), names)

    def _node_record(self, file_node: str, epoch: int) -> CommitRecord | None:
        """The record ``file_node`` reads at ``epoch``: with a layout, its own in this job's
        save of it, unless that save reaches the job's nodes cut anew (then None: no one
        record holds its blobs); without one, of this job's save, else of a save of the newest
        run holding that node (Caffe2's per-node lookups)."""
        if self._layout is not None:
            try:
                placement = self.placement(epoch)
            except (CheckpointNotFoundError, JobDefinitionError):
                return None
            return None if placement.reshards else placement.save.records.get(file_node)
        save = self.save_of(epoch)
        if save is None or file_node not in save.records:
            save = self._scan(self._store).save_at(epoch, [file_node])
        return None if save is None else save.records.get(file_node)

    def committed_epochs(self) -> Iterator[int]:
        """The committed epochs of the current lineage, newest first (read lazily)."""
        return (save.epoch for save in self.lineage())

    def lineage(self) -> Iterator[Save]:
        """The committed saves of the current lineage, newest first (read lazily: nothing is
        read until the first save is asked for)."""
        yield from self.current().lineage()

    def fallback_lineage(self) -> Iterator[Save]:
        """The saves an automatic resume falls back along, newest first: the current lineage
        then, with a layout, the save of other nodes it starts from; or, while this job's nodes
        have saved nothing and it resumes saves of another node count (:meth:`elastic_saves`),
        those saves' lineage."""
        elastic = self.elastic_saves()
        if elastic:
            yield from (elastic[epoch] for epoch in sorted(elastic, reverse=True))
            return
        yield from self.lineage()
        yield from self.other_saves().values()

    # -- Caffe2 API ------------------------------------------------------------------------------

    def _init(self, files: dict[str, str], retrieve_from_epoch: int | None,
              path_prefix: str | None, path_type: str | None) -> TaskGroup:
        if not self._bind_nodes(files) and retrieve_from_epoch is None:
            return TaskGroup(WorkspaceType.GLOBAL, name="checkpoint_init")  # reuse: keep lists
        store = self._source(path_prefix, path_type)
        if retrieve_from_epoch is None:
            def make(node: str, file_node: str) -> Any:
                return nodeops.blob_names
        else:
            self.current(store).end()  # a resume starts a new run (see load)
            placement = self.placement(check_epoch(retrieve_from_epoch), store)
            if placement.reshards:
                names = shared_names(store, placement.save.records, placement.order,
                                     placement.kinds)

                def make(node: str, file_node: str) -> Any:
                    return partial(nodeops.given_names, names[file_node])
            else:
                records = placement.save.records

                def make(node: str, file_node: str) -> Any:
                    return partial(nodeops.manifest_names, store, records[file_node])
            return self._group("checkpoint_init", make, self._collect_names(placement))
        return self._group("checkpoint_init", make,
                           lambda node, _, names: self._blob_names.__setitem__(node, names))

    def _collect_names(self, placement: Placement) -> Callable[[str, str, list[str]], None]:
        """Record each node's blob list of a resume; once every node's is in, a WARNING names
        the blobs the layout adopts (:meth:`~caffe2ckpt.history.placement.Placement.
        adoption`)."""
        files = self._require_files()
        seen: dict[str, list[str]] = {}

        def collect(node: str, file_node: str, names: list[str]) -> None:
            self._blob_names[node] = seen[file_node] = names
            warning = placement.adoption(seen) if len(seen) == len(files) else None
            if warning is not None:
                logger.warning("%s under %s", warning, self._location.display())
        return collect

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
        """A runnable that restores every node's checkpointed blobs from ``epoch`` (the
        current lineage's save of it)."""
        epoch = check_epoch(epoch)
        store = self._source(path_prefix, path_type)
        self.current(store).end()  # a load starts a new run, from the prefix as it is now
        return self._load_group("checkpoint_load", self.placement(epoch, store), store,
                                self._names, True)

    def _load_group(self, name: str, placement: Placement, store: CheckpointStore,
                    names: Callable[[str], list[str]], require_all: bool) -> TaskGroup:
        """One task per node loading its ``names(node)`` of the save as ``placement`` says:
        its share, cut anew, or its own blobs (with ``require_all``, every one of them)."""
        shared = SharedReads()  # what several nodes read, once per process
        save, epoch = placement.save, placement.save.epoch
        return self._group(name, lambda node, file_node: partial(
            nodeops.load, store, save.records, file_node, placement.cut, names(node),
            require_all, shared), self._record_time(epoch), epoch=epoch)

    def _check_layout(self, session: Session, epoch: int) -> None:
        """Before the save writes anything: each node's replicated blobs hold what their writers
        hold, and the rows blobs fit the layout (:mod:`~caffe2ckpt.store.read.replicas`; one group:
        a digest of each replicated blob and the dtype and shape of each rows blob, per node)."""
        writers = self._writers()
        rows = [] if self._layout is None else self._layout.rows_among(
            n for node in self._require_files() for n in self._names(node))
        if not writers and not rows:
            return
        facts: dict[str, tuple[dict[str, str], dict[str, RowSpec]]] = {}
        session.run(self._group("checkpoint_replicas", lambda node, file_node: partial(
            nodeops.layout_facts_of, [n for n in self._names(node) if n in writers], rows),
            lambda node, file_node, result: facts.__setitem__(file_node, result),
            epoch=epoch))
        where = self._store.location.display()
        check_replicas(epoch, {node: f[0] for node, f in facts.items()}, writers, where)
        check_rows(epoch, {node: f[1] for node, f in facts.items()}, rows, self.file_nodes(),
                   self._layout.partition, where)  # type: ignore[union-attr]

    def _writers(self) -> dict[str, str]:
        """Which node (by file name) writes each replicated blob of a save: the first in node
        order holding it."""
        if self._layout is None:
            return {}
        files = self._require_files()
        return self._layout.writers(self.file_nodes(), {
            file_node: self._names(node) for node, file_node in files.items()})

    def load_blobs_from_checkpoint(self, blob_names: Sequence[str], epoch: int) -> TaskGroup:
        """A runnable that loads only ``blob_names`` (those present) from ``epoch``: this job's
        save of it as :meth:`placement` places it or, without a layout, each node's record of
        it as saved (Caffe2's per-node loads)."""
        epoch = check_epoch(epoch)
        names = list(blob_names)
        if self._layout is not None:
            placement = self.placement(epoch, names=names)
            held = shared_names(self._store, placement.save.records, placement.order,
                                placement.kinds) if placement.reshards else None
            files = self._require_files()
            return self._load_group(
                "checkpoint_partial_load", placement, self._store, lambda node: names
                if held is None else [n for n in names if n in held[files[node]]], False)
        shared = SharedReads()

        def make(node: str, file_node: str) -> Any:
            record = self._node_record(file_node, epoch)
            if record is None:
                raise CheckpointNotFoundError(
                    f"epoch {epoch} is not committed for node {file_node!r} under {self.url!r}")
            return partial(nodeops.load, self._store, {file_node: record}, file_node, None,
                           names, False, shared)

        return self._group("checkpoint_partial_load", make, self._record_time(epoch),
                           epoch=epoch)

    def check_db_exists(self, epoch: int) -> TaskGroup:
        """A runnable whose per-node output ``caffe2ckpt/db_exists`` says whether that node's
        checkpoint of ``epoch`` is committed (on the current lineage; with a layout, whether
        the job's save of it is, whichever nodes made it)."""
        epoch = check_epoch(epoch)
        group = TaskGroup(WorkspaceType.GLOBAL, name="check_db_exists", epoch=epoch)
        whole = None if self._layout is None else self.save_of(epoch) is not None
        for node, file_node in self._require_files().items():
            exists = whole if whole is not None else self._node_record(file_node,
                                                                       epoch) is not None
            Task(partial(nodeops.db_exists, exists), name="check_db_exists", group=group,
                 node=node, outputs=[DB_EXISTS])
        return group

    def save(self, epoch: int, *, stop: bool = False, stop_conditions: Sequence[str] = (),
             metrics: dict[str, float] | None = None, writer: dict[str, Any] | None = None,
             claim: Run | None = None) -> TaskGroup:
        """A runnable that saves and commits every node's checkpointed blobs as ``epoch``.

        The keyword arguments are kept in the commit records (the runner passes the epoch's stop
        decision and the session's writer info). Saves belong to this manager's run (see
        :meth:`claim`): a save above the run's newest save continues it; any other save starts
        a new run that continues the lineage from the newest committed epoch below ``epoch``
        (so going back supersedes the saves above it). A run refuses to commit once a newer run
        has claimed the prefix. An explicit ``claim`` (another manager's :meth:`claim`) makes
        the save part of that run instead.

        With ``async_save``, running it only snapshots the blobs; they are written and committed
        in the background (see :meth:`wait_until_finished`). A previous background save is
        waited for first, and its failure is raised here.
        """
        return self._save_group(epoch, {}, stop=stop, stop_conditions=stop_conditions,
                                metrics=metrics, writer=writer, claim=claim)

    def _save_group(self, epoch: int, into: dict[str, CommitRecord], *, stop: bool,
                    stop_conditions: Sequence[str], metrics: dict[str, float] | None,
                    writer: dict[str, Any] | None, claim: Run | None = None,
                    options: StepManagerOptions | None = None) -> TaskGroup:
        epoch = check_epoch(epoch)
        self.wait_until_finished()
        if claim is None:
            with writing(f"claiming {self.url!r} to save epoch {epoch}", epoch):
                run = self.current().run_for(epoch, writer)
        else:
            run = claim
            if run.parent is not None and epoch <= run.parent[0]:
                raise JobDefinitionError(
                    f"run {run.generation} started from epoch {run.parent[0]}: it cannot save "
                    f"epoch {epoch} (a run saves only above where it started)")
        save_id = new_save_id(run.generation)
        self._attempt = (epoch, save_id)
        info = SaveInfo(save_id=save_id, nodes=self.file_nodes(), stop=bool(stop),
                        stop_conditions=tuple(stop_conditions), metrics=metrics, writer=writer,
                        parent=run.parent, layout=self._layout, writers=self._writers())
        record = self._record_save(epoch, save_id, into)
        delta = None
        if options is not None and options.delta_saves:
            base = self.current().base_for(epoch) if claim is None else None
            delta = nodeops.DeltaArgs(self._key, options, base)

        def collect(node: str, file_node: str, result: Timed | None) -> None:
            self._save_group_ran = group
            if result is None:
                self._note_pending(epoch, node, save_id)
            record(node, file_node, result)

        group = self._group("checkpoint_save", lambda node, file_node: partial(
            nodeops.save, self._store, node, file_node, epoch, self._names(node), info,
            self._background, delta), collect, epoch=epoch)
        return group

    def save_checkpoint(self, session: Session, epoch: int, *, stop: bool = False,
                        stop_conditions: Sequence[str] = (),
                        metrics: dict[str, float] | None = None,
                        writer: dict[str, Any] | None = None,
                        options: StepManagerOptions | None = None) -> SaveOutcome:
        """Run the save of ``epoch`` on ``session`` and return its outcome (what the runner
        uses; :meth:`save` is Caffe2's runnable). ``options`` with ``delta_saves`` make it a
        differential save (see :mod:`caffe2ckpt.store.delta.plan`). With replicated blobs in the
        layout, every node's value of each is first compared with the one its writer will
        write (:mod:`~caffe2ckpt.store.read.replicas`): if they differ, nothing is written."""
        self._check_layout(session, epoch)
        into: dict[str, CommitRecord] = {}
        session.run(self._save_group(epoch, into, stop=stop, stop_conditions=stop_conditions,
                                     metrics=metrics, writer=writer, options=options))
        if self.pending_epoch == epoch:
            return SaveOutcome(epoch, pending=True)
        return self._outcome(epoch, into)

    def finish_save(self) -> SaveOutcome | None:
        """Wait for a background save and return its outcome (None: none was in flight).

        Raises:
            CheckpointWriteError: it failed.
        """
        epoch = self.pending_epoch
        if epoch is None:
            return None
        return self._outcome(epoch, self.wait_until_finished())

    def recheck_save(self, epoch: int) -> SaveOutcome | None:
        """The outcome of the last save of ``epoch`` if every node's commit record of it is
        there, although the save raised (its answer lost on the way back, a take-back that
        failed, a worker that committed and died): None if it is not committed."""
        if self._attempt is None or self._attempt[0] != epoch:
            return None
        save_id = self._attempt[1]
        records = {}
        for node in self.file_nodes():
            try:
                records[node] = self._store.read_record(
                    RecordRef(epoch=epoch, node=node, save_id=save_id))
            except CheckpointError:
                return None
        self.current().committed(Save(epoch, save_id, records))
        return SaveOutcome(epoch, records)

    def _outcome(self, epoch: int, records: dict[str, CommitRecord]) -> SaveOutcome:
        nodes = self.file_nodes()
        if sorted(records) != sorted(nodes):
            raise CheckpointWriteError(
                f"checkpoint of epoch {epoch}: only nodes {sorted(records)} of {nodes} committed",
                epoch=epoch)
        return SaveOutcome(epoch, dict(records))

    def retain(self, options: StepManagerOptions | None,
               protect: Collection[int] = ()) -> list[Save]:
        """Apply ``options``' retention to this manager's lineage (fenced by its run); return
        the saves removed (see :mod:`caffe2ckpt.history.retention`)."""
        return self.current().retain(options, protect)

    def write_checkpoint_metadata(self, epoch: int) -> None:
        if self._metadata_handler is not None:
            self._metadata_handler.write(epoch=epoch)

    def get_resume_from_epoch_id(self, user_epoch: int | None = None) -> int | None:
        """``user_epoch``, or with a metadata handler, the epoch it says to resume from. Asking
        starts a new run: this manager's earlier run and its view of the prefix are over."""
        if self._files is not None or self._param_nodes:
            self.end_run()
        if self._metadata_handler is None:
            return user_epoch
        if not self._param_nodes and self._files is not None:  # bound by init() alone
            self._set_params(self.file_nodes(), None, None)
        elastic = self.elastic_saves()
        if elastic and (user_epoch is None or user_epoch in elastic):
            return max(elastic) if user_epoch is None else user_epoch
        if self._layout is not None and user_epoch is not None and not elastic and (
                self.current().save_of(user_epoch) is None
                and user_epoch in self.other_saves()):
            return user_epoch  # the save of other nodes its lineage starts from
        if self._layout is not None and user_epoch is None:
            self._left_behind.check(self._store, self.current().newest())
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

    # -- beyond Caffe2: runs ---------------------------------------------------------------------

    def end_run(self) -> None:
        """End this manager's run on the prefix (a new attempt of the job starts): what it
        read is forgotten, and the next save, resume or :meth:`claim` decides from the prefix
        as it is then."""
        self.current().end()

    @contextmanager
    def resuming(self) -> Iterator[None]:
        """A block for one resume (``init(retrieve_from_epoch=...)``, ``load``, the questions
        about the loaded save and the :meth:`claim` that continues it): this manager's run
        ends, and within the block the prefix is read once, so what is loaded and what the new
        run continues are the same save even if another writer re-saves that epoch meanwhile.
        Outside such a block, a manager without a run reads the prefix again for each
        question."""
        self._reading = {}  # and what is read of the whole prefix (another node count's saves)
        try:
            with self.current().resuming():
                yield
        finally:
            self._reading = None

    def claim(self, writer: dict[str, Any] | None = None, *,
              parent: Any = NEWEST) -> Run:
        """Start a run (its entry in the run log; older runs are fenced off) for the saves that
        follow. ``parent`` is the committed save the run resumed from, as (epoch, generation);
        by default the newest save of the current lineage (the run continues it); None is a
        fresh start, which supersedes every earlier run's epochs (see
        :mod:`caffe2ckpt.history.lineage`). If the claim fails, the first save claims again
        with the same parent."""
        if self._files is None and not self._param_nodes:
            raise JobDefinitionError(f"{type(self).__name__}.claim() needs the nodes its run "
                                     "saves: call init() or set_params() first")
        if parent is NEWEST:
            self.end_run()  # the newest save as the prefix is now, not as this run saw it
            newest = self.current().newest()
            parent = None if newest is None else (newest.epoch, newest.generation)
        return self.current().start(parent, writer)


