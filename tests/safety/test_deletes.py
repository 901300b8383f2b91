"""Deletes touch exactly what they name: node names with glob characters (``w[12]``, ``a*``,
``b?``) next to the nodes they would match as patterns, on memory, local and S3; and symbolic
links under a local prefix are deleted themselves, never followed."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest

from caffe2ckpt import (
    Job,
    JobRunner,
    LocalSession,
    MultiNodeCheckpointManager,
    Node,
    StepCheckpointManager,
    StepManagerOptions,
    Task,
    epoch_limiter,
)
from caffe2ckpt.cli import main
from caffe2ckpt.fs.location import Location
from caffe2ckpt.store.commit.protocol import CheckpointStore
from tests.s3server import s3_params
from tests.stores import committed_epochs, delete_epoch, find_leftovers, load, remove_leftovers

# each glob node would match (as a pattern) the other job's nodes beside it
GLOB_NODES = ["w[12]", "a*", "b?"]
OTHER_NODES = ["w1", "w2", "ab", "bc"]
ALL_KINDS = pytest.mark.parametrize(
    "prefix", ["memory", "local", *s3_params()], indirect=True)


def save_other_job(prefix: str) -> dict[str, bytes]:
    """The other job's committed epochs 0 and 1; returns its files' bytes (records included)."""
    with StepCheckpointManager(prefix, handle_preemption=False) as other:
        for e in range(2):
            other.save(e, {n: {"w": np.full(5, 100 * e + i), "big": np.full(9000, e)}
                           for i, n in enumerate(OTHER_NODES)})
    return other_files(prefix)


def other_files(prefix: str) -> dict[str, bytes]:
    location = Location(prefix)
    fs, root = location.fs, location.root
    out = {}
    for path in fs.find(root):
        rel = path[len(root):].lstrip("/")
        top = rel.split("/")[0]
        if top.rpartition(".")[0] in OTHER_NODES or (
                top == "_commits" and rel.split(".")[1] in OTHER_NODES):
            out[rel] = fs.cat_file(path)
    return out


def assert_other_job_listed(prefix: str, before: dict[str, bytes]) -> None:
    """The cheap check between operations (one listing): none of the other job's files is gone.
    Nothing ever rewrites them, so :func:`assert_other_job_intact` at the end sees any change."""
    location = Location(prefix)
    location.fs.invalidate_cache()
    listed = {p[len(location.root):].lstrip("/") for p in location.fs.find(location.root)}
    assert set(before) <= listed, sorted(set(before) - listed)


def assert_other_job_intact(prefix: str, before: dict[str, bytes]) -> None:
    assert other_files(prefix) == before  # bit-exact, nothing missing
    store = CheckpointStore(Location(prefix))
    assert committed_epochs(store, OTHER_NODES) == [0, 1]
    for e in range(2):
        for i, n in enumerate(OTHER_NODES):
            assert np.array_equal(load(store, n, e)["w"], np.full(5, 100 * e + i))


def glob_items(step: int) -> dict[str, dict[str, np.ndarray]]:
    return {n: {"w": np.full(5, -step - i), "big": np.full(9000, -step)}
            for i, n in enumerate(GLOB_NODES)}


@ALL_KINDS
def test_step_manager_retention_resave_and_delete_of_glob_named_nodes(prefix):
    """Every deletion of a glob node's step (retention of step 0, the re-save of step 1 replacing
    its group, ``delete_step`` of step 1) is of a step the other job has too, where a pattern
    would match its nodes' groups and records; ``delete`` of the newest step 2 as well."""
    before = save_other_job(prefix)
    with StepCheckpointManager(prefix, options=StepManagerOptions(max_to_keep=1),
                               nodes=GLOB_NODES, handle_preemption=False) as mgr:
        for step in range(2):
            mgr.save(step, glob_items(step))
        assert mgr.all_steps(read=True) == [1]
        assert_other_job_listed(prefix, before)
        mgr.save(1, glob_items(10), force=True)  # a re-save: a group at a path of its own
        assert mgr.all_steps(read=True) == [1]
        assert np.array_equal(mgr.restore(1)["w[12]"]["w"], np.full(5, -10))
        assert_other_job_listed(prefix, before)
        mgr.save(2, glob_items(2))
        mgr.delete(2)
        assert mgr.all_steps(read=True) == [1]
    assert_other_job_listed(prefix, before)
    store = CheckpointStore(Location(prefix))
    delete_epoch(store, 1, GLOB_NODES)
    assert committed_epochs(store, GLOB_NODES) == []
    assert find_leftovers(store, min_age=0) == []  # their data went too, not only records
    assert_other_job_intact(prefix, before)


def glob_job(epochs: int) -> Job:
    with Job(name="globs") as job:
        for node in GLOB_NODES:
            with Node(node):
                with job.init_group:
                    Task(lambda ws: ws.update(w=np.zeros(4)), name="init")
                Task(lambda ws: ws.update(w=ws["w"] + 1), name="step")
        epoch_limiter(job, epochs)
    return job


@ALL_KINDS
def test_jobrunner_retention_and_resave_of_glob_named_nodes(prefix):
    before = save_other_job(prefix)
    assert JobRunner(glob_job(2), MultiNodeCheckpointManager(prefix)).train(LocalSession()) == 2
    # resuming from epoch 1 re-saves the committed epoch 2 (a path of its own), then retention
    # keeps the newest and the epoch resumed from: it deletes epoch 0, which the other job has
    runner = JobRunner(glob_job(3), MultiNodeCheckpointManager(prefix), resume_from_epoch=1,
                       options=StepManagerOptions(max_to_keep=1))
    assert runner.train(LocalSession()) == 3 and runner.resumed_from == 1
    store = CheckpointStore(Location(prefix))
    assert committed_epochs(store, GLOB_NODES) == [1, 3]
    assert np.array_equal(load(store, "a*", 3)["w"], np.full(4, 3.0))
    assert find_leftovers(store, min_age=0) == []
    assert_other_job_intact(prefix, before)


@ALL_KINDS
def test_gc_of_glob_named_nodes_removes_only_theirs(prefix, capsys):
    before = save_other_job(prefix)
    with StepCheckpointManager(prefix, nodes=GLOB_NODES, handle_preemption=False) as mgr:
        for step in range(2):  # gc --keep-last 1 deletes step 0, which the other job has too
            mgr.save(step, glob_items(step))
    location = Location(prefix)
    for node in GLOB_NODES:  # uncommitted data and an interrupted re-save of each glob node
        for group in (f"{node}.7", f"_staging/{node}.1.abc"):
            location.makedirs(location.path(group))
            location.fs.pipe_file(location.path(group, "zarr.json"), b"{}")
    assert main(["gc", prefix, "--keep-last", "1", "--min-age", "0", "--yes",
                 *[a for n in GLOB_NODES for a in ("--node", n)]]) == 0
    capsys.readouterr()
    store = CheckpointStore(location)
    assert committed_epochs(store, GLOB_NODES) == [1]
    assert find_leftovers(store, min_age=0) == []
    assert_other_job_intact(prefix, before)


# -- symbolic links (local disks) ----------------------------------------------------------------

@pytest.fixture
def outside(tmp_path):
    """A directory outside the prefix holding files named like a prefix's entries."""
    out = tmp_path / "outside"
    for name in ("n.1.abc", "n.2"):  # a staged re-save of node n's epoch 1, a group of epoch 2
        (out / name).mkdir(parents=True)
        (out / name / "zarr.json").write_text("outside")
    (out / "keep.txt").write_text("outside")
    return out


def tree_of(path) -> dict[str, str]:
    return {str(p.relative_to(path)): p.read_text() for p in sorted(path.rglob("*")) if p.is_file()}


def test_a_symlinked_staging_directory_is_never_deleted_through(tmp_path, outside, capsys):
    """Storage model 2 staged re-saves under ``_staging/``; ``gc`` still sweeps what is left
    there, and a link there goes itself, never what it points to."""
    prefix = tmp_path / "ckpt"
    with StepCheckpointManager(str(prefix), handle_preemption=False) as mgr:
        mgr.save(1, {"n": {"w": np.zeros(3)}})
        expected = tree_of(outside)
        os.symlink(outside, prefix / "_staging")
        mgr.save(1, {"n": {"w": np.ones(3)}}, force=True)  # a re-save: a path of its own
        assert tree_of(outside) == expected
        assert np.array_equal(mgr.restore(1)["n"]["w"], np.ones(3))
    assert main(["gc", str(prefix), "--min-age", "0", "--yes"]) == 0
    capsys.readouterr()
    assert tree_of(outside) == expected
    assert not os.path.lexists(prefix / "_staging")  # the link went, not what it points to


def test_a_symlinked_node_group_is_deleted_as_a_link(tmp_path, outside, capsys):
    prefix = tmp_path / "ckpt"
    with StepCheckpointManager(str(prefix), handle_preemption=False) as mgr:
        mgr.save(1, {"n": {"w": np.zeros(3)}})
    expected = tree_of(outside)
    os.symlink(outside / "n.2", prefix / "n.2")  # uncommitted "data" that is a link
    os.symlink(outside, prefix / "n.3")
    store = CheckpointStore(Location(str(prefix)))
    remove_leftovers(store, find_leftovers(store, min_age=0))
    assert tree_of(outside) == expected
    assert not os.path.lexists(prefix / "n.2") and not os.path.lexists(prefix / "n.3")
    with StepCheckpointManager(str(prefix), handle_preemption=False) as mgr:
        mgr.save(2, {"n": {"w": np.ones(3)}})
    shutil.rmtree(prefix / "n.2")  # a committed group swapped for a link (hostile)
    os.symlink(outside / "n.2", prefix / "n.2")
    delete_epoch(store, 2, ["n"])  # its records go; whose the link is cannot be told: it stays
    assert tree_of(outside) == expected and os.path.islink(prefix / "n.2")
    remove_leftovers(store, find_leftovers(store, min_age=0))  # gc: the link itself goes
    assert tree_of(outside) == expected and not os.path.lexists(prefix / "n.2")
