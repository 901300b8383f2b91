"""PrefectSession inside real flows: Caffe2 behaviours, task run names, retries, artifacts."""

from __future__ import annotations

import json
import math
from uuid import UUID

import numpy as np
import pytest
from prefect import flow
from prefect.client.schemas.filters import (
    ArtifactFilter,
    ArtifactFilterFlowRunId,
    FlowRunFilter,
    FlowRunFilterId,
    LogFilter,
    LogFilterFlowRunId,
)
from prefect.runtime import flow_run

from caffe2ckpt import Job, JobRunner, LocalSession, MultiNodeCheckpointManager, Node, Task
from caffe2ckpt.commit import CommitRecord
from caffe2ckpt.example import build_job
from caffe2ckpt.job import epoch_limiter
from caffe2ckpt.metadata import ZarrMetadataHandler
from caffe2ckpt.prefect import AttemptLimitExceeded, PrefectSession, artifact_key, run_job
from caffe2ckpt.prefect.artifacts import checkpoint_row, checkpoint_table, format_metric
from tests.jobs import EXPECTED_TOTALS, Counter, fetch, make_job
from tests.prefect.conftest import poll


# The Prefect layer does not depend on the filesystem (tests/test_*.py cover memory, local, S3).
ON_LOCAL_DISK = pytest.mark.parametrize("prefix", ["local"], indirect=True)


def task_run_names(client, flow_run_id: str, expected: int) -> list[str]:
    runs = poll(lambda: client.read_task_runs(flow_run_filter=FlowRunFilter(
        id=FlowRunFilterId(any_=[UUID(flow_run_id)]))), lambda r: len(r) >= expected)
    return sorted(r.name for r in runs)


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
    expected = (["init_group[trainer_0] e0", "checkpoint_init[trainer_0] e0"]
                + [f"checkpoint_save[trainer_0] e{e}" for e in range(5)]
                + [f"epoch_group[trainer_0] e{e}" for e in range(1, 5)])
    names = task_run_names(client, run_id, len(expected))
    assert sorted(expected) == [n for n in names if n in expected] and len(names) == len(expected)

    for epoch in (1, 2, 3, 4):
        session = PrefectSession()
        final, _ = pipeline(resume_from=epoch)
        assert final == 4 and fetch(session, "trainer_0", total) == 145
    assert counter.init_calls == 1


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
    assert f"flow_run_id={run_id}" in resumed[0] and "run_count=1" in resumed[0]

    artifacts = client.read_artifacts(artifact_filter=ArtifactFilter(
        flow_run_id=ArtifactFilterFlowRunId(any_=[UUID(run_id)])))
    by_key: dict[str, list] = {}
    for artifact in artifacts:
        if artifact.key is not None:  # key-less ones are Prefect's own (persisted results)
            by_key.setdefault(artifact.key, []).append(artifact)
    keys = {artifact_key("regression", k) for k in ("checkpoints", "progress", "summary")}
    assert set(by_key) == keys and all(len(v) == 1 for v in by_key.values())
    rows = json.loads(by_key["regression-checkpoints"][0].data)
    assert [r["epoch"] for r in rows] == [0, 1, 2, 3, 4, 5]
    assert all(r["status"] == "committed" and r["nodes"] == "trainer_0, trainer_1" for r in rows)
    assert [r["attempt"] for r in rows] == [1, 1, 1, 2, 2, 2]
    assert by_key["regression-progress"][0].data == 100.0
    summary = by_key["regression-summary"][0].data
    assert "Resumed** from epoch 2" in summary and "Finished at epoch **5**" in summary


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

def record(epoch: int, node: str, metrics: dict[str, float]) -> CommitRecord:
    return CommitRecord(epoch=epoch, node=node, save_id="s", nodes=["trainer_0", "trainer_1"],
                        nbytes=1000, blob_count=1, seconds=0.5, metrics=metrics,
                        writer={"run_count": 1})


def test_checkpoint_table_has_a_compact_column_per_metric():
    nan = float("nan")
    both = {"loss": 0.123456789, "acc": nan, "epoch": 3.0}
    rows = [
        checkpoint_row(0, {n: record(0, n, {}) for n in ("trainer_0", "trainer_1")}, "u0"),
        checkpoint_row(1, {n: record(1, n, both) for n in ("trainer_0", "trainer_1")}, "u1"),
        checkpoint_row(2, {"trainer_0": record(2, "trainer_0", {"loss": 12345678.0}),
                           "trainer_1": record(2, "trainer_1", {"loss": -math.inf})}, "u2"),
        {"epoch": 3, "status": "FAILED: OSError: disk full", "nodes": "", "bytes": "",
         "seconds": "", "MB/s": "", "attempt": "", "url": "", "metrics": {}},
    ]
    table = checkpoint_table(rows)
    # metric columns right after "status", in first-seen order; a name taken by a column is prefixed
    assert list(table[0]) == ["epoch", "status", "loss", "acc", "metric epoch", "nodes", "bytes",
                              "seconds", "MB/s", "attempt", "url"]
    assert all(list(row) == list(table[0]) for row in table)
    assert [(r["loss"], r["acc"], r["metric epoch"]) for r in table] == [
        ("", "", ""), ("0.1235", "NaN", "3"),
        ("trainer_0: 1.235e+07, trainer_1: -inf", "", ""), ("", "", "")]
    assert table[1]["epoch"] == 1 and table[1]["MB/s"] == 0.0 and table[3]["status"].startswith("FAILED")
    json.loads(json.dumps(table), parse_constant=pytest.fail)  # strict JSON: NaN is a string
    assert [format_metric(v) for v in (1e-7, 2.0, math.inf, nan)] == ["1e-07", "2", "inf", "NaN"]


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


def read_table(client, run_id: str, key: str) -> list[dict]:
    artifacts = client.read_artifacts(artifact_filter=ArtifactFilter(
        flow_run_id=ArtifactFilterFlowRunId(any_=[UUID(run_id)])))
    found = [a for a in artifacts if a.key == key]
    assert len(found) == 1
    return json.loads(found[0].data)


@ON_LOCAL_DISK
def test_checkpoint_table_artifact_shows_the_metrics_of_each_save(prefix, client):
    @flow(name="with-metrics")
    def with_metrics() -> str:
        # a long interval: every save after the first is deferred, "finished" uploads them
        session = PrefectSession(artifacts_interval=3600)
        JobRunner(metrics_job(3), MultiNodeCheckpointManager(prefix)).train(session)
        return flow_run.id

    rows = read_table(client, with_metrics(), artifact_key("metrics job", "checkpoints"))
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
    rows = read_table(client, str(state.state_details.flow_run_id), "regression-checkpoints")
    assert [r["epoch"] for r in rows] == [0, 1, 2, 3]
    assert [r["loss"] != "" for r in rows] == [False, True, True, True]


def test_throttled_table_is_uploaded_while_the_next_epoch_runs(tmp_path, client):
    seen: list[list[int]] = []

    @flow(name="slow-last-epoch")
    def slow_last_epoch() -> None:
        run_id = flow_run.id

        def step(ws):  # epochs 1-3 take no time; epoch 4 waits for the timer's upload
            ws["e"] = ws["e"] + 1
            if int(ws["e"]) == 4:
                rows = poll(lambda: read_table(client, run_id, "slow-checkpoints"),
                            lambda rs: len(rs) == 4, timeout=15)
                seen.append([r["epoch"] for r in rows])

        with Job(name="slow") as job:
            with Node("trainer_0"):
                with job.init_group:
                    Task(lambda ws: ws.update(e=np.int64(0)), name="init")
                Task(step, name="step")
            epoch_limiter(job, 4)
        cm = MultiNodeCheckpointManager(str(tmp_path / "ckpt"))
        JobRunner(job, cm).train(PrefectSession(artifacts_interval=1.0))

    slow_last_epoch()
    assert seen == [[0, 1, 2, 3]]
