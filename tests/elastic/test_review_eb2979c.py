"""Regression tests for the defects of the outside review of eb2979c's elastic epochs
(/work/shared/REVIEW_eb2979c_elastic.md), each through the public API.

The rule they hold the library to (docs/elastic.md, "How a save reaches the job's nodes"): one
function decides which save a job resumes and how its blobs reach the job's nodes, from the
whole saved layout (node order, partition, every blob's kind) against the job's. Any difference
reshards, so the result equals the plain numpy model (the global arrays cut anew); what cannot
be resharded is refused naming the blob and both kinds, before anything is written.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest

from caffe2ckpt import (
    Job,
    JobDefinitionError,
    JobRunner,
    Layout,
    LocalSession,
    MultiNodeCheckpointManager,
    Node,
    StepCheckpointManager,
    Task,
    epoch_limiter,
)
from caffe2ckpt.sharding import new_rows

ROWS, COLS = 10, 3
TABLE = np.arange(ROWS * COLS, dtype=np.float32).reshape(ROWS, COLS)
COUNT = "epoch_limiter.0/epochs_done"


def cut(table: np.ndarray, partition: str, index: int, count: int) -> np.ndarray:
    rows = new_rows(partition, index, count, table.shape[0])
    return np.ascontiguousarray(table[rows.start:rows.stop:rows.step])


def put_together(parts: list[np.ndarray], partition: str) -> np.ndarray:
    """The global table whose shares (in node order) are ``parts``: the plain numpy model."""
    total = sum(len(p) for p in parts)
    out = np.empty((total, *parts[0].shape[1:]), parts[0].dtype)
    for k, part in enumerate(parts):
        rows = new_rows(partition, k, len(parts), total)
        out[rows.start:rows.stop:rows.step] = part
    return out


def manager(url: str, nodes: list[str], layout: Layout, **options) -> StepCheckpointManager:
    return StepCheckpointManager(url, nodes=nodes, layout=layout, handle_preemption=False,
                                 **options)


def save_split(url: str, nodes: list[str], layout: Layout, step: int = 0,
               table: np.ndarray = TABLE, pack_threshold: int = 1 << 16,
               **more: np.ndarray) -> None:
    with manager(url, nodes, layout, pack_threshold=pack_threshold) as mgr:
        mgr.save(step, {n: {"emb": cut(table, layout.partition, k, len(nodes)), **more}
                        for k, n in enumerate(nodes)})


# -- D1, D2: the same nodes in another order, or another partition, reshard --------------------

@pytest.mark.parametrize("partition", ["range", "mod"])
def test_the_same_nodes_in_another_order_get_the_table_cut_anew(prefix, partition):
    layout = Layout(rows=["emb"], partition=partition)
    save_split(prefix, ["a", "b", "c"], layout)
    order = ["c", "a", "b"]
    with manager(prefix, order, layout) as mgr:
        got = mgr.restore(0)
        for k, node in enumerate(order):
            assert got[node]["emb"].tobytes() == cut(TABLE, partition, k, 3).tobytes(), node
        mgr.save(1, got)  # recorded in the new order: the global table is unchanged
    with manager(prefix, ["a", "b", "c"], layout) as mgr:
        again = mgr.restore(1)
    assert put_together([again[n]["emb"] for n in "abc"], partition).tobytes() == TABLE.tobytes()


def test_another_partition_on_the_same_nodes_gets_the_table_cut_anew(prefix):
    save_split(prefix, ["a", "b"], Layout(rows=["emb"]))
    mod = Layout(rows=["emb"], partition="mod")
    with manager(prefix, ["a", "b"], mod) as mgr:
        got = mgr.restore(0)
        assert got["a"]["emb"].tobytes() == TABLE[0::2].tobytes()
        assert got["b"]["emb"].tobytes() == TABLE[1::2].tobytes()
        mgr.save(1, got)
    with manager(prefix, ["x"], Layout(rows=["emb"])) as mgr:  # a third node count agrees
        assert mgr.restore(1)["x"]["emb"].tobytes() == TABLE.tobytes()


def job_on(nodes: list[str], epochs: int, partition: str = "range", seen: dict | None = None,
           bump: float = 1.0) -> Job:
    """``nodes`` hold shares of TABLE (split by ``partition`` in their order) and weights ``w``;
    each epoch adds ``bump`` to every row and doubles ``w``. ``seen`` gets each node's ``emb``
    as the first epoch of a train() call finds it."""
    with Job(name="review") as job:
        for k, node in enumerate(nodes):
            def init(ws, k=k):
                ws["emb"] = cut(TABLE, partition, k, len(nodes))
                ws["w"] = np.ones(3)

            def train(ws, node=node):
                if seen is not None and node not in seen:
                    seen[node] = ws["emb"].copy()
                ws["emb"] = ws["emb"] + np.float32(bump)
                ws["w"] = ws["w"] * 2

            with Node(node):
                with job.init_group:
                    Task(init, name="init")
                Task(train, name="train")
        epoch_limiter(job, epochs)
    return job


JOB_LAYOUT = {"rows": ["emb"], "replicated": ["w"]}


@pytest.mark.parametrize("partition", ["range", "mod"])
def test_a_job_runner_with_its_nodes_in_another_order_reshards(prefix, partition, caplog):
    layout = Layout(partition=partition, **JOB_LAYOUT)
    JobRunner(job_on(["t0", "t1", "t2"], 2, partition),
              MultiNodeCheckpointManager(prefix, layout=layout)).train(LocalSession())
    order, seen, session = ["t2", "t0", "t1"], {}, LocalSession()
    runner = JobRunner(job_on(order, 3, partition, seen),
                       MultiNodeCheckpointManager(prefix, layout=layout))
    with caplog.at_level(logging.INFO, logger="caffe2ckpt"):
        assert runner.train(session) == 3  # the limit's count moved to the new first node
    assert runner.resumed_from == 2
    assert "node order" in caplog.text
    table = TABLE + 2
    for k, node in enumerate(order):
        assert seen[node].tobytes() == cut(table, partition, k, 3).tobytes(), node
        assert session.workspace(node)["emb"].tobytes() == cut(TABLE + 3, partition, k,
                                                               3).tobytes()
    assert COUNT in session.workspace("t2") and COUNT not in session.workspace("t0")


def test_a_job_runner_switching_partition_on_the_same_nodes_reshards(prefix):
    JobRunner(job_on(["t0", "t1"], 2), MultiNodeCheckpointManager(
        prefix, layout=Layout(**JOB_LAYOUT))).train(LocalSession())
    seen, session = {}, LocalSession()
    JobRunner(job_on(["t0", "t1"], 3, "mod", seen), MultiNodeCheckpointManager(
        prefix, layout=Layout(partition="mod", **JOB_LAYOUT))).train(session)
    assert seen["t0"].tobytes() == (TABLE + 2)[0::2].tobytes()
    assert seen["t1"].tobytes() == (TABLE + 2)[1::2].tobytes()


# -- D3: the save a JobRunner loads is the one whose epoch it chose ----------------------------

def global_emb(url: str, nodes: list[str], epoch: int, layout: Layout) -> np.ndarray:
    with manager(url, nodes, layout) as mgr:
        got = mgr.restore(epoch)
    return put_together([got[n]["emb"] for n in nodes], layout.partition)


def test_a_job_runner_loads_the_newest_family_it_chose_not_one_holding_its_nodes(prefix):
    layout = Layout(**JOB_LAYOUT)
    JobRunner(job_on(["t0", "t1", "t2"], 5), MultiNodeCheckpointManager(
        prefix, layout=layout)).train(LocalSession())
    JobRunner(job_on(["t0", "t1", "t3"], 5, bump=10.0), MultiNodeCheckpointManager(
        prefix, layout=layout, auto_resume=False)).train(LocalSession())  # a newer run
    expected = global_emb(prefix, ["t0", "t1", "t3"], 5, layout)
    assert expected.tobytes() != global_emb(prefix, ["t0", "t1", "t2"], 5, layout).tobytes()
    seen = {}
    runner = JobRunner(job_on(["t0", "t1"], 6, seen=seen), MultiNodeCheckpointManager(
        prefix, layout=layout))
    runner.train(LocalSession())
    assert runner.resumed_from == 5
    assert put_together([seen["t0"], seen["t1"]], "range").tobytes() == expected.tobytes()


def test_4_2_4_then_1_loads_the_family_of_the_newest_run(prefix, caplog):
    layout = Layout(**JOB_LAYOUT)
    four = [f"t{k}" for k in range(4)]
    JobRunner(job_on(four, 3), MultiNodeCheckpointManager(prefix, layout=layout)).train(
        LocalSession())
    JobRunner(job_on(four[:2], 6, bump=5.0), MultiNodeCheckpointManager(
        prefix, layout=layout)).train(LocalSession())  # 2 nodes: epochs 4-6
    JobRunner(job_on(four, 6, bump=7.0), MultiNodeCheckpointManager(
        prefix, layout=layout)).train(LocalSession())  # back to 4: its own 3, then 4-6
    expected = global_emb(prefix, four, 6, layout)
    seen = {}
    runner = JobRunner(job_on(["t0"], 7, seen=seen), MultiNodeCheckpointManager(
        prefix, layout=layout))
    with caplog.at_level(logging.INFO, logger="caffe2ckpt.runner"):
        runner.train(LocalSession())
    assert "saved by 4 nodes, on 1 node" in caplog.text
    assert seen["t0"].tobytes() == expected.tobytes()


# -- D4: a newer family passed over is named ----------------------------------------------------

def test_a_newer_family_without_a_layout_is_named_when_passed_over(prefix, caplog):
    layout = Layout(rows=["emb"])
    save_split(prefix, ["t0", "t1", "t2", "t3"], layout, step=3)
    with manager(prefix, ["t0", "t1"], layout) as mgr:
        got = mgr.restore(3)
        mgr.save(4, got)
    with StepCheckpointManager(prefix, nodes=["t0", "t1"], handle_preemption=False) as mgr:
        mgr.save(6, got)  # the same nodes, without a layout: no other node count can use it
    caplog.clear()
    with manager(prefix, ["x0", "x1", "x2"], layout) as mgr:
        assert mgr.all_steps() == [3]
    assert "epoch 6 of nodes ['t0', 't1']" in caplog.text
    assert "that save has no layout" in caplog.text


# -- D5: a blob's kind changed on resume: cut anew by the documented rule, or refused -----------

def test_a_replicated_blob_declared_rows_is_split_as_the_global_array(prefix):
    save_split(prefix, ["a", "b"], Layout(rows=["emb"], replicated=["tab"]), tab=TABLE)
    with manager(prefix, ["x", "y", "z"], Layout(rows=["emb", "tab"])) as mgr:
        got = mgr.restore(0)
        assert mgr.item_metadata(0)["y"]["tab"].shape == cut(TABLE, "range", 1, 3).shape
        for k, node in enumerate("xyz"):
            assert got[node]["tab"].tobytes() == cut(TABLE, "range", k, 3).tobytes()
        mgr.save(1, got)
    with manager(prefix, ["q"], Layout(rows=["emb", "tab"])) as mgr:
        assert mgr.restore(1)["q"]["tab"].tobytes() == TABLE.tobytes()  # 10 rows, not 30


def test_a_rows_blob_declared_replicated_gives_every_node_the_global_array(prefix):
    save_split(prefix, ["a", "b", "c"], Layout(rows=["emb"], partition="mod"))
    for nodes in (["a", "b", "c"], ["x", "y"]):
        with manager(prefix, nodes, Layout(replicated=["emb"])) as mgr:
            got = mgr.restore(0)
        assert all(got[n]["emb"].tobytes() == TABLE.tobytes() for n in nodes)


def test_a_replicated_blob_declared_rows_on_the_same_nodes_is_split(prefix):
    with manager(prefix, ["a", "b"], Layout(replicated=["tab"])) as mgr:
        mgr.save(0, {n: {"tab": TABLE} for n in "ab"})
    with manager(prefix, ["a", "b"], Layout(rows=["tab"])) as mgr:
        got = mgr.restore(0)
    assert got["a"]["tab"].tobytes() == TABLE[:5].tobytes()
    assert got["b"]["tab"].tobytes() == TABLE[5:].tobytes()


@pytest.mark.parametrize("declared, saved_as", [
    (Layout(rows=["emb"]), "replicated"),  # "w" now matches no pattern: local
    (Layout(replicated=["w"]), "rows"),  # "emb" now local
])
def test_a_blob_declared_local_that_was_saved_spread_is_refused_naming_it(prefix, declared,
                                                                         saved_as):
    save_split(prefix, ["a", "b"], Layout(rows=["emb"], replicated=["w"]), w=np.ones(2))
    blob = "w" if saved_as == "replicated" else "emb"
    for nodes in (["a", "b"], ["x"]):
        with manager(prefix, nodes, declared) as mgr:
            with pytest.raises(JobDefinitionError) as info:
                mgr.restore(0)
        message = str(info.value)
        assert f"blob {blob!r}" in message and f"saved {saved_as}" in message
        assert "local" in message and "epoch 0" in message


def test_a_single_value_declared_rows_is_refused_naming_it(prefix):
    with manager(prefix, ["a"], Layout(replicated=["lr"])) as mgr:
        mgr.save(0, {"a": {"lr": np.float32(0.1)}})
    with manager(prefix, ["a", "b"], Layout(rows=["lr"])) as mgr:
        with pytest.raises(JobDefinitionError, match=r"blob 'lr'.*saved replicated.*rows.*"
                                                     r"axis 0"):
            mgr.restore(0)


def test_a_job_runner_refuses_a_kind_change_before_it_claims_the_prefix(prefix):
    JobRunner(job_on(["t0", "t1"], 2), MultiNodeCheckpointManager(
        prefix, layout=Layout(**JOB_LAYOUT))).train(LocalSession())
    cm = MultiNodeCheckpointManager(prefix, layout=Layout(rows=["emb"]))  # "w" now local
    location = cm.store.location
    runs = sorted(location.list_names(location.path("_runs")))
    with pytest.raises(JobDefinitionError, match=r"blob 'w'.*saved replicated"):
        JobRunner(job_on(["t0", "t1"], 4), cm).train(LocalSession())
    assert sorted(location.list_names(location.path("_runs"))) == runs


# -- D8: the epoch an elastic lineage starts from -----------------------------------------------

def test_an_elastic_manager_restores_the_epoch_its_history_starts_from(prefix):
    layout = Layout(rows=["emb"])
    save_split(prefix, ["t0", "t1", "t2", "t3"], layout, step=2)
    with manager(prefix, ["u0", "u1"], layout) as mgr:
        got = mgr.restore(2)
        mgr.save(3, got)
        mgr.save(4, got)
    with manager(prefix, ["u0", "u1"], layout) as mgr:
        assert mgr.all_steps() == [2, 3, 4]
        again = mgr.restore(2)
        assert again["u1"]["emb"].tobytes() == TABLE[5:].tobytes()
        with pytest.raises(Exception, match=r"step 1 .*nodes \['u0', 'u1'\].*starts from step 2 "
                                            r"of nodes \['t0', 't1', 't2', 't3'\]"):
            mgr.restore(1)


def test_a_job_runner_goes_back_to_the_epoch_its_history_starts_from(prefix):
    layout = Layout(**JOB_LAYOUT)
    JobRunner(job_on(["t0", "t1", "t2", "t3"], 2), MultiNodeCheckpointManager(
        prefix, layout=layout)).train(LocalSession())
    JobRunner(job_on(["u0", "u1"], 4), MultiNodeCheckpointManager(
        prefix, layout=layout)).train(LocalSession())  # from epoch 2 of the 4 nodes: 3, 4
    seen, session = {}, LocalSession()
    runner = JobRunner(job_on(["u0", "u1"], 4, seen=seen), MultiNodeCheckpointManager(
        prefix, layout=layout), resume_from_epoch=2)
    assert runner.train(session) == 4
    assert runner.resumed_from == 2
    assert put_together([seen["u0"], seen["u1"]], "range").tobytes() == (TABLE + 2).tobytes()
    assert session.workspace("u1")["emb"].tobytes() == cut(TABLE + 4, "range", 1, 2).tobytes()


# -- D9, D10: what an elastic restore reads ------------------------------------------------------

def counting(mgr: StepCheckpointManager) -> list[str]:
    location, paths = mgr._store.location, []
    for name in ("read_bytes", "read_exact"):
        original = getattr(location, name)

        def counted(path, *args, _original=original, **kwargs):
            paths.append(path)
            return _original(path, *args, **kwargs)
        setattr(location, name, counted)
    return paths


def test_an_old_arrays_metadata_is_read_once_per_old_node(prefix, monkeypatch):
    from caffe2ckpt.store.format import manifest

    monkeypatch.setattr(manifest, "ROWS_CHUNK_BYTES", 64)
    table = np.arange(400 * 4, dtype=np.float32).reshape(400, 4)
    old = [f"t{k}" for k in range(4)]
    save_split(prefix, old, Layout(rows=["emb"]), table=table, pack_threshold=16)
    with manager(prefix, ["u0", "u1", "u2"], Layout(rows=["emb"])) as mgr:
        paths = counting(mgr)
        got = mgr.restore(0)
    assert put_together([got[n]["emb"] for n in ["u0", "u1", "u2"]], "range").tobytes() == (
        table.tobytes())
    metadata = [p for p in paths if p.endswith("/emb/zarr.json")]
    assert len(metadata) == len(set(metadata)) == 4, metadata


def test_a_replicated_blob_of_the_first_node_only_is_not_read_for_the_others(prefix):
    layout = Layout(rows=["emb"], replicated=["big"])
    big = np.arange(100_000, dtype=np.float64)
    with manager(prefix, ["t0", "t1"], layout, pack_threshold=1024) as mgr:
        mgr.save(0, {"t0": {"emb": TABLE[:5], "big": big}, "t1": {"emb": TABLE[5:]}})
    with manager(prefix, ["u0", "u1"], layout) as mgr:
        paths = counting(mgr)
        got = mgr.restore(0, nodes=["u1"])
        assert list(got["u1"]) == ["emb"]
        assert not [p for p in paths if "/big/" in p], paths
        assert np.array_equal(mgr.restore(0, nodes=["u0"])["u0"]["big"], big)


# -- what a second reading of the change found ---------------------------------------------------

def test_an_elastic_managers_steps_after_its_first_save_are_its_own_and_its_start(prefix):
    layout = Layout(rows=["emb"])
    with manager(prefix, ["a", "b"], layout) as mgr:
        for step in (1, 2, 3, 9):
            mgr.save(step, {n: {"emb": cut(TABLE, "range", k, 2)} for k, n in enumerate("ab")})
    with manager(prefix, ["y"], layout) as mgr:
        got = mgr.restore(3)
        mgr.save(4, got, force=True)
        assert mgr.all_steps() == [3, 4] and mgr.latest_step() == 4
        assert mgr.save(5, got)  # not skipped as if step 9 of the old nodes were its own
        assert mgr.all_steps() == [3, 4, 5]
        assert mgr.restore()["y"]["emb"].tobytes() == TABLE.tobytes()


def test_a_replicated_blob_some_nodes_hold_stays_at_its_position(prefix):
    with manager(prefix, ["a", "b"], Layout(rows=["emb"], replicated=["r"])) as mgr:
        mgr.save(0, {"a": {"emb": TABLE[:5]}, "b": {"emb": TABLE[5:], "r": np.arange(3)}})
    with manager(prefix, ["a", "b"], Layout(rows=["emb"], replicated=["r"],
                                            partition="mod")) as mgr:
        got = mgr.restore(0)
    assert sorted(got["a"]) == ["emb"] and np.array_equal(got["b"]["r"], np.arange(3))
    with manager(prefix, ["x"], Layout(rows=["emb"], replicated=["r"])) as mgr:
        with pytest.raises(JobDefinitionError, match=r"replicated blob 'r' was held only by "
                                                     r"nodes \['b'\]"):
            mgr.restore(0)


def test_a_blob_a_node_does_not_get_is_not_left_as_it_was(prefix):
    from caffe2ckpt import CheckpointNotFoundError

    with manager(prefix, ["a", "b"], Layout(rows=["emb"], replicated=["r"])) as mgr:
        mgr.save(0, {"a": {"emb": TABLE[:5], "r": np.arange(3)}, "b": {"emb": TABLE[5:]}})
    session = LocalSession()
    for node in ("x", "y"):
        session.workspace(node).update(emb=np.zeros((5, 3), np.float32), r=np.zeros(3, int))
    cm = MultiNodeCheckpointManager(prefix, layout=Layout(rows=["emb"], replicated=["r"]))
    session.run(cm.init(["x", "y"]))  # the blob lists of the workspaces: "r" on both
    with pytest.raises(CheckpointNotFoundError, match=r"node 'y'.*no blobs \['r'\]"):
        session.run(cm.load(0))


def test_local_blobs_kept_through_a_reshard_on_the_same_nodes_are_named(prefix, caplog):
    with manager(prefix, ["a", "b"], Layout(rows=["emb"])) as mgr:
        mgr.save(0, {"a": {"emb": TABLE[:5], "loc": np.arange(2)},
                     "b": {"emb": TABLE[5:], "loc": np.arange(1)}})
    with manager(prefix, ["a", "b"], Layout(rows=["emb", "loc"], partition="mod")) as mgr:
        got = mgr.restore(0)
    assert np.array_equal(got["b"]["loc"], np.arange(1))
    assert "holds ['loc'] saved local to their nodes" in caplog.text


def test_a_job_without_a_layout_is_refused_a_save_with_one_in_another_order(prefix):
    JobRunner(job_on(["t0", "t1", "t2"], 2), MultiNodeCheckpointManager(
        prefix, layout=Layout(**JOB_LAYOUT))).train(LocalSession())
    cm = MultiNodeCheckpointManager(prefix)
    location = cm.store.location
    runs = sorted(location.list_names(location.path("_runs")))
    with pytest.raises(JobDefinitionError, match=r"declares no layout.*layout=caffe2ckpt\."
                                                 r"Layout\(rows=\['emb'\]"):
        JobRunner(job_on(["t2", "t0", "t1"], 4), cm, resume_from_epoch=2).train(LocalSession())
    assert sorted(location.list_names(location.path("_runs"))) == runs
    # in the order that saved it, node by node, as Caffe2 reads
    runner = JobRunner(job_on(["t0", "t1", "t2"], 3), MultiNodeCheckpointManager(prefix))
    assert runner.train(LocalSession()) == 3 and runner.resumed_from == 2


def test_the_caffe2_readers_agree_on_an_epoch_cut_anew(prefix):
    layout = Layout(**JOB_LAYOUT)
    JobRunner(job_on(["t0", "t1"], 1), MultiNodeCheckpointManager(
        prefix, layout=layout)).train(LocalSession())
    nodes = ["t0", "t1", "t2"]
    session = LocalSession()
    cm = MultiNodeCheckpointManager(prefix, layout=layout)
    session.run(cm.init(nodes, retrieve_from_epoch=1))
    session.run(cm.check_db_exists(1))
    assert all(bool(session.workspace(n)["caffe2ckpt/db_exists"]) for n in nodes)
    assert cm.load_blobs_locally(nodes, ["emb"], 1, session)
    parts = [session.workspace(n)["emb"] for n in nodes]
    assert put_together(parts, "range").tobytes() == (TABLE + 1).tobytes()
    # no one group holds what t0 reads at epoch 1: Caffe2's name for its own save of it
    assert cm.get_ckpt_db_name("t0", 1) == f"{cm.url}/t0.1"


def test_a_restore_of_some_blobs_compares_only_their_kinds(prefix):
    save_split(prefix, ["a", "b"], Layout(rows=["emb"], replicated=["w"]), w=np.ones(2))
    with manager(prefix, ["a", "b"], Layout(rows=["emb"])) as mgr:  # "w" now local
        got = mgr.restore(0, blobs=["emb"])
        assert got["b"]["emb"].tobytes() == TABLE[5:].tobytes()
        with pytest.raises(JobDefinitionError, match="blob 'w'"):
            mgr.restore(0)


def test_no_adoption_is_reported_of_a_replicated_blob_some_nodes_hold(prefix, caplog):
    layout = Layout(rows=["emb"], replicated=["r"])
    with manager(prefix, ["a", "b"], layout) as mgr:
        mgr.save(0, {"a": {"emb": TABLE[:5]}, "b": {"emb": TABLE[5:], "r": np.arange(3)}})
        mgr.restore(0)
    assert "saved local" not in caplog.text


def test_a_fortran_table_declared_replicated_is_fortran_on_every_node(prefix):
    table = np.asfortranarray(TABLE)
    with manager(prefix, ["a", "b"], Layout(rows=["emb"])) as mgr:
        mgr.save(0, {"a": {"emb": np.asfortranarray(table[:5])},
                     "b": {"emb": np.asfortranarray(table[5:])}})
    with manager(prefix, ["x", "y", "z"], Layout(replicated=["emb"])) as mgr:
        got = mgr.restore(0)
    for node in "xyz":
        assert got[node]["emb"].flags.f_contiguous and np.array_equal(got[node]["emb"], table)
    got["x"]["emb"][0, 0] = -1  # each node has its own copy
    assert got["y"]["emb"][0, 0] == table[0, 0]


def test_a_job_runners_nodes_read_an_old_arrays_metadata_once(prefix, monkeypatch):
    from caffe2ckpt.store.format import manifest

    monkeypatch.setattr(manifest, "ROWS_CHUNK_BYTES", 64)
    table = np.arange(400 * 4, dtype=np.float32).reshape(400, 4)
    save_split(prefix, ["t0", "t1", "t2", "t3"], Layout(rows=["emb"]), table=table,
               pack_threshold=16)
    session = LocalSession()
    cm = MultiNodeCheckpointManager(prefix, layout=Layout(rows=["emb"]))
    location, paths = cm.store.location, []
    original = location.read_bytes

    def counted(path, *args, **kwargs):
        paths.append(path)
        return original(path, *args, **kwargs)
    location.read_bytes = counted
    nodes = ["u0", "u1", "u2"]
    session.run(cm.init(nodes, retrieve_from_epoch=0))
    session.run(cm.load(0))
    assert put_together([session.workspace(n)["emb"] for n in nodes], "range").tobytes() == (
        table.tobytes())
    metadata = [p for p in paths if p.endswith("/emb/zarr.json")]
    assert len(metadata) == len(set(metadata)) == 4, metadata
