"""An elastic resume on Dask: a job saved by 4 nodes on a cluster of 4 workers (one node each)
resumes on a cluster of 2 workers as a job of 2 nodes, each loading its share of
the table on its own worker (both partitions)."""

from __future__ import annotations

import pytest

from caffe2ckpt import JobRunner, MultiNodeCheckpointManager
from tests.elastic.elasticjob import assert_holds_reference, build, layout

pytest.importorskip("distributed")
from caffe2ckpt.dask import DaskSession
from tests.daskcluster import client_of, local_cluster

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("partition", ["range", "mod"])
def test_a_job_saved_on_4_workers_resumes_on_2(tmp_path, partition):
    url = str(tmp_path / "ckpt")
    with local_cluster(4) as cluster, client_of(cluster) as client, \
            DaskSession(client) as session:
        JobRunner(build(4, 3, partition), MultiNodeCheckpointManager(
            url, layout=layout(partition))).train(session)
        assert len({session.worker_of(f"trainer_{k}") for k in range(4)}) == 4
    # the next run gets a cluster of 2 workers (a new one: scaling a LocalCluster down races
    # its close in distributed, a KeyError in _update_worker_status seen once in CI)
    with local_cluster(2) as cluster, client_of(cluster) as client, \
            DaskSession(client) as session:
        runner = JobRunner(build(2, 5, partition),
                           MultiNodeCheckpointManager(url, layout=layout(partition)))
        runner.train(session)
        assert runner.resumed_from == 3
        assert_holds_reference(session, partition, 2, 5)
        assert len({session.worker_of(f"trainer_{k}") for k in range(2)}) == 2
