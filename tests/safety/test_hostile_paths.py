"""Saves into a local prefix in which a directory below the prefix is a symbolic link to a folder
elsewhere (review 1aeae9c, defect 12). Reads never follow such a link (they report the files
behind it as damage), so writes must not either: a save through a symlinked ``_commits/``,
``_runs/`` or ``_hints/`` fails with an error naming the link, and nothing is written outside the
prefix. (At 1aeae9c every such save reported success and wrote its records, run entries or hints
into the folder the link pointed to; no reader accepted them.) A symlink where a save's group
would go (``<node>.<epoch>``) is a taken path, as any entry there is: the save writes at a path of
its own, inside the prefix. The prefix itself may be a symlink: the user chose it.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from caffe2ckpt import (
    CheckpointWriteError,
    JobRunner,
    LocalSession,
    MultiNodeCheckpointManager,
    StepCheckpointManager,
)
from caffe2ckpt.metadata import ZarrMetadataHandler
from tests.safety.test_hostile import one_node_job


def everything(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


@pytest.fixture
def linked(tmp_path):
    """``make(name)``: a new prefix whose entry ``name`` is a symlink to an empty folder
    outside it; returns (prefix, outside folder)."""
    def make(name: str) -> tuple[Path, Path]:
        prefix, outside = tmp_path / "ckpt", tmp_path / "outside"
        prefix.mkdir()
        outside.mkdir()
        (prefix / name).symlink_to(outside, target_is_directory=True)
        return prefix, outside
    return make


LINKS = ["_commits", "_runs", "_hints"]


@pytest.mark.parametrize("link", LINKS)
def test_a_runner_saving_through_a_symlinked_directory_fails_naming_it(linked, link):
    prefix, outside = linked(link)
    cm = MultiNodeCheckpointManager(str(prefix), metadata_handler=ZarrMetadataHandler())
    runner = JobRunner(one_node_job("n", 1), cm, on_save_error="raise")
    with pytest.raises(CheckpointWriteError) as info:
        runner.train(LocalSession())
    assert info.value.epoch == 0 and f"{prefix / link} is a symbolic link" in str(info.value), (
        str(info.value))
    assert runner.saved_epochs == [] and everything(outside) == []


@pytest.mark.parametrize("link", LINKS)
def test_warned_saves_through_a_symlinked_directory_write_nothing_outside(linked, link):
    """With ``on_save_error="warn"`` the run goes on: epoch 0 is a failed save, nothing lands
    outside the prefix, and whatever the run reports saved a fresh resume accepts."""
    prefix, outside = linked(link)
    cm = MultiNodeCheckpointManager(str(prefix), metadata_handler=ZarrMetadataHandler())
    runner = JobRunner(one_node_job("n", 2), cm)
    assert runner.train(LocalSession()) == 2
    assert 0 in runner.failed_saves and everything(outside) == []
    handler = ZarrMetadataHandler()
    handler.set_params(db_prefix=str(prefix), db_type="zarr", node_names=["n"])
    assert handler.last_epoch() == (max(runner.saved_epochs) if runner.saved_epochs else None)


@pytest.mark.parametrize("link", LINKS)
def test_a_step_manager_saving_through_a_symlinked_directory_fails_naming_it(linked, link):
    prefix, outside = linked(link)
    with StepCheckpointManager(str(prefix), handle_preemption=False) as mgr, \
            pytest.raises(CheckpointWriteError) as info:
        mgr.save(0, {"n": {"w": np.arange(100_000.0)}})
    assert f"{prefix / link} is a symbolic link" in str(info.value), str(info.value)
    assert everything(outside) == []


def test_a_symlink_at_the_group_path_is_a_taken_path_never_followed(linked):
    """``mkdir`` of ``n.0`` finds the link: the path is taken, so the save writes at a path of
    its own inside the prefix, which the record names and a restore reads."""
    prefix, outside = linked("n.0")
    with StepCheckpointManager(str(prefix), handle_preemption=False) as mgr:
        assert mgr.save(0, {"n": {"w": np.arange(100_000.0)}})
    assert everything(outside) == []
    assert [p.name for p in prefix.glob("n.0.*")]  # its own path, inside the prefix
    with StepCheckpointManager(str(prefix), handle_preemption=False) as mgr:
        assert np.array_equal(mgr.restore(0)["n"]["w"], np.arange(100_000.0))


def test_a_prefix_that_is_itself_a_symlink_is_written_and_read_through_it(tmp_path):
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "link").symlink_to(real, target_is_directory=True)
    prefix = str(tmp_path / "link" / "ckpt")
    runner = JobRunner(one_node_job("n", 1), MultiNodeCheckpointManager(
        prefix, metadata_handler=ZarrMetadataHandler()), on_save_error="raise")
    assert runner.train(LocalSession()) == 1 and runner.saved_epochs == [0, 1]
    assert os.path.isdir(real / "ckpt" / "_commits")
    resumed = JobRunner(one_node_job("n", 2), MultiNodeCheckpointManager(
        prefix, metadata_handler=ZarrMetadataHandler()))
    assert resumed.train(LocalSession()) == 2 and resumed.resumed_from == 1
