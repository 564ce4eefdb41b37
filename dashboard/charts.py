"""Charts as inline SVG, drawn on the server: no JavaScript, no CDN, readable without colour.

A chart is bars (counts, money) or a line (rates) over time buckets. Every mark carries its
bucket and value as `data-` attributes and a `<title>` (the browser's tooltip, and what a
screen reader announces), and the page prints the same numbers as a table.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime

from markupsafe import Markup, escape

WIDTH, HEIGHT = 640, 200
LEFT, RIGHT, TOP, BOTTOM = 56, 8, 12, 28  # room for the axis labels


@dataclass(frozen=True, slots=True)
class Point:
    at: datetime  # start of the bucket (UTC)
    value: float


def nice_ceiling(value: float) -> float:
    """The smallest 1, 2, 2.5 or 5 x 10^k at or above `value` (the top of the y axis)."""
    if value <= 0:
        return 1.0
    exp = math.floor(math.log10(value))
    for step in (1, 2, 2.5, 5, 10):
        top = step * 10.0**exp
        if top >= value * (1 - 1e-9):
            return top
    return 10.0 ** (exp + 1)


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


def render(
    points: Sequence[Point],
    *,
    chart_id: str,
    title: str,
    hourly: bool,
    kind: str = "bar",
    fmt: Callable[[float], str] = compact,
) -> Markup:
    """An SVG chart of `points` (one per bucket, oldest first)."""
    title_id, desc_id = f"{chart_id}-title", f"{chart_id}-desc"
    values = [p.value for p in points]
    top = nice_ceiling(max(values, default=0.0))
    total = sum(values)
    summary = (
        f"{len(points)} {'hours' if hourly else 'days'}, "
        f"highest {fmt(max(values, default=0.0))}, total {fmt(total)}"
        if kind == "bar"
        else f"{len(points)} {'hours' if hourly else 'days'}, highest {fmt(max(values, default=0.0))}"
    )
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM
    out = [
        f'<svg class="chart" id="{escape(chart_id)}" viewBox="0 0 {WIDTH} {HEIGHT}" role="img" '
        f'aria-labelledby="{title_id} {desc_id}" data-kind="{kind}" data-points="{len(points)}">',
        f'<title id="{title_id}">{escape(title)}</title><desc id="{desc_id}">{escape(summary)}</desc>',
    ]
    # Horizontal grid lines with their values: 0, 1/4, ... top.
    for i in range(5):
        y = TOP + plot_h - plot_h * i / 4
        out.append(
            f'<line class="grid" x1="{LEFT}" x2="{WIDTH - RIGHT}" y1="{y:.1f}" y2="{y:.1f}"/>'
            f'<text class="axis" x="{LEFT - 6}" y="{y + 4:.1f}" text-anchor="end">'
            f"{escape(fmt(top * i / 4))}</text>"
        )
    if not points:
        out.append(
            f'<text class="empty" x="{LEFT + plot_w / 2}" y="{TOP + plot_h / 2}" text-anchor="middle">'
            "No data in this range</text></svg>"
        )
        return Markup("".join(out))
    step = plot_w / len(points)
    # A few x labels (first, middle, last) so they never overlap, even at phone width.
    for i in sorted({0, len(points) // 2, len(points) - 1}):
        x = LEFT + step * (i + 0.5)
        anchor = "start" if i == 0 and len(points) > 1 else ("end" if i == len(points) - 1 else "middle")
        out.append(
            f'<text class="axis" x="{x:.1f}" y="{HEIGHT - 8}" text-anchor="{anchor}">'
            f"{escape(bucket_label(points[i].at, hourly))}</text>"
        )

    def y_of(value: float) -> float:
        return TOP + plot_h - plot_h * (value / top)

    if kind == "line":
        coords = " ".join(f"{LEFT + step * (i + 0.5):.1f},{y_of(p.value):.1f}" for i, p in enumerate(points))
        out.append(f'<polyline class="line" points="{coords}"/>')
    for i, p in enumerate(points):
        label = f"{bucket_label(p.at, hourly)}: {fmt(p.value)}"
        data = f'class="mark" data-bucket="{p.at.isoformat()}" data-value="{p.value!r}"'
        if kind == "line":
            out.append(
                f'<circle {data} cx="{LEFT + step * (i + 0.5):.1f}" cy="{y_of(p.value):.1f}" r="3">'
                f"<title>{escape(label)}</title></circle>"
            )
        else:
            height = plot_h * (p.value / top)
            gap = min(2.0, step * 0.2)
            out.append(
                f'<rect {data} x="{LEFT + step * i + gap / 2:.1f}" y="{TOP + plot_h - height:.1f}" '
                f'width="{max(step - gap, 0.5):.1f}" height="{height:.1f}">'
                f"<title>{escape(label)}</title></rect>"
            )
    y0 = TOP + plot_h
    out.append(f'<line class="axis-line" x1="{LEFT}" x2="{WIDTH - RIGHT}" y1="{y0}" y2="{y0}"/></svg>')
    return Markup("".join(out))
