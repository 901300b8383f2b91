"""A real Dask cluster for the tests: 2 worker processes on 127.0.0.1 (a LocalCluster), every
port chosen by the OS, so test processes running side by side never collide."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest

distributed = pytest.importorskip("distributed")


@contextlib.contextmanager
def local_cluster(workers: int = 2) -> Iterator[distributed.LocalCluster]:
    with distributed.LocalCluster(n_workers=workers, threads_per_worker=2, processes=True,
                                  host="127.0.0.1", scheduler_port=0, dashboard_address=":0",
                                  silence_logs=40) as cluster:
        yield cluster


@contextlib.contextmanager
def client_of(cluster: distributed.LocalCluster) -> Iterator[distributed.Client]:
    """A client of ``cluster`` once all its workers are up (a killed one is restarted)."""
    with distributed.Client(cluster) as client:
        client.wait_for_workers(len(cluster.workers), timeout=60)
        yield client
