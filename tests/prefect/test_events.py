"""Checkpoint events reach a real Prefect server: each event its server streams out (what the
Event Feed shows and automations trigger on), with its resource, payload and related run."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
from fsspec.implementations.local import LocalFileSystem
from prefect import flow
from prefect.client.orchestration import get_client
from prefect.runtime import flow_run
from prefect.settings import PREFECT_API_URL

from caffe2ckpt import MultiNodeCheckpointManager, StepCheckpointManager, StepManagerOptions
from caffe2ckpt.errors import CheckpointCorruptedError, CheckpointWriteError
from caffe2ckpt.example import build_job
from caffe2ckpt.fs.location import Location
from caffe2ckpt.metadata import ZarrMetadataHandler
from caffe2ckpt.prefect import PrefectSession, run_job
from caffe2ckpt.prefect.events import resource_id
from tests.cli.test_cli import flip_chunk
from tests.faultfs import FaultyFileSystem
from tests.prefect.eventfeed import event_feed

COMMITTED, FAILED, RESUMED = ("caffe2ckpt.epoch.committed", "caffe2ckpt.save.failed",
                              "caffe2ckpt.run.resumed")
DAMAGED, GC = "caffe2ckpt.checkpoint.damaged", "caffe2ckpt.gc.finished"


def related(event, role: str) -> list[str]:
    return [r.id for r in event.related if r.role == role]


def test_a_retried_job_run_sends_its_commits_and_its_resume(tmp_path):
    url = str(tmp_path / "ckpt")
    attempts: list[int] = []  # the run_count each attempt saw

    @flow(name="evented", retries=1, retry_delay_seconds=0)
    def evented() -> None:
        job = build_job(4, fail_at_epoch=None if attempts else 3)  # the first attempt fails
        attempts.append(flow_run.run_count)
        cm = MultiNodeCheckpointManager(url, metadata_handler=ZarrMetadataHandler())
        run_job(job, cm, session=PrefectSession(artifacts=False),
                options=StepManagerOptions(max_to_keep=10))  # retention counts what is kept

    with event_feed() as feed:
        state = evented(return_state=True)
        run_id = str(state.state_details.flow_run_id)
        assert state.is_completed(), (attempts, _state_history(run_id))
        assert attempts == [1, 2], (attempts, _state_history(run_id))
        committed = feed.wait_for(COMMITTED, lambda es: len(es) >= 5)
        resumed = feed.wait_for(RESUMED)
    assert [e.payload["epoch"] for e in committed] == [0, 1, 2, 3, 4]
    # each commit names the one before it (Prefect's triggers then take them in that order),
    # across the retry too (the same process)
    assert [e.follows for e in committed] == [None, *(e.id for e in committed[:-1])]
    first = committed[0]
    assert first.resource.id == resource_id(Location(url).canonical_url)
    assert first.resource.id == "caffe2ckpt.checkpoint.file://" + url
    assert first.resource.get("caffe2ckpt.job") == "regression"
    # the Event Feed tells prefixes apart, and one prefix's jobs
    assert first.resource.get("prefect.resource.name") == "regression @ file://" + url
    assert related(first, "flow-run") == [f"prefect.flow-run.{run_id}"]
    assert related(first, "flow") and not related(first, "deployment")
    payload = committed[-1].payload
    assert payload["job"] == "regression" and payload["nodes"] == ["trainer_0", "trainer_1"]
    assert payload["kind"] == "whole" and payload["bytes"] == payload["bytes_written"] > 0
    assert payload["seconds"] > 0 and payload["kept"] == 5 and set(payload["metrics"]) == {"loss"}
    # attempt 2 of the same flow run resumed from epoch 2, the newest committed one
    assert [(e.payload["epoch"], e.payload["reason"]) for e in resumed] == [(2, "retry")]
    assert resumed[0].payload["saved_by"] == resumed[0].payload["nodes"] == 2
    assert related(resumed[0], "flow-run") == [f"prefect.flow-run.{run_id}"]


def _state_history(flow_run_id: str) -> list[tuple[str, str | None, str]]:
    """The flow run's states as the server recorded them (what a failure of the test shows)."""
    with get_client(sync_client=True) as client:
        return [(s.name, s.message, s.timestamp.isoformat())
                for s in client.read_flow_run_states(flow_run_id)]


def _big(value: float) -> dict[str, dict[str, np.ndarray]]:
    return {"a": {"w": np.full(50_000, value)}}


def test_failures_damage_and_gc_are_sent_from_flows_and_the_command_line(tmp_path):
    url = str(tmp_path / "steps")
    faulty = FaultyFileSystem(LocalFileSystem(auto_mkdir=True))

    @flow(name="step-events")
    def step_events() -> None:
        with StepCheckpointManager(url, filesystem=faulty, handle_preemption=False) as mgr:
            for step in range(3):
                mgr.save(step, _big(step))
            faulty.arm("write", 1, sticky=True)
            with pytest.raises(CheckpointWriteError):
                mgr.save(3, _big(3))
            faulty.reset()
        flip_chunk(url, "a", 2, "_packed")
        with StepCheckpointManager(url, handle_preemption=False) as mgr:
            with pytest.raises(CheckpointCorruptedError):
                mgr.restore(2)
            assert mgr.restore(1)["a"]["w"][0] == 1.0

    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value()}
    with event_feed() as feed:
        step_events()
        failed = feed.wait_for(FAILED)
        damaged = feed.wait_for(DAMAGED)
        resumed = feed.wait_for(RESUMED)
        cli = [sys.executable, "-m", "caffe2ckpt.cli"]
        out = subprocess.run([*cli, "verify", url], env=env, capture_output=True, text=True,
                             check=False)
        assert out.returncode == 1 and out.stderr == "", out.stderr
        verified = feed.wait_for(DAMAGED, lambda es: len(es) >= 2)
        clean = str(tmp_path / "clean")
        with StepCheckpointManager(clean, handle_preemption=False) as mgr:
            for step in range(3):
                mgr.save(step, _big(step))
        out = subprocess.run([*cli, "gc", clean, "--keep-last", "1", "--yes"], env=env,
                             capture_output=True, text=True, check=False)
        assert out.returncode == 0 and out.stderr == "", out.stderr
        gc = feed.wait_for(GC)
    assert [(e.payload["epoch"], e.payload["error"]) for e in failed] == [
        (3, "CheckpointWriteError")]
    assert "injected" in failed[0].payload["message"]
    assert [(e.payload["epoch"], e.payload["node"], e.payload["blob"], e.payload["found_by"])
            for e in damaged] == [(2, "a", "w", "restore")]  # the user's blob, packed or not
    assert [(e.payload["epoch"], e.payload["reason"]) for e in resumed] == [(1, "going back")]
    by_verify = [e for e in verified if e.payload["found_by"] == "verify"]
    assert [(e.payload["epoch"], e.payload["node"], e.payload["blob"]) for e in by_verify] == [
        (2, "a", "w")]
    assert not by_verify[0].related  # a command-line run: no flow run to relate it to
    assert gc[0].payload["deleted"] == [0, 1] and gc[0].payload["kept"] == [2]
    assert gc[0].payload["bytes_freed"] > 0
    assert failed[0].resource.id == "caffe2ckpt.checkpoint.faulty://" + url  # its filesystem
    assert all(e.resource.id == "caffe2ckpt.checkpoint.file://" + url
               for e in (*damaged, *verified))
    assert gc[0].resource.id == "caffe2ckpt.checkpoint.file://" + clean


def test_nothing_is_sent_and_no_server_started_without_a_prefect_api(tmp_path):
    script = f"""
import sys
import numpy as np
import caffe2ckpt.prefect
from caffe2ckpt import StepCheckpointManager, events
built = []
original = events.committed_payload
events.committed_payload = lambda *a, **k: built.append(1) or original(*a, **k)
with StepCheckpointManager({str(tmp_path / 'plain')!r}, handle_preemption=False) as mgr:
    mgr.save(0, {{"a": {{"w": np.zeros(3)}}}})
# a temporary server is a SubprocessASGIServer: its module is not even imported (importing it
# here to look would cost ~4 s of CPU)
server = sys.modules.get("prefect.server.api.server")
assert not built and server is None, (built, server and server.SubprocessASGIServer._instances)
print("quiet")
"""
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                         text=True, timeout=120, check=False)
    assert out.returncode == 0 and out.stdout.strip() == "quiet", out.stderr


def test_an_event_sent_outside_any_run_names_no_run_after_a_flow_ran(tmp_path):
    """Prefect's events worker, started inside a flow run, related every later event to that
    run, also one sent after the run ended, from outside any run: an alert named that run and
    ``fail_flow_run`` would have failed it. A fresh process, so the worker starts in the flow."""
    script = f"""
import numpy as np
from prefect import flow
import caffe2ckpt.prefect
from caffe2ckpt import StepCheckpointManager

def save(url, step):
    with StepCheckpointManager(url, handle_preemption=False) as mgr:
        mgr.save(step, {{"a": {{"w": np.zeros(3)}}}})

flow(name="first-events")(save)({str(tmp_path / 'inside')!r}, 0)
save({str(tmp_path / 'outside')!r}, 1)
from caffe2ckpt.prefect.events import PrefectPublisher
PrefectPublisher().flush()
"""
    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value()}
    with event_feed() as feed:
        subprocess.run([sys.executable, "-c", script], env=env, check=True, timeout=120)
        committed = feed.wait_for(COMMITTED, lambda es: len(es) >= 2)
    by_prefix = {e.resource["caffe2ckpt.url"].rpartition("/")[2]: e for e in committed}
    assert related(by_prefix["inside"], "flow-run")
    assert related(by_prefix["outside"], "flow-run") == []
