"""Every name under a checkpoint prefix, built and parsed here and nowhere else.

::

    <prefix>/
      <node>.<epoch>/                  the first save of an epoch (Caffe2's ``db_name``)
      <node>.<epoch>.<save id>/        a later save of the same epoch: a path of its own
      _commits/<epoch:012d>.<node>.<save id>.json   commit records (the source of truth)
      _runs/<generation:012d>.json     the run log: one entry per run, never edited
      _runs/<generation:012d>.committed.json   written once a run's first save committed
      _hints/<family>.json             the newest save of a job family (a hint only)
      _retired/<record name>           a removal in progress: the groups the record named
      _metadata.json                   root metadata of a StepCheckpointManager
      _claims/, _staging/              storage model 2: claims still give generations,
                                       ``gc`` sweeps staged leftovers

A **save id** is ``g<generation>-<hex>``: the generation is the claim number of the run that
wrote it (its entry in ``_runs/``), so a listing orders saves by run; within a run the hex starts
with the save's creation time, so two saves of one epoch in one run sort in the order they were
made. Ids of another form (records of format 1) are generation 0.

Node names never start with ``_`` (:func:`caffe2ckpt.naming.check_node_name`), so no group can
collide with the directories above; a save id always contains ``g`` and ``-``, so a later
save's path never parses as a first save's (``<node>.<digits>``), whatever dots the node name
holds.
"""

from __future__ import annotations

import hashlib
import re
import threading
import time
import uuid
from typing import NamedTuple

from caffe2ckpt.errors import InvalidLocationError
from caffe2ckpt.naming import MAX_EPOCH, check_node_name, get_ckpt_filename

__all__ = [
    "COMMITS_DIR",
    "HINTS_DIR",
    "LEGACY_CLAIMS_DIR",
    "LEGACY_STAGING_DIR",
    "RETIRED_DIR",
    "MAX_GENERATION",
    "ROOT_METADATA",
    "RUNS_DIR",
    "GroupName",
    "committed_name",
    "group_name",
    "hint_name",
    "legacy_claim_number",
    "new_save_id",
    "parse_committed_name",
    "parse_group_name",
    "parse_run_name",
    "run_name",
    "save_generation",
]

COMMITS_DIR = "_commits"
RUNS_DIR = "_runs"
HINTS_DIR = "_hints"
RETIRED_DIR = "_retired"  # removals in progress: the groups a removed save's record named
ROOT_METADATA = "_metadata.json"
LEGACY_CLAIMS_DIR = "_claims"
LEGACY_STAGING_DIR = "_staging"
MAX_GENERATION = 10**18 - 1  # a generation is at most 18 digits in a save id
_SAVE_ID = re.compile(r"g([0-9]{1,18})-[0-9a-f]{8,64}")
_RUN = re.compile(r"([0-9]{12,18})\.json")
_COMMITTED = re.compile(r"([0-9]{12,18})\.committed\.json")
_last_stamp = 0
_stamp_lock = threading.Lock()


def _creation_stamp() -> int:
    """Nanoseconds since the epoch, strictly increasing within this process."""
    global _last_stamp
    with _stamp_lock:
        _last_stamp = max(time.time_ns(), _last_stamp + 1)
        return _last_stamp


def new_save_id(generation: int) -> str:
    """A fresh save id for a save of run ``generation`` (0 for a save of no run): the creation
    time (16 hex digits, so ids of one run sort by it), then 8 random ones."""
    if not 0 <= generation <= MAX_GENERATION:
        raise ValueError(f"generation {generation} does not fit a save id")
    return f"g{generation}-{_creation_stamp():016x}{uuid.uuid4().hex[:8]}"


def save_generation(save_id: str) -> int:
    """The generation a save id names (0 for ids that name none, e.g. format-1 records)."""
    match = _SAVE_ID.fullmatch(save_id)
    return int(match.group(1)) if match else 0


def is_save_id(text: str) -> bool:
    return _SAVE_ID.fullmatch(text) is not None


class GroupName(NamedTuple):
    """What a group's directory name says: its node and epoch, and for a later save of the
    epoch, the save's id (None for the first save, at ``<node>.<epoch>``)."""

    node: str
    epoch: int
    save_id: str | None


def group_name(node: str, epoch: int, save_id: str | None = None) -> str:
    """``<node>.<epoch>`` (the first save of an epoch), or ``<node>.<epoch>.<save id>``."""
    name = get_ckpt_filename(node, epoch)
    return name if save_id is None else f"{name}.{save_id}"


def parse_group_name(name: str) -> GroupName | None:
    """The node, epoch and save id a group directory's name gives, or None for other names."""
    rest, dot, last = name.rpartition(".")
    save_id = None
    if dot and is_save_id(last):
        save_id = last
        rest, dot, last = rest.rpartition(".")
    if not (dot and last.isascii() and last.isdigit() and len(last) <= 12):
        return None
    try:
        check_node_name(rest)
    except InvalidLocationError:
        return None
    epoch = int(last)
    return GroupName(rest, epoch, save_id) if epoch <= MAX_EPOCH else None


def run_name(generation: int) -> str:
    """The run log entry of run ``generation``: ``<generation:012d>.json``."""
    return f"{generation:012d}.json"


def parse_run_name(name: str) -> int | None:
    """The generation a run log entry's name gives, or None for anything else."""
    match = _RUN.fullmatch(name)
    return int(match.group(1)) if match else None


def committed_name(generation: int) -> str:
    """The run log's mark that run ``generation`` has committed a save:
    ``<generation:012d>.committed.json``."""
    return f"{generation:012d}.committed.json"


def parse_committed_name(name: str) -> int | None:
    """The generation a committed mark's name gives, or None for anything else."""
    match = _COMMITTED.fullmatch(name)
    return int(match.group(1)) if match else None


def legacy_claim_number(name: str) -> int | None:
    """The number of a model-2 claim file ``claim-<n>.json`` (at most 18 digits), else None."""
    digits = name.removeprefix("claim-").removesuffix(".json")
    # isascii: str.isdigit() also accepts digits such as "²" that int() refuses
    if (name.startswith("claim-") and name.endswith(".json") and digits.isascii()
            and digits.isdigit() and len(digits.lstrip("0")) <= 18):
        return int(digits)
    return None


def hint_name(nodes: frozenset[str] | set[str] | list[str]) -> str:
    """The hint file of the job family ``nodes`` (the nodes saved together)."""
    digest = hashlib.sha256("\0".join(sorted(nodes)).encode("utf-8")).hexdigest()[:24]
    return f"{digest}.json"
