"""``caffe2ckpt verify --node`` and ``show --verify --node`` on a save with a layout (review D7):
a node's replicated blob that another node of its save wrote is read, when the node restores,
from the writer's group; so verifying the node checks it there too, and damage found there is
reported under the node asked for, naming the blob and the writer's group. A run verifying both
nodes reads the writer's blob once."""

from __future__ import annotations

import collections

import numpy as np
import pytest

from caffe2ckpt import CheckpointCorruptedError, Layout, StepCheckpointManager
from caffe2ckpt.fs.location import Location
from caffe2ckpt.store.read import group as groupread
from tests.cli.test_cli import flip_chunk, run, run_json

NODES = ["t0", "t1"]
LAYOUT = Layout(rows=["emb"], replicated=["w"])
BIG_W = np.arange(1 << 17, dtype=np.float64)  # 1 MiB: an array of its own in t0's group
SMALL_W = np.arange(16, dtype=np.float64)  # packed


def save(prefix: str, w: np.ndarray) -> None:
    """Epoch 1 of ``t0`` and ``t1``: ``w`` replicated (written by t0 only), 4 rows each of
    ``emb``."""
    with StepCheckpointManager(prefix, nodes=NODES, layout=LAYOUT,
                               handle_preemption=False) as mgr:
        mgr.save(1, {n: {"emb": np.full((4, 3), k, np.float32), "w": w}
                     for k, n in enumerate(NODES)})


def damaged_w(prefix: str, w: np.ndarray) -> str:
    """Flip a byte of ``w`` in writer t0's group; return that group's name."""
    flip_chunk(prefix, "t0", 1, "w" if w is BIG_W else "_packed")
    return "t0.1"


@pytest.mark.parametrize("w", [BIG_W, SMALL_W], ids=["array", "packed"])
def test_an_undamaged_save_verifies_ok_on_every_node(prefix, capsys, w):
    save(prefix, w)
    assert run_json(capsys, "verify", prefix)["summary"]["ok"] == 2
    for node in NODES:
        doc = run_json(capsys, "verify", prefix, "--node", node)
        assert [(r["node"], r["status"]) for r in doc["results"]] == [(node, "ok")]
        doc = run_json(capsys, "show", prefix, "--epoch", 1, "--verify", "--node", node)
        assert doc["problems"] == []
    code, out, _ = run(capsys, "verify", prefix, "--node", "t1")
    assert code == 0 and "1 of 1 node checkpoint verified ok" in out


@pytest.mark.parametrize("w", [BIG_W, SMALL_W], ids=["array", "packed"])
def test_damage_in_the_writers_group_fails_the_node_that_borrows_it(prefix, capsys, w):
    save(prefix, w)
    group = damaged_w(prefix, w)
    with StepCheckpointManager(prefix, nodes=NODES, layout=LAYOUT, handle_preemption=False
                               ) as mgr, pytest.raises(CheckpointCorruptedError):
        mgr.restore(1, nodes=["t1"])  # what verify --node t1 must foresee

    doc = run_json(capsys, "verify", prefix, "--node", "t1", code=1)
    (result,) = doc["results"]
    assert (result["node"], result["status"]) == ("t1", "damaged")
    (error,) = [e for e in result["errors"] if e["blob"] == "w"]
    assert error["writer"] == "t0" and error["path"].endswith(group)
    assert "'w'" in error["error"] and group in error["error"] and "'t0'" in error["error"]
    code, out, _ = run(capsys, "verify", prefix, "--node", "t1")
    assert code == 1 and "0 of 1 node checkpoint verified ok" in out and "'w'" in out

    doc = run_json(capsys, "show", prefix, "--epoch", 1, "--verify", "--node", "t1", code=1)
    (problem,) = [p for p in doc["problems"] if p["blob"] == "w"]
    assert problem["node"] == "t1" and group in problem["error"]
    code, out, _ = run(capsys, "show", prefix, "--epoch", 1, "--verify", "--node", "t1")
    assert code == 1 and "DAMAGE FOUND" in out and "'w'" in out and group in out

    doc = run_json(capsys, "verify", prefix, code=1)  # both nodes: each is damaged
    assert {r["node"]: r["status"] for r in doc["results"]} == {"t0": "damaged",
                                                                "t1": "damaged"}
    doc = run_json(capsys, "show", prefix, "--epoch", 1, "--verify", code=1)
    assert {p["node"] for p in doc["problems"]} == {"t0", "t1"}


@pytest.mark.parametrize("w", [BIG_W, SMALL_W], ids=["array", "packed"])
def test_verifying_both_nodes_reads_the_writers_blob_once(prefix, capsys, monkeypatch, w):
    """Plain ``verify`` and ``show --verify`` read no chunk twice (as before they checked
    borrowed blobs); ``verify --node t1`` reads t0's ``w`` too."""
    save(prefix, w)
    reads: collections.Counter = collections.Counter()  # chunk file -> times read
    chunk = groupread._read_chunk

    def counted(location, manifest, where, blob, path, *args):
        reads[path] += 1
        return chunk(location, manifest, where, blob, path, *args)

    monkeypatch.setattr(groupread, "_read_chunk", counted)
    for argv in (("verify", prefix), ("verify", prefix, "--node", "t1", "--node", "t0"),
                 ("show", prefix, "--epoch", 1, "--verify")):
        reads.clear()
        run_json(capsys, *argv)
        assert reads and max(reads.values()) == 1, reads
    reads.clear()
    run_json(capsys, "verify", prefix, "--node", "t1")
    assert max(reads.values()) == 1
    assert any("/t0.1/" in path for path in reads)  # w, where t1's restore reads it


def test_a_writers_damaged_metadata_fails_the_node_that_borrows_from_it(prefix, capsys):
    save(prefix, SMALL_W)
    location = Location(prefix)
    location.fs.pipe_file(location.path("t0.1", "zarr.json"), b"{}")
    doc = run_json(capsys, "verify", prefix, "--node", "t1", code=1)
    (result,) = doc["results"]
    assert result["status"] == "damaged"
    (error,) = result["errors"]
    assert error["blob"] == "w" and error["writer"] == "t0" and "metadata" in error["error"]
    doc = run_json(capsys, "show", prefix, "--epoch", 1, "--verify", "--node", "t1", code=1)
    assert [(p["node"], p["blob"]) for p in doc["problems"]] == [("t1", "w")]
