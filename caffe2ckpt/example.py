"""The example job: minibatch SGD for linear regression on synthetic data, on several nodes.

Each node ("trainer_0", "trainer_1", ...) owns one shard of a synthetic regression set made from a
fixed seed, its own weights, and a data cursor; every epoch it takes ``batches_per_epoch``
minibatches from the cursor (reshuffling with a seeded permutation at each pass over its shard)
and prints its loss. Everything the job needs to continue — weights, cursor, permutation, step
count — lives in the workspace after the init group, so it is checkpointed every epoch and a
killed run resumes exactly where its last committed epoch left off.

Run it (``--help`` lists the options)::

    python -m caffe2ckpt.example --checkpoint-url checkpoints/regression --epochs 10

Kill it at any time and run the same command again: it resumes from the newest committed epoch.
SIGTERM is a polite preemption: the running epoch finishes and is committed, then the program
exits with status 75 (EX_TEMPFAIL); run it again to continue.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

import numpy as np

from caffe2ckpt.errors import JobDefinitionError, JobPreemptedError
from caffe2ckpt.job import Job, Node, Task, epoch_limiter
from caffe2ckpt.workspace import Workspace

__all__ = ["EXIT_PREEMPTED", "build_job", "held_out_loss", "main", "node_names"]

EXIT_PREEMPTED = 75  # EX_TEMPFAIL: stopped by a preemption signal, rerun to resume

FEATURES = 8
SAMPLES_PER_NODE = 32768  # data/x is 1 MiB: an array of its own in the checkpoint
BATCH = 64


class InjectedFailure(RuntimeError):
    """Raised by the example on purpose (``fail_at_epoch``) to demonstrate resuming."""


def _init_node(node_index: int, seed: int):
    def init(ws: Workspace) -> None:
        rng = np.random.default_rng([seed, node_index])
        true_w = np.random.default_rng(seed).normal(size=FEATURES)
        x = rng.normal(size=(SAMPLES_PER_NODE, FEATURES)).astype(np.float32)
        noise = rng.normal(scale=0.1, size=SAMPLES_PER_NODE)
        ws["data/x"] = x
        ws["data/y"] = (x @ true_w + 0.5 + noise).astype(np.float32)
        ws["model/w"] = np.zeros(FEATURES, np.float32)
        ws["model/b"] = np.float32(0.0)
        ws["reader/cursor"] = np.int64(0)
        ws["reader/order"] = rng.permutation(SAMPLES_PER_NODE)
        ws["reader/pass"] = np.int64(0)
        ws["optim/lr"] = np.float32(0.05)
        ws["epoch"] = np.int64(0)

    return init


def _train_epoch(node: str, node_index: int, seed: int, batches: int,
                 fail_at_epoch: int | None):
    def sgd(ws: Workspace) -> None:
        epoch = int(ws["epoch"]) + 1
        if fail_at_epoch is not None and epoch == fail_at_epoch:
            raise InjectedFailure(f"injected failure on {node} in epoch {epoch}")
        x, y = ws["data/x"], ws["data/y"]
        w, b = ws["model/w"].copy(), np.float32(ws["model/b"])
        cursor, order = int(ws["reader/cursor"]), ws["reader/order"]
        lr = ws["optim/lr"]
        losses = []
        for _ in range(batches):
            if cursor + BATCH > order.size:  # new pass: reshuffle deterministically
                data_pass = int(ws["reader/pass"]) + 1
                order = np.random.default_rng([seed, node_index, data_pass]).permutation(order.size)
                ws["reader/pass"] = np.int64(data_pass)
                cursor = 0
            idx = order[cursor:cursor + BATCH]
            cursor += BATCH
            err = x[idx] @ w + b - y[idx]
            losses.append(float(np.mean(err * err)))
            w -= lr * (2.0 / BATCH) * (x[idx].T @ err)
            b -= lr * np.float32(2.0 * err.mean())
        ws["model/w"], ws["model/b"] = w, np.float32(b)
        ws["reader/cursor"], ws["reader/order"] = np.int64(cursor), order
        ws["epoch"] = np.int64(epoch)
        ws["loss"] = np.float32(np.mean(losses))
        print(f"[{node}] epoch {epoch:3d}  loss {float(ws['loss']):.5f}", flush=True)

    return sgd


def held_out_loss(w: np.ndarray, b: float, *, seed: int = 0, samples: int = 4096) -> float:
    """The mean squared error of model ``(w, b)`` on samples no node trains on (the same true
    weights as :func:`build_job` with ``seed``): what an evaluation of a checkpoint reports."""
    true_w = np.random.default_rng(seed).normal(size=FEATURES)
    rng = np.random.default_rng([seed, 1 << 20])  # a stream no trainer node uses
    x = rng.normal(size=(samples, FEATURES)).astype(np.float32)
    y = x @ true_w + 0.5 + rng.normal(scale=0.1, size=samples)
    err = x @ np.asarray(w, np.float64) + float(b) - y
    return float(np.mean(err * err))


def node_names(num_nodes: int) -> list[str]:
    """The example's nodes: ``trainer_0``, ``trainer_1``, ..."""
    return [f"trainer_{i}" for i in range(num_nodes)]


def build_job(
    num_epochs: int = 10,
    num_nodes: int = 2,
    *,
    batches_per_epoch: int = 16,
    seed: int = 0,
    fail_at_epoch: int | None = None,
) -> Job:
    """The example job on ``num_nodes`` trainer nodes, stopping after ``num_epochs`` epochs.

    ``fail_at_epoch`` makes every node raise :class:`InjectedFailure` in that epoch (for demos
    and tests of resuming).
    """
    if num_nodes < 1:
        raise JobDefinitionError(f"the example needs at least one node, got {num_nodes}")
    with Job(name="regression") as job:
        for i, node in enumerate(node_names(num_nodes)):
            with Node(node):
                with job.init_group:
                    Task(_init_node(i, seed), name="init")
                sgd = Task(_train_epoch(node, i, seed, batches_per_epoch, fail_at_epoch),
                           name="sgd", outputs=["loss"])
            if i == 0:
                job.add_metric("loss", sgd.outputs()[0])  # kept in each epoch's commit record
        epoch_limiter(job, num_epochs)
    return job


def help_text(doc: str) -> str:
    """A docstring as ``--help`` prints it: without reStructuredText's double backquotes."""
    return doc.replace("``", "")


def positive_int(text: str) -> int:
    """An argparse type: an int >= 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def epoch_number(text: str) -> int:
    """An argparse type: an int >= 0."""
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def main(argv: Sequence[str] | None = None) -> int:
    """Command line entry point: train (or resume) the example job with a LocalSession."""
    from caffe2ckpt.manager import MultiNodeCheckpointManager
    from caffe2ckpt.metadata import ZarrMetadataHandler
    from caffe2ckpt.policy import StepManagerOptions
    from caffe2ckpt.runner import JobRunner
    from caffe2ckpt.session import LocalSession

    parser = argparse.ArgumentParser(prog="python -m caffe2ckpt.example",
                                     description=help_text(__doc__),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint-url", default="checkpoints/regression",
                        help="local folder or fsspec URL of the checkpoints")
    parser.add_argument("--epochs", type=positive_int, default=10)
    parser.add_argument("--nodes", type=positive_int, default=2)
    parser.add_argument("--batches-per-epoch", type=positive_int, default=16)
    parser.add_argument("--fail-at-epoch", type=positive_int, default=None,
                        help="raise in this epoch (to demonstrate resuming)")
    parser.add_argument("--save-every", type=positive_int, default=None, metavar="N",
                        help="checkpoint every N-th epoch (epoch 0 and the last always)")
    parser.add_argument("--keep-last", type=positive_int, default=None, metavar="N",
                        help="keep only the newest N checkpoints (default: keep all)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(levelname)-7s %(name)s %(message)s")
    job = build_job(args.epochs, args.nodes, batches_per_epoch=args.batches_per_epoch,
                    fail_at_epoch=args.fail_at_epoch)
    cm = MultiNodeCheckpointManager(args.checkpoint_url, metadata_handler=ZarrMetadataHandler())
    session = LocalSession()
    options = StepManagerOptions(save_interval_steps=args.save_every, max_to_keep=args.keep_last)
    try:
        final = JobRunner(job, cm, options=options).train(session)
    except JobPreemptedError as exc:
        print(f"preempted: {exc}", file=sys.stderr)
        return EXIT_PREEMPTED
    for node in job.nodes_to_checkpoint():
        ws = session.workspace(node)
        print(f"[{node}] final epoch {final}: w[:3]={ws['model/w'][:3]} b={float(ws['model/b']):.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
