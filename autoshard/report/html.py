"""report.html: the plan report as one self-contained page (inline CSS and hand-written SVG, no
script, no network), rendered from the same dict as the sharding log (`plan_report`), never from
Plan objects, so the page, the log and plan.json can never disagree.

Sections: the summary (mesh, modeled step split compute / communication, peak memory per rank
beside the device's capacity), each parameter's layout drawn as a grid (one representative per
repeated block, every FQN listed), the modeled step per block as stacked bars, the collectives by
kind, and, given the training metrics rows, loss and tokens/s curves.
"""

from __future__ import annotations

import html
import math
from typing import Any, Iterable, Sequence

from autoshard.layout import Layout, split_digits
from autoshard.report.text import human_bytes, human_time

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
MEMORY_PARTS = (
    ("params", "params"),
    ("grads", "grads"),
    ("optimizer", "AdamW states"),
    ("activations", "saved activations"),
    ("gathered_params", "gathered params"),
    ("transient", "transient"),
    ("buffers", "buffers"),
    ("inputs", "inputs"),
)
MEMORY_COLORS = ("#1f6fd1", "#4e9de0", "#8430ce", "#e8710a", "#f2b632", "#c5221f", "#188038", "#7b8ea8")

CSS = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",sans-serif;color:#1d2330;margin:24px auto;max-width:1320px;
padding:0 16px}
h1{font-size:22px;margin:0 0 4px}h2{font-size:18px;margin:28px 0 8px;border-bottom:1px solid #d5dae3;padding-bottom:4px}
h3{font-size:15px;margin:18px 0 6px}code,.mono{font-family:ui-monospace,"DejaVu Sans Mono",monospace;font-size:12.5px}
.muted{color:#5f6b7c}.note{color:#5f6b7c;font-size:12.5px}.warn{color:#b3261e;font-weight:600}.ok{color:#188038;
font-weight:600}
dl.kv{display:grid;grid-template-columns:max-content auto;gap:2px 14px;margin:6px 0}dl.kv dt{color:#5f6b7c}
dl.kv dd{margin:0}
.cards{display:flex;flex-wrap:wrap;gap:14px}.card{border:1px solid #d5dae3;border-radius:6px;padding:8px 10px;
background:#fbfcfe}
.card .name{font-family:ui-monospace,monospace;font-size:12.5px;font-weight:600;word-break:break-all;max-width:300px}
.card .sub{font-size:12px;color:#3c4657}.tag{display:inline-block;font-size:11px;padding:0 5px;border-radius:3px;
background:#fdecd2;color:#8a4b00}
table{border-collapse:collapse;font-size:12.5px}th,td{padding:2px 10px 2px 0;text-align:left;vertical-align:top}
th{color:#5f6b7c;font-weight:600;border-bottom:1px solid #d5dae3}td.num,th.num{text-align:right}
.legend{display:flex;flex-wrap:wrap;gap:4px 14px;font-size:12.5px;margin:4px 0}.sw{display:inline-block;width:11px;
height:11px;border-radius:2px;margin-right:4px;vertical-align:-1px}
details{margin:10px 0}summary{cursor:pointer;color:#1f4f9a}
"""


# ------------------------------------------------------------------------------------ helpers
def _e(value: Any) -> str:
    return html.escape(str(value))


def _shape(shape: Sequence[int]) -> str:
    return "(" + ", ".join(map(str, shape)) + ("," if len(shape) == 1 else "") + ")"


def _fmt(x: float) -> str:
    return f"{x:.1f}".rstrip("0").rstrip(".")


def mesh_dim_names(report: dict) -> list[str]:
    """The mesh dims' names as the report records them (older plan.json files: in the plan's `run`
    or train's `settings`), else m0, m1, ..."""
    mesh = report["mesh_shape"]
    for names in (
        report.get("mesh_names"),
        *(
            (report.get(key) or {}).get("mesh_names")
            for key in ("run", "settings")
            if isinstance(report.get(key), dict)
        ),
    ):
        if names and len(names) == len(mesh):
            return [str(n) for n in names]
    return [f"m{i}" for i in range(len(mesh))]


def _color(kind: str, extra: dict[str, str]) -> str:
    if kind in SEGMENT_COLORS:
        return SEGMENT_COLORS[kind]
    return extra.setdefault(kind, _MORE_COLORS[len(extra) % len(_MORE_COLORS)])


def _legend(items: Iterable[tuple[str, str]]) -> str:
    return (
        '<div class="legend">'
        + "".join(f'<span><span class="sw" style="background:{c}"></span>{_e(label)}</span>' for label, c in items)
        + "</div>"
    )


def _md(i: int, names: Sequence[str]) -> str:
    """A mesh dim's name in its colour: 'tp(1)'."""
    return f'<b style="color:{MESH_COLORS[i % len(MESH_COLORS)]}">{_e(names[i])}</b>({i})'


def _bar(
    segments: Sequence[tuple[str, float, str]], scale: float, width: int = 560, height: int = 16, label: str = ""
) -> str:
    """A horizontal stacked bar: (name, value, colour) segments, `scale` = the value of the full width."""
    parts, x = [], 0.0
    for name, value, color in segments:
        w = width * value / scale if scale > 0 else 0.0
        if w > 0:
            parts.append(
                f'<rect x="{x:.1f}" y="0" width="{w:.1f}" height="{height}" fill="{color}">'
                f"<title>{_e(name)}</title></rect>"
            )
        x += w
    total_w = width + (190 if label else 0)
    text = (
        f'<text x="{min(x, width) + 6:.1f}" y="{height - 4}" font-size="11" fill="#1d2330">{_e(label)}</text>'
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
                    f'text-anchor="middle" fill="#3c4657">{_e(text)}</text>'
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


def layout_caption(shape: Sequence[int], layout: str, mesh_shape: Sequence[int], names: Sequence[str]) -> str:
    """In words: which mesh dims split which tensor dim, in which order; what is replicated / partial."""
    lay = Layout.parse(layout)
    parts = []
    for td, mds in lay.order:
        axis = ("rows" if td == 0 else "columns" if td == 1 else "not drawn") if len(shape) >= 2 else "across"
        steps = " then ".join(f"{_md(m, names)}&times;{mesh_shape[m]}" for m in mds)
        parts.append(f"dim {td} ({axis}) split by {steps}")
    rep = [i for i, p in enumerate(lay.placements) if p.kind == "R"]
    partial = [i for i, p in enumerate(lay.placements) if p.kind == "P"]
    if rep:
        parts.append("replicated over " + ", ".join(_md(i, names) for i in rep))
    if partial:
        parts.append("partial over " + ", ".join(_md(i, names) for i in partial))
    return "; ".join(parts)


def param_card(
    p: dict, mesh_shape: Sequence[int], names: Sequence[str], title: str | None = None, note: str = ""
) -> str:
    tag = "" if p.get("default_order", True) else ' <span class="tag">non-default device order</span>'
    return (
        f'<div class="card"><div class="name">{_e(title or p["fqn"])}</div>'
        f"{layout_svg(p['shape'], p['layout'], mesh_shape, names)}"
        f'<div class="sub"><code>{_e(p["layout"])}</code>{tag}</div>'
        f'<div class="sub">global {_e(_shape(p["shape"]))} {_e(p["dtype"])} &rarr; local '
        f"{_e(_shape(p['local_shape']))}, {_e(human_bytes(p['bytes_per_rank']))}/rank</div>"
        f'<div class="sub">{layout_caption(p["shape"], p["layout"], mesh_shape, names)}</div>'
        f"{note}</div>"
    )


def block_key(path: str) -> tuple[str, int, str] | None:
    """'layers.3.attention.wq.weight' -> ('layers', 3, 'attention.wq.weight'); None outside a numbered block."""
    parts = path.split(".")
    for i, part in enumerate(parts[1:], 1):
        if part.isdigit():
            return ".".join(parts[:i]), int(part), ".".join(parts[i + 1 :])
    return None


def _ranges(indices: Iterable[int]) -> str:
    """[0, 1, 2, 5] -> '0-2, 5'."""
    out: list[str] = []
    for i in sorted(indices):
        if out and out[-1][1] == i - 1:
            out[-1] = (out[-1][0], i)
        else:
            out.append((i, i))  # type: ignore[arg-type]
    return ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in out)  # type: ignore[misc]


def layouts_section(report: dict, names: Sequence[str]) -> str:
    mesh = report["mesh_shape"]
    params = report["parameters"]
    blocks: dict[str, dict[int, list[dict]]] = {}
    for p in params:
        key = block_key(p["fqn"])
        if key is not None:
            blocks.setdefault(key[0], {}).setdefault(key[1], []).append(p)
    repeated = {prefix: by_index for prefix, by_index in blocks.items() if len(by_index) > 1}
    out = [
        '<section id="layouts"><h2>Parameter layouts</h2>',
        '<p class="note">Each rectangle is a parameter\'s global shape (dim 0 down, dim 1 across; not to '
        "scale). Lines split it along the tensor dims the mesh dims shard, in device order: the first split "
        "is the thickest line, each in its mesh dim's colour; a piece is labelled with the mesh coordinates "
        "that hold it (in split order) when it has room.</p>",
        _legend(
            (f"mesh dim {i}: {n} (size {mesh[i]})", MESH_COLORS[i % len(MESH_COLORS)]) for i, n in enumerate(names)
        ),
    ]
    for prefix, by_index in repeated.items():
        first = min(by_index)
        layouts: dict[str, dict[str, list[int]]] = {}  # pattern -> layout -> block indices
        for index, ps in by_index.items():
            for p in ps:
                pattern = f"{prefix}.*.{block_key(p['fqn'])[2]}"  # type: ignore[index]
                layouts.setdefault(pattern, {}).setdefault(p["layout"], []).append(index)
        differing = {
            pat: ls for pat, ls in layouts.items() if len(ls) > 1 or sum(map(len, ls.values())) != len(by_index)
        }
        out.append(
            f"<h3><code>{_e(prefix)}.*</code>: {len(by_index)} blocks ({_e(_ranges(by_index))}); "
            f"block {first} shown</h3>"
        )
        if differing:
            items = "".join(
                f"<li><code>{_e(pat)}</code>: "
                + "; ".join(f"<code>{_e(lay)}</code> in blocks {_e(_ranges(idx))}" for lay, idx in ls.items())
                + "</li>"
                for pat, ls in differing.items()
            )
            out.append(f'<p class="warn">Not every block has the same layouts:</p><ul>{items}</ul>')
        else:
            out.append(f'<p class="ok">All {len(by_index)} blocks share these layouts.</p>')
        cards = []
        for p in by_index[first]:
            pattern = f"{prefix}.*.{block_key(p['fqn'])[2]}"  # type: ignore[index]
            note = '<div class="sub warn">differs between blocks</div>' if pattern in differing else ""
            cards.append(param_card(p, mesh, names, title=pattern, note=note))
        out.append('<div class="cards">' + "".join(cards) + "</div>")
    rest = [p for p in params if (block_key(p["fqn"]) or ("",))[0] not in repeated]
    if rest:
        out.append("<h3>Rest of the model</h3>" if repeated else "")
        out.append('<div class="cards">' + "".join(param_card(p, mesh, names) for p in rest) + "</div>")
    rows = "".join(
        f'<tr><td class="mono">{_e(p["fqn"])}</td><td>{_e(_shape(p["shape"]))}</td><td>{_e(p["dtype"])}</td>'
        f'<td class="mono">{_e(p["layout"])}</td><td>{_e(_shape(p["local_shape"]))}</td>'
        f'<td class="num">{_e(human_bytes(p["bytes_per_rank"]))}</td></tr>'
        for p in params
    )
    out.append(
        f"<details><summary>All {len(params)} parameters (FQN, layout, local shape)</summary>"
        f"<table><tr><th>parameter (FQN)</th><th>global shape</th><th>dtype</th><th>layout</th>"
        f'<th>local shape</th><th class="num">bytes/rank</th></tr>{rows}</table></details></section>'
    )
    return "".join(out)


# ------------------------------------------------------------------------------------ the step
def _top_block(module: str) -> str:
    """'layers.3.attention.wq' -> 'layers.3'; 'output' -> 'output'; '' -> '(step)'."""
    if not module:
        return "(step)"
    key = block_key(module)
    return f"{key[0]}.{key[1]}" if key else module


def step_by_block(report: dict) -> dict[str, dict[str, float]]:
    """Modeled seconds per top-level block, in first-appearance order: 'compute' and one entry per
    collective kind. A redistribution's cost is shared evenly by its collective steps (one with only
    local steps, e.g. chunk, counts as 'local'); a gradient's goes to its parameter's block."""
    from autoshard.pricing.ring import COLLECTIVE_KINDS

    rows: dict[str, dict[str, float]] = {}

    def add(block: str, redistributions: list[dict], compute: float = 0.0) -> None:
        row = rows.setdefault(block, {"compute": 0.0})
        row["compute"] += compute
        for r in redistributions:
            kinds = [s.split("[", 1)[0] for s in r["steps"]]
            kinds = [k for k in kinds if k in COLLECTIVE_KINDS] or ["local"]
            for k in kinds:
                row[k] = row.get(k, 0.0) + r["cost_s"] / len(kinds)

    for n in report["nodes"]:
        add(_top_block(n["module"]), n["redistributions"], n["compute_s"])
    for s in report.get("sinks", []):
        module = s["fqn"].rsplit(".", 1)[0] if s.get("fqn") and "." in s["fqn"] else ""
        add(_top_block(module), s["redistributions"])
    return rows


def timeline_section(report: dict, colors: dict[str, str]) -> str:
    rows = step_by_block(report)
    kinds = ["compute"] + sorted({k for row in rows.values() for k in row} - {"compute"})
    scale = max((sum(row.values()) for row in rows.values()), default=0.0)
    body = "".join(
        f'<tr><td class="mono">{_e(block)}</td><td>'
        + _bar(
            [(f"{k}: {human_time(row.get(k, 0.0))}", row.get(k, 0.0), _color(k, colors)) for k in kinds],
            scale,
            width=640,
            height=14,
            label=human_time(sum(row.values())),
        )
        + "</td></tr>"
        for block, row in rows.items()
    )
    t = report["totals"]
    return (
        '<section id="timeline"><h2>Modeled step per block</h2>'
        f'<p class="note">Per rank, no overlap: compute and the redistributions each block\'s ops (forward and '
        f"backward) and gradients need. Bars share one scale; the step is {_e(human_time(t['step_time_s']))}. "
        "A redistribution of several collectives is shared evenly among them.</p>"
        + _legend((k, _color(k, colors)) for k in kinds)
        + f"<table><tr><th>block</th><th>modeled time</th></tr>{body}</table></section>"
    )


def collectives_section(report: dict, colors: dict[str, str]) -> str:
    t = report["totals"]
    counts, sizes = t.get("count_by_collective", {}), t.get("bytes_by_collective", {})
    program = t.get("program_count_by_collective")
    seconds: dict[str, float] = {}
    for row in step_by_block(report).values():
        for k, v in row.items():
            seconds[k] = seconds.get(k, 0.0) + v
    kinds = sorted(set(counts) | set(sizes))
    if not kinds:
        return '<section id="collectives"><h2>Collectives</h2><p>None: every rank computes on its own.</p></section>'
    biggest = max(sizes.values(), default=0.0) or 1.0
    rows = "".join(
        f'<tr><td class="mono">{_e(k)}</td><td class="num">{counts.get(k, 0)}</td>'
        + (f'<td class="num">{program.get(k, 0)}</td>' if program is not None else "")
        + f'<td class="num">{_e(human_bytes(sizes.get(k, 0.0)))}</td>'
        f'<td class="num">{_e(human_time(seconds.get(k, 0.0)))}</td>'
        f"<td>{_bar([(k, sizes.get(k, 0.0), _color(k, colors))], biggest, width=300, height=12)}</td></tr>"
        for k in kinds
    )
    total = (
        f'<tr><th>total</th><th class="num">{sum(counts.values())}</th>'
        + (f'<th class="num">{sum(program.values())}</th>' if program is not None else "")
        + f'<th class="num">{_e(human_bytes(t.get("comm_bytes", 0.0)))}</th>'
        f'<th class="num">{_e(human_time(t.get("comm_s", 0.0)))}</th><th></th></tr>'
    )
    head = (
        '<tr><th>kind</th><th class="num">count</th>'
        + ('<th class="num">as run</th>' if program is not None else "")
        + '<th class="num">bytes</th><th class="num">modeled time</th><th>bytes</th></tr>'
    )
    note = (
        ' "As run" counts what the lowered program issues (a block\'s parameter gathers and gradient '
        "scatters bucketed)."
        if program is not None
        else ""
    )
    return (
        '<section id="collectives"><h2>Collectives per rank by kind</h2>'
        f'<p class="note">Wire bytes per rank of every planned redistribution.{_e(note)}</p>'
        f"<table>{head}{rows}{total}</table></section>"
    )


# ------------------------------------------------------------------------------------ summary
_RUN_KEYS = ("model", "batch", "seq", "steps", "network", "device", "device_profile", "backend", "memory_budget")


def summary_section(report: dict, names: Sequence[str], colors: dict[str, str]) -> str:
    mesh = report["mesh_shape"]
    t = report["totals"]
    run = report.get("run") if isinstance(report.get("run"), dict) else report.get("settings")
    items = [
        (
            "mesh",
            f"{_e(_shape(mesh))} = "
            + " &times; ".join(f"{_md(i, names)}&nbsp;=&nbsp;{size}" for i, size in enumerate(mesh))
            + f" ({math.prod(mesh)} ranks)",
        )
    ]
    if isinstance(run, dict):
        items += [(k, _e(run[k])) for k in _RUN_KEYS if run.get(k) is not None]
    if report.get("precision"):
        items.append(("precision", _e(report["precision"]["summary"])))
    if report.get("memory_fit"):
        items.append(("memory limit", _e(report["memory_fit"]["summary"])))
    if (report.get("recompute") or {}).get("blocks"):
        items.append(
            (
                "activation checkpointing",
                _e(
                    f"every block of {', '.join(report['recompute']['blocks'])} "
                    f"recomputes its forward ({report['recompute']['ops']} ops)"
                ),
            )
        )
    if (report.get("reshard") or {}).get("blocks"):
        items.append(
            (
                "reshard after forward",
                _e(
                    f"every block of {', '.join(report['reshard']['blocks'])} "
                    f"gathers its parameters again in the backward"
                ),
            )
        )
    step = t["step_time_s"]
    optimizer = t.get("optimizer_s", 0.0)
    items.append(
        (
            "modeled step per rank",
            f"{_e(human_time(step))} = compute {_e(human_time(t['compute_s']))} + "
            f"optimizer {_e(human_time(optimizer))} + communication {_e(human_time(t['comm_s']))} (no overlap)",
        )
    )
    bar = _bar(
        [
            ("compute", t["compute_s"], _color("compute", colors)),
            ("optimizer", optimizer, "#8e6bbf"),
            ("communication", t["comm_s"], "#d9534f"),
        ],
        step or 1.0,
        width=560,
        height=16,
    )
    items.append(
        (
            "",
            bar
            + _legend([("compute", _color("compute", colors)), ("optimizer", "#8e6bbf"), ("communication", "#d9534f")]),
        )
    )
    items.append(
        (
            "parameters",
            f"{t['params']}, {t['non_default_order_params']} in non-default device order; "
            f"{_e(human_bytes(t['param_bytes_per_rank']))} per rank",
        )
    )
    ilp = t.get("ilp")
    if ilp:
        items.append(
            (
                "ILP",
                f"{ilp['variables']:,} variables, {ilp['constraints']:,} constraints; "
                f"{_e(ilp['backend'])} {_e(ilp['status'])} in {ilp['solve_s']:.2f} s",
            )
        )
    if report.get("timings"):
        items.append(
            (
                "planning",
                _e(", ".join(f"{k} {v:.2f} s" for k, v in report["timings"].items()))
                + f" (total {sum(report['timings'].values()):.2f} s)",
            )
        )
    dl = '<dl class="kv">' + "".join(f"<dt>{_e(k)}</dt><dd>{v}</dd>" for k, v in items) + "</dl>"
    return f'<section id="summary"><h2>Summary</h2>{dl}{memory_block(report.get("memory"))}</section>'


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
                else f'<span class="warn">does not fit ({_e(human_bytes(peak - capacity))} over)</span>'
            )
            out.append(
                f"<p>rank {r['rank']}: peak {_e(human_bytes(peak))} in the {_e(r['phase'])} of "
                f"{_e(human_bytes(capacity))} on {_e(memory.get('device'))} ({share:.0%}): {verdict}</p>"
            )
            out.append(
                _bar(
                    [("peak", peak, "#c5221f" if peak > capacity else "#1f6fd1")],
                    max(capacity, peak),
                    width=560,
                    height=16,
                    label=f"{share:.0%} of {human_bytes(capacity)}",
                )
            )
        else:
            out.append(
                f"<p>rank {r['rank']}: peak {_e(human_bytes(peak))} in the {_e(r['phase'])} "
                "(no device capacity given)</p>"
            )
        segments = [
            (f"{label}: {human_bytes(r.get(key, 0))}", r.get(key, 0), color)
            for (key, label), color in zip(MEMORY_PARTS, MEMORY_COLORS)
        ]
        out.append(
            '<div class="note">live at the peak:</div>'
            + _bar(segments, peak or 1, width=560, height=16, label=human_bytes(peak))
        )
        out.append(
            '<div class="note">'
            + ", ".join(f"{_e(label)} {_e(human_bytes(r.get(key, 0)))}" for key, label in MEMORY_PARTS)
            + "</div>"
        )
    out.append(_legend(parts))
    return "".join(out)


# ------------------------------------------------------------------------------------ training
def curve_svg(xs: Sequence[float], ys: Sequence[float], color: str, y_label: str, fmt=_fmt) -> str:
    """One polyline (x = step) with its axes, min/max ticks and the last value."""
    w, h, left, bottom, top, right = 620, 190, 64, 26, 10, 16
    pw, ph = w - left - right, h - top - bottom
    x0, x1 = min(xs), max(xs)
    y0, y1 = min(ys), max(ys)
    if y1 == y0:
        y0, y1 = y0 - 1, y1 + 1
    sx = (lambda x: left + pw * (x - x0) / (x1 - x0)) if x1 > x0 else (lambda x: left + pw / 2)
    sy = lambda y: top + ph * (1 - (y - y0) / (y1 - y0))  # noqa: E731
    points = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in zip(xs, ys))
    ticks = "".join(
        f'<text x="{left - 6}" y="{sy(v) + 4:.1f}" font-size="11" text-anchor="end">{_e(fmt(v))}</text>'
        for v in (y0, y1)
    )
    return (
        f'<svg width="{w}" height="{h}" role="img"><rect x="{left}" y="{top}" width="{pw}" height="{ph}" '
        f'fill="#f6f8fb" stroke="#d5dae3"></rect>{ticks}'
        f'<text x="{left}" y="{h - 8}" font-size="11">step {int(x0)}</text>'
        f'<text x="{left + pw}" y="{h - 8}" font-size="11" text-anchor="end">step {int(x1)}</text>'
        f'<text x="{left + pw / 2}" y="{h - 8}" font-size="11" text-anchor="middle">{_e(y_label)}</text>'
        f'<polyline points="{points}" fill="none" stroke="{color}" stroke-width="1.8"></polyline>'
        + (
            f'<circle cx="{sx(xs[0]):.1f}" cy="{sy(ys[0]):.1f}" r="2.5" fill="{color}"></circle>'
            if len(xs) == 1
            else ""
        )
        + "</svg>"
    )


def training_section(metrics: Sequence[dict]) -> str:
    out = ['<section id="training"><h2>Training</h2>']
    for key, label, color, fmt in (
        ("loss", "loss", "#c5221f", lambda v: f"{v:.3f}"),
        ("tokens_per_s", "tokens/s", "#188038", lambda v: f"{v:,.0f}"),
    ):
        pts = [
            (float(r["step"]), float(r[key]))
            for r in metrics
            if isinstance(r.get(key), (int, float)) and isinstance(r.get("step"), (int, float))
        ]
        if not pts:
            continue
        xs, ys = zip(*pts)
        out.append(
            f"<h3>{_e(label)}: {_e(fmt(ys[-1]))} at step {int(xs[-1])} ({len(pts)} steps)</h3>"
            + curve_svg(xs, ys, color, label, fmt)
        )
    out.append("</section>")
    return "".join(out)


# ------------------------------------------------------------------------------------ the page
def render_html(report: dict, metrics: Sequence[dict] | None = None) -> str:
    """The whole page from `plan_report`'s dict and, optionally, the training metrics rows."""
    names = mesh_dim_names(report)
    colors: dict[str, str] = {}
    run = report.get("run") if isinstance(report.get("run"), dict) else report.get("settings")
    model = run.get("model") if isinstance(run, dict) else None
    mesh_text = "x".join(map(str, report["mesh_shape"]))
    title = f"autoshard plan: {model + ' on ' if model else ''}mesh {mesh_text}"
    body = [
        f"<h1>{_e(title)}</h1>",
        '<p class="muted">Rendered from plan.json, the same data as sharding.log. Times and bytes are the '
        "planner's model, per rank.</p>",
        summary_section(report, names, colors),
        layouts_section(report, names),
        timeline_section(report, colors),
        collectives_section(report, colors),
    ]
    if metrics:
        body.append(training_section(metrics))
    return (
        f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{_e(title)}</title>'
        f"<style>{CSS}</style></head><body>\n" + "\n".join(body) + "\n</body></html>\n"
    )
