"""Flow helpers: the one-line flow body and the crash-retry automation with its attempt cap.

``@flow(retries=N)`` re-runs the flow body after an exception in the same process; a process
that is killed is marked *Crashed* and is not retried by ``retries``. For that, a deployment can
have an automation (:func:`create_crash_retry_automation`) that puts crashed runs back to
``Scheduled`` (``AwaitingRetry``), so a worker runs the *same* flow run again in a new process.
Automations have no attempt limit, so :func:`run_job` enforces one from ``run_count``.
"""

from __future__ import annotations

import logging
import signal
from uuid import UUID

from prefect.automations import Automation
from prefect.client.schemas.objects import StateType
from prefect.events.actions import ChangeFlowRunState
from prefect.events.schemas.automations import EventTrigger, Posture
from prefect.runtime import flow_run

from caffe2ckpt.errors import CheckpointError, JobPreemptedError
from caffe2ckpt.job import Job
from caffe2ckpt.manager import UploadTaskGroupBuilder, _BaseManager
from caffe2ckpt.policy import StepManagerOptions
from caffe2ckpt.prefect.orphans import claim_and_sweep
from caffe2ckpt.prefect.session import PrefectSession
from caffe2ckpt.runner import JobRunner

__all__ = ["AttemptLimitExceeded", "create_crash_retry_automation", "run_job"]

logger = logging.getLogger(__name__)


class AttemptLimitExceeded(CheckpointError, RuntimeError):
    """The flow run has been attempted more often than ``max_attempts`` allows."""


def run_job(
    job: Job,
    checkpoint_manager: _BaseManager,
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

    Returns:
        The final epoch.

    Raises:
        AttemptLimitExceeded: the attempt cap is reached.
    """
    attempt = flow_run.run_count
    if max_attempts is not None and attempt > max_attempts:
        raise AttemptLimitExceeded(
            f"flow run {flow_run.id} is on attempt {attempt}, over max_attempts={max_attempts}; "
            f"its checkpoints stay at {checkpoint_manager.url!r}"
        )
    _claim_and_sweep()
    runner = JobRunner(job, checkpoint_manager, resume_from_epoch=resume_from_epoch,
                       upload_task_group_builder=upload_task_group_builder,
                       on_save_error=on_save_error, options=options)  # type: ignore[arg-type]
    try:
        return runner.train(session or PrefectSession())
    except JobPreemptedError as exc:
        logger.warning("%s", exc)
        if _prefect_handles_sigterm():
            signal.raise_signal(signal.SIGTERM)  # Prefect's handler raises TerminationSignal
        raise


def _claim_and_sweep() -> None:
    try:
        claim_and_sweep()
    except Exception as exc:  # housekeeping: never a reason to stop the job
        logger.warning("could not look for orphaned runs of flow %r: %s", flow_run.flow_name, exc)


def _prefect_handles_sigterm() -> bool:
    try:
        from prefect.utilities.engine import is_prefect_sigterm_handler_installed
    except ImportError:  # an older Prefect: let the error end the run as Failed
        return False
    return is_prefect_sigterm_handler_installed()


def create_crash_retry_automation(deployment_id: UUID | str, *, name: str | None = None) -> UUID:
    """Create an automation that re-schedules crashed runs of one deployment (same run id).

    Pair it with ``run_job(..., max_attempts=N)``: each re-run increments ``run_count``, and the
    flow refuses to run past N, ending in *Failed* rather than looping.

    Returns:
        The automation's id.
    """
    automation = Automation(
        name=name or f"caffe2ckpt-retry-crashed-{deployment_id}",
        description="Put crashed flow runs of this deployment back to AwaitingRetry "
                    "(caffe2ckpt resumes them from the newest committed epoch)",
        trigger=EventTrigger(
            expect={"prefect.flow-run.Crashed"},
            match_related={"prefect.resource.id": f"prefect.deployment.{deployment_id}"},
            for_each={"prefect.resource.id"},
            posture=Posture.Reactive,
            threshold=1,
            within=0,
        ),
        actions=[ChangeFlowRunState(state=StateType.SCHEDULED, name="AwaitingRetry",
                                    message="caffe2ckpt: retrying a crashed run")],
    ).create()
    logger.info("created automation %s for crashed runs of deployment %s", automation.id,
                deployment_id)
    return automation.id

