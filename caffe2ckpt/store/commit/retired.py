"""Retire notes: ``_retired/<record name>``, written just before a commit record is deleted to
remove its save, and deleted once the removal is done.

A removal deletes a save's records first and its groups after (so no record ever names a
missing group). A kill between the two would leave groups that no record names; ``gc`` removes
such leftovers, but never those of a run that may still be saving. The note says which groups
the record named (its closure), so ``gc`` can finish the removal whatever the run: a removed
save's groups are never written again, and any of them that a readable record still needs is
kept.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

from caffe2ckpt.errors import CheckpointError
from caffe2ckpt.fs import strictjson
from caffe2ckpt.fs.location import Location
from caffe2ckpt.store.format.paths import RETIRED_DIR, parse_group_name, save_generation
from caffe2ckpt.store.format.records import CommitRecord, RecordRef, record_path

__all__ = ["forget", "note_path", "retire", "standing", "unfinished"]


def _path(location: Location, ref: RecordRef) -> str:
    return location.path(RETIRED_DIR, ref.filename)


def retire(location: Location, record: CommitRecord) -> None:
    """Note the groups ``record`` names, before it is deleted."""
    data = json.dumps({"epoch": record.epoch, "node": record.node, "save_id": record.save_id,
                       "groups": record.closure}, sort_keys=True).encode()
    location.replace_file(_path(location, record.ref), data)


def forget(location: Location, ref: RecordRef) -> None:
    """The removal of the record ``ref`` is done (missing is fine)."""
    location.remove(_path(location, ref))


def note_path(ref: RecordRef) -> str:
    """The note of the record ``ref``, relative to the prefix."""
    return f"{RETIRED_DIR}/{ref.filename}"


def _notes(location: Location) -> Iterator[tuple[RecordRef, bool]]:
    """Every retire note, by its record, and whether that record still exists."""
    for name in sorted(location.list_names(location.path(RETIRED_DIR))):
        ref = RecordRef.parse(name)
        if ref is not None:
            yield ref, location.exists(record_path(location, ref))


def standing(location: Location) -> list[RecordRef]:
    """The notes whose record is still there: a removal in progress (between its note and
    its record delete: an instant), or one whose record delete failed and whose note could
    not be taken back either. Such a note names only groups the save still needs (harmless),
    but no removal finishes it."""
    return [ref for ref, stands in _notes(location) if stands]


def unfinished(location: Location) -> list[tuple[RecordRef, dict[str, str]]]:
    """Removals cut short: each note whose record is gone, with the groups it names (path ->
    save id; none if the note is unreadable: then only the note is left to delete). A note whose
    record is still there belongs to a removal in progress, or one that stopped before deleting
    anything: it is not listed (:func:`standing` lists those)."""
    out = []
    for ref, stands in _notes(location):
        if stands:
            continue
        try:
            note = strictjson.loads(location.read_bytes(_path(location, ref),
                                                        limit=strictjson.MAX_BYTES))
            groups = {g: i for g, i in note["groups"].items() if _named(ref, g, i)}
        except (CheckpointError, ValueError, KeyError, TypeError, AttributeError):
            groups = {}
        out.append((ref, groups))
    return out


def _named(ref: RecordRef, group: object, owner: object) -> bool:
    """Whether a note of the record ``ref`` may name ``group`` (of save ``owner``): its own
    group, or an older group of its node written by its run (what a record's closure holds);
    anything else in a note is ignored."""
    parsed = parse_group_name(group) if isinstance(group, str) else None
    if parsed is None or not isinstance(owner, str) or parsed.node != ref.node:
        return False
    own = parsed.epoch == ref.epoch and owner == ref.save_id
    return (parsed.save_id in (None, owner) and (own or parsed.epoch < ref.epoch)
            and save_generation(owner) == ref.generation > 0)
