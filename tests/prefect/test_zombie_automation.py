"""On a real Prefect server nothing of caffe2ckpt outlives a killed flow process. Flow runs send
``prefect.flow-run.heartbeat`` events (every ``PREFECT_FLOWS_HEARTBEAT_FREQUENCY`` seconds, 180
by default in Prefect 3.9), and an automation on their absence marks a silent run *Crashed*: the
definition the docs propose, created on a real server and seen to fire (with a short window)."""

from __future__ import annotations

from datetime import timedelta

from prefect import flow
from prefect.automations import Automation
from prefect.client.schemas.objects import StateType
from prefect.events import emit_event
from prefect.events.actions import ChangeFlowRunState
from prefect.events.schemas.automations import EventTrigger, Posture
from prefect.events.schemas.events import ResourceSpecification
from prefect.events.worker import EventsWorker
from prefect.states import Running

from tests.prefect.conftest import poll

FINAL_EVENTS = {"prefect.flow-run.Completed", "prefect.flow-run.Failed",
                "prefect.flow-run.Cancelled", "prefect.flow-run.Crashed"}


def crash_silent_runs(within: timedelta) -> Automation:
    """The automation of the docs: a flow run that sent a heartbeat, then neither another one
    nor a final state for ``within`` (say three heartbeat periods), is marked *Crashed*."""
    return Automation(
        name="crash-flow-runs-without-heartbeat",
        trigger=EventTrigger(
            after={"prefect.flow-run.heartbeat"},
            expect={"prefect.flow-run.heartbeat", *FINAL_EVENTS},
            match=ResourceSpecification({"prefect.resource.id": ["prefect.flow-run.*"]}),
            for_each={"prefect.resource.id"},
            posture=Posture.Proactive,
            threshold=1,
            within=within,
        ),
        actions=[ChangeFlowRunState(state=StateType.CRASHED,
                                    message="no heartbeat: its process is gone")],
    )


def test_a_flow_run_whose_heartbeats_stop_is_marked_crashed(client):
    @flow(name="silent-after-one-heartbeat")
    def silent() -> None:
        """Only its definition is used: its run is made by hand."""

    automation = crash_silent_runs(timedelta(seconds=10)).create()
    try:
        run = client.create_flow_run(flow=silent, state=Running())
        emit_event("prefect.flow-run.heartbeat",
                   resource={"prefect.resource.id": f"prefect.flow-run.{run.id}"})
        EventsWorker.drain_all(timeout=10)  # sent; then the process "dies": no more heartbeats
        after = poll(lambda: client.read_flow_run(run.id),
                     lambda r: r.state.type == StateType.CRASHED, timeout=90)
        assert after.state.type == StateType.CRASHED, after.state
        assert after.state.message == "no heartbeat: its process is gone"
    finally:
        client.delete_automation(automation.id)
