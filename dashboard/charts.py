"""Charts as inline SVG, drawn on the server: no JavaScript, no CDN, readable without colour.

A chart is bars (counts, money), bars stacked by series (counts per model) or a line (rates)
over time buckets. Every mark carries its bucket and value as `data-` attributes and a
`<title>` (the browser's tooltip, and what a screen reader announces), and the page prints
the same numbers as a table.

Every label stays inside the chart's box at any width: the SVG is drawn 640 units wide and
scaled to its container, its text 11 units tall on a desktop and 20 on a phone
(dashboard.css), so the room for labels is measured for the larger size; x labels that
would overlap are left out (the first and last stay).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime

from markupsafe import Markup, escape

WIDTH, HEIGHT = 640, 200
RIGHT, TOP, BOTTOM = 10, 24, 34  # room for the top label's ascent and the x labels
X_LABEL_Y = HEIGHT - 10  # baseline of the x labels; their descent stays above HEIGHT
FONT = 20  # the largest font size of chart text (dashboard.css, on a phone), in SVG units
# Characters' widths in em, a little above DejaVu Sans's (Debian's default sans-serif; its
# digits are 0.636 em, '%' 0.95): what an axis label may hold. Anything else counts 1 em.
_NARROW, _DIGIT = 0.36, 0.64
_EM = {c: _NARROW for c in ".,:; '-"} | {c: _DIGIT for c in "0123456789+"} | {"%": 1.0}
CHAR = _DIGIT * FONT  # a typical character's width, for the gaps between labels
MIN_LEFT = 40
# Stacked series get classes s0 ... s5 (dashboard.css); more would not be told apart.
SERIES_CLASSES = 6


@dataclass(frozen=True, slots=True)
class Point:
    at: datetime  # start of the bucket (UTC)
    value: float


@dataclass(frozen=True, slots=True)
class Layer:
    """One series of a stacked chart: its name and a value per bucket."""

    name: str
    values: Sequence[float]


def axis_ticks(highest: float, *, integer: bool = False, most: int = 5) -> list[float]:
    """The y axis' grid values, from 0 to the first tick at or above `highest`, at most
    `most` steps of 1, 2, 2.5 or 5 x 10^k. A count axis (`integer`) steps by whole numbers
    only: 0, 1, 2, 3 for a highest value of 3, never 0.75 or 12.5 requests."""
    if highest <= 0:
        return [0.0, 1.0]
    raw = highest / most
    exp = math.floor(math.log10(raw))
    step = 10.0 ** (exp + 1)
    for mantissa in (1, 2, 2.5, 5, 10):
        candidate = mantissa * 10.0**exp
        if integer and (candidate < 1 or not float(round(candidate, 9)).is_integer()):
            continue
        if candidate * most >= highest * (1 - 1e-9):
            step = candidate
            break
    if integer:
        step = max(1.0, float(round(step)))
    steps = max(1, math.ceil(highest / step - 1e-9))
    return [round(i * step, 12) for i in range(steps + 1)]


def compact(value: float) -> str:
    """1234 -> 1.2k, 5_600_000 -> 5.6M; small numbers keep up to two decimals."""
    for limit, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= limit:
            return f"{value / limit:.1f}".rstrip("0").rstrip(".") + suffix
    if value == int(value):
        return str(int(value))
    return f"{value:.2f}".rstrip("0").rstrip(".")


def bucket_label(at: datetime, hourly: bool) -> str:
    return at.strftime("%m-%d %H:00") if hourly else at.strftime("%Y-%m-%d")


def text_width(text: str) -> float:
    """An upper estimate of a label's width in SVG units at the largest font size."""
    return FONT * sum(_EM.get(c, 0.68 if c.islower() else 0.82 if c.isupper() else 1.0) for c in text)


class _Frame:
    """The axes of a chart: y labels (with the left margin they need), grid, x labels."""

    def __init__(
        self, starts: Sequence[datetime], top_value: float, *, integer: bool, fmt: Callable[[float], str]
    ) -> None:
        self.ticks = axis_ticks(top_value, integer=integer)
        self.labels = [fmt(t) for t in self.ticks]
        self.left = max(MIN_LEFT, max(text_width(label) for label in self.labels) + 10)
        self.plot_w, self.plot_h = WIDTH - self.left - RIGHT, HEIGHT - TOP - BOTTOM
        self.top = self.ticks[-1]
        self.starts = starts
        self.step = self.plot_w / len(starts) if starts else self.plot_w

    def y_of(self, value: float) -> float:
        return TOP + self.plot_h - self.plot_h * (value / self.top)

    def height_of(self, value: float) -> float:
        return self.plot_h * (value / self.top)

    def x_of(self, i: int) -> float:
        """The middle of bucket i."""
        return self.left + self.step * (i + 0.5)

    def axes(self, hourly: bool) -> list[str]:
        out = []
        for value, label in zip(self.ticks, self.labels, strict=True):
            y = self.y_of(value)
            out.append(
                f'<line class="grid" x1="{self.left:.1f}" x2="{WIDTH - RIGHT}" y1="{y:.1f}" y2="{y:.1f}"/>'
                f'<text class="axis y" x="{self.left - 6:.1f}" y="{y + 4:.1f}" text-anchor="end">'
                f"{escape(label)}</text>"
            )
        n = len(self.starts)
        if not n:
            return out
        # First, middle and last, leaving out any that would overlap one already placed.
        placed: list[tuple[float, float]] = []
        for i in sorted({0, n - 1, n // 2}, key=lambda i: (i not in (0, n - 1), i)):
            label = bucket_label(self.starts[i], hourly)
            width, x = text_width(label), self.x_of(i)
            if n == 1:
                anchor, lo = "middle", x - width / 2
            elif i == 0:
                anchor, lo = "start", x
            elif i == n - 1:
                anchor, lo = "end", x - width
            else:
                anchor, lo = "middle", x - width / 2
            if any(lo < hi + CHAR and lo + width + CHAR > a for a, hi in placed):
                continue
            placed.append((lo, lo + width))
            out.append(
                f'<text class="axis x" x="{x:.1f}" y="{X_LABEL_Y}" text-anchor="{anchor}">'
                f"{escape(label)}</text>"
            )
        return out

    def baseline(self) -> str:
        y0 = TOP + self.plot_h
        return f'<line class="axis-line" x1="{self.left:.1f}" x2="{WIDTH - RIGHT}" y1="{y0}" y2="{y0}"/>'


def _open(chart_id: str, title: str, summary: str, kind: str, n: int) -> list[str]:
    title_id, desc_id = f"{chart_id}-title", f"{chart_id}-desc"
    return [
        f'<svg class="chart" id="{escape(chart_id)}" viewBox="0 0 {WIDTH} {HEIGHT}" role="img" '
        f'aria-labelledby="{title_id} {desc_id}" data-kind="{kind}" data-points="{n}">',
        f'<title id="{title_id}">{escape(title)}</title><desc id="{desc_id}">{escape(summary)}</desc>',
    ]


def _empty(frame: _Frame) -> str:
    return (
        f'<text class="empty" x="{frame.left + frame.plot_w / 2:.1f}" y="{TOP + frame.plot_h / 2:.1f}" '
        'text-anchor="middle">No data in this range</text>'
    )


def render(
    points: Sequence[Point],
    *,
    chart_id: str,
    title: str,
    hourly: bool,
    kind: str = "bar",
    fmt: Callable[[float], str] = compact,
    axis_fmt: Callable[[float], str] | None = None,
    integer: bool = False,
) -> Markup:
    """An SVG chart of `points` (one per bucket, oldest first). `fmt` writes values (tooltips,
    summary), `axis_fmt` the y axis (default `fmt`); `integer`: a count axis."""
    values = [p.value for p in points]
    highest = max(values, default=0.0)
    span = f"{len(points)} {'hours' if hourly else 'days'}, highest {fmt(highest)}"
    summary = f"{span}, total {fmt(sum(values))}" if kind == "bar" else span
    frame = _Frame([p.at for p in points], highest, integer=integer, fmt=axis_fmt or fmt)
    out = _open(chart_id, title, summary, kind, len(points))
    out += frame.axes(hourly)
    if not points:
        out.append(_empty(frame) + "</svg>")
        return Markup("".join(out))
    if kind == "line":
        coords = " ".join(f"{frame.x_of(i):.1f},{frame.y_of(p.value):.1f}" for i, p in enumerate(points))
        out.append(f'<polyline class="line" points="{coords}"/>')
    gap = min(2.0, frame.step * 0.2)
    for i, p in enumerate(points):
        label = f"{bucket_label(p.at, hourly)}: {fmt(p.value)}"
        data = f'class="mark" data-bucket="{p.at.isoformat()}" data-value="{p.value!r}"'
        if kind == "line":
            out.append(
                f'<circle {data} cx="{frame.x_of(i):.1f}" cy="{frame.y_of(p.value):.1f}" r="3">'
                f"<title>{escape(label)}</title></circle>"
            )
        else:
            height = frame.height_of(p.value)
            x = frame.left + frame.step * i + gap / 2
            out.append(
                f'<rect {data} x="{x:.1f}" y="{TOP + frame.plot_h - height:.1f}" '
                f'width="{max(frame.step - gap, 0.5):.1f}" height="{height:.1f}">'
                f"<title>{escape(label)}</title></rect>"
            )
    out.append(frame.baseline() + "</svg>")
    return Markup("".join(out))


def render_stacked(
    starts: Sequence[datetime],
    layers: Sequence[Layer],
    *,
    chart_id: str,
    title: str,
    hourly: bool,
    fmt: Callable[[float], str] = compact,
    integer: bool = True,
) -> Markup:
    """Bars per bucket (`starts`, oldest first), each stacked from `layers` bottom up in their
    order; layer j's marks have class `s{j}` (its colour, dashboard.css) and `data-series`."""
    totals = [sum(layer.values[i] for layer in layers) for i in range(len(starts))]
    highest = max(totals, default=0.0)
    summary = (
        f"{len(starts)} {'hours' if hourly else 'days'}, highest {fmt(highest)}, total {fmt(sum(totals))}, "
        f"stacked by {', '.join(layer.name for layer in layers) or 'nothing'}"
    )
    frame = _Frame(starts, highest, integer=integer, fmt=fmt)
    out = _open(chart_id, title, summary, "stacked", len(starts))
    out += frame.axes(hourly)
    if not starts:
        out.append(_empty(frame) + "</svg>")
        return Markup("".join(out))
    gap = min(2.0, frame.step * 0.2)
    for i, at in enumerate(starts):
        out.append(f'<g class="bucket" data-bucket="{at.isoformat()}" data-total="{totals[i]!r}">')
        below = 0.0
        for j, layer in enumerate(layers):
            value = layer.values[i]
            if not value:
                continue
            label = f"{layer.name}, {bucket_label(at, hourly)}: {fmt(value)}"
            y = frame.y_of(below + value)
            out.append(
                f'<rect class="mark s{j % SERIES_CLASSES}" data-bucket="{at.isoformat()}" '
                f'data-series="{escape(layer.name)}" '
                f'data-value="{value!r}" x="{frame.left + frame.step * i + gap / 2:.1f}" y="{y:.1f}" '
                f'width="{max(frame.step - gap, 0.5):.1f}" height="{frame.height_of(value):.1f}">'
                f"<title>{escape(label)}</title></rect>"
            )
            below += value
        out.append("</g>")
    out.append(frame.baseline() + "</svg>")
    return Markup("".join(out))
