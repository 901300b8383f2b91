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
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import xxhash
from distributed.protocol import to_serialize

from caffe2ckpt.errors import CheckpointCorruptedError
from caffe2ckpt.workspace import Workspace

__all__ = ["PIECE_BYTES", "Copies", "Copy", "Lease", "alive", "kept", "restore", "seal", "send",
           "take"]

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
    once it went), and the timer that drops it then."""

    copies: Copies
    owner: Lease | None
    timer: threading.Timer | None = None


_kept: dict[tuple[str, str], _Entry] = {}  # (prefix key, node) -> the node's newest store
_kept_lock = threading.Lock()


def key_of(token: str) -> str:
    """The prefix key a run's token starts with (see :func:`caffe2ckpt.session.tier_token`)."""
    return token.split("/", 1)[0]


class Lease:
    """One node actor's hold on its copies (:attr:`copies`), and what becomes of them when the
    actor goes: kept ``keep`` seconds under the prefix key of the run that took them, for a
    new actor of the node to :meth:`adopt` (one per node and prefix in a worker process: the
    newest)."""

    def __init__(self, node: str, keep: float) -> None:
        self.node, self.keep = node, keep
        self.copies = Copies(node)
        self.key: str | None = None  # the prefix the copies were taken for

    def bind(self, token: str) -> None:
        """The copies are now taken for ``token``'s prefix: they are the node's newest there
        (what an earlier actor of the node kept for it goes)."""
        self.key = key_of(token)
        self._own(_Entry(self.copies, self))

    def adopt(self, key: str) -> bool:
        """Take over the node's newest copies kept here for prefix ``key`` by another actor
        (gone, or of a session that went; its later release keeps nothing); False when there
        are none."""
        with _kept_lock:
            entry = _kept.get((key, self.node))
        if entry is None or entry.owner is self:
            return False
        self.copies, self.key = entry.copies, key
        self._own(_Entry(entry.copies, self))
        return True

    def drop(self) -> None:
        """Forget every copy (the job finished: no resume needs them)."""
        with _kept_lock:
            entry = _kept.get((self.key or "", self.node))
            if entry is not None and entry.owner is self:
                del _kept[(self.key or "", self.node)]
        self.copies, self.key = Copies(self.node), None

    def release(self) -> None:
        """The actor went: its copies stay ``keep`` seconds if they are still the node's
        newest for their prefix."""
        where = (self.key or "", self.node)
        with _kept_lock:
            entry = _kept.get(where)
            if entry is None or entry.owner is not self:
                return
            if self.keep <= 0:
                del _kept[where]
                return
            entry.owner = None
            entry.timer = threading.Timer(self.keep, _expire, (where, entry))
            entry.timer.daemon = True
            entry.timer.start()

    def _own(self, entry: _Entry) -> None:
        with _kept_lock:
            old = _kept.get((self.key or "", self.node))
            _kept[(self.key or "", self.node)] = entry
        if old is not None and old.timer is not None:
            old.timer.cancel()


def _expire(where: tuple[str, str], entry: _Entry) -> None:
    with _kept_lock:
        if _kept.get(where) is entry:
            del _kept[where]


def kept(key: str) -> list[dict[str, Any]]:
    """The copies this worker process keeps for prefix ``key``: one entry per copy, naming
    the node whose actor keeps or kept it (``"store"``)."""
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
