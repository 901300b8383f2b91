"""Caffe2's checkpoint managers (re-exports only): :class:`MultiNodeCheckpointManager`,
:class:`CheckpointManager` (its one-node case), their shared :class:`BaseCheckpointManager`,
and :class:`UploadTaskGroupBuilder`."""

from caffe2ckpt.manager._base import (
    BaseCheckpointManager,
    CheckpointManager,
    MultiNodeCheckpointManager,
    UploadTaskGroupBuilder,
)

__all__ = ["BaseCheckpointManager", "CheckpointManager", "MultiNodeCheckpointManager",
           "UploadTaskGroupBuilder"]
