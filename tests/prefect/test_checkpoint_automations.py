"""Automations on caffe2ckpt's events, created on a real Prefect server and seen to act: an
evaluation deployment run every k-th committed epoch (and executed) and when a metric crosses a
threshold, a notification through a
webhook block when damage is found, a flow run marked *Failed* when its save failed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from uuid import UUID

import numpy as np
import pytest
from prefect import flow
from prefect.blocks.notifications import CustomWebhookNotificationBlock
from prefect.client.schemas.filters import (
    ArtifactFilter,
    ArtifactFilterFlowRunId,
    DeploymentFilter,
    DeploymentFilterId,
)
from prefect.client.schemas.objects import StateType
from prefect.events import emit_event
from prefect.events.worker import EventsWorker
from prefect.settings import PREFECT_API_URL
from prefect.states import Running

from caffe2ckpt import MultiNodeCheckpointManager, StepCheckpointManager, read_epoch
from caffe2ckpt.errors import CheckpointCorruptedError, JobDefinitionError
from caffe2ckpt.example import build_job, held_out_loss
from caffe2ckpt.fs.location import Location
from caffe2ckpt.prefect import (
    PrefectSession,
    create_checkpoint_alert_automation,
    create_epoch_deployment_automation,
    create_metric_deployment_automation,
    run_job,
)
from caffe2ckpt.prefect.automations import FAILED_MESSAGE
from caffe2ckpt.prefect.events import resource_id
from tests.cli.test_cli import flip_chunk
from tests.prefect.conftest import poll

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "flows"))
from evaluate import evaluate


def evaluation_deployment(client, name: str = "evaluate") -> UUID:
    """A deployment of flows/evaluate.py (its runs are created, and run only where a test
    runs one)."""
    return client.create_deployment(flow_id=client.create_flow(evaluate), name=name,
                                    entrypoint="flows/evaluate.py:evaluate", path=str(REPO))


def test_an_evaluation_runs_on_every_second_committed_epoch(tmp_path, monkeypatch, client):
    """The automation is given the prefix as the manager is: a path relative to the current
    directory (with a '[', which Prefect's trigger would take for a glob)."""
    monkeypatch.chdir(tmp_path)
    url = "checkpoints/run[1]"
    canonical = "file://" + os.path.realpath(tmp_path / url)
    deployment_id = evaluation_deployment(client)
    automation_id = create_epoch_deployment_automation(deployment_id, every=2,
                                                       checkpoint_url=url)

    @flow(name="train-then-evaluate")
    def train() -> int:
        cm = MultiNodeCheckpointManager(url)
        return run_job(build_job(5), cm, session=PrefectSession(artifacts=False))

    runs_of = DeploymentFilter(id=DeploymentFilterId(any_=[deployment_id]))
    try:
        assert train() == 5  # commits epochs 0-5: 2 and 4 run the deployment
        runs = poll(lambda: client.read_flow_runs(deployment_filter=runs_of),
                    lambda rs: len(rs) >= 2, timeout=120)
    finally:
        client.delete_automation(automation_id)
    assert sorted(int(r.parameters["epoch"]) for r in runs) == [2, 4]
    assert {r.parameters["checkpoint_url"] for r in runs} == {canonical}

    # the run for epoch 4 executes as a worker would run it: the flow from its entrypoint
    run = next(r for r in runs if int(r.parameters["epoch"]) == 4)
    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value(),
           "PREFECT__FLOW_RUN_ID": str(run.id)}
    out = subprocess.run([sys.executable, "-m", "prefect.engine"], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=180, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    done = client.read_flow_run(run.id)
    assert done.state.type == StateType.COMPLETED, done.state
    saved = read_epoch(url, 4, "trainer_0", blobs=["model/w", "model/b"])
    expected = held_out_loss(saved["model/w"], float(saved["model/b"]))
    artifacts = client.read_artifacts(artifact_filter=ArtifactFilter(
        flow_run_id=ArtifactFilterFlowRunId(any_=[run.id])))
    assert [a.data for a in artifacts if a.key == "checkpoint-evaluation"] == [
        f"Epoch **4** of `{canonical}` (trainer_0): held-out loss **{expected:.6f}**"]


class Webhook:
    """A local HTTP endpoint that keeps every JSON body posted to it."""

    def __init__(self) -> None:
        self.bodies: list[dict] = []
        bodies = self.bodies

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length", 0))
                bodies.append(json.loads(self.rfile.read(length)))
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args) -> None:
                pass

        self.server = HTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def webhook():
    hook = Webhook()
    yield hook
    hook.close()


def test_damage_found_at_restore_sends_a_notification(tmp_path, webhook, client):
    block = CustomWebhookNotificationBlock(name="ckpt-alerts", url=webhook.url,
                                           json_data={"subject": "{{subject}}",
                                                      "body": "{{body}}"})
    block_id = block.save("ckpt-alerts-test", overwrite=True)
    url = str(tmp_path / "steps")  # a plain path, as the manager is given it
    automation_id = create_checkpoint_alert_automation(notification_block_id=block_id,
                                                       checkpoint_url=url)
    try:
        with StepCheckpointManager(url, handle_preemption=False) as mgr:
            mgr.save(0, {"a": {"w": np.arange(50_000.0)}})
        flip_chunk(url, "a", 0, "_packed")
        with (StepCheckpointManager(url, handle_preemption=False) as mgr,
              pytest.raises(CheckpointCorruptedError)):
            mgr.restore(0)
        EventsWorker.drain_all(timeout=10)
        bodies = poll(lambda: list(webhook.bodies), bool, timeout=120)
    finally:
        client.delete_automation(automation_id)
    assert len(bodies) == 1, bodies
    canonical = Location(url).canonical_url
    assert bodies[0]["subject"] == f"caffe2ckpt: caffe2ckpt.checkpoint.damaged for {canonical}"
    assert "checkpoint: " + canonical in bodies[0]["body"]
    assert "\nepoch: 0\nnode: a\nblob: w" in bodies[0]["body"]


def emit_save_failed(url: str, run_id, node: str | None) -> None:
    """Send a ``save.failed`` event of epoch 7 under ``url`` as flow run ``run_id`` would."""
    emit_event("caffe2ckpt.save.failed",
               resource={"prefect.resource.id": resource_id(url), "caffe2ckpt.url": url},
               related=[{"prefect.resource.id": f"prefect.flow-run.{run_id}",
                         "prefect.resource.role": "flow-run"}],
               payload={"epoch": 7, "node": node, "error": "CheckpointWriteError",
                        "message": "disk full"})
    EventsWorker.drain_all(timeout=10)


def test_a_failed_save_can_mark_its_flow_run_failed(tmp_path, client):
    @flow(name="saving-run")
    def saving() -> None:
        """Only its definition is used: its run is made by hand."""

    url = Location(str(tmp_path / "ck")).canonical_url
    automation_id = create_checkpoint_alert_automation(fail_flow_run=True, checkpoint_url=url)
    try:
        run = client.create_flow_run(flow=saving, state=Running())
        emit_save_failed(url, run.id, node="a")
        after = poll(lambda: client.read_flow_run(run.id),
                     lambda r: r.state.type == StateType.FAILED, timeout=120)
    finally:
        client.delete_automation(automation_id)
    assert after.state.type == StateType.FAILED, after.state
    assert after.state.message == FAILED_MESSAGE


LOSSES = [3.0, 2.5, 0.9, 0.4, -1e-300, 0.3, float("nan"), float("inf"), -0.0, 7.0]


def test_a_metric_crossing_a_threshold_runs_a_deployment(tmp_path, client):
    """Below 0.5 once: the first such epoch (3) only, though 4, 5 and 8 are below too; above
    2.0 every time: 0, 1 and 9 (NaN and inf are no number to compare: never); another
    metric's name matches nothing. All ten are saved within milliseconds: each commit's event
    names the one before it (test_events.py checks that), so the trigger takes them in order.
    """
    url = str(tmp_path / "steps")
    canonical = Location(url).canonical_url
    first, every = evaluation_deployment(client, "first"), evaluation_deployment(client, "every")
    automations = [
        create_metric_deployment_automation(first, metric="loss", below=0.5,
                                            checkpoint_url=url),
        create_metric_deployment_automation(every, metric="loss", above=2, once=False,
                                            checkpoint_url=url),
        create_metric_deployment_automation(every, metric="accuracy", below=1e300,
                                            checkpoint_url=url)]

    @flow(name="steps-with-a-loss")
    def steps(start: int, stop: int) -> None:
        with StepCheckpointManager(url, handle_preemption=False) as mgr:
            for step in range(start, stop):
                mgr.save(step, {"a": {"w": np.full(4, step)}}, metrics={"loss": LOSSES[step]})

    def epochs(deployment_id: UUID) -> list[int]:
        runs = client.read_flow_runs(deployment_filter=DeploymentFilter(
            id=DeploymentFilterId(any_=[deployment_id])))
        assert {r.parameters["checkpoint_url"] for r in runs} <= {canonical}
        return sorted(int(r.parameters["epoch"]) for r in runs)

    try:
        steps(0, len(LOSSES))
        poll(lambda: epochs(first), lambda got: got == [3], timeout=120)
        poll(lambda: epochs(every), lambda got: got == [0, 1, 9], timeout=120)
        EventsWorker.drain_all(timeout=10)
        time.sleep(2)  # the later events had time to (wrongly) act too
        assert (epochs(first), epochs(every)) == ([3], [0, 1, 9])
    finally:
        for automation_id in automations:
            client.delete_automation(automation_id)


@pytest.mark.parametrize("below, above", [(None, None), (1, 2), (float("nan"), None),
                                          (None, float("inf")), (None, "1"), (True, None)])
def test_a_threshold_is_one_finite_number(below, above):
    with pytest.raises(JobDefinitionError, match="exactly one of below= and above="):
        create_metric_deployment_automation(UUID(int=1), metric="loss", below=below,
                                            above=above)
    with pytest.raises(JobDefinitionError, match="metric must be"):
        create_metric_deployment_automation(UUID(int=1), metric="", below=1)


@pytest.mark.parametrize("every", [0, -1, 1.5, True])
def test_every_must_be_a_positive_int(every):
    with pytest.raises(JobDefinitionError, match="every must be an int >= 1"):
        create_epoch_deployment_automation(UUID(int=1), every=every)
    with pytest.raises(JobDefinitionError, match="up_to_epoch must be an int >= 1"):
        create_epoch_deployment_automation(UUID(int=1), up_to_epoch=every)


def test_an_alert_needs_an_action():
    with pytest.raises(JobDefinitionError, match="give notification_block_id"):
        create_checkpoint_alert_automation()
