"""Caffe2's checkpoint managers (re-exports only): :class:`MultiNodeCheckpointManager`,
:class:`CheckpointManager` (its one-node case), their shared :class:`BaseCheckpointManager`
(with :class:`SaveOutcome`, what a save became), and :class:`UploadTaskGroupBuilder`."""

from caffe2ckpt.manager._base import BaseCheckpointManager, SaveOutcome
from caffe2ckpt.manager._managers import (
    CheckpointManager,
    MultiNodeCheckpointManager,
    UploadTaskGroupBuilder,
)

__all__ = ["BaseCheckpointManager", "CheckpointManager", "MultiNodeCheckpointManager",
           "SaveOutcome", "UploadTaskGroupBuilder"]
