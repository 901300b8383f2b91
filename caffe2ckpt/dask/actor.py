"""The worker side of :class:`~caffe2ckpt.dask.DaskSession`: :class:`NodeActor` holds one node's
workspace in a Dask actor and runs the node's steps there. The session reaches it only through
:meth:`NodeActor.call`, which takes the arguments pickled and always answers with the pickled
outcome, so nothing that goes wrong on the worker can leave the session's call without an
answer."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
import traceback
import weakref
from typing import Any

import cloudpickle
import numpy as np
from distributed import get_worker

from caffe2ckpt.dask import tier
from caffe2ckpt.dask.scripts import cannot_import
from caffe2ckpt.fs.iopool import set_io_threads
from caffe2ckpt.manager._nodeops import worker_info
from caffe2ckpt.session import Step, run_node_tasks
from caffe2ckpt.workspace import Workspace, WorkspaceType

__all__ = ["NodeActor"]

logger = logging.getLogger(__name__)


class NodeActor:
    """One node's workspace, held by a Dask actor on the worker the node was placed on;
    ``io_threads`` sets the worker process's chunk I/O threads; its memory-tier copies stay
    ``keep`` seconds after it goes (:class:`tier.Lease`)."""

    def __init__(self, node: str, io_threads: int, keep: float = 0.0) -> None:
        self.node = node
        self.ws = Workspace()
        set_io_threads(io_threads)
        self.lease = tier.Lease(node, keep)  # its memory-tier copies (memory_tier=True)
        weakref.finalize(self, self.lease.release).atexit = False
        self._sending: tuple[str, concurrent.futures.Future[None]] | None = None  # to, job

    def call(self, method: str, args: bytes) -> bytes:
        """Run ``method`` with the pickled ``args`` for the session; returns the pickled (True,
        what it returned) or (False, the exception it raised). It never raises: arguments that
        cannot be unpickled here (a task function whose module this worker cannot import) come
        back as that error too. (Dask's own actor call loses any error of its transport that is
        not an ``OSError``, and its caller waits for ever.)"""
        try:
            loaded = cloudpickle.loads(args)
        except BaseException as exc:  # noqa: BLE001 - handed to the client, which raises it
            exc.add_note(f"while unpickling the arguments of {method!r} on node {self.node!r}"
                         + _import_hint(exc))
            return _pack((False, exc), self.node)
        if method == "run":
            return self.run(*loaded)
        try:
            outcome = True, getattr(self, method)(*loaded)
        except BaseException as exc:  # noqa: BLE001 - handed to the client, which raises it
            outcome = False, exc
        try:
            return _pack(outcome, self.node, verify=not outcome[0])
        finally:
            del outcome  # (see run)

    def run(self, steps: list[Step], workspace_type: WorkspaceType) -> bytes:
        """The pickled (True, the steps' results) or (False, the exception a step raised), so
        the client tells a failing task from a lost worker, and what cannot travel back fails
        here, clearly, instead of in Dask's transport."""
        try:
            outcome = True, run_node_tasks(steps, self.ws, workspace_type)
        except BaseException as exc:  # noqa: BLE001 - handed to the client, which raises it
            outcome = False, exc
        try:
            return _pack(outcome, self.node)
        finally:
            # an exception's traceback holds this frame, which held it: without this cycle
            # the actor goes (its lease released) when its session does, not at the next
            # collection of cycles
            del outcome

    def names(self) -> list[str]:
        return list(self.ws)

    def get(self, name: str) -> np.ndarray:
        return self.ws[name]

    def set(self, name: str, value: Any) -> None:
        self.ws[name] = value

    def delete(self, name: str) -> None:
        del self.ws[name]

    def clear(self) -> None:
        """Empty the workspace (and drop the changed-row hints it kept)."""
        self.ws = Workspace()

    def where(self) -> dict[str, Any]:
        return worker_info()

    def cannot_import(self, names: list[str]) -> list[str]:
        """Those of the modules ``names`` that this worker cannot import by name."""
        return cannot_import(names)

    # -- the memory tier (caffe2ckpt.dask.tier) --------------------------------------------------

    @property
    def copies(self) -> tier.Copies:
        return self.lease.copies

    def snapshot(self, epoch: int, token: str, buddy: tuple[str, str] | None,
                 buddied: set[str]) -> float:
        """Copy the workspace into the node's own memory-tier copy; then, in the background,
        digest it and send it to the ``buddy`` actor (its worker's address, its key). This
        actor keeps only the held copies of the ``buddied`` nodes. Returns the seconds the copy
        took (what the training path waits for)."""
        self._settle(())
        self.lease.bind(token)
        self.copies.keep_held(buddied)
        start = time.perf_counter()
        own = tier.take(self.copies, self.ws, epoch, token)
        took = time.perf_counter() - start
        self._send_later(own, buddy, seal=True)
        return took

    def _send_later(self, own: tier.Copy, buddy: tuple[str, str] | None, *, seal: bool) -> None:
        """In the background: digest ``own`` (``seal``), then send it to ``buddy``."""
        worker = get_worker()

        async def seal_and_send() -> None:
            if seal:
                await asyncio.get_running_loop().run_in_executor(None, tier.seal, own)
            if buddy is not None:
                await tier.send(own, worker.rpc(buddy[0]), buddy[1], "held")
                own.sent = True

        job = asyncio.run_coroutine_threadsafe(seal_and_send(), worker.loop.asyncio_loop)
        self._sending = (buddy[0] if buddy else "", job)

    def tier_push(self, epoch: int, buddy: tuple[str, str]) -> None:
        """Send the node's own copy (complete, of ``epoch``) to ``buddy``, in the background."""
        self._settle(())
        self._send_later(self.copies.held(self.node, "own", epoch), buddy, seal=False)

    def _settle(self, lost: tuple[str, ...] | list[str], give_up: bool = False) -> None:
        """Wait for the last snapshot's background work; give up a send to a ``lost`` worker
        (with ``give_up``, any send)."""
        if self._sending is None:
            return
        to, job = self._sending
        self._sending = None
        if to in lost or give_up:
            job.cancel()
        try:
            job.result()
        except concurrent.futures.CancelledError:
            pass  # its copy stays incomplete: never used
        except BaseException as exc:  # noqa: BLE001 - its copy stays incomplete: never used
            logger.warning("node %r: the memory-tier copy to %s failed: %r", self.node, to, exc)
        finally:
            del job  # its error's traceback holds this frame: no cycle keeps the actor (see run)

    def tier_settle(self, lost: list[str], give_up: bool) -> None:
        """Wait until this node's last copy reached its buddy or failed (a copy to a ``lost``
        worker is given up; with ``give_up``, any copy)."""
        self._settle(lost, give_up)

    def tier_adopt(self, key: str) -> bool:
        """Take over the copies this node's previous actor on this worker left for prefix
        ``key`` (its session went without finishing the job); False if it left none."""
        self._settle(())
        return self.lease.adopt(key)

    def tier_drop(self) -> None:
        """Drop every copy this actor keeps (its job finished)."""
        self._settle((), give_up=True)
        self.lease.drop()

    def tier_copies(self) -> list[dict[str, Any]]:
        """The copies this actor holds."""
        return self.copies.listing()

    async def tier_receive(self, message: tuple[Any, ...]) -> None:
        """One piece of a copy another actor sends (on the worker's event loop, so that two
        actors sending to each other never wait for each other's thread)."""
        self.copies.receive(message)

    def tier_send(self, node: str, role: str, epoch: int, to: tuple[str, str]) -> None:
        """Send this actor's ``role`` copy of ``node`` (which must be complete and of
        ``epoch``) to the actor ``to`` as its own copy."""
        copy = self.copies.held(node, role, epoch)
        worker = get_worker()
        asyncio.run_coroutine_threadsafe(tier.send(copy, worker.rpc(to[0]), to[1], "own"),
                                         worker.loop.asyncio_loop).result()

    def tier_restore(self, epoch: int, token: str, adopt: bool) -> None:
        """Put the node's own copy of ``epoch`` back as its workspace (verified first; see
        :func:`tier.restore` for ``adopt``)."""
        self._settle(())
        tier.restore(self.copies, self.ws, epoch, token, adopt=adopt)


def _import_hint(exc: BaseException) -> str:
    """What to do when a worker cannot load a task function's module."""
    if isinstance(exc, ModuleNotFoundError) and exc.name:
        return (f": this Dask worker cannot import module {exc.name!r}; install it where the "
                "workers run (the session sends by value only modules of the flow process that "
                "live outside site-packages, such as a deployed flow file)")
    return " (are its task functions importable on the Dask workers?)"


def _pack(outcome: tuple[bool, Any], node: str, *, verify: bool = True) -> bytes:
    """Pickle a node's outcome (with cloudpickle, like Dask); a failure carries the remote
    traceback as a note. Anything that would not come back intact becomes a RuntimeError
    saying what it was. ``verify=False`` skips unpickling the result here (the workspace's own
    values: arrays, names, the worker's address, which always come back)."""
    finished, value = outcome
    where = worker_info()
    if not finished:
        value.add_note(f"raised on node {node!r} (Dask worker on {where['host']}, pid "
                       f"{where['pid']}):\n" + "".join(traceback.format_exception(value)).rstrip())
    try:
        data = cloudpickle.dumps(outcome)
        if verify:
            cloudpickle.loads(data)  # e.g. an exception whose __init__ wants other arguments
        return data
    except Exception as exc:  # noqa: BLE001 - any pickling failure
        what = (f"raised {type(value).__name__}: {value}" if not finished else
                f"returned a value that cannot be sent back ({type(exc).__name__}: {exc})")
        notes = "\n".join(getattr(value, "__notes__", [])) if not finished else ""
        return cloudpickle.dumps((False, RuntimeError(f"node {node!r} {what}\n{notes}")))
