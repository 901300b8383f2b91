"""Retention over one family's history: which saves to keep (and why) and which to delete.

The rules are :func:`caffe2ckpt.policy.keep_reasons`; this applies them to a
:class:`~caffe2ckpt.history.scan.Family`, so the runner, the step manager and ``caffe2ckpt gc``
decide alike, save by save: the lineage is ranked, superseded saves are deleted once any rule
is given (they are never a resume point), and every decision names the save ids it covers.
Removing what a plan deletes is :func:`caffe2ckpt.history.cleanup.remove_saves`.

:func:`plan_letting_go` is the plan of an old node set of a resized job
(:mod:`caffe2ckpt.history.nodesets` says which): every save goes, its newest last.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field

from caffe2ckpt.history.lineage import Save
from caffe2ckpt.history.scan import Family
from caffe2ckpt.policy import StepManagerOptions, keep_reasons

__all__ = ["RetentionPlan", "plan_letting_go", "plan_retention"]


@dataclass(frozen=True)
class RetentionPlan:
    """Retention's decision for one family: saves kept with their reasons, saves to delete."""

    keep: list[tuple[Save, list[str]]] = field(default_factory=list)
    delete: list[Save] = field(default_factory=list)


def plan_retention(family: Family, options: StepManagerOptions | None,
                   protect: Collection[int] = ()) -> RetentionPlan:
    """Apply ``options``' retention to ``family``; ``protect`` lists lineage epochs that stay
    whatever the rules say (the one a run resumed from)."""
    reasons = keep_reasons(options, {s.epoch: s.metrics for s in family.lineage}, protect)
    keep = [(s, reasons[s.epoch]) for s in family.lineage if reasons[s.epoch]]
    delete = [s for s in family.lineage if not reasons[s.epoch]]
    if options is not None and options.has_retention:
        delete += family.superseded
    else:
        keep += [(s, ["superseded (no retention rule)"]) for s in family.superseded]
    return RetentionPlan(keep, delete)


def plan_letting_go(family: Family) -> RetentionPlan:
    """Delete every committed save of ``family``, an old node set of a job that has moved to
    other nodes: superseded saves first, then the lineage oldest first, so that until the last
    removal the family keeps a newest save to resume from (an interrupted removal leaves a
    shorter history, never one without its newest epoch), and that newest save is the last one
    to go (``gc`` reads the records again before it removes that one's groups: see
    :func:`caffe2ckpt.history.cleanup.remove_saves`)."""
    superseded = sorted(family.superseded, key=lambda s: (s.epoch, s.generation))
    return RetentionPlan([], [*superseded, *reversed(family.lineage)])
