"""A storage outage on the terminal: one WARNING line per failed save, no traceback; the flow
run's logs (Prefect's API log handler) keep the tracebacks. The flow (outage_flow.py) runs as a
user's script against the session's server, its S3 server (moto) unreachable for two epochs."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
from prefect.settings import PREFECT_API_URL

from tests.prefect.conftest import poll

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]


def test_a_storage_outage_prints_one_line_per_failed_save(moto_server, client):
    bucket = moto_server.new_bucket()
    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value(), "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, str(Path(__file__).with_name("outage_flow.py")),
                           moto_server.endpoint, bucket], env=env, capture_output=True,
                          text=True, timeout=180, check=False)
    terminal = done.stdout + done.stderr
    assert done.returncode == 0, terminal
    warnings = [line for line in terminal.splitlines() if "Unable to write checkpoint" in line]
    assert [w.split("epoch ")[1].split(".")[0] for w in warnings] == ["2", "3"], terminal
    assert "Traceback" not in terminal, terminal
    print(f"the terminal: {len(terminal.splitlines())} lines")
    flow_run_id = re.search(r"^[0-9a-f-]{36}$", done.stdout, re.MULTILINE).group()
    logs = poll(lambda: client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(
        any_=[flow_run_id]))), lambda logs: any("Traceback" in log.message for log in logs))
    failed_saves = [log for log in logs if log.task_run_id is not None
                    and "Traceback" in log.message and "CheckpointWriteError" in log.message]
    unretrieved = [log for log in logs if log.name == "asyncio" and "Traceback" in log.message]
    print(f"the run's logs: {len(failed_saves)} failed save task runs, {len(unretrieved)} "
          "asyncio records, with tracebacks")
    assert len(failed_saves) >= 2 and unretrieved, [log.message[:200] for log in logs]
