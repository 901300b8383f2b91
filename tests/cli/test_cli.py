"""The ``caffe2ckpt`` command line on real checkpoint trees (memory:// and local directories):
every command in human and ``--json`` form, damage, retention, wrong arguments and missing
prefixes; plus the installed console script and ``python -m caffe2ckpt.cli`` in subprocesses."""

from __future__ import annotations

import contextlib
import json
import math
import os
import pty
import select
import shutil
import subprocess
import sys
import time
from pathlib import Path

import fsspec.config
import numpy as np
import pytest

from caffe2ckpt import (
    JobRunner,
    LocalSession,
    MultiNodeCheckpointManager,
    StepCheckpointManager,
)
from caffe2ckpt.cli import main
from caffe2ckpt.example import build_job
from caffe2ckpt.fs.location import Location
from caffe2ckpt.history.scan import scan
from caffe2ckpt.metadata import ZarrMetadataHandler
from caffe2ckpt.naming import blob_path
from caffe2ckpt.policy import StepManagerOptions, retained_epochs
from caffe2ckpt.store.commit.protocol import CheckpointStore
from caffe2ckpt.store.commit import runs
from caffe2ckpt.store.format.records import list_records
from tests.stores import gone

NODES = ["trainer_0", "trainer_1"]
EPOCHS = range(6)
BIG = "model/w"  # 1 MiB: its own zarr array; the others are packed


def blobs(node: str, epoch: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng([NODES.index(node), epoch])
    return {
        BIG: rng.normal(size=(1024, 256)).astype(np.float32),
        "model/b": rng.normal(size=8),
        "step": np.int64(epoch),
        "names": np.array([f"{node}-{epoch}", "ü"]),
    }


def metrics(epoch: int) -> dict[str, float]:
    return {"loss": 1.0 / (epoch + 1), "acc": math.nan if epoch == 2 else epoch / 10}


def write_tree(prefix: str, epochs=EPOCHS, nodes=NODES) -> None:
    with StepCheckpointManager(prefix, handle_preemption=False) as mgr:
        for epoch in epochs:
            mgr.save(epoch, {n: blobs(n, epoch) for n in nodes}, metrics=metrics(epoch))


@pytest.fixture
def tree(prefix) -> str:
    """Epochs 0..5 of trainer_0 and trainer_1, committed under ``prefix``."""
    write_tree(prefix)
    return prefix


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def run_json(capsys, *argv: str, code: int = 0) -> dict:
    got, out, err = run(capsys, *argv, "--json")
    assert got == code, (got, out, err)
    return json.loads(out)


def files(prefix: str) -> dict[str, bytes]:
    """Every file under ``prefix`` and its content."""
    loc = Location(prefix)
    return {p: loc.fs.cat_file(p) for p in loc.fs.find(loc.root)}


def flip_chunk(prefix: str, node: str, epoch: int, array: str) -> None:
    loc = Location(prefix)
    group = f"{loc.root}/{node}.{epoch}/{array}"
    chunk = min(p for p in loc.fs.find(group) if p.rsplit("/", 1)[1].startswith("c."))
    data = bytearray(loc.fs.cat_file(chunk))
    data[len(data) // 2] ^= 0x10
    loc.fs.pipe_file(chunk, bytes(data))


def leftover(prefix: str, name: str = "trainer_0.9") -> str:
    """An uncommitted group (a save that died before its record): returns its path."""
    loc = Location(prefix)
    path = f"{loc.root}/{name}/model%2Fw/c.0.0"
    loc.fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
    loc.fs.pipe_file(path, b"x" * 100)
    return path


def assert_loads_exact(prefix: str, epoch: int, nodes=NODES) -> None:
    with StepCheckpointManager(prefix, handle_preemption=False) as mgr:
        restored = mgr.restore(epoch)
    for node in nodes:
        want = blobs(node, epoch)
        assert sorted(restored[node]) == sorted(want)
        for name, value in want.items():
            got = restored[node][name]
            assert (got.dtype, got.shape) == (value.dtype, value.shape)
            assert got.tobytes() == value.tobytes(), (node, epoch, name)


# -- ls ----------------------------------------------------------------------------------------


def test_ls_lists_every_epoch_with_bytes_metrics_and_writer(tree, capsys):
    doc = run_json(capsys, "ls", tree)
    assert doc["committed_epochs"] == list(EPOCHS)
    assert [e["epoch"] for e in doc["epochs"]] == list(EPOCHS)
    for row in doc["epochs"]:
        epoch = row["epoch"]
        assert row["state"] == "committed" and row["nodes"] == NODES
        node_bytes = {n: sum(a.nbytes for a in blobs(n, epoch).values()) for n in NODES}
        assert row["node_bytes"] == node_bytes
        assert row["bytes"] == sum(node_bytes.values())
        assert row["blobs"] == 8
        want = {k: "nan" if math.isnan(v) else v for k, v in metrics(epoch).items()}
        assert row["metrics"] == want
        assert row["writer"]["manager"] == "StepCheckpointManager"
        assert abs(row["created"] - time.time()) < 600
    assert doc["leftovers"] == []

    code, out, err = run(capsys, "ls", tree)
    assert code == 0 and err == ""
    assert "6 committed epochs, newest 5" in out
    header = next(line for line in out.splitlines() if line.startswith("EPOCH"))
    assert header.split() == ["EPOCH", "NODES", "STORED", "SIZE", "METRICS", "CREATED",
                              "WRITER", "STATE"]
    rows = [line for line in out.splitlines() if line.strip()[:1].isdigit()]
    assert len(rows) == 6
    assert "acc=nan loss=0.333333" in rows[2] and rows[2].rstrip().endswith("committed")
    assert "StepCheckpointManager" in rows[0]


def test_ls_shows_partial_saves_damaged_records_and_leftovers(tree, capsys):
    loc = Location(tree)
    refs = {(r.node, r.epoch): r for r in list_records(loc)}
    loc.fs.rm_file(loc.path("_commits", refs["trainer_1", 5].filename))  # partial save
    loc.fs.pipe_file(loc.path("_commits", refs["trainer_0", 4].filename), b"{garbage")
    leftover(tree)

    doc = run_json(capsys, "ls", tree)
    by_epoch = {e["epoch"]: e for e in doc["epochs"]}
    assert doc["committed_epochs"] == [0, 1, 2, 3]
    assert by_epoch[5]["state"] == "partial"
    assert (by_epoch[5]["nodes"], by_epoch[5]["missing_nodes"]) == (["trainer_0"], ["trainer_1"])
    assert by_epoch[4]["state"] == "damaged record"
    assert by_epoch[4]["missing_nodes"] == ["trainer_0"]
    assert refs["trainer_0", 4].filename in by_epoch[4]["error"]
    left = {x["path"]: x for x in doc["leftovers"]}  # trainer_1.5 lost its record
    assert sorted(left) == ["trainer_0.9", "trainer_1.5"]
    assert left["trainer_0.9"]["kind"] == "unidentified data"  # no zarr.json: whose is it?
    assert left["trainer_1.5"]["kind"] == "uncommitted save"  # its zarr.json names the save
    assert left["trainer_0.9"]["bytes"] == 100 and 0 <= left["trainer_0.9"]["age_seconds"] < 600
    assert left["trainer_1.5"]["bytes"] > sum(a.nbytes for a in blobs("trainer_1", 5).values())

    code, out, _ = run(capsys, "ls", tree)
    assert code == 0
    assert "partial (missing trainer_1)" in out
    assert "damaged record (missing trainer_0)" in out
    assert "unidentified data" in out and "trainer_0.9" in out


def test_ls_and_verify_a_prefix_written_by_a_job_runner(prefix, capsys):
    cm = MultiNodeCheckpointManager(prefix, metadata_handler=ZarrMetadataHandler())
    session = LocalSession()
    assert JobRunner(build_job(3), cm).train(session) == 3
    capsys.readouterr()  # the example job prints its losses
    doc = run_json(capsys, "ls", prefix)
    assert doc["committed_epochs"] == [0, 1, 2, 3]
    newest = doc["epochs"][-1]
    assert newest["nodes"] == NODES and newest["stop"] is True
    assert newest["writer"]["session"] == "local"
    assert run_json(capsys, "verify", prefix)["summary"]["ok"] == 8
    for node in NODES:  # the blobs present after init are checkpointed
        shown = run_json(capsys, "show", prefix, "--node", node)["blobs"]
        ws = session.workspace(node)
        names = {b["name"] for b in shown}
        assert {"data/x", "data/y", "model/w", "model/b", "reader/cursor"} <= names <= set(ws)
        assert all(b["bytes"] == ws[b["name"]].nbytes for b in shown)
        assert newest["node_bytes"][node] == sum(b["bytes"] for b in shown)


# -- show --------------------------------------------------------------------------------------


def test_show_lists_blobs_from_metadata(tree, capsys):
    doc = run_json(capsys, "show", tree, "--epoch", 3)
    assert (doc["epoch"], doc["nodes"], doc["verified"]) == (3, NODES, False)
    assert doc["problems"] == []
    got = {(b["node"], b["name"]): b for b in doc["blobs"]}
    assert len(got) == 8
    for node in NODES:
        for name, value in blobs(node, 3).items():
            entry = got[node, name]
            assert entry["dtype"] == value.dtype.str and tuple(entry["shape"]) == value.shape
            assert entry["bytes"] == value.nbytes and entry["checksum"] == "recorded"
            assert entry["storage"] == ("array" if name == BIG else "packed")
    assert got["trainer_0", BIG]["chunks"] == 1 and got["trainer_0", BIG]["path"] == blob_path(BIG)

    newest = run_json(capsys, "show", tree, "--node", "trainer_1")
    assert newest["epoch"] == 5 and {b["node"] for b in newest["blobs"]} == {"trainer_1"}

    code, out, _ = run(capsys, "show", tree, "--epoch", 3, "--node", "trainer_0")
    assert code == 0
    assert "epoch 3" in out and "4 blobs" in out
    line = next(x for x in out.splitlines() if x.startswith("trainer_0  model/w"))
    assert line.split()[2:5] == ["<f4", "(1024,", "256)"] and "crc32c recorded" in line
    assert "array model%2Fw, 1 chunk" in line
    assert "packed @" in next(x for x in out.splitlines() if " step " in x)


def test_show_verify_marks_the_damaged_blob_bad(tree, capsys):
    flip_chunk(tree, "trainer_1", 4, blob_path(BIG))
    assert run_json(capsys, "show", tree, "--epoch", 4, "--node", "trainer_0", "--verify")[
        "problems"] == []
    doc = run_json(capsys, "show", tree, "--epoch", 4, "--verify", code=1)
    states = {(b["node"], b["name"]): b["checksum"] for b in doc["blobs"]}
    assert states.pop(("trainer_1", BIG)) == "bad"
    assert set(states.values()) == {"ok"}
    (problem,) = doc["problems"]
    assert (problem["node"], problem["blob"]) == ("trainer_1", BIG)
    code, out, _ = run(capsys, "show", tree, "--epoch", 4, "--verify")
    assert code == 1
    assert "BAD" in out and "'trainer_1'" in out and "epoch 4" in out and repr(BIG) in out
    assert "DAMAGE FOUND" in out.splitlines()[0] and "verified" not in out.splitlines()[0]

    loc = Location(tree)  # damaged group metadata: found without --verify too
    loc.fs.pipe_file(loc.path("trainer_0.3", "zarr.json"), b"{}")
    doc = run_json(capsys, "show", tree, "--epoch", 3, code=1)
    assert {b["node"] for b in doc["blobs"]} == {"trainer_1"}
    (problem,) = doc["problems"]
    assert (problem["node"], problem["blob"]) == ("trainer_0", "zarr.json")
    assert "'trainer_0'" in problem["error"] and "epoch 3" in problem["error"]


# -- verify ------------------------------------------------------------------------------------


def test_verify_reads_everything_and_names_a_flipped_byte(tree, capsys):
    doc = run_json(capsys, "verify", tree)
    assert doc["summary"] == {"checked": 12, "ok": 12, "damaged": 0, "error": 0,
                              "bytes": sum(a.nbytes for e in EPOCHS for n in NODES
                                           for a in blobs(n, e).values())}
    code, out, err = run(capsys, "verify", tree)
    assert code == 0 and err == "" and "12 of 12 node checkpoints verified ok" in out

    flip_chunk(tree, "trainer_1", 3, blob_path(BIG))
    doc = run_json(capsys, "verify", tree, code=1)
    bad = [r for r in doc["results"] if r["status"] != "ok"]
    assert [(r["epoch"], r["node"], r["status"]) for r in bad] == [(3, "trainer_1", "damaged")]
    (error,) = bad[0]["errors"]
    assert error["blob"] == BIG
    assert "'trainer_1'" in error["error"] and "epoch 3" in error["error"]
    code, out, _ = run(capsys, "verify", tree)
    assert code == 1
    assert "DAMAGED" in out and "11 of 12" in out and repr(BIG) in out

    only = run_json(capsys, "verify", tree, "--epoch", 4)
    assert {(r["epoch"], r["node"]) for r in only["results"]} == {(4, n) for n in NODES}
    doc = run_json(capsys, "verify", tree, "--node", "trainer_1", "--epoch", 3, code=1)
    assert [(r["node"], r["status"]) for r in doc["results"]] == [("trainer_1", "damaged")]
    assert run_json(capsys, "verify", tree, "--node", "trainer_0")["summary"]["ok"] == 6


def test_verify_reports_packed_damage_and_damaged_records(tree, capsys):
    flip_chunk(tree, "trainer_0", 1, "_packed")
    loc = Location(tree)
    (ref,) = [r for r in list_records(loc) if (r.node, r.epoch) == ("trainer_1", 2)]
    loc.fs.pipe_file(loc.path("_commits", ref.filename), b"not json")
    doc = run_json(capsys, "verify", tree, code=1)
    (bad,) = [r for r in doc["results"] if r["status"] != "ok"]
    assert (bad["epoch"], bad["node"]) == (1, "trainer_0")
    assert bad["errors"][0]["blob"] == "model/b"  # a blob the user knows, not '_packed'
    assert set(bad["errors"][0]["packed_blobs"]) == {"model/b", "step", "names"}
    (record,) = doc["unreadable_records"]
    assert (record["epoch"], record["node"], record["record"]) == (2, "trainer_1", ref.filename)
    # epoch 2 is no longer committed, but verify --epoch 2 reports its damaged record
    doc = run_json(capsys, "verify", tree, "--epoch", 2, code=1)
    assert doc["results"] == [] and len(doc["unreadable_records"]) == 1


# -- gc ----------------------------------------------------------------------------------------


def test_gc_dry_run_changes_nothing(tree, capsys):
    leftover(tree)
    before = files(tree)
    doc = run_json(capsys, "gc", tree, "--keep-last", 2, "--keep-every", 3, "--min-age", 0)
    assert doc["dry_run"] is True
    assert [d["epoch"] for d in doc["delete"]] == [1, 2]
    assert {k["epoch"]: k["reasons"] for k in doc["keep"]} == {
        0: ["every 3"], 3: ["every 3"], 4: ["last 2"], 5: ["newest", "last 2"]}
    assert [x["path"] for x in doc["leftovers"]] == ["trainer_0.9"]
    assert doc["bytes_freed"] == 100 + sum(a.nbytes for e in (1, 2) for n in NODES
                                           for a in blobs(n, e).values())
    code, out, _ = run(capsys, "gc", tree, "--keep-last", 2, "--keep-every", 3, "--min-age", 0)
    assert code == 0
    assert "would remove" in out and "--yes" in out and "newest, last 2" in out
    assert files(tree) == before


def test_gc_without_retention_options_removes_only_old_leftovers(tree, capsys):
    leftover(tree)
    doc = run_json(capsys, "gc", tree)  # the leftover is seconds old: --min-age 3600 keeps it
    assert doc["delete"] == [] and doc["leftovers"] == []
    assert all(k["reasons"] == ["no retention rule"] for k in doc["keep"])
    before = files(tree)
    doc = run_json(capsys, "gc", tree, "--min-age", 0, "--yes")
    assert [x["path"] for x in doc["leftovers"]] == ["trainer_0.9"] and doc["delete"] == []
    after = files(tree)
    assert sorted(set(before) - set(after)) == [p for p in before if "/trainer_0.9/" in p]
    assert all(after[p] == before[p] for p in after)


def test_gc_with_no_committed_epoch_removes_the_uncommitted_groups(prefix, capsys):
    write_tree(prefix, epochs=[0])
    loc = Location(prefix)
    for ref in list_records(loc):  # both records lost: epoch 0 was never committed
        loc.fs.rm_file(loc.path("_commits", ref.filename))
    assert run_json(capsys, "ls", prefix)["epochs"] == []
    # the run that wrote them has not been overtaken: it may still be writing, so gc keeps them
    doc = run_json(capsys, "gc", prefix, "--keep-last", 1, "--min-age", 0, "--yes")
    assert (doc["delete"], doc["keep"], doc["leftovers"]) == ([], [], [])
    assert sorted(x["path"] for x in doc["skipped"]) == ["trainer_0.0", "trainer_1.0"]
    assert "may still be writing" in doc["skipped"][0]["reason"]
    runs.claim(loc, nodes=NODES, parent=None)  # a newer run of the job starts
    doc = run_json(capsys, "gc", prefix, "--keep-last", 1, "--min-age", 0, "--yes")
    assert (doc["delete"], doc["keep"], doc["skipped"]) == ([], [], [])
    assert sorted(x["path"] for x in doc["leftovers"]) == ["trainer_0.0", "trainer_1.0"]
    assert all(x["done"] for x in doc["leftovers"])
    assert gone(loc, "trainer_0.0") and gone(loc, "trainer_1.0")


def test_gc_min_age_uses_modification_times(tmp_path, capsys):
    prefix = str(tmp_path / "ckpt")
    write_tree(prefix, epochs=[0])
    path = leftover(prefix)
    assert run_json(capsys, "gc", prefix, "--min-age", 60)["leftovers"] == []
    old = time.time() - 7200
    os.utime(path, (old, old))
    (found,) = run_json(capsys, "gc", prefix)["leftovers"]  # default --min-age 3600
    assert found["path"] == "trainer_0.9" and found["age_seconds"] >= 7200


def test_gc_yes_removes_exactly_the_expected_epochs_and_leftovers(tree, capsys):
    leftover(tree)
    leftover(tree, "trainer_1.7")
    doc = run_json(capsys, "gc", tree, "--keep-last", 2, "--keep-every", 3, "--min-age", 0,
                   "--yes")
    assert doc["dry_run"] is False
    assert [d["epoch"] for d in doc["delete"]] == [1, 2]
    assert not any("error" in d for d in doc["delete"] + doc["leftovers"])
    store = CheckpointStore(Location(tree))
    assert sorted({s.epoch for s in scan(store).saves()}) == [0, 3, 4, 5]
    remaining = files(tree)
    loc = Location(tree)
    groups = {p.split("/")[-1] for p in loc.fs.ls(loc.root, detail=False)}
    removed = {f"{n}.{e}" for n in NODES for e in (1, 2)}  # tombstones: paths stay used
    assert groups == ({f"{n}.{e}" for n in NODES for e in (0, 3, 4, 5)} | removed
                      | {"_commits", "_runs", "_hints", "_retired"})
    assert loc.list_names(loc.path("_retired")) == []  # every removal finished
    assert all(gone(loc, group) for group in removed)
    assert not any("/trainer_0.9/" in p or "/trainer_1.7/" in p for p in remaining)
    for epoch in (0, 3, 4, 5):
        assert_loads_exact(tree, epoch)
    assert run_json(capsys, "verify", tree)["summary"]["ok"] == 8
    again = run_json(capsys, "gc", tree, "--keep-last", 2, "--keep-every", 3, "--min-age", 0)
    assert again["delete"] == [] and again["leftovers"] == []


def test_gc_never_deletes_good_epochs_in_favour_of_a_damaged_newest(tree, capsys):
    flip_chunk(tree, "trainer_1", 5, blob_path(BIG))
    before = files(tree)
    code, out, err = run(capsys, "gc", tree, "--keep-last", 1, "--min-age", 0, "--yes")
    assert code == 1, (out, err)
    assert "REFUSED" in out and "newest one, 5, fails verification" in out
    assert files(tree) == before  # nothing deleted
    doc = run_json(capsys, "gc", tree, "--keep-last", 1, "--min-age", 0, code=1)
    assert doc["delete"] == [] and "trainer_1" in doc["refused"]


def test_gc_keep_best_follows_the_retention_policy(tree, capsys):
    scores = {e: metrics(e) for e in EPOCHS}
    dry = run_json(capsys, "gc", tree, "--keep-best", 4, "--metric", "acc", "--mode", "max")
    assert [d["epoch"] for d in dry["delete"]] == [0, 2]  # epoch 2's acc is NaN: the worst
    doc = run_json(capsys, "gc", tree, "--keep-best", 2, "--metric", "loss", "--mode", "max",
                   "--yes")
    expected = retained_epochs(StepManagerOptions(keep_best=2, best_fn="loss", best_mode="max"),
                               scores)
    assert expected == {0, 1, 5}
    assert [k["epoch"] for k in doc["keep"]] == sorted(expected)
    assert [d["epoch"] for d in doc["delete"]] == [2, 3, 4]
    reasons = {k["epoch"]: k["reasons"] for k in doc["keep"]}
    assert reasons == {0: ["best 2 by loss (max)"], 1: ["best 2 by loss (max)"], 5: ["newest"]}
    assert sorted({s.epoch for s in scan(CheckpointStore(Location(tree))).saves()}) == [0, 1, 5]
    for epoch in (0, 1, 5):
        assert_loads_exact(tree, epoch)


def test_gc_node_never_touches_other_nodes(prefix, capsys):
    for node in NODES:  # two managers, each saving its own node: separate saves
        with StepCheckpointManager(prefix, nodes=[node], handle_preemption=False) as mgr:
            for epoch in range(4):
                mgr.save(epoch, {node: blobs(node, epoch)}, metrics=metrics(epoch))
    before = files(prefix)
    doc = run_json(capsys, "gc", prefix, "--node", "trainer_0", "--keep-last", 1, "--yes",
                   "--min-age", 0)
    assert [(d["epoch"], d["nodes"]) for d in doc["delete"]] == [
        (e, ["trainer_0"]) for e in range(3)]
    after = files(prefix)
    theirs = [p for p in before if "trainer_1" in p]
    assert theirs and all(after.get(p) == before[p] for p in theirs)
    assert all(gone(Location(prefix), f"trainer_0.{e}") for e in range(3))
    assert any("/trainer_0.3/" in p for p in after) and not gone(Location(prefix), "trainer_0.3")
    with StepCheckpointManager(prefix, nodes=["trainer_1"], handle_preemption=False) as mgr:
        assert mgr.all_steps() == [0, 1, 2, 3]


def test_gc_node_never_splits_an_epoch_saved_with_other_nodes(tree, capsys):
    before = files(tree)
    doc = run_json(capsys, "gc", tree, "--node", "trainer_0", "--keep-last", 1, "--yes")
    assert doc["delete"] == []
    reasons = {k["epoch"]: k["reasons"] for k in doc["keep"]}
    assert "saved together with trainer_1" in reasons[0][0]
    assert files(tree) == before


@pytest.mark.parametrize("command", ["gc", "ls", "show", "verify"])
def test_a_folder_that_is_not_a_checkpoint_prefix_is_refused(tmp_path, capsys, command):
    """e.g. the folder above the prefix: gc removes nothing there, and ls does not report
    "0 committed epochs" as if it were an empty prefix."""
    (tmp_path / "python3.11").mkdir()
    (tmp_path / "python3.11" / "os.py").write_text("x")
    extra = ["--min-age", 0, "--yes"] if command == "gc" else []
    code, out, err = run(capsys, command, tmp_path, *extra)
    assert code == 3 and out == ""
    assert "does not look like a checkpoint prefix" in err and str(tmp_path) in err
    assert (tmp_path / "python3.11" / "os.py").exists()


def test_gc_leaves_saves_with_an_unreadable_record_alone(tree, capsys):
    loc = Location(tree)
    (ref,) = [r for r in list_records(loc) if (r.node, r.epoch) == ("trainer_1", 5)]
    loc.fs.pipe_file(loc.path("_commits", ref.filename), b"{")
    before = files(tree)
    doc = run_json(capsys, "gc", tree, "--min-age", 0, "--yes")
    assert doc["leftovers"] == []
    assert [s["path"] for s in doc["skipped"]] == ["trainer_0.5"]
    assert files(tree) == before


# -- diff --------------------------------------------------------------------------------------


def test_diff_reports_changes_and_by_how_much(prefix, capsys):
    w0 = np.linspace(0, 1, 30000, dtype=np.float32)
    w0[5] = np.nan
    w1 = w0.copy()
    w1[[10, 20, 30]] += np.float32([0.5, -2.0, 0.25])
    w1[7] = np.nan  # NaN on one side only
    a = {"w": w0, "same": np.arange(10), "gone": np.int32(3), "dt": np.zeros(3, np.float32),
         "sh": np.zeros(3), "s": np.array(["ab", "cd"]), "big": np.array([0, 2**62], np.int64)}
    b = {"w": w1, "same": np.arange(10), "new": np.ones(2), "dt": np.zeros(3, np.float64),
         "sh": np.zeros(4), "s": np.array(["ab", "ce"]), "big": np.array([0, -2**62], np.int64)}
    with StepCheckpointManager(prefix, handle_preemption=False) as mgr:
        mgr.save(0, {"trainer_0": a, "old": {"x": np.ones(2)}})
        mgr.save(1, {"trainer_0": b, "fresh": {"y": np.ones(2)}})

    doc = run_json(capsys, "diff", prefix, 0, 1)
    assert doc["epochs"] == [0, 1]
    assert (doc["nodes_added"], doc["nodes_removed"]) == (["fresh"], ["old"])
    got = {(x["node"], x["name"]): x for x in doc["blobs"]}
    status = {k: v["status"] for k, v in got.items()}
    assert status == {
        ("trainer_0", "w"): "changed", ("trainer_0", "same"): "same",
        ("trainer_0", "gone"): "removed", ("trainer_0", "new"): "added",
        ("trainer_0", "dt"): "changed", ("trainer_0", "sh"): "changed",
        ("trainer_0", "s"): "changed", ("trainer_0", "big"): "changed",
        ("old", "x"): "removed", ("fresh", "y"): "added"}
    assert doc["summary"] == {"changed": 5, "added": 2, "removed": 2, "same": 1}
    w = got["trainer_0", "w"]
    differ = ~((w0 == w1) | (np.isnan(w0) & np.isnan(w1)))
    assert w["differing"] == int(differ.sum()) == 4 and w["elements"] == 30000
    assert w["nan_mismatches"] == 1
    assert w["max_abs_diff"] == float(np.nanmax(np.abs(w1.astype(np.float64) - w0)[differ]))
    assert got["trainer_0", "big"]["max_abs_diff"] == 2**63  # exact, no int64 overflow
    assert got["trainer_0", "s"]["differing"] == 1 and got["trainer_0", "s"]["max_abs_diff"] is None
    dt = got["trainer_0", "dt"]
    assert (dt["a"]["dtype"], dt["b"]["dtype"], dt["differing"]) == ("<f4", "<f8", None)
    assert got["trainer_0", "sh"]["differing"] is None
    assert got["trainer_0", "same"]["differing"] == 0

    code, out, _ = run(capsys, "diff", prefix, 0, 1)
    assert code == 0
    assert "5 changed, 2 added, 2 removed, 1 same" in out
    assert "4/30000 elements differ, max |b-a| 2" in out and "1 NaN on one side only" in out
    assert "dtype <f4 -> <f8" in out and "shape (3,) -> (4,)" in out
    assert " same " not in out  # unchanged blobs only with --all
    assert "identical" in run(capsys, "diff", prefix, 0, 1, "--all")[1]
    only = run_json(capsys, "diff", prefix, 0, 1, "--node", "fresh")
    assert [(x["node"], x["status"]) for x in only["blobs"]] == [("fresh", "added")]


def test_diff_of_identical_epochs_and_of_damaged_data(tree, capsys):
    doc = run_json(capsys, "diff", tree, 4, 4)
    assert doc["summary"] == {"changed": 0, "added": 0, "removed": 0, "same": 8}
    doc = run_json(capsys, "diff", tree, 3, 4)
    assert doc["summary"]["changed"] == 8
    flip_chunk(tree, "trainer_0", 4, blob_path(BIG))
    code, out, err = run(capsys, "diff", tree, 3, 4)
    assert code == 1 and out == ""
    assert "'trainer_0'" in err and "epoch 4" in err and repr(BIG) in err


# -- wrong arguments, unknown epochs, missing prefixes -----------------------------------------


@pytest.mark.parametrize(("argv", "message"), [
    ([], "required: COMMAND"),
    (["bogus", "x"], "invalid choice: 'bogus'"),
    (["ls"], "required: PREFIX"),
    (["show", "P", "--epoch", "x"], "not an epoch number"),
    (["show", "P", "--epoch", "-1"], "not an epoch number"),
    (["show", "P", "--node", "a/b"], "cannot name checkpoint files"),
    (["diff", "P", "1"], "required: B"),
    (["gc", "P", "--keep-last", "0"], "must be 1 or more"),
    (["gc", "P", "--keep-best", "2"], "--keep-best needs --metric"),
    (["gc", "P", "--metric", "loss"], "--metric is only used with --keep-best"),
    (["gc", "P", "--mode", "median"], "invalid choice: 'median'"),
    (["gc", "P", "--min-age", "soon"], "not a number of seconds"),
    (["gc", "P", "--min-age", "inf"], "must be a finite number"),
    (["ls", "P", "--storage-options", "{bad"], "--storage-options: not valid JSON"),
    (["--storage-options", "[1]", "ls", "P"], "must be a JSON object"),
    (["ls", "foo://x"], "Protocol not known: foo"),
    (["show", "P", "999"], "caffe2ckpt show: error: unrecognized arguments: 999: an epoch is "
                           "given as --epoch 999"),
    (["ls", "P", "--bogus"], "caffe2ckpt ls: error: unrecognized arguments: --bogus"),
    (["materialize", "P", "0", "D", "--consolidate"],
     "materialize: error: the epoch is given as --epoch 0, e.g. caffe2ckpt materialize PREFIX "
     "--epoch 0 DEST"),
    (["materialize", "P", "D"], "the following argument is required: --epoch E"),
])
def test_wrong_arguments_exit_2_with_a_message(memory_fs, capsys, argv, message):
    tree = "memory://wrong-args"
    write_tree(tree, epochs=[0])
    argv = [tree if a == "P" else a for a in argv]
    before = files(tree)
    code, out, err = run(capsys, *argv)
    assert code == 2, (out, err)
    assert message in err and "Traceback" not in err
    if argv and argv[0] in ("ls", "show", "verify", "gc", "diff"):  # the command's usage only
        assert "COMMAND ..." not in err, err
    assert files(tree) == before


@pytest.mark.parametrize(("argv", "meant"), [
    (["lss", "P"], "ls"), (["materialise", "P", "--epoch", "0", "D"], "materialize"),
    (["--json", "verfy", "P"], "verify"), (["gc", "P", "--mode", "mni"], "min"),
])
def test_a_mistyped_choice_gets_a_did_you_mean(capsys, argv, meant):
    """Issue 34 item 5.3: `caffe2ckpt lss` listed the commands without saying which one was
    meant."""
    code, out, err = run(capsys, *argv)
    assert (code, out) == (2, "")
    bad = next(a for a in argv if a not in ("P", "D", "0", "--json", "--epoch", "gc", "--mode"))
    assert f"invalid choice: {bad!r}; did you mean {meant!r}?" in err, err
    code, _, err = run(capsys, "xyzzy", "P")
    assert code == 2 and "invalid choice: 'xyzzy' (choose from" in err and "did you" not in err


def test_unknown_metric_is_a_usage_error(tree, capsys):
    code, _, err = run(capsys, "gc", tree, "--keep-best", 1, "--metric", "lss", "--yes")
    assert code == 2 and "metric 'lss'" in err and "acc, loss" in err
    assert sorted({s.epoch for s in scan(CheckpointStore(Location(tree))).saves()}) == list(EPOCHS)


@pytest.mark.parametrize("argv", [["show", "--epoch", "9"], ["verify", "--epoch", "9"],
                                  ["diff", "0", "9"], ["show", "--epoch", "2", "--verify"]])
def test_unknown_epoch_is_named(tree, capsys, argv):
    if argv[-1] == "--verify":  # epoch 2 loses trainer_1's record: a partial save
        loc = Location(tree)
        (ref,) = [r for r in list_records(loc) if (r.node, r.epoch) == ("trainer_1", 2)]
        loc.fs.rm_file(loc.path("_commits", ref.filename))
    code, out, err = run(capsys, argv[0], tree, *argv[1:])
    assert code == 3 and out == ""
    epoch = argv[-1] if argv[-1] != "--verify" else "2"
    assert f"epoch {epoch} is not committed under {tree!r}" in err
    assert ("trainer_1 have no commit record" if epoch == "2" else "committed epochs: 0-5") in err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_unknown_node_is_named(tree, capsys):
    code, _, err = run(capsys, "show", tree, "--node", "nobody")
    assert code == 3 and "holding node(s) ['nobody']" in err and "trainer_0, trainer_1" in err
    code, _, err = run(capsys, "show", tree, "--epoch", 3, "--node", "nobody")
    assert code == 3 and f"epoch 3 under {tree!r} has no node(s) ['nobody']" in err
    assert "its saves: trainer_0, trainer_1" in err
    code, _, err = run(capsys, "diff", tree, 0, 1, "--node", "nobody")
    assert code == 3 and "'nobody'" in err
    code, _, err = run(capsys, "gc", tree, "--node", "nobody", "--keep-last", 1)
    assert code == 3 and "'nobody'" in err


@pytest.mark.parametrize("command", [["ls"], ["show"], ["verify"], ["gc"], ["diff", "0", "1"]])
def test_missing_prefix_exits_3(prefix, capsys, command):
    code, out, err = run(capsys, command[0], prefix, *command[1:])
    assert (code, out) == (3, "")
    assert err == (f"caffe2ckpt {command[0]}: error: no checkpoints at {prefix!r}: "
                   "it does not exist\n")
    code, out, err = run(capsys, command[0], prefix, *command[1:], "--json")
    assert code == 3 and json.loads(out) == {"error": err.split("error: ", 1)[1].strip(),
                                             "exit_code": 3}


def test_json_option_before_the_command_and_storage_options(tree, capsys):
    code, out, _ = run(capsys, "--json", "--storage-options", '{"skip_instance_cache": true}',
                       "ls", tree)
    assert code == 0 and json.loads(out)["committed_epochs"] == list(EPOCHS)


def test_help_reads_well(capsys):
    code, out, _ = run(capsys, "--help")
    assert code == 0
    for command in ("ls", "show", "verify", "gc", "diff"):
        assert f"    {command} " in out
    assert "examples:" in out and "exit codes:" in out
    for command in ("ls", "show", "verify", "gc", "diff"):
        code, out, _ = run(capsys, command, "--help")
        assert code == 0 and f"usage: caffe2ckpt {command}" in out
        assert f"caffe2ckpt {command} " in out.split("examples:")[1]
        assert "--storage-options JSON" in out and "--json" in out


# -- S3 (a real S3-protocol server) ------------------------------------------------------------


@pytest.mark.slow
def test_storage_options_reach_an_s3_server(s3_server, capsys):
    """--storage-options carries the endpoint and credentials (plain s3:// URLs would go to
    AWS here: the server is not configured as fsspec's default)."""
    bucket = s3_server.new_bucket()
    options = s3_server.options()
    url = f"s3://{bucket}/run"
    with StepCheckpointManager(url, storage_options=options, handle_preemption=False) as mgr:
        for epoch in range(3):
            mgr.save(epoch, {n: blobs(n, epoch) for n in NODES}, metrics=metrics(epoch))
    opts = ["--storage-options", json.dumps(options)]
    assert run_json(capsys, "ls", url, *opts)["committed_epochs"] == [0, 1, 2]
    assert run_json(capsys, "verify", url, *opts)["summary"]["ok"] == 6
    doc = run_json(capsys, "gc", url, *opts, "--keep-last", 1, "--yes")
    assert [d["epoch"] for d in doc["delete"]] == [0, 1]
    assert run_json(capsys, "ls", url, *opts)["committed_epochs"] == [2]
    code, _, err = run(capsys, "ls", f"s3://{bucket}/nothing", *opts)
    assert code == 3 and f"s3://{bucket}/nothing" in err


@pytest.mark.slow
def test_credentials_missing_or_rejected_exit_4_naming_the_url(s3_server, monkeypatch, tmp_path,
                                                              capsys):
    """No credentials anywhere (no AWS_* variables, empty config files, no instance metadata),
    or a key the server does not know: the storage refused, exit 4 naming the URL; an option
    s3fs does not take is still a wrong argument (exit 2)."""
    bucket = s3_server.new_bucket()
    url = f"s3://{bucket}/run"
    with StepCheckpointManager(url, storage_options=s3_server.options(),
                               handle_preemption=False) as mgr:
        for epoch in range(2):
            mgr.save(epoch, {n: blobs(n, epoch) for n in NODES})
    before = s3_server.filesystem().find(bucket)
    for key in [k for k in os.environ if k.startswith("AWS_")]:
        monkeypatch.delenv(key)
    (tmp_path / "empty").write_text("")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "empty"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "empty"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # else botocore asks 169.254.169.254
    monkeypatch.delitem(fsspec.config.conf, "s3", raising=False)
    endpoint = {"endpoint_url": s3_server.endpoint, "skip_instance_cache": True}
    for command in (["ls"], ["show"], ["verify"], ["gc", "--keep-last", "1", "--yes"],
                    ["diff", "0", "1"]):
        argv = [command[0], url, *command[1:], "--storage-options", json.dumps(endpoint)]
        code, out, err = run(capsys, *argv)
        assert (code, out) == (4, ""), err
        assert err.startswith(f"caffe2ckpt {command[0]}: error: cannot use checkpoint prefix "
                              f"{url!r}: no usable credentials: NoCredentialsError"), err
        assert err.count("\n") == 1 and "Traceback" not in err
        assert run_json(capsys, *argv, code=4)["exit_code"] == 4

    wrong_key = json.dumps({**endpoint, "key": "AKIAWRONG", "secret": "wrong"})
    with checking_keys(s3_server):  # the server checks keys, and knows no AKIAWRONG
        code, out, err = run(capsys, "verify", url, "--storage-options", wrong_key)
    assert (code, out) == (4, "")
    assert err.startswith(f"caffe2ckpt verify: error: cannot use checkpoint prefix {url!r}: the "
                          "store rejected the credentials (InvalidAccessKeyId: "), err

    bad_option = json.dumps({**s3_server.options(), "retries": 1, "skip_instance_cache": True})
    code, _, err = run(capsys, "ls", url, "--storage-options", bad_option)
    assert code == 2 and repr(url) in err and "retries" in err, err
    assert s3_server.filesystem().find(bucket) == before  # gc --yes deleted nothing


def checking_keys(s3_server):
    """moto checks keys only with IAM authentication on (it then knows none); SeaweedFS always
    does."""
    if s3_server.kind == "moto":
        from moto.core.authorization import enable_iam_authentication

        return enable_iam_authentication()
    return contextlib.nullcontext()


# -- the installed console script, python -m, and the progress bar ------------------------------


def script() -> str:
    path = shutil.which("caffe2ckpt", path=str(Path(sys.executable).parent))
    assert path, "the caffe2ckpt console script is not installed (pip install -e .)"
    return path


@pytest.mark.slow
def test_console_script_and_python_m_on_a_local_tree(tmp_path):
    prefix = str(tmp_path / "ckpt")
    write_tree(prefix, epochs=range(3))
    out = subprocess.run([script(), "ls", prefix, "--json"], capture_output=True, text=True,
                         timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["committed_epochs"] == [0, 1, 2]
    flip_chunk(prefix, "trainer_0", 1, blob_path(BIG))
    out = subprocess.run([sys.executable, "-m", "caffe2ckpt.cli", "verify", prefix],
                         capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 1 and "DAMAGED" in out.stdout and out.stderr == ""
    out = subprocess.run([script(), "show", str(tmp_path / "missing")], capture_output=True,
                         text=True, timeout=120, check=False)
    assert out.returncode == 3 and out.stdout == ""
    assert out.stderr.strip() == (f"caffe2ckpt show: error: no checkpoints at "
                                  f"{str(tmp_path / 'missing')!r}: it does not exist")


@pytest.mark.slow
def test_progress_bar_only_on_a_terminal(tmp_path, capsys):
    prefix = str(tmp_path / "ckpt")
    write_tree(prefix, epochs=range(2))
    master, slave = pty.openpty()
    try:
        proc = subprocess.Popen([script(), "verify", prefix, "--json"], stdout=subprocess.PIPE,
                                stderr=slave, text=True)
        os.close(slave)
        stdout, _ = proc.communicate(timeout=120)
        seen = b""
        while select.select([master], [], [], 0.5)[0]:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # the terminal closed
                break
            if not chunk:
                break
            seen += chunk
    finally:
        os.close(master)
    assert proc.returncode == 0 and json.loads(stdout)["summary"]["ok"] == 4
    assert b"\rverify [" in seen and b"100%" in seen
    assert seen.endswith(b"\r") and seen.split(b"\r")[-2].strip() == b""  # erased at the end
    assert b"\n" not in seen
    # not a terminal (pytest captures stderr): no progress output at all
    assert run(capsys, "verify", prefix)[2] == ""
