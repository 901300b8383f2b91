"""Prefixes written by storage model 2 (caffe2ckpt at 75dd0ff: staged groups moved into
``<node>.<epoch>``, ``_claims/``, record and manifest format 2; ``tests/fixtures/model2``, made by
``tests/fixtures/make_model2.py``) keep resuming, listing, restoring and collecting with model 3,
and a model-3 run continues them."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from caffe2ckpt import (
    JobRunner,
    LocalSession,
    MultiNodeCheckpointManager,
    StepCheckpointManager,
)
from caffe2ckpt.cli import main as cli_main
from caffe2ckpt.fs.location import Location
from caffe2ckpt.metadata import ZarrMetadataHandler
from tests.fixtures.make_model2 import NODES, build, expected
from tests.stores import gone

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "model2"
FIRST = {e: 1.0 for e in range(1, 7)}  # run A: epochs 1..6 added 1
SECOND = {**FIRST, 4: 10.0}  # run B went back to 3 and re-saved 4 adding 10 (in place)


@pytest.fixture
def job(tmp_path) -> str:
    """A copy of the fixture's job prefix (the fixture itself is never written)."""
    shutil.copytree(FIXTURE / "job", tmp_path / "job")
    return str(tmp_path / "job")


def cli(capsys, *args) -> tuple[int, dict]:
    capsys.readouterr()
    code = cli_main([*map(str, args), "--json"])
    return code, json.loads(capsys.readouterr().out)


def assert_blobs(got: dict, node: str, epoch: int, deltas: dict) -> None:
    """``got`` holds the fixture job's blobs of ``node`` after ``epoch`` (and the epoch
    limiter's counter)."""
    want = expected(node, epoch, deltas)
    extra = set(got) - set(want)
    assert set(want) <= set(got) and all(n.startswith("epoch_limiter") for n in extra), (
        node, epoch, sorted(got))
    for name, value in want.items():
        assert np.asarray(got[name]).tobytes() == value.tobytes(), (node, epoch, name)


def test_the_fixture_is_model_2(job):
    root = Path(job)
    assert (root / "_claims").is_dir() and not (root / "_runs").exists()
    record = json.loads(next((root / "_commits").glob("000000000004.trainer_0.*")).read_text())
    assert record["format"] == 2 and "path" not in record


def test_lineage_listing_and_the_newest_epoch_of_a_model_2_prefix(job, capsys):
    handler = ZarrMetadataHandler()
    handler.set_params(db_prefix=job, db_type="zarr", node_names=NODES)
    assert handler.last_epoch() == 4  # run B's 4, not run A's superseded 6
    with StepCheckpointManager(job, nodes=NODES, handle_preemption=False) as mgr:
        assert mgr.all_steps() == [0, 1, 2, 3, 4] and mgr.latest_step() == 4
        for step in range(5):
            restored = mgr.restore(step)
            for node in NODES:
                assert_blobs(restored[node], node, step, SECOND)
    code, doc = cli(capsys, "ls", job)
    assert code == 0
    states = sorted((row["epoch"], row["state"]) for row in doc["epochs"])
    assert states == [*((e, "committed") for e in range(5)), (5, "superseded"), (6, "superseded")]
    paths = {row["epoch"]: row["paths"] for row in doc["epochs"]}
    assert paths[4] == {n: f"{job}/{n}.4" for n in NODES}  # model 2: always <node>.<epoch>
    code, doc = cli(capsys, "verify", job)
    assert code == 0 and doc["summary"]["ok"] == 14, doc["summary"]
    code, doc = cli(capsys, "show", job)
    assert code == 0 and doc["epoch"] == 4


def test_a_model_3_run_continues_a_model_2_prefix(job, capsys):
    session = LocalSession()
    runner = JobRunner(build(6, 10.0), MultiNodeCheckpointManager(job, pack_threshold=1024))
    assert runner.train(session) == 6 and runner.resumed_from == 4
    for node in NODES:
        ws = session.workspace(node)
        want = expected(node, 6, {**SECOND, 5: 10.0, 6: 10.0})
        assert all(ws[name].tobytes() == value.tobytes() for name, value in want.items())
    runs = sorted(p.name for p in (Path(job) / "_runs").iterdir())
    # after model 2's claims 1 and 2; the run has committed, and the run log says so
    assert runs == ["000000000003.committed.json", "000000000003.json"]
    code, doc = cli(capsys, "ls", job)
    rows = sorted((r["epoch"], r["state"], r["save_ids"][0].split("-")[0]) for r in doc["epochs"])
    assert rows == [*((e, "committed", "g1") for e in range(4)), (4, "committed", "g2"),
                    (5, "committed", "g3"), (5, "superseded", "g1"),
                    (6, "committed", "g3"), (6, "superseded", "g1")]
    # run A's 5 and 6 hold <node>.5 and <node>.6: the new saves wrote paths of their own
    new = {r["epoch"]: r["paths"] for r in doc["epochs"] if r["state"] == "committed"}
    assert all(".g3-" in p for e in (5, 6) for p in new[e].values())
    code, doc = cli(capsys, "gc", job, "--keep-last", 2, "--min-age", 0, "--yes")
    assert code == 0
    assert sorted((d["epoch"], d["superseded"]) for d in doc["delete"]) == [
        (0, False), (1, False), (2, False), (3, False), (4, False), (5, True), (6, True)]
    with StepCheckpointManager(job, nodes=NODES, handle_preemption=False) as mgr:
        assert mgr.all_steps() == [5, 6]
        for node in NODES:
            assert_blobs(mgr.restore(6)[node], node, 6, {**SECOND, 5: 10.0, 6: 10.0})
    assert all(gone(Location(job), p.name) for e in (4, 5) for p in Path(job).glob(f"*.{e}"))


def test_a_model_2_step_manager_prefix_keeps_working(tmp_path):
    shutil.copytree(FIXTURE / "steps", tmp_path / "steps")
    prefix = str(tmp_path / "steps")
    deltas = {e: 1.0 for e in range(1, 6)}
    with StepCheckpointManager(prefix, handle_preemption=False) as mgr:
        assert mgr.all_steps() == [2, 3] and mgr.latest_step() == 3
        assert_blobs(mgr.restore(3)["n"], "n", 3, deltas)
        assert mgr.metrics(2) == {"loss": pytest.approx(1 / 3)}
        assert mgr.save(4, {"n": expected("n", 4, deltas)})
        assert mgr.all_steps() == [2, 3, 4]
    with StepCheckpointManager(prefix, handle_preemption=False) as mgr:
        assert mgr.latest_step() == 4
        assert_blobs(mgr.restore(4)["n"], "n", 4, deltas)
