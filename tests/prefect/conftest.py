"""A real Prefect server (Prefect's test harness: a server subprocess on 127.0.0.1 with a
temporary SQLite database) shared by the Prefect-backed tests, with lean settings: no flow
heartbeats and no event persister (task runs are still recorded so tests can query them)."""

from __future__ import annotations

import logging
import os
import tempfile
import time
from collections.abc import Collection
from pathlib import Path
from unittest import mock
from uuid import UUID

import pytest

os.environ["PREFECT_SERVER_SERVICES_EVENT_PERSISTER_ENABLED"] = "false"
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")

import prefect.testing.utilities  # noqa: E402
from prefect.client.orchestration import get_client  # noqa: E402
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId  # noqa: E402
from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings  # noqa: E402
from prefect.testing.utilities import prefect_test_harness  # noqa: E402

import caffe2ckpt.prefect  # noqa: E402,F401  (before prefect: routes caffe2ckpt logs)
from tests import prefectdb  # noqa: E402


def _seeded_mkdtemp(*args, **kwargs) -> str:
    """The harness's database folder (``mkdtemp``), holding a copy of the migrated template."""
    folder = tempfile.mkdtemp(*args, **kwargs)
    prefectdb.seed(Path(folder) / "prefect-test.db")
    return folder


@pytest.fixture(scope="session", autouse=True)
def prefect_server():
    """The harness's server (on a copy of the session's migrated database), and this worker's
    ``PREFECT_HOME`` seeded too, for the temporary servers of the flows tests run."""
    prefectdb.seed_home(Path(os.environ["PREFECT_HOME"]))
    with (mock.patch.object(prefect.testing.utilities, "mkdtemp", _seeded_mkdtemp),
          prefect_test_harness(server_startup_timeout=120),
          temporary_settings({PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None})):
        yield


@pytest.fixture
def client():
    with get_client(sync_client=True) as c:
        yield c


def poll(fetch, ready, timeout: float = 30.0):
    """Call ``fetch()`` until ``ready(result)`` (the server records task runs asynchronously)."""
    deadline = time.monotonic() + timeout
    while True:
        result = fetch()
        if ready(result) or time.monotonic() > deadline:
            return result
        time.sleep(0.25)


def finished_task_runs(client, flow_run_id, expected: int, names: Collection[str] = ()) -> list:
    """The flow run's task runs once at least ``expected`` exist, every one is final and
    ``names`` are among theirs. Prefect records a task run from its events: the Pending event
    carries the default name (``<task>-<key>``), later events the ``task_run_name``; counting
    rows alone can read a task run between the two, and under load the recorder was seen to
    record a run final while its name was still the default (a flow of Dask actors' tasks)."""
    runs_filter = FlowRunFilter(id=FlowRunFilterId(any_=[UUID(str(flow_run_id))]))
    return poll(lambda: client.read_task_runs(flow_run_filter=runs_filter),
                lambda runs: len(runs) >= expected and all(r.state and r.state.is_final()
                                                           for r in runs)
                and set(names) <= {r.name for r in runs})


class Records(logging.Handler):
    """Keeps every record it is handed (attach it to the loggers a test reads)."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)
