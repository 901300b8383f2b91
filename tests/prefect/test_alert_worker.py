"""On a real ``prefect server`` with its default services (events stored): a deployment run on a
process worker that someone marks *Failed* while it trains (as
``create_checkpoint_alert_automation(fail_flow_run=True)`` does) stops at an epoch boundary and
stays *Failed*; an ``epoch.committed`` event sent twice is stored once, and a resume re-creates
the event of its epoch that an earlier run never sent."""

from __future__ import annotations

import functools
import logging
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import httpx
import pytest
from prefect.client.orchestration import SyncPrefectClient, get_client
from prefect.client.schemas.actions import WorkPoolCreate
from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId, LogFilterLevel
from prefect.client.schemas.objects import StateType
from prefect.events.filters import (
    EventFilter,
    EventNameFilter,
    EventOccurredFilter,
    EventResourceFilter,
)
from prefect.settings import PREFECT_API_URL, temporary_settings
from prefect.states import Failed
from prefect.workers.process import ProcessWorker

from caffe2ckpt import JobRunner, LocalSession, MultiNodeCheckpointManager, events
from caffe2ckpt.example import build_job
from caffe2ckpt.fs.location import Location
from caffe2ckpt.prefect.events import PrefectPublisher, _stored, resource_id
from caffe2ckpt.store.commit.protocol import CheckpointStore
from caffe2ckpt.store.format.records import list_records
from tests import prefectdb
from tests.prefect.test_deployment_e2e import REPO, wait_for
from tests.procs import free_port, stop_tree
from tests.stores import newest_epoch, records_at

pytestmark = pytest.mark.slow

EPOCHS = 1000  # a run not stopped trains for minutes; marked at epoch 3 it stops within seconds
MESSAGE = "caffe2ckpt test: a checkpoint save failed (marked as the alert automation does)"


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[tuple[str, dict[str, str]]]:
    """A real Prefect server on 127.0.0.1 with its default services (the event persister
    flushing every 0.5 s), stopped by PID at the end; its API URL and an environment for its
    processes."""
    folder = tmp_path_factory.mktemp("alert-server")
    port = free_port()
    env = {**os.environ, "PREFECT_HOME": str(prefectdb.seed_home(folder / "home")),
           "PREFECT_API_URL": f"http://127.0.0.1:{port}/api",
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "DO_NOT_TRACK": "1",
           "PREFECT_WORKER_QUERY_SECONDS": "1", "PREFECT_LOGGING_LEVEL": "INFO",
           "PREFECT_SERVER_SERVICES_EVENT_PERSISTER_FLUSH_INTERVAL": "0.5"}
    for key in ("PREFECT_SERVER_SERVICES_EVENT_PERSISTER_ENABLED",
                "PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_ENABLED"):
        env.pop(key, None)
    with open(folder / "server.log", "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "prefect", "server", "start", "--host",
                                 "127.0.0.1", "--port", str(port), "--no-ui"], env=env,
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            with httpx.Client() as http:
                wait_for(lambda: http.get(f"{env['PREFECT_API_URL']}/health",
                                          timeout=2).status_code == 200, 120, "the server")
            yield env["PREFECT_API_URL"], env
        finally:
            stop_tree(proc)


@pytest.fixture
def api(server) -> Iterator[SyncPrefectClient]:
    """A client of the module's server (this process's Prefect settings point at it)."""
    with temporary_settings({PREFECT_API_URL: server[0]}), get_client(sync_client=True) as c:
        yield c


def _deployment_run(client: SyncPrefectClient, checkpoint_url: str) -> tuple[uuid.UUID, str]:
    """A run of flows/regression.py deployed to a new process work pool, not yet started; its
    id and the pool's name."""
    pool = f"pool-{uuid.uuid4().hex[:8]}"
    client.create_work_pool(WorkPoolCreate(
        name=pool, type="process",
        base_job_template=ProcessWorker.get_default_base_job_template()))
    flow_id = client.create_flow_from_name("regression")
    deployment = client.create_deployment(
        flow_id, "alerted", work_pool_name=pool, entrypoint="flows/regression.py:regression",
        pull_steps=[{"prefect.deployments.steps.set_working_directory":
                     {"directory": str(REPO)}}])
    run = client.create_flow_run_from_deployment(deployment, parameters={
        "checkpoint_url": checkpoint_url, "epochs": EPOCHS})
    return run.id, pool


def test_a_deployment_run_marked_failed_stops_and_stays_failed(server, api, tmp_path):
    env = server[1]
    ckpt = str(tmp_path / "ckpt")
    run_id, pool = _deployment_run(api, ckpt)
    with open(tmp_path / "worker.log", "wb") as log:
        worker = subprocess.Popen([sys.executable, "-m", "prefect", "worker", "start", "--pool",
                                   pool, "--type", "process", "--run-once"], env=env, cwd=REPO,
                                  stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            wait_for(lambda: any(r.epoch >= 3 for r in list_records(Location(ckpt))), 120,
                     "epoch 3 committed", every=0.1)
            api.set_flow_run_state(run_id, Failed(message=MESSAGE))  # not forced, as automations
            assert worker.wait(timeout=120) == 0, (tmp_path / "worker.log").read_text()
        finally:
            stop_tree(worker)
    run = api.read_flow_run(run_id)
    # the flow has retries left: Prefect made the mark AwaitingRetry, the run made it Failed
    assert run.state.type == StateType.FAILED, run.state
    assert run.state.message.startswith(MESSAGE + " (caffe2ckpt: Prefect had made this Failed "
                                         "mark AwaitingRetry"), run.state
    last = newest_epoch(CheckpointStore(Location(ckpt)), ["trainer_0", "trainer_1"])
    assert 3 <= last < EPOCHS, last

    def said() -> list[str]:
        logs = api.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run_id]),
                                       level=LogFilterLevel(ge_=logging.WARNING)))  # a page
        # of the first 200 lines would miss it: a run with more epochs before it stops logs more
        return [log.message for log in logs if "was marked Failed while it ran" in log.message]

    (line,) = wait_for(said, 30, "the run's log line saying why it stopped")
    assert (f"(AwaitingRetry: {MESSAGE}; Prefect made it AwaitingRetry as the flow has retries "
            f"left: now Failed): stopping after epoch {last}") in line, line
    assert f"stay under {Location(ckpt).url}, and the run stays Failed" in line, line


def _committed(client: SyncPrefectClient, url: str) -> list:
    """The ``epoch.committed`` events the server stored for prefix ``url``."""
    page = client.read_events(EventFilter(
        event=EventNameFilter(name=[events.EPOCH_COMMITTED]),
        resource=EventResourceFilter(id=[resource_id(url)]),
        occurred=EventOccurredFilter(since=datetime.now(UTC) - timedelta(hours=1))),
        limit=50)
    return page.events


def test_a_resume_recreates_a_lost_committed_event_and_a_copy_is_stored_once(api, tmp_path):
    """Prefect's server stores an event id once (its persister inserts ``ON CONFLICT DO
    NOTHING``; its message queue drops a copy seen in the last minutes): the committed event of
    the epoch a run resumes from, sent again, exists once."""
    url = Location(str(tmp_path / "ck")).canonical_url
    nodes = ["trainer_0", "trainer_1"]
    events.flush()  # Prefect's events worker was made for the session's server: a new one
    try:
        with temporary_settings({PREFECT_API_URL: None}):  # a run whose events never left
            assert not PrefectPublisher().active()
            JobRunner(build_job(2), MultiNodeCheckpointManager(url)).train(LocalSession())
        JobRunner(build_job(3), MultiNodeCheckpointManager(url)).train(LocalSession())
        events.flush()
        stored = wait_for(lambda: len(_committed(api, url)) >= 2 and _committed(api, url), 30,
                          "the resumed and the new epoch's events stored")
        record = records_at(CheckpointStore(Location(url)), nodes, 2)["trainer_0"]
        again = functools.partial(events.committed_payload, records_at(
            CheckpointStore(Location(url)), nodes, 2), kept=None)
        events.publish(events.EPOCH_COMMITTED, url, again, job="regression")  # a copy
        events.publish(events.EPOCH_COMMITTED, url, again, job="regression", resent=True)
        events.publish(events.GC_FINISHED, url, lambda: {"deleted": []})  # after the copies
        events.flush()
        wait_for(lambda: api.read_events(EventFilter(
            event=EventNameFilter(name=[events.GC_FINISHED]),
            resource=EventResourceFilter(id=[resource_id(url)])), limit=1).events, 30,
                 "the gc event")
        after = _committed(api, url)
    finally:
        events.flush()  # the next test's events go to the session's server again
    assert sorted(e.payload["epoch"] for e in stored) == [2, 3]  # 0 and 1 never left
    (resumed,) = [e for e in after if e.payload["epoch"] == 2]
    assert str(resumed.id) == events.committed_event_id(url, 2, record.save_id)
    assert resumed.payload["save_id"] == record.save_id and resumed.payload["kept"] is None
    assert resumed.resource.get("prefect.resource.name") == f"regression @ {url}"
    assert sorted(e.payload["epoch"] for e in after) == [2, 3]
    assert _stored(str(resumed.id)) is True  # so a later resume does not send it again
