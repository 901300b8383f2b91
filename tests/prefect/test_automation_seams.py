"""Where a user's inputs meet the automations, on the session's real Prefect server: a
``create_*`` call made twice gives one automation (updated, same id); the default names say
which deployment (by name), prefix and condition; two FTP servers' prefixes are watched apart;
a ``checkpoint_url`` that no event can name is refused; the alert names the flow run that sent
the event."""

from __future__ import annotations

import asyncio
import os
from datetime import UTC, datetime, timedelta
from uuid import UUID, uuid4

import pytest
from prefect import flow
from prefect.blocks.notifications import CustomWebhookNotificationBlock
from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId
from prefect.events import emit_event
from prefect.events.actions import DoNothing
from prefect.events.schemas.automations import AutomationCore, EventTrigger
from prefect.events.worker import EventsWorker
from prefect.server.events.jinja_filters import all_filters
from prefect.server.events.schemas.events import ReceivedEvent
from prefect.server.schemas.responses import FlowRunResponse
from prefect.server.utilities.user_templates import (
    register_user_template_filters,
    render_user_template,
)
from prefect.settings import PREFECT_UI_URL, temporary_settings
from prefect.states import Running

from caffe2ckpt.errors import JobDefinitionError
from caffe2ckpt.prefect import (
    create_checkpoint_alert_automation,
    create_crash_retry_automation,
    create_epoch_deployment_automation,
    create_heartbeat_crash_automation,
    create_metric_deployment_automation,
)
from caffe2ckpt.prefect.automations import ALERT_BODY, _prefix, _prefixes
from caffe2ckpt.prefect.events import resource_id
from caffe2ckpt.prefect.orderkey import metric_labels
from tests.prefect.conftest import poll
from tests.prefect.test_checkpoint_automations import (
    Webhook,
    emit_save_failed,
    evaluation_deployment,
)


@pytest.fixture
def webhook():
    hook = Webhook()
    yield hook
    hook.close()


def _block(url: str) -> UUID:
    return CustomWebhookNotificationBlock(
        name="seams-alerts", url=url,
        json_data={"subject": "{{subject}}", "body": "{{body}}"}).save("seams-alerts",
                                                                      overwrite=True)


# each helper: (call with the first settings, call with the second, the default name expected,
# what the second settings changed in the stored automation); P is the watched prefix
CASES = {
    "crash-retry": (lambda d, b, p: create_crash_retry_automation(d),
                    lambda d, b, p: create_crash_retry_automation("evaluate-checkpoint/seams"),
                    "caffe2ckpt: retry crashed runs of evaluate-checkpoint/seams",
                    lambda a: True),
    "heartbeat": (lambda d, b, p: create_heartbeat_crash_automation(timedelta(minutes=10)),
                  lambda d, b, p: create_heartbeat_crash_automation(timedelta(minutes=20)),
                  "caffe2ckpt-crash-silent-runs",
                  lambda a: a.trigger.within == timedelta(minutes=20)),
    "epoch": (lambda d, b, p: create_epoch_deployment_automation(
                  d, every=2, checkpoint_url=p, parameters={"v": 1}),
              lambda d, b, p: create_epoch_deployment_automation(
                  d, every=2, checkpoint_url=p, parameters={"v": 2}),
              "caffe2ckpt: run evaluate-checkpoint/seams every 2 epochs in P",
              lambda a: a.actions[0].parameters["v"] == 2),
    "metric": (lambda d, b, p: create_metric_deployment_automation(
                   d, metric="loss", below=0.25, checkpoint_url=p),
               lambda d, b, p: create_metric_deployment_automation(
                   d, metric="loss", below=0.25, once=False, checkpoint_url=p),
               "caffe2ckpt: run evaluate-checkpoint/seams when loss is below 0.25 in P",
               lambda a: a.trigger.within == timedelta(0)),
    "alert": (lambda d, b, p: create_checkpoint_alert_automation(
                  notification_block_id=b, checkpoint_url=p),
              lambda d, b, p: create_checkpoint_alert_automation(
                  notification_block_id=b, fail_flow_run=True, checkpoint_url=p),
              "caffe2ckpt: alert custom-webhook/seams-alerts on failed saves and damage in P",
              lambda a: len(a.actions) == 2),
}


@pytest.mark.parametrize("case", CASES)
def test_creating_twice_updates_the_one_automation_named_by_what_it_watches(
        case, tmp_path, monkeypatch, client):
    """The prefix is given relative to the current directory, as the managers take it; the
    name shows it canonical."""
    first, second, expected_name, changed = CASES[case]
    monkeypatch.chdir(tmp_path)
    prefix = "file://" + os.path.realpath(tmp_path / "checkpoints/run")
    deployment_id = evaluation_deployment(client, "seams")
    block_id = _block("http://127.0.0.1:9/unused")
    automation_id = first(deployment_id, block_id, "checkpoints/run")
    try:
        assert second(deployment_id, block_id, "checkpoints/run/") == automation_id
        same = client.read_automations_by_name(expected_name.replace("P", prefix))
        assert [a.id for a in same] == [automation_id]
        assert changed(same[0])
        if case not in ("heartbeat", "alert"):
            assert f"evaluate-checkpoint/seams ({deployment_id})" in same[0].description
    finally:
        client.delete_automation(automation_id)


def test_two_automations_of_one_name_are_refused_naming_both(client):
    core = AutomationCore(name=f"seams-twice-{uuid4()}", trigger=EventTrigger(expect={"x"}),
                          actions=[DoNothing()])
    ids = [client.create_automation(core) for _ in range(2)]
    try:
        with pytest.raises(JobDefinitionError, match=f"2 automations are named '{core.name}'") \
                as caught:
            create_heartbeat_crash_automation(name=core.name)
        assert all(str(i) in str(caught.value) for i in ids)
    finally:
        for automation_id in ids:
            client.delete_automation(automation_id)


def test_two_ftp_servers_prefixes_are_watched_apart():
    """Nothing connects to these servers (and no Prefect server is needed): the prefix is made
    canonical from the URL alone, host and port kept, the password left out."""
    watched = [_prefixes(_prefix(url, "test")).root["prefect.resource.id"]
               for url in ("ftp://alice:S3cr3t-pw@h1:21/run", "ftp://h2:2121/run",
                           "ftp://h1/run")]  # the port fsspec connects to when none is given
    assert watched == [resource_id("ftp://h1:21/run"), resource_id("ftp://h2:2121/run"),
                       resource_id("ftp://h1:21/run")]


def test_a_default_name_shows_the_prefix_without_its_password(client):
    deployment_id = evaluation_deployment(client, "seams")
    automation_id = create_epoch_deployment_automation(
        deployment_id, checkpoint_url="ftp://alice:S3cr3t-pw@h1:21/run")
    try:
        automation = client.read_automation(automation_id)
    finally:
        client.delete_automation(automation_id)
    assert automation.name == "caffe2ckpt: run evaluate-checkpoint/seams every epoch in " \
                              "ftp://h1:21/run"
    assert "S3cr3t" not in automation.model_dump_json()


@pytest.mark.parametrize("url, says", [
    ("", "names no prefix"), (" ", "names no prefix"), ("*", "has a wildcard"),
    ("runs/*/a", "has a wildcard"), ("runs/a*", "has a wildcard"),
    ("s3:/bucket/run", "one slash"), ("http://host/run", "cannot be a checkpoint prefix"),
    ("ftp://alice:S3cr3t-pw@h1/run*", "'ftp://h1/run\\*'")])
def test_a_checkpoint_url_no_event_can_name_is_refused(url, says):
    for create in (lambda: create_epoch_deployment_automation(UUID(int=1), checkpoint_url=url),
                   lambda: create_checkpoint_alert_automation(fail_flow_run=True,
                                                              checkpoint_url=url)):
        with pytest.raises(JobDefinitionError, match=says) as caught:
            create()
        assert "checkpoint_url" in str(caught.value) and "S3cr3t" not in str(caught.value)


def test_a_missing_deployment_or_block_is_named(client):
    missing = UUID(int=7)
    with pytest.raises(JobDefinitionError, match=f"no deployment {missing} on the Prefect"):
        create_epoch_deployment_automation(missing, every=3)
    with pytest.raises(JobDefinitionError, match="no deployment named 'nope/none' on the"):
        create_crash_retry_automation("nope/none")
    with pytest.raises(JobDefinitionError, match="'nope' is neither a deployment id nor"):
        create_crash_retry_automation("nope")
    with pytest.raises(JobDefinitionError, match=f"no block {missing} on the Prefect"):
        create_checkpoint_alert_automation(notification_block_id=missing)


def test_calling_a_once_threshold_automation_again_re_arms_it(tmp_path, client):
    """After an epoch below the threshold ran the deployment, the same call again (an update
    of the one automation) lets the next such epoch run it too (the once-only window is
    tested in test_checkpoint_automations)."""
    url = "file://" + os.path.realpath(tmp_path / "run")
    deployment_id = evaluation_deployment(client, "seams-once")
    runs_of = DeploymentFilter(id=DeploymentFilterId(any_=[deployment_id]))

    def commit(epoch: int) -> None:
        emit_event("caffe2ckpt.epoch.committed",
                   resource={"prefect.resource.id": resource_id(url), "caffe2ckpt.url": url,
                             **metric_labels({"loss": 0.1})},
                   payload={"epoch": epoch})
        EventsWorker.drain_all(timeout=10)

    def runs(n: int) -> list[int]:
        found = poll(lambda: client.read_flow_runs(deployment_filter=runs_of),
                     lambda rs: len(rs) >= n, timeout=60)
        return sorted(int(r.parameters["epoch"]) for r in found)

    def arm() -> UUID:
        return create_metric_deployment_automation(deployment_id, metric="loss", below=0.5,
                                                   checkpoint_url=url)

    automation_id = arm()
    try:
        commit(1)
        assert runs(1) == [1]
        assert arm() == automation_id
        commit(3)
        assert runs(2) == [1, 3]
    finally:
        client.delete_automation(automation_id)


def test_an_alert_names_the_flow_run_that_sent_it(tmp_path, webhook, client):
    """On the server (no UI address known there): the run's name and id, and no line for the
    node the event does not know."""
    @flow(name="seams-saving-run")
    def saving() -> None:
        """Only its definition is used: its run is made by hand."""

    url = "file://" + os.path.realpath(tmp_path / "ck")
    automation_id = create_checkpoint_alert_automation(
        notification_block_id=_block(webhook.url), checkpoint_url=url)
    try:
        run = client.create_flow_run(flow=saving, state=Running())
        emit_save_failed(url, run.id, node=None)
        bodies = poll(lambda: list(webhook.bodies), bool, timeout=60)
    finally:
        client.delete_automation(automation_id)
    assert bodies[0]["body"] == (f"caffe2ckpt.save.failed: disk full\ncheckpoint: {url}\n"
                                 f"epoch: 7\nflow run: {run.name} ({run.id})")


def test_an_alert_links_the_flow_run_where_the_ui_address_is_known():
    """Prefect's own renderer of notification templates, with a server's PREFECT_UI_URL."""
    run_id = uuid4()
    event = ReceivedEvent(
        event="caffe2ckpt.checkpoint.damaged",
        resource={"prefect.resource.id": resource_id("s3://b/run"), "caffe2ckpt.url": "s3://b/run"},
        payload={"job": "regression", "epoch": 0, "node": "trainer_0", "blob": "model/w",
                 "message": "checksum mismatch"}, id=uuid4(), occurred=datetime.now(UTC))
    flow_run = FlowRunResponse(id=run_id, name="brave-otter", flow_id=uuid4())
    register_user_template_filters(all_filters)
    with temporary_settings({PREFECT_UI_URL: "http://ui.example:4200"}):
        body = asyncio.run(render_user_template(ALERT_BODY, {"event": event,
                                                             "flow_run": flow_run}))
    assert body == ("caffe2ckpt.checkpoint.damaged: checksum mismatch\ncheckpoint: s3://b/run\n"
                    "job: regression\nepoch: 0\nnode: trainer_0\nblob: model/w\n"
                    f"flow run: brave-otter ({run_id}): "
                    f"http://ui.example:4200/runs/flow-run/{run_id}")
