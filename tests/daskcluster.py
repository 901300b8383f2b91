"""A real Dask cluster for the tests: 2 worker processes on 127.0.0.1 (a LocalCluster), every
port chosen by the OS, so test processes running side by side never collide."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import pytest

dask = pytest.importorskip("dask")
distributed = pytest.importorskip("distributed")


# A LocalCluster closes a worker's nanny when, ``lost-worker-timeout`` (15 s) after a removal of
# that worker, no worker of its name is registered: a second kill within 15 s whose restart is
# under way at that moment then leaves the cluster a worker short for good (seen in a test run
# and in chaos runs). The tests kill workers to have them restarted, so the nannies must stay.
KEEP_NANNIES = {"distributed.deploy.lost-worker-timeout": "1h"}
# Worker processes (and their restarts) fork from a server process that imported distributed,
# numpy and the rest once, as Dask's own test suite runs them, instead of each starting a new
# interpreter and importing them again (spawn, the default): tests/dask alone took 22 s of
# processor time instead of 40 s. What a worker runs is the same.
CLUSTER_CONFIG = {**KEEP_NANNIES, "distributed.worker.multiprocessing-method": "forkserver"}


@contextlib.contextmanager
def local_cluster(workers: int = 2) -> Iterator[distributed.LocalCluster]:
    with dask.config.set(CLUSTER_CONFIG), distributed.LocalCluster(
            n_workers=workers, threads_per_worker=2, processes=True, host="127.0.0.1",
            scheduler_port=0, dashboard_address=":0", silence_logs=40) as cluster:
        yield cluster


@contextlib.contextmanager
def client_of(cluster: distributed.LocalCluster) -> Iterator[distributed.Client]:
    """A client of ``cluster`` once all its workers are up (a killed one is restarted)."""
    with distributed.Client(cluster) as client:
        client.wait_for_workers(len(cluster.workers), timeout=60)
        yield client


def die_before_commit(marker: str, node: str = "trainer_1", epoch: int = 3, *,
                      copied: bool = False) -> None:
    """Run on every worker (``client.run``): the first save of ``node``'s ``epoch`` (while the
    file ``marker`` exists) SIGKILLs its worker once the group is written, before its commit
    record (in the save's own thread: the actor's, or the background writer's with
    ``async_save``; with ``copied``, an async save's writer waits until the node's memory-tier
    copy of ``epoch`` reached its buddy first)."""
    _die_at_commit(marker, node, epoch, after=False, copied=copied)


def die_after_commit(marker: str, node: str = "trainer_1", epoch: int = 3) -> None:
    """:func:`die_before_commit`, but the worker dies right after the commit record is written:
    the save is committed, and its outcome never reaches the client. Undone by
    :func:`undo_die_before_commit` too."""
    _die_at_commit(marker, node, epoch, after=True)


def _die_at_commit(marker: str, node: str, epoch: int, *, after: bool,
                   copied: bool = False) -> None:
    import signal
    import time

    from caffe2ckpt.dask import tier
    from caffe2ckpt.store.commit import protocol

    write_record = getattr(protocol.write_record, "original", protocol.write_record)

    def dying(location, record):
        if record.node == node and record.epoch == epoch and os.path.exists(marker):
            for _ in range(1000 if copied else 0):
                with tier._kept_lock:  # the store of the node's live actor
                    own = [e.copies.slot(node, "own") for (_, n), e in tier._kept.items()
                           if n == node and e.owner]
                if own and own[0].epoch == epoch and own[0].sent:
                    break
                time.sleep(0.01)
            if after:
                write_record(location, record)
            os.unlink(marker)
            os.kill(os.getpid(), signal.SIGKILL)
        return write_record(location, record)

    dying.original = write_record
    protocol.write_record = dying


def _undo_die_before_commit() -> None:
    from caffe2ckpt.store.commit import protocol

    protocol.write_record = getattr(protocol.write_record, "original", protocol.write_record)


def undo_die_before_commit(client) -> None:
    """Undo :func:`die_before_commit` on the workers it did not kill. The killed one may still be
    on the scheduler's list, its connection reset ("Connection reset by peer" failed a test): a
    connection error is not an error here (its restarted process never had the patch); any other
    is raised."""
    results = client.run(_undo_die_before_commit, on_error="return")
    for result in results.values():
        if isinstance(result, BaseException) and not isinstance(result, OSError):
            raise result
