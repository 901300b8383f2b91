"""PrefectSession inside real flows: Caffe2 behaviours, task run names, retries, artifacts."""

from __future__ import annotations

import base64
import json
import math
import os
import re
import xml.etree.ElementTree as ET
from typing import Any
from uuid import UUID

import numpy as np
import pytest
from prefect import flow
from prefect.client.schemas.filters import (
    ArtifactFilter,
    ArtifactFilterFlowRunId,
    LogFilter,
    LogFilterFlowRunId,
)
from prefect.runtime import flow_run
from prefect.settings import PREFECT_UI_URL

from caffe2ckpt import Job, JobRunner, LocalSession, MultiNodeCheckpointManager, Node, Task
from caffe2ckpt.example import build_job
from caffe2ckpt.fs.location import Location
from caffe2ckpt.job import epoch_limiter
from caffe2ckpt.metadata import ZarrMetadataHandler
from caffe2ckpt.prefect import AttemptLimitExceeded, PrefectSession, artifact_key, run_job
from caffe2ckpt.prefect.table import (
    checkpoint_row,
    checkpoint_table,
    format_metric,
    run_link,
    writer_cell,
)
from caffe2ckpt.store.commit.protocol import CheckpointStore
from caffe2ckpt.store.format.records import CommitRecord
from caffe2ckpt.units import epochs_text
from tests.jobs import EXPECTED_TOTALS, Counter, fetch, make_job
from tests.prefect.conftest import finished_task_runs, poll
from tests.stores import records_at

# The Prefect layer does not depend on the filesystem (tests/test_*.py cover memory, local, S3).
ON_LOCAL_DISK = pytest.mark.parametrize("prefix", ["local"], indirect=True)


def task_run_names(client, flow_run_id: str, expected: int) -> list[str]:
    return sorted(r.name for r in finished_task_runs(client, flow_run_id, expected))


def snapshot(session, nodes) -> dict:
    return {n: {k: (v.dtype.str, v.shape, v.tobytes()) for k, v in session.workspace(n).items()}
            for n in nodes}


@ON_LOCAL_DISK
def test_caffe2_job_through_prefect_with_named_task_runs(prefix, client):
    counter = Counter()
    job, (total,) = make_job(counter=counter)
    session = PrefectSession()

    @flow(name="pipeline")
    def pipeline(resume_from: int | None = None) -> tuple[int, str]:
        cm = MultiNodeCheckpointManager(prefix)
        return JobRunner(job, cm, resume_from_epoch=resume_from).train(session), flow_run.id

    final, run_id = pipeline()
    assert final == 4 and fetch(session, "trainer_0", total) == 145
    writer = records_at(CheckpointStore(Location(prefix)), ["trainer_0"], 4)["trainer_0"].writer
    assert (writer["session"], writer["flow_run_id"], writer["flow_name"], writer["run_count"],
            writer["deployment_id"]) == ("prefect", run_id, "pipeline", 1, None), writer
    expected = (["init_group[trainer_0] e0", "checkpoint_init[trainer_0] e0"]
                + [f"checkpoint_save[trainer_0] e{e}" for e in range(5)]
                + [f"epoch_group[trainer_0] e{e}" for e in range(1, 5)]
                + [f"epoch {e}" for e in range(5)])  # each epoch's parent task run
    names = task_run_names(client, run_id, len(expected))
    assert sorted(expected) == [n for n in names if n in expected] and len(names) == len(expected)

    for epoch in (1, 2, 3, 4):
        session = PrefectSession()
        final, _ = pipeline(resume_from=epoch)
        assert final == 4 and fetch(session, "trainer_0", total) == 145
    assert counter.init_calls == 1


def test_epochs_send_no_request_to_read_their_flow_run(tmp_path, monkeypatch):
    """Each epoch's writer information (flow run, attempt, deployment) comes from the flow run's
    context: ``prefect.runtime.deployment.id`` read in a run of no deployment asked the API for
    the run, with a new client, at every epoch (20 epochs: 23 requests, a third of the flow's
    CPU). What is left is one request per run (the sweep for orphaned runs)."""
    import prefect.runtime.deployment
    import prefect.runtime.flow_run

    requests = []
    read = prefect.runtime.flow_run._get_flow_run

    async def counted(run_id):
        requests.append(run_id)
        return await read(run_id)

    for module in (prefect.runtime.deployment, prefect.runtime.flow_run):
        monkeypatch.setattr(module, "_get_flow_run", counted)
    cm = MultiNodeCheckpointManager(str(tmp_path / "ckpt"))
    flow(name="no-reads")(lambda: run_job(build_job(6), cm, session=PrefectSession()))()
    assert len(requests) <= 1, requests


@ON_LOCAL_DISK
def test_multi_node_partial_load_through_prefect(prefix):
    for node_id in range(3):
        job, _ = make_job(node_ids=(node_id,))
        flow(name="one-node")(lambda: JobRunner(job, MultiNodeCheckpointManager(prefix))
                              .train(PrefectSession()))()
    job, _ = make_job(node_ids=(0, 1, 2))
    session = PrefectSession()

    @flow(name="partial-load")
    def partial(epoch: int) -> bool:
        runner = JobRunner(job, MultiNodeCheckpointManager(prefix))
        return runner.load_blobs_from_checkpoints(["trainer_1/total", "trainer_2/total"],
                                                  epoch, session)

    for epoch in (1, 2, 3, 4):
        assert partial(epoch) is True
        assert fetch(session, "trainer_2", "trainer_2/total") == EXPECTED_TOTALS[epoch - 1]
    assert partial(5) is False


def test_retry_resumes_from_last_committed_epoch_bit_identical(tmp_path, client):
    url = str(tmp_path / "ckpt")
    session = PrefectSession()
    init_calls = []

    @flow(name="retrying", retries=1, retry_delay_seconds=0)
    def retrying() -> tuple[int, str]:
        job = build_job(5, fail_at_epoch=3 if flow_run.run_count == 1 else None)
        init = job.init_group.tasks[0].fn
        job.init_group.tasks[0].fn = lambda ws: (init_calls.append(1), init(ws))
        cm = MultiNodeCheckpointManager(url, metadata_handler=ZarrMetadataHandler())
        return run_job(job, cm, session=session), flow_run.id

    final, run_id = retrying()
    assert final == 5 and init_calls == [1]
    run = client.read_flow_run(UUID(run_id))
    assert run.state.is_completed() and run.run_count == 2

    reference = LocalSession()
    JobRunner(build_job(5), MultiNodeCheckpointManager(str(tmp_path / "ref"))).train(reference)
    nodes = ["trainer_0", "trainer_1"]
    assert snapshot(session, nodes) == snapshot(reference, nodes)

    logs = poll(lambda: client.read_logs(log_filter=LogFilter(
        flow_run_id=LogFilterFlowRunId(any_=[UUID(run_id)]))),
        lambda ls: any("Resuming from epoch" in log.message for log in ls))
    resumed = [log.message for log in logs if "Resuming from epoch" in log.message]
    assert len(resumed) == 1 and "Resuming from epoch 2" in resumed[0]
    assert f" (written by flow run {run.name} ({run_id}) attempt 1 on host " in resumed[0]

    artifacts = client.read_artifacts(artifact_filter=ArtifactFilter(
        flow_run_id=ArtifactFilterFlowRunId(any_=[UUID(run_id)])))
    by_key: dict[str, list] = {}
    for artifact in artifacts:
        if artifact.key is not None:  # key-less ones are Prefect's own (persisted results)
            by_key.setdefault(artifact.key, []).append(artifact)
    keys = {key_of("regression", k, url) for k in ("checkpoints", "progress", "summary")}
    assert set(by_key) == keys and all(len(v) == 1 for v in by_key.values())
    rows = json.loads(by_key[key_of("regression", "checkpoints", url)][0].data)[::-1]
    assert [r["epoch"] for r in rows] == [0, 1, 2, 3, 4, 5]
    assert all(r["status"] == "committed" and r["nodes"] == "trainer_0, trainer_1" for r in rows)
    # a retry is the same flow run: its first attempt's epochs are this run's too
    assert [r["written by"] for r in rows] == ["this run, attempt 1"] * 3 + ["this run, attempt 2"] * 3
    assert [r["path"] for r in rows] == [f"trainer_0.{e}, trainer_1.{e}" for e in range(6)]
    progress = by_key[key_of("regression", "progress", url)][0]
    assert progress.data == 100.0 and progress.description == "Job 'regression': Epoch 5 of 5 (finished)"
    summary = by_key[key_of("regression", "summary", url)][0].data
    # why attempt 2 ran: Prefect's retry after the first attempt failed in epoch 3
    assert ("- **Attempt 2** of this flow run, a retry: attempt 1 **failed** (Flow run "
            "encountered an exception: InjectedFailure: injected failure on trainer_0 in epoch 3)"
            " and Prefect retried the flow run\n" in summary), summary
    assert "Resumed** from epoch 2, written by this run, attempt 1\n" in summary
    assert "Finished at epoch **5**" in summary
    assert "- this run, attempt 1: epochs 0-2\n- this run, attempt 2: epochs 3-5" in summary
    # its chart marks both: attempt 1 failed in epoch 3, attempt 2 resumed from epoch 2
    svg = base64.b64decode(summary.partition("base64,")[2].partition(")")[0]).decode()
    lines = ET.fromstring(svg).iter("{http://www.w3.org/2000/svg}line")
    marked = {(ln.get("class"), ln.get("data-epoch")) for ln in lines if ln.get("data-epoch")}
    assert marked == {("marker resumed", "2"), ("marker failed", "3")}, marked


def test_a_create_sent_twice_leaves_one_artifact_per_key(tmp_path, client, monkeypatch):
    """Prefect's client sends a create again when its answer is lost (a slow server under
    load): the run keeps one table artifact, the oldest, and updates that one."""
    from caffe2ckpt.prefect import artifacts as module

    real = module.create_table_artifact

    def twice(*args, **kwargs):
        real(*args, **kwargs)
        return real(*args, **kwargs)
    monkeypatch.setattr(module, "create_table_artifact", twice)
    url = str(tmp_path / "ckpt")

    @flow(name="duplicated")
    def duplicated() -> str:
        JobRunner(build_job(2), MultiNodeCheckpointManager(url)).train(PrefectSession())
        return flow_run.id

    run_id = duplicated()
    rows = read_table(client, run_id, key_of("regression", "checkpoints", url))
    assert [r["epoch"] for r in rows] == [0, 1, 2]


@pytest.mark.parametrize(("name", "shown"), [
    ("crimson-otter", "crimson-otter"),
    ("evil|name](javascript:alert(1))", "evil\\|name\\](javascript:alert(1))"),
])
def test_a_resuming_flow_run_shows_which_run_wrote_each_epoch(tmp_path, client, name, shown):
    url = str(tmp_path / "ckpt")

    @flow(name="resumable")
    def resumable(epochs: int) -> tuple[str, str]:
        JobRunner(build_job(epochs), MultiNodeCheckpointManager(url)).train(PrefectSession())
        return flow_run.id, flow_run.name

    first, first_name = resumable.with_options(flow_run_name=name)(3)  # epochs 0-3
    second, _ = resumable.with_options(flow_run_name="second-run")(5)  # resumes at 3: 4, 5
    assert first_name == name

    key = key_of("regression", "checkpoints", url)
    rows = read_table(client, first, key)
    assert [r["written by"] for r in rows] == ["this run, attempt 1"] * 4
    rows = read_table(client, second, key)
    assert [r["epoch"] for r in rows] == [0, 1, 2, 3, 4, 5]
    assert [r["written by"] for r in rows] == (
        [f"{shown} ({first[:8]}), attempt 1"] * 4 + ["this run, attempt 1"] * 2)

    summaries = client.read_artifacts(artifact_filter=ArtifactFilter(
        flow_run_id=ArtifactFilterFlowRunId(any_=[UUID(second)])))
    summary = next(a.data for a in summaries if a.key == key_of("regression", "summary", url))
    link = f"[{shown} ({first[:8]})]({PREFECT_UI_URL.value()}/runs/flow-run/{first})"
    assert f"- **Resumed** from epoch 3, written by {link}, attempt 1\n" in summary
    assert (f"- This run: [second-run ({second[:8]})]({PREFECT_UI_URL.value()}/runs/flow-run/"
            f"{second}), attempt 1\n") in summary
    assert f"- {link}, attempt 1: epochs 0-3\n- this run, attempt 1: epochs 4-5" in summary


def test_attempt_cap_fails_the_run_before_training(tmp_path):
    url = str(tmp_path / "ckpt")

    @flow(name="capped", retries=1, retry_delay_seconds=0)
    def capped() -> int:
        job = build_job(4, fail_at_epoch=2)
        cm = MultiNodeCheckpointManager(url, metadata_handler=ZarrMetadataHandler())
        return run_job(job, cm, max_attempts=1)

    with pytest.raises(AttemptLimitExceeded, match="max_attempts=1"):
        capped()


# -- metrics in the checkpoint table -------------------------------------------------------------

def record(epoch: int, node: str, metrics: dict[str, float], *, nbytes: int = 1000,
           writer: Any = None) -> CommitRecord:
    return CommitRecord(epoch=epoch, node=node, save_id="s", nodes=["trainer_0", "trainer_1"],
                        nbytes=nbytes, blob_count=1, seconds=0.5, metrics=metrics,
                        writer={"run_count": 1} if writer is None else writer)


def test_checkpoint_table_has_a_compact_column_per_metric():
    nan = float("nan")
    both = {"loss": 0.123456789, "acc": nan, "epoch": 3.0}
    rows = [
        checkpoint_row(0, {n: record(0, n, {}) for n in ("trainer_0", "trainer_1")}),
        checkpoint_row(1, {n: record(1, n, both) for n in ("trainer_0", "trainer_1")}),
        checkpoint_row(2, {"trainer_0": record(2, "trainer_0", {"loss": 12345678.0}),
                           "trainer_1": record(2, "trainer_1", {"loss": -math.inf})}),
        {"epoch": 3, "status": "FAILED: OSError: disk full", "nodes": "", "bytes": "",
         "seconds": "", "MB/s": "", "written by": "", "path": "", "metrics": {}},
    ]
    table = checkpoint_table(rows)
    # metric columns right after "status", in first-seen order; a name taken by a column is prefixed
    assert list(table[0]) == ["epoch", "status", "loss", "acc", "metric epoch", "nodes", "bytes",
                              "written", "seconds", "MB/s", "written by", "path"]
    assert all(list(row) == list(table[0]) for row in table)
    assert [(r["loss"], r["acc"], r["metric epoch"]) for r in table] == [
        ("", "", ""), ("0.1235", "NaN", "3"),
        ("trainer_0: 1.235e+07, trainer_1: -inf", "", ""), ("", "", "")]
    assert table[1]["epoch"] == 1 and table[1]["MB/s"] == 0.0 and table[3]["status"].startswith("FAILED")
    assert table[2]["path"] == "trainer_0.2, trainer_1.2"
    json.loads(json.dumps(table), parse_constant=pytest.fail)  # strict JSON: NaN is a string
    assert [format_metric(v) for v in (1e-7, 2.0, math.inf, nan)] == ["1e-07", "2", "inf", "NaN"]


@pytest.mark.parametrize(("nbytes", "text"), [
    (0, "0 B"), (500, "1000 B"), (1024, "2.0 KiB"), (6_448_742, "12.3 MiB"),
    (3 * 2**40, "6.0 TiB")])
def test_checkpoint_table_bytes_are_human_readable(nbytes, text):
    """Two nodes of ``nbytes`` each."""
    row = checkpoint_row(7, {n: record(7, n, {}, nbytes=nbytes) for n in ("trainer_0", "trainer_1")})
    assert checkpoint_table([row])[0]["bytes"] == text
    assert checkpoint_table([row])[0]["written"] == text  # a whole save writes all of it


THIS_RUN = "5f1c7a9e-0000-4000-8000-00000000abcd"
OTHER_RUN = "1a2b3c4d-1111-4111-8111-111111111111"


@pytest.mark.parametrize(("writer", "cell"), [
    ({"flow_run_id": THIS_RUN, "flow_run_name": "lively-panda", "run_count": 2},
     "this run, attempt 2"),
    ({"flow_run_id": THIS_RUN.upper(), "run_count": 1}, "this run, attempt 1"),
    ({"flow_run_id": OTHER_RUN, "flow_run_name": "crimson-otter", "run_count": 1},
     "crimson-otter (1a2b3c4d), attempt 1"),
    ({"flow_run_id": OTHER_RUN, "run_count": 3}, "flow run 1a2b3c4d, attempt 3"),  # older record
    ({"session": "local", "host": "box", "pid": 3}, "no flow run (local session on box)"),
    ({}, "no flow run (unknown writer)"),
    ("not a dict", "no flow run (unknown writer)"),
    # hostile records: untrusted text, escaped for the UI that renders cells as markdown
    ({"flow_run_id": OTHER_RUN, "flow_run_name": "evil|name](javascript:alert(1))",
      "run_count": "1|2"},
     "evil\\|name\\](javascript:alert(1)) (1a2b3c4d), attempt 1\\|2"),
    ({"flow_run_id": OTHER_RUN, "flow_run_name": "<img src=x onerror=alert(1)>\n# big *x*"},
     "\\<img src=x onerror=alert(1)\\> \\# big \\*x\\* (1a2b3c4d)"),
    ({"flow_run_id": "](javascript:x)|", "flow_run_name": ["a", "b"], "run_count": {"n": 1}},
     "\\['a', 'b'\\] (\\](javascrip…), attempt {'n': 1}"),
    ({"flow_run_id": 7, "flow_run_name": "a\u202eb\x00c" + "x" * 100},
     "a b c" + "x" * 54 + "… (7)"),
])
def test_written_by_names_the_run_that_wrote_the_epoch(writer, cell):
    row = checkpoint_row(3, {"trainer_0": record(3, "trainer_0", {}, writer=writer)}, THIS_RUN)
    assert checkpoint_table([row])[0]["written by"] == cell


def test_only_valid_flow_run_ids_become_links():
    ui = PREFECT_UI_URL.value()
    assert ui and ui.startswith("http")  # the test harness's server
    hostile = {"flow_run_id": OTHER_RUN, "flow_run_name": "x](javascript:alert(1))[y"}
    assert run_link(hostile) == (f"[x\\](javascript:alert(1))\\[y (1a2b3c4d)]"
                                 f"({ui}/runs/flow-run/{OTHER_RUN})")
    assert run_link({"flow_run_id": "javascript:alert(1)"}) == "flow run javascript:…"
    assert run_link({"flow_run_id": f"{OTHER_RUN})](javascript:x"}) == "flow run 1a2b3c4d-11…"
    assert writer_cell({"flow_run_id": OTHER_RUN, "run_count": "2]"}, THIS_RUN, link=True) == (
        f"[flow run 1a2b3c4d]({ui}/runs/flow-run/{OTHER_RUN}), attempt 2\\]")
    assert epochs_text([7, 0, 1, 2, 3, 5, 8, 2]) == "0-3, 5, 7-8"


def metrics_job(epochs: int) -> Job:
    """Two nodes; after epoch e: "loss" = 1/e (NaN in epoch 2) and "lr" = 0.1 (trainer_0)."""
    with Job(name="metrics job") as job:
        for node in ("trainer_0", "trainer_1"):
            with Node(node):
                with job.init_group:
                    Task(lambda ws: ws.update(e=np.int64(0)), name="init")

                def step(ws):
                    ws["e"] = ws["e"] + 1
                    ws["loss"] = np.float64("nan" if int(ws["e"]) == 2 else 1 / int(ws["e"]))
                    ws["lr"] = np.float32(0.1)
                task = Task(step, name="step", outputs=["loss", "lr"])
                if node == "trainer_0":
                    job.add_metric("loss", task.outputs()[0])
                    job.add_metric("lr", task.outputs()[1])
        epoch_limiter(job, epochs)
    return job


def key_of(job: str, what: str, url: str) -> str:
    return artifact_key(job, what, Location(url).canonical_url)


def read_table(client, run_id: str, key: str) -> list[dict]:
    """The checkpoint table artifact ``key`` of the flow run, oldest epoch first."""
    artifacts = client.read_artifacts(artifact_filter=ArtifactFilter(
        flow_run_id=ArtifactFilterFlowRunId(any_=[UUID(run_id)])))
    found = [a for a in artifacts if a.key == key]
    assert len(found) == 1, [a.key for a in artifacts]
    rows = json.loads(found[0].data)
    assert [r["epoch"] for r in rows] == sorted((r["epoch"] for r in rows), reverse=True)
    return rows[::-1]  # the table is newest first


@ON_LOCAL_DISK
def test_checkpoint_table_artifact_shows_the_metrics_of_each_save(prefix, client):
    @flow(name="with-metrics")
    def with_metrics() -> str:
        # a long interval: every save after the first is deferred, "finished" uploads them
        session = PrefectSession(artifacts_interval=3600)
        JobRunner(metrics_job(3), MultiNodeCheckpointManager(prefix)).train(session)
        return flow_run.id

    rows = read_table(client, with_metrics(), key_of("metrics job", "checkpoints", prefix))
    assert [r["epoch"] for r in rows] == [0, 1, 2, 3]
    assert [(r["loss"], r["lr"]) for r in rows] == [
        ("", ""), ("1", "0.1"), ("NaN", "0.1"), ("0.3333", "0.1")]
    assert all(r["status"] == "committed" for r in rows)


def test_throttled_artifacts_reach_the_server_when_the_flow_fails(tmp_path, client):
    url = str(tmp_path / "ckpt")

    @flow(name="failing")
    def failing() -> None:
        job = build_job(6, fail_at_epoch=4)
        cm = MultiNodeCheckpointManager(url, metadata_handler=ZarrMetadataHandler())
        JobRunner(job, cm).train(PrefectSession(artifacts_interval=3600))

    state = failing(return_state=True)
    assert state.is_failed()
    # no "finished" event and a long interval: the failing task run uploads epochs 1-3
    rows = read_table(client, str(state.state_details.flow_run_id),
                      key_of("regression", "checkpoints", url))
    assert [r["epoch"] for r in rows] == [0, 1, 2, 3]
    assert [r["loss"] != "" for r in rows] == [False, True, True, True]


def test_throttled_table_is_uploaded_while_the_next_epoch_runs(tmp_path, client):
    seen: list[list[int]] = []

    @flow(name="slow-last-epoch")
    def slow_last_epoch() -> None:
        run_id, url = flow_run.id, str(tmp_path / "ckpt")

        def step(ws):  # epochs 1-3 take no time; epoch 4 waits for the timer's upload
            ws["e"] = ws["e"] + 1
            if int(ws["e"]) == 4:
                rows = poll(lambda: read_table(client, run_id, key_of("slow", "checkpoints", url)),
                            lambda rs: len(rs) == 4, timeout=15)
                seen.append([r["epoch"] for r in rows])

        with Job(name="slow") as job:
            with Node("trainer_0"):
                with job.init_group:
                    Task(lambda ws: ws.update(e=np.int64(0)), name="init")
                Task(step, name="step")
            epoch_limiter(job, 4)
        JobRunner(job, MultiNodeCheckpointManager(url)).train(PrefectSession(artifacts_interval=1.0))

    slow_last_epoch()
    assert seen == [[0, 1, 2, 3]]


@pytest.mark.parametrize("user_handler", [False, True])
@pytest.mark.parametrize("first", ["prefect.flows", "caffe2ckpt.prefect"])
def test_caffe2ckpt_logs_reach_prefect_whichever_is_imported_first(first, user_handler):
    """The flow run log shipper is among the handlers Prefect gives its extra loggers when it
    sets up logging; caffe2ckpt's logger reaches it too when prefect came first (a flow file
    that imports prefect before caffe2ckpt.prefect: its "Resuming from epoch" lines were
    missing from the flow run logs), and logging outside a run then warns about nothing (the
    suite turns warnings into errors). A handler the user gave the logger first changes
    nothing of that."""
    import subprocess
    import sys

    code = ("import importlib, logging; "
            + ("logging.getLogger('caffe2ckpt').addHandler(logging.NullHandler()); "
               if user_handler else "")
            + f"importlib.import_module({first!r}); "
            "import caffe2ckpt.prefect; "
            "from prefect.logging.handlers import APILogHandler; "
            "ours = logging.getLogger('caffe2ckpt'); "
            "assert any(isinstance(getattr(h, 'target', h), APILogHandler) "
            "for h in ours.handlers), ours.handlers; "
            "assert ours.getEffectiveLevel() <= logging.INFO, ours.getEffectiveLevel(); "
            "logging.getLogger('caffe2ckpt.runner').warning('outside any run')")
    env = {k: v for k, v in os.environ.items()
           if k not in ("PREFECT_LOGGING_EXTRA_LOGGERS", "PREFECT_LOGGING_TO_API_WHEN_MISSING_FLOW")}
    result = subprocess.run([sys.executable, "-W", "error", "-c", code], capture_output=True,
                            text=True, timeout=120, env=env)
    assert result.returncode == 0, result.stderr[-2000:]


def test_artifact_keys_tell_checkpoint_folders_apart(tmp_path, monkeypatch):
    """Runs of one job that write to two folders get artifacts of their own; every spelling of
    one folder (relative, with a trailing slash, as a file:// URL) gets the same key."""
    monkeypatch.chdir(tmp_path)
    one, other = tmp_path / "a" / "regression", tmp_path / "b" / "regression"
    key = key_of("regression", "summary", str(one))
    assert re.fullmatch(r"regression-regression-[0-9a-f]{6}-summary", key), key
    assert key != key_of("regression", "summary", str(other))
    assert {key_of("regression", "summary", spelling) for spelling in (
        "a/regression", f"{one}/", f"file://{one}")} == {key}
    assert key_of("Job: nightly!", "progress", "memory://ckpt/run 1").startswith(
        "job-nightly-run-1-")


def test_with_retention_the_summary_reports_the_newest_epoch_not_the_deleted_one(tmp_path, client):
    """Retention deletes epoch e-2 right after epoch e is saved: the deletion must not make the
    summary and the progress bar say the job is at e-2 (seen after a failure, which uploads
    the pending artifacts as they are)."""
    from caffe2ckpt.policy import StepManagerOptions

    url = str(tmp_path / "ckpt")

    @flow(name="retained")
    def retained() -> None:
        cm = MultiNodeCheckpointManager(url, metadata_handler=ZarrMetadataHandler())
        JobRunner(build_job(6, fail_at_epoch=5), cm, options=StepManagerOptions(max_to_keep=2)
                  ).train(PrefectSession(artifacts_interval=3600))

    state = retained(return_state=True)
    assert state.is_failed()
    run_id = UUID(str(state.state_details.flow_run_id))
    artifacts = {a.key: a for a in client.read_artifacts(artifact_filter=ArtifactFilter(
        flow_run_id=ArtifactFilterFlowRunId(any_=[run_id])))}
    summary = artifacts[key_of("regression", "summary", url)].data
    assert "- Training: at epoch **4** of 6, started from epoch 0" in summary, summary
    progress = artifacts[key_of("regression", "progress", url)]
    assert progress.description == "Job 'regression': Epoch 4 of 6 (this run started from epoch 0)"
    rows = read_table(client, str(run_id), key_of("regression", "checkpoints", url))
    assert [r["status"] for r in rows] == ["deleted (retention)"] * 3 + ["committed"] * 2


def test_an_elastic_resume_says_so_in_the_summary(tmp_path, client):
    """A job saved by 4 nodes resumed by a flow run of 2: the summary artifact says how many
    nodes saved the epoch it resumed from and how many resumed it."""
    from tests.elastic.elasticjob import build, layout

    url = str(tmp_path / "ckpt")
    JobRunner(build(4, 2), MultiNodeCheckpointManager(url, layout=layout())).train(
        LocalSession())

    @flow(name="elastic")
    def elastic() -> None:
        JobRunner(build(2, 3), MultiNodeCheckpointManager(url, layout=layout())).train(
            PrefectSession(artifacts_interval=3600))

    state = elastic(return_state=True)
    assert state.is_completed()
    run_id = UUID(str(state.state_details.flow_run_id))
    artifacts = {a.key: a for a in client.read_artifacts(artifact_filter=ArtifactFilter(
        flow_run_id=ArtifactFilterFlowRunId(any_=[run_id])))}
    summary = artifacts[key_of("elastic", "summary", url)].data
    assert re.search(r"\*\*Resumed\*\* from epoch 2, written by .*, saved by 4 nodes, on 2 "
                     r"nodes", summary), summary
