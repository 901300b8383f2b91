"""The example job as a Prefect flow: ``python flows/regression.py [--epochs N ...]``.

Without ``PREFECT_API_URL`` it runs on Prefect's temporary local server (stopped even when this
process is killed) and checkpoints to ``checkpoints/regression``. Run it again (or let Prefect retry it) and it resumes from the
newest committed epoch. ``prefect.yaml`` deploys it with a schedule. With ``--dask-scheduler``
(or the flow parameter ``dask_scheduler``) each node lives on a worker of that Dask cluster
(``pip install ".[dask]"``; see the README, "Running on a cluster").
"""

from __future__ import annotations

import argparse
import os

# The temporary server needs more than Prefect's default 20 s on a busy 2-core machine, and its
# analytics service only adds "database is locked" noise to a first run.
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")

from caffe2ckpt.prefect import PrefectSession, run_job, temporary_server  # before prefect (logs)

from prefect import flow
from prefect.runtime import flow_run

from caffe2ckpt import MultiNodeCheckpointManager
from caffe2ckpt.example import build_job, positive_int
from caffe2ckpt.metadata import ZarrMetadataHandler


@flow(name="regression", retries=2, retry_delay_seconds=1, log_prints=True)
def regression(
    checkpoint_url: str = "checkpoints/regression",
    epochs: int = 10,
    nodes: int = 2,
    fail_at_epoch: int | None = None,
    max_attempts: int = 5,
    dask_scheduler: str | None = None,
) -> int:
    """Train the example regression job, resuming from its newest committed checkpoint.

    ``fail_at_epoch`` injects a failure in that epoch on the first attempt only, to show a
    retry resuming from the epoch before it. ``dask_scheduler``: run each node in an actor on a
    worker of the Dask cluster at that address (``checkpoint_url`` must then be a folder or
    bucket every worker can reach).
    """
    cm = MultiNodeCheckpointManager(checkpoint_url, metadata_handler=ZarrMetadataHandler())
    fail = fail_at_epoch if flow_run.run_count <= 1 else None
    job = build_job(epochs, nodes, fail_at_epoch=fail)
    if dask_scheduler is None:
        return run_job(job, cm, max_attempts=max_attempts)
    from caffe2ckpt.dask import DaskSession

    with DaskSession(dask_scheduler) as cluster_nodes:
        return run_job(job, cm, max_attempts=max_attempts,
                       session=PrefectSession(nodes=cluster_nodes))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint-url", default="checkpoints/regression")
    parser.add_argument("--epochs", type=positive_int, default=10)
    parser.add_argument("--nodes", type=positive_int, default=2)
    parser.add_argument("--fail-at-epoch", type=positive_int, default=None)
    parser.add_argument("--dask-scheduler", default=None, metavar="ADDRESS",
                        help="run the nodes on this Dask cluster, e.g. tcp://10.0.0.5:8786")
    args = parser.parse_args()
    with temporary_server():  # without PREFECT_API_URL: Prefect's, but it dies with us
        final = regression(args.checkpoint_url, args.epochs, args.nodes, args.fail_at_epoch,
                           dask_scheduler=args.dask_scheduler)
    print(f"final epoch: {final}")
