"""A Fortran-ordered rows table whose rows have 2 or more axes (review D6): a node holding 0
rows of it holds no data, so its shard fits either memory order. Such a save is accepted by a
step manager and by a JobRunner job, and every other node count restores every node's share in
Fortran order, bit-exact."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from caffe2ckpt import (
    Job,
    JobRunner,
    Layout,
    LocalSession,
    MultiNodeCheckpointManager,
    Node,
    StepCheckpointManager,
    Task,
    epoch_limiter,
)
from caffe2ckpt.sharding import orders_of
from caffe2ckpt.store.read.replicas import check_rows, row_specs
from tests.elastic.elasticjob import share

ROW_SHAPE = (2, 2)


def table(rows: int) -> np.ndarray:
    return np.arange(rows * 4, dtype=np.float32).reshape(rows, *ROW_SHAPE)


def shards(whole: np.ndarray, sizes: tuple[int, ...]) -> list[np.ndarray]:
    """``whole`` cut into blocks of ``sizes`` rows, each Fortran-ordered."""
    bounds = np.cumsum((0, *sizes))
    return [np.asfortranarray(whole[a:b]) for a, b in itertools.pairwise(bounds)]


def test_a_shard_holding_no_data_says_nothing_about_the_order():
    assert orders_of([((0, 2, 2), "C"), ((3, 2, 2), "F")]) == {"F"}
    assert orders_of([((3, 0, 2), "C"), ((3, 2, 2), "C")]) == {"C"}
    assert orders_of([((1, 2, 2), "C"), ((3, 2, 2), "F")]) == {"C", "F"}  # data: it counts
    specs = {f"t{k}": row_specs({"emb": arr}) for k, arr in enumerate(shards(table(5),
                                                                              (0, 3, 2)))}
    check_rows(0, specs, ["emb"], list(specs), "range", "memory://x")  # nothing raised


@pytest.mark.parametrize("partition,sizes", [("range", (0, 3, 2)), ("range", (3, 0, 2)),
                                             ("range", (4, 1, 0)), ("mod", (1, 1, 0))])
def test_a_step_manager_saves_and_reshards_it(prefix, partition, sizes):
    layout = Layout(rows=["emb"], partition=partition)
    whole = table(sum(sizes))
    old = [f"t{k}" for k in range(len(sizes))]
    if partition == "mod":  # node k holds the rows r % N == k
        parts = [np.asfortranarray(whole[k::len(sizes)]) for k in range(len(sizes))]
    else:
        parts = shards(whole, sizes)
    with StepCheckpointManager(prefix, nodes=old, layout=layout,
                               handle_preemption=False) as mgr:
        mgr.save(0, {node: {"emb": part} for node, part in zip(old, parts)})
        got = mgr.restore(0)  # the same nodes get their own shards back
    for node, part in zip(old, parts):
        assert got[node]["emb"].tobytes("A") == part.tobytes("A")
    for m in (1, 3):
        nodes = [f"n{k}" for k in range(m)]
        with StepCheckpointManager(prefix, nodes=nodes, layout=layout,
                                   handle_preemption=False) as mgr:
            got = mgr.restore(0)
        for k, node in enumerate(nodes):
            expected = share(whole, partition, k, m)
            assert got[node]["emb"].shape == expected.shape
            assert got[node]["emb"].tobytes() == expected.tobytes()
            assert got[node]["emb"].flags.f_contiguous


def _job(sizes: tuple[int, ...], epochs: int) -> Job:
    """Nodes ``trainer_k`` holding Fortran-ordered blocks of ``sizes`` rows of :func:`table`,
    each epoch adding 1 to every element (in the order the blob is held in)."""
    bounds = np.cumsum((0, *sizes))
    with Job(name="fortran") as job:
        for k, (a, b) in enumerate(itertools.pairwise(bounds)):
            with Node(f"trainer_{k}"):
                with job.init_group:
                    Task(lambda ws, a=a, b=b: ws.__setitem__(
                        "emb", np.asfortranarray(table(int(bounds[-1]))[a:b])), name="init")
                Task(lambda ws: ws.__setitem__("emb", ws["emb"] + 1), name="train")
        epoch_limiter(job, epochs)
    return job


@pytest.mark.parametrize("m", [1, 3])
def test_a_job_runner_saves_it_and_another_node_count_resumes_it(prefix, m):
    layout = Layout(rows=["emb"])
    runner = JobRunner(_job((0, 3, 0, 2), 2), MultiNodeCheckpointManager(prefix, layout=layout))
    runner.train(LocalSession())
    assert runner.saved_epochs == [0, 1, 2]
    session = LocalSession()
    sizes = tuple(len(share(table(5), "range", k, m)) for k in range(m))
    runner = JobRunner(_job(sizes, 3), MultiNodeCheckpointManager(prefix, layout=layout))
    runner.train(session)
    assert runner.resumed_from == 2 and runner.saved_epochs == [3]
    for k in range(m):
        got = session.workspace(f"trainer_{k}")["emb"]
        expected = share(table(5) + 3, "range", k, m)
        assert got.shape == expected.shape and got.tobytes() == expected.tobytes()
        assert got.flags.f_contiguous  # as restored: the epoch's + 1 keeps the order
