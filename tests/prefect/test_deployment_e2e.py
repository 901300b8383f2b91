"""End to end, offline: a real `prefect server`, the repo's prefect.yaml deployed to a process
work pool, a worker, a flow run killed with SIGKILL mid-run, the crash-retry automation putting
the same flow run back, the deployment's schedule creating a run that completes, and assertions
over the REST API and the checkpoint files."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

import httpx
import numpy as np
import psutil
import pytest
import yaml

from caffe2ckpt import JobRunner, LocalSession, MultiNodeCheckpointManager
from caffe2ckpt.example import build_job
from caffe2ckpt.fs.location import Location
from caffe2ckpt.prefect import artifact_key
from caffe2ckpt.store.commit.protocol import CheckpointStore
from caffe2ckpt.store.format.records import list_records, read_record
from tests import prefectdb
from tests.procs import free_port, stop_tree, tree
from tests.stores import load, newest_epoch, records_at

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
# the kill comes at epoch 3 or a little after (polled every 0.1 s): on the 2-core machine of
# 2026-12-06 ten epochs took 0.3 s, and with 10 the first attempt finished before its kill
EPOCHS = 40
NIGHTLY_EPOCHS = 4  # the scheduled run's epochs_per_run (prefect.yaml's 10, made shorter)
# one client for the test's many polls (httpx.get makes a client, and a TLS context, per call)
HTTP = httpx.Client()


@pytest.fixture(scope="module", autouse=True)
def _close_http():
    """Close the module's client after its tests (its connection to the stopped server was
    otherwise left open: a ResourceWarning at the worker's exit in every CI log)."""
    yield
    HTTP.close()


def flow_processes(worker: subprocess.Popen) -> list[psutil.Process]:
    """The flow run processes (``python -m prefect.engine``) under ``worker`` still running."""
    running = []
    for proc in tree(worker.pid):
        try:
            if (proc.status() != psutil.STATUS_ZOMBIE
                    and "prefect.engine" in " ".join(proc.cmdline())):
                running.append(proc)
        except psutil.NoSuchProcess:
            pass
    return running


def wait_for(check, timeout: float, what: str, every: float = 0.5):
    """``check()``'s first true result, asked every ``every`` seconds. A request to the server
    that times out or is refused counts as "not yet": the SQLite-backed server stalls for
    seconds on a loaded machine."""
    deadline = time.monotonic() + timeout
    last_error = None
    while time.monotonic() < deadline:
        try:
            result = check()
        except httpx.TransportError as exc:
            result, last_error = None, exc
        if result:
            return result
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}"
                         + (f" (last request error: {last_error!r})" if last_error else ""))


@pytest.fixture
def server(tmp_path):
    """A real Prefect server on 127.0.0.1, stopped by PID at the end."""
    port = free_port()
    home = prefectdb.seed_home(tmp_path / "prefect-home")
    env = {**os.environ, "PREFECT_HOME": str(home),
           "PREFECT_API_URL": f"http://127.0.0.1:{port}/api", "PWD": str(REPO),
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "DO_NOT_TRACK": "1",
           "PREFECT_WORKER_QUERY_SECONDS": "1", "PREFECT_LOGGING_LEVEL": "INFO"}
    for key in ("PREFECT_SERVER_SERVICES_EVENT_PERSISTER_ENABLED",
                "PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_ENABLED"):
        env.pop(key, None)  # this tier runs the server with its default services
    log = open(tmp_path / "server.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "prefect", "server", "start", "--host",
                             "127.0.0.1", "--port", str(port), "--no-ui"], env=env, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    api = env["PREFECT_API_URL"]
    try:
        wait_for(lambda: _healthy(api), 120, "the Prefect server")
        yield api, env
    finally:
        stop_tree(proc)
        log.close()


def _healthy(api: str) -> bool:
    return HTTP.get(f"{api}/health", timeout=2).status_code == 200


def prefect(env, *args: str) -> str:
    out = subprocess.run([sys.executable, "-m", "prefect", *args], env=env, cwd=REPO,
                         capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, f"prefect {' '.join(args)} failed:\n{out.stdout}\n{out.stderr}"
    return out.stdout


def post(api: str, path: str, body: dict) -> list:
    response = HTTP.post(f"{api}{path}", json=body, timeout=30)
    response.raise_for_status()
    return response.json()


def scheduled_soon(tmp_path: Path, checkpoint_url: Path, seconds: float) -> tuple[Path, datetime]:
    """The repo's prefect.yaml with the nightly deployment's schedule moved to ``seconds`` from
    now (one run: the next one is a day later), :data:`NIGHTLY_EPOCHS` epochs per run and its
    checkpoints in ``checkpoint_url``."""
    config = yaml.safe_load((REPO / "prefect.yaml").read_text())
    nightly = next(d for d in config["deployments"] if d["name"] == "nightly")
    at = datetime.now(timezone.utc) + timedelta(seconds=seconds)
    nightly["schedules"] = [{"interval": 86400, "anchor_date": at.isoformat(), "timezone": "UTC"}]
    nightly["parameters"]["checkpoint_url"] = str(checkpoint_url)
    nightly["parameters"]["epochs_per_run"] = NIGHTLY_EPOCHS
    path = tmp_path / "prefect.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path, at


def scheduled_runs(api: str) -> list[dict]:
    """The runs the scheduler created, soonest first."""
    return post(api, "/flow_runs/filter", {"flow_runs": {"tags": {"all_": ["auto-scheduled"]}},
                                           "sort": "EXPECTED_START_TIME_ASC"})


def scheduled_run(api: str) -> dict | None:
    """The first run the scheduler created, once it completed (it must not fail or crash)."""
    run = scheduled_runs(api)[0]
    assert run["state_type"] not in ("FAILED", "CRASHED", "CANCELLED"), run["state"]
    return run if run["state_type"] == "COMPLETED" else None


def test_deploy_kill_and_automatic_retry(server, tmp_path):
    api, env = server
    ckpt = tmp_path / "ckpt"
    prefect(env, "work-pool", "create", "caffe2ckpt", "--type", "process")
    config, schedule_at = scheduled_soon(tmp_path, tmp_path / "scheduled", 25)
    prefect(env, "--no-prompt", "deploy", "--all", "--prefect-file", str(config))
    out = subprocess.run([sys.executable, "-m", "caffe2ckpt.prefect", "retry-crashed",
                          "regression/nightly"], env=env, cwd=REPO, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0 and "automation" in out.stdout, out.stderr
    # (with SQLAlchemy 2.1 the scheduler fails here, "Can't evaluate bulk DML statement")
    wait_for(lambda: scheduled_runs(api), 60, "the scheduler to create the run prefect.yaml's "
             "schedule asks for")
    worker_log = open(tmp_path / "worker.log", "wb")
    worker = subprocess.Popen([sys.executable, "-m", "prefect", "worker", "start", "--pool",
                               "caffe2ckpt", "--type", "process"], env=env, cwd=REPO,
                              stdout=worker_log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        # epochs_per_run: nightly's 10 -> EPOCHS, so the retried run must still stop at
        # EPOCHS, counted from where its first attempt started (not where the retry resumes)
        started = prefect(env, "deployment", "run", "regression/nightly", "--param",
                          f"checkpoint_url={ckpt}", "--param", f"epochs={EPOCHS}",
                          "--param", f"epochs_per_run={EPOCHS}")
        run_id = started.split("flow-run/")[1].split()[0].strip()
        location = Location(str(ckpt))

        def committed_epoch(minimum: int):
            refs = [r for r in list_records(location) if r.epoch >= minimum]
            return refs[-1] if refs else None

        ref = wait_for(lambda: committed_epoch(3), 120, "epoch 3 to be committed", every=0.1)
        victim = read_record(location, ref).writer["pid"]
        os.kill(victim, signal.SIGKILL)
        killed_after = committed_epoch(0).epoch  # no epoch after it commits: the process is gone
        assert killed_after < EPOCHS, f"the first attempt finished (epoch {killed_after}) first"

        def final_state():
            run = HTTP.get(f"{api}/flow_runs/{run_id}", timeout=30).json()
            return run if run["state_type"] == "COMPLETED" else None

        run = wait_for(final_state, 240, "the retried flow run to complete")
        scheduled = wait_for(lambda: scheduled_run(api), 240, "the scheduled run to complete")
        # a flow process sends its last batch of logs (every 2 s) as it exits, after its run is
        # Completed: stopping the worker stops it too, so let each end on its own first (a
        # retry that resumed at epoch 6 and completed 1 s later lost its "Resuming" line)
        wait_for(lambda: not flow_processes(worker), 60, "the flow run processes to exit")
    finally:
        stop_tree(worker)
        worker_log.close()

    # the schedule from prefect.yaml fired: a run the scheduler created, at the scheduled time
    assert "auto-scheduled" in scheduled["tags"]
    assert abs(datetime.fromisoformat(scheduled["expected_start_time"]) - schedule_at) < timedelta(seconds=1)
    sched_store = CheckpointStore(Location(str(tmp_path / "scheduled")))
    # a first night from scratch: the deployment's epochs_per_run epochs, of its epochs (100)
    assert newest_epoch(sched_store, ["trainer_0", "trainer_1"]) == NIGHTLY_EPOCHS

    assert run["run_count"] >= 2  # the same flow run, retried in a new process
    store = CheckpointStore(location)
    nodes = ["trainer_0", "trainer_1"]
    assert newest_epoch(store, nodes) == EPOCHS
    last = records_at(store, nodes, EPOCHS)
    assert last["trainer_0"].writer["flow_run_id"] == run_id
    assert last["trainer_0"].writer["run_count"] >= 2
    assert last["trainer_0"].writer["deployment_id"] == run["deployment_id"] is not None

    reference = LocalSession()
    JobRunner(build_job(EPOCHS), MultiNodeCheckpointManager(str(tmp_path / "ref"))).train(reference)
    for node in nodes:
        restored = load(store, node, EPOCHS)
        expected = reference.workspace(node)
        # outputs created after init_group ("loss", the limiter's stop flag) are not checkpointed
        assert {"model/w", "model/b", "reader/cursor"} <= restored.keys() <= expected.keys()
        for name, value in restored.items():
            assert value.tobytes() == expected[name].tobytes() and value.dtype == expected[name].dtype

    def run_logs() -> list:  # every log of the run: a page holds at most 200
        logs: list = []
        while page := post(api, "/logs/filter", {"logs": {"flow_run_id": {"any_": [run_id]}},
                                                "limit": 200, "offset": len(logs),
                                                "sort": "TIMESTAMP_ASC"}):
            logs += page
        return logs

    def resumed() -> list[str]:  # the retry logs where it resumed from and who wrote it
        return [log["message"] for log in run_logs()
                if "Resuming from epoch" in log["message"] and run_id in log["message"]]

    # the flow process may send its last log batch after the run is already Completed
    try:
        wait_for(resumed, 60, "the retry's 'Resuming from epoch ... <flow run id>' log line")
    except AssertionError as exc:  # say whether the flow process logged it and what went wrong
        raise AssertionError(f"{exc}\n{_log_evidence(tmp_path)}") from None
    def task_runs(name_filter: dict) -> set[str]:  # a run has more task runs than one page
        found = post(api, "/task_runs/filter", {"flow_runs": {"id": {"any_": [run_id]}},
                                                "task_runs": {"name": name_filter}})
        return {t["name"] for t in found}

    final = {f"epoch_group[trainer_0] e{EPOCHS}", f"checkpoint_save[trainer_1] e{EPOCHS}"}
    # the server records task runs asynchronously: the last ones may land after the flow run
    wait_for(lambda: task_runs({"any_": sorted(final)}) == final, 60, f"task runs {final}")
    assert task_runs({"like_": "checkpoint_load[trainer_0]"})
    artifacts = post(api, "/artifacts/filter", {"artifacts": {"flow_run_id": {"any_": [run_id]}}})
    keys = {what: artifact_key("regression", what, location.canonical_url)
            for what in ("checkpoints", "progress", "summary")}
    keyed = {a["key"]: a for a in artifacts if a["key"]}
    assert sorted(keyed) == sorted(keys.values())
    table = json.loads(keyed[keys["checkpoints"]]["data"])
    assert [row["epoch"] for row in table] == list(range(EPOCHS, -1, -1))  # newest first
    assert np.all([row["status"] == "committed" for row in table])
    # the summary says why attempt 2 ran: attempt 1 crashed, the automation put it back
    summary = keyed[keys["summary"]]["data"]
    assert "a retry after the run ended **Crashed**" in summary, summary
    assert "put back by: caffe2ckpt: retrying a crashed run" in summary, summary


def _log_evidence(tmp_path: Path) -> str:
    """The worker's and the server's lines that tell a lost log batch from a line never
    logged: the flow processes' console output reaches the worker's log."""
    wanted = ("Resuming from epoch", "Error logging to API", "ERROR", "locked", "Traceback")
    parts = []
    for name in ("worker.log", "server.log"):
        lines = (tmp_path / name).read_text(errors="replace").splitlines()
        parts.append(f"--- {name} ({len(lines)} lines), matching {wanted}:")
        parts += [line for line in lines if any(w in line for w in wanted)][-40:]
    return "\n".join(parts)
