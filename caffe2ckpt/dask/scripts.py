"""Task functions from modules that a Dask worker cannot import travel by value.

cloudpickle pickles a function by reference (its module's name and its own) unless its module
is ``__main__``, whose functions it pickles by value (their code): no other process could
import a script. A flow that a Prefect worker runs from a deployment is not ``__main__``:
Prefect loads the entrypoint file (``emb_job.py:train``) as a module named after the file
(``emb_job``; ``__prefect_loader_<hash>__`` when that name is taken), with the file's folder on
``sys.path`` while the file runs, so that the modules beside it that it imports are found, and
off it afterwards. A Dask worker (``dask worker``, a ``LocalCluster``'s processes, even those the
flow itself starts) has no such folder on its path: pickled by reference, those functions fail
there with ``ModuleNotFoundError: No module named 'emb_job'``.

So before a session first sends a node's steps to a worker, it asks the worker which of this
process's own modules (:func:`own_modules`) it cannot import by name, and registers those with
``cloudpickle.register_pickle_by_value``: their functions then travel as ``__main__``'s do.
Installed libraries are never sent by value: one missing on a worker fails there naming it.
"""

from __future__ import annotations

import logging
import site
import sys
import sysconfig
import threading
from collections.abc import Callable

import cloudpickle

__all__ = ["ScriptModules", "cannot_import"]

logger = logging.getLogger(__name__)

_INSTALLED = tuple({*(sysconfig.get_paths()[key] for key in ("stdlib", "platstdlib", "purelib",
                                                             "platlib")),
                    *site.getsitepackages(), site.getusersitepackages()})


class ScriptModules:
    """One session's record of which of this process's own modules each worker was asked about
    (a worker is asked about a module once)."""

    def __init__(self) -> None:
        self._asked: dict[str, set[str]] = {}  # worker address -> module names asked about
        self._lock = threading.Lock()  # a node's steps wait until their worker was asked

    def send_by_value(self, worker: str, ask: Callable[[list[str]], list[str]]) -> None:
        """Register by value the modules that ``worker`` cannot import, as ``ask(names)``
        answers for the modules it was not asked about yet."""
        with self._lock:
            asked = self._asked.setdefault(worker, set())
            names = [name for name in own_modules() if name not in asked]
            if not names:
                return
            missing = ask(names)
            asked.update(names)
        for name in missing:
            module = sys.modules.get(name)
            if module is not None:
                cloudpickle.register_pickle_by_value(module)
                logger.debug("the functions of module %r (%s) go to Dask workers by value: "
                             "worker %s cannot import it", name, module.__file__, worker)


def own_modules() -> list[str]:
    """The loaded top-level modules (packages, namespace packages too) read from a folder
    outside site-packages and the standard library: a flow file, the modules beside it, a
    package in development. ``__main__`` goes by value anyway."""
    return [name for name, module in list(sys.modules.items())
            if "." not in name and name != "__main__"
            and (path := _location(module)) is not None and not path.startswith(_INSTALLED)]


def _location(module: object) -> str | None:
    """Where ``module`` was read from: its file, or a namespace package's first folder."""
    path = getattr(module, "__file__", None)
    if isinstance(path, str):
        return path
    folders = list(getattr(module, "__path__", None) or [])
    return folders[0] if folders and isinstance(folders[0], str) else None


def cannot_import(names: list[str]) -> list[str]:
    """Those of ``names`` that ``import name`` would not find in this process (run on a
    worker)."""
    return [name for name in names if name not in sys.modules and not _importable(name)]


def _importable(name: str) -> bool:
    """Whether a finder of ``sys.meta_path`` finds the top-level module ``name``."""
    for finder in sys.meta_path:
        find_spec = getattr(finder, "find_spec", None)
        try:
            if find_spec is not None and find_spec(name, None) is not None:
                return True
        except Exception:  # noqa: BLE001 - a finder that fails to look: assume it would find it
            return True
    return False
