"""On a real Prefect server nothing of caffe2ckpt outlives a killed flow process. Flow runs send
``prefect.flow-run.heartbeat`` events (every ``PREFECT_FLOWS_HEARTBEAT_FREQUENCY`` seconds, 180
by default in Prefect 3.9), and an automation on their absence marks a silent run *Crashed*:
``create_heartbeat_crash_automation``, created on a real server and seen to fire (with a short
window)."""

from __future__ import annotations

from datetime import timedelta

import pytest
from prefect import flow
from prefect.client.schemas.objects import StateType
from prefect.events import emit_event
from prefect.events.worker import EventsWorker
from prefect.states import Running

from caffe2ckpt.errors import JobDefinitionError
from caffe2ckpt.prefect import create_heartbeat_crash_automation
from caffe2ckpt.prefect.automations import SILENT_MESSAGE
from tests.prefect.conftest import poll


def test_a_flow_run_whose_heartbeats_stop_is_marked_crashed(client):
    @flow(name="silent-after-one-heartbeat")
    def silent() -> None:
        """Only its definition is used: its run is made by hand."""

    automation_id = create_heartbeat_crash_automation(timedelta(seconds=10))
    try:
        run = client.create_flow_run(flow=silent, state=Running())
        emit_event("prefect.flow-run.heartbeat",
                   resource={"prefect.resource.id": f"prefect.flow-run.{run.id}"})
        EventsWorker.drain_all(timeout=10)  # sent; then the process "dies": no more heartbeats
        after = poll(lambda: client.read_flow_run(run.id),
                     lambda r: r.state.type == StateType.CRASHED, timeout=90)
        assert after.state.type == StateType.CRASHED, after.state
        assert after.state.message == SILENT_MESSAGE
    finally:
        client.delete_automation(automation_id)


@pytest.mark.parametrize("within", [timedelta(0), timedelta(seconds=-1), 600])
def test_a_window_that_is_not_a_positive_duration_is_refused(within):
    with pytest.raises(JobDefinitionError, match="within must be a positive timedelta"):
        create_heartbeat_crash_automation(within)
