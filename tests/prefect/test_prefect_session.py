"""PrefectSession inside real flows: Caffe2 behaviours, task run names, retries, artifacts."""

from __future__ import annotations

import json
from uuid import UUID

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

from caffe2ckpt import JobRunner, LocalSession, MultiNodeCheckpointManager
from caffe2ckpt.example import build_job
from caffe2ckpt.metadata import ZarrMetadataHandler
from caffe2ckpt.prefect import AttemptLimitExceeded, PrefectSession, artifact_key, run_job
from tests.jobs import EXPECTED_TOTALS, Counter, fetch, make_job
from tests.prefect.conftest import poll


def task_run_names(client, flow_run_id: str, expected: int) -> list[str]:
    runs = poll(lambda: client.read_task_runs(flow_run_filter=FlowRunFilter(
        id=FlowRunFilterId(any_=[UUID(flow_run_id)]))), lambda r: len(r) >= expected)
    return sorted(r.name for r in runs)


def snapshot(session, nodes) -> dict:
    return {n: {k: (v.dtype.str, v.shape, v.tobytes()) for k, v in session.workspace(n).items()}
            for n in nodes}


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
    names = task_run_names(client, run_id, 16)
    expected = (["init_group[trainer_0] e0", "checkpoint_init[trainer_0] e0"]
                + [f"checkpoint_save[trainer_0] e{e}" for e in range(5)]
                + [f"epoch_group[trainer_0] e{e}" for e in range(1, 5)])
    assert sorted(expected) == [n for n in names if n in expected] and len(names) == len(expected)

    for epoch in (1, 2, 3, 4):
        session = PrefectSession()
        final, _ = pipeline(resume_from=epoch)
        assert final == 4 and fetch(session, "trainer_0", total) == 145
    assert counter.init_calls == 1


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
