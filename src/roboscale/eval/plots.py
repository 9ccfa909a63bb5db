"""Plots as inline SVG text: success bars with interval whiskers, and line charts (training curves, success vs
step). Hand-written SVG keeps the reports self-contained and dependency-free (no matplotlib), and every mark
carries a class and data attributes, so tests (and a browser) can check what is drawn.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from html import escape

PALETTE = ("#2b6cb0", "#dd6b20", "#38a169", "#805ad5", "#d53f8c", "#718096", "#b7791f", "#319795")
FONT = "font-family='sans-serif' font-size='12'"


@dataclass
class BarSeries:
    name: str
    """Legend text (a run's label)."""
    values: list[float | None]
    """One rate in [0, 1] per category; None: no data for that category (no bar drawn)."""
    lows: list[float | None] = field(default_factory=list)
    """Lower interval bounds (same length as values; empty: no whiskers)."""
    highs: list[float | None] = field(default_factory=list)
    """Upper interval bounds."""


@dataclass
class LineSeries:
    name: str
    xs: list[float]
    ys: list[float]
    lows: list[float] = field(default_factory=list)
    """Lower bounds drawn as vertical whiskers at each point (empty: none)."""
    highs: list[float] = field(default_factory=list)
    markers: bool = False
    """Draw a dot at each point (sparse series such as evaluations)."""


def bar_chart(categories: list[str], series: list[BarSeries], title: str, x_label: str = "success rate (%)") -> str:
    """Horizontal bars, one row per category (long task names stay readable), 0-100 %, with whiskers at each
    series' interval. Several series are grouped within a row (run comparisons)."""
    label_w = max(90, 7 * max((len(c) for c in categories), default=0) + 12)
    plot_w, bar_h, gap = 440, 16, 10
    row_h = bar_h * len(series) + gap
    top, bottom = 30 + (18 if len(series) > 1 else 0), 46
    width, height = label_w + plot_w + 44, top + row_h * len(categories) + bottom
    x0 = label_w

    def x(rate: float) -> float:
        return x0 + plot_w * min(1.0, max(0.0, rate))

    out = [_open(width, height, title), f"<text x='{width / 2}' y='16' text-anchor='middle' {FONT} "
           f"font-weight='bold'>{escape(title)}</text>"]
    for tick in range(0, 101, 20):
        tx = x(tick / 100)
        out.append(f"<line x1='{tx:.1f}' y1='{top - 4}' x2='{tx:.1f}' y2='{height - bottom}' stroke='#ddd'/>")
        out.append(f"<text x='{tx:.1f}' y='{height - bottom + 16}' text-anchor='middle' {FONT}>{tick}</text>")
    out.append(f"<text x='{x0 + plot_w / 2}' y='{height - 10}' text-anchor='middle' {FONT}>{escape(x_label)}</text>")
    for i, category in enumerate(categories):
        y_row = top + i * row_h
        out.append(f"<text x='{x0 - 6}' y='{y_row + row_h / 2 - gap / 2 + 4:.1f}' text-anchor='end' {FONT}>"
                   f"{escape(category)}</text>")
        for j, s in enumerate(series):
            value = s.values[i]
            if value is None:
                continue
            color = PALETTE[j % len(PALETTE)]
            y = y_row + j * bar_h
            # a 0 % bar stays a 1 px sliver: 0 % is a result, unlike no bar at all (the run lacks the task)
            out.append(f"<rect class='bar' data-category='{escape(category)}' data-series='{escape(s.name)}' "
                       f"data-value='{value:.4f}' x='{x0}' y='{y + 1}' width='{max(1.0, x(value) - x0):.1f}' "
                       f"height='{bar_h - 2}' fill='{color}'><title>{escape(s.name)} {escape(category)}: "
                       f"{value:.0%}</title></rect>")
            low = s.lows[i] if s.lows else None
            high = s.highs[i] if s.highs else None
            end = x(value)
            if low is not None and high is not None:
                out.append(_whisker_h(x(low), x(high), y + bar_h / 2, bar_h / 2 - 1, low, high))
                end = max(end, x(high))
            out.append(f"<text x='{end + 5:.1f}' y='{y + bar_h / 2 + 4:.1f}' font-family='sans-serif' "
                       f"font-size='11' fill='#333'>{value:.0%}</text>")
    out.append(f"<line x1='{x0}' y1='{top - 4}' x2='{x0}' y2='{height - bottom}' stroke='#333'/>")
    if len(series) > 1:
        out.append(_legend([s.name for s in series], x0, top - 22))
    out.append("</svg>")
    return "\n".join(out)


def line_chart(series: list[LineSeries], title: str, x_label: str, y_label: str, *, y_range: tuple[float, float]
               | None = None, log_y: bool | None = None, highlight: tuple[float, float, str] | None = None,
               percent: bool = False, from_zero: bool = False) -> str:
    """Lines (and optional whiskers) over a shared x axis. ``log_y`` None: log scale when the positive values
    span more than 30x (losses). ``highlight``: (x, y, text) marked with a ring and a label (the best
    checkpoint). ``percent``: y values are rates in [0, 1], labelled in %. ``from_zero``: the y axis starts at 0
    (throughput: a 10% wobble must not look like a collapse)."""
    width, height = 560, 280
    left, right, top, bottom = 64, 16, 30 + (16 if len(series) > 1 else 0), 44
    xs = [x for s in series for x in s.xs]
    ys = [y for s in series for y in (*s.ys, *s.lows, *s.highs) if math.isfinite(y)]
    if not xs or not ys:
        raise ValueError(f"{title}: nothing to plot")
    if log_y is None:
        log_y = min(ys) > 0 and max(ys) / min(ys) > 30
    y_lo, y_hi = y_range if y_range else (min(ys), max(ys))
    if log_y:
        y_lo, y_hi = math.log10(y_lo), math.log10(y_hi)
    elif from_zero and not y_range:
        y_lo = min(0.0, y_lo)
    if y_hi - y_lo < 1e-12 * max(1.0, abs(y_hi)):  # a constant: centre it in a band around its value
        pad = 0.1 if log_y else abs(y_hi) * 0.5 or 0.5
        y_lo, y_hi = y_lo - (pad if not from_zero or log_y else 0.0), y_hi + pad
    elif not y_range:
        y_hi += 0.05 * (y_hi - y_lo)  # headroom: the highest point is not drawn on the frame
    x_lo, x_hi = min(xs), max(xs)
    if x_hi == x_lo:  # one point (a first evaluation): centre it
        pad = max(1.0, abs(x_lo) * 0.1)
        x_lo, x_hi = x_lo - pad, x_hi + pad
    plot_w, plot_h = width - left - right, height - top - bottom

    def px(x: float) -> float:
        return left + plot_w * (x - x_lo) / (x_hi - x_lo)

    def py(y: float) -> float:
        v = math.log10(y) if log_y else y
        return top + plot_h * (1 - (v - y_lo) / (y_hi - y_lo))

    out = [_open(width, height, title), f"<text x='{width / 2}' y='16' text-anchor='middle' {FONT} "
           f"font-weight='bold'>{escape(title)}</text>"]
    y_ticks = _log_ticks(y_lo, y_hi) if log_y else _nice_ticks(y_lo, y_hi)
    # enough decimals that neighbouring percent ticks differ (0.5% steps on an MFU axis)
    decimals = max(0, -math.floor(math.log10(100 * (y_ticks[1] - y_ticks[0])))) if len(y_ticks) > 1 else 0
    for t in y_ticks:
        ty = py(t)
        if top - 1 <= ty <= top + plot_h + 1:
            out.append(f"<line x1='{left}' y1='{ty:.1f}' x2='{left + plot_w}' y2='{ty:.1f}' stroke='#eee'/>")
            out.append(f"<text x='{left - 6}' y='{ty + 4:.1f}' text-anchor='end' {FONT}>"
                       f"{f'{100 * t:.{decimals}f}%' if percent else _fmt(t)}</text>")
    for t in _nice_ticks(x_lo, x_hi):
        tx = px(t)
        if left - 1 <= tx <= left + plot_w + 1:
            out.append(f"<line x1='{tx:.1f}' y1='{top + plot_h}' x2='{tx:.1f}' y2='{top + plot_h + 4}' "
                       "stroke='#333'/>")
            out.append(f"<text x='{tx:.1f}' y='{top + plot_h + 16}' text-anchor='middle' {FONT}>{_fmt(t)}</text>")
    out.append(f"<rect x='{left}' y='{top}' width='{plot_w}' height='{plot_h}' fill='none' stroke='#333'/>")
    out.append(f"<text x='{left + plot_w / 2}' y='{height - 8}' text-anchor='middle' {FONT}>{escape(x_label)}</text>")
    out.append(f"<text transform='translate(14,{top + plot_h / 2}) rotate(-90)' text-anchor='middle' {FONT}>"
               f"{escape(y_label)}{' (log scale)' if log_y else ''}</text>")
    for j, s in enumerate(series):
        color = PALETTE[j % len(PALETTE)]
        points = [(x, y) for x, y in zip(s.xs, s.ys, strict=True) if math.isfinite(y) and (y > 0 or not log_y)]
        path = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in points)
        out.append(f"<polyline class='line' data-series='{escape(s.name)}' data-points='{len(points)}' "
                   f"points='{path}' fill='none' stroke='{color}' stroke-width='1.6'/>")
        if s.lows and s.highs:
            for x, low, high in zip(s.xs, s.lows, s.highs, strict=True):
                out.append(_whisker_v(px(x), py(low), py(high), 4, low, high))
        if s.markers:
            out += [f"<circle class='point' cx='{px(x):.1f}' cy='{py(y):.1f}' r='3' fill='{color}'>"
                    f"<title>{_fmt(x)}: {f'{y:.0%}' if percent else _fmt(y)}</title></circle>" for x, y in points]
    if highlight is not None:
        hx, hy, text = highlight
        out.append(f"<circle class='highlight' cx='{px(hx):.1f}' cy='{py(hy):.1f}' r='7' fill='none' "
                   f"stroke='#c53030' stroke-width='2'/>")
        anchor = "end" if px(hx) > left + plot_w * 0.7 else "start"
        dx = -10 if anchor == "end" else 10
        dy = 18 if py(hy) < top + 20 else -10  # below the point when above it is the frame
        out.append(f"<text x='{px(hx) + dx:.1f}' y='{py(hy) + dy:.1f}' text-anchor='{anchor}' fill='#c53030' "
                   f"{FONT}>{escape(text)}</text>")
    if len(series) > 1:
        out.append(_legend([s.name for s in series], left, top - 18))
    out.append("</svg>")
    return "\n".join(out)


def _open(width: float, height: float, title: str) -> str:
    return (f"<svg xmlns='http://www.w3.org/2000/svg' class='plot' width='{width:.0f}' height='{height:.0f}' "
            f"viewBox='0 0 {width:.0f} {height:.0f}' role='img' aria-label='{escape(title)}'>"
            f"<rect width='100%' height='100%' fill='white'/>")


def _whisker_h(x1: float, x2: float, y: float, cap: float, low: float, high: float) -> str:
    return (f"<g class='whisker' data-low='{low:.4f}' data-high='{high:.4f}' stroke='#111' stroke-width='1.2'>"
            f"<line x1='{x1:.1f}' y1='{y:.1f}' x2='{x2:.1f}' y2='{y:.1f}'/>"
            f"<line x1='{x1:.1f}' y1='{y - cap:.1f}' x2='{x1:.1f}' y2='{y + cap:.1f}'/>"
            f"<line x1='{x2:.1f}' y1='{y - cap:.1f}' x2='{x2:.1f}' y2='{y + cap:.1f}'/></g>")


def _whisker_v(x: float, y1: float, y2: float, cap: float, low: float, high: float) -> str:
    return (f"<g class='whisker' data-low='{low:.4f}' data-high='{high:.4f}' stroke='#111' stroke-width='1.2'>"
            f"<line x1='{x:.1f}' y1='{y1:.1f}' x2='{x:.1f}' y2='{y2:.1f}'/>"
            f"<line x1='{x - cap:.1f}' y1='{y1:.1f}' x2='{x + cap:.1f}' y2='{y1:.1f}'/>"
            f"<line x1='{x - cap:.1f}' y1='{y2:.1f}' x2='{x + cap:.1f}' y2='{y2:.1f}'/></g>")


def _legend(names: list[str], x: float, y: float) -> str:
    parts = []
    for j, name in enumerate(names):
        parts.append(f"<rect x='{x:.1f}' y='{y:.1f}' width='10' height='10' fill='{PALETTE[j % len(PALETTE)]}'/>"
                     f"<text x='{x + 14:.1f}' y='{y + 9:.1f}' {FONT}>{escape(name)}</text>")
        x += 24 + 7 * len(name)
    return "<g class='legend'>" + "".join(parts) + "</g>"


def _nice_ticks(lo: float, hi: float, count: int = 5) -> list[float]:
    """Round tick values (1, 2 or 5 times a power of ten apart) covering [lo, hi]."""
    span = hi - lo
    raw = span / max(1, count)
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 5, 10) if m * power >= raw)
    first = math.ceil(lo / step - 1e-9) * step
    ticks = []
    t = first
    while t <= hi + step * 1e-9:
        ticks.append(round(t, 12))
        t += step
    return ticks


def _log_ticks(lo_exp: float, hi_exp: float) -> list[float]:
    """Decades (and 2x, 5x within them when the range spans fewer than three decades)."""
    mults = (1, 2, 5) if hi_exp - lo_exp < 3 else (1,)
    return [m * 10.0**e for e in range(math.floor(lo_exp), math.ceil(hi_exp) + 1) for m in mults
            if lo_exp - 1e-9 <= math.log10(m * 10.0**e) <= hi_exp + 1e-9]


def _fmt(v: float) -> str:
    """Short tick text: 12k, 1.5M, 0.003, 2e-05."""
    a = abs(v)
    if a >= 1e6:
        return f"{v / 1e6:g}M"
    if a >= 1e4:
        return f"{v / 1e3:g}k"
    if a == 0 or a >= 1e-3:
        return f"{v:.4g}"
    return f"{v:.0e}"
