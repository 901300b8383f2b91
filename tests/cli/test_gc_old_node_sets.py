"""``caffe2ckpt gc --drop-old-node-sets``: a job resized 2 -> 3 -> 1 nodes (or 4 -> 2 -> 4)
lets the node sets it left go once its current node set has committed epochs of its own;
unrelated jobs on the prefix, the current node set's saves and every group a kept save needs
stay; nothing goes while the newest run of the job has committed nothing; the dry run lists and
removes nothing; and a gc SIGKILLed at several points of its removals loses nothing it keeps and
finishes when run again."""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from caffe2ckpt import Layout, StepCheckpointManager
from caffe2ckpt.cli import main
from caffe2ckpt.fs.location import Location
from caffe2ckpt.history.scan import scan
from caffe2ckpt.store.commit import runs
from caffe2ckpt.store.commit.protocol import CheckpointStore
from tests.elastic.elasticjob import share
from tests.stores import find_leftovers, unreferenced_groups

LAYOUT = Layout(rows=["emb"], replicated=["w"])
ROWS = 12
TWO = ["trainer_0", "trainer_1"]
THREE = ["trainer_0", "trainer_1", "trainer_2"]
ONE = ["trainer_0"]
FOUR = ["t0", "t1", "t2", "t3"]
HALF = ["u0", "u1"]
SOLO = ["solo_0"]
REPO = Path(__file__).resolve().parents[2]


def table(epoch: int) -> np.ndarray:
    return (np.arange(ROWS * 3, dtype=np.float32).reshape(ROWS, 3) + 100 * epoch)


def weights(epoch: int) -> np.ndarray:
    return np.arange(4, dtype=np.float64) * (epoch + 1)


def items(nodes: list[str], epoch: int) -> dict[str, dict[str, np.ndarray]]:
    """What ``nodes`` save at ``epoch``: their range shares of the epoch's table, and the
    weights."""
    return {n: {"emb": share(table(epoch), "range", k, len(nodes)), "w": weights(epoch)}
            for k, n in enumerate(nodes)}


def manager(prefix: str, nodes: list[str], layout: Layout | None = LAYOUT):
    return StepCheckpointManager(prefix, nodes=nodes, layout=layout, handle_preemption=False)


def save(prefix: str, nodes: list[str], epochs, resumes: int | None = None) -> None:
    """``nodes`` restore the newest step they see (it must be ``resumes``), then save
    ``epochs``."""
    with manager(prefix, nodes) as mgr:
        if resumes is not None:
            got = mgr.restore()
            assert mgr.latest_step() == resumes
            assert all(np.array_equal(got[n]["emb"], items(nodes, resumes)[n]["emb"])
                       for n in nodes)
        for epoch in epochs:
            mgr.save(epoch, items(nodes, epoch))


def resized_job(prefix: str, solo: bool = True) -> None:
    """2 nodes save epochs 0-2, 3 nodes resume from 2 and save 3-4, 1 node resumes from 4 and
    saves 5-6; then an unrelated job (solo_0, no layout, the newest run on the prefix) saves
    its own epochs 0-1."""
    save(prefix, TWO, range(3))
    save(prefix, THREE, (3, 4), resumes=2)
    save(prefix, ONE, (5, 6), resumes=4)
    if solo:
        with manager(prefix, SOLO, layout=None) as mgr:
            for epoch in (0, 1):
                mgr.save(epoch, {"solo_0": {"emb": table(epoch) * 2}})


def run(*argv) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()) as err:
        code = main([str(a) for a in argv])
    return code, out.getvalue() + err.getvalue()


def run_json(*argv, code: int = 0) -> dict:
    got, out = run(*argv, "--json")
    assert got == code, out
    return json.loads(out)


def committed(prefix: str, strict: bool = True) -> dict[tuple[str, ...], list[int]]:
    """``caffe2ckpt ls --json``: committed epochs by node set (``strict``: and no other row, no
    partial save, no damage)."""
    doc = run_json("ls", prefix)
    out: dict[tuple[str, ...], list[int]] = {}
    for row in doc["epochs"]:
        assert row["state"] in (("committed",) if strict else ("committed", "partial")), row
        if row["state"] == "committed":
            out.setdefault(tuple(sorted(row["nodes"])), []).append(row["epoch"])
    return {k: sorted(v) for k, v in out.items()}


def files(prefix: str) -> dict[str, bytes]:
    location = Location(prefix)
    fs = location.fs
    return {p: fs.cat_file(p) for p in fs.find(location.root)}


def assert_restores(prefix: str, nodes: list[str], epochs, layout: Layout | None = LAYOUT
                    ) -> None:
    with manager(prefix, nodes, layout) as mgr:
        for epoch in epochs:
            got = mgr.restore(epoch)
            want = items(nodes, epoch)
            for node in nodes:
                assert got[node]["emb"].tobytes() == want[node]["emb"].tobytes(), (node, epoch)
                assert got[node]["w"].tobytes() == want[node]["w"].tobytes(), (node, epoch)


def assert_solo_restores(prefix: str) -> None:
    with manager(prefix, SOLO, layout=None) as mgr:
        for epoch in (0, 1):
            assert mgr.restore(epoch)["solo_0"]["emb"].tobytes() == (table(epoch) * 2).tobytes()


def test_the_old_node_sets_of_a_resized_job_go_and_the_rest_stays(prefix):
    resized_job(prefix)
    before = files(prefix)
    assert committed(prefix) == {tuple(TWO): [0, 1, 2], tuple(THREE): [3, 4], tuple(ONE): [5, 6],
                                 tuple(SOLO): [0, 1]}

    # the dry run: every save of the 2- and 3-node sets, each saying which node set it was
    # and which one replaced it; nothing is removed
    doc = run_json("gc", prefix, "--drop-old-node-sets")
    assert doc["dry_run"] and doc["drop_old_node_sets"]
    assert sorted((tuple(d["nodes"]), d["epoch"]) for d in doc["delete"]) == [
        (tuple(TWO), 0), (tuple(TWO), 1), (tuple(TWO), 2), (tuple(THREE), 3), (tuple(THREE), 4)]
    for d in doc["delete"]:
        assert d["old_node_set"] == {"nodes": d["nodes"], "replaced_by": ONE,
                                     "newest_epoch": 6}
        assert d["why"].startswith(f"old node set {','.join(d['nodes'])} ")
        assert "replaced by trainer_0" in d["why"]
    assert sorted((tuple(k["nodes"]), k["epoch"]) for k in doc["keep"]) == sorted([
        (tuple(ONE), 5), (tuple(ONE), 6), (tuple(SOLO), 0), (tuple(SOLO), 1)])
    [job] = [j for j in doc["node_sets"] if j["old"]]
    assert job == {"current": ONE, "newest_epoch": 6, "old": [TWO, THREE], "letting_go": True,
                   "waiting": None}
    code, text = run("gc", prefix, "--drop-old-node-sets")
    assert code == 0
    assert "old node set trainer_0,trainer_1 (2 nodes), replaced by trainer_0" in text
    assert "would remove" in text and "WHY" in text
    assert files(prefix) == before

    # with --keep-last 1 the current node set and the unrelated job keep their newest only
    doc = run_json("gc", prefix, "--drop-old-node-sets", "--keep-last", 1)
    why = {(tuple(d["nodes"]), d["epoch"]): d["why"] for d in doc["delete"]}
    assert why[(tuple(ONE), 5)] == why[(tuple(SOLO), 0)] == "outside the retention policy"
    assert len(why) == 7 and files(prefix) == before

    doc = run_json("gc", prefix, "--drop-old-node-sets", "--yes")
    assert [d["done"] for d in doc["delete"]] == [True] * 5
    assert committed(prefix) == {tuple(ONE): [5, 6], tuple(SOLO): [0, 1]}
    assert_restores(prefix, ONE, (5, 6))
    assert_solo_restores(prefix)
    store = CheckpointStore(Location(prefix))
    assert unreferenced_groups(store) == [] and find_leftovers(store, min_age=0) == []
    # the next run on other nodes resumes from the current node set
    with manager(prefix, TWO) as mgr:
        assert mgr.latest_step() == 6
    # again: nothing more to let go
    doc = run_json("gc", prefix, "--drop-old-node-sets", "--yes")
    assert doc["delete"] == [] and doc["node_sets"] == []


def test_nothing_goes_while_the_newest_node_set_has_committed_nothing(prefix):
    save(prefix, TWO, range(3))
    with manager(prefix, THREE) as mgr:  # restored, not saved yet: one node set on the prefix
        mgr.restore()
        doc = run_json("gc", prefix, "--drop-old-node-sets", "--yes")
        assert doc["delete"] == []
        mgr.save(3, items(THREE, 3))
    # a run of the one-node set started from epoch 3 and has not committed (killed before its
    # first save, or still in it): the 2-node set stays too
    location = Location(prefix)
    listing = runs.listing(location).numbers
    claim = runs.claim(location, nodes=ONE, parent=(3, max(listing)))
    before = files(prefix)
    doc = run_json("gc", prefix, "--drop-old-node-sets", "--yes")
    assert doc["delete"] == [] and files(prefix) == before
    [job] = doc["node_sets"]
    assert job["letting_go"] is False and job["old"] == [TWO]
    assert f"run {claim.generation} (nodes trainer_0)" in job["waiting"]
    assert "has committed no save" in job["waiting"]
    code, text = run("gc", prefix, "--drop-old-node-sets")
    assert code == 0 and "has committed no save" in text
    # once it has, the 2- and 3-node sets go
    save(prefix, ONE, (4,), resumes=3)
    run_json("gc", prefix, "--drop-old-node-sets", "--yes")
    assert committed(prefix) == {tuple(ONE): [4]}
    assert_restores(prefix, ONE, (4,))


def test_four_two_four_lets_the_two_node_set_go_once_four_commits_again(prefix):
    """4 -> 2 -> 4: the 4-node set resumes its own newest epoch (2), not the 2-node set's (4).
    The node sets are one job by descent (the 2-node set started from a 4-node save), and the
    node set of the job's newest committed save is current, provided no run of another node set
    started after it. While the 2-node set is newest, the 4-node set is the old one; while the
    4-node set's new run has committed nothing, nothing goes."""
    save(prefix, FOUR, range(3))
    save(prefix, HALF, (3, 4), resumes=2)
    doc = run_json("gc", prefix, "--drop-old-node-sets")
    assert sorted({tuple(d["nodes"]) for d in doc["delete"]}) == [tuple(FOUR)]
    # the 4-node job starts again and has not committed: nothing goes, either way
    runs.claim(Location(prefix), nodes=FOUR, parent=(2, 1))
    doc = run_json("gc", prefix, "--drop-old-node-sets", "--yes")
    assert doc["delete"] == [] and "has committed no save" in doc["node_sets"][0]["waiting"]
    with manager(prefix, FOUR) as mgr:
        mgr.restore()
        assert mgr.latest_step() == 2  # its own, not the 2-node set's 4
        for epoch in (3, 4, 5):
            mgr.save(epoch, items(FOUR, epoch))
    doc = run_json("gc", prefix, "--drop-old-node-sets", "--yes")
    assert sorted((tuple(d["nodes"]), d["epoch"]) for d in doc["delete"]) == [
        (tuple(HALF), 3), (tuple(HALF), 4)]
    assert all(d["old_node_set"]["replaced_by"] == FOUR for d in doc["delete"])
    assert committed(prefix) == {tuple(FOUR): [0, 1, 2, 3, 4, 5]}
    assert_restores(prefix, FOUR, range(6))


def test_a_job_back_on_a_node_set_that_went_resumes_from_the_current_one(prefix):
    """4 -> 2, the 4-node set let go: a job back on 4 nodes has no epoch of its own and resumes
    from the 2-node set's newest epoch (not from its own older one, as it would have)."""
    save(prefix, FOUR, range(3))
    save(prefix, HALF, (3, 4), resumes=2)
    doc = run_json("gc", prefix, "--drop-old-node-sets", "--yes")
    assert [d["epoch"] for d in doc["delete"]] == [0, 1, 2]
    save(prefix, FOUR, (5,), resumes=4)
    assert committed(prefix) == {tuple(HALF): [3, 4], tuple(FOUR): [5]}
    run_json("gc", prefix, "--drop-old-node-sets", "--yes")
    assert committed(prefix) == {tuple(FOUR): [5]}
    assert_restores(prefix, FOUR, (5,))


def test_damage_keeps_the_old_node_sets(prefix):
    """A newest epoch of the current node set that fails verification, or a run log entry
    newer than it that cannot be read (it may be a run of the job moving elsewhere), keeps
    every old node set, saying why and where."""
    resized_job(prefix, solo=False)
    location = Location(prefix)
    before = files(prefix)
    [chunk] = [p for p in before if p.endswith("/trainer_0.6/_packed/c.0")]
    damaged = bytearray(before[chunk])
    damaged[len(damaged) // 2] ^= 0xFF
    location.fs.pipe_file(chunk, bytes(damaged))
    doc = run_json("gc", prefix, "--drop-old-node-sets", "--yes", code=1)
    assert doc["delete"] == [] and "fails verification" in doc["refused"]
    assert "job now on nodes ['trainer_0']: its newest epoch, 6" in doc["refused"]
    location.fs.pipe_file(chunk, before[chunk])
    newest = max(runs.listing(location).numbers)
    location.fs.pipe_file(location.path("_runs", f"{newest + 1:012d}.json"), b"{garbage")
    doc = run_json("gc", prefix, "--drop-old-node-sets", "--yes")
    [job] = doc["node_sets"]
    assert doc["delete"] == [] and not job["letting_go"]
    assert f"run log entry {newest + 1} is unreadable" in job["waiting"]
    assert f"{newest + 1:012d}.json" in job["waiting"]  # where


def test_with_node_only_those_nodes_sets_are_let_go(prefix):
    resized_job(prefix)
    before = files(prefix)
    doc = run_json("gc", prefix, "--drop-old-node-sets", "--node", "solo_0", "--yes")
    assert doc["delete"] == [] and files(prefix) == before
    # an old node set with a node not given is kept, saying why
    doc = run_json("gc", prefix, "--drop-old-node-sets", "--node", "trainer_0")
    assert sorted((tuple(d["nodes"]), d["epoch"]) for d in doc["delete"]) == []
    kept = {(tuple(k["nodes"]), k["epoch"]): k["reasons"] for k in doc["keep"]}
    assert any("not given with --node" in r for r in kept[(tuple(TWO), 0)])


# -- kills --------------------------------------------------------------------------------------

GC_SCRIPT = textwrap.dedent('''
    import os
    import signal
    import sys

    sys.path.insert(0, sys.argv[1])
    from caffe2ckpt.cli import main

    # each line: "<kill at> <count file> <caffe2ckpt arguments...>": a child forked from this
    # process (imports paid once) runs caffe2ckpt and SIGKILLs itself just before its
    # <kill at>-th change to the filesystem (an unlink, rmdir, link or replace; 0: never),
    # writing how many it made to <count file>; its pid is printed at once, and its exit status
    # (or killing signal, negative) once the next line asks
    for line in sys.stdin:
        kill_at, count_file, *argv = line.split()
        pid = os.fork()
        if pid == 0:
            os.dup2(os.open(os.devnull, os.O_RDWR), 0)
            os.dup2(0, 1)
            os.dup2(0, 2)
            made = [0]

            def hook(real):
                def changed(*args, **kwargs):
                    made[0] += 1
                    if made[0] == int(kill_at):
                        os.kill(os.getpid(), signal.SIGKILL)
                    return real(*args, **kwargs)
                return changed

            for name in ("unlink", "remove", "rmdir", "link", "replace", "rename"):
                setattr(os, name, hook(getattr(os, name)))
            code = main(argv)
            with open(count_file, "w") as f:
                f.write(str(made[0]))
            os._exit(code)
        print(pid, flush=True)
        sys.stdin.readline()
        _, status = os.waitpid(pid, 0)
        print(os.waitstatus_to_exitcode(status), flush=True)
''')
GC_ARGS = ["gc", "--drop-old-node-sets", "--min-age", "0", "--yes"]
KILL_POINTS = 9


class Forks:
    """The gc fork server of :data:`GC_SCRIPT`."""

    def __init__(self, tmp_path: Path) -> None:
        script = tmp_path / "gc.py"
        script.write_text(GC_SCRIPT)
        self.count = tmp_path / "count"
        self.proc = subprocess.Popen([sys.executable, str(script), str(REPO)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, text=True)

    def gc(self, prefix: Path, kill_at: int) -> int:
        """Run gc on ``prefix`` killed at its ``kill_at``-th change; its exit status."""
        argv = [str(kill_at), str(self.count), GC_ARGS[0], str(prefix), *GC_ARGS[1:]]
        self.proc.stdin.write(" ".join(argv) + "\n")
        self.proc.stdin.flush()
        int(self.proc.stdout.readline())
        self.proc.stdin.write("wait\n")
        self.proc.stdin.flush()
        return int(self.proc.stdout.readline())

    def close(self) -> None:
        self.proc.stdin.close()
        assert self.proc.wait(timeout=60) == 0
        self.proc.stdout.close()


@pytest.mark.slow
def test_sigkill_during_the_removals_loses_nothing_kept(tmp_path):
    """``caffe2ckpt gc --drop-old-node-sets --yes`` in a subprocess SIGKILLed before its n-th
    change to the filesystem, for n spread over all its changes, each time on a fresh copy of
    the resized job's prefix: the 1-node set and the unrelated job still list and restore
    bit-exact, every save of the old node sets still committed is whole (restores bit-exact),
    none half removed is listed as committed, and gc run again finishes the job and leaves no
    leftovers."""
    source = tmp_path / "source"
    resized_job(str(source))
    old = {tuple(TWO): [0, 1, 2], tuple(THREE): [3, 4]}
    ids = {s.save_id for s in scan(CheckpointStore(Location(str(source)))).saves()}
    forks = Forks(tmp_path)
    try:
        whole = tmp_path / "whole"
        shutil.copytree(source, whole, copy_function=os.link)  # gc only unlinks and replaces
        assert forks.gc(whole, 0) == 0
        changes = int(forks.count.read_text())
        assert committed(str(whole)) == {tuple(ONE): [5, 6], tuple(SOLO): [0, 1]}
        points = sorted({1 + (changes - 1) * k // (KILL_POINTS - 1) for k in range(KILL_POINTS)})
        landed = {"between removals": 0, "other": 0, "a partial save left": 0}
        for n in points:
            prefix = tmp_path / f"kill-{n}"
            shutil.copytree(source, prefix, copy_function=os.link)
            assert forks.gc(prefix, n) == -signal.SIGKILL, n
            killed_state(str(prefix), old, ids, landed)
            assert run("gc", prefix, *GC_ARGS[1:])[0] == 0
            assert run("gc", prefix, "--min-age", 0, "--yes")[0] == 0
            assert committed(str(prefix)) == {tuple(ONE): [5, 6], tuple(SOLO): [0, 1]}
            ls = run_json("ls", prefix)
            assert ls["leftovers"] == [], (n, ls["leftovers"])
            store = CheckpointStore(Location(str(prefix)))
            assert unreferenced_groups(store) == [], n
            assert_restores(str(prefix), ONE, (5, 6))
            assert_solo_restores(str(prefix))
        print(f"\n{changes} changes; kills before change {points}: {landed}")
        assert landed["between removals"] >= 3 and landed["a partial save left"] >= 1, landed
    finally:
        forks.close()


def killed_state(prefix: str, old: dict, ids: set[str], landed: dict) -> None:
    """What a killed gc left: the kept node sets whole, and of the old ones only whole saves
    committed."""
    if any(row["state"] == "partial" for row in run_json("ls", prefix)["epochs"]):
        landed["a partial save left"] += 1  # killed between the records of one save
    now = committed(prefix, strict=False)
    assert now.pop(tuple(ONE)) == [5, 6] and now.pop(tuple(SOLO)) == [0, 1]
    assert {s.save_id for s in scan(CheckpointStore(Location(prefix))).saves()} <= ids
    for nodes, epochs in now.items():
        assert set(epochs) <= set(old[nodes]), (nodes, epochs)
        assert_restores(prefix, list(nodes), epochs)
    remaining = sum(len(v) for v in now.values())
    landed["between removals" if 0 < remaining < 5 else "other"] += 1
    assert_restores(prefix, ONE, (5, 6))
    assert_solo_restores(prefix)


@pytest.mark.slow
@pytest.mark.parametrize("prefix", ["s3-moto"], indirect=True)
def test_on_s3(prefix):
    save(prefix, TWO, range(2))
    save(prefix, ONE, (2,), resumes=1)
    run_json("gc", prefix, "--drop-old-node-sets", "--yes")
    assert committed(prefix) == {tuple(ONE): [2]}
    assert_restores(prefix, ONE, (2,))
