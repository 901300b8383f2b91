"""Line charts of per-epoch values as SVG images for markdown artifacts.

Prefect has no chart artifact, and its UI strips inline ``<svg>`` from markdown (measured with
Prefect 3.9's UI in headless Chromium: the text stays, the lines go). An image whose source is
a ``data:image/svg+xml`` URL is shown as drawn, so :func:`chart_markdown` returns a markdown
image of that form. The SVG has its own white background and dark ink, readable in the UI's
light and dark themes; as an image it cannot run scripts, and every text in it is escaped.

A chart stacks one panel per series (a metric, the save seconds, the save MB/s): the values
over the epochs as a line (with dots when there are few) and the last value on the right.
Every panel shares one epoch axis: the same epoch is at the same x in each panel, from the
lowest to the highest epoch of any series or marker; an epoch a series lacks has no point.
Both axes have a few ticks at round values (1, 2 or 5 times a power of ten; whole epochs).
A series whose values are all positive and span more than ``LOG_RATIO`` is drawn on a log
scale (a loss falling from 1 to 0.001), its ticks powers of ten. :class:`Marker` lines cross
every panel at an epoch (a run resumed there, an attempt failed there), labelled above the
first. A long series is thinned to about a point per pixel; the scale is that of every point.
"""

from __future__ import annotations

import base64
import math
from collections.abc import Sequence
from typing import NamedTuple
from xml.sax.saxutils import escape

from caffe2ckpt.prefect.table import plain_text

__all__ = ["CHART_ID", "Marker", "Series", "chart_markdown", "chart_svg", "nice_ticks"]

CHART_ID = "caffe2ckpt-chart"  #: the ``id`` of the chart's ``<svg>`` and the image's alt text start
LOG_RATIO = 100.0
MAX_POINTS = 600  # about one per pixel: longer series are thinned (first and last kept)
WIDTH, PANEL, TOP, LEFT, RIGHT, BOTTOM = 760, 150, 26, 70, 90, 22
PLOT = WIDTH - LEFT - RIGHT  # the width of every panel's plot area
MARKS = 34  # the strip above the panels that holds the markers' labels (two rows)
Y_TICKS, X_TICKS = 5, 8  # at most this many ticks on each axis
_COLORS = ["#1f5fbf", "#8e44ad", "#b9770e", "#117a65", "#6c3483", "#2e4053"]
_MARK_COLORS = {"resumed": "#1e8449", "failed": "#c0392b"}
_GRID = "#ececec"
_CHAR = 6.6  # about the width of one character of the 12 px labels


class Series(NamedTuple):
    """One panel: ``title`` (e.g. ``loss``), ``points`` as (epoch, value) in epoch order."""

    title: str
    points: Sequence[tuple[int, float]]


class Marker(NamedTuple):
    """A dashed line through every panel at ``epoch``: ``kind`` is ``"resumed"`` (a run or
    attempt started from this committed epoch) or ``"failed"`` (an attempt failed in it);
    ``label`` is its short text (plain text, escaped here)."""

    epoch: int
    kind: str
    label: str


class _Epochs(NamedTuple):
    """The shared epoch axis: ``first`` at the plot's left edge, ``last`` at its right."""

    first: int
    last: int

    def x(self, epoch: float) -> float:
        span = self.last - self.first
        return LEFT + PLOT * ((epoch - self.first) / span if span else 0.5)


def nice_ticks(low: float, high: float, most: int, least_step: float = 0.0) -> list[float]:
    """Round values from ``low`` to ``high`` (both included when round): the multiples of
    the smallest step of 1, 2 or 5 times a power of ten, and at least ``least_step``, that
    gives at most ``most`` of them. ``[low]`` when the range is empty."""
    if not high > low:
        return [low]
    power = 10.0 ** math.floor(math.log10((high - low) / most))
    for step in (m * power * 10 ** k for k in range(4) for m in (1, 2, 5)):
        first, last = math.ceil(low / step - 1e-9), math.floor(high / step + 1e-9)
        if step >= least_step and last - first + 1 <= most:
            return [float(format(k * step, ".12g")) for k in range(first, last + 1)]
    return [low, high]


def _finite(points: Sequence[tuple[int, float]]) -> list[tuple[int, float]]:
    return [(e, float(v)) for e, v in points if v is not None and math.isfinite(float(v))]


def _thin(points: list[tuple[int, float]]) -> list[tuple[int, float]]:
    if len(points) <= MAX_POINTS:
        return points
    step = len(points) / (MAX_POINTS - 1)
    return [points[int(i * step)] for i in range(MAX_POINTS - 1)] + [points[-1]]


def _fmt(value: float) -> str:
    return format(value, ".4g")


class _Scale(NamedTuple):
    """A panel's value axis: ``low`` and ``high`` (log10 of them on a log scale) at the
    bottom and top of the plot that starts ``top`` pixels down."""

    low: float
    high: float
    log: bool
    top: float

    def y(self, value: float) -> float:
        v, span = math.log10(value) if self.log else value, self.high - self.low
        height = PANEL - TOP - BOTTOM
        return self.top + height * (1 - ((v - self.low) / span if span else 0.5))

    def ticks(self) -> list[float]:
        if self.log:
            return [10.0 ** d for d in nice_ticks(self.low, self.high, Y_TICKS, least_step=1)]
        return nice_ticks(self.low, self.high, Y_TICKS)


def _scale(values: list[float], top: float) -> _Scale:
    log = min(values) > 0 and max(values) / min(values) > LOG_RATIO
    low, high = min(values), max(values)
    return _Scale(math.log10(low), math.log10(high), True, top) if log else \
        _Scale(low, high, False, top)


def _x_ticks(epochs: _Epochs, top: float) -> list[str]:
    """The shared epoch ticks of a panel: grid lines in its plot, labels below it."""
    bottom = top + PANEL - TOP - BOTTOM
    out = [f'<text x="{LEFT - 14}" y="{bottom + 16}" text-anchor="end" fill="#666">epoch</text>']
    for tick in nice_ticks(epochs.first, epochs.last, X_TICKS, least_step=1):
        x = epochs.x(tick)
        out += [f'<line x1="{x:.1f}" y1="{top}" x2="{x:.1f}" y2="{bottom}" stroke="{_GRID}"/>',
                f'<text class="xtick" x="{x:.1f}" y="{bottom + 16}" text-anchor="middle">'
                f"{int(tick)}</text>"]
    return out


def _y_ticks(scale: _Scale) -> list[str]:
    """A panel's value ticks: grid lines across its plot, labels on its left."""
    out = []
    for tick in scale.ticks():
        y = scale.y(tick)
        out += [f'<line x1="{LEFT}" y1="{y:.1f}" x2="{WIDTH - RIGHT}" y2="{y:.1f}" '
                f'stroke="{_GRID}"/>',
                f'<text class="ytick" x="{LEFT - 6}" y="{y + 4:.1f}" text-anchor="end">'
                f"{escape(_fmt(tick))}</text>"]
    return out


def _line(points: list[tuple[int, float]], epochs: _Epochs, scale: _Scale,
          color: str) -> list[str]:
    """The values as a line (dots when few), the last value on the right."""
    line = " ".join(f"{epochs.x(e):.1f},{scale.y(v):.1f}" for e, v in points)
    out = [f'<polyline fill="none" stroke="{color}" stroke-width="2" points="{line}"/>']
    if len(points) <= 60:
        out += [f'<circle cx="{epochs.x(e):.1f}" cy="{scale.y(v):.1f}" r="2.5" fill="{color}"/>'
                for e, v in points]
    return out + [f'<text x="{WIDTH - RIGHT + 6}" y="{scale.y(points[-1][1]) + 4:.1f}" '
                  f'fill="{color}">{escape(_fmt(points[-1][1]))}</text>']


def _panel(series: Series, top: int, color: str, epochs: _Epochs) -> list[str]:
    """The SVG elements of one panel whose frame starts ``top`` pixels down."""
    every = _finite(series.points)
    height = PANEL - TOP - BOTTOM
    scale = _scale([v for _, v in every], top + TOP) if every else None
    log = " (log scale)" if scale is not None and scale.log else ""
    out = [f'<text x="{LEFT}" y="{top + 17}" font-weight="bold">'
           f"{escape(plain_text(series.title, 60))}{log}</text>"]
    out += _x_ticks(epochs, top + TOP)
    if scale is None:
        out.append(f'<text x="{LEFT + 8}" y="{top + TOP + height / 2}" fill="#666">'
                   "no finite values yet</text>")
    else:
        out += _y_ticks(scale) + _line(_thin(every), epochs, scale, color)
    return out + [f'<rect x="{LEFT}" y="{top + TOP}" width="{PLOT}" height="{height}" '
                  'fill="none" stroke="#c8c8c8"/>']


def _label_rows(markers: Sequence[Marker], epochs: _Epochs) -> list[tuple[float, str, int]]:
    """Where each marker's label goes: (x it starts at, anchor, row 0 or 1). A resume's label
    ends at its line, a failure's starts there (one epoch apart they do not meet); a label
    that would leave the image flips sides, one that would overlap another takes row 1."""
    taken: list[list[tuple[float, float]]] = [[], []]
    placed = []
    for marker in markers:
        x, width = epochs.x(marker.epoch), len(plain_text(marker.label, 40)) * _CHAR + 4
        left = marker.kind == "resumed" and x - width >= 0 or x + width > WIDTH
        span = (x - width, x) if left else (x, x + width)
        row = next((i for i, spans in enumerate(taken)
                    if all(span[1] <= a or span[0] >= b for a, b in spans)), 1)
        taken[row].append(span)
        placed.append((x - 3 if left else x + 3, "end" if left else "start", row))
    return placed


def _markers(markers: Sequence[Marker], epochs: _Epochs, panels: int) -> list[str]:
    """Each marker: its label in the strip above the panels, its line across every plot."""
    out = []
    for marker, (tx, anchor, row) in zip(markers, _label_rows(markers, epochs)):
        color, x = _MARK_COLORS.get(marker.kind, "#555555"), epochs.x(marker.epoch)
        out.append(f'<text class="marker-label {escape(marker.kind)}" x="{tx:.1f}" '
                   f'y="{13 + 15 * row}" text-anchor="{anchor}" fill="{color}">'
                   f"{escape(plain_text(marker.label, 40))}</text>")
        out += [f'<line class="marker {escape(marker.kind)}" data-epoch="{marker.epoch}" '
                f'x1="{x:.1f}" y1="{MARKS + i * PANEL + TOP}" x2="{x:.1f}" '
                f'y2="{MARKS + (i + 1) * PANEL - BOTTOM}" stroke="{color}" stroke-width="1.5" '
                'stroke-dasharray="5 3"/>' for i in range(panels)]
    return out


def _epoch_axis(series: Sequence[Series], markers: Sequence[Marker]) -> _Epochs:
    epochs = [e for one in series for e, _ in _finite(one.points)] + [m.epoch for m in markers]
    return _Epochs(min(epochs), max(epochs)) if epochs else _Epochs(0, 0)


def chart_svg(series: Sequence[Series], markers: Sequence[Marker] = ()) -> str:
    """An SVG document with one panel per series, stacked on one epoch axis, and
    ``markers`` across them."""
    markers = sorted(markers)
    strip = MARKS if markers else 0
    height = strip + PANEL * len(series)
    epochs = _epoch_axis(series, markers)
    body = [f'<rect width="{WIDTH}" height="{height}" fill="#ffffff"/>']
    for i, one in enumerate(series):
        body += _panel(one, strip + i * PANEL, _COLORS[i % len(_COLORS)], epochs)
    if markers:
        body += _markers(markers, epochs, len(series))
    return (f'<svg xmlns="http://www.w3.org/2000/svg" id="{CHART_ID}" width="{WIDTH}" '
            f'height="{height}" viewBox="0 0 {WIDTH} {height}" font-family="sans-serif" '
            f'font-size="12" fill="#222222">' + "".join(body) + "</svg>")


def chart_markdown(series: Sequence[Series], caption: str, markers: Sequence[Marker] = ()) -> str:
    """A markdown image of :func:`chart_svg` as a data URL; ``caption`` (plain text, no
    markdown) is its alt text after ``CHART_ID``. Empty for no series."""
    if not series:
        return ""
    data = base64.b64encode(chart_svg(series, markers).encode()).decode("ascii")
    alt = "".join(c for c in caption if c not in "[]\\\n")
    return f"![{CHART_ID}: {alt}](data:image/svg+xml;base64,{data})"
