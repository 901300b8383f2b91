"""Job definition and LocalSession semantics: contexts, PRIVATE/GLOBAL, concurrency, errors."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from caffe2ckpt import (
    Job,
    JobDefinitionError,
    LocalSession,
    Node,
    Task,
    TaskGroup,
    WorkspaceType,
)


def test_tasks_default_to_epoch_group_and_current_node():
    with Job() as job:
        with Node("n1"):
            t = Task(lambda ws: None, name="t")
        with job.init_group:
            i = Task(lambda ws: None, name="i")
    assert t.group is job.epoch_group and t.node == "n1"
    assert i.group is job.init_group and i.node == "local"
    assert job.init_group.workspace_type is WorkspaceType.GLOBAL
    assert job.epoch_group.workspace_type is WorkspaceType.PRIVATE
    assert Job.current.__doc__  # public docstring
    with pytest.raises(JobDefinitionError, match="outside"):
        Job.current()


def test_used_nodes_in_first_appearance_order():
    group = TaskGroup()
    for node in ("b", "a", "b", "c"):
        Task(lambda ws: None, group=group, node=node)
    assert group.used_nodes() == ["b", "a", "c"]


def test_private_group_semantics():
    session = LocalSession()
    ws = session.workspace("n")
    ws["existing"] = np.zeros(2)
    with TaskGroup() as group:
        def first(ws):
            ws["existing"] = np.ones(2)      # exists globally: written through
            ws["scratch"] = np.int64(1)      # new: dropped after the group
            ws["out"] = np.int64(7)          # new but declared output: promoted
        def second(ws):
            ws["out"] = ws["out"] + ws["scratch"]  # same child workspace within the group
        Task(first, node="n", outputs=["out"])
        Task(second, node="n")
    session.run(group)
    assert set(ws) == {"existing", "out"}
    np.testing.assert_array_equal(ws["existing"], np.ones(2))
    assert int(ws["out"]) == 8
    assert int(group.tasks[0].outputs()[0].fetch()) == 8


def test_global_group_keeps_new_blobs():
    session = LocalSession()
    session.run(Task(lambda ws: ws.__setitem__("x", 3), node="n"))  # bare task: GLOBAL
    assert int(session.workspace("n")["x"]) == 3


def test_mixing_workspace_types_is_rejected():
    group = TaskGroup(WorkspaceType.GLOBAL)
    with pytest.raises(JobDefinitionError, match="cannot mix"):
        Task(lambda ws: None, group=group, workspace_type=WorkspaceType.PRIVATE)


def test_nodes_run_concurrently_and_first_failure_is_raised_after_all_finish():
    barrier = threading.Barrier(2, timeout=10)
    finished = []
    with TaskGroup() as group:
        def waits(ws):
            barrier.wait()  # deadlocks (times out) if the nodes ran one after another
            finished.append("a")
        def fails(ws):
            barrier.wait()
            raise RuntimeError("boom on b")
        Task(waits, node="a")
        Task(fails, node="b")
    with pytest.raises(RuntimeError, match="boom on b"):
        LocalSession().run(group)
    assert finished == ["a"]


def test_fetch_before_run_is_an_error():
    task = Task(lambda ws: None, outputs=["x"], node="n")
    with pytest.raises(JobDefinitionError, match="before the task ran"):
        task.outputs()[0].fetch()


def test_stop_condition_from_blob_name_and_bad_value():
    with Job() as job:
        with Node("n"):
            out = job.add_stop_condition("done")
        with pytest.raises(JobDefinitionError):
            job.add_stop_condition(42)
    assert out.key == "n:done" and job.stop_conditions == [out]


def test_explicit_nodes_to_checkpoint():
    with Job(nodes_to_checkpoint=["x", "y"]) as job:
        with job.init_group:
            Task(lambda ws: None, node="z")
    assert job.nodes_to_checkpoint() == ["x", "y"]
