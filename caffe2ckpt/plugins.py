"""Integrations installed as entry points (group ``caffe2ckpt.plugins``), loaded by a
command-line run only when their environment variable is set: each entry point is named after
that variable, and is a function that installs the integration. caffe2ckpt's own is Prefect's
(``PREFECT_API_URL``): checkpoint events become Prefect events, and ``prefect-block://``
references name checkpoint prefixes. Without the variable nothing is imported, so a command
pays nothing for integrations it does not use.
"""

from __future__ import annotations

import logging
import os
import threading
from importlib.metadata import entry_points

__all__ = ["GROUP", "load"]

logger = logging.getLogger(__name__)

GROUP = "caffe2ckpt.plugins"
_lock = threading.Lock()
_loaded = False


def load() -> None:
    """Install every integration whose environment variable is set (once per process). What
    the caller's ``caffe2ckpt`` loggers print stays as it was: an integration may configure
    logging when it is imported (Prefect does)."""
    global _loaded
    with _lock:
        if _loaded:
            return
        _loaded = True
    ours = logging.getLogger("caffe2ckpt")
    before = (list(ours.handlers), ours.level, ours.propagate)
    for plugin in entry_points(group=GROUP):
        if os.environ.get(plugin.name):
            try:
                plugin.load()()
            except Exception as exc:  # noqa: BLE001 - an integration never stops a command
                logger.warning("could not load the integration %r: %r", plugin.value, exc)
    ours.handlers[:], ours.level, ours.propagate = before
