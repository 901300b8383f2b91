"""Requests to the Prefect API that a job waits for only so long.

Prefect's client retries a request that times out, with back-off, for minutes. A job that asks
the API something on the way (is my flow run still mine? was this event stored?) must go on
when the answer is late: :func:`in_background` sends the request from a daemon thread (which
never holds up the process's exit), and the caller waits on its future as long as it chooses.
"""

from __future__ import annotations

import contextvars
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import TypeVar

__all__ = ["in_background"]

T = TypeVar("T")


def in_background(call: Callable[[], T], name: str = "caffe2ckpt-api") -> Future[T]:
    """Start ``call()`` in a daemon thread, in a copy of the caller's context (Prefect's
    settings and run contexts live in context variables); its future."""
    future: Future[T] = Future()
    context = contextvars.copy_context()

    def run() -> None:
        try:
            future.set_result(context.run(call))
        except BaseException as exc:  # noqa: BLE001 - handed to whoever reads the future
            future.set_exception(exc)

    threading.Thread(target=run, name=name, daemon=True).start()
    return future
