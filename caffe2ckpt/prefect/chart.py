"""Line charts of per-epoch values as SVG images for markdown artifacts.

Prefect has no chart artifact, and its UI strips inline ``<svg>`` from markdown (measured with
Prefect 3.9's UI in headless Chromium: the text stays, the lines go). An image whose source is
a ``data:image/svg+xml`` URL is shown as drawn, so :func:`chart_markdown` returns a markdown
image of that form. The SVG has its own white background and dark ink, readable in the UI's
light and dark themes; as an image it cannot run scripts, and every text in it is escaped.

A chart stacks one panel per series (a metric, the save seconds, the save MB/s): the values
over the epochs as a line (with dots when there are few), the lowest and highest value on the
left, the first and last epoch below, the last value on the right. A series whose values are
all positive and span more than ``LOG_RATIO`` is drawn on a log scale (a loss falling from 1 to
0.001). A long series is thinned to about a point per pixel; the lowest and highest values and
the scale are those of every point.
"""

from __future__ import annotations

import base64
import math
from collections.abc import Sequence
from typing import NamedTuple
from xml.sax.saxutils import escape

from caffe2ckpt.prefect.table import plain_text

__all__ = ["CHART_ID", "Series", "chart_markdown", "chart_svg"]

CHART_ID = "caffe2ckpt-chart"  #: the ``id`` of the chart's ``<svg>`` and the image's alt text start
LOG_RATIO = 100.0
MAX_POINTS = 600  # about one per pixel: longer series are thinned (first and last kept)
WIDTH, PANEL, TOP, LEFT, RIGHT, BOTTOM = 760, 150, 26, 70, 90, 22
_COLORS = ["#1f5fbf", "#c0392b", "#1e8449", "#8e44ad", "#b9770e", "#117a65"]


class Series(NamedTuple):
    """One panel: ``title`` (e.g. ``loss``), ``points`` as (epoch, value) in epoch order."""

    title: str
    points: Sequence[tuple[int, float]]


def _finite(points: Sequence[tuple[int, float]]) -> list[tuple[int, float]]:
    return [(e, float(v)) for e, v in points if v is not None and math.isfinite(float(v))]


def _thin(points: list[tuple[int, float]]) -> list[tuple[int, float]]:
    if len(points) <= MAX_POINTS:
        return points
    step = len(points) / (MAX_POINTS - 1)
    return [points[int(i * step)] for i in range(MAX_POINTS - 1)] + [points[-1]]


def _fmt(value: float) -> str:
    return format(value, ".4g")


def _panel(series: Series, top: int, color: str) -> list[str]:
    """The SVG elements of one panel whose frame starts ``top`` pixels down."""
    every = _finite(series.points)
    points = _thin(every)
    height = PANEL - TOP - BOTTOM
    values = [v for _, v in every]
    log = bool(values) and min(values) > 0 and max(values) / min(values) > LOG_RATIO
    title = escape(plain_text(series.title, 60)) + (" (log scale)" if log else "")
    out = [f'<text x="{LEFT}" y="{top + 17}" font-weight="bold">{title}</text>',
           f'<rect x="{LEFT}" y="{top + TOP}" width="{WIDTH - LEFT - RIGHT}" height="{height}" '
           'fill="none" stroke="#c8c8c8"/>']
    if not points:
        return out + [f'<text x="{LEFT + 8}" y="{top + TOP + height / 2}" fill="#666">'
                      "no finite values yet</text>"]
    scale = math.log10 if log else (lambda v: v)
    low, high = scale(min(values)), scale(max(values))
    first, last = points[0][0], points[-1][0]

    def x(epoch: int) -> float:
        span = last - first
        return LEFT + (WIDTH - LEFT - RIGHT) * ((epoch - first) / span if span else 0.5)

    def y(value: float) -> float:
        span = high - low
        return top + TOP + height * (1 - ((scale(value) - low) / span if span else 0.5))

    line = " ".join(f"{x(e):.1f},{y(v):.1f}" for e, v in points)
    out.append(f'<polyline fill="none" stroke="{color}" stroke-width="2" points="{line}"/>')
    if len(points) <= 60:
        out += [f'<circle cx="{x(e):.1f}" cy="{y(v):.1f}" r="2.5" fill="{color}"/>'
                for e, v in points]
    bottom = top + TOP + height
    out += [
        f'<text x="{LEFT - 6}" y="{top + TOP + 4}" text-anchor="end">{_fmt(max(values))}</text>',
        f'<text x="{LEFT - 6}" y="{bottom}" text-anchor="end">{_fmt(min(values))}</text>',
        f'<text x="{LEFT}" y="{bottom + 16}">epoch {first}</text>',
        f'<text x="{WIDTH - RIGHT}" y="{bottom + 16}" text-anchor="end">epoch {last}</text>',
        f'<text x="{WIDTH - RIGHT + 6}" y="{y(points[-1][1]) + 4:.1f}" fill="{color}">'
        f"{_fmt(points[-1][1])}</text>",
    ]
    return out


def chart_svg(series: Sequence[Series]) -> str:
    """An SVG document with one panel per series, stacked."""
    height = PANEL * len(series)
    body = [f'<rect width="{WIDTH}" height="{height}" fill="#ffffff"/>']
    for i, one in enumerate(series):
        body += _panel(one, i * PANEL, _COLORS[i % len(_COLORS)])
    return (f'<svg xmlns="http://www.w3.org/2000/svg" id="{CHART_ID}" width="{WIDTH}" '
            f'height="{height}" viewBox="0 0 {WIDTH} {height}" font-family="sans-serif" '
            f'font-size="12" fill="#222222">' + "".join(body) + "</svg>")


def chart_markdown(series: Sequence[Series], caption: str) -> str:
    """A markdown image of :func:`chart_svg` as a data URL; ``caption`` (plain text, no
    markdown) is its alt text after ``CHART_ID``. Empty for no series."""
    if not series:
        return ""
    data = base64.b64encode(chart_svg(series).encode()).decode("ascii")
    alt = "".join(c for c in caption if c not in "[]\\\n")
    return f"![{CHART_ID}: {alt}](data:image/svg+xml;base64,{data})"
