"""When to save and what to keep: :class:`StepManagerOptions` and the two decisions it makes.

Both decisions are pure functions of the options and what is committed, so the runner, the
Orbax-style manager and the CLI's ``gc`` make exactly the same choices.

Save policy (a union: an epoch is saved when any rule says so):
    ``save_interval_steps`` (every N-th epoch), ``save_on_steps`` (listed epochs),
    ``save_interval_seconds`` (at least that long since the last save). Epoch 0, the final
    epoch and an epoch interrupted by preemption are always saved. No rule: every epoch.

Retention (a union: an epoch is kept when any rule keeps it):
    ``max_to_keep`` (the newest N), ``keep_period`` (every K-th epoch), ``keep_best`` (the
    best N by ``best_fn`` over the epoch's metrics, ``best_mode`` min or max; NaN or a missing
    metric counts as worst). As in Orbax, ``max_to_keep`` with ``best_fn`` and no ``keep_best``
    means the best N instead (:attr:`StepManagerOptions.best_to_keep`).
    ``keep_checkpoints_without_metrics`` keeps epochs without metrics when best-N is on. The
    rules rank the current lineage only: an epoch a later run superseded (it resumed from an
    earlier epoch) is never kept by a rule. The newest epoch of the lineage and the protected
    epochs (e.g. the one a run resumed from) are always kept. No rule: everything is kept.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from caffe2ckpt.errors import JobDefinitionError

__all__ = ["StepManagerOptions", "retained_epochs", "should_save"]

Metrics = Mapping[str, float]


@dataclass(frozen=True, kw_only=True)
class StepManagerOptions:
    """Save policy and retention, with Orbax's option names where Orbax has them.

    ``max_to_keep`` is the newest N, ``keep_best`` the best N by ``best_fn``, and retention
    keeps the union. As in Orbax, ``max_to_keep`` alone with ``best_fn`` (no ``keep_best``)
    keeps the best N by ``best_fn`` instead of the newest N; set ``keep_best`` as well to keep
    the newest ``max_to_keep`` and the best ``keep_best``. Unlike Orbax, the newest step is
    always kept too (a job resumes from it).
    """

    save_interval_steps: int | None = None
    save_on_steps: Sequence[int] = ()
    save_interval_seconds: float | None = None
    max_to_keep: int | None = None
    keep_period: int | None = None
    keep_best: int | None = None
    best_fn: Callable[[Metrics], float] | str | None = None
    best_mode: Literal["min", "max"] = "min"
    keep_checkpoints_without_metrics: bool = True
    enable_async_checkpointing: bool = False

    def __post_init__(self) -> None:
        for name in ("save_interval_steps", "max_to_keep", "keep_period", "keep_best"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < 1):
                raise JobDefinitionError(f"StepManagerOptions.{name} must be an int >= 1 or "
                                         f"None, got {value!r}")
        if self.save_interval_seconds is not None and not self.save_interval_seconds >= 0:
            raise JobDefinitionError("StepManagerOptions.save_interval_seconds must be >= 0, "
                                     f"got {self.save_interval_seconds!r}")
        bad = [s for s in self.save_on_steps if isinstance(s, bool) or not isinstance(s, int)]
        if bad:
            raise JobDefinitionError(f"StepManagerOptions.save_on_steps must be ints, got {bad}")
        if self.best_mode not in ("min", "max"):
            raise JobDefinitionError(f"StepManagerOptions.best_mode must be 'min' or 'max', "
                                     f"got {self.best_mode!r}")
        if self.keep_best is not None and self.best_fn is None:
            raise JobDefinitionError("StepManagerOptions.keep_best needs best_fn (a metric name "
                                     "or a function of the metrics dict)")

    @property
    def has_save_rule(self) -> bool:
        return bool(self.save_interval_steps or self.save_on_steps
                    or self.save_interval_seconds is not None)

    @property
    def newest_to_keep(self) -> int | None:
        """How many of the newest epochs retention keeps (``max_to_keep`` unless it is best-N)."""
        return None if self._max_to_keep_is_best else self.max_to_keep

    @property
    def best_to_keep(self) -> int | None:
        """How many of the best epochs retention keeps: ``keep_best``, or as in Orbax
        ``max_to_keep`` when ``best_fn`` is set without ``keep_best``."""
        return self.max_to_keep if self._max_to_keep_is_best else self.keep_best

    @property
    def _max_to_keep_is_best(self) -> bool:
        return self.best_fn is not None and self.keep_best is None

    @property
    def has_retention(self) -> bool:
        return any(v is not None for v in (self.max_to_keep, self.keep_period, self.keep_best))

    def score(self, metrics: Metrics | None) -> float | None:
        """The epoch's score under ``best_fn`` (None: no metrics, or not a number/NaN)."""
        if self.best_fn is None or not metrics:
            return None
        try:
            value = (metrics[self.best_fn] if isinstance(self.best_fn, str)
                     else self.best_fn(metrics))
            value = float(value)
        except (KeyError, TypeError, ValueError):
            return None
        return None if math.isnan(value) else value


def should_save(options: StepManagerOptions | None, epoch: int, *, final: bool = False,
                last_save_time: float | None = None, now: float | None = None) -> bool:
    """Whether ``epoch`` is saved under ``options`` (``final``: the job stops after it)."""
    if options is None or not options.has_save_rule or epoch == 0 or final:
        return True
    if options.save_interval_steps and epoch % options.save_interval_steps == 0:
        return True
    if epoch in options.save_on_steps:
        return True
    if options.save_interval_seconds is not None:
        if last_save_time is None or now is None:
            return True
        return now - last_save_time >= options.save_interval_seconds
    return False


def retained_epochs(options: StepManagerOptions | None, metrics: Mapping[int, Metrics | None],
                    protect: Collection[int] = (), *,
                    superseded: Collection[int] = ()) -> set[int]:
    """Which of the committed epochs (the keys of ``metrics``) retention keeps.

    The rules rank only the current lineage; ``superseded`` epochs (committed by a run that a
    later resume from an earlier epoch replaced, see :mod:`caffe2ckpt.history.lineage`) are never kept
    by a rule, and never count as the newest. The newest lineage epoch and every epoch in
    ``protect`` are always kept.
    """
    if options is None or not options.has_retention:
        return set(metrics)
    keep = set(protect) & set(metrics)
    epochs = sorted(set(metrics) - set(superseded))
    if epochs:
        keep.add(epochs[-1])
    if options.newest_to_keep:
        keep.update(epochs[-options.newest_to_keep:])
    if options.keep_period:
        keep.update(e for e in epochs if e % options.keep_period == 0)
    if options.best_to_keep:
        scored = [(options.score(metrics[e]), e) for e in epochs]
        if options.keep_checkpoints_without_metrics:
            keep.update(e for s, e in scored if s is None and not metrics[e])
        sign = 1.0 if options.best_mode == "min" else -1.0
        ranked = sorted(scored, key=lambda se: (se[0] is None,
                                                sign * se[0] if se[0] is not None else 0.0,
                                                -se[1]))
        keep.update(e for _, e in ranked[: options.best_to_keep])
    return keep
