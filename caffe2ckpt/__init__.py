"""caffe2ckpt: Caffe2's epoch-level checkpointing (Job, JobRunner, CheckpointManager) on Zarr v3
and fsspec, orchestrated by Prefect through :mod:`caffe2ckpt.prefect`.

``import caffe2ckpt`` never imports prefect.
"""

from caffe2ckpt.errors import (
    CheckpointCorruptedError,
    CheckpointError,
    CheckpointFencedError,
    CheckpointNotFoundError,
    CheckpointWriteError,
    InvalidBlobError,
    InvalidLocationError,
    JobDefinitionError,
    JobPreemptedError,
    NodeLostError,
    StorageCredentialsError,
)
from caffe2ckpt.job import Job, Node, Task, TaskGroup, TaskOutput, epoch_limiter
from caffe2ckpt.manager import CheckpointManager, MultiNodeCheckpointManager, UploadTaskGroupBuilder
from caffe2ckpt.naming import db_name, get_ckpt_filename
from caffe2ckpt.policy import StepManagerOptions
from caffe2ckpt.runner import JobRunner
from caffe2ckpt.session import LocalSession, Session
from caffe2ckpt.sharding import Layout
from caffe2ckpt.steps import AbstractCheckpointManager, StepCheckpointManager
from caffe2ckpt.steps.plainzarr import materialize, read_epoch, zarr_store
from caffe2ckpt.workspace import Workspace, WorkspaceType

__all__ = [
    "AbstractCheckpointManager",
    "CheckpointCorruptedError",
    "CheckpointError",
    "CheckpointFencedError",
    "CheckpointManager",
    "CheckpointNotFoundError",
    "CheckpointWriteError",
    "InvalidBlobError",
    "InvalidLocationError",
    "Job",
    "JobDefinitionError",
    "JobPreemptedError",
    "JobRunner",
    "Layout",
    "LocalSession",
    "MultiNodeCheckpointManager",
    "Node",
    "NodeLostError",
    "Session",
    "StepCheckpointManager",
    "StepManagerOptions",
    "StorageCredentialsError",
    "Task",
    "TaskGroup",
    "TaskOutput",
    "UploadTaskGroupBuilder",
    "Workspace",
    "WorkspaceType",
    "db_name",
    "epoch_limiter",
    "get_ckpt_filename",
    "materialize",
    "read_epoch",
    "zarr_store",
]
