"""``python -m caffe2ckpt.prefect retry-crashed FLOW/DEPLOYMENT``: create the automation that
re-schedules crashed runs of a deployment (see :func:`create_crash_retry_automation`)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from caffe2ckpt.prefect.automations import create_crash_retry_automation


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m caffe2ckpt.prefect", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    retry = sub.add_parser("retry-crashed", help="re-schedule crashed runs of a deployment")
    retry.add_argument("deployment", help="FLOW_NAME/DEPLOYMENT_NAME, e.g. regression/nightly")
    args = parser.parse_args(argv)

    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    with get_client(sync_client=True) as client:
        try:
            deployment = client.read_deployment_by_name(args.deployment)
        except ObjectNotFound:
            print(f"error: no deployment named {args.deployment!r} on {client.api_url}",
                  file=sys.stderr)
            return 2
    automation_id = create_crash_retry_automation(deployment.id,
                                                  name=f"retry-crashed-{args.deployment}")
    print(f"automation {automation_id}: crashed runs of {args.deployment} go back to "
          "AwaitingRetry (cap them with the flow's max_attempts)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
