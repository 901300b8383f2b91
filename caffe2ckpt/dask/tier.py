"""The memory tier, worker side: copies of node workspaces kept by the nodes' Dask actors.

After an epoch, each node's actor copies its workspace into buffers it keeps from the previous
snapshot (its *own* copy: after the first snapshot a copy allocates nothing), then, in the
background while the next epoch runs, digests it (xxh3-128, as a save records) and sends it in
pieces to a *buddy* node's actor on another worker, which keeps it as a *held* copy in
buffers it also reuses. So a worker keeps, per node it holds, the live workspace and its own
copy, plus the held copies of its buddied nodes: for one buddy per node, about three times its
own workspace. The copies belong to the actors (:class:`Copies`): they go when the actors do.

A copy is marked incomplete while it is overwritten and complete once all of it arrived and its
digests are known; a restore verifies every blob's digest and the run's token. Nothing here is
written to storage or seen by the checkpoint store: a copy is never a committed checkpoint.

An actor's copies outlive it for a while (:class:`Lease`): when its session's client goes away
(the flow process died) or closes without the job finishing, they stay in the worker process,
under the key of the checkpoint prefix they were taken for, for ``keep`` seconds, so that the
next session of the job (a Prefect retry against the same cluster) resumes from them: a new
actor of the same node on that worker takes them over (:meth:`Lease.adopt`). A job that
finishes drops them at once (:meth:`Lease.drop`).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import xxhash
from distributed.protocol import to_serialize

from caffe2ckpt.errors import CheckpointCorruptedError
from caffe2ckpt.session import token_key
from caffe2ckpt.workspace import Workspace

__all__ = ["PIECE_BYTES", "Copies", "Copy", "Lease", "alive", "kept", "restore", "seal", "send",
           "take"]

logger = logging.getLogger(__name__)

PIECE_BYTES = 32 * 1024 * 1024  # one message of a copy sent to another worker
SEND_TIMEOUT = 120.0  # seconds one piece may take before the send is given up


@dataclass
class Copy:
    """One node's workspace as of ``epoch``, for the run holding ``token``."""

    node: str
    epoch: int
    token: str
    arrays: dict[str, np.ndarray] = field(default_factory=dict)
    digests: dict[str, str] = field(default_factory=dict)
    complete: bool = False
    sent: bool = False  # an own copy: whether its buddy holds all of it

    def describe(self) -> dict[str, Any]:
        return {"node": self.node, "epoch": self.epoch, "token": self.token,
                "complete": self.complete}

    def reshape(self, specs: dict[str, Spec]) -> None:
        """Make the buffers match ``specs``, keeping those that do."""
        old, self.arrays = self.arrays, {}
        for name, spec in specs.items():
            buf = old.get(name)
            if buf is None or spec_of(buf) != spec:
                buf = np.empty(spec[1], spec[0], order=spec[2])
                flat(buf)[:] = 0  # its pages now, at once: see below
            self.arrays[name] = buf


Spec = tuple[np.dtype, tuple[int, ...], str]  # a blob's dtype, shape and memory order


def spec_of(arr: np.ndarray) -> Spec:
    """What a copy's buffer for ``arr`` is: its dtype, shape and order (Fortran order kept)."""
    fortran = arr.flags.f_contiguous and not arr.flags.c_contiguous
    return arr.dtype, arr.shape, "F" if fortran else "C"


def flat(arr: np.ndarray) -> np.ndarray:
    """The bytes of a copy's buffer (contiguous in its own order), as a view."""
    return arr.reshape(-1, order=spec_of(arr)[2]).view(np.uint8)


def digest(arr: np.ndarray) -> str:
    """The xxh3-128 of a copy's buffer's bytes."""
    return xxhash.xxh3_128_hexdigest(memoryview(flat(arr)))


class Copies:
    """The copies one node's actor keeps: its node's own copy, and the held copies of the
    nodes it is the buddy of. They live as long as the actor's :class:`Lease` keeps them."""

    def __init__(self, node: str) -> None:
        self.node = node
        self._copies: dict[tuple[str, str], Copy] = {}  # (node, "own" or "held") -> copy
        self._lock = threading.Lock()
        _alive.add(self)

    def slot(self, node: str, role: str) -> Copy:
        with self._lock:
            return self._copies.setdefault((node, role), Copy(node, -1, ""))

    def listing(self) -> list[dict[str, Any]]:
        """One entry per copy, with its role."""
        with self._lock:
            return [{**c.describe(), "role": role} for (_, role), c in self._copies.items()]

    def held(self, node: str, role: str, epoch: int) -> Copy:
        """The complete ``role`` copy of ``node`` at ``epoch``."""
        with self._lock:
            copy = self._copies.get((node, role))
        if copy is None or not copy.complete or copy.epoch != epoch:
            raise CheckpointCorruptedError(
                f"memory-tier copy of node {node!r}, epoch {epoch}: node {self.node!r}'s actor "
                "has " + ("none" if copy is None else
                          f"epoch {copy.epoch} (complete: {copy.complete})"))
        return copy

    def keep_held(self, nodes: set[str]) -> None:
        """Drop the held copies but those of ``nodes`` (no longer buddied here)."""
        with self._lock:
            for key in [k for k in self._copies if k[1] == "held" and k[0] not in nodes]:
                del self._copies[key]

    def receive(self, message: tuple[Any, ...]) -> None:
        """Apply one message of :func:`send`."""
        kind, node, role, *rest = message
        copy = self.slot(node, role)
        if kind == "begin":
            epoch, token, specs = rest
            copy.complete, copy.epoch, copy.token, copy.digests = False, epoch, token, {}
            copy.reshape(specs)
        elif kind == "piece":
            name, start, piece = rest
            flat(copy.arrays[name])[start:start + piece.size] = piece
        else:
            epoch, digests = rest
            if epoch != copy.epoch:
                raise RuntimeError(f"memory-tier copy of node {node!r}: epoch {epoch} ended, "
                                   f"{copy.epoch} began")
            copy.digests, copy.complete = digests, True


_alive: weakref.WeakSet[Copies] = weakref.WeakSet()  # every store of this process, for tests


@dataclass
class _Entry:
    """A store of copies taken for a prefix: its actor's lease while the actor lives (None
    once it went), and then when it expires (on :data:`_clock`)."""

    copies: Copies
    owner: Lease | None
    expires: float = math.inf


_kept: dict[tuple[str, str], _Entry] = {}  # (prefix key, node) -> the node's newest store
_kept_lock = threading.Lock()
_gone: collections.deque[Lease] = collections.deque()  # leases of actors gone, to release
SWEEP_SECONDS = 0.5  # how often released leases are taken in and expired stores dropped


class Lease:
    """One node actor's hold on its copies (:attr:`copies`), and what becomes of them when the
    actor goes: kept ``keep`` seconds under the prefix key of the run that took them, for a
    new actor of the node to :meth:`adopt` (one per node and prefix in a worker process: the
    newest)."""

    def __init__(self, node: str, keep: float) -> None:
        self.node, self.keep = node, keep
        self.copies = Copies(node)
        self.key: str | None = None  # the prefix the copies were taken for
        _start_sweeping()

    def bind(self, token: str) -> None:
        """The copies are now taken for ``token``'s prefix: they are the node's newest there
        (what an earlier actor of the node kept for it goes). Without a prefix, nothing can
        resume from them: they are kept by no one after the actor."""
        with _kept_lock:
            self._rekey(token_key(token) or None)
            if self.key is not None:
                _kept[(self.key, self.node)] = _Entry(self.copies, self)

    def adopt(self, key: str) -> bool:
        """Take over the node's newest copies kept here for prefix ``key`` by another actor
        (gone, or still there for a session that went: that one keeps none); False when there
        are none."""
        with _kept_lock:
            entry = _kept.get((key, self.node))
            if entry is None or entry.owner is self:
                return False
            if entry.owner is not None:
                entry.owner.copies, entry.owner.key = Copies(self.node), None
            self._rekey(key)
            self.copies = entry.copies
            _kept[(key, self.node)] = _Entry(entry.copies, self)
        return True

    def drop(self) -> None:
        """Forget every copy (the job finished: no resume needs them)."""
        with _kept_lock:
            self._rekey(None)
        self.copies = Copies(self.node)

    def release(self) -> None:
        """The actor went (a finalizer: it may run inside the garbage collector, in any
        thread, so it only queues the lease; :func:`_sweep` keeps its copies ``keep`` seconds
        if they are still the node's newest for their prefix)."""
        _gone.append(self)

    def _rekey(self, key: str | None) -> None:
        """(Holding the lock.) The lease's copies are for ``key`` now: its entry under another
        key goes."""
        where = (self.key or "", self.node)
        if self.key != key and _kept.get(where, _NONE).owner is self:
            del _kept[where]
        self.key = key


_NONE = _Entry(Copies("-"), None)


def _sweep() -> None:
    """Take in the leases of actors gone (their copies expire ``keep`` seconds from now, or at
    once), and drop the stores expired."""
    now = _clock()
    with _kept_lock:
        while _gone:
            lease = _gone.popleft()
            entry = _kept.get((lease.key or "", lease.node))
            if entry is not None and entry.owner is lease:
                entry.owner, entry.expires = None, now + lease.keep
        for where in [w for w, e in _kept.items() if e.owner is None and e.expires <= now]:
            del _kept[where]


_sweeper: threading.Thread | None = None
_clock = time.monotonic  # (tests set another)


def _start_sweeping() -> None:
    global _sweeper
    with _kept_lock:
        if _sweeper is None or not _sweeper.is_alive():
            _sweeper = threading.Thread(target=_sweep_forever, name="caffe2ckpt-tier-sweep",
                                        daemon=True)
            _sweeper.start()


def _sweep_forever() -> None:
    while True:
        time.sleep(SWEEP_SECONDS)
        try:
            _sweep()
        except Exception:  # the sweeper must live on
            logger.exception("the memory tier's sweep failed")


def kept(key: str) -> list[dict[str, Any]]:
    """The copies this worker process keeps for prefix ``key``: one entry per copy, naming
    the node whose actor keeps or kept it (``"store"``)."""
    _sweep()
    with _kept_lock:
        stores = [(node, e.copies) for (k, node), e in _kept.items() if k == key]
    return [{**entry, "store": node} for node, copies in stores for entry in copies.listing()]


def alive() -> list[Copies]:
    """The stores of the actors alive in this process."""
    return list(_alive)


def take(store: Copies, ws: Workspace, epoch: int, token: str) -> Copy:
    """Copy ``ws`` into the store's node's own copy (digests not yet computed: see
    :func:`seal`)."""
    own = store.slot(store.node, "own")
    own.complete = own.sent = False
    names = ws.local_names()
    own.reshape({n: spec_of(ws[n]) for n in names})
    for name in names:
        np.copyto(own.arrays[name], ws[name])
    own.epoch, own.token, own.digests = epoch, token, {}
    return own


def seal(copy: Copy) -> None:
    """Digest a copy just taken, and mark it complete."""
    copy.digests = {name: digest(arr) for name, arr in copy.arrays.items()}
    copy.complete = True


async def send(copy: Copy, rpc: Any, key: str, role: str) -> None:
    """Send a complete ``copy`` to the actor ``key`` that ``rpc`` reaches, as its ``role``
    copy, in pieces of at most :data:`PIECE_BYTES`."""
    specs = {name: spec_of(arr) for name, arr in copy.arrays.items()}
    await _message(rpc, key, ("begin", copy.node, role, copy.epoch, copy.token, specs))
    for name, arr in copy.arrays.items():
        data = flat(arr)
        for start in range(0, data.size, PIECE_BYTES):
            piece = data[start:start + PIECE_BYTES]
            await _message(rpc, key, ("piece", copy.node, role, name, start, piece))
    await _message(rpc, key, ("end", copy.node, role, copy.epoch, copy.digests))


async def _message(rpc: Any, key: str, message: tuple[Any, ...]) -> None:
    reply = await asyncio.wait_for(rpc.actor_execute(
        actor=key, function="tier_receive", args=[to_serialize(message)], kwargs={}),
        SEND_TIMEOUT)
    if reply.get("status") != "OK":
        raise RuntimeError(f"the worker refused a piece of a memory-tier copy: "
                           f"{reply.get('exception')!r}")


def restore(store: Copies, ws: Workspace, epoch: int, token: str, *,
            adopt: bool = False) -> None:
    """Replace ``ws``'s blobs with the store's node's own copy of ``epoch`` (verified first:
    every digest, the epoch and the run's token); blobs the copy does not have are dropped.

    A blob is copied into the array ``ws`` holds under its name when that array is writeable,
    of the same dtype, shape and order, and no other name's array is, or is a view of, the same
    memory (no other blob sees the copy land); into a new array otherwise. With ``adopt``, an empty ``ws`` (a
    node placed again) takes the copy's buffers themselves: the own copy is then gone (the next
    snapshot makes one), so the caller does that only while another worker holds a copy."""
    own = _verified(store, epoch, token)
    if adopt and not ws.local_names():
        ws.restore(own.arrays)
        own.arrays, own.complete, own.epoch = {}, False, -1
        return
    for name in ws.local_names():
        if name not in own.arrays:
            del ws[name]
    held = {name: ws[name] for name in ws.local_names()}
    roots = [id(_root(a)) for a in held.values()]
    shared = {r for r in roots if roots.count(r) > 1}
    ws.restore({name: _into(held.get(name), arr, shared) for name, arr in own.arrays.items()})


def _root(arr: np.ndarray) -> object:
    """The object whose memory ``arr`` is (itself, or what its chain of views ends at)."""
    while isinstance(arr, np.ndarray) and arr.base is not None:
        arr = arr.base
    return arr


def _into(target: np.ndarray | None, arr: np.ndarray, shared: set[int]) -> np.ndarray:
    """``arr``'s values in ``target`` when that is safe (see :func:`restore`), else a copy."""
    if (target is not None and target.flags.writeable and id(_root(target)) not in shared
            and spec_of(target) == spec_of(arr)):
        np.copyto(target, arr)
        return target
    return arr.copy(order="K")


def _verified(store: Copies, epoch: int, token: str) -> Copy:
    """The node's own copy, checked: complete, of ``epoch`` and run ``token``, every digest."""
    own = store.slot(store.node, "own")
    where = f"memory-tier copy of node {store.node!r}, epoch {epoch}"
    if not own.complete or own.epoch != epoch or own.token != token:
        raise CheckpointCorruptedError(f"{where}: its actor holds epoch {own.epoch} "
                                       f"(complete: {own.complete}) of run {own.token!r}")
    for name, arr in own.arrays.items():
        if digest(arr) != own.digests.get(name):
            raise CheckpointCorruptedError(f"{where}: blob {name!r} does not match its digest")
    return own
