"""Evaluate one committed epoch of the example job: ``python flows/evaluate.py URL EPOCH``.

The flow ``evaluate-checkpoint`` reads the model of a committed epoch (node ``trainer_0``'s
``model/w`` and ``model/b``; every node holds the same model after an epoch of the example)
with :func:`caffe2ckpt.read_epoch`, which reads and verifies without resuming anything, scores
it on held-out samples and reports the loss as a markdown artifact. It is what
:func:`caffe2ckpt.prefect.create_epoch_deployment_automation` runs when epochs commit: deploy
it (``prefect.yaml``, deployment ``evaluate``) and create the automation, and every k-th
committed epoch of the training job gets its evaluation run, with ``checkpoint_url`` and
``epoch`` filled in from the event.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")

from caffe2ckpt.prefect import temporary_server  # before prefect: routes caffe2ckpt logs

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact

from caffe2ckpt import read_epoch
from caffe2ckpt.example import epoch_number, held_out_loss, help_text
from caffe2ckpt.urls import public_url


@flow(name="evaluate-checkpoint", log_prints=True)
def evaluate(checkpoint_url: str, epoch: int, node: str = "trainer_0",
             storage_options: dict[str, Any] | None = None) -> float:
    """Score committed ``epoch`` under ``checkpoint_url`` on held-out data; return its loss."""
    model = read_epoch(checkpoint_url, epoch, node, blobs=["model/w", "model/b"],
                       storage_options=storage_options)
    loss = held_out_loss(model["model/w"], float(model["model/b"]))
    where = public_url(checkpoint_url)  # never a password or token of the URL
    get_run_logger().info("epoch %d of %s: held-out loss %.6f", epoch, where, loss)
    create_markdown_artifact(
        key="checkpoint-evaluation",
        markdown=f"Epoch **{epoch}** of `{where}` ({node}): held-out loss "
                 f"**{loss:.6f}**",
        description=f"Evaluation of epoch {epoch}")
    return loss


def main() -> None:
    parser = argparse.ArgumentParser(description=help_text(__doc__.split("\n\n")[0]))
    parser.add_argument("checkpoint_url")
    parser.add_argument("epoch", type=epoch_number)
    args = parser.parse_args()
    with temporary_server():
        loss = evaluate(args.checkpoint_url, args.epoch)
    print(f"held-out loss of epoch {args.epoch}: {loss:.6f}")


if __name__ == "__main__":
    main()
