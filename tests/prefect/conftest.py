"""A real Prefect server (Prefect's test harness: a server subprocess on 127.0.0.1 with a
temporary SQLite database) shared by the Prefect-backed tests, with lean settings: no flow
heartbeats and no event persister (task runs are still recorded so tests can query them)."""

from __future__ import annotations

import os
import time

import pytest

os.environ["PREFECT_SERVER_SERVICES_EVENT_PERSISTER_ENABLED"] = "false"
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")

import caffe2ckpt.prefect  # noqa: E402,F401  (before prefect: routes caffe2ckpt logs)
from prefect.client.orchestration import get_client  # noqa: E402
from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings  # noqa: E402
from prefect.testing.utilities import prefect_test_harness  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def prefect_server():
    with prefect_test_harness(server_startup_timeout=120):
        with temporary_settings({PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}):
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
