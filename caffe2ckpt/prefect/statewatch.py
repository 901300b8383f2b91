"""A flow run that someone else marked *Failed* stops at its next epoch boundary.

``create_checkpoint_alert_automation(fail_flow_run=True)`` (or a user, or any automation) can
set a running flow run's state to *Failed*. For Prefect that is only a state change: the process
trains on, and its final *Completed* replaces the *Failed*. And a flow with ``retries`` left
never gets there: Prefect's server turns a *Failed* proposed for a *Running* run into
*AwaitingRetry* (with the proposal's message), which no process acts on either.

:class:`FailedMarkWatch` reads the run's state between epochs (``JobRunner(stop_check=...)``,
which :func:`~.flow.run_job` sets). Once it is *Failed*, or *AwaitingRetry* straight after
*Running* (a *Failed* mark turned into a retry), it logs why and raises
:class:`prefect.exceptions.Abort`: the flow body ends without proposing a state of its own, so
the run stays *Failed* (a worker's process exits 0; a flow called directly raises the ``Abort``
to its caller). An *AwaitingRetry* mark is first made *Failed* (forced, with its message): left
as it is, a worker would start the run again and train on. A *Crashed* run put back by the
crash-retry automation is *AwaitingRetry* after *Crashed*, not after *Running*: not a mark.

Reading costs one request to the API at an epoch boundary, at most one per :data:`INTERVAL`
seconds (two when the run is *Scheduled*: its state history). The boundary waits for the answer
at most :data:`WAIT` seconds, and only while the API answers within that: a late request is left
to finish in the background (its answer is used at a later boundary), no new one is sent
meanwhile, and the next ones are not waited for until one answers in time again. A request that
fails is logged (the first as a WARNING) and the job goes on: a slow or unreachable API never
stops or fails it. After the job's last epoch one more read is waited for (at most
:data:`WAIT`), so that the run's *Completed* does not replace a *Failed* set while it finished.
"""

from __future__ import annotations

import functools
import logging
import math
import time
from concurrent.futures import Future
from concurrent.futures import wait as wait_for
from typing import Any

from prefect.client.orchestration import get_client
from prefect.client.schemas.objects import StateType
from prefect.exceptions import Abort
from prefect.states import Failed

from caffe2ckpt.prefect._bounded import in_background

__all__ = ["INTERVAL", "WAIT", "FailedMarkWatch"]

logger = logging.getLogger(__name__)

INTERVAL = 1.0  #: seconds: the state is read at most this often
WAIT = 2.0  #: seconds an epoch boundary waits for the answer, at most


class FailedMarkWatch:
    """Raises :class:`~prefect.exceptions.Abort` at an epoch boundary once flow run ``run_id``
    is marked *Failed* (see the module docstring); ``url``: the checkpoint prefix, for the log
    line."""

    def __init__(self, run_id: str, url: str, *, interval: float = INTERVAL,
                 wait: float = WAIT) -> None:
        self.run_id, self.url = run_id, url
        self.interval, self.wait = interval, wait
        self._read: Future[tuple[Any, float]] | None = None
        self._sent = -math.inf  # when the last read was sent (monotonic seconds)
        self._prompt = True  # the last answer came within ``wait``: a boundary waits for one
        self._warned = False

    def __call__(self, epoch: int) -> None:
        """Between epochs: ``epoch`` is the one before the boundary."""
        if self._read is None and time.monotonic() - self._sent >= self.interval:
            self._send(wait=self._prompt)
        self._act_on_answer(epoch)

    def final(self, epoch: int) -> None:
        """After the job's last epoch (``epoch``): one fresh read, waited for."""
        self._send(wait=True)
        self._act_on_answer(epoch)

    def _send(self, *, wait: bool) -> None:
        self._sent = time.monotonic()
        self._read = in_background(functools.partial(self._mark, self._sent),
                                   name="caffe2ckpt-state-watch")
        if wait:
            wait_for([self._read], timeout=self.wait)
            self._prompt = self._read.done()

    def _mark(self, sent: float) -> tuple[Any, float]:
        """The run's state if it is a *Failed* mark (else None), and the seconds since
        ``sent`` the reading took."""
        with get_client(sync_client=True) as client:
            state = client.read_flow_run(self.run_id).state
            if state is not None and state.type == StateType.SCHEDULED:
                before = sorted((s for s in client.read_flow_run_states(self.run_id)
                                 if s.timestamp < state.timestamp), key=lambda s: s.timestamp)
                if state.name != "AwaitingRetry" or not before \
                        or before[-1].type != StateType.RUNNING:
                    state = None
            elif state is not None and state.type != StateType.FAILED:
                state = None
        return state, time.monotonic() - sent

    def _act_on_answer(self, epoch: int) -> None:
        read = self._read
        if read is None or not read.done():
            return  # late: its answer is used at a later boundary
        self._read = None
        try:
            mark, seconds = read.result()
        except Exception as exc:  # noqa: BLE001 - an unreachable API never stops the job
            self._cannot_read(exc)
            return
        self._prompt = seconds <= self.wait
        if mark is not None:
            self._stop(epoch, mark)

    def _cannot_read(self, exc: Exception) -> None:
        level = logging.DEBUG if self._warned else logging.WARNING
        self._warned = True
        logger.log(level, "cannot read the state of flow run %s (%r): going on; a Failed mark "
                   "set meanwhile stops the job once the state can be read", self.run_id, exc)

    def _stop(self, epoch: int, mark: Any) -> None:
        why = f"{mark.name}: {mark.message}" if mark.message else mark.name
        if mark.type != StateType.FAILED:
            why += self._fail(mark)
        logger.warning("flow run %s was marked Failed while it ran (%s): stopping after epoch "
                       "%d; its committed checkpoints stay under %s, and the run stays Failed",
                       self.run_id, why, epoch, self.url)
        raise Abort(f"flow run {self.run_id} was marked Failed while it ran ({why}); stopped "
                    f"after epoch {epoch} of the job checkpointed under {self.url}")

    def _fail(self, mark: Any) -> str:
        """Make *AwaitingRetry* ``mark`` *Failed*; what became of it, for the log line."""
        message = (f"{mark.message or 'marked Failed'} (caffe2ckpt: Prefect had made this "
                   "Failed mark AwaitingRetry, as the flow has retries left)")

        def force() -> None:
            with get_client(sync_client=True) as client:
                client.set_flow_run_state(self.run_id, Failed(message=message), force=True)

        done = in_background(force, name="caffe2ckpt-state-watch")
        try:
            done.result(timeout=self.wait)
        except Exception as exc:  # noqa: BLE001 - stopping matters more than the state
            logger.warning("could not make the AwaitingRetry mark of flow run %s Failed (%r): "
                           "a worker may start it again", self.run_id, exc)
            return "; Prefect made it AwaitingRetry, and setting Failed failed"
        return "; Prefect made it AwaitingRetry as the flow has retries left: now Failed"
