"""The whole exception tree of caffe2ckpt.

Every error the library raises on purpose derives from :class:`CheckpointError` and also from
the builtin a caller would naturally catch, so ``except FileNotFoundError`` keeps working::

    CheckpointError (Exception)
    ├── CheckpointNotFoundError (FileNotFoundError)   no committed checkpoint where one was asked for
    ├── CheckpointCorruptedError (ValueError)         stored bytes or metadata fail verification
    ├── CheckpointWriteError (OSError)                a save or commit could not be completed
    │   └── CheckpointFencedError                     a newer run took over the prefix
    ├── InvalidBlobError (ValueError)                 a workspace value or blob name we cannot store
    ├── InvalidLocationError (ValueError)             a bad node name, prefix, URL or epoch
    │   └── StorageCredentialsError                   the prefix's filesystem found no credentials
    ├── JobDefinitionError (ValueError)               a Job / Task / runner set up wrongly
    ├── JobPreemptedError                             a signal stopped the job between epochs
    └── NodeLostError (RuntimeError)                  a node's worker died, or it could not be placed

Errors pickle with their attributes (``node``, ``epoch``...), so they keep them when raised on a
remote node and re-raised here.

:func:`writing` is the one place where a failure of a save's third-party or OS call becomes a
:class:`CheckpointWriteError` naming what was being written.

This module imports nothing from the rest of the package.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

__all__ = [
    "CheckpointCorruptedError",
    "CheckpointError",
    "CheckpointFencedError",
    "CheckpointNotFoundError",
    "CheckpointWriteError",
    "InvalidBlobError",
    "InvalidLocationError",
    "JobDefinitionError",
    "JobPreemptedError",
    "NodeLostError",
    "StorageCredentialsError",
]


class CheckpointError(Exception):
    """Base class of every error raised by caffe2ckpt."""

    def __reduce__(self) -> tuple:
        return _rebuild, (type(self), self.args, dict(self.__dict__))


def _rebuild(cls: type[CheckpointError], args: tuple, state: dict) -> CheckpointError:
    exc = cls.__new__(cls, *args)
    exc.args = args
    exc.__dict__.update(state)
    return exc


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """No committed checkpoint exists for the requested node and epoch."""


class CheckpointCorruptedError(CheckpointError, ValueError):
    """Stored data or metadata failed verification.

    Attributes:
        node: the node whose checkpoint is damaged, or None.
        epoch: the epoch of that checkpoint, or None.
        blob: the blob (or record) that failed, or None when not applicable.
        blobs: every blob the damage hits (``blob`` first): several where they share a
            damaged chunk (small blobs packed together); ``(blob,)`` or ``()`` otherwise.
    """

    def __init__(
        self,
        message: str,
        *,
        node: str | None = None,
        epoch: int | None = None,
        blob: str | None = None,
        blobs: Sequence[str] | None = None,
    ) -> None:
        super().__init__(message)
        self.node = node
        self.epoch = epoch
        self.blob = blob
        self.blobs = tuple(blobs) if blobs is not None else (blob,) if blob else ()


class CheckpointWriteError(CheckpointError, OSError):
    """A save or commit failed; nothing already committed was changed.

    Attributes:
        epoch: the epoch whose save failed, or None when not known.
        maybe_committed: the save's commit record may have been stored even so (its answer
            was lost and taking it back failed too): ask the records before calling the epoch
            failed (:class:`~caffe2ckpt.JobRunner` does).
    """

    def __init__(self, *args: object, epoch: int | None = None,
                 maybe_committed: bool = False) -> None:
        super().__init__(*args)
        self.epoch = epoch
        self.maybe_committed = maybe_committed


@contextmanager
def writing(what: str, epoch: int | None = None) -> Iterator[None]:
    """Raise any failure inside as a :class:`CheckpointWriteError` saying ``what`` failed (e.g.
    ``"saving node 'n' epoch 3 to 's3://b/run/n.3'"``, with its ``epoch``); caffe2ckpt's own
    errors pass as they are.
    """
    try:
        yield
    except CheckpointWriteError as exc:
        if exc.epoch is None:
            exc.epoch = epoch
        raise
    except CheckpointError:
        raise
    except Exception as exc:
        raise CheckpointWriteError(f"{what} failed: {exc}", epoch=epoch) from exc


class CheckpointFencedError(CheckpointWriteError):
    """A newer run claimed the checkpoint prefix; this run must stop saving there.

    Attributes:
        newer_writers: what each newer run of the family recorded about itself when it claimed
            the prefix, oldest first (a Prefect run records ``flow_run_id`` and
            ``run_count``); empty when the first such entry cannot be read.
    """

    def __init__(self, *args: object, newer_writers: list[dict[str, Any]] | None = None,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.newer_writers = list(newer_writers or ())


class InvalidBlobError(CheckpointError, ValueError):
    """A blob name or value cannot be checkpointed (e.g. an object array)."""


class InvalidLocationError(CheckpointError, ValueError):
    """A node name, checkpoint prefix, URL or epoch number is not acceptable."""


class StorageCredentialsError(InvalidLocationError):
    """The prefix's filesystem has no usable credentials: none were found (environment, config
    files, instance metadata, storage options), they could not be loaded, or the store rejected
    them (a wrong secret, an unknown key, an expired token, or a request they may not make:
    ``SignatureDoesNotMatch``, ``InvalidAccessKeyId``, ``ExpiredToken``, ``AccessDenied``...).
    The message names the prefix."""


class JobDefinitionError(CheckpointError, ValueError):
    """A job, task, group or runner was defined or used inconsistently."""


class JobPreemptedError(CheckpointError):
    """A preemption signal (SIGTERM) stopped the job after an epoch, which was checkpointed.

    Attributes:
        epoch: the last epoch that ran.
        committed: whether that epoch's checkpoint is committed (a rerun resumes from it).
        signal: the signal's name, e.g. ``"SIGTERM"``.
    """

    def __init__(self, message: str, *, epoch: int, committed: bool, signal: str) -> None:
        super().__init__(message)
        self.epoch = epoch
        self.committed = committed
        self.signal = signal


class NodeLostError(CheckpointError, RuntimeError):
    """A node's workspace is gone with its worker, or the node could not be placed on one.

    Attributes:
        node: the node.
        loss: what happened, without the advice on what to do next (a memory tier's recovery
            reports it while the run goes on).
    """

    def __init__(self, message: str, *, node: str | None = None,
                 loss: str | None = None) -> None:
        super().__init__(message)
        self.node = node
        self.loss = loss or message
