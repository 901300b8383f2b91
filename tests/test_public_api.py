"""The public surface: exact exports, and that importing caffe2ckpt never imports prefect."""

from __future__ import annotations

import subprocess
import sys

import caffe2ckpt
import caffe2ckpt.errors as errors

PUBLIC = {
    "Workspace", "WorkspaceType", "Node", "Task", "TaskGroup", "TaskOutput", "Job",
    "epoch_limiter", "Session", "LocalSession", "CheckpointManager",
    "MultiNodeCheckpointManager", "UploadTaskGroupBuilder", "JobRunner", "db_name",
    "get_ckpt_filename", "StepCheckpointManager", "StepManagerOptions",
    "AbstractCheckpointManager", "materialize", "read_epoch", "zarr_store", "Layout",
    *errors.__all__,
}


def test_all_is_exactly_the_public_names_and_sorted():
    assert set(caffe2ckpt.__all__) == PUBLIC
    assert caffe2ckpt.__all__ == sorted(caffe2ckpt.__all__)
    for name in caffe2ckpt.__all__:
        assert getattr(caffe2ckpt, name) is not None


def test_the_docs_error_tree_names_every_public_error():
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "concepts.md").read_text()
    tree = text.split("## Errors", 1)[1].split("```text\n")[1].split("```")[0]
    named = {line.strip("│├└─ ").split(" ")[0] for line in tree.splitlines() if line.strip()}
    assert named == set(errors.__all__)


def test_error_tree():
    assert issubclass(errors.CheckpointNotFoundError, FileNotFoundError)
    assert issubclass(errors.CheckpointCorruptedError, ValueError)
    for name in errors.__all__:
        assert issubclass(getattr(errors, name), errors.CheckpointError)
    err = errors.CheckpointCorruptedError("m", node="n", epoch=3, blob="b")
    assert (err.node, err.epoch, err.blob) == ("n", 3, "b")


def test_import_does_not_import_prefect_or_zarr_eagerly_outside_storage():
    code = "import sys, caffe2ckpt, caffe2ckpt.metadata; print('prefect' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_the_license_file_is_the_license_pyproject_names():
    import tomllib
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    assert project["license"] == "Apache-2.0"
    text = (root / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
