"""Workspace values, node/epoch validation and blob-path escaping (pure functions)."""

from __future__ import annotations

import numpy as np
import pytest

from caffe2ckpt import InvalidBlobError, InvalidLocationError, Workspace, get_ckpt_filename
from caffe2ckpt.naming import blob_path, check_epoch, check_node_name


@pytest.mark.parametrize("value", [3, 2.5, True, 1 + 2j, np.float16(1.5), np.uint8(7)])
def test_scalars_become_0d_arrays(value):
    ws = Workspace()
    ws["s"] = value
    assert isinstance(ws["s"], np.ndarray) and ws["s"].shape == ()
    assert ws["s"].item() == value


@pytest.mark.parametrize("value", [np.array([object()]), [1, 2], None, {"a": 1},
                                   np.zeros(2, dtype=[("a", "i4")]),
                                   np.array(["2020-01-01"], dtype="datetime64[D]"),
                                   np.zeros(3, np.longdouble), np.zeros(3, np.clongdouble)])
def test_unsupported_values_name_the_blob(value):
    with pytest.raises(InvalidBlobError, match="'bad/blob'"):
        Workspace()["bad/blob"] = value


@pytest.mark.parametrize("name", ["", 3, None])
def test_bad_blob_names(name):
    with pytest.raises(InvalidBlobError):
        Workspace()[name] = 1


@pytest.mark.parametrize("node", ["", ".", "..", "a/b", "a\\b", "_reserved", "x" * 129, "t\n"])
def test_bad_node_names(node):
    with pytest.raises(InvalidLocationError):
        check_node_name(node)


@pytest.mark.parametrize("epoch", [-1, 1.0, "3", True, 10**12, None])
def test_bad_epochs(epoch):
    with pytest.raises(InvalidLocationError):
        check_epoch(epoch)


def test_ckpt_filename_is_unpadded():
    assert get_ckpt_filename("trainer_0", 10) == "trainer_0.10"


@pytest.mark.parametrize("name,path", [
    ("w", "w"), ("fc1_w", "fc1_w"), ("a/b:0", "a%2Fb%3A0"), ("..", "%2E."), (".", "%2E"),
    ("_packed", "%5Fpacked"), ("100%", "100%25"), ("über", "%C3%BCber"),
])
def test_blob_path_escaping(name, path):
    assert blob_path(name) == path


def test_long_names_are_hashed_and_distinct():
    a, b = "x" * 200 + "a", "x" * 200 + "b"
    assert len(blob_path(a)) <= 120 and blob_path(a) != blob_path(b)
    assert "~" in blob_path(a) and "/" not in blob_path("/" * 300)


@pytest.mark.parametrize("value", [np.ma.masked_array([1.0, 2.0], mask=[False, True]),
                                   np.array([[1, 2]]).view(np.matrix)])
def test_ndarray_subclasses_that_a_restore_would_change_are_refused(value):
    with pytest.raises(InvalidBlobError, match=rf"'bad/blob'.*{type(value).__name__}"):
        Workspace()["bad/blob"] = value


def test_a_memmap_is_stored_as_its_data(tmp_path):
    mapped = np.memmap(tmp_path / "m", dtype=np.float32, mode="w+", shape=(3,))
    mapped[:] = [1, 2, 3]
    ws = Workspace()
    ws["m"] = mapped
    assert type(ws["m"]) is np.ndarray and ws["m"].tolist() == [1, 2, 3]
    del mapped, ws
