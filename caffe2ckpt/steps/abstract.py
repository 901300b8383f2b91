"""The checkpoint-manager interface of Orbax (``AbstractCheckpointManager``) as an abstract base
class, so code can be typed against it and other managers can implement it.

:class:`~caffe2ckpt.StepCheckpointManager` is this package's implementation. A user class
either subclasses :class:`AbstractCheckpointManager` (instantiating it fails with ``TypeError``
naming every method it leaves abstract) or just defines every member: Orbax declares its class
a ``typing.Protocol`` (matched by shape), and here ``issubclass``/``isinstance`` likewise count
such a class as a *virtual* subclass (:meth:`AbstractCheckpointManager.__subclasshook__`).

Members beyond the ones listed in Orbax's API page: ``save`` and ``delete`` are abstract in
Orbax's source too, and a manager without them could not be used through the interface.
"""

from __future__ import annotations

import abc
import os
from collections.abc import Sequence
from typing import Any

__all__ = ["AbstractCheckpointManager"]


class AbstractCheckpointManager(abc.ABC):
    """Saves numbered steps under one directory, lists them, restores them and retires them.

    Structural check: ``issubclass(C, AbstractCheckpointManager)`` is True for any class ``C``
    that has (defined itself or inherited) every member named in ``__abstractmethods__`` of this
    class; setting a member to ``None`` in ``C`` opts out. The check applies to this class only,
    not to its subclasses (a class is a ``StepCheckpointManager`` only by inheriting from it),
    and ``abc`` caches each answer per class.
    """

    @classmethod
    def __subclasshook__(cls, other: type) -> Any:
        if cls is not AbstractCheckpointManager:
            return NotImplemented  # a concrete manager is subclassed, never matched by shape
        for name in AbstractCheckpointManager.__abstractmethods__:
            owner = next((base for base in other.__mro__ if name in base.__dict__), None)
            if owner is None or owner.__dict__[name] is None:
                return NotImplemented  # the ordinary rules decide (subclasses, register())
        return True

    @property
    @abc.abstractmethod
    def directory(self) -> os.PathLike[str] | str:
        """Where the steps live: an ``os.PathLike`` (e.g. ``pathlib.Path``) for a local
        directory; an implementation on a filesystem without local paths may return its URL
        (a ``str``) and must say so."""

    @abc.abstractmethod
    def all_steps(self, read: bool = False) -> Sequence[int]:
        """The saved steps. ``read=True``: ask the storage, not a cached listing."""

    @abc.abstractmethod
    def latest_step(self) -> int | None:
        """The newest saved step, or None when there is none."""

    @abc.abstractmethod
    def best_step(self) -> int | None:
        """The best saved step by the manager's ``best_fn``, or None when there is none."""

    @abc.abstractmethod
    def reload(self) -> None:
        """Forget cached state (the step listing) and read it again from the storage, which
        someone else may have changed."""

    @abc.abstractmethod
    def reached_preemption(self, step: int) -> bool:
        """Whether the job is being preempted, so ``step`` should be saved and the loop left."""

    @abc.abstractmethod
    def should_save(self, step: int) -> bool:
        """Whether the save policy wants ``step`` saved. Never for a step at or below the
        latest saved one."""

    @abc.abstractmethod
    def save(self, step: int, *args: Any, **kwargs: Any) -> bool:
        """Save ``step`` if :meth:`should_save` agrees (or when forced); return whether it did.
        What is saved, and how metrics and forcing are passed, is the implementation's."""

    @abc.abstractmethod
    def delete(self, step: int) -> None:
        """Remove ``step``."""

    @abc.abstractmethod
    def restore(self, step: int, *args: Any, **kwargs: Any) -> Any:
        """The saved contents of ``step``."""

    @abc.abstractmethod
    def item_metadata(self, step: int) -> Any:
        """Per-item metadata of ``step`` (what was saved), without reading the data."""

    @abc.abstractmethod
    def metadata(self, step: int | None = None) -> Any:
        """Metadata of ``step``; with no step, of the directory as a whole."""

    @abc.abstractmethod
    def metrics(self, step: int) -> Any:
        """The metrics saved with ``step``, or None when it has none."""

    @abc.abstractmethod
    def wait_until_finished(self) -> None:
        """Block until every save started so far is complete (a no-op when saves are
        synchronous)."""

    @abc.abstractmethod
    def check_for_errors(self) -> None:
        """Raise the error of an asynchronous save that has already failed, without waiting
        for the ones still running."""

    @abc.abstractmethod
    def close(self) -> None:
        """Finish outstanding work (as :meth:`wait_until_finished`) and release resources."""
