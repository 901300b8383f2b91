"""Replicated blobs (:class:`caffe2ckpt.Layout`'s ``replicated``) are written once per save, by
the first node holding them; the others' records name that node. So a save whose nodes hold
different values of one would keep only the writer's: before anything is written, every
holder's value must be the writer's (compared by the xxh3-128 of its bytes in stored form, with
its dtype and shape), else the save fails naming the blob and the nodes."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from caffe2ckpt.errors import InvalidBlobError
from caffe2ckpt.store.delta import stored_digest
from caffe2ckpt.store.zarrgroup import stored_form

__all__ = ["check_replicas", "replica_digests"]


def replica_digests(blobs: Mapping[str, np.ndarray]) -> dict[str, str]:
    """A digest of each blob's value: dtype, shape and bytes."""
    return {name: f"{arr.dtype.str}{arr.shape}:"
                  f"{stored_digest(stored_form(np.ascontiguousarray(arr)))}"
            for name, arr in blobs.items()}


def check_replicas(epoch: int, digests: Mapping[str, Mapping[str, str]],
                   writers: Mapping[str, str]) -> None:
    """``digests`` (node -> blob -> :func:`replica_digests`) agree with each blob's writer
    (``writers``: blob -> node).

    Raises:
        InvalidBlobError: a node holds another value of a replicated blob than its writer.
    """
    for name, writer in writers.items():
        differ = sorted(node for node, held in digests.items()
                        if name in held and held[name] != digests[writer][name])
        if differ:
            raise InvalidBlobError(
                f"cannot save epoch {epoch}: replicated blob {name!r} differs between node "
                f"{writer!r} and nodes {differ} (a replicated blob is written once, by "
                f"{writer!r}, for every node holding it: nothing was written)")
