"""The Orbax-style API (re-exports only): :class:`AbstractCheckpointManager`, Orbax's interface,
and :class:`StepCheckpointManager`, its implementation over caffe2ckpt's prefixes."""

from caffe2ckpt.steps.abstract import AbstractCheckpointManager
from caffe2ckpt.steps.manager import BlobMetadata, RootMetadata, StepCheckpointManager, StepMetadata

__all__ = ["AbstractCheckpointManager", "BlobMetadata", "RootMetadata", "StepCheckpointManager",
           "StepMetadata"]
