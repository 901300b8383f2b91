"""AbstractCheckpointManager: StepCheckpointManager implements it, users can subclass it (an
incomplete subclass cannot be instantiated), code typed against it runs on either, a class with
every member counts as a virtual subclass, and ``directory`` is a path on a local disk and the
URL elsewhere."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from caffe2ckpt import AbstractCheckpointManager, StepCheckpointManager

MEMBERS = {"directory", "all_steps", "latest_step", "best_step", "reload", "reached_preemption",
           "should_save", "save", "delete", "restore", "item_metadata", "metadata", "metrics",
           "wait_until_finished", "check_for_errors", "close"}


class DictManager(AbstractCheckpointManager):
    """A complete user implementation: steps kept in a dict, saved every ``every`` steps."""

    def __init__(self, every: int = 1) -> None:
        self.every = every
        self.saved: dict[int, tuple[Any, dict[str, float] | None]] = {}

    @property
    def directory(self) -> Path:
        return Path("/nowhere")

    def all_steps(self, read: bool = False) -> Sequence[int]:
        return sorted(self.saved)

    def latest_step(self) -> int | None:
        return max(self.saved, default=None)

    def best_step(self) -> int | None:
        return self.latest_step()

    def reload(self) -> None:
        pass

    def reached_preemption(self, step: int) -> bool:
        return False

    def should_save(self, step: int) -> bool:
        latest = self.latest_step()
        return (latest is None or step > latest) and step % self.every == 0

    def save(self, step: int, items: Any = None, *, metrics: dict[str, float] | None = None,
             force: bool = False) -> bool:
        if not (force or self.should_save(step)):
            return False
        self.saved[step] = (items, metrics)
        return True

    def delete(self, step: int) -> None:
        del self.saved[step]

    def restore(self, step: int | None = None) -> Any:
        return self.saved[self.latest_step() if step is None else step][0]

    def item_metadata(self, step: int) -> Any:
        return sorted(self.saved[step][0])

    def metadata(self, step: int | None = None) -> Any:
        return {"steps": self.all_steps()} if step is None else {"step": step}

    def metrics(self, step: int) -> Any:
        return self.saved[step][1]

    def wait_until_finished(self) -> None:
        pass

    def check_for_errors(self) -> None:
        pass

    def close(self) -> None:
        pass


def train(mgr: AbstractCheckpointManager, steps: int) -> list[int]:
    """A training loop that knows only the interface: resume from the latest step, save by
    the manager's policy, close."""
    start = mgr.latest_step()
    w = np.zeros(3) if start is None else mgr.restore(start)["trainer_0"]["w"]
    for step in range((start or 0) + 1, steps + 1):
        w = w + 1
        if mgr.should_save(step):
            mgr.save(step, {"trainer_0": {"w": w}}, metrics={"loss": 1 / step})
        if mgr.reached_preemption(step):
            break
    mgr.wait_until_finished()
    mgr.check_for_errors()
    steps_saved = list(mgr.all_steps(read=True))
    mgr.close()
    return steps_saved


def test_the_interface_has_orbaxs_members_and_the_step_manager_implements_all_of_them(prefix):
    assert AbstractCheckpointManager.__abstractmethods__ == MEMBERS
    with pytest.raises(TypeError, match="abstract"):
        AbstractCheckpointManager()
    assert issubclass(StepCheckpointManager, AbstractCheckpointManager)
    assert not StepCheckpointManager.__abstractmethods__
    with StepCheckpointManager(prefix, handle_preemption=False) as mgr:
        assert isinstance(mgr, AbstractCheckpointManager)


def test_an_incomplete_subclass_cannot_be_instantiated_and_names_what_is_missing():
    class NoErrorsCheck(DictManager):
        check_for_errors = AbstractCheckpointManager.check_for_errors

    with pytest.raises(TypeError, match="NoErrorsCheck.*check_for_errors"):
        NoErrorsCheck()
    partial = type("Partial", (AbstractCheckpointManager,), {
        "all_steps": DictManager.all_steps, "latest_step": DictManager.latest_step})
    with pytest.raises(TypeError, match="Partial") as info:
        partial()
    missing = MEMBERS - {"all_steps", "latest_step"}
    assert all(name in str(info.value) for name in missing)
    assert issubclass(partial, AbstractCheckpointManager)  # still a subclass, just abstract


def test_code_typed_against_the_interface_runs_on_a_user_subclass_and_the_step_manager(prefix):
    user = DictManager(every=2)
    assert train(user, 6) == [2, 4, 6]
    assert user.restore()["trainer_0"]["w"].tolist() == [6.0, 6.0, 6.0]
    assert isinstance(user.directory, os.PathLike)
    assert train(StepCheckpointManager(prefix, handle_preemption=False), 3) == [1, 2, 3]
    resumed = StepCheckpointManager(prefix, handle_preemption=False)
    assert train(resumed, 5) == [1, 2, 3, 4, 5]
    with StepCheckpointManager(prefix, handle_preemption=False) as mgr:
        assert mgr.restore(5)["trainer_0"]["w"].tolist() == [5.0, 5.0, 5.0]
        assert mgr.metrics(4) == {"loss": 0.25}


def _shaped(name: str, skip: str = "", none: str = "") -> type:
    """A class not derived from the interface, with its members but ``skip`` (``none``: set to
    None)."""
    members: dict[str, Any] = {m: (lambda self: None) for m in MEMBERS - {skip}}
    if none:
        members[none] = None
    return type(name, (), members)


def test_subclasshook_counts_a_class_with_every_member_as_a_virtual_subclass():
    duck = _shaped("Duck")
    assert issubclass(duck, AbstractCheckpointManager)
    assert isinstance(duck(), AbstractCheckpointManager)
    assert AbstractCheckpointManager not in duck.__mro__
    inherited = type("Inherited", (duck,), {})  # members from a base class count too
    assert issubclass(inherited, AbstractCheckpointManager)
    assert not issubclass(_shaped("NoClose", skip="close"), AbstractCheckpointManager)
    assert not issubclass(_shaped("NoDirectory", skip="directory"), AbstractCheckpointManager)
    assert not issubclass(_shaped("OptedOut", none="save"), AbstractCheckpointManager)
    assert not isinstance(object(), AbstractCheckpointManager)
    # only the interface matches by shape: a concrete manager is a base only by inheritance
    assert not issubclass(duck, StepCheckpointManager)
    assert not issubclass(duck, DictManager)


def test_directory_is_a_path_on_a_local_disk(tmp_path, monkeypatch):
    with StepCheckpointManager(str(tmp_path / "ckpt"), handle_preemption=False) as mgr:
        assert isinstance(mgr.directory, os.PathLike) and mgr.directory == tmp_path / "ckpt"
        mgr.save(0, {"trainer_0": {"w": np.zeros(2)}})
        assert (mgr.directory / "_commits").is_dir()  # the real directory
        assert mgr.metadata().directory == str(tmp_path / "ckpt")  # RootMetadata: as given
    monkeypatch.chdir(tmp_path)
    with StepCheckpointManager("rel/ckpt", handle_preemption=False) as mgr:
        assert mgr.directory == Path.cwd() / "rel" / "ckpt"  # absolute
    with StepCheckpointManager(f"file://{tmp_path}/ckpt", handle_preemption=False) as mgr:
        assert mgr.directory == tmp_path / "ckpt" and mgr.all_steps() == [0]


def test_directory_is_the_url_on_other_filesystems(memory_fs):
    with StepCheckpointManager("memory://runs/a", handle_preemption=False) as mgr:
        assert mgr.directory == "memory://runs/a" and isinstance(mgr.directory, str)
        mgr.save(0, {"trainer_0": {"w": np.zeros(2)}})
    with StepCheckpointManager("/runs/a", filesystem=memory_fs, handle_preemption=False) as mgr:
        assert mgr.directory == "/runs/a" and mgr.all_steps() == [0]  # a path on that fs
