"""The example job as a Prefect flow: ``python flows/regression.py [--epochs N ...]``.

Without ``PREFECT_API_URL`` it runs on Prefect's temporary local server (stopped even when this
process is killed) and checkpoints to ``checkpoints/regression``. Run it again (or let Prefect
retry it) and it resumes from the newest committed epoch. ``--fail-at-epoch N`` runs the flow
``regression-failure-demo`` instead: the same training, failing once in epoch N to show a retry
resuming. ``prefect.yaml`` deploys ``regression`` with a schedule. With ``--dask-scheduler``
(or the flow parameter ``dask_scheduler``) each node lives on a worker of that Dask cluster
(``pip install ".[dask]"``; see docs/dask.md). ``--storage-options JSON``
(the flow parameter ``storage_options``) goes to the checkpoint managers' filesystem, e.g. an
S3 endpoint and credentials: ``'{"endpoint_url": "http://127.0.0.1:8333", "key": "k",
"secret": "s"}'``. Better for credentials: ``--checkpoint-block NAME`` (the flow parameter
``checkpoint_block``), the name of a ``Checkpoint Storage`` block holding the prefix and its
storage options encrypted (docs/prefect.md, "Credentials in blocks"); only the name is a
parameter of the run.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

# The temporary server needs more than Prefect's default 20 s on a busy 2-core machine, and its
# analytics service only adds "database is locked" noise to a first run.
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")

from caffe2ckpt.prefect import (  # before prefect: routes caffe2ckpt logs
    CheckpointStorage,
    PrefectSession,
    plan_run,
    planned_failures,
    quiet_task_runs,
    run_job,
    temporary_server,
)

from prefect import flow
from prefect.runtime import flow_run

from caffe2ckpt import MultiNodeCheckpointManager
from caffe2ckpt.example import (
    InjectedFailure,
    build_job,
    epoch_number,
    help_text,
    node_names,
    positive_int,
)
from caffe2ckpt.metadata import ZarrMetadataHandler

# The terminal shows one line per epoch (caffe2ckpt's); each task run's "Finished in state" and
# the nodes' loss prints stay in the flow run's logs, out of the terminal (warnings still show).
quiet_task_runs()


@flow(name="regression", retries=2, retry_delay_seconds=1, log_prints=True)
def regression(
    checkpoint_url: str = "checkpoints/regression",
    epochs: int = 10,
    nodes: int = 2,
    epochs_per_run: int | None = None,
    resume_from_epoch: int | None = None,
    max_attempts: int = 5,
    dask_scheduler: str | None = None,
    storage_options: dict[str, Any] | None = None,
    checkpoint_block: str | None = None,
) -> int:
    """Train the example regression job, resuming from its newest committed checkpoint.

    ``epochs``: the epoch to train up to, in all (counted across runs). ``epochs_per_run``:
    train at most this many epochs past where this run starts (still never past ``epochs``),
    so a scheduled run trains that many more every time. ``resume_from_epoch``: start from
    this committed epoch instead of the newest one; the epochs this run commits above it
    supersede the older ones (a retry continues from the newest epoch the run committed).
    ``dask_scheduler``: run each node in an actor on a worker of the Dask cluster at that address
    (``checkpoint_url`` must then be a folder or bucket every worker can reach).
    ``storage_options``: fsspec options for ``checkpoint_url``'s filesystem (endpoint,
    credentials, ...). ``checkpoint_block``: the name of a ``Checkpoint Storage`` block to
    checkpoint to instead of ``checkpoint_url`` and ``storage_options``.
    """
    if checkpoint_block is not None:
        checkpoint_url = CheckpointStorage.load(checkpoint_block)
    return train(checkpoint_url, epochs, nodes, epochs_per_run=epochs_per_run,
                 resume_from_epoch=resume_from_epoch, max_attempts=max_attempts,
                 dask_scheduler=dask_scheduler, storage_options=storage_options)


@flow(name="regression-failure-demo", retries=2, retry_delay_seconds=1, log_prints=True)
def regression_failure_demo(
    fail_at_epoch: int,
    checkpoint_url: str = "checkpoints/regression",
    epochs: int = 10,
    nodes: int = 2,
    storage_options: dict[str, Any] | None = None,
) -> int:
    """The regression flow, failing in epoch ``fail_at_epoch`` on its first attempt only, to
    show a retry resuming from the epoch before it (``--fail-at-epoch``; deployed nowhere)."""
    return train(checkpoint_url, epochs, nodes, storage_options=storage_options,
                 fail_at_epoch=fail_at_epoch if flow_run.run_count <= 1 else None)


def train(checkpoint_url: str | CheckpointStorage, epochs: int, nodes: int, *, epochs_per_run: int | None = None,
          resume_from_epoch: int | None = None, max_attempts: int = 5,
          dask_scheduler: str | None = None, fail_at_epoch: int | None = None,
          storage_options: dict[str, Any] | None = None) -> int:
    """The body of both flows: returns the final epoch."""
    cm = MultiNodeCheckpointManager(checkpoint_url, storage_options=storage_options,
                                    metadata_handler=ZarrMetadataHandler())
    plan = plan_run(cm, node_names(nodes), epochs=epochs, epochs_per_run=epochs_per_run,
                    resume_from_epoch=resume_from_epoch)
    job = build_job(plan.num_epochs, nodes, fail_at_epoch=fail_at_epoch)
    if dask_scheduler is None:
        return run_job(job, cm, max_attempts=max_attempts,
                       resume_from_epoch=plan.resume_from_epoch)
    from caffe2ckpt.dask import DaskSession

    with DaskSession(dask_scheduler) as cluster_nodes:
        return run_job(job, cm, max_attempts=max_attempts,
                       resume_from_epoch=plan.resume_from_epoch,
                       session=PrefectSession(nodes=cluster_nodes))


def json_object(text: str) -> dict[str, Any]:
    """An argparse type: a JSON object (``--storage-options``)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON ({exc.msg}): {text!r}") from exc
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text!r}")
    return value


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=help_text(__doc__),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint-url", default="checkpoints/regression")
    parser.add_argument("--epochs", type=positive_int, default=10,
                        help="train up to this epoch in all (default: 10)")
    parser.add_argument("--nodes", type=positive_int, default=2)
    parser.add_argument("--epochs-per-run", type=positive_int, default=None, metavar="N",
                        help="train at most N epochs past where this run starts (and "
                             "never past --epochs)")
    parser.add_argument("--resume-from-epoch", type=epoch_number, default=None, metavar="EPOCH",
                        help="resume from this committed epoch (default: the newest)")
    parser.add_argument("--fail-at-epoch", type=positive_int, default=None, metavar="EPOCH",
                        help="demo: fail in this epoch on the first attempt (runs the flow "
                             "regression-failure-demo, which takes none of --epochs-per-run, "
                             "--resume-from-epoch and --dask-scheduler)")
    parser.add_argument("--dask-scheduler", default=None, metavar="ADDRESS",
                        help="run the nodes on this Dask cluster, e.g. tcp://10.0.0.5:8786")
    parser.add_argument("--storage-options", type=json_object, default=None, metavar="JSON",
                        help="fsspec options for the checkpoint URL's filesystem, e.g. "
                             "'{\"endpoint_url\": \"http://127.0.0.1:8333\", \"key\": \"k\", "
                             "\"secret\": \"s\"}'")
    parser.add_argument("--checkpoint-block", default=None, metavar="NAME",
                        help="checkpoint to the prefix of this Checkpoint Storage block (its "
                             "credentials stay secret) instead of --checkpoint-url")
    args = parser.parse_args()
    if args.fail_at_epoch is not None:
        given = [f"--{k.replace('_', '-')}" for k in ("epochs_per_run", "resume_from_epoch",
                                                     "dask_scheduler")
                 if getattr(args, k) is not None]
        if given:
            parser.error(f"--fail-at-epoch (the failure demo) does not take {', '.join(given)}")
    with temporary_server():  # without PREFECT_API_URL: Prefect's, but it dies with us
        if args.fail_at_epoch is not None:
            with planned_failures(InjectedFailure):  # one WARNING, not ERRORs and tracebacks
                final = regression_failure_demo(args.fail_at_epoch, args.checkpoint_url,
                                                args.epochs, args.nodes, args.storage_options)
        else:
            final = regression(args.checkpoint_url, args.epochs, args.nodes,
                               epochs_per_run=args.epochs_per_run,
                               resume_from_epoch=args.resume_from_epoch,
                               dask_scheduler=args.dask_scheduler,
                               storage_options=args.storage_options,
                               checkpoint_block=args.checkpoint_block)
    print(f"final epoch: {final}")
