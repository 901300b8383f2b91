"""Prefect helpers from the command line (they talk to the server ``PREFECT_API_URL`` names).

``python -m caffe2ckpt.prefect retry-crashed FLOW/DEPLOYMENT`` creates the automation that
re-schedules crashed runs of a deployment (``create_crash_retry_automation``).

``python -m caffe2ckpt.prefect refresh-crashed RUN_ID...`` brings the checkpoint artifacts of
crashed flow runs up to date from their commit records (``caffe2ckpt.prefect.crashed``)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from prefect.settings import PREFECT_API_URL

from caffe2ckpt.prefect.automations import create_crash_retry_automation


_DESCRIPTION = """Prefect helpers for caffe2ckpt (they talk to the server PREFECT_API_URL names).

  retry-crashed FLOW/DEPLOYMENT   create the automation that re-schedules crashed runs of a
                                  deployment (cap the attempts with run_job's max_attempts)
  refresh-crashed RUN_ID...       bring crashed flow runs' checkpoint artifacts up to date
                                  from their commit records"""


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m caffe2ckpt.prefect",
                                     description=_DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    retry = sub.add_parser("retry-crashed", help="re-schedule crashed runs of a deployment")
    retry.add_argument("deployment", help="FLOW_NAME/DEPLOYMENT_NAME, e.g. regression/nightly")
    refresh = sub.add_parser("refresh-crashed",
                             help="bring crashed flow runs' checkpoint artifacts up to date")
    refresh.add_argument("run_ids", nargs="+", metavar="RUN_ID", help="flow run ids")
    refresh.add_argument("--why", default="marked Crashed", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if not PREFECT_API_URL.value():
        print("error: PREFECT_API_URL is not set: set it to the API of the Prefect server "
              "holding the runs (e.g. http://127.0.0.1:4200/api)", file=sys.stderr)
        return 2
    if args.command == "refresh-crashed":
        return _refresh(args.run_ids, args.why)
    return _retry_crashed(args.deployment)


def _refresh(run_ids: list[str], why: str) -> int:
    from uuid import UUID

    from prefect.client.orchestration import get_client

    from caffe2ckpt.prefect.crashed import refresh_crashed_run

    try:
        ids = [UUID(r) for r in run_ids]
    except ValueError as exc:
        print(f"error: not a flow run id: {exc}", file=sys.stderr)
        return 2
    with get_client(sync_client=True) as client:
        for run_id in ids:
            done = refresh_crashed_run(client, run_id, why)
            print(f"{run_id}: " + ("artifacts brought up to date" if done else
                                   "no checkpoint artifacts to update"))
    return 0


def _retry_crashed(name: str) -> int:
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    with get_client(sync_client=True) as client:
        try:
            deployment = client.read_deployment_by_name(name)
        except ObjectNotFound:
            print(f"error: no deployment named {name!r} on {client.api_url}", file=sys.stderr)
            return 2
    automation_id = create_crash_retry_automation(deployment.id, name=f"retry-crashed-{name}")
    print(f"automation {automation_id}: crashed runs of {name} go back to "
          "AwaitingRetry (cap them with the flow's max_attempts)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
