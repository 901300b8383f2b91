"""Flow helpers: the one-line flow body (:func:`run_job`, with its attempt cap) and a plan for
how far a run trains (:func:`plan_run`).

``@flow(retries=N)`` re-runs the flow body after an exception in the same process; a process
that is killed is marked *Crashed* and is not retried by ``retries``: for that, see
:mod:`caffe2ckpt.prefect.automations`. Automations have no attempt limit, so :func:`run_job`
enforces one from ``run_count``.
"""

from __future__ import annotations

import logging
import signal
from collections.abc import Sequence
from typing import NamedTuple

from prefect.exceptions import Abort
from prefect.runtime import flow_run

from caffe2ckpt.errors import (
    CheckpointError,
    CheckpointFencedError,
    InvalidLocationError,
    JobDefinitionError,
    JobPreemptedError,
)
from caffe2ckpt.job import Job
from caffe2ckpt.manager import BaseCheckpointManager, UploadTaskGroupBuilder
from caffe2ckpt.naming import check_epoch
from caffe2ckpt.policy import StepManagerOptions
from caffe2ckpt.prefect.orphans import claim_and_sweep
from caffe2ckpt.prefect.session import PrefectSession
from caffe2ckpt.prefect.statewatch import FailedMarkWatch
from caffe2ckpt.runner import JobRunner

__all__ = ["AttemptLimitExceeded", "RunPlan", "plan_run", "run_job"]

logger = logging.getLogger(__name__)


class AttemptLimitExceeded(CheckpointError, RuntimeError):
    """The flow run has been attempted more often than ``max_attempts`` allows."""


class RunPlan(NamedTuple):
    """How far this flow run trains (see :func:`plan_run`)."""

    start_epoch: int  #: the epoch the run starts (or, on a retry, started) from; 0: from scratch
    num_epochs: int  #: the job's epoch limit, e.g. for ``epoch_limiter`` (a total, not a count)
    resume_from_epoch: int | None  #: for :func:`run_job`; None: the newest committed epoch


def plan_run(
    checkpoint_manager: BaseCheckpointManager,
    nodes: Sequence[str],
    *,
    epochs: int,
    epochs_per_run: int | None = None,
    resume_from_epoch: int | None = None,
) -> RunPlan:
    """Where this flow run starts and at which epoch its job stops, the same on every attempt.

    A run starts from ``resume_from_epoch`` if given, else from the newest committed epoch of
    ``nodes`` under the manager's prefix (0 if there is none), and trains up to epoch
    ``epochs`` — or, with ``epochs_per_run``, ``epochs_per_run`` epochs past its start, but
    never past ``epochs``. So a scheduled run with ``epochs_per_run`` trains that many more
    epochs each time, until ``epochs`` is reached.

    A retry (a later attempt of the same flow run, after an earlier one committed epochs) keeps
    the start of the first attempt, so it stops at the same epoch, and resumes from the newest
    epoch the run committed (``resume_from_epoch`` is then None) instead of going back to the
    requested one. The run's own epochs are found by the flow run id in their commit records.

    Raises:
        JobDefinitionError: ``epochs`` or ``epochs_per_run`` is below 1.
        InvalidLocationError: ``resume_from_epoch`` is not an epoch number.
    """
    for name, value in (("epochs", epochs), ("epochs_per_run", epochs_per_run)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or value < 1):
            raise JobDefinitionError(f"{name} must be an int >= 1, got {value!r}")
    if resume_from_epoch is not None:
        try:
            check_epoch(resume_from_epoch)
        except InvalidLocationError as exc:
            raise InvalidLocationError(f"resume_from_epoch={resume_from_epoch!r}: {exc}") from exc
    checkpoint_manager.set_params(nodes=list(nodes))
    started = _started_from(checkpoint_manager)
    if started is None:  # this flow run has committed nothing yet
        start = (resume_from_epoch if resume_from_epoch is not None
                 else checkpoint_manager.get_resume_from_epoch_id() or 0)
    else:
        start, resume_from_epoch = started, None
    limit = epochs if epochs_per_run is None else min(epochs, start + epochs_per_run)
    return RunPlan(start, limit, resume_from_epoch)


def _started_from(checkpoint_manager: BaseCheckpointManager) -> int | None:
    """The epoch the current flow run started from, if the newest epochs of the prefix's
    lineage are its own (an earlier attempt committed them); else None."""
    this_run = flow_run.id
    if this_run is None:
        return None
    checkpoint_manager.end_run()  # an attempt starts: read the prefix as it is now
    first = None
    for save in checkpoint_manager.lineage():  # newest first: this run's saves, then older
        writer = next(iter(save.records.values())).writer or {}
        if writer.get("flow_run_id") != str(this_run):
            break
        first = save
    if first is None:
        return None
    return first.parent[0] if first.parent is not None else 0


def run_job(
    job: Job,
    checkpoint_manager: BaseCheckpointManager,
    *,
    max_attempts: int | None = None,
    resume_from_epoch: int | None = None,
    upload_task_group_builder: UploadTaskGroupBuilder | None = None,
    on_save_error: str = "warn",
    options: StepManagerOptions | None = None,
    session: PrefectSession | None = None,
) -> int:
    """``JobRunner(job, checkpoint_manager).train(PrefectSession())`` for a flow body.

    Args:
        max_attempts: fail at once (without running anything) when this flow run's
            ``run_count`` is higher; caps crash retries by automation and flow retries alike.
        options: save policy and retention (see :class:`JobRunner`).

    A flow run without a deployment records its process (``<host>:<pid>``) and marks runs of the
    same flow that were left *Running* by a process that no longer exists *Crashed* (see
    :mod:`caffe2ckpt.prefect.orphans`).

    Preemption: SIGTERM during an epoch (a cancellation from the UI or the worker, or the
    machine going away) lets the epoch finish and commit; then the signal is handed back to
    Prefect, which ends the run *Cancelled* (a cancellation) or *Crashed* (anything else; the
    crash-retry automation resumes it from that epoch) instead of retrying it in this process.

    An attempt fenced by a newer attempt of the same flow run ends without a state of its own
    (see "Retries and crashes" in the docs).

    A run that someone else marks *Failed* while it trains (e.g.
    ``create_checkpoint_alert_automation(fail_flow_run=True)``) stops at its next epoch
    boundary, or once its last epoch is done, and stays *Failed*
    (:mod:`~caffe2ckpt.prefect.statewatch`).

    Returns:
        The final epoch.

    Raises:
        AttemptLimitExceeded: the attempt cap is reached.
        prefect.exceptions.Abort: a newer attempt of this flow run took over the prefix, or
            the run was marked *Failed* while it ran.
    """
    attempt = flow_run.run_count
    if max_attempts is not None and attempt > max_attempts:
        raise AttemptLimitExceeded(
            f"flow run {flow_run.id} is on attempt {attempt}, over max_attempts={max_attempts}; "
            f"its checkpoints stay at {checkpoint_manager.url!r}"
        )
    _claim_and_sweep()
    watch = (FailedMarkWatch(str(flow_run.id), checkpoint_manager.url)
             if flow_run.id is not None else None)
    runner = JobRunner(job, checkpoint_manager, resume_from_epoch=resume_from_epoch,
                       upload_task_group_builder=upload_task_group_builder,
                       on_save_error=on_save_error, options=options,  # type: ignore[arg-type]
                       stop_check=watch)
    try:
        epoch = runner.train(session or PrefectSession())
    except JobPreemptedError as exc:
        logger.warning("%s", exc)
        if _prefect_handles_sigterm():
            signal.raise_signal(signal.SIGTERM)  # Prefect's handler raises TerminationSignal
        raise
    except CheckpointFencedError as exc:
        _stop_if_superseded(exc, attempt, checkpoint_manager.url)
        raise
    if watch is not None:
        watch.final(epoch)
    return epoch


def _stop_if_superseded(exc: CheckpointFencedError, attempt: int, url: str) -> None:
    """End this attempt without a state of its own if a newer attempt of the *same* flow run
    took over the prefix.

    Prefect can run two attempts of one flow run at once: a killed run is reported *Crashed*
    twice (by the process runner and again by the worker), and when the second report lands
    after the crash-retry automation has started the next attempt, it crashes that attempt's
    state under it and the automation starts yet another. The newest attempt owns the flow
    run's state; an older one that proposed *Failed* would fail the run (or, with flow
    ``retries``, retry and fence the newest in turn). :class:`prefect.exceptions.Abort` ends
    the flow body without proposing a state.
    """
    run = flow_run.id
    counts = [w.get("run_count") for w in exc.newer_writers
              if run is not None and str(w.get("flow_run_id")) == str(run)]
    count = max((c for c in counts if isinstance(c, int)), default=0)
    if count <= attempt:
        return
    logger.warning("attempt %d of flow run %s stops without a state: attempt %d of the same "
                   "flow run took over %r and now owns the run's state", attempt, flow_run.id,
                   count, url)
    raise Abort(f"attempt {attempt} of flow run {flow_run.id} was superseded by attempt "
                f"{count}") from exc


def _claim_and_sweep() -> None:
    try:
        claim_and_sweep()
    except Exception as exc:  # noqa: BLE001 - housekeeping: never a reason to stop the job
        logger.warning("could not look for orphaned runs of flow %r: %s", flow_run.flow_name, exc)


def _prefect_handles_sigterm() -> bool:
    try:
        from prefect.utilities.engine import is_prefect_sigterm_handler_installed
    except ImportError:  # an older Prefect: let the error end the run as Failed
        return False
    return is_prefect_sigterm_handler_installed()
