"""A prefix written at 1aeae9c (run-log entries of format 1, no committed marks; see
tests/fixtures/make_model3_format1.py) reads as it was written: a run of format 1 took over its
job's history when it claimed, so what it superseded stays superseded, also once its own records
are gone; a new run continues it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np

from caffe2ckpt import JobRunner, LocalSession, MultiNodeCheckpointManager, StepCheckpointManager
from caffe2ckpt.cli import main as cli_main
from caffe2ckpt.metadata import ZarrMetadataHandler
from tests.fixtures.make_model3_format1 import build

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "model3_format1" / "job"


def _copy(tmp_path: Path) -> str:
    shutil.copytree(FIXTURE, tmp_path / "job")
    return str(tmp_path / "job")


def _last_epoch(prefix: str) -> int | None:
    handler = ZarrMetadataHandler()
    handler.set_params(db_prefix=prefix, db_type="zarr", node_names=["n"])
    return handler.last_epoch()


def _rows(prefix: str, capsys) -> list[tuple[int, str, str]]:
    assert cli_main(["ls", prefix, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    return sorted((r["epoch"], r["state"], r["save_ids"][0].split("-")[0]) for r in doc["epochs"])


def test_a_format_1_history_reads_as_it_was_written(tmp_path, capsys):
    prefix = _copy(tmp_path)
    assert _last_epoch(prefix) == 3
    assert _rows(prefix, capsys) == [(0, "committed", "g1"), (1, "committed", "g1"),
                                     (2, "committed", "g1"), (3, "committed", "g3"),
                                     (3, "superseded", "g1"), (4, "superseded", "g1")]
    with StepCheckpointManager(prefix, handle_preemption=False) as mgr:
        assert mgr.all_steps() == [0, 1, 2, 3]
        assert np.array_equal(mgr.restore(3)["n"]["w"], np.full(16, 3.0))


def test_a_format_1_run_keeps_what_it_superseded_when_its_records_go(tmp_path, capsys):
    prefix = _copy(tmp_path)
    (record,) = Path(prefix, "_commits").glob("000000000003.n.g3-*.json")
    record.unlink()
    assert _last_epoch(prefix) == 2  # never run 1's superseded 3 or 4
    assert _rows(prefix, capsys) == [(0, "committed", "g1"), (1, "committed", "g1"),
                                     (2, "committed", "g1"), (3, "superseded", "g1"),
                                     (4, "superseded", "g1")]


def test_a_new_run_continues_a_format_1_prefix(tmp_path, capsys):
    prefix = _copy(tmp_path)
    runner = JobRunner(build(5), MultiNodeCheckpointManager(prefix))
    session = LocalSession()
    assert runner.train(session) == 5 and runner.resumed_from == 3
    assert np.array_equal(session.workspace("n")["w"], np.full(16, 5.0))
    rows = _rows(prefix, capsys)
    assert [(e, g) for e, s, g in rows if s == "committed"] == [
        (0, "g1"), (1, "g1"), (2, "g1"), (3, "g3"), (4, "g4"), (5, "g4")]
