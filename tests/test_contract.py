"""Caffe2's checkpoint_test.py, re-expressed with numpy tasks (reference/caffe2_contract.md §4).

The reference job: each node has ten records 0..9 and a running ``total`` starting at 100; every
epoch reads at most three records into the total, and the job stops after the epoch in which the
reader ran out of data. Totals after epochs 1..4: 103, 115, 136, 145.
"""

from __future__ import annotations

import logging

import fsspec
import numpy as np
import pytest
import zarr

from caffe2ckpt import (
    CheckpointManager,
    CheckpointWriteError,
    Job,
    JobDefinitionError,
    JobRunner,
    LocalSession,
    MultiNodeCheckpointManager,
    Node,
    Task,
    TaskGroup,
    UploadTaskGroupBuilder,
    WorkspaceType,
    db_name,
)
from tests.jobs import EXPECTED_TOTALS, Counter, fetch, make_job


@pytest.fixture(params=["single", "multi"])
def make_manager(request, prefix):
    def make():
        if request.param == "single":
            return CheckpointManager(prefix, "temp_node")
        return MultiNodeCheckpointManager(prefix)
    return make


def test_single_checkpoint_run_resume_and_load(make_manager, prefix):
    counter = Counter()
    job, (total,) = make_job(counter=counter)
    session = LocalSession()
    assert JobRunner(job, make_manager()).train(session) == 4
    assert fetch(session, "trainer_0", total) == 145
    assert counter.init_calls == 1

    for initial_epoch in (1, 2, 3, 4):
        session, cm = LocalSession(), make_manager()
        final = JobRunner(job, cm, resume_from_epoch=initial_epoch).train(session)
        assert fetch(session, "trainer_0", total) == 145
        # Caffe2 would run an extra epoch 5 when resuming from 4; we know epoch 4 finished.
        assert final == 4
    assert counter.init_calls == 1  # resumes never ran init_group

    for epoch in (1, 2, 3, 4):
        session.run(cm.load(epoch))
        assert fetch(session, "trainer_0", total) == EXPECTED_TOTALS[epoch - 1]
    session.run(cm.load(0))
    assert fetch(session, "trainer_0", total) == 100


def test_single_manager_names_files_by_node_name(tmp_path):
    job, _ = make_job()
    JobRunner(job, CheckpointManager(str(tmp_path), "temp_node")).train(LocalSession())
    names = sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith("_"))
    assert names == [f"temp_node.{e}" for e in range(5)]


def test_ckpt_names_for_multi_node_job(prefix):
    job, _ = make_job(node_ids=(0, 1, 2))
    cm = MultiNodeCheckpointManager(prefix)
    cm.init(job.nodes_to_checkpoint())  # built, not run
    for k in range(3):
        assert cm.get_ckpt_db_name(f"trainer_{k}", 5) == prefix + "/" + f"trainer_{k}" + ".5"
    assert cm.get_ckpt_db_name("trainer_9", 5) is None
    assert db_name(5, "trainer_1", "/tmp/x") == "/tmp/x/trainer_1.5"
    assert db_name(5, "trainer_1", "/tmp/x/") == "/tmp/x/trainer_1.5"
    assert db_name(5, "trainer_1", "ignored", path_prefix="gs://b/p-") == "gs://b/p-trainer_1.5"


def test_checkpointed_names_are_those_after_init(prefix):
    for node_id in range(3):
        job, _ = make_job(node_ids=(node_id,))
        session, cm = LocalSession(), MultiNodeCheckpointManager(prefix)
        assert JobRunner(job, cm).train(session) == 4
        node = f"trainer_{node_id}"
        after_init = {f"{node}/total", f"{node}/val", f"{node}/cursor"}
        assert set(cm.blob_list()[node]) == after_init
        assert "data_finished" in session.workspace(node)  # created later, never checkpointed
        assert set(cm.store.manifest(cm.lineage_save(4).records[node]).blobs) == after_init


def test_partial_load_across_three_nodes(prefix):
    for node_id in range(3):
        job, _ = make_job(node_ids=(node_id,))
        JobRunner(job, MultiNodeCheckpointManager(prefix)).train(LocalSession())
    job, _ = make_job(node_ids=(0, 1, 2))
    session = LocalSession()
    assert all(len(session.workspace(f"trainer_{i}")) == 0 for i in range(3))
    runner = JobRunner(job, MultiNodeCheckpointManager(prefix))
    names = ["trainer_1/total", "trainer_2/total"]
    for epoch in (1, 2, 3, 4):
        assert runner.load_blobs_from_checkpoints(names, epoch, session) is True
        for node, name in zip(("trainer_1", "trainer_2"), names):
            assert fetch(session, node, name) == EXPECTED_TOTALS[epoch - 1]
    assert "trainer_1/total" not in session.workspace("trainer_0")
    before = fetch(session, "trainer_1", names[0])
    assert runner.load_blobs_from_checkpoints(names, 5, session) is False
    assert fetch(session, "trainer_1", names[0]) == before  # nothing half-loaded


class UploadToDir(UploadTaskGroupBuilder):
    """Copies each node's checkpoint of the final epoch to ``<dest>/<node>``."""

    def __init__(self, dest: str) -> None:
        self.dest = dest
        self.epochs: list[int] = []

    def build(self, epoch, checkpoint_manager):
        self.epochs.append(epoch)
        group = TaskGroup(WorkspaceType.GLOBAL)
        for node in checkpoint_manager.file_nodes():
            src_fs, src = fsspec.core.url_to_fs(checkpoint_manager.get_ckpt_db_name(node, epoch))
            Task(lambda ws, fs=src_fs, s=src, n=node: fs.get(s, f"{self.dest}/{n}", recursive=True),
                 group=group, node=node, name="upload")
        return group


def test_upload_builder_gets_final_epoch(prefix, tmp_path):
    dest = str(tmp_path / "upload")
    for node_id in range(3):
        job, _ = make_job(node_ids=(node_id,))
        builder = UploadToDir(dest)
        n = JobRunner(job, MultiNodeCheckpointManager(prefix),
                      upload_task_group_builder=builder).train(LocalSession())
        assert n == 4 and builder.epochs == [4]
    for node_id in range(3):
        uploaded = zarr.open_group(str(tmp_path / "upload" / f"trainer_{node_id}"), mode="r")
        assert uploaded.attrs["caffe2ckpt"]["epoch"] == 4


def test_failing_saves_warn_and_keep_training(tmp_path, caplog):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    for node_id in range(3):
        job, (total,) = make_job(node_ids=(node_id,))
        runner = JobRunner(job, MultiNodeCheckpointManager(str(blocker / "ckpt")))
        session = LocalSession()
        with caplog.at_level(logging.WARNING, logger="caffe2ckpt"):
            assert runner.train(session) == 4
        assert fetch(session, f"trainer_{node_id}", total) == 145
        assert runner.failed_saves == [0, 1, 2, 3, 4]
    warnings = [r for r in caplog.records if "Unable to write checkpoint for epoch" in r.message]
    assert len(warnings) == 15
    assert str(blocker) in warnings[0].message


def test_failing_save_raises_when_asked(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    job, _ = make_job()
    runner = JobRunner(job, MultiNodeCheckpointManager(str(blocker / "ckpt")),
                       on_save_error="raise")
    with pytest.raises(CheckpointWriteError, match="epoch 0"):
        runner.train(LocalSession())
    assert runner.failed_saves == [0]


def test_download_and_exit_groups_run_after_the_loop_in_order():
    order: list[str] = []
    with Job() as job:
        with Node("trainer:0"):
            with job.init_group:
                def init(ws):
                    for name in ("input1", "input2", "output", "download_result"):
                        ws[name] = np.ones(8, np.float32)
                Task(init)

            def add(ws):
                order.append("epoch")
                ws["output"] = ws["input1"] + ws["input2"]
                ws["stop"] = True
            Task(add, outputs=["stop"])
            job.add_stop_condition("stop")
            with job.download_group:
                def download(ws):
                    order.append("download")
                    ws["download_result"] = ws["output"].copy()
                Task(download)
            with job.exit_group:
                Task(lambda ws: order.append("exit"))
    session = LocalSession()
    assert JobRunner(job).train(session) == 1
    ws = session.workspace("trainer:0")
    np.testing.assert_array_equal(ws["output"], np.full(8, 2.0, np.float32))
    np.testing.assert_array_equal(ws["download_result"], np.full(8, 2.0, np.float32))
    assert order == ["epoch", "download", "exit"]


def test_reused_checkpoint_manager(prefix):
    job, (total,) = make_job()
    session, cm = LocalSession(), MultiNodeCheckpointManager(prefix)
    JobRunner(job, cm).train(session)
    for initial_epoch in (1, 2, 3, 4):
        JobRunner(job, cm, resume_from_epoch=initial_epoch).train(session)
        assert fetch(session, "trainer_0", total) == 145


def test_reused_manager_rejects_other_nodes(prefix):
    cm = MultiNodeCheckpointManager(prefix)
    cm.init(["trainer_0"])
    with pytest.raises(JobDefinitionError, match="trainer_0"):
        cm.init(["trainer_1"])


def test_job_without_stop_condition_is_rejected():
    with Job(name="forever") as job:
        Task(lambda ws: None, node="n")
    with pytest.raises(JobDefinitionError, match="no stop condition"):
        JobRunner(job).train(LocalSession())


def test_resume_epoch_without_manager_is_rejected():
    job, _ = make_job()
    with pytest.raises(JobDefinitionError, match="needs a checkpoint manager"):
        JobRunner(job, resume_from_epoch=2).train(LocalSession())


def test_single_manager_rejects_several_nodes(prefix):
    with pytest.raises(JobDefinitionError, match="single node"):
        CheckpointManager(prefix, "n").init(["a", "b"])
