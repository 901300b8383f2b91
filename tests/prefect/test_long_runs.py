"""Long runs read well: the example's terminal has one line per epoch while the flow run logs
keep every task run's lines, and the flow run graph has one node per epoch with the epoch's
node task runs nested under it (graph-v2 API of the test harness's real server)."""

from __future__ import annotations

import io
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from prefect import flow, get_run_logger, task
from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
from prefect.logging.handlers import PrefectConsoleHandler
from prefect.runtime import flow_run
from prefect.settings import PREFECT_API_URL

from caffe2ckpt import JobRunner, MultiNodeCheckpointManager
from caffe2ckpt.example import InjectedFailure, build_job
from caffe2ckpt.prefect import PrefectSession, quiet_task_runs
from tests.prefect.conftest import Records, finished_task_runs, poll
from tests.prefect.test_regression_flow import lineage, writer

REPO = Path(__file__).resolve().parents[2]
EPOCHS = 6
EPOCH_LINE = re.compile(r"Epoch (\d+) of job 'regression' done, loss [0-9.e-]+; "
                        r"checkpoint committed under ")


def test_the_example_prints_one_line_per_epoch_and_the_api_keeps_the_rest(tmp_path, client):
    url = str(tmp_path / "ckpt")
    env = {**os.environ, "PYTHONPATH": str(REPO), "PREFECT_API_URL": PREFECT_API_URL.value()}
    out = subprocess.run([sys.executable, str(REPO / "flows" / "regression.py"),
                          "--checkpoint-url", url, "--epochs", str(EPOCHS)], env=env,
                         cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0 and f"final epoch: {EPOCHS}" in out.stdout, out.stderr
    lines = (out.stdout + out.stderr).splitlines()
    assert [int(m.group(1)) for line in lines if (m := EPOCH_LINE.search(line))] == list(
        range(1, EPOCHS + 1)), lines
    assert not [line for line in lines if "Finished in state Completed()" in line
                and "Task run" in line], lines
    assert not [line for line in lines if "loss" in line and "[trainer_" in line], lines
    assert len(lines) <= EPOCHS + 6, lines  # epochs + flow run begins/ends + job start + final

    run_id = writer(lineage(url)[0])["flow_run_id"]
    task_runs = finished_task_runs(client, run_id, 2 * 3 + 4 * EPOCHS + EPOCHS + 1)
    log_filter = LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run_id]))

    def task_run_logs():
        return [log.message for log in client.read_logs(log_filter=log_filter, limit=200)
                if log.task_run_id is not None]

    logs = poll(task_run_logs, lambda got: sum("Finished in state" in m for m in got)
                >= len(task_runs))
    assert sum("Finished in state Completed()" in m for m in logs) == len(task_runs)
    assert sum(bool(re.match(r"\[trainer_[01]\] epoch +\d+ +loss", m)) for m in logs) == 2 * EPOCHS


def test_task_run_warnings_still_reach_the_console():
    @task(task_run_name="noisy")
    def noisy() -> None:
        get_run_logger().info("task info line")
        get_run_logger().warning("task warning line")

    @flow(name="console-check")
    def check() -> None:
        get_run_logger().info("flow info line")
        noisy()

    consoles = [h for h in logging.getLogger().handlers if isinstance(h, PrefectConsoleHandler)]
    assert consoles, "Prefect's console handler is not on the root logger"
    stream, console = io.StringIO(), consoles[0].console  # the handler writes through rich
    old, console.file = console.file, stream
    try:
        assert quiet_task_runs() == len(consoles)
        check()
        quiet = stream.getvalue()
        quiet_task_runs(False)
        check()
        loud = stream.getvalue()[len(quiet):]
    finally:
        quiet_task_runs(False)
        console.file = old
    assert "task warning line" in quiet and "flow info line" in quiet, quiet
    assert "task info line" not in quiet
    assert not [line for line in quiet.splitlines() if "Task run" in line
                and "WARNING" not in line], quiet
    assert "task info line" in loud and "Task run 'noisy' - Finished in state" in loud, loud


NAMED = re.compile(r"epoch \d+|\w+\[trainer_\d\] e\d+")  # a task run's name once it started


def graph(flow_run_id: str, expected: int) -> list[dict]:
    """The flow run's graph-v2 nodes once ``expected`` task runs are in it, each under its final
    name (the server records a task run under a provisional name first, renamed as it starts:
    the recorder may lag behind)."""
    def fetch() -> list[dict]:
        response = httpx.get(f"{PREFECT_API_URL.value()}/flow_runs/{flow_run_id}/graph-v2")
        response.raise_for_status()
        return [node for _, node in response.json()["nodes"]]

    return poll(fetch, lambda nodes: len(nodes) >= expected
                and all(NAMED.fullmatch(node["label"]) for node in nodes))


@pytest.mark.parametrize("grouped", [True, False])
def test_the_graph_has_one_node_per_epoch_with_its_task_runs_nested(tmp_path, client, grouped):
    epochs, nodes = 3, 2

    @flow(name="graph-check")
    def train() -> str:
        cm = MultiNodeCheckpointManager(str(tmp_path / "ckpt"))
        JobRunner(build_job(epochs, nodes), cm).train(PrefectSession(group_epochs=grouped))
        return flow_run.id

    run_id = train()
    node_runs = nodes * 3 + 2 * nodes * epochs  # init, checkpoint_init, save e0; epoch, save
    found = graph(run_id, node_runs + (epochs + 1 if grouped else 0))
    by_id = {node["id"]: node for node in found}
    top = sorted(node["label"] for node in found if not node["encapsulating"])
    if not grouped:
        assert len(top) == node_runs and not [n for n in top if n.startswith("epoch ")]
        return
    assert top == [f"epoch {e}" for e in range(epochs + 1)], top
    for node in found:
        if node["encapsulating"]:  # a node task run keeps its name, under its epoch's node
            epoch = node["label"].rsplit(" e", 1)[1]
            assert [by_id[e["id"]]["label"] for e in node["encapsulating"]] == [f"epoch {epoch}"]
    assert len(found) == node_runs + epochs + 1


@pytest.mark.parametrize("grouped", [True, False])
def test_a_failed_node_task_is_logged_once_not_again_by_its_epoch(tmp_path, grouped):
    """A node's failure is logged by its task run; the epoch's parent task run that it passes
    through adds no ERROR line (the parent still ends Failed), so grouping logs what the flat
    graph logs."""
    @flow(name="fails-in-epoch-2")
    def train() -> None:
        cm = MultiNodeCheckpointManager(str(tmp_path / "ckpt"))
        JobRunner(build_job(4, 1, fail_at_epoch=2), cm).train(PrefectSession(group_epochs=grouped))

    handler = Records()
    logger = logging.getLogger("prefect.task_runs")
    logger.addHandler(handler)
    try:
        with pytest.raises(InjectedFailure):
            train()
    finally:
        logger.removeHandler(handler)
    errors = [(getattr(r, "task_run_name", ""), r.getMessage().split("\n")[0])
              for r in handler.records if r.levelno >= logging.ERROR]
    # "failed with exception", then "Finished in state Failed": the node's task run only
    assert [name for name, _ in errors] == ["epoch_group[trainer_0] e2"] * 2, errors
    assert sum(bool(r.exc_info) for r in handler.records) == 1


RETRY_SCRIPT = """
import sys
import numpy as np
from prefect import flow
from caffe2ckpt import Job, JobRunner, MultiNodeCheckpointManager, Node, Task, epoch_limiter
from caffe2ckpt.prefect import PrefectSession

calls = []

def fail_first(ws):
    calls.append(1)
    if len(calls) == 1:
        raise RuntimeError("the first call fails")
    ws["w"] = ws["w"] + 1

with Job(name="retry-check") as job:
    with Node("trainer_0"):
        with job.init_group:
            Task(lambda ws: ws.update(w=np.zeros(2)), name="init")
        Task(fail_first, name="step")
    epoch_limiter(job, 2)

@flow(name="no-task-retries")
def train() -> int:
    return JobRunner(job, MultiNodeCheckpointManager(sys.argv[1])).train(PrefectSession())

try:
    train()
except RuntimeError:
    pass
print("calls", len(calls))
"""


def test_an_epoch_is_never_retried_in_place(tmp_path):
    """Prefect's default task retries (``PREFECT_TASKS_DEFAULT_RETRIES``, read when a task is
    defined) do not apply to caffe2ckpt's task runs: a failed epoch is not run again on the
    workspaces it changed (a flow retry resumes from a commit instead)."""
    (tmp_path / "retry.py").write_text(RETRY_SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(REPO), "PREFECT_API_URL": PREFECT_API_URL.value(),
           "PREFECT_TASKS_DEFAULT_RETRIES": "2"}
    out = subprocess.run([sys.executable, "retry.py", str(tmp_path / "ckpt")], cwd=tmp_path,
                         env=env, capture_output=True, text=True, timeout=180, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "calls 1" in out.stdout.splitlines(), (out.stdout, out.stderr[-3000:])
