"""Elastic epochs through the public API: what a layout refuses and why, listing and saving
after an elastic restore, the declared layout's checks, the split arithmetic, and a JobRunner
job saved by 4 nodes resumed on 2 (both partitions)."""

from __future__ import annotations

import itertools
import logging

import numpy as np
import pytest

from caffe2ckpt import (
    JobDefinitionError,
    JobRunner,
    Layout,
    LocalSession,
    MultiNodeCheckpointManager,
    StepCheckpointManager,
    StepManagerOptions,
)
from caffe2ckpt.sharding import new_rows
from caffe2ckpt.steps import BlobMetadata
from tests.elastic.elasticjob import assert_holds_reference, build, layout, share

COUNTS = (1, 2, 3, 4, 8)


def test_a_local_blob_is_refused_naming_it_and_both_node_counts(prefix):
    layout = Layout(rows=["emb"])
    with StepCheckpointManager(prefix, nodes=["a", "b"], layout=layout,
                               handle_preemption=False) as mgr:
        mgr.save(0, {n: {"emb": np.zeros((4, 2)), "opt_state": np.ones(3)} for n in "ab"})
    with StepCheckpointManager(prefix, nodes=["x"], layout=layout,
                               handle_preemption=False) as mgr:
        with pytest.raises(JobDefinitionError) as info:
            mgr.restore(0)
    message = str(info.value)
    assert "'opt_state'" in message and "2 nodes" in message and "on 1 node " in message
    assert "replicated=[...]" in message
    # the nodes that saved it restore it as ever
    with StepCheckpointManager(prefix, nodes=["a", "b"], layout=layout,
                               handle_preemption=False) as mgr:
        assert np.array_equal(mgr.restore(0)["b"]["opt_state"], np.ones(3))


def test_a_save_without_a_layout_is_not_resumed_on_other_nodes_and_a_warning_says_so(
        prefix, caplog):
    with StepCheckpointManager(prefix, nodes=["a", "b"], handle_preemption=False) as mgr:
        mgr.save(0, {n: {"emb": np.zeros((4, 2))} for n in "ab"})
    with StepCheckpointManager(prefix, nodes=["x"], layout=Layout(rows=["emb"]),
                               handle_preemption=False) as mgr:
        assert mgr.all_steps() == []  # nothing of another node count to resume from
        with StepCheckpointManager(prefix, handle_preemption=False) as reader:
            assert reader.all_steps() == [0]
    assert ("not resuming nodes ['x'] from epoch 0 of nodes ['a', 'b']: that save has no "
            "layout") in caplog.text


def test_no_warning_about_another_node_count_once_the_nodes_have_steps_of_their_own(
        prefix, caplog):
    with StepCheckpointManager(prefix, nodes=["a", "b"], handle_preemption=False) as mgr:
        mgr.save(0, {n: {"emb": np.zeros((4, 2))} for n in "ab"})  # no layout
    with StepCheckpointManager(prefix, nodes=["x"], layout=Layout(rows=["emb"]),
                               handle_preemption=False) as mgr:
        mgr.save(1, {"x": {"emb": np.ones((8, 2))}})
    caplog.clear()
    with StepCheckpointManager(prefix, nodes=["x"], layout=Layout(rows=["emb"]),
                               handle_preemption=False) as mgr:
        assert mgr.all_steps() == [1]  # its own: nothing of another node count is looked at
    assert "not resuming" not in caplog.text


def test_saves_after_an_elastic_restore_continue_and_keep_the_old_family(prefix, caplog):
    layout = Layout(rows=["emb"], replicated=["w"])
    old = {f"t{k}": {"emb": np.full((5, 2), k, np.int32), "w": np.arange(3)} for k in range(4)}
    with StepCheckpointManager(prefix, nodes=list(old), layout=layout,
                               options=StepManagerOptions(max_to_keep=1),
                               handle_preemption=False) as mgr:
        for epoch in range(3):
            mgr.save(epoch, old)
    with StepCheckpointManager(prefix, nodes=["u0", "u1"], layout=layout,
                               options=StepManagerOptions(max_to_keep=1),
                               handle_preemption=False) as mgr:
        got = mgr.restore()
        assert got["u0"]["emb"].ravel().tolist() == [0] * 10 + [1] * 10
        for epoch in (3, 4):
            mgr.save(epoch, got)
        assert mgr.all_steps() == [2, 4]  # its own, and the step its lineage starts from
    with StepCheckpointManager(prefix, nodes=list(old), layout=layout,
                               handle_preemption=False) as mgr:
        assert mgr.all_steps() == [2]  # the old family's newest save, kept
        assert np.array_equal(mgr.restore(2)["t3"]["emb"], old["t3"]["emb"])
    # going back to 4 nodes goes back to their own step, and says so, once per manager
    warning = ("nodes ['t0', 't1', 't2', 't3'] resume from their own newest epoch 2, not from "
               "epoch 4 that nodes ['u0', 'u1'] saved later")
    assert caplog.text.count(warning) == 1
    with StepCheckpointManager(prefix, nodes=list(old), layout=layout,
                               handle_preemption=False) as mgr:
        for _ in range(3):
            mgr.all_steps(read=True)
        assert caplog.text.count(warning) == 2
        mgr.delete(2)  # with none of its own, it lists the other node count's steps again
        assert mgr.all_steps() == [4]


def test_layouts_are_checked_when_declared():
    with pytest.raises(JobDefinitionError, match="partition='rows'"):
        Layout(partition="rows")
    with pytest.raises(JobDefinitionError, match="glob patterns"):
        Layout(rows=[""])
    with pytest.raises(JobDefinitionError, match="matches both"):
        Layout(rows=["e*"], replicated=["*b"]).kind("emb")
    assert Layout(rows="emb").rows == ("emb",)
    assert [Layout(rows=["emb_*"], replicated=["w?"]).kind(n) for n in ("emb_1", "w1", "x")] == [
        "rows", "replicated", "local"]
    # epoch_limiter's blobs are replicated unless a pattern says otherwise
    assert Layout().kind("epoch_limiter.0/epochs_done") == "replicated"
    assert Layout(rows=["epoch*"]).kind("epoch_limiter.1/stop") == "rows"


def test_overlap_is_the_intersection_of_two_splits():
    from caffe2ckpt.sharding import old_rows, overlap

    for total, n, m, old_p, new_p in itertools.product(range(0, 40, 3), COUNTS, COUNTS,
                                                       ("range", "mod"), ("range", "mod")):
        sources = old_rows(old_p, [len(new_rows(old_p, k, n, total)) for k in range(n)])
        for j in range(m):
            target = new_rows(new_p, j, m, total)
            got = []
            for source in sources:
                pair = overlap(source, target)
                if pair is not None:
                    assert [source[i] for i in pair[0]] == [target[i] for i in pair[1]]
                    got += [target[i] for i in pair[1]]
            assert sorted(got) == list(target)


@pytest.mark.parametrize("partition", ["range", "mod"])
def test_a_job_saved_by_4_nodes_resumes_on_2_and_on_8(prefix, partition, caplog):
    session = LocalSession()
    JobRunner(build(4, 3, partition), MultiNodeCheckpointManager(prefix, layout=layout(
        partition))).train(session)
    for m, epochs in ((2, 5), (8, 7)):
        session = LocalSession()
        runner = JobRunner(build(m, epochs, partition),
                           MultiNodeCheckpointManager(prefix, layout=layout(partition)))
        with caplog.at_level(logging.INFO, logger="caffe2ckpt.runner"):
            runner.train(session)
        saved_by = 4 if m == 2 else 2
        assert runner.resumed_from == epochs - 2
        assert f"saved by {saved_by} nodes, on {m} nodes" in caplog.text
        assert_holds_reference(session, partition, m, epochs)
        caplog.clear()
    cm = MultiNodeCheckpointManager(prefix, layout=layout(partition))
    cm.set_params([f"trainer_{k}" for k in range(4)])
    assert cm.get_resume_from_epoch_id() == 3  # as plan_run asks before the runner does
    runner = JobRunner(build(4, 9, partition), cm)  # 4 -> 2 -> 8 -> 4: back to its own epoch 3
    runner.train(LocalSession())
    assert runner.resumed_from == 3
    assert caplog.text.count("resume from their own newest epoch 3, not from epoch 7 that nodes "
                             "['trainer_0', 'trainer_1', 'trainer_2', 'trainer_3', "
                             "'trainer_4'") == 1


@pytest.mark.parametrize("partition", ["range", "mod"])
def test_an_elastic_resume_falls_back_past_a_damaged_newest_epoch(tmp_path, partition):
    """As a resume on the same nodes does: epoch 3 of the 4-node job is damaged, so the job
    resumed on 2 nodes starts from epoch 2, bit-exact."""
    url = str(tmp_path / "ckpt")
    JobRunner(build(4, 3, partition), MultiNodeCheckpointManager(url, layout=layout(
        partition))).train(LocalSession())
    chunk = sorted(p for p in (tmp_path / "ckpt" / "trainer_1.3").rglob("c*") if p.is_file())[0]
    data = bytearray(chunk.read_bytes())
    data[0] ^= 0xFF
    chunk.write_bytes(bytes(data))
    session = LocalSession()
    runner = JobRunner(build(2, 5, partition), MultiNodeCheckpointManager(url, layout=layout(
        partition)))
    runner.train(session)
    assert runner.resumed_from == 2
    assert_holds_reference(session, partition, 2, 5)


def test_a_job_with_a_local_blob_is_refused_before_it_claims_the_prefix(prefix):
    JobRunner(build(2, 2), MultiNodeCheckpointManager(prefix, layout=Layout(rows=["emb"]))
              ).train(LocalSession())
    cm = MultiNodeCheckpointManager(prefix, layout=Layout(rows=["emb"]))
    runs = sorted(cm.store.location.list_names(cm.store.location.path("_runs")))
    with pytest.raises(JobDefinitionError, match=r"saved by 2 nodes.*on 3 nodes.*blobs "
                       r"\['w'\] are local.*or resume on the nodes that saved it"):
        JobRunner(build(3, 4), cm).train(LocalSession())
    assert sorted(cm.store.location.list_names(cm.store.location.path("_runs"))) == runs


def forged(tmp_path, node: str, change) -> tuple[object, object]:
    """A save of nodes a and b with a layout, node ``node``'s record rewritten by
    ``change(its layout as stored)`` (returning the new one); the location and that ref."""
    import json

    from caffe2ckpt.store.format.records import list_records, record_path

    with StepCheckpointManager(str(tmp_path / "ckpt"), nodes=["a", "b"], handle_preemption=False,
                               layout=Layout(rows=["x"], replicated=["w"])) as mgr:
        mgr.save(0, {n: {"x": np.zeros((2, 2)), "w": np.ones(2)} for n in "ab"})
        location = mgr._store.location
    ref = next(r for r in list_records(location) if r.node == node)
    path = record_path(location, ref)
    data = json.loads(location.read_bytes(path))
    data["layout"] = change(data["layout"])
    with open(path, "w") as f:
        json.dump(data, f)
    return location, ref


GOOD = {"partition": "range", "order": ["a", "b"], "rows": ["x"], "replicated": ["w"],
        "written_by": {"w": "a"}}


@pytest.mark.parametrize("field, value", [
    ("partition", "hash"), ("order", ["a", "c"]), ("order", ["a", "b", "b"]),
    ("replicated", ["w", "x"]), ("written_by", {"w": "z"}), ("written_by", {"w": "b"}),
    ("written_by", {"x": "a"}), ("rows", "x"), ("extra", 1),
], ids=["partition", "order", "repeated-node", "both-kinds", "writer-not-a-node",
        "writer-itself", "writer-of-rows", "rows-not-a-list", "unknown-field"])
def test_a_forged_layout_makes_its_record_damage(tmp_path, field, value):
    from caffe2ckpt.errors import CheckpointCorruptedError
    from caffe2ckpt.store.format.records import read_record

    location, ref = forged(tmp_path, "b", lambda layout: {**layout, field: value})
    with pytest.raises(CheckpointCorruptedError, match="unreadable") as info:
        read_record(location, ref)
    assert info.value.node == "b" and info.value.epoch == 0
    untouched = forged(tmp_path / "again", "b", lambda layout: layout)  # what each case changed
    assert read_record(*untouched).layout.to_dict() == GOOD


def test_records_of_one_save_that_disagree_on_the_layout_are_damage(tmp_path):
    from caffe2ckpt.errors import CheckpointCorruptedError

    location, _ = forged(tmp_path, "b", lambda layout: {**layout, "partition": "mod"})
    with StepCheckpointManager(str(tmp_path / "ckpt"), nodes=["z"], layout=Layout(rows=["x"]),
                               handle_preemption=False) as mgr:
        with pytest.raises(CheckpointCorruptedError, match="disagree on the layout"):
            mgr.restore(0)


def test_a_replicated_blob_is_written_once_and_read_once(prefix):
    from caffe2ckpt.naming import blob_path

    weights = np.random.default_rng(0).random((300, 300))
    items = {n: {"emb": np.full((50, 4), k), "w": weights} for k, n in enumerate("abc")}
    with StepCheckpointManager(prefix, nodes=list("abc"), pack_threshold=1024,
                               layout=Layout(rows=["emb"], replicated=["w"]),
                               handle_preemption=False) as mgr:
        mgr.save(0, items)
        records = mgr._step(0).records
        assert records["a"].nbytes == weights.nbytes + items["a"]["emb"].nbytes
        assert [records[n].nbytes for n in "bc"] == [items["b"]["emb"].nbytes] * 2
        assert [records[n].layout.written_by for n in "abc"] == [{}, {"w": "a"}, {"w": "a"}]
        location, read = mgr._store.location, []
        original = location.read_exact

        def counted(path, out, trailer):
            if f"/{blob_path('w')}/" in path:
                read.append(len(out))
            return original(path, out, trailer)

        location.read_exact = counted
        got = mgr.restore(0)
        assert sum(read) == weights.nbytes  # once, for the three nodes
        assert all(np.array_equal(got[n]["w"], weights) for n in "abc")
        got["b"]["w"][0, 0] = -1  # each node has its own copy
        assert got["c"]["w"][0, 0] == weights[0, 0]
        assert np.array_equal(mgr.restore(0, nodes=["c"])["c"]["w"], weights)


ROWS_MISFITS = {  # layout, each node's blobs, the refusal
    "no axis 0": (Layout(rows=["x"]), {"a": {"x": np.zeros(3)}, "b": {"x": np.float64(1)}},
                  r"rows blob 'x' has no axis 0 on nodes \['b'\]"),
    "row shapes": (Layout(rows=["x"]), {"a": {"x": np.zeros((3, 2))}, "b": {"x": np.zeros((3, 3))}},
                   r"rows blob 'x' holds rows of another dtype or row shape on nodes \['b'\] "
                   r"than on node 'a' \(<f8, rows of shape \(2,\)\)"),
    "orders": (Layout(rows=["x"]), {"a": {"x": np.zeros((3, 2))},
                                    "b": {"x": np.asfortranarray(np.zeros((3, 2)))}},
               r"rows blob 'x' is held in C order on nodes \['a'\] and in Fortran order on "
               r"nodes \['b'\]"),
    "dtypes": (Layout(rows=["x"]), {"a": {"x": np.zeros(3)}, "b": {"x": np.zeros(3, np.int64)}},
               r"rows blob 'x' holds rows of another dtype"),
    "mod split": (Layout(rows=["x"], partition="mod"),
                  {f"n{k}": {"x": np.zeros((n, 2))} for k, n in enumerate([10, 3, 3, 3])},
                  r"rows blob 'x' cannot be partition='mod' .*row counts \[10, 3, 3, 3\] "
                  r"are not a mod split of 19 rows"),
    "held by some": (Layout(rows=["x*"]), {"a": {"x1": np.zeros(3)}, "b": {"x2": np.zeros(3)}},
                     r"rows blob 'x1' is not held by nodes \['b'\]"),
}


@pytest.mark.parametrize("case", sorted(ROWS_MISFITS))
def test_rows_blobs_no_node_count_could_restore_are_refused_before_anything_is_written(
        tmp_path, case):
    """A save whose rows blobs do not fit its layout would be committed and then refused, as
    damage, by every restore on another node count: it is refused when saved instead."""
    from caffe2ckpt import InvalidBlobError

    layout_, items, message = ROWS_MISFITS[case]
    with StepCheckpointManager(str(tmp_path / "ckpt"), nodes=list(items), layout=layout_,
                               handle_preemption=False) as mgr:
        with pytest.raises(InvalidBlobError, match=r"cannot save epoch 0 under '.*ckpt': "
                           + message + r".*nothing was written"):
            mgr.save(0, items)
        location = mgr._store.location
        assert not location.list_names(location.path("_commits"))
        assert mgr.all_steps() == []


def test_a_job_whose_rows_blobs_differ_in_row_shape_commits_nothing(tmp_path, caplog):
    from caffe2ckpt import Job, Node, Task, epoch_limiter

    with Job(name="misfit") as job:
        for k in range(2):
            with Node(f"trainer_{k}"):
                with job.init_group:
                    Task(lambda ws, k=k: ws.__setitem__("emb", np.zeros((4, 2 + k))), name="init")
        epoch_limiter(job, 2)
    runner = JobRunner(job, MultiNodeCheckpointManager(str(tmp_path / "job"),
                                                       layout=Layout(rows=["emb"])))
    runner.train(LocalSession())
    assert runner.saved_epochs == []
    assert "rows blob 'emb' holds rows of another dtype or row shape on nodes " \
        "['trainer_1']" in caplog.text


def test_nodes_that_disagree_on_a_replicated_blob_write_nothing(prefix):
    from caffe2ckpt import InvalidBlobError, Job, Node, Task

    layout_ = Layout(replicated=["w"])
    with StepCheckpointManager(prefix, nodes=["a", "b"], layout=layout_,
                               handle_preemption=False) as mgr:
        with pytest.raises(InvalidBlobError, match=r"replicated blob 'w' differs between node "
                           r"'a' and nodes \['b'\].*nothing was written"):
            mgr.save(0, {"a": {"w": np.zeros(3)}, "b": {"w": np.ones(3)}})
        location = mgr._store.location
        assert not location.list_names(location.path("_commits"))
        assert not location.list_names(location.path("_runs"))

    def job() -> Job:
        with Job(name="drift") as j:
            for k in range(2):
                with Node(f"trainer_{k}"):
                    with j.init_group:
                        Task(lambda ws: ws.__setitem__("w", np.zeros(3)), name="init")
                    Task(lambda ws, k=k: ws.__setitem__("w", ws["w"] + 1 + (k and ws["w"][0] > 0)),
                         name="train")
            epoch_limiter(j, 3)
        return j

    from caffe2ckpt import epoch_limiter  # noqa: F811

    url = f"{prefix}/job"
    runner = JobRunner(job(), MultiNodeCheckpointManager(url, layout=Layout(
        replicated=["w", "epoch_limiter.*"])))
    runner.train(LocalSession())
    assert runner.saved_epochs == [0, 1]  # epoch 2: trainer_1 drifted, nothing written for it


@pytest.mark.parametrize("sizes", [(4, 1), (5, 0), (1, 4)])
def test_fortran_ordered_shards_of_0_or_1_rows_fit_the_others(prefix, sizes):
    """A shard of 0 or 1 rows is laid out alike in C and Fortran order: it fits Fortran-ordered
    shards of the other nodes, and every node count restores the table in Fortran order."""
    table = np.arange(sum(sizes) * 3, dtype=np.float32).reshape(-1, 3)
    cut = sizes[0]
    items = {"a": {"emb": np.asfortranarray(table[:cut])},
             "b": {"emb": np.asfortranarray(table[cut:])}}
    with StepCheckpointManager(prefix, nodes=["a", "b"], layout=Layout(rows=["emb"]),
                               handle_preemption=False) as mgr:
        mgr.save(0, items)
    for m in (1, 3):
        nodes = [f"n{k}" for k in range(m)]
        with StepCheckpointManager(prefix, nodes=nodes, layout=Layout(rows=["emb"]),
                                   handle_preemption=False) as mgr:
            got = mgr.restore(0)
        for k, node in enumerate(nodes):
            expected = share(table, "range", k, m)
            assert np.array_equal(got[node]["emb"], expected)
            assert got[node]["emb"].flags.f_contiguous


@pytest.mark.parametrize("partition", ["range", "mod"])
def test_item_metadata_describes_what_restore_returns(prefix, partition):
    """Replicated blobs on every node holding them (not only on the node that wrote them), and
    a step of another node count as this manager's nodes restore it."""
    layout_ = Layout(rows=["emb"], replicated=["w"], partition=partition)
    items = {f"a{k}": {"emb": np.full((25, 4), k, np.float32), "w": np.arange(3.0)}
             for k in range(4)}
    for nodes, saves in ((list(items), True), (["b0", "b1", "b2"], False)):
        with StepCheckpointManager(prefix, nodes=nodes, layout=layout_,
                                   handle_preemption=False) as mgr:
            if saves:
                mgr.save(0, items)
            got = mgr.restore(0)
            assert mgr.item_metadata(0) == {
                node: {name: BlobMetadata(a.dtype.str, a.shape, a.nbytes) for name, a in b.items()}
                for node, b in got.items()}


def test_a_missing_blob_is_not_found_whoever_saved_the_step(prefix):
    from caffe2ckpt import CheckpointNotFoundError

    layout_ = Layout(rows=["emb"])
    with StepCheckpointManager(prefix, nodes=["a", "b"], layout=layout_,
                               handle_preemption=False) as mgr:
        mgr.save(0, {n: {"emb": np.zeros((4, 2))} for n in "ab"})
    for nodes in (["a", "b"], ["c"]):
        with StepCheckpointManager(prefix, nodes=nodes, layout=layout_,
                                   handle_preemption=False) as mgr:
            with pytest.raises(CheckpointNotFoundError, match=r"has no blobs \['nope'\]"):
                mgr.restore(0, blobs=["nope"])

