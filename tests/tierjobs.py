"""A three-node job for the memory tier's tests (tests/dask/test_memory_tier.py, and the Prefect
flows in tests/prefect/test_dask_prefect.py): numpy state in C and Fortran order, a blob that
appears in a later epoch, and, on request, a worker that dies once in the middle of an epoch."""

from __future__ import annotations

import os
import time
from collections.abc import Mapping

import numpy as np

from caffe2ckpt import Job, JobRunner, LocalSession, MultiNodeCheckpointManager, Node, Task
from caffe2ckpt.fs.location import Location
from caffe2ckpt.job import epoch_limiter
from caffe2ckpt.store.commit.protocol import CheckpointStore

NODES = ["trainer_0", "trainer_1", "trainer_2"]
EPOCHS = 6


def _init(i: int):
    def init(ws):
        ws["w"] = np.random.default_rng(i).standard_normal((300, 40))
        ws["b"] = np.asfortranarray(np.arange(12.0 * (i + 1)).reshape(3, -1))
        ws["step"] = np.int64(0)
    return init


def _train(node: str, marker: str | None, die_at: int, buddied: bool, fail: str | None,
           pace: float):
    def train(ws):
        time.sleep(pace)
        step = int(ws["step"]) + 1
        if fail and os.path.exists(fail) and step == die_at:
            os.unlink(fail)
            raise RuntimeError(f"injected: node {node!r} fails in epoch {step}")
        if marker and os.path.exists(marker) and step == die_at:
            if buddied:
                _wait_until_buddied(node, step - 1)
            os.unlink(marker)
            os._exit(1)  # the worker process dies in the middle of the epoch
        ws["w"] = np.tanh(ws["w"] * 1.1 + step)
        ws["b"] = ws["b"] * 2 - step
        ws["step"] = np.int64(step)
        ws["loss"] = np.float64(np.abs(ws["w"]).mean())
        if step == 2:
            ws["born_at_2"] = np.full(5, step)
    return train


def _wait_until_buddied(node: str, epoch: int) -> None:
    """Wait until this worker's own copy of ``node`` at ``epoch`` is at its buddy (a kill
    before that is the window in which the copy cannot be recovered: see the test below)."""
    for _ in range(1000):
        own = live_copy(node)
        if own is not None and own.epoch == epoch and own.sent:
            return
        time.sleep(0.01)
    raise AssertionError(f"the copy of {node!r} at epoch {epoch} never reached its buddy")


def live_copy(node: str):
    """On a worker: the own memory-tier copy of ``node`` that its live actor holds here (an
    actor gone may still have a store in the process, until it is collected), or None."""
    from caffe2ckpt.dask import tier

    with tier._kept_lock:
        stores = [e.copies for (_, n), e in tier._kept.items() if n == node and e.owner]
    return stores[0].slot(node, "own") if stores else None


def job(die: Mapping[str, str] | None = None, die_at: int = 3, *, buddied: bool = True,
        fail: str | None = None, pace: float = 0.0) -> Job:
    """Three nodes; ``die`` maps a node to a marker file: while it exists, the node's worker
    dies (once) in epoch ``die_at`` (``buddied``: once its copy of the epoch before is at its
    buddy). While the marker file ``fail`` exists, the first node's task raises in epoch
    ``die_at`` instead (once): the run fails, its workers live. Each epoch's task first sleeps
    ``pace`` seconds."""
    die = die or {}
    with Job(name="tiered") as j:
        for i, node in enumerate(NODES):
            with Node(node):
                with j.init_group:
                    Task(_init(i), name="init")
                train = Task(_train(node, die.get(node), die_at, buddied,
                                    fail if i == 0 else None, pace), name="train",
                             outputs=["loss"])
                if i == 0:  # a metric: a resume from memory reads it before any task ran
                    j.add_metric("loss", train.outputs()[0])
        epoch_limiter(j, EPOCHS)
    return j


def markers(tmp_path, *nodes: str) -> dict[str, str]:
    """A marker file per node (see :func:`job`), created."""
    out = {}
    for node in nodes:
        out[node] = str(tmp_path / f"die-{node}")
        open(out[node], "w").close()
    return out


def reference(tmp_path) -> tuple[dict[str, dict[str, np.ndarray]], CheckpointStore]:
    """An uninterrupted run's workspaces, and its checkpoints."""
    session, url = LocalSession(), str(tmp_path / "ref")
    JobRunner(job(), MultiNodeCheckpointManager(url)).train(session)
    return {n: dict(session.workspace(n)) for n in NODES}, CheckpointStore(Location(url))


def dict_of(session, node: str) -> dict[str, np.ndarray]:
    ws = session.workspace(node)
    return {name: ws[name] for name in ws}


def same(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> bool:
    assert sorted(a) == sorted(b)
    for k, x in a.items():
        assert np.array_equal(x, b[k]), k
        assert (x.dtype, x.flags.f_contiguous) == (b[k].dtype, b[k].flags.f_contiguous), k
    return True


class Recoveries:
    """An event subscriber (``caffe2ckpt.events.subscribe``) keeping the payloads of the
    ``caffe2ckpt.run.recovered`` events (or those named ``name``)."""

    def __init__(self, name: str = "caffe2ckpt.run.recovered") -> None:
        self.name = name
        self.seen: list[dict] = []

    def active(self) -> bool:
        return True

    def __call__(self, event) -> None:
        if event.name == self.name:
            self.seen.append(dict(event.payload))

    def flush(self) -> None:
        pass
