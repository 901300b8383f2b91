"""The Orbax-style API (re-exports only): :class:`AbstractCheckpointManager`, Orbax's interface,
and :class:`StepCheckpointManager`, its implementation over caffe2ckpt's prefixes."""

from caffe2ckpt.steps.abstract import AbstractCheckpointManager
from caffe2ckpt.steps.manager import StepCheckpointManager
from caffe2ckpt.steps.metadata import BlobMetadata, RootMetadata, StepMetadata

__all__ = ["AbstractCheckpointManager", "BlobMetadata", "RootMetadata", "StepCheckpointManager",
           "StepMetadata"]
