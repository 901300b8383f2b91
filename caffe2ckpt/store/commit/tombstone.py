"""Tombstones: what stays at ``<node>.<epoch>`` once the save that took that path is removed.

The first save of an epoch takes Caffe2's path ``<node>.<epoch>`` by creating its ``zarr.json``
exclusively; a later save of the epoch writes at a path of its own. A path that was freed could
be taken again, and a remover that checked the old save's identity a moment earlier would then
delete the new save's files. So removing a group at ``<node>.<epoch>`` never deletes its
``zarr.json``: the remover replaces it by a tombstone, an empty Zarr group whose attributes say
which save was removed. The path stays taken for ever (a later save of the epoch writes at its
own path), plain ``zarr.open_group`` opens it as an empty group, and ``gc`` leaves it alone.
Paths of their own (``<node>.<epoch>.<save id>``) are removed whole: no save can ever take
them again.
"""

from __future__ import annotations

import json

from caffe2ckpt.fs import strictjson

__all__ = ["ATTRIBUTE", "is_tombstone", "tombstone"]

ATTRIBUTE = "caffe2ckpt_removed"
MAX_BYTES = 4096  # a tombstone is small; a larger file is not one


def tombstone(node: str, epoch: int, save_id: str) -> bytes:
    """The ``zarr.json`` that marks ``<node>.<epoch>`` as used by the removed save ``save_id``."""
    return json.dumps({"zarr_format": 3, "node_type": "group", "attributes": {ATTRIBUTE: {
        "node": node, "epoch": epoch, "save_id": save_id,
        "note": "this checkpoint was removed; a later save of this epoch has a path of its own"}}},
        sort_keys=True).encode()


def is_tombstone(raw: bytes) -> bool:
    """Whether ``raw`` (a group's ``zarr.json``) is a tombstone."""
    if len(raw) > MAX_BYTES:
        return False
    try:
        data = strictjson.loads(raw)
        return isinstance(data["attributes"][ATTRIBUTE], dict)
    except (ValueError, KeyError, TypeError):
        return False
