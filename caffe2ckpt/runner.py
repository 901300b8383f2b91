"""JobRunner: the epoch loop, and the only place it exists.

Run order (Caffe2's, with the deliberate differences listed in docs/concepts.md):

1. with a manager: ``set_params`` with the job's nodes, then ``get_resume_from_epoch_id``;
2. fresh start: run ``init_group``, ``init`` the manager, save epoch 0;
3. resume: skip ``init_group``, ``init`` from the checkpoint and load it; an automatically
   chosen epoch that turns out damaged falls back to the newest one that loads;
4. loop: run ``epoch_group``, read the stop conditions, save the epoch (with the stop
   decision), stop when any condition held; a resumed job whose checkpoint already met its stop
   condition runs no epoch;
5. upload (with the final epoch), ``download_group``, ``exit_group``; return the final epoch.
"""

from __future__ import annotations

import functools
import itertools
import logging
import time
from collections.abc import Callable, Iterable
from contextlib import nullcontext, suppress
from typing import Any, Literal

import numpy as np

from caffe2ckpt import events
from caffe2ckpt.errors import (
    CheckpointCorruptedError,
    CheckpointError,
    CheckpointFencedError,
    CheckpointNotFoundError,
    CheckpointWriteError,
    JobDefinitionError,
    JobPreemptedError,
    NodeLostError,
    StorageCredentialsError,
)
from caffe2ckpt.job import Job
from caffe2ckpt.manager import BaseCheckpointManager, SaveOutcome, UploadTaskGroupBuilder
from caffe2ckpt.naming import check_node_name
from caffe2ckpt.policy import StepManagerOptions, should_save
from caffe2ckpt.preemption import PreemptionWatch
from caffe2ckpt.session import (
    RunEvent,
    Session,
    memory_tier,
    notify,
    run_epoch,
    tier_key,
    tier_token,
    token_run,
)
from caffe2ckpt.units import writer_phrase

__all__ = ["JobRunner"]

logger = logging.getLogger(__name__)

MAX_LOSSES_PER_EPOCH = 3  # with a memory tier: an epoch that loses nodes more often fails the run


class JobRunner:
    """Runs a :class:`Job` epoch by epoch, checkpointing after init and after every epoch.

    Args:
        job: what to run; it must have at least one stop condition.
        checkpoint_manager: where to checkpoint (None: no checkpoints, no resume).
        resume_from_epoch: resume from this committed epoch (with a metadata handler, None
            means "the newest committed epoch, if any").
        upload_task_group_builder: run with the final epoch after the loop.
        on_save_error: ``"warn"`` (Caffe2's behaviour: log a WARNING and keep training) or
            ``"raise"``. Failed epochs are listed in :attr:`failed_saves` either way. A node
            lost with its worker (:class:`NodeLostError`) is always raised.
        options: save policy (which epochs to checkpoint; epoch 0, the final epoch and a
            preempted epoch always are) and retention (which committed epochs to keep; the
            newest and the one resumed from always are). Default: save and keep every epoch.
            Its ``enable_async_checkpointing=True`` (Orbax's name) is the manager's
            ``async_save=True``: it turns background saves on for a manager made without
            ``async_save``, and is refused (:class:`JobDefinitionError`) for one made with
            ``async_save=False``.
        handle_preemption: while training (in the main thread), SIGTERM only sets a flag: the
            current epoch finishes, is saved and committed, and :meth:`train` raises
            :class:`JobPreemptedError` instead of running another epoch.
        stop_check: called before each epoch the loop runs, with the number of the epoch before
            it (its save handed over); it stops the job by raising, and :meth:`train` raises
            that once a background save has finished (``run_job`` stops a flow run that
            someone else marked *Failed* this way). None: nothing is checked.

    Example:
        >>> from caffe2ckpt import LocalSession, MultiNodeCheckpointManager
        >>> from caffe2ckpt.example import build_job
        >>> cm = MultiNodeCheckpointManager("memory://doc/runner")
        >>> JobRunner(build_job(num_epochs=2), cm).train(LocalSession())
        2
    """

    def __init__(
        self,
        job: Job,
        checkpoint_manager: BaseCheckpointManager | None = None,
        resume_from_epoch: int | None = None,
        upload_task_group_builder: UploadTaskGroupBuilder | None = None,
        *,
        on_save_error: Literal["warn", "raise"] = "warn",
        options: StepManagerOptions | None = None,
        handle_preemption: bool = True,
        stop_check: Callable[[int], None] | None = None,
    ) -> None:
        if on_save_error not in ("warn", "raise"):
            raise JobDefinitionError(f"on_save_error must be 'warn' or 'raise', got {on_save_error!r}")
        self.job = job
        self.checkpoint_manager = checkpoint_manager
        self.resume_from_epoch = resume_from_epoch
        self.upload_task_group_builder = upload_task_group_builder
        self.on_save_error = on_save_error
        self.options = options
        self.handle_preemption = handle_preemption
        self.stop_check = stop_check
        self.failed_saves: list[int] = []
        self.saved_epochs: list[int] = []  # committed by this train() call
        self.resumed_from: int | None = None
        self._last_save_time: float | None = None
        self._losses: dict[int, int] = {}  # epoch -> times it lost nodes (memory tier)
        self._stopped: dict[int, bool] = {}  # epoch -> whether a stop condition held after it

    def train(self, session: Session) -> int:
        """Run the job to its stop condition; return the number of the final epoch.

        Raises:
            JobPreemptedError: a preemption signal arrived; the epoch that was running finished
                and was checkpointed, and no further epoch ran.
        """
        watch = PreemptionWatch() if self.handle_preemption else nullcontext(None)
        with watch as preemption:
            return self._train(session, preemption)

    def _train(self, session: Session, preemption: PreemptionWatch | None) -> int:
        job, cm = self.job, self.checkpoint_manager
        job.compile()  # rejects a job without stop conditions
        if cm is None and self.resume_from_epoch is not None:
            raise JobDefinitionError(
                f"resume_from_epoch={self.resume_from_epoch} needs a checkpoint manager"
            )
        if cm is not None and self.options is not None:  # Orbax's name for async_save
            cm.use_async_option(self.options.enable_async_checkpointing)
        self.failed_saves = []
        self.saved_epochs = []
        self.resumed_from = None
        self._last_save_time = None
        self._losses, self._stopped = {}, {}
        resume = None
        if cm is not None:
            nodes = [check_node_name(n) for n in job.nodes_to_checkpoint()]
            cm.set_params(nodes=nodes)
            resume = cm.get_resume_from_epoch_id(self.resume_from_epoch)
        if resume is None:
            epoch, finished = self._start_fresh(session), False
        else:
            epoch, finished = (self._start_from_memory(session, resume)
                               or self._start_resumed(session, resume))
        epoch = self._loop(session, preemption, epoch, finished)
        self._stop_if_preempted(epoch, session, preemption)
        if self.upload_task_group_builder is not None:
            session.run(self.upload_task_group_builder.build(epoch, cm))
        session.run(job.download_group)
        session.run(job.exit_group)
        self._stop_if_preempted(epoch, session, preemption)
        if self.failed_saves:
            logger.warning("job %r finished at epoch %d; checkpoints of epochs %s were NOT saved",
                           job.name, epoch, self.failed_saves)
        self._notify(session, "finished", epoch)
        self._drop_copies(session, epoch)
        return epoch

    def _drop_copies(self, session: Session, epoch: int) -> None:
        """The job finished at ``epoch``: once that is committed, no resume needs its
        memory-tier copies (a failure to drop them leaves them for ``memory_tier_keep``
        seconds, and never fails the job)."""
        tier = memory_tier(session)
        if tier is None or (self.checkpoint_manager is not None
                            and not self._committed_epoch(epoch)):
            return
        try:
            tier.drop()
        except Exception as exc:  # noqa: BLE001 - the job has finished
            logger.warning("the memory-tier copies were not dropped (%s: %s): they go when "
                           "the session's memory_tier_keep ends", type(exc).__name__, exc)

    def _start_fresh(self, session: Session) -> int:
        """Run the init group and save epoch 0 (a fresh start); return 0."""
        job = self.job
        logger.info("Starting job %r from scratch", job.name)
        self._notify(session, "started", 0)
        return run_epoch(session, 0, lambda: self._init_epoch(session))

    def _init_epoch(self, session: Session) -> int:
        """Epoch 0 of a fresh start: the init group, then the manager's init and its save."""
        job, cm = self.job, self.checkpoint_manager
        session.run(job.init_group)
        if cm is not None:
            session.run(cm.init(job.nodes_to_checkpoint()))
            self._start_run(session, cm, parent=None)
            self.save_checkpoints(0, session)
        logger.info("%s", self._epoch_line(0, None, session))
        return 0

    def _start_resumed(self, session: Session, resume: int) -> tuple[int, bool]:
        """Load epoch ``resume`` (or, chosen automatically and damaged, an older one) and start
        this run from it; return the epoch loaded and whether the job had finished there."""
        cm = self.checkpoint_manager
        assert cm is not None
        with cm.resuming():  # what is loaded and what the run continues: one save
            epoch, finished, parent = self._resume(session, cm, resume,
                                                   automatic=self.resume_from_epoch is None)
            # a pass a crash cut short is completed now, when the run continues the newest
            # save; going back, what it supersedes stays until the run's first commit
            head = next(cm.lineage(), None) if self._has_retention() else None
            at_head = head is not None and (head.epoch, head.generation) == parent
            if self._start_run(session, cm, parent) and at_head:
                self._retain(session, cm)
        if finished:
            logger.info("Job %r had finished at epoch %d (its stop condition held): no "
                        "epoch to run", self.job.name, epoch)
        return epoch, finished

    def _start_from_memory(self, session: Session, stored: int) -> tuple[int, bool] | None:
        """Resume from copies an earlier session of the job left in worker memory, when they
        continue ``stored`` (the newest committed epoch, chosen automatically) and every node
        has one of an epoch at or after it; then persist that epoch before training on.
        Return (the epoch, whether the job had finished there), or None: resume from storage.
        Only the same nodes in the same layout resume from memory."""
        tier, cm = memory_tier(session), self.checkpoint_manager
        if tier is None or cm is None or self.resume_from_epoch is not None:
            return None
        with cm.resuming():  # what is checked, restored and continued: one reading
            restored = self._restore_from_memory(session, tier, cm, stored)
            if restored is None:
                return None
            back, save = restored
            self._start_run(session, cm, parent=(stored, save.generation))
        self.resumed_from = stored
        met = [c.key for c in self.job.stop_conditions if _holds(session, c)]
        finished = self._stopped[back] = bool(met)
        detail = f"epoch {back} from worker memory; storage holds epoch {stored}"
        logger.info("Resuming %s", detail)
        self._notify(session, "resumed", back, records=save.records, detail=detail)
        self._resend_committed(cm, save)
        events.publish(events.RUN_RESUMED, _url(cm), lambda: {
            **_resume_payload(cm, save, lambda: "resume"), "epoch": back, "source": "memory"},
            job=self.job.name)
        if back > stored:  # so that losing the whole cluster costs at most the save interval
            self._save_restored(session, back)
            self._finish_background(session, cm)
            if back not in self.saved_epochs:
                logger.warning("epoch %d, resumed from worker memory, is not in storage (its "
                               "save failed): losing the whole cluster now goes back to epoch "
                               "%d", back, stored)
        return back, finished

    def _restore_from_memory(self, session: Session, tier: Any, cm: BaseCheckpointManager,
                             stored: int) -> tuple[int, Any] | None:
        """Within a resume: put every node back to the newest epoch of copies that continue
        the committed ``stored`` (see :meth:`_start_from_memory`) and initialise the manager
        as a resume of ``stored`` would; return that epoch and ``stored``'s save, or None with
        nothing restored (any failure on the way empties every workspace: storage is used)."""
        try:
            placement = cm.placement(stored)
        except (CheckpointError, JobDefinitionError):
            return None  # the resume from storage says what is wrong
        if placement.reshards:
            return None  # an elastic resume reads storage
        nodes = self.job.nodes_to_checkpoint()
        try:
            token = self._continuing(cm, tier.adopt(tier_key(_url(cm)), nodes), stored)
            back = None if token is None else tier.recover(token, at_least=stored)
            if back is not None:
                session.run(cm.init(nodes, retrieve_from_epoch=stored))
        except Exception as exc:  # noqa: BLE001 - memory is a shortcut: storage is the way
            logger.warning("cannot resume from worker memory (%s: %s): resuming from storage",
                           type(exc).__name__, exc)
            tier.replace_lost(clear=True)  # no node keeps what a copy restored
            return None
        return None if back is None else (back, placement.save)

    def _save_restored(self, session: Session, epoch: int) -> None:
        """Save ``epoch``, which the nodes were just put back to from worker memory (its stop
        conditions and metrics read from their workspaces)."""
        met = [c.key for c in self.job.stop_conditions if _holds(session, c)]
        self.save_checkpoints(epoch, session, stop=bool(met), stop_conditions=met,
                              metrics=self.job.fetch_metrics(session))

    @staticmethod
    def _continuing(cm: BaseCheckpointManager, tokens: dict[str, int],
                    stored: int) -> str | None:
        """Of the runs whose copies the nodes hold (``tokens``: token -> newest epoch), the one
        whose copies continue the committed epoch ``stored`` (newer than it, or as new), if
        any; why each other run's do not is logged."""
        for token, newest in sorted(tokens.items(), key=lambda t: -t[1]):
            run = token_run(token, _url(cm))
            why = ("they are of no run of this prefix" if run is None else
                   f"their newest epoch, {newest}, is older" if newest < stored else
                   cm.continues(run, stored))
            if why is None:
                return token
            logger.info("not resuming from the worker-memory copies of run %s: %s; storage "
                        "holds epoch %d", None if run is None else run[0], why, stored)
        return None

    def _loop(self, session: Session, preemption: PreemptionWatch | None, epoch: int,
              finished: bool) -> int:
        """Run epochs after ``epoch`` until a stop condition holds (or a preemption stops the
        job); return the final epoch, its save finished (committed or failed)."""
        cm = self.checkpoint_manager
        run = cm.current().run if cm is not None else None
        # this train() call's memory-tier copies: no other's; a later session of the job takes
        # them only if they continue its newest save (_start_from_memory)
        token = tier_token(_url(cm), None if run is None else (run.generation, run.created))
        try:
            if not finished:
                self._snapshot(session, epoch, token)
            while not finished:
                self._stop_if_preempted(epoch, session, preemption)
                if self.stop_check is not None:
                    self.stop_check(epoch)
                epoch += 1
                try:
                    finished = run_epoch(session, epoch,
                                         lambda e=epoch: self._run_epoch(e, session, preemption))
                    if not finished:
                        self._snapshot(session, epoch, token)
                    elif cm is not None:
                        self._finish_background(session, cm)  # a loss there is recovered too
                except NodeLostError as lost:
                    epoch = self._recover(session, epoch, token, lost)
                    finished = self._stopped.get(epoch, False)
        except BaseException:
            if cm is not None and cm.pending_epoch is not None:  # let it commit, then fail
                try:
                    self._finish_background(session, cm)
                except Exception as exc:  # noqa: BLE001 - the original error matters more
                    logger.warning("the background save failed too: %s", exc)
            raise
        if cm is not None:
            self._finish_background(session, cm)
        return epoch

    def _snapshot(self, session: Session, epoch: int, token: str) -> None:
        """Copy every node's workspace as of ``epoch`` to worker memory, if the session has a
        memory tier. Only a lost node is raised: any other failure leaves the tier's newest
        complete epoch an older one (a WARNING says so), and the job goes on."""
        tier = memory_tier(session)
        if tier is None:
            return
        try:
            took = tier.snapshot(epoch, token)
        except NodeLostError:
            raise  # the run goes back (_recover)
        except Exception as exc:  # noqa: BLE001 - a copy never fails the epoch it follows
            logger.warning("epoch %d was not copied to worker memory (%s: %s): a loss goes back "
                           "to an older copy or to storage", epoch, type(exc).__name__, exc)
            return
        logger.debug("epoch %d copied to worker memory in %.3f s", epoch, took)

    def _recover(self, session: Session, epoch: int, token: str, lost: NodeLostError) -> int:
        """A node was lost during ``epoch``: put every node back to the newest epoch that
        either the session's memory tier has a complete copy of or this run committed, and
        return it (the epochs after it run again). Raises ``lost`` without a memory tier, when
        neither exists, or when ``epoch`` lost nodes :data:`MAX_LOSSES_PER_EPOCH` times."""
        tier, cm = memory_tier(session), self.checkpoint_manager
        self._losses[epoch] = self._losses.get(epoch, 0) + 1
        if tier is None or tier.epoch is None or self._losses[epoch] > MAX_LOSSES_PER_EPOCH:
            raise lost
        started, nodes = time.monotonic(), tier.lost()
        if cm is not None and cm.pending_epoch is not None:
            with suppress(NodeLostError):  # its save is made again: when its epoch runs
                self._finish_background(session, cm)  # again, or below if it is ``back``
        stored = max(self.saved_epochs, default=self.resumed_from)
        newer = stored is not None and stored > tier.epoch  # committed after the last copies
        back = None if newer else tier.recover(token, at_least=stored or 0)
        source = "memory"
        if back is None:  # storage is newer, or no epoch of which every node has a copy
            if cm is None or stored is None:
                raise lost
            self._reload(session, cm, stored, token)
            back, source = stored, "storage"
        redo = back in self.failed_saves  # its save died with the loss (or failed before)
        self.failed_saves = [e for e in self.failed_saves if e < back]
        self._report_recovery(session, {
            "epoch": back, "source": source, "stored": stored, "lost": nodes,
            "failed_epoch": epoch, "seconds": time.monotonic() - started}, lost)
        if redo:
            self._save_restored(session, back)  # made again
        return back

    def _report_recovery(self, session: Session, what: dict[str, Any],
                         lost: NodeLostError) -> None:
        """Log, notify and publish a recovery (``what``: the event's payload)."""
        stored, back = what["stored"], what["epoch"]
        detail = (f"node(s) {', '.join(what['lost'])} lost with their Dask worker in epoch "
                  f"{what['failed_epoch']}: recovered epoch {back} from "
                  + ("worker memory" if what["source"] == "memory" else "storage")
                  + f" (storage holds {'nothing' if stored is None else f'epoch {stored}'})")
        logger.warning("%s; epoch %d runs again (%s)", detail, back + 1, lost.loss)
        self._notify(session, "recovered", back, detail=detail)
        if self.checkpoint_manager is not None:
            events.publish(events.RUN_RECOVERED, _url(self.checkpoint_manager), lambda: what,
                           job=self.job.name)

    def _reload(self, session: Session, cm: BaseCheckpointManager, epoch: int,
                token: str) -> None:
        """Put every node back to this run's committed ``epoch`` from storage, as a resume in
        a new session would (the lost nodes placed again, every workspace emptied first: no
        blob the save does not hold is left from a later epoch), and copy it to worker
        memory."""
        memory_tier(session).replace_lost(clear=True)
        session.run(cm.init(self.job.nodes_to_checkpoint(), retrieve_from_epoch=epoch))
        session.run(cm.load(epoch))
        self._snapshot(session, epoch, token)

    def _run_epoch(self, epoch: int, session: Session,
                   preemption: PreemptionWatch | None) -> bool:
        """Run ``epoch``'s group and save it if the policy (or a preemption) says so; return
        whether a stop condition held."""
        job, cm = self.job, self.checkpoint_manager
        logger.debug("Running epoch %d of job %r", epoch, job.name)
        self._notify(session, "epoch", epoch)
        session.run(job.epoch_group)
        met = [c.key for c in job.stop_conditions if bool(np.any(c.fetch()))]
        finished = self._stopped[epoch] = bool(met)
        preempted = preemption is not None and preemption.requested
        metrics = None
        if cm is not None and (preempted or should_save(
                self.options, epoch, final=finished,
                last_save_time=self._last_save_time, now=time.monotonic())):
            metrics = job.fetch_metrics()
            self.save_checkpoints(epoch, session, stop=finished, stop_conditions=met,
                                  metrics=metrics)
        logger.info("%s", self._epoch_line(epoch, metrics, session))
        return finished

    def _epoch_line(self, epoch: int, metrics: dict[str, float] | None, session: Session) -> str:
        """The one INFO line of an epoch: its number, the job's metrics (those its save read;
        read for the line only where the workspaces are in this process), what became of its
        checkpoint."""
        cm = self.checkpoint_manager
        if metrics is None and not getattr(session, "remote", False):
            try:
                metrics = self.job.fetch_metrics()
            except Exception as exc:  # noqa: BLE001 - a log line never fails an epoch
                logger.debug("epoch %d: metrics not read for the log line: %r", epoch, exc)
        values = "".join(f", {name} {value:.6g}" for name, value in (metrics or {}).items())
        if cm is None:
            saved = "no checkpoint manager"
        elif epoch in self.saved_epochs:
            saved = f"checkpoint committed under {cm.url!r}"
        elif cm.pending_epoch == epoch:
            saved = f"checkpoint being written under {cm.url!r} in the background"
        elif epoch in self.failed_saves:
            saved = "checkpoint NOT saved (see the warning above)"
        else:
            saved = "no checkpoint (the save policy skips this epoch)"
        if epoch == 0:  # not a training epoch: what init made, saved as epoch 0
            return f"Init of job {self.job.name!r} done (epoch 0: the save after init); {saved}"
        return f"Epoch {epoch} of job {self.job.name!r} done{values}; {saved}"

    def _committed_epoch(self, epoch: int) -> bool:
        """Whether ``epoch`` is committed by (or was resumed by) this train() call."""
        return self.checkpoint_manager is not None and (
            epoch in self.saved_epochs or epoch == self.resumed_from)

    def _stop_if_preempted(self, epoch: int, session: Session,
                           preemption: PreemptionWatch | None) -> None:
        if preemption is not None and preemption.requested:
            self._preempted(epoch, session, preemption.signal_name)

    def _preempted(self, epoch: int, session: Session, signal_name: str) -> None:
        """Make sure ``epoch`` is checkpointed, then stop with :class:`JobPreemptedError`. An
        epoch committed already (by this run, also in the background, or the one it resumed
        from) is never saved again."""
        cm = self.checkpoint_manager
        if cm is not None:
            self._finish_background(session, cm)  # first: it may be this very epoch's save
            if not self._committed_epoch(epoch) and epoch not in self.failed_saves:
                self.save_checkpoints(epoch, session, metrics=self.job.fetch_metrics(session))
                self._finish_background(session, cm)
        committed = self._committed_epoch(epoch)
        self._notify(session, "preempted", epoch)
        where = f"under {cm.url!r}" if cm is not None else "(no checkpoint manager)"
        raise JobPreemptedError(
            f"job {self.job.name!r} was stopped by {signal_name} after epoch {epoch}; its "
            + (f"checkpoint is committed {where}: run the job again to resume from it"
               if committed else f"checkpoint was NOT committed {where}"),
            epoch=epoch, committed=committed, signal=signal_name)

    @staticmethod
    def _start_run(session: Session, cm: BaseCheckpointManager, parent: tuple[int, int] | None) -> bool:
        """Start this run on the prefix (only once it is known to be valid: a refused run
        writes nothing); ``parent`` is the save it resumed from, None for a fresh start.
        False when the prefix could not be claimed."""
        try:
            cm.claim(_writer(session), parent=parent)
        except (OSError, StorageCredentialsError) as exc:  # the saves will report it
            logger.warning("cannot claim checkpoint prefix %r: %s", cm.url, exc)
            return False
        return True

    def _notify(self, session: Session, kind: str, epoch: int, **info: Any) -> None:
        notify(session, RunEvent(kind=kind, job=self.job.name, epoch=epoch,  # type: ignore[arg-type]
                                 max_epochs=self.job.max_epochs,
                                 checkpoint_manager=self.checkpoint_manager, **info))

    def _resume(self, session: Session, cm: BaseCheckpointManager, epoch: int, *,
                automatic: bool) -> tuple[int, bool, tuple[int, int]]:
        """Load the checkpoint to resume from; return (epoch loaded, whether the job is done,
        the loaded save as (epoch, generation)). An automatically chosen epoch that fails to
        load falls back along the lineage (never to a superseded epoch): the lineage of the
        saves of another node count, when the job resumes those."""
        nodes = self.job.nodes_to_checkpoint()
        candidates: Iterable[int] = [epoch]
        if automatic:
            candidates = itertools.chain(candidates,
                                         (s.epoch for s in cm.fallback_lineage()
                                          if s.epoch < epoch))
        failures: list[str] = []
        for candidate in candidates:
            self._notify(session, "loading", candidate)
            try:
                session.run(cm.init(nodes, retrieve_from_epoch=candidate))
                session.run(cm.load(candidate))
                placement = cm.placement(candidate)  # what init and load read: one reading
                save = placement.save
                elastic = save.nodes != frozenset(cm.file_nodes())
                if not elastic and cm.lineage_save(candidate) is None:
                    logger.warning("Epoch %d was superseded (a later run went back to an "
                                   "earlier epoch); resuming from it on request makes its "
                                   "history current again", candidate)
            except (CheckpointCorruptedError, CheckpointNotFoundError) as exc:
                self._publish_damage(cm, candidate, exc)
                if not automatic:
                    raise
                failures.append(f"epoch {candidate}: {exc}")
                logger.warning("Cannot resume from epoch %d (%s); trying an older checkpoint",
                               candidate, exc)
                continue
            cm.report_checkpoint_stats("checkpoint_load")
            self.resumed_from = candidate
            logger.info("Resuming from epoch %d (written by %s)%s", candidate,
                        writer_phrase(save.first.writer),
                        f", {placement.describe()}" if placement.reshards else "")
            self._notify(session, "resumed", candidate, records=save.records)
            self._resend_committed(cm, save)
            reason = _resume_reason(cm, candidate, automatic=automatic,
                                    elastic=placement.reshards, fell_back=bool(failures))
            events.publish(events.RUN_RESUMED, _url(cm), functools.partial(
                _resume_payload, cm, save, reason), job=self.job.name)
            return (candidate, self._still_finished(save.records, session,
                                                    moved=placement.reshards),
                    (candidate, save.generation))
        raise CheckpointCorruptedError(
            f"no committed epoch of {cm.url!r} could be loaded: " + "; ".join(failures)
        )

    def _resend_committed(self, cm: BaseCheckpointManager, save: Any) -> None:
        """The commit event of the save a resume continues, sent again: it may have died with
        the process that committed it."""
        events.publish(events.EPOCH_COMMITTED, _url(cm), functools.partial(
            events.committed_payload, save.records, kept=None), job=self.job.name, resent=True)

    def _still_finished(self, records: dict[str, Any], session: Session, *,
                        moved: bool = False) -> bool:
        """Does the job stop at the loaded epoch? Yes if a stop condition that can be checked
        on the restored workspace holds there (e.g. an epoch limit at or below the loaded
        epoch, also when the run that saved it allowed more), or if the save met a condition
        that cannot be checked again."""
        if any(c.still_stopped is not None and _holds(session, c)  # (a blob it reads that
               for c in self.job.stop_conditions):  # was not checkpointed: cannot tell)
            return True
        met = {k for r in records.values() if r.stop for k in r.stop_conditions}
        if any(self._condition(key, moved) is None
               or self._condition(key, moved).still_stopped is None  # type: ignore[union-attr]
               for key in met):
            return True
        if met:
            logger.info("The checkpoint met its stop condition, but the job now allows more "
                        "epochs")
        return False

    def _condition(self, key: str, moved: bool) -> Any:
        """The job's stop condition a saved key (``"<node>:<blob>"``) names: the same key, or,
        when the resume ``moved`` blobs between nodes (a reshard: ``epoch_limiter``'s count
        goes to the new first node), the one condition on that blob; else None."""
        conditions = self.job.stop_conditions
        same = [c for c in conditions if c.key == key] or [
            c for c in conditions if moved and c.name == key.partition(":")[2]]
        return same[0] if len(same) == 1 else None

    def load_blobs_from_checkpoints(self, blob_names: list[str], epoch: int,
                                    session: Session) -> bool:
        """Load ``blob_names`` from every node's checkpoint of ``epoch``; False if any is missing."""
        cm = self.checkpoint_manager
        if cm is None:
            raise JobDefinitionError("Checkpoint manager is None")
        if not hasattr(cm, "load_blobs_locally"):
            raise JobDefinitionError("load_blobs_from_checkpoints needs a MultiNodeCheckpointManager")
        ok = cm.load_blobs_locally(self.job.nodes_to_checkpoint(), blob_names, epoch, session)
        cm.report_checkpoint_stats("checkpoint_partial_load")
        return ok

    def save_checkpoints(self, epoch: int, session: Session, *, stop: bool = False,
                         stop_conditions: list[str] | tuple[str, ...] = (),
                         metrics: dict[str, float] | None = None) -> None:
        """Save and commit every node's checkpoint of ``epoch``.

        A failure is logged as a WARNING and recorded in :attr:`failed_saves`
        (``on_save_error="warn"``) or raised as :class:`CheckpointWriteError` (``"raise"``).
        With an ``async_save`` manager the save is finished in the background; its outcome is
        handled at the next save or at the end of :meth:`train`.
        """
        cm = self.checkpoint_manager
        if cm is None:
            raise JobDefinitionError("Checkpoint manager is None")
        self._finish_background(session, cm)
        if epoch in self.saved_epochs:  # a committed epoch is never saved twice by one run
            logger.debug("epoch %d is committed already: not saving it again", epoch)
            return
        try:
            if not cm.cp_accessible(epoch=epoch):
                cause = cm.access_error
                raise CheckpointWriteError(
                    f"checkpoint of epoch {epoch}: files cannot be accessed at {cm.url!r}"
                    + (f": {cause}" if cause else ""), epoch=epoch) from cause
            logger.debug("Saving checkpoints for epoch %d", epoch)
            self._last_save_time = time.monotonic()
            outcome = cm.save_checkpoint(session, epoch, stop=stop,
                                         stop_conditions=stop_conditions, metrics=metrics,
                                         writer=_writer(session), options=self.options)
        except Exception as exc:
            if cm.pending_epoch == epoch:  # other nodes' background saves: drain them first
                try:
                    cm.wait_until_finished()
                except NodeLostError as lost:  # a lost node fails the run, whatever came first
                    exc = exc if isinstance(exc, NodeLostError) else lost
                except Exception:  # noqa: BLE001 - the first failure is reported below
                    pass
            self._save_failed(epoch, session, exc)
            return
        if not outcome.pending:
            self._committed(outcome, session, cm)

    def _finish_background(self, session: Session, cm: BaseCheckpointManager) -> None:
        epoch = cm.pending_epoch
        if epoch is None:
            return
        try:
            outcome = cm.finish_save()
        except Exception as exc:
            self._save_failed(epoch, session, exc)
            return
        if outcome is not None:
            self._committed(outcome, session, cm)

    def _committed(self, outcome: SaveOutcome, session: Session,
                   cm: BaseCheckpointManager) -> None:
        cm.write_checkpoint_metadata(outcome.epoch)
        cm.report_checkpoint_stats("checkpoint_save")
        self.saved_epochs.append(outcome.epoch)
        self._notify(session, "saved", outcome.epoch, records=outcome.records)
        if self.options is not None and self.options.has_retention:
            self._retain(session, cm)
        events.publish(events.EPOCH_COMMITTED, _url(cm), lambda: events.committed_payload(
            outcome.records, kept=cm.current().known_count()), job=self.job.name)

    def _publish_damage(self, cm: BaseCheckpointManager, epoch: int, exc: Exception) -> None:
        if isinstance(exc, CheckpointCorruptedError):
            events.publish(events.CHECKPOINT_DAMAGED, _url(cm), lambda: events.damage_payload(
                exc, found_by="restore", epoch=epoch), job=self.job.name)

    def _has_retention(self) -> bool:
        return self.options is not None and self.options.has_retention

    def _retain(self, session: Session, cm: BaseCheckpointManager) -> None:
        """Apply retention; a failure only leaves unreferenced files (``caffe2ckpt gc``). A
        fenced run removes nothing and stops."""
        protect = {self.resumed_from} if self.resumed_from is not None else set()
        try:
            deleted = cm.retain(self.options, protect)
        except CheckpointFencedError:
            raise
        except (OSError, CheckpointError) as exc:
            logger.warning("retention could not delete old checkpoints under %r: %s", cm.url, exc)
            return
        for save in deleted:
            self._notify(session, "deleted", save.epoch)

    def _save_failed(self, epoch: int, session: Session, exc: Exception) -> None:
        """``epoch``'s save raised ``exc``: unless every node's record of it is there after all
        (an answer lost on the way back), the epoch failed."""
        cm = self.checkpoint_manager
        outcome = _recheck_failed(cm, epoch, exc) if cm is not None else None
        if outcome is not None:
            self._committed(outcome, session, cm)  # type: ignore[arg-type]
            if isinstance(exc, NodeLostError):
                raise exc
            return
        self.failed_saves.append(epoch)
        events.publish(events.SAVE_FAILED, _url(cm),
                       lambda: events.failure_payload(epoch, exc), job=self.job.name)
        self._notify(session, "save_failed", epoch, error=f"{type(exc).__name__}: {exc}")
        if isinstance(exc, NodeLostError):  # the node's workspace is gone: the run must fail
            raise exc  # (a retry resumes from the newest committed epoch)
        if self.on_save_error == "raise" or isinstance(exc, CheckpointFencedError):
            if isinstance(exc, CheckpointError):
                raise exc
            raise CheckpointWriteError(f"checkpoint of epoch {epoch} failed: {exc}",
                                       epoch=epoch) from exc
        logger.warning("Unable to write checkpoint for epoch %d. Error=%s", epoch, exc)


def _holds(session: Session, condition: Any) -> bool:
    """Whether a stop condition holds on its node's workspace as it is: checked again where
    the condition can be (an epoch limit: the job's limit now, not the one its blob was
    computed with), else its blob's value; False when the workspace lacks what it reads."""
    try:
        ws = session.workspace(condition.task.node)
        if condition.still_stopped is not None:
            return bool(condition.still_stopped(ws))
        return bool(np.any(ws[condition.name]))
    except KeyError:
        return False


def _recheck_failed(cm: BaseCheckpointManager, epoch: int, exc: Exception) -> SaveOutcome | None:
    """The outcome of ``epoch``'s save if, although it raised ``exc``, it is committed."""
    try:
        outcome = cm.recheck_save(epoch)
    except Exception as check:  # noqa: BLE001 - the save's own failure is what is reported
        logger.debug("cannot re-check the save of epoch %d: %s", epoch, check)
        return None
    if outcome is not None:
        logger.warning("the save of epoch %d reported %s: %s, but every node's commit record is "
                       "there: the epoch is committed", epoch, type(exc).__name__, exc)
    return outcome


def _resume_payload(cm: BaseCheckpointManager, save: Any, reason: Callable[[], str]
                    ) -> dict[str, Any]:
    return {"epoch": save.epoch, "reason": reason(), "saved_by": len(save.nodes),
            "nodes": len(cm.file_nodes()), "source": "storage", "stored": save.epoch}


def _url(cm: BaseCheckpointManager | None) -> str:
    """The prefix as its events name it."""
    return "" if cm is None else cm.store.location.canonical_url


def _resume_reason(cm: BaseCheckpointManager, epoch: int, *, automatic: bool, elastic: bool,
                   fell_back: bool) -> Callable[[], str]:
    """Why a run resumes from ``epoch`` (see :mod:`caffe2ckpt.events`), found when asked."""
    def reason() -> str:
        if elastic:
            return "elastic"
        if fell_back:
            return "fallback"
        if automatic:  # the newest epoch (a user's own choice is compared with it)
            return "resume"
        newest = next(cm.lineage(), None)
        return "going back" if newest is not None and newest.epoch > epoch else "resume"
    return reason


def _writer(session: Session) -> dict[str, Any] | None:
    writer_info = getattr(session, "writer_info", None)
    return writer_info() if writer_info is not None else None

