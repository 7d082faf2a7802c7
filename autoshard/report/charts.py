"""The drawing behind report.html: the palette (one colour per mesh dim, per collective kind and per
memory category) and the hand-written SVG: a horizontal stacked bar, a parameter's global shape
split by the mesh dims that shard it, a metric's curve over the steps (with the validation loss's
marks beside the loss), and the memory per rank
(peak beside capacity, what is live at the peak); with the escaping and number formatting they
share. Strings in, strings out: `report.html` lays the page's sections out around them.
"""

from __future__ import annotations

import html
import math
from typing import Any, Iterable, Sequence

from autoshard.layout import Layout, split_digits
from autoshard.report.text import MEMORY_PARTS, human_bytes

# One colour per mesh dim (split lines and names), and per bar segment kind.
MESH_COLORS = ("#1f6fd1", "#e8710a", "#188038", "#c5221f", "#8430ce", "#8d6e63")
SEGMENT_COLORS = {
    "compute": "#7b8ea8",
    "all_gather": "#4e9de0",
    "reduce_scatter": "#f29d38",
    "all_reduce": "#d9534f",
    "all_to_all": "#9c6ade",
    "local": "#b8b8b8",
}
_MORE_COLORS = ("#2bb5a0", "#c9a227", "#6c757d")
MEMORY_COLORS = ("#1f6fd1", "#4e9de0", "#8430ce", "#e8710a", "#f2b632", "#c5221f", "#188038", "#7b8ea8")


# ------------------------------------------------------------------------------------ helpers


def escape(value: Any) -> str:
    return html.escape(str(value))


def fmt_number(x: float) -> str:
    return f"{x:.1f}".rstrip("0").rstrip(".")


def kind_color(kind: str, extra: dict[str, str]) -> str:
    if kind in SEGMENT_COLORS:
        return SEGMENT_COLORS[kind]
    return extra.setdefault(kind, _MORE_COLORS[len(extra) % len(_MORE_COLORS)])


def legend(items: Iterable[tuple[str, str]]) -> str:
    return (
        '<div class="legend">'
        + "".join(f'<span><span class="sw" style="background:{c}"></span>{escape(label)}</span>' for label, c in items)
        + "</div>"
    )


def mesh_dim_label(i: int, names: Sequence[str]) -> str:
    """A mesh dim's name in its colour: 'tp(1)'."""
    return f'<b style="color:{MESH_COLORS[i % len(MESH_COLORS)]}">{escape(names[i])}</b>({i})'


def bar_svg(
    segments: Sequence[tuple[str, float, str]], scale: float, width: int = 560, height: int = 16, label: str = ""
) -> str:
    """A horizontal stacked bar: (name, value, colour) segments, `scale` = the value of the full width."""
    parts, x = [], 0.0
    for name, value, color in segments:
        w = width * value / scale if scale > 0 else 0.0
        if w > 0:
            parts.append(
                f'<rect x="{x:.1f}" y="0" width="{w:.1f}" height="{height}" fill="{color}">'
                f"<title>{escape(name)}</title></rect>"
            )
        x += w
    total_w = width + (190 if label else 0)
    text = (
        f'<text x="{min(x, width) + 6:.1f}" y="{height - 4}" font-size="11" fill="#1d2330">{escape(label)}</text>'
        if label
        else ""
    )
    return (
        f'<svg width="{total_w}" height="{height}" role="img">'
        f'<rect x="0" y="0" width="{width}" height="{height}" fill="#eef1f6"></rect>{"".join(parts)}{text}</svg>'
    )


# ------------------------------------------------------------------------------------ layouts
def layout_svg(shape: Sequence[int], layout: str, mesh_shape: Sequence[int], names: Sequence[str]) -> str:
    """A parameter's global shape as a rectangle (dim 0 down, dim 1 across; a 1-D tensor is one row),
    split along each tensor dim by the mesh dims that shard it, in device order: the first split is the
    thickest line, each line in its mesh dim's colour; a piece large enough is labelled with the mesh
    coordinates that hold it (`tp1 dp0`)."""
    order = dict(Layout.parse(layout).order)
    if len(shape) >= 2:
        rows, cols, row_dim, col_dim = shape[0], shape[1], 0, 1
    else:
        rows, cols, row_dim, col_dim = 1, (shape[0] if shape else 1), None, (0 if shape else None)
    if row_dim is None:
        w, h = 180.0, 18.0
    elif cols >= rows:
        w, h = 180.0, max(180.0 * rows / max(cols, 1), 40.0)
    else:
        w, h = max(130.0 * cols / max(rows, 1), 64.0), 130.0
    row_mds = list(order.get(row_dim, ())) if row_dim is not None else []
    col_mds = list(order.get(col_dim, ())) if col_dim is not None else []
    row_sizes = [mesh_shape[m] for m in row_mds]
    col_sizes = [mesh_shape[m] for m in col_mds]
    n_rows, n_cols = math.prod(row_sizes), math.prod(col_sizes)
    ch, cw = h / n_rows, w / n_cols
    pad = 2
    out = [
        f'<svg width="{w + 2 * pad:.0f}" height="{h + 2 * pad:.0f}" role="img">',
        f'<g transform="translate({pad},{pad})">',
    ]
    label_cells = n_rows * n_cols <= 16 and cw >= 44 and ch >= 13
    for i in range(n_rows):
        for j in range(n_cols):
            fill = "#e6ecf5" if (i + j) % 2 == 0 else "#f6f8fb"
            out.append(
                f'<rect x="{j * cw:.1f}" y="{i * ch:.1f}" width="{cw:.1f}" height="{ch:.1f}" fill="{fill}"></rect>'
            )
            if label_cells and (row_mds or col_mds):
                coords = [
                    *zip(row_mds, split_digits(i, row_sizes)),
                    *zip(col_mds, split_digits(j, col_sizes)),
                ]  # split order
                text = " ".join(f"{names[m]}{c}" for m, c in coords)
                out.append(
                    f'<text x="{j * cw + cw / 2:.1f}" y="{i * ch + ch / 2 + 3.5:.1f}" font-size="9.5" '
                    f'text-anchor="middle" fill="#3c4657">{escape(text)}</text>'
                )

    def lines(mds: list[int], sizes: list[int], n: int, horizontal: bool) -> None:
        for k in range(1, n):
            level = next(lv for lv in range(len(sizes)) if k % (n // math.prod(sizes[: lv + 1])) == 0)
            color = MESH_COLORS[mds[level] % len(MESH_COLORS)]
            sw = max(2.6 - 0.9 * level, 0.6) if n <= 32 else max(1.4 - 0.5 * level, 0.4)
            if horizontal:
                y = k * h / n
                out.append(
                    f'<line x1="0" y1="{y:.1f}" x2="{w:.1f}" y2="{y:.1f}" stroke="{color}" stroke-width="{sw}"></line>'
                )
            else:
                x = k * w / n
                out.append(
                    f'<line x1="{x:.1f}" y1="0" x2="{x:.1f}" y2="{h:.1f}" stroke="{color}" stroke-width="{sw}"></line>'
                )

    lines(row_mds, row_sizes, n_rows, True)
    lines(col_mds, col_sizes, n_cols, False)
    out.append(
        f'<rect x="0" y="0" width="{w:.1f}" height="{h:.1f}" fill="none" stroke="#3c4657" stroke-width="1"></rect>'
    )
    out.append("</g></svg>")
    return "".join(out)


# ------------------------------------------------------------------------------------ curves
def curve_svg(
    xs: Sequence[float],
    ys: Sequence[float],
    color: str,
    y_label: str,
    fmt=fmt_number,
    dots: Sequence[tuple[float, float]] = (),
    dots_color: str = "#1f6fd1",
    dots_label: str = "",
) -> str:
    """One polyline (x = step) with its axes, min/max ticks and the last value; `dots`, (step, value)
    points measured now and then (validation), drawn on the same axes as marks joined by a dashed line."""
    w, h, left, bottom, top, right = 620, 190, 64, 26, 10, 16
    pw, ph = w - left - right, h - top - bottom
    x0, x1 = min([*xs, *(x for x, _ in dots)]), max([*xs, *(x for x, _ in dots)])
    y0, y1 = min([*ys, *(y for _, y in dots)]), max([*ys, *(y for _, y in dots)])
    if y1 == y0:
        y0, y1 = y0 - 1, y1 + 1
    sx = (lambda x: left + pw * (x - x0) / (x1 - x0)) if x1 > x0 else (lambda x: left + pw / 2)
    sy = lambda y: top + ph * (1 - (y - y0) / (y1 - y0))  # noqa: E731
    points = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in zip(xs, ys))
    ticks = "".join(
        f'<text x="{left - 6}" y="{sy(v) + 4:.1f}" font-size="11" text-anchor="end">{escape(fmt(v))}</text>'
        for v in (y0, y1)
    )
    marks = (
        f'<polyline points="{" ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in dots)}" fill="none" '
        f'stroke="{dots_color}" stroke-width="1.4" stroke-dasharray="4 3"></polyline>'
        if len(dots) > 1
        else ""
    ) + "".join(
        f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="3" fill="{dots_color}">'
        f"<title>{escape(f'step {int(x)}: {dots_label} {fmt(y)}')}</title></circle>"
        for x, y in dots
    )
    return (
        f'<svg width="{w}" height="{h}" role="img"><rect x="{left}" y="{top}" width="{pw}" height="{ph}" '
        f'fill="#f6f8fb" stroke="#d5dae3"></rect>{ticks}'
        f'<text x="{left}" y="{h - 8}" font-size="11">step {int(x0)}</text>'
        f'<text x="{left + pw}" y="{h - 8}" font-size="11" text-anchor="end">step {int(x1)}</text>'
        f'<text x="{left + pw / 2}" y="{h - 8}" font-size="11" text-anchor="middle">{escape(y_label)}</text>'
        f'<polyline points="{points}" fill="none" stroke="{color}" stroke-width="1.8"></polyline>'
        + (
            f'<circle cx="{sx(xs[0]):.1f}" cy="{sy(ys[0]):.1f}" r="2.5" fill="{color}"></circle>'
            if len(xs) == 1
            else ""
        )
        + marks
        + "</svg>"
    )


# ------------------------------------------------------------------------------------ memory
def memory_block(memory: dict | None) -> str:
    if not memory:
        return (
            '<h3>Memory per rank</h3><p class="muted">No dry run in this report (planned with --no-dry-run), '
            "so no peak memory.</p>"
        )
    capacity = memory.get("capacity_bytes")
    out = ["<h3>Memory per rank (dry run of the lowered program on fake tensors)</h3>"]
    parts = [(label, color) for (_, label), color in zip(MEMORY_PARTS, MEMORY_COLORS)]
    for r in memory["ranks"]:
        peak = r["peak_bytes"]
        if capacity:
            share = peak / capacity
            verdict = (
                '<span class="ok">fits</span>'
                if peak <= capacity
                else f'<span class="warn">does not fit ({escape(human_bytes(peak - capacity))} over)</span>'
            )
            out.append(
                f"<p>rank {escape(r['rank'])}: peak {escape(human_bytes(peak))} in the {escape(r['phase'])} of "
                f"{escape(human_bytes(capacity))} on {escape(memory.get('device'))} ({share:.0%}): {verdict}</p>"
            )
            out.append(
                bar_svg(
                    [("peak", peak, "#c5221f" if peak > capacity else "#1f6fd1")],
                    max(capacity, peak),
                    width=560,
                    height=16,
                    label=f"{share:.0%} of {human_bytes(capacity)}",
                )
            )
        else:
            out.append(
                f"<p>rank {escape(r['rank'])}: peak {escape(human_bytes(peak))} in the {escape(r['phase'])} "
                "(no device capacity given)</p>"
            )
        segments = [
            (f"{label}: {human_bytes(r.get(key, 0))}", r.get(key, 0), color)
            for (key, label), color in zip(MEMORY_PARTS, MEMORY_COLORS)
        ]
        out.append(
            '<div class="note">live at the peak:</div>'
            + bar_svg(segments, peak or 1, width=560, height=16, label=human_bytes(peak))
        )
        out.append(
            '<div class="note">'
            + ", ".join(f"{escape(label)} {escape(human_bytes(r.get(key, 0)))}" for key, label in MEMORY_PARTS)
            + "</div>"
        )
    out.append(legend(parts))
    return "".join(out)
