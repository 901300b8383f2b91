"""Reading a checkpoint prefix in tests the way the library reads it (through the lineage of
:mod:`caffe2ckpt.history`), without a manager: which save is the newest, which save an epoch
means, and loading a node of it."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np

from caffe2ckpt.errors import CheckpointNotFoundError
from caffe2ckpt.fs.location import Location
from caffe2ckpt.history import cleanup
from caffe2ckpt.history.current import CurrentRun
from caffe2ckpt.history.lineage import Save
from caffe2ckpt.history.scan import family_history, newest_save, scan
from caffe2ckpt.store.commit import runs
from caffe2ckpt.store.commit.protocol import CheckpointStore
from caffe2ckpt.store.commit.tombstone import is_tombstone
from caffe2ckpt.store.format.paths import parse_group_name
from caffe2ckpt.store.format.records import CommitRecord, list_records

__all__ = ["committed_epochs", "delete_epoch", "epochs_with_records", "find_leftovers",
           "gone", "lineage_epochs", "load", "newest_epoch", "open_store", "record_of",
           "records_at", "remove_leftovers", "retain", "save_at", "unreferenced_groups"]


def open_store(url: str, **options: Any) -> CheckpointStore:
    return CheckpointStore(Location(url, options or None))


def gone(location: Location, group: str) -> bool:
    """Whether the group at ``group`` (relative to the prefix) was removed: nothing is there,
    or (at ``<node>.<epoch>``, a path never freed) only its tombstone."""
    path = location.path(group)
    if not location.exists(path):
        return True
    raw = location.read_bytes(f"{path}/zarr.json", limit=4096)
    return location.list_names(path) == ["zarr.json"] and is_tombstone(raw)


def unreferenced_groups(store: CheckpointStore) -> list[str]:
    """Groups holding data that no readable record needs (tombstones aside): what a quiet
    ``gc`` must leave none of."""
    needed, location = scan(store).referenced, store.location
    return sorted(n for n in location.list_names(location.root)
                  if parse_group_name(n) and n not in needed and not gone(location, n))


def newest_epoch(store: CheckpointStore, nodes: Iterable[str]) -> int | None:
    """The epoch a job of ``nodes`` resumes from (None: nothing committed)."""
    save = newest_save(store, nodes)
    return None if save is None else save.epoch


def lineage_epochs(store: CheckpointStore, nodes: Iterable[str]) -> list[int]:
    """The committed epochs of the lineage of ``nodes``, newest first."""
    return [s.epoch for s in family_history(store, nodes).lineage()]


def save_at(store: CheckpointStore, nodes: Iterable[str], epoch: int) -> Save | None:
    """The lineage's committed save of ``epoch`` for the family ``nodes``."""
    return next((s for s in family_history(store, nodes).lineage() if s.epoch == epoch), None)


def records_at(store: CheckpointStore, nodes: Iterable[str],
               epoch: int) -> dict[str, CommitRecord] | None:
    save = save_at(store, nodes, epoch)
    return None if save is None else save.records


def epochs_with_records(store: CheckpointStore, nodes: Iterable[str]) -> list[int]:
    """Epochs where every node of ``nodes`` has a record file, committed or not."""
    return family_history(store, nodes).recorded_epochs()


def record_of(store: CheckpointStore, node: str, epoch: int) -> CommitRecord:
    """The record of ``node`` at ``epoch``: in the current lineage of any family holding it,
    else in any committed save.

    Raises:
        CheckpointCorruptedError: its record is damaged.
        CheckpointNotFoundError: there is no committed one.
    """
    found = scan(store)
    current = found.current()
    if epoch in current and node in current[epoch].records:
        return current[epoch].records[node]
    for save in found.saves():
        if save.epoch == epoch and node in save.records:
            return save.records[node]
    for ref in list_records(store.location):
        if (ref.node, ref.epoch) == (node, epoch):
            store.read_record(ref)  # a damaged record says so (CheckpointCorruptedError)
    raise CheckpointNotFoundError(f"no committed checkpoint of node {node!r} at epoch {epoch}")


def load(store: CheckpointStore, node: str, epoch: int,
         names: list[str] | None = None) -> dict[str, np.ndarray]:
    """Read and verify ``node``'s committed checkpoint of ``epoch``."""
    return store.load_node(record_of(store, node, epoch), names)


def committed_epochs(store: CheckpointStore, nodes: Iterable[str]) -> list[int]:
    """The committed epochs of the lineage of ``nodes``, oldest first."""
    return sorted(lineage_epochs(store, nodes))


def find_leftovers(store: CheckpointStore, **kwargs: Any) -> list[cleanup.Leftover]:
    """What ``caffe2ckpt gc`` would sweep (keyword arguments: ``min_age``, ``nodes``)."""
    return cleanup.find_leftovers(store, scan(store), **kwargs)


def remove_leftovers(store: CheckpointStore, items: list[cleanup.Leftover]) -> None:
    """Sweep ``items``, acting for the newest run (as ``gc`` does)."""
    cleanup.remove_leftovers(store, items, fence=runs.newest_generation(store.location))


def delete_epoch(store: CheckpointStore, epoch: int, nodes: Iterable[str]) -> None:
    """Remove the lineage save of ``epoch`` of the family ``nodes`` (as a step manager's
    ``delete`` does)."""
    save = save_at(store, nodes, epoch)
    assert save is not None, f"epoch {epoch} is not committed for {sorted(nodes)}"
    CurrentRun(store, nodes).remove([save])


def retain(store: CheckpointStore, options: Any, nodes: Iterable[str]) -> None:
    """A retention pass over the family ``nodes`` (acting for the newest run)."""
    CurrentRun(store, nodes).retain(options)
