"""docs/dask.md's deployment block as written: its flow file (the page's ```python block, in a
temporary folder outside the package) deployed with ``prefect deploy`` to a process work pool
and run by a real ``prefect worker start --run-once`` against the session's server, its nodes on
a Dask LocalCluster of worker processes. The workers cannot import the flow file by name
(Prefect loads the entrypoint from its path), so its task functions must travel by value:
before the fix the run failed with ``ModuleNotFoundError: No module named 'my_cluster_flow'``."""

from __future__ import annotations

from pathlib import Path

import pytest
from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterName

from tests.prefect.test_doc_blocks import (
    _block_env,
    _resume_epoch,
    _run_block,
    doc_blocks,
    python_blocks,
)

pytest.importorskip("distributed")
pytestmark = pytest.mark.slow

SECTION = "docs/dask.md > As a deployment #1"


def test_the_deployment_block_runs_a_flow_file_on_the_dask_workers(tmp_path, client,
                                                                    dask_cluster):
    env = {**_block_env(tmp_path), "PREFECT_WORKER_QUERY_SECONDS": "1"}
    flow = python_blocks()["docs/dask.md > Scale-out with Dask #1"]
    assert "tcp://127.0.0.1:8786" in flow
    (Path(env["TMPDIR"]) / "my_cluster_flow.py").write_text(
        flow.replace("tcp://127.0.0.1:8786", dask_cluster.scheduler_address))
    code, text, leftovers = _run_block(doc_blocks("bash")[SECTION], tmp_path, env)
    assert code == 0 and not leftovers, f"the block exited {code} ({leftovers}):\n{text}"
    runs = client.read_flow_runs(deployment_filter=DeploymentFilter(
        name=DeploymentFilterName(any_=["on-dask"])))
    assert [r.state.type.value for r in runs] == ["COMPLETED"], text
    assert "ModuleNotFoundError" not in text
    assert _resume_epoch(tmp_path / "checkpoints" / "my-cluster-deployed") == 10
