"""A flow run that someone else marks *Failed* while it trains (the alert automation's
``fail_flow_run=True``) stops at an epoch boundary and stays *Failed*; a slow or unreachable API
never stops it. In process, on the session's server (a real worker: test_alert_worker.py)."""

from __future__ import annotations

import functools
import itertools
import logging
import socket
import time

import pytest
from prefect import flow
from prefect.client.orchestration import get_client
from prefect.client.schemas.objects import StateType
from prefect.exceptions import Abort
from prefect.runtime import flow_run
from prefect.settings import PREFECT_API_URL, temporary_settings
from prefect.states import Failed

from caffe2ckpt import MultiNodeCheckpointManager
from caffe2ckpt.example import build_job
from caffe2ckpt.fs.location import Location
from caffe2ckpt.job import Node, Task
from caffe2ckpt.prefect import PrefectSession, run_job
from caffe2ckpt.prefect.statewatch import FailedMarkWatch
from caffe2ckpt.store.commit.protocol import CheckpointStore
from tests.prefect.conftest import Records
from tests.stores import newest_epoch

EPOCHS = 300  # far more than a run marked at epoch 3 gets to (~1 s of epochs)
MARKED_AT = 3
MESSAGE = "caffe2ckpt test: marked Failed from outside the run"
HOST = "127.0.0.1"


def marking_job(epochs: int, at: int):
    """The example job, whose first node marks its own flow run *Failed* in epoch ``at`` (as
    the alert automation does, through the API)."""
    job = build_job(epochs)
    calls = itertools.count(1)

    def mark(ws) -> None:
        if next(calls) == at:
            with get_client(sync_client=True) as client:
                client.set_flow_run_state(flow_run.id, Failed(message=MESSAGE))

    with Node("trainer_0"), job.epoch_group:
        Task(mark, name="mark")
    return job


def test_a_run_marked_failed_stops_at_an_epoch_boundary_and_stays_failed(tmp_path, client):
    url = str(tmp_path / "ck")
    ran: list[str] = []

    @flow(name="marked-failed")
    def marked_failed() -> int:
        ran.append(str(flow_run.id))
        cm = MultiNodeCheckpointManager(url)
        return run_job(marking_job(EPOCHS, MARKED_AT), cm, session=PrefectSession(
            artifacts=False, group_epochs=False))

    records = Records()
    logging.getLogger("caffe2ckpt.prefect.statewatch").addHandler(records)
    try:
        with pytest.raises(Abort, match="was marked Failed while it ran"):
            marked_failed()
    finally:
        logging.getLogger("caffe2ckpt.prefect.statewatch").removeHandler(records)
    run = client.read_flow_run(ran[0])
    assert run.state.type == StateType.FAILED and run.state.message == MESSAGE, run.state
    last = newest_epoch(CheckpointStore(Location(url)), ["trainer_0", "trainer_1"])
    assert MARKED_AT <= last < EPOCHS // 2, last  # it stopped within a second of epochs
    (line,) = [r.getMessage() for r in records.records]
    assert f"flow run {ran[0]} was marked Failed while it ran (Failed: {MESSAGE}): stopping " \
           f"after epoch {last}" in line, line
    assert f"its committed checkpoints stay under {url}, and the run stays Failed" in line


def test_a_slow_or_unreachable_api_never_stops_the_run():
    """Each epoch boundary waits at most ``wait`` for a read it sent, none for one still out:
    an API that accepts connections and never answers, or refuses them (Prefect's client tries
    again), costs one wait, not one per epoch. An error answer is logged (once as a WARNING)
    and the run goes on."""
    watch = functools.partial(FailedMarkWatch, "00000000-0000-0000-0000-000000000001",
                              "file:///x", interval=0, wait=0.3)
    silent = socket.socket()
    silent.bind((HOST, 0))
    silent.listen(8)
    closed = socket.socket()
    closed.bind((HOST, 0))
    refused = closed.getsockname()[1]
    closed.close()
    try:
        with temporary_settings({PREFECT_API_URL: f"http://{HOST}:{silent.getsockname()[1]}/api"}):
            hanging, started = watch(), time.monotonic()
            for epoch in range(20):
                hanging(epoch)
            hung = time.monotonic() - started
    finally:
        silent.close()
    with temporary_settings({PREFECT_API_URL: f"http://{HOST}:{refused}/api"}):
        down, started = watch(), time.monotonic()
        for epoch in range(20):
            down(epoch)
        refusing = time.monotonic() - started
    records, logger = Records(), logging.getLogger("caffe2ckpt.prefect.statewatch")
    logger.addHandler(records)
    level, logger.level = logger.level, logging.DEBUG
    try:
        unknown = watch(wait=30)  # the session's server, waited for: no such flow run
        for epoch in range(3):
            unknown(epoch)
    finally:
        logger.removeHandler(records)
        logger.setLevel(level)
    assert hung < 1.0 and refusing < 1.0, (hung, refusing)  # one wait of 0.3 s, not twenty
    said = [(r.levelno, r.getMessage()) for r in records.records]
    assert [level for level, _ in said] == [logging.WARNING, logging.DEBUG, logging.DEBUG], said
    assert all("cannot read the state of flow run" in text and "ObjectNotFound" in text
               for _, text in said), said
