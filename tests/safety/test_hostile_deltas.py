"""Hostile differential records and manifests: a chain into another node's group, out of the
prefix, onto itself or forward in time, into another run, a million entries, indices out of
range. Each is a damaged record of its own node and epoch (listed as such, never restored,
never followed by a remover), and nothing else changes."""

from __future__ import annotations

import copy
import hashlib
import json

import numpy as np
import pytest

from caffe2ckpt import (
    CheckpointCorruptedError,
    StepCheckpointManager,
    StepManagerOptions,
)
from caffe2ckpt.cli import main as cli_main
from caffe2ckpt.store.format.records import list_records, record_path
from tests.stores import open_store

OPTIONS = StepManagerOptions(delta_saves=True, delta_min_bytes=1024)


@pytest.fixture
def saved(prefix):
    """Steps 0 (whole), 1 and 2 (deltas, each with a span and an overlay) of nodes n0 and n1;
    returns the expected tables."""
    tables, states = {n: np.zeros((2048, 8), np.float32) for n in ("n0", "n1")}, {}
    with StepCheckpointManager(prefix, options=OPTIONS, handle_preemption=False) as mgr:
        for step in range(3):
            for t in tables.values():
                t[step * 10:(step + 1) * 10] = step + 1
                t[step + 100::200] = step + 1  # a row of every part: each save writes a span
            mgr.save(step, {n: {"t": t} for n, t in tables.items()})
            states[step] = {n: t.copy() for n, t in tables.items()}
    return states


def rewrite(prefix: str, epoch: int, node: str, change) -> None:
    """Replace the record of ``node`` at ``epoch`` by ``change(its JSON)``."""
    store = open_store(prefix)
    ref = next(r for r in list_records(store.location) if (r.epoch, r.node) == (epoch, node))
    path = record_path(store.location, ref)
    data = json.loads(store.location.read_bytes(path, limit=1 << 30))
    store.location.replace_file(path, json.dumps(change(copy.deepcopy(data))).encode())


def _group(name):
    def change(record):
        record["delta"]["groups"][0]["group"] = name
        return record
    return change


# 1.5 MB of record: parsed, then refused for its groups (chains.MAX_GROUPS is 65; a million
# groups are refused by the record's size before parsing). Every command parses it again:
# 100,000 groups (15 MB) cost this test 17 s in CI, 52 parses, for the same refusal.
COUNT = 10_000


def _many_groups(record):
    entry = record["delta"]["groups"][0]
    record["delta"]["groups"] = [dict(entry, group=f"n0.{i}") for i in range(COUNT)]
    return record


def _field(path, value):
    def change(record):
        target = record["delta"]
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value
        return record
    return change


def _other_run(record):
    record["delta"]["groups"][0]["save_id"] = "g999-18eb0000000000000000000"
    return record


HOSTILE = {
    "another node's group": _group("n1.0"),
    "out of the prefix": _group("../elsewhere/n0.0"),
    "a nested path": _group("n0.0/../n0.1"),
    "itself": _group("n0.2"),
    "a newer epoch": _group("n0.7"),
    "another run's save": _other_run,
    "an index out of range": _field(("chains", "t"), [0, 5]),
    "epochs going back": _field(("chains", "t"), [1, 0]),
    "a missing digest": _field(("digests",), {}),
    "an unknown algorithm": _field(("algorithm",), "crc8"),
    "a negative depth": _field(("depth",), -1),
    "a bad metadata digest": _field(("groups", 0, "metadata", "zarr.json"), "00"),
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_a_hostile_delta_record_is_damage_of_its_own_epoch(prefix, saved, name, capsys):
    hostile_record_is_damage(prefix, saved, HOSTILE[name], capsys)


@pytest.mark.parametrize("prefix", ["memory"], indirect=True)  # parsed alike from any store
def test_a_delta_record_of_10000_groups_is_damage_of_its_own_epoch(prefix, saved, capsys):
    hostile_record_is_damage(prefix, saved, _many_groups, capsys)


def hostile_record_is_damage(prefix, saved, change, capsys) -> None:
    rewrite(prefix, 2, "n0", change)
    with StepCheckpointManager(prefix, handle_preemption=False) as reader:
        assert reader.all_steps() == [0, 1]  # epoch 2 is not committed: n0's record is damage
        got = reader.restore(1)
        assert all(np.array_equal(got[n]["t"], saved[1][n]) for n in ("n0", "n1"))
    assert cli_main(["ls", prefix, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["epochs"]
    assert [r["state"] for r in rows if r["epoch"] == 2] == ["damaged record"]
    assert cli_main(["gc", prefix, "--keep-last", "1", "--min-age", "0", "--yes"]) == 0
    capsys.readouterr()
    with StepCheckpointManager(prefix, handle_preemption=False) as reader:
        got = reader.restore(1)  # the newest committed step stays, and loads
        assert all(np.array_equal(got[n]["t"], saved[1][n]) for n in ("n0", "n1"))


def edit_manifest(prefix: str, epoch: int, node: str, change) -> None:
    """Replace the manifest of ``node``'s group at ``epoch`` by ``change(its blob "t" entry
    of the delta section)`` applied in place."""
    store = open_store(prefix)
    record = next(r for r in (store.read_record(ref) for ref in list_records(store.location))
                  if (r.epoch, r.node) == (epoch, node))
    group = store.location.path(record.group, "zarr.json")
    meta = json.loads(store.location.read_bytes(group, limit=1 << 20))
    change(meta["attributes"]["caffe2ckpt"]["delta"]["blobs"]["t"])
    store.location.replace_file(group, json.dumps(meta).encode())


@pytest.mark.parametrize("field, value", [("chain", ["n0.0"]),  # not the record's chain
                                          ("shape", [])])  # a 0-d blob with a row overlay
def test_a_crafted_differential_manifest_is_damage(prefix, saved, field, value):
    edit_manifest(prefix, 2, "n0", lambda entry: entry.__setitem__(field, value))
    with StepCheckpointManager(prefix, handle_preemption=False) as reader:
        with pytest.raises(CheckpointCorruptedError) as caught:
            reader.restore(2)
    assert (caught.value.node, caught.value.epoch) == ("n0", 2)


def test_crafted_retire_notes_cannot_remove_what_they_do_not_own(prefix, saved, monkeypatch,
                                                                 capsys):
    """A retire note is followed only for its own node's groups of its own run, older than
    its epoch, and (like any leftover) after the grace period: a note naming another node's
    group, another run's, a newer one, or the group of a save still in progress removes
    nothing of them (found by review)."""
    from caffe2ckpt.store.commit import protocol

    store = open_store(prefix)
    refs = {(r.epoch, r.node): r for r in list_records(store.location)}
    sid = refs[(2, "n0")].save_id
    with StepCheckpointManager(prefix, options=OPTIONS, handle_preemption=False) as mgr:
        mgr.restore(2)
        with monkeypatch.context() as patch:
            patch.setattr(protocol, "write_record", _refuse)
            for step, first in ((3, "n0"), (4, "n1")):  # leaves n0.3, n1.4 uncommitted, live
                with pytest.raises(Exception, match="refused"):
                    mgr.save(step, {n: {"t": saved[2][n]} for n in (first, *NODES)},
                             force=True)
    groups = {"n0": "n0.3", "n1": "n1.4"}
    progress = {n: store.location.list_names(store.location.path(g)) for n, g in groups.items()}
    pending = {n: json.loads(store.location.read_bytes(
        store.location.path(g, "zarr.json"), limit=1 << 20))["attributes"]["caffe2ckpt"][
            "save_id"] for n, g in groups.items()}
    crafted = {  # record name -> groups: none of them may be removed on its account
        f"000000000009.n0.{sid}.json": {"n1.4": pending["n1"]},  # another node's group
        "000000000009.n0.g77-18eb0000000000000000aaaa.json": {"n0.3": pending["n0"]},  # run
        f"000000000001.n0.{sid}.json": {"n0.3": pending["n0"]},  # newer than the note
    }
    write_notes(store, crafted)
    assert cli_main(["gc", prefix, "--min-age", "0", "--yes"]) == 0
    # a note of its own node and run: followed, but (a save in progress is recent) only
    # after the grace period, like any leftover
    write_notes(store, {f"000000000009.n0.{sid}.json": {"n0.3": pending["n0"]}})
    assert cli_main(["gc", prefix, "--yes"]) == 0
    capsys.readouterr()
    assert {n: store.location.list_names(store.location.path(g))
            for n, g in groups.items()} == progress
    with StepCheckpointManager(prefix, handle_preemption=False) as reader:
        for step in (0, 1, 2):
            got = reader.restore(step)
            assert all(np.array_equal(got[n]["t"], saved[step][n]) for n in ("n0", "n1"))


NODES = ("n0", "n1")


def write_notes(store, notes: dict) -> None:
    for name, groups in notes.items():
        store.location.replace_file(store.location.path("_retired", name),
                                    json.dumps({"groups": groups}).encode())


def _refuse(*args, **kwargs):
    raise OSError("record refused")


def forge(prefix: str, epoch: int, node: str, change) -> None:
    """A forger with write access to everything: ``change(manifest, record)`` edits the group's
    manifest and the record (as JSON) in place, and the record is made to vouch for the new
    ``zarr.json`` (its digest), so only the reader's own checks stand in the way."""
    store = open_store(prefix)
    ref = next(r for r in list_records(store.location) if (r.epoch, r.node) == (epoch, node))
    record_file = record_path(store.location, ref)
    record = json.loads(store.location.read_bytes(record_file, limit=1 << 30))
    group = store.location.path(record["path"], "zarr.json")
    meta = json.loads(store.location.read_bytes(group, limit=1 << 20))
    change(meta["attributes"]["caffe2ckpt"], record)
    raw = json.dumps(meta).encode()
    record["metadata"]["zarr.json"] = hashlib.sha256(raw).hexdigest()
    store.location.replace_file(group, raw)
    store.location.replace_file(record_file, json.dumps(record).encode())


def _span_field(key, value):
    def change(manifest, record):
        manifest["delta"]["spans"]["t"][key] = value
    return change


def _drop_oldest(manifest, record):
    """The chain without its oldest group, in manifest and record alike: rows nobody holds."""
    manifest["delta"]["blobs"]["t"]["chain"].pop(0)
    delta = record["delta"]
    gone = delta["chains"]["t"].pop(0)
    delta["groups"].pop(gone)
    delta["chains"]["t"] = [i - (i > gone) for i in delta["chains"]["t"]]


def _huge(manifest, record):
    """A blob claiming 2**40 rows whose chain holds a few thousand."""
    manifest["delta"]["blobs"]["t"]["shape"] = [2**40, 8]
    record["nbytes"] = record["nbytes"] - 2048 * 8 * 4 + 2**40 * 8 * 4


FORGED = {
    "a span past the blob's rows": _span_field("start", 2047),
    "a span of a billion rows": _span_field("shape", [10**9, 8]),
    "a chain short of rows": _drop_oldest,
    "a blob of 2**40 rows": _huge,
}


@pytest.mark.parametrize("name", sorted(FORGED))
def test_a_forged_span_or_chain_is_damage_never_data(prefix, saved, name):
    """Spans and chains that do not rebuild the blob, behind a record that vouches for them:
    damage naming node, epoch and blob, found before anything that large is allocated."""
    forge(prefix, 2, "n0", FORGED[name])
    with StepCheckpointManager(prefix, handle_preemption=False) as reader:
        with pytest.raises(CheckpointCorruptedError) as caught:
            reader.restore(2, nodes=["n0"])
        got = reader.restore(1)
    assert (caught.value.node, caught.value.epoch) == ("n0", 2)
    assert caught.value.blob in ("t", "zarr.json")
    assert all(np.array_equal(got[n]["t"], saved[1][n]) for n in ("n0", "n1"))
