"""An Orbax-style checkpoint manager (``AbstractCheckpointManager``'s interface) over the same
prefix, node groups and commit records as :class:`~caffe2ckpt.JobRunner` (a step is an epoch).

Checkpoints written by a job are steps here and steps saved here resume a job. Only committed
steps (every node of the save has its record) are ever reported.

Example:
    >>> import numpy as np
    >>> from caffe2ckpt import StepCheckpointManager, StepManagerOptions
    >>> with StepCheckpointManager("memory://doc/steps",
    ...                            options=StepManagerOptions(max_to_keep=2)) as mgr:
    ...     for step in range(4):
    ...         _ = mgr.save(step, {"trainer_0": {"w": np.full(3, step)}}, metrics={"loss": 1 / (step + 1)})
    ...     mgr.all_steps(), mgr.restore(3)["trainer_0"]["w"].tolist()
    ([2, 3], [3, 3, 3])
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from caffe2ckpt import events
from caffe2ckpt.background import BackgroundSaves, ClosedOnExit
from caffe2ckpt.errors import (
    CheckpointError,
    CheckpointFencedError,
    CheckpointNotFoundError,
    CheckpointWriteError,
    InvalidLocationError,
    JobDefinitionError,
    writing,
)
from caffe2ckpt.fs.location import Location
from caffe2ckpt.history.current import CurrentRun
from caffe2ckpt.history.lineage import Save
from caffe2ckpt.history.placement import Placement, place
from caffe2ckpt.history.scan import Family, LeftBehindWarning, PrefixScan, other_saves, scan
from caffe2ckpt.naming import check_epoch, check_node_name, get_ckpt_filename
from caffe2ckpt.policy import StepManagerOptions, should_save
from caffe2ckpt.preemption import PreemptionWatch
from caffe2ckpt.sharding import Layout
from caffe2ckpt.steps.abstract import AbstractCheckpointManager
from caffe2ckpt.steps.hints import ChangedRows, check_hints
from caffe2ckpt.steps.items import Items, check_items, read_nodes, split_replicas
from caffe2ckpt.steps.metadata import (
    BlobMetadata,
    RootMetadata,
    StepMetadata,
    as_metadata,
    blob_metadata,
    read_root_metadata,
    step_metadata,
    write_root_metadata,
)
from caffe2ckpt.store.commit.protocol import CheckpointStore, SaveInfo
from caffe2ckpt.store.delta.plan import DeltaTracker
from caffe2ckpt.store.delta.write import DeltaWrite
from caffe2ckpt.store.format.paths import new_save_id
from caffe2ckpt.store.format.records import CommitRecord
from caffe2ckpt.store.format.zarrgroup import DEFAULT_PACK_THRESHOLD
from caffe2ckpt.store.read.save import SaveReader, share_infos

__all__ = ["StepCheckpointManager"]

logger = logging.getLogger(__name__)

class StepCheckpointManager(ClosedOnExit, AbstractCheckpointManager):
    """Save, list, restore and retire steps under ``directory`` (any fsspec URL or local path).

    Args:
        directory: the checkpoint prefix (shared with ``JobRunner`` / the Caffe2 managers).
        options: save policy and retention (:class:`StepManagerOptions`).
        nodes: the nodes this manager owns: a step must have all of them, and retention and
            :meth:`delete` touch only steps saved by exactly these nodes (or a subset). Default:
            any node; retention then touches steps saved by the nodes this manager saved.
        metadata: custom root metadata, stored once (never overwritten) in ``_metadata.json``.
        storage_options: fsspec options for ``directory`` (credentials, endpoint, ...).
        filesystem: an fsspec filesystem to use instead of one made from the URL.
        handle_preemption: watch SIGTERM (main thread only) until :meth:`close`; see
            :meth:`reached_preemption`.
        layout: how the blobs are spread over ``nodes`` (:class:`~caffe2ckpt.Layout`),
            stored with every save. With ``nodes`` and a layout, a step saved by another set of
            nodes (the newest family of the prefix whose saves carry a layout, while this
            manager's nodes have saved none) is listed and restored split anew over
            ``nodes``; saves continue from it.
    """

    def __init__(
        self,
        directory: str,
        *,
        options: StepManagerOptions | None = None,
        nodes: Sequence[str] | None = None,
        metadata: Mapping[str, Any] | None = None,
        storage_options: dict[str, Any] | None = None,
        filesystem: Any = None,
        pack_threshold: int = DEFAULT_PACK_THRESHOLD,
        handle_preemption: bool = True,
        layout: Layout | None = None,
    ) -> None:
        self.options = options or StepManagerOptions()
        self._nodes = None if nodes is None else [check_node_name(n) for n in nodes]
        if layout is not None and not isinstance(layout, Layout):
            raise JobDefinitionError(f"layout must be a caffe2ckpt.Layout, got "
                                     f"{type(layout).__name__}")
        self._layout = layout
        self._store = CheckpointStore(Location(directory, storage_options, filesystem),
                                      pack_threshold=pack_threshold)
        self._background = BackgroundSaves() if self.options.enable_async_checkpointing else None
        # the step in flight: its save id, its run and its nodes
        self._pending: tuple[int, str, CurrentRun, list[str]] | None = None
        self._failed: Exception | None = None  # a background save's error, not raised yet
        # the run this manager saves in, and its family's lineage view (with ``nodes``, known
        # from the start; else from the first save)
        self._current = None if self._nodes is None else CurrentRun(self._store, self._nodes,
                                                                    steady=True)
        self._last_save_time: float | None = None
        self._protected: set[int] = set()
        # without ``nodes``: every family's steps; elastic, before a save of its own: those of
        # the family it resumes; after: the step of other nodes its history starts from
        self._others: dict[int, Save] = {}
        self._left_behind = LeftBehindWarning()
        self._passed_over: set[str] = set()  # newer saves without a layout, warned of
        self._trackers: dict[str, DeltaTracker] = {}  # delta_saves: each node's state
        if metadata is not None:
            write_root_metadata(self._store.location, dict(metadata))
        self.reload()
        self._watch = PreemptionWatch().__enter__() if handle_preemption else None

    # -- listing ---------------------------------------------------------------------------------

    @property
    def directory(self) -> Path | str:
        """The checkpoint prefix: a ``pathlib.Path`` (absolute) on the local filesystem, else
        the URL as given (a ``str``, e.g. ``"s3://bucket/run"``; with ``filesystem=``, the path
        on that filesystem), since ``pathlib`` cannot name a non-local location."""
        location = self._store.location
        return Path(location.root) if location.is_local else location.url

    def reload(self) -> None:
        """Re-read the commit records (the prefix may have changed outside this manager). Only
        the steps of the current lineage count: steps a later run superseded (it restored an
        earlier step and saved from there) are not listed, restored or kept."""
        if self._current is not None:
            self._current.forget()
            own = self._current.family()
            if self._elastic:
                found = scan(self._store)
                self._others = self._elastic_steps(found, own)
                self._left_behind.check(self._store, own.newest, found)  # own steps count
        else:
            self._others = scan(self._store).current()

    def _elastic_steps(self, found: PrefixScan, own: Family) -> dict[int, Save]:
        """What an elastic manager lists besides its own lineage
        (:func:`~caffe2ckpt.history.scan.other_saves`): while its nodes have no step, the steps
        of the family it resumes; after, the step of other nodes its lineage starts from."""
        return other_saves(found, own, warned=self._passed_over)

    @property
    def _elastic(self) -> bool:
        """Whether steps of other node sets are restored split anew (``nodes`` and a layout)."""
        return self._layout is not None and self._nodes is not None

    @property
    def _steps(self) -> dict[int, Save]:
        """The committed steps of the lineage, by step; for an elastic manager, with the steps
        of other nodes it reaches (read by :meth:`reload`): while its own lineage is empty,
        those it would resume; after, the one its lineage starts from (found among those read,
        so its first save needs no new reading)."""
        if self._current is None:
            return self._others
        own = self._current.family().current()
        if not self._elastic:
            return own
        if not own:
            return self._others
        start = self._start()
        return own if start is None else {start.epoch: start, **own}

    def _start(self) -> Save | None:
        """The step of other nodes this elastic manager's own lineage starts from, among the
        steps :meth:`reload` read (so its first save needs no new reading); None."""
        lineage = self._current.family().lineage if self._current is not None else []
        parent = lineage[-1].parent if lineage else None
        return next((s for s in self._others.values()
                     if (s.epoch, s.generation) == parent), None)

    def _listed(self) -> set[int]:
        """The committed steps and, as in Orbax, the step an async save is writing (listed as
        it will be once committed: the first save of a run that went back supersedes the steps
        above where it started)."""
        steps = set(self._steps)
        if self._pending is not None:
            step, _, current, _ = self._pending
            limit = current.supersedes_above()
            steps = {s for s in steps if limit is None or s <= limit} | {step}
        return steps

    def all_steps(self, read: bool = False) -> list[int]:
        """Committed steps and the step in flight, oldest first (``read=True`` re-reads the
        prefix first)."""
        if read:
            self.reload()
        return sorted(self._listed())

    def latest_step(self) -> int | None:
        """The newest step: committed, or being saved in the background."""
        return max(self._listed(), default=None)

    def best_step(self) -> int | None:
        """The best step by ``options.best_fn`` (the latest without one; None if none scored)."""
        if self.options.best_fn is None:
            return self.latest_step()
        scored = [(s, e) for e, step in self._steps.items()
                  if (s := self.options.score(step.metrics)) is not None]
        if not scored:
            return None
        pick = min if self.options.best_mode == "min" else max
        return pick(scored, key=lambda se: (se[0], -se[1] if pick is min else se[1]))[1]

    def _step(self, step: int) -> Save:
        """The committed save of ``step`` as the prefix holds it now (a step in flight is
        waited for first): listings may come from this manager's view, but what is restored,
        described or deleted is read afresh, so another writer's saves and deletions since the
        view was read count."""
        step = check_epoch(step)
        if self._pending is not None and self._pending[0] == step:
            self.wait_until_finished()
        if self._current is not None:
            save = self._lineage_save(self._current, step)
        else:
            save = scan(self._store).current().get(step)
        if save is None or self._steps.get(step) != save:
            self.reload()  # the view was out of date: listings follow what was read
        if save is None:
            raise CheckpointNotFoundError(
                f"step {step} is not committed under {self._store.location.display()!r}"
                f"{self._lineage_text()}; committed steps: {sorted(self._steps)}")
        return save

    def _lineage_text(self) -> str:
        """For a step not found: the nodes whose lineage was asked and, elastic, where that
        lineage starts."""
        if self._current is None:
            return ""
        nodes = sorted(self._current.nodes)
        start = self._start() if self._elastic else None
        if start is None:
            return f" in the lineage of nodes {nodes}"
        return (f" in the lineage of nodes {nodes}, which starts from step {start.epoch} of "
                f"nodes {sorted(start.nodes)} (a manager on those nodes restores their steps)")

    def _lineage_save(self, current: CurrentRun, step: int) -> Save | None:
        """The save of ``step`` of this family's lineage or, for an elastic manager, of the
        other nodes' steps it reaches (:meth:`_elastic_steps`): one reading of the prefix
        decides, asked only when its own lineage (as last listed) has no such step."""
        if not self._elastic or current.family().lineage:
            save = current.lineage_save(step)
            if save is not None or not self._elastic:
                return save
        found = scan(self._store)  # the family's lineage too, as it is now
        family = found.families.get(current.nodes) or Family(current.nodes, [], [])
        return family.lineage_save(step) or self._elastic_steps(found, family).get(step)

    # -- saving ----------------------------------------------------------------------------------

    def reached_preemption(self, step: int) -> bool:
        """Whether a preemption signal (SIGTERM) arrived: save ``step`` and stop."""
        return self._watch is not None and self._watch.requested

    def should_save(self, step: int) -> bool:
        """Whether the save policy wants ``step``. As in Orbax, never a step at or below
        :meth:`latest_step` (not even after a preemption signal); otherwise always after one."""
        latest = self.latest_step()
        if latest is not None and check_epoch(step) <= latest:
            return False
        if self.reached_preemption(step):
            return True
        return should_save(self.options, step, last_save_time=self._last_save_time,
                           now=time.monotonic())

    def save(self, step: int, items: Items, *, metrics: Mapping[str, float] | None = None,
             force: bool = False, changed_rows: ChangedRows | None = None) -> bool:
        """Save ``items`` (``{node: {blob: array}}``) as ``step`` if :meth:`should_save` says so
        (or ``force``); return whether it saved. Retention runs after the commit.

        As in Orbax, a step at or below :meth:`latest_step` is not saved (False) unless
        ``force``. ``force=True`` saves whatever the policy says: a committed step is re-saved
        (replaced). A forced step below the latest continues from the step this manager restored
        (else from the newest step below it); if this manager has not saved yet, or restored a
        step below the newest since, that is a new run and the later steps are superseded (no
        longer listed; retention deletes them).

        With ``enable_async_checkpointing`` this returns once the arrays are copied; the write
        and commit finish in the background (see :meth:`wait_until_finished`).

        With ``delta_saves`` and ``delta_detection="hints"``, ``changed_rows`` (``{node:
        {blob: row ids}}``) says which rows of which blobs changed since the previous save
        (rows of a blob not listed, and blobs not listed, are compared by digest only, so a
        blob missing here is written whole unless it did not change at all). A hint that
        misses changed rows is found at restore (:class:`CheckpointCorruptedError`), never
        returned as data.
        """
        step = check_epoch(step)
        blobs = check_items(step, items, self._nodes)
        check_hints(step, blobs, changed_rows, self.options)
        for node, hints in (changed_rows or {}).items():  # kept until a save takes them
            for blob, rows in hints.items():
                self._tracker(node).mark_changed(blob, rows)
        if not (force or self.should_save(step)):
            return False
        self.wait_until_finished()
        with events.reporting_save_failure(self._url, step):
            return self._save_now(step, blobs, metrics)

    def _save_now(self, step: int, blobs: dict[str, dict[str, np.ndarray]],
                  metrics: Mapping[str, float] | None) -> bool:
        """Write and commit ``blobs`` as ``step`` (or start writing them in the background)."""
        order = tuple(self._nodes or blobs)
        writers, held, blobs = split_replicas(self._layout, step, order, blobs,
                                              self._store.location.display())
        values = {str(k): float(v) for k, v in (metrics or {}).items()}
        current = self._run_of(sorted(blobs))
        with writing(f"claiming {self._store.location.display()!r} to save step {step}",
                     step):
            run = current.run_for(step, _writer())
        save_id = new_save_id(run.generation)
        info = SaveInfo(save_id=save_id, nodes=sorted(blobs), metrics=values, writer=_writer(),
                        parent=run.parent, layout=self._layout, order=order, writers=writers)
        self._last_save_time = time.monotonic()
        base = current.base_for(step)
        plans: dict[str, DeltaWrite] = {}
        started: set[str] = set()  # nodes whose save ran (or runs): they settle their hints
        try:
            for node, b in blobs.items():
                plans[node] = self._plan(node, base, b)
            if self._background is None:
                records = {}
                for node in blobs:
                    started.add(node)
                    records[node] = self._save_node(step, node, plans[node].whole, info,
                                                    plans[node], held[node])
                self._committed(current, Save(step, save_id, records))
                return True
            # recorded before any submit: if a snapshot fails, the nodes already submitted are
            # still waited for (and the incomplete save reported) by wait_until_finished
            self._pending = (step, save_id, current, sorted(blobs))
            for node in blobs:
                self._background.submit(step, node, plans[node].whole,
                                        lambda snapshot, n=node: self._save_node(
                                            step, n, snapshot, info, plans[n], held[n]))
                started.add(node)
        except BaseException:
            for node, plan in plans.items():  # their hints count for the next save
                if node not in started and node in self._trackers:
                    self._trackers[node].failed(plan)
            raise
        return True

    def _tracker(self, node: str) -> DeltaTracker:
        tracker = self._trackers.get(node)
        if tracker is None:
            tracker = self._trackers[node] = DeltaTracker(node, self.options)
        return tracker

    def _plan(self, node: str, base: str | None, blobs: dict[str, np.ndarray]) -> DeltaWrite:
        """What the save of ``node`` writes (everything, unless ``delta_saves``)."""
        if not self.options.delta_saves:
            return DeltaWrite(blobs, {}, {})
        return self._tracker(node).plan(base, blobs, self._store.has_record,
                                        defer=self._background is None)

    def _run_of(self, nodes: list[str]) -> CurrentRun:
        """The run (and lineage view) of the family ``nodes``: this manager's family."""
        if self._current is None or self._current.nodes != frozenset(nodes):
            self._current = CurrentRun(self._store, nodes, steady=True)
        return self._current

    def _save_node(self, step: int, node: str, blobs: dict[str, np.ndarray],
                   info: SaveInfo, plan: DeltaWrite, held: list[str]) -> CommitRecord:
        where = self._store.location.display(get_ckpt_filename(node, step))
        tracker = self._trackers.get(node)
        with writing(f"saving step {step} of node {node!r} to {where!r}", step):
            try:
                record = self._store.save_node(node, step, blobs, info,
                                               plan if tracker is not None else None,
                                               info.borrowed(node, held))
            except BaseException:
                if tracker is not None:
                    tracker.failed(plan)
                raise
        if tracker is not None:
            tracker.committed(plan)
        return record

    def _committed(self, current: CurrentRun, save: Save) -> None:
        """``save`` is committed: the run learns of it and retention runs. A retention that
        fails leaves only files ``gc`` removes, so it is logged, not raised: the step is saved
        (a fenced run stops, as a JobRunner does: its next save would be refused anyway)."""
        current.committed(save)
        try:
            current.retain(self.options, protect=self._protected)
        except CheckpointFencedError:
            raise
        except (OSError, CheckpointError) as exc:
            logger.warning("step %d is committed under %s, but retention could not delete older "
                           "steps: %s (caffe2ckpt gc removes them later)", save.epoch,
                           self._store.location.display(), exc)
        events.publish(events.EPOCH_COMMITTED, self._url,
                       lambda: events.committed_payload(save.records,
                                                        kept=current.known_count()))

    # -- reading ---------------------------------------------------------------------------------

    def restore(self, step: int | None = None, *, nodes: Sequence[str] | None = None,
                blobs: Sequence[str] | None = None) -> dict[str, dict[str, np.ndarray]]:
        """Read and verify ``step`` (default: the latest): ``{node: {blob: array}}`` for all its
        nodes or ``nodes``, all blobs or only ``blobs``. The step is then protected from
        retention (a run resumed from it). A background save is waited for first; if it failed,
        its error is raised here only when it was the step asked for, else by the next save,
        :meth:`wait_until_finished` or :meth:`close`."""
        info = self._step(self._restore_step(step))
        placement = self._placement(info, blobs)  # a refusal comes before anything is read
        with events.reporting_damage(self._url, info.epoch, found_by="restore"):
            out = self._read(info, placement, nodes, blobs)
        if placement is not None and info.nodes != frozenset(placement.order):
            self._protected = set()  # another family's step: this manager's retention never
            self._run_of(sorted(placement.order)).set_parent((info.epoch, info.generation))
            self._resumed(info, "elastic")  # touches it; saves from now on continue from it
            return out
        if placement is not None and placement.reshards:  # its own step, cut anew
            self._resumed(info, "elastic")
        self._protected = {info.epoch}
        current = self._run_of(sorted(info.nodes))
        newest = current.newest()
        own = current.run is not None and info.generation == current.run.generation
        if not own or newest is None or info.epoch < newest.epoch:
            # saves from now on continue from this step; going back below the newest step
            # starts a new run (a new claim and generation) that supersedes the later ones
            current.set_parent((info.epoch, info.generation))
        if placement is None or not placement.reshards:
            self._resumed(info, "going back" if newest is not None and info.epoch < newest.epoch
                          else "resume")
        return out

    def _placement(self, info: Save, blobs: Sequence[str] | None = None) -> Placement | None:
        """How this manager's nodes get ``info``'s blobs (all, or ``blobs``); None: as its
        nodes saved them, for a manager without ``nodes`` or without a layout."""
        if not self._elastic:
            return None
        return place(info, self._nodes, self._layout,  # type: ignore[arg-type]
                     self._store.location.display(), None if blobs is None else set(blobs))

    def _read(self, info: Save, placement: Placement | None, nodes: Sequence[str] | None,
              blobs: Sequence[str] | None) -> dict[str, dict[str, np.ndarray]]:
        """``info``'s blobs for ``nodes`` (default all), all or ``blobs``: cut anew when the
        placement reshards, else as each node saved them."""
        if placement is None or not placement.reshards:
            out = read_nodes(self._store, info, nodes, blobs)
        else:
            own = list(placement.order)
            unknown = sorted(set(nodes or ()) - set(own))
            if unknown:
                raise CheckpointNotFoundError(f"restore({info.epoch}): nodes {unknown} are not "
                                              f"this manager's nodes {own}")
            out = SaveReader(self._store, info.records).read(
                None if nodes is None else [str(n) for n in nodes],
                None if blobs is None else list(blobs), placement.cut)
            logger.info("restored step %d under %s, %s", info.epoch,
                        self._store.location.display(), placement.describe())
        warning = None if placement is None else placement.adoption(out)
        if warning is not None:
            logger.warning("%s under %s", warning, self._store.location.display())
        return out

    @property
    def _url(self) -> str:
        """The prefix as its events name it."""
        return self._store.location.canonical_url

    def _resumed(self, info: Save, reason: str) -> None:
        events.publish(events.RUN_RESUMED, self._url, lambda: {
            "epoch": info.epoch, "reason": reason, "saved_by": len(info.nodes),
            "nodes": len(self._nodes or info.nodes)})

    def _restore_step(self, step: int | None) -> int:
        """The step a restore of ``step`` reads (None: the latest), once the save in flight
        is finished (its failure raised if it was that step, else kept for later)."""
        step = None if step is None else check_epoch(step)
        pending = self._pending
        try:
            self._finish_pending()
        except Exception as exc:
            if step is None or step == pending[0]:  # type: ignore[index]
                raise
            self._failed = exc
        if step is None:
            step = self.latest_step()
            if step is None:
                raise CheckpointNotFoundError(
                    f"no committed step under {self._store.location.display()!r}")
        return step

    def item_metadata(self, step: int) -> dict[str, dict[str, BlobMetadata]]:
        """``{node: {blob: BlobMetadata(dtype, shape, nbytes)}}`` of what :meth:`restore`
        returns for ``step``, from the manifests only: replicated blobs on every node holding
        them, and a step of another node count split anew over this manager's nodes."""
        info = self._step(step)
        placement = self._placement(info)
        if placement is not None and placement.reshards:
            shares = share_infos(self._store, info.records, placement.order,
                                 placement.partition, placement.kinds)
            return {node: as_metadata(blobs) for node, blobs in shares.items()}
        return blob_metadata(self._store, info)

    def metadata(self, step: int | None = None) -> StepMetadata | RootMetadata:
        """:class:`StepMetadata` of ``step``, or with no step the :class:`RootMetadata`."""
        if step is None:
            return RootMetadata(directory=self._store.location.url, steps=self.all_steps(),
                                custom=read_root_metadata(self._store.location))
        return step_metadata(self._step(step))

    def metrics(self, step: int) -> dict[str, float] | None:
        """The metrics saved with ``step`` (None if it has none)."""
        return self._step(step).metrics or None

    # -- deleting, waiting, closing --------------------------------------------------------------

    def delete(self, step: int) -> None:
        """Remove ``step`` (records first, then data).

        Raises:
            InvalidLocationError: the step was saved together with nodes outside ``nodes``
                (deleting part of it would un-commit the other nodes' step).
        """
        self.wait_until_finished()
        save = self._step(step)
        others = sorted(save.nodes - set(self._nodes or save.nodes))
        if self._elastic and save.nodes != frozenset(self._nodes):  # type: ignore[arg-type]
            others = sorted(save.nodes)  # the step its lineage starts from: another family's
        if others:
            raise InvalidLocationError(
                f"step {step} under {self._store.location.display()!r} was saved together with "
                f"nodes {others}, which this manager does not own; delete it with a manager "
                "owning all of its nodes")
        self._run_of(sorted(save.nodes)).remove([save])
        self._others.pop(step, None)
        if self._elastic and not self._current.family().lineage:  # type: ignore[union-attr]
            self.reload()  # none of its own left: it lists the steps it would resume again

    def wait_until_finished(self) -> None:
        """Wait for a background save, commit it in the cache and apply retention.

        Raises:
            CheckpointWriteError: the background save failed (raised once, never dropped).
        """
        if self._failed is not None:
            failed, self._failed = self._failed, None
            raise failed
        self._finish_pending()

    def _finish_pending(self) -> None:
        """Wait for the save in flight, if any; commit it in the cache or raise its error."""
        if self._background is None or self._pending is None:
            return
        step, save_id, current, nodes = self._pending
        self._pending = None
        with events.reporting_save_failure(self._url, step):
            _, records = self._background.wait()
            if sorted(records) != nodes:  # a snapshot failed: the nodes submitted were written
                raise CheckpointWriteError(
                    f"the save of step {step} under {self._store.location.display()!r} is "
                    f"incomplete: only nodes {sorted(records)} of {nodes} were written "
                    "(another node's snapshot failed); it is not committed", epoch=step)
        self._committed(current, Save(step, save_id, records))

    def check_for_errors(self) -> None:
        """Raise the error of a background save that has already failed (does not block)."""
        if self._failed is not None or (self._background is not None and self._pending
                                        and self._background.done()):
            self.wait_until_finished()

    def close(self) -> None:
        """Wait for outstanding saves (raising their error), then release threads and signals."""
        try:
            self.wait_until_finished()
        finally:
            if self._background is not None:
                self._background.close()
            if self._watch is not None:
                self._watch.__exit__(None, None, None)
                self._watch = None

    def __repr__(self) -> str:
        return f"StepCheckpointManager({self._store.location.url!r}, steps={self.all_steps()})"


def _writer() -> dict[str, Any]:
    return {"manager": "StepCheckpointManager", "host": socket.gethostname(), "pid": os.getpid()}

