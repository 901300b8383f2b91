"""DaskSession inside real Prefect flows on a 2-worker process LocalCluster: one Prefect task run
per node and group, and a worker SIGKILLed mid-epoch or mid-save failing the attempt naming the
node, after which Prefect's retry places fresh actors and resumes bit-exact."""

from __future__ import annotations

import os
import signal
import time

import pytest
from prefect import flow
from prefect.runtime import flow_run

from caffe2ckpt import JobRunner, LocalSession, MultiNodeCheckpointManager
from caffe2ckpt.example import build_job
from caffe2ckpt.fs.location import Location
from caffe2ckpt.prefect import PrefectSession
from caffe2ckpt.store.protocol import CheckpointStore
from tests.jobs import EXPECTED_TOTALS, fetch, make_job
from tests.prefect.conftest import finished_task_runs

pytest.importorskip("distributed")
from caffe2ckpt.dask import DaskSession  # noqa: E402
from tests.stores import newest_epoch

pytestmark = pytest.mark.slow
NODES = ["trainer_0", "trainer_1"]


def test_task_runs_per_node_and_group_with_actors(tmp_path, dask_client, client):
    job, totals = make_job(node_ids=(0, 1))

    @flow(name="dask-pipeline")
    def pipeline() -> tuple[int, str, list[int]]:
        with DaskSession(dask_client) as nodes:
            final = JobRunner(job, MultiNodeCheckpointManager(str(tmp_path / "ckpt"))).train(
                PrefectSession(nodes=nodes))
            return final, flow_run.id, [fetch(nodes, f"trainer_{i}", t)
                                        for i, t in enumerate(totals)]

    final, run_id, values = pipeline()
    assert final == 4 and values == [145, 145]
    expected = sorted(
        [f"{g}[{n}] e0" for g in ("init_group", "checkpoint_init") for n in NODES]
        + [f"checkpoint_save[{n}] e{e}" for e in range(5) for n in NODES]
        + [f"epoch_group[{n}] e{e}" for e in range(1, 5) for n in NODES])
    assert sorted(r.name for r in finished_task_runs(client, run_id, len(expected))) == expected


def test_caffe2_contract_inside_flows_resume_from_each_epoch_and_partial_load(tmp_path,
                                                                             dask_client):
    url, third = str(tmp_path / "ckpt"), str(tmp_path / "three")
    job, _ = make_job(node_ids=(0, 1))

    def train(job, url: str, resume_from: int | None = None) -> tuple[int, int | None, list[int]]:
        with DaskSession(dask_client) as nodes:
            runner = JobRunner(job, MultiNodeCheckpointManager(url), resume_from_epoch=resume_from)
            final = runner.train(PrefectSession(nodes=nodes))
            return final, runner.resumed_from, [fetch(nodes, node, f"{node}/total")
                                                for node in job.nodes_to_checkpoint()]

    @flow(name="dask-contract")
    def contract() -> list[tuple]:
        return [train(job, url)] + [train(job, url, epoch) for epoch in (1, 2, 3, 4)]

    assert contract() == [(4, None, [145, 145])] + [(4, e, [145, 145]) for e in (1, 2, 3, 4)]

    @flow(name="dask-partial-load")
    def partial() -> list[tuple]:
        for node_id in range(3):  # three one-node jobs share a prefix
            assert train(make_job(node_ids=(node_id,))[0], third)[0] == 4
        three, _ = make_job(node_ids=(0, 1, 2))
        out = []
        with DaskSession(dask_client) as nodes:
            runner = JobRunner(three, MultiNodeCheckpointManager(third))
            for epoch in (1, 2, 3, 4, 5):
                loaded = runner.load_blobs_from_checkpoints(
                    ["trainer_1/total", "trainer_2/total"], epoch, PrefectSession(nodes=nodes))
                out.append((loaded, fetch(nodes, "trainer_2", "trainer_2/total") if loaded
                            else None, "trainer_0/total" in nodes.workspace("trainer_0")))
        return out

    assert partial() == [(True, t, False) for t in EXPECTED_TOTALS] + [(False, None, False)]


def test_async_saves_wait_in_the_actors_as_task_runs(tmp_path, dask_client, client):
    url = str(tmp_path / "ckpt")

    @flow(name="dask-async")
    def pipeline() -> tuple[int, str]:
        with DaskSession(dask_client) as nodes:
            cm = MultiNodeCheckpointManager(url, async_save=True)
            return JobRunner(build_job(3), cm).train(PrefectSession(nodes=nodes)), flow_run.id

    final, run_id = pipeline()
    assert final == 3
    assert newest_epoch(CheckpointStore(Location(url)), NODES) == 3
    runs = finished_task_runs(client, run_id, 26)  # 2 init + 2 checkpoint_init + 6 epochs + 8 + 8
    # each save and each wait in its actor is its own task run, labelled with its epoch
    for group in ("checkpoint_save", "checkpoint_wait"):
        assert sorted(r.name for r in runs if r.name.startswith(group + "[")) == sorted(
            f"{group}[{n}] e{e}" for e in range(4) for n in NODES)


def kill_at(epoch: int, node: str):
    """An extra epoch task: SIGKILLs the worker holding ``node`` when it reaches ``epoch``."""
    def maybe_die(ws) -> None:
        if int(ws["epoch"]) == epoch:
            os.kill(os.getpid(), signal.SIGKILL)
    return maybe_die


def die_while_installing(marker: str) -> None:
    """Run on every worker: the first save of trainer_1's epoch 3 (while the marker file
    exists) SIGKILLs its worker after its group is written, before its record."""
    from caffe2ckpt.store import protocol

    write_record = protocol.write_record

    def dying(location, record):
        if record.node == "trainer_1" and record.epoch == 3 and os.path.exists(marker):
            os.unlink(marker)
            os.kill(os.getpid(), signal.SIGKILL)
        return write_record(location, record)

    dying.original = write_record
    protocol.write_record = dying


def undo_die_while_installing() -> None:
    from caffe2ckpt.store import protocol

    protocol.write_record = getattr(protocol.write_record, "original", protocol.write_record)


@pytest.mark.parametrize("where", ["mid-epoch", "mid-save"])
def test_a_killed_worker_fails_the_attempt_and_the_retry_resumes(tmp_path, dask_client, where):
    url = str(tmp_path / "ckpt")
    marker = tmp_path / "kill-once"
    if where == "mid-save":
        marker.touch()
        dask_client.run(die_while_installing, str(marker))
    attempts: list[tuple[int, float, str]] = []

    @flow(name="dask-retrying", retries=1, retry_delay_seconds=0)
    def retrying() -> list[dict]:
        job = build_job(5)
        if where == "mid-epoch" and flow_run.run_count == 1:
            from caffe2ckpt import Node, Task
            with Node("trainer_1"):
                Task(kill_at(3, "trainer_1"), name="die", group=job.epoch_group)
        started = time.monotonic()
        try:
            with DaskSession(dask_client) as nodes:
                JobRunner(job, MultiNodeCheckpointManager(url)).train(PrefectSession(nodes=nodes))
                return [{k: v.tobytes() for k, v in nodes.workspace(n).items()} for n in NODES]
        except Exception as exc:
            attempts.append((flow_run.run_count, time.monotonic() - started, repr(exc)))
            raise

    final = retrying()
    assert len(attempts) == 1, attempts
    _, seconds, error = attempts[0]
    assert "NodeLostError" in error and "trainer_1" in error, error
    assert seconds < 30, attempts
    assert not marker.exists()  # the mid-save kill happened

    reference = LocalSession()
    JobRunner(build_job(5), MultiNodeCheckpointManager(str(tmp_path / "ref"))).train(reference)
    assert final == [{k: v.tobytes() for k, v in reference.workspace(n).items()} for n in NODES]
    store = CheckpointStore(Location(url))
    assert newest_epoch(store, NODES) == 5
    if where == "mid-save":
        dask_client.run(undo_die_while_installing)  # the worker that was not killed


def test_a_process_pool_task_runner_is_refused_up_front(tmp_path):
    from prefect.task_runners import ProcessPoolTaskRunner

    from caffe2ckpt.errors import JobDefinitionError

    @flow(name="process-pool", task_runner=ProcessPoolTaskRunner(max_workers=2))
    def pooled() -> int:
        return JobRunner(build_job(2), MultiNodeCheckpointManager(str(tmp_path / "ckpt"))).train(
            PrefectSession())

    with pytest.raises(JobDefinitionError, match="ProcessPoolTaskRunner.*DaskSession"):
        pooled()
    assert not (tmp_path / "ckpt").exists()  # refused before anything ran or was written
