"""When to save and what to keep: :class:`StepManagerOptions` and the two decisions it makes.

Both decisions are pure functions of the options and what is committed, so the runner, the
Orbax-style manager and the CLI's ``gc`` make exactly the same choices.

Save policy (a union: an epoch is saved when any rule says so):
    ``save_interval_steps`` (every N-th epoch), ``save_on_steps`` (listed epochs),
    ``save_interval_seconds`` (at least that long since the last save). Epoch 0, the final
    epoch and an epoch interrupted by preemption are always saved. No rule: every epoch.

Differential saves (``delta_saves``): a save writes, per blob, only what changed since the
save it builds on (the previous committed save of the same run). A large blob
(``delta_min_bytes`` or more) is cut into ``max_delta_chain + 1`` parts of rows: each save
writes one part whole, in turn (a *span*), if it changed since it was last written whole, and
the rows of the other parts that changed (a *row overlay*); so a changed row is rewritten whole
within ``max_delta_chain + 1`` saves, a save needs at most ``max_delta_chain`` older ones for
the rows that changed, and what did not change is written by no later save (the record names
the group holding it). A small blob is written whole when it changed or is under 1 KiB, else
not at all. Changed rows are found by comparing 8-byte keyed
digests of the rows with those of the last save (no copy of the data is kept); with
``delta_detection="hints"`` the rows named by ``changed_rows=`` of a step save or
``Workspace.mark_changed`` in a job's tasks are written as well, and changed rows the hints
missed are still found, written and reported. A blob whose overlays would reach
``max_delta_fraction`` of its bytes is written whole: that bounds what a restore reads.

Retention (a union: an epoch is kept when any rule keeps it):
    ``max_to_keep`` (the newest N), ``keep_period`` (every K-th epoch), ``keep_best`` (the
    best N by ``best_fn`` over the epoch's metrics, ``best_mode`` min or max; NaN or a missing
    metric counts as worst). As in Orbax, ``max_to_keep`` with ``best_fn`` and no ``keep_best``
    means the best N instead (:attr:`StepManagerOptions.best_to_keep`).
    ``keep_checkpoints_without_metrics`` keeps epochs without metrics when best-N is on. The
    rules rank one family's current lineage (:mod:`caffe2ckpt.history.lineage`); superseded
    saves are never kept once a rule is given. The newest epoch of the lineage and the
    protected epochs (e.g. the one a run resumed from) are always kept. No rule: everything is
    kept.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from caffe2ckpt.errors import JobDefinitionError

__all__ = ["StepManagerOptions", "keep_reasons", "retained_epochs", "should_save"]

Metrics = Mapping[str, float]
MAX_DELTA_CHAIN = 64  # overlays a blob may build on (records refuse longer chains as damage)
MAX_BLOCK_BYTES = 16384  # delta_block_bytes at most (wider blocks: seeded XXH3, no proven bound)


@dataclass(frozen=True, kw_only=True)
class StepManagerOptions:
    """Save policy and retention, with Orbax's option names where Orbax has them.

    ``max_to_keep`` is the newest N, ``keep_best`` the best N by ``best_fn``, and retention
    keeps the union. As in Orbax, ``max_to_keep`` alone with ``best_fn`` (no ``keep_best``)
    keeps the best N by ``best_fn`` instead of the newest N; set ``keep_best`` as well to keep
    the newest ``max_to_keep`` and the best ``keep_best``. Unlike Orbax, the newest step is
    always kept too (a job resumes from it).

    ``enable_async_checkpointing`` (Orbax's name) makes a :class:`~caffe2ckpt.StepCheckpointManager`
    save in the background. It is the same switch as the Caffe2 managers' ``async_save``
    (``MultiNodeCheckpointManager(url, async_save=True)``): given to a
    :class:`~caffe2ckpt.JobRunner`, True turns its manager's background saves on (refused if
    the manager was made with ``async_save=False``).

    Differential saves (docs/deltas.md has the whole story):

    - ``delta_saves``: a save writes only part of each large blob (see the module docstring)
      and builds on the previous committed save of its run; a run's first save is whole.
    - ``max_delta_chain`` (1 to 64, default 9): a large blob is cut into
      ``max_delta_chain + 1`` parts of rows and each save writes one part whole, in turn, if it
      changed, so a save needs at most this many older saves for the rows that changed (and
      the older ones holding what did not). More parts write less per save (a tenth of the
      blob, when it changed, plus its changed rows at the default) and make a restore read
      more overlays.
    - ``max_delta_fraction`` (above 0, at most 1, default 0.5): a blob whose row overlays in
      the saves it needs would pass this share of its bytes is written whole: a restore never
      reads more than ``1 + max_delta_fraction`` times the blob.
    - ``delta_min_bytes`` (default 4 MiB): smaller blobs are written whole when they changed
      (or are under 1 KiB), referenced when they did not.
    - ``delta_detection``: ``"compare"`` (default) finds changed rows by comparing 8-byte keyed
      digests of blocks of rows with the last save's (no copy; 2**-64 per changed block,
      caffe2ckpt.store.delta.rowhash); ``"hints"`` also writes the rows given as ``changed_rows=`` /
      ``Workspace.mark_changed``, and still finds (writes and reports) changed rows the hints
      missed.
    - ``delta_block_bytes`` (8 to 16384, default 64): a block is one row, or as many rows as
      make this many bytes: a changed row is written with its block. The digests take 8 bytes
      per block: 8 / ``delta_block_bytes`` of the large blobs at most (12.5% for rows of 64
      bytes or fewer at the default; 3% for 256-byte rows); 160 keeps them under 5%, at the
      cost of writing a scattered change's neighbours in narrow rows.
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
    delta_saves: bool = False
    max_delta_chain: int = 9
    max_delta_fraction: float = 0.5
    delta_min_bytes: int = 4 << 20
    delta_detection: Literal["compare", "hints"] = "compare"
    delta_block_bytes: int = 64

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
        self._check_delta()

    def _check_delta(self) -> None:
        if type(self.delta_saves) is not bool:
            raise JobDefinitionError("StepManagerOptions.delta_saves must be True or False, got "
                                     f"{self.delta_saves!r}")
        chain = self.max_delta_chain
        if type(chain) is not int or not 1 <= chain <= MAX_DELTA_CHAIN:
            raise JobDefinitionError(f"StepManagerOptions.max_delta_chain must be an int from 1 "
                                     f"to {MAX_DELTA_CHAIN}, got {chain!r}")
        fraction = self.max_delta_fraction
        if (isinstance(fraction, bool) or not isinstance(fraction, (int, float))
                or not 0 < fraction <= 1):
            raise JobDefinitionError("StepManagerOptions.max_delta_fraction must be a number "
                                     f"above 0 and at most 1, got {fraction!r}")
        least = self.delta_min_bytes
        if type(least) is not int or least < 1:
            raise JobDefinitionError("StepManagerOptions.delta_min_bytes must be an int >= 1, "
                                     f"got {least!r}")
        if self.delta_detection not in ("compare", "hints"):
            raise JobDefinitionError("StepManagerOptions.delta_detection must be 'compare' or "
                                     f"'hints', got {self.delta_detection!r}")
        block = self.delta_block_bytes
        if type(block) is not int or not 8 <= block <= MAX_BLOCK_BYTES:
            raise JobDefinitionError("StepManagerOptions.delta_block_bytes must be an int from 8 "
                                     f"to {MAX_BLOCK_BYTES}, got {block!r}")

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


def keep_reasons(options: StepManagerOptions | None, metrics: Mapping[int, Metrics | None],
                 protect: Collection[int] = ()) -> dict[int, list[str]]:
    """Why retention keeps each of the lineage's committed epochs (the keys of ``metrics``),
    rule by rule; an epoch with no reason is deleted. This is retention's one definition: the
    runner, the step manager and ``caffe2ckpt gc`` all apply it and ``gc`` prints it.

    The newest epoch and every epoch in ``protect`` (e.g. the one a run resumed from) are
    always kept. Without a rule, everything is kept.
    """
    reasons: dict[int, list[str]] = {e: [] for e in metrics}
    epochs = sorted(metrics)
    if not epochs:
        return reasons
    if options is None or not options.has_retention:
        for epoch in epochs:
            reasons[epoch].append("no retention rule")
        return reasons
    reasons[epochs[-1]].append("newest")
    for epoch in sorted(set(protect) & set(metrics)):
        reasons[epoch].append("resumed from")
    if options.newest_to_keep:
        for epoch in epochs[-options.newest_to_keep:]:
            reasons[epoch].append(f"last {options.newest_to_keep}")
    if options.keep_period:
        for epoch in epochs:
            if epoch % options.keep_period == 0:
                reasons[epoch].append(f"every {options.keep_period}")
    if options.best_to_keep:
        _keep_best(options, metrics, epochs, reasons)
    return reasons


def _keep_best(options: StepManagerOptions, metrics: Mapping[int, Metrics | None],
               epochs: list[int], reasons: dict[int, list[str]]) -> None:
    """The best-N rule of :func:`keep_reasons` (and keeping epochs without metrics)."""
    scored = [(options.score(metrics[e]), e) for e in epochs]
    if options.keep_checkpoints_without_metrics:
        for score, epoch in scored:
            if score is None and not metrics[epoch]:
                reasons[epoch].append("has no metrics")
    sign = 1.0 if options.best_mode == "min" else -1.0
    ranked = sorted(scored, key=lambda se: (se[0] is None,
                                            sign * se[0] if se[0] is not None else 0.0,
                                            -se[1]))
    label = options.best_fn if isinstance(options.best_fn, str) else "best_fn"
    for _, epoch in ranked[: options.best_to_keep]:
        reasons[epoch].append(f"best {options.best_to_keep} by {label} ({options.best_mode})")


def retained_epochs(options: StepManagerOptions | None, metrics: Mapping[int, Metrics | None],
                    protect: Collection[int] = ()) -> set[int]:
    """Which of the lineage's committed epochs (the keys of ``metrics``) retention keeps: those
    :func:`keep_reasons` gives a reason."""
    return {e for e, why in keep_reasons(options, metrics, protect).items() if why}
