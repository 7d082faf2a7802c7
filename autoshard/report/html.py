"""report.html: the plan report as one self-contained page (inline CSS and hand-written SVG, no
script, no network), rendered from the same dict as the sharding log (`plan_report`), never from
Plan objects, so the page, the log and plan.json can never disagree.

Sections: the summary (mesh, modeled step split compute / communication, peak memory per rank
beside the device's capacity), each parameter's layout drawn as a grid (one representative per
repeated block, every FQN listed), the modeled step per block as stacked bars, the collectives by
kind, and, given the training metrics rows, loss and tokens/s curves (the validation loss beside
the loss, and its last value and perplexity, when the run evaluated).
"""

from __future__ import annotations

import math
from typing import Iterable, Sequence

from autoshard.layout import Layout
from autoshard.report.charts import (
    MESH_COLORS,
    curve_svg,
    layout_svg,
    memory_block,
)
from autoshard.report.charts import (
    bar_svg as _bar,
)
from autoshard.report.charts import (
    escape as _e,
)
from autoshard.report.charts import (
    kind_color as _color,
)
from autoshard.report.charts import (
    legend as _legend,
)
from autoshard.report.charts import (
    mesh_dim_label as _md,
)
from autoshard.report.experts import experts_line
from autoshard.report.pipeline import pipeline_section
from autoshard.report.text import STAGE_PLAN, host_line, human_bytes, human_time

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


def _shape(shape: Sequence[int]) -> str:
    return "(" + ", ".join(map(str, shape)) + ("," if len(shape) == 1 else "") + ")"


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


def layout_caption(shape: Sequence[int], layout: str, mesh_shape: Sequence[int], names: Sequence[str]) -> str:
    """In words: which mesh dims split which tensor dim, in which order; what is replicated / partial."""
    lay = Layout.parse(layout)
    parts = []
    for td, mds in lay.order:
        axis = ("rows" if td == 0 else "columns" if td == 1 else "not drawn") if len(shape) >= 2 else "across"
        steps = " then ".join(f"{_md(m, names)}&times;{_e(mesh_shape[m])}" for m in mds)
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
        f'<tr><td class="mono">{_e(k)}</td><td class="num">{_e(counts.get(k, 0))}</td>'
        + (f'<td class="num">{_e(program.get(k, 0))}</td>' if program is not None else "")
        + f'<td class="num">{_e(human_bytes(sizes.get(k, 0.0)))}</td>'
        f'<td class="num">{_e(human_time(seconds.get(k, 0.0)))}</td>'
        f"<td>{_bar([(k, sizes.get(k, 0.0), _color(k, colors))], biggest, width=300, height=12)}</td></tr>"
        for k in kinds
    )
    total = (
        f'<tr><th>total</th><th class="num">{_e(sum(counts.values()))}</th>'
        + (f'<th class="num">{_e(sum(program.values()))}</th>' if program is not None else "")
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
    host = [("host", _e(host_line(report["host"]).removeprefix("host: ")))] if report.get("host") else []
    if report.get("experts"):
        host.append(("experts", _e(experts_line(report["experts"]).removeprefix("experts: "))))
    items = [*_run_items(report, names), *_step_items(report["totals"], colors), *host, *_plan_items(report)]
    dl = '<dl class="kv">' + "".join(f"<dt>{_e(k)}</dt><dd>{v}</dd>" for k, v in items) + "</dl>"
    return f'<section id="summary"><h2>Summary</h2>{dl}{memory_block(report.get("memory"))}</section>'


def _run_items(report: dict, names: Sequence[str]) -> list[tuple[str, str]]:
    """What was planned: the mesh, the run's settings, precision, memory limit, what runs twice."""
    mesh = report["mesh_shape"]
    run = report.get("run") if isinstance(report.get("run"), dict) else report.get("settings")
    items = [
        (
            "mesh",
            f"{_e(_shape(mesh))} = "
            + " &times; ".join(f"{_md(i, names)}&nbsp;=&nbsp;{_e(size)}" for i, size in enumerate(mesh))
            + f" ({_e(math.prod(mesh))} ranks)",
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
    return items


def _step_items(t: dict, colors: dict[str, str]) -> list[tuple[str, str]]:
    """The modeled step per rank, as a sum and as a bar of its parts."""
    step = t["step_time_s"]
    optimizer = t.get("optimizer_s", 0.0)
    parts = [
        ("compute", t["compute_s"], _color("compute", colors)),
        ("optimizer", optimizer, "#8e6bbf"),
        ("communication", t["comm_s"], "#d9534f"),
    ]
    total = " + ".join(f"{name} {_e(human_time(seconds))}" for name, seconds, _ in parts)
    bar = _bar(parts, step or 1.0, width=560, height=16) + _legend([(name, color) for name, _, color in parts])
    return [("modeled step per rank", f"{_e(human_time(step))} = {total} (no overlap)"), ("", bar)]


def _plan_items(report: dict) -> list[tuple[str, str]]:
    """What the plan holds and how it was found: parameters, the ILP, the planning stages' times."""
    t = report["totals"]
    items = [
        (
            "parameters",
            f"{_e(t['params'])}, {_e(t['non_default_order_params'])} in non-default device order; "
            f"{_e(human_bytes(t['param_bytes_per_rank']))} per rank",
        )
    ]
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
    return items


# ------------------------------------------------------------------------------------ training
VAL_COLOR = "#1f6fd1"


def _points(metrics: Sequence[dict], key: str) -> list[tuple[float, float]]:
    """(step, value) of the rows where both are finite numbers: any other value is not drawn."""
    return [
        (float(r["step"]), float(r[key]))
        for r in metrics
        if isinstance(r.get(key), (int, float))
        and isinstance(r.get("step"), (int, float))
        and math.isfinite(r[key])
        and math.isfinite(r["step"])
    ]


def validation_line(metrics: Sequence[dict]) -> str:
    """The last validation loss and perplexity, at its step; '' without one (no --eval-every)."""
    rows = [r for r in metrics if isinstance(r.get("val_loss"), (int, float))]
    if not rows:
        return ""
    last = rows[-1]
    loss, ppl, step = float(last["val_loss"]), last.get("val_ppl"), last.get("step")
    text = f"validation loss: {loss:.3f}"
    text += f", perplexity {float(ppl):,.2f}" if isinstance(ppl, (int, float)) else ""
    text += f" at step {int(step)}" if isinstance(step, (int, float)) and math.isfinite(step) else ""
    return f"<h3>{_e(text)} ({len(rows)} evaluation{'s' if len(rows) > 1 else ''})</h3>"


def training_section(metrics: Sequence[dict]) -> str:
    """The loss curve (with the validation loss's marks when the run evaluated) and tokens/s."""
    out = ['<section id="training"><h2>Training</h2>']
    for key, label, color, fmt in (
        ("loss", "loss", "#c5221f", lambda v: f"{v:.3f}"),
        ("tokens_per_s", "tokens/s", "#188038", lambda v: f"{v:,.0f}"),
    ):
        pts = _points(metrics, key)
        if not pts:
            continue
        xs, ys = zip(*pts)
        out.append(f"<h3>{_e(label)}: {_e(fmt(ys[-1]))} at step {int(xs[-1])} ({len(pts)} steps)</h3>")
        val = validation_line(metrics) if key == "loss" else ""
        if val:
            dots = _points(metrics, "val_loss")
            out.append(
                val
                + curve_svg(xs, ys, color, label, fmt, dots=dots, dots_color=VAL_COLOR, dots_label="validation loss")
                + _legend([("training loss", color), ("validation loss (every --eval-every steps)", VAL_COLOR)])
            )
        else:
            out.append(curve_svg(xs, ys, color, label, fmt))
    out.append("</section>")
    return "".join(out)


# ------------------------------------------------------------------------------------ the page
def render_html(report: dict, metrics: Sequence[dict] | None = None) -> str:
    """The whole page from `plan_report`'s dict and, optionally, the training metrics rows."""
    names = mesh_dim_names(report)
    colors: dict[str, str] = {}
    run = report.get("run") if isinstance(report.get("run"), dict) else report.get("settings")
    model = run.get("model") if isinstance(run, dict) else None
    pipeline = report.get("pipeline")
    mesh_text = "x".join(map(str, pipeline["mesh"] if pipeline else report["mesh_shape"]))
    title = f"autoshard plan: {model + ' on ' if model else ''}mesh {mesh_text}"
    body = [
        f"<h1>{_e(title)}</h1>",
        '<p class="muted">Rendered from plan.json, the same data as sharding.log. Times and bytes are the '
        "planner's model, per rank.</p>",
        *([pipeline_section(pipeline), f'<p class="muted">Below: {_e(STAGE_PLAN)}.</p>'] if pipeline else []),
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
