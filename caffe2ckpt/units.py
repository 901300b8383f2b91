"""Sizes and epoch lists for people: shared by the command line, the library's messages and the
Prefect artifacts."""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["epochs_summary", "epochs_text", "human_bytes"]


def human_bytes(n: int | None) -> str:
    if n is None:
        return "?"
    if n < 1024:
        return f"{n} B"
    value = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB", "PiB"):
        value /= 1024
        if value < 1024 or unit == "PiB":
            return f"{value:.1f} {unit}"
    raise AssertionError("unreachable")


def _runs(epochs: Iterable[int]) -> list[tuple[int, int]]:
    """``[0, 1, 2, 5, 7, 8]`` -> ``[(0, 2), (5, 5), (7, 8)]``."""
    runs: list[list[int]] = []
    for epoch in sorted(set(epochs)):
        if runs and epoch == runs[-1][1] + 1:
            runs[-1][1] = epoch
        else:
            runs.append([epoch, epoch])
    return [(a, b) for a, b in runs]


def _text(runs: list[tuple[int, int]]) -> str:
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs) or "none"


def epochs_text(epochs: Iterable[int]) -> str:
    """``[0, 1, 2, 5, 7, 8]`` -> ``"0-2, 5, 7-8"``."""
    return _text(_runs(epochs))


def epochs_summary(epochs: Iterable[int], what: str = "committed", most: int = 5) -> str:
    """``"committed epochs: 0-5"``; past ``2 * most`` runs of consecutive epochs, their count,
    range and the newest ``most`` runs: ``"31 committed epochs (0 to 61), the newest: 52, 54,
    56, 58, 61"``."""
    epochs = sorted(set(epochs))
    runs = _runs(epochs)
    if len(runs) <= 2 * most:
        return f"{what} epochs: {_text(runs)}"
    return (f"{len(epochs)} {what} epochs ({epochs[0]} to {epochs[-1]}), the newest: "
            f"{_text(runs[-most:])}")
