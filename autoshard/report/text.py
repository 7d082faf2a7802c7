"""The sharding log and the console summary, rendered from the report dict (`report.build`)."""

from __future__ import annotations

import json
import math

from autoshard.report.build import OWN_KEYS
from autoshard.report.experts import experts_line
from autoshard.report.pipeline import pipeline_lines, pipeline_summary
from autoshard.report.units import human_bytes, human_time


def _shape(shape: list[int]) -> str:
    return "(" + ", ".join(map(str, shape)) + ("," if len(shape) == 1 else "") + ")"


def _table(header: list[str], rows: list[list[str]], right: set[int] = frozenset()) -> list[str]:
    """Aligned columns, two spaces apart; columns in `right` are right-aligned (numbers)."""
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]

    def line(row):
        cells = [c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))]
        return "  ".join(cells).rstrip()

    return [line(header), line(["-" * w for w in widths]), *map(line, rows)]


def _redistribution_line(r: dict) -> str:
    path = " -> ".join(r["steps"]) or "(no steps)"
    return (
        f"      <- {r['from']} [slot {r['slot']}] {r['src']} -> {r['dst']}: {path}"
        f"  {human_time(r['cost_s'])}, {human_bytes(r['bytes'])} {r.get('dtype') or ''}"
    ).rstrip()


_JSON_ONLY = {"solution"}  # machine-readable extras (the solver's choices) stay out of the log


def format_log(report: dict) -> str:
    """The human-readable sharding log, rendered from `plan_report`'s dict."""
    shape, names = tuple(report["mesh_shape"]), report.get("mesh_names")
    pipeline = report.get("pipeline")
    if pipeline:
        shape, names = tuple(pipeline["mesh"]), pipeline["mesh_names"]
    roles = f" = {' x '.join(f'{name} {size}' for name, size in zip(names, shape))}" if names else ""
    out = [f"autoshard sharding log: mesh {shape}{roles}"]
    if pipeline:
        out += pipeline_lines(pipeline) + ["", f"== {STAGE_PLAN} =="]
    if names and "dp_replicate" in names and shape[names.index("dp_replicate")] > 1:
        out.append(
            f"dp_replicate (mesh dim {names.index('dp_replicate')}): parameters replicated over it, the batch "
            "split; its placements planned first as data parallelism, then the other dims (the ILP's "
            "bound below holds with those placements fixed)"
        )
    if "precision" in report:
        out.append(f"mixed precision: {report['precision']['summary']}")
    for key, value in report.items():  # run description etc. passed in as `extra`
        if key not in OWN_KEYS and key not in _JSON_ONLY:
            out.append(f"{key}: {value if isinstance(value, (str, int, float)) else json.dumps(value)}")

    out += _parameter_lines(report) + _node_lines(report) + _sink_lines(report) + _totals_lines(report)
    if report.get("memory") or report.get("memory_fit") or (report.get("recompute") or {}).get("blocks"):
        out += ["", "== memory per rank (dry run of the lowered program on fake tensors) =="]
        out += _memory_lines(report["memory"]) if report.get("memory") else []
        out += _fit_lines(report)
    if report.get("timings"):
        out += ["", "== timings =="]
        out += [f"{stage:<8} {seconds:8.2f} s" for stage, seconds in report["timings"].items()]
        out.append(f"{'total':<8} {sum(report['timings'].values()):8.2f} s")
    if report.get("compare"):
        out += ["", "== compare (modeled, per rank; ratio = autoshard / other) =="]
        out += compare_lines(report)
    if report.get("explain"):
        out += ["", f"== explain {report['explain']['fqn']} (each alternative re-solved with it pinned) =="]
        out += explain_lines(report["explain"])
    return "\n".join(out) + "\n"


def _parameter_lines(report: dict) -> list[str]:
    """The parameters and the other placeholders (inputs, buffers), one table each."""
    params = report["parameters"]
    out = ["", f"== parameters ({len(params)}) =="]
    out += _table(
        ["parameter (FQN)", "global shape", "dtype", "layout", "local shape", "bytes/rank"],
        [
            [
                p["fqn"],
                _shape(p["shape"]),
                p["dtype"],
                p["layout"],
                _shape(p["local_shape"]),
                human_bytes(p["bytes_per_rank"]),
            ]
            for p in params
        ],
        right={5},
    )

    if report.get("inputs"):
        out += ["", f"== inputs and buffers ({len(report['inputs'])}) =="]
        out += _table(
            ["name", "kind", "what", "global shape", "dtype", "layout", "local shape", "bytes/rank"],
            [
                [
                    i["name"],
                    i["kind"],
                    i["what"],
                    _shape(i["shape"]),
                    i["dtype"],
                    i["layout"],
                    _shape(i["local_shape"]),
                    human_bytes(i["bytes_per_rank"]),
                ]
                for i in report["inputs"]
            ],
            right={7},
        )
    return out


def _node_lines(report: dict) -> list[str]:
    """Every op with its strategy, each followed by the redistributions of its inputs."""
    nodes = report["nodes"]
    n_redist = sum(len(n["redistributions"]) for n in nodes)
    out = [
        "",
        f"== graph ({len(nodes)} ops, {n_redist} redistributions; '<-' = redistribution of an input, "
        f"with its collective path and modeled cost) ==",
    ]
    # Column widths capped so a few very long names (flash-attention backward) do not push every
    # line wide; those few cells just overflow.
    name_w = min(max((len(n["name"]) for n in nodes), default=0), 20)
    op_w = min(max((len(n["op"]) for n in nodes), default=0), 36)
    dtype_w = max((len(n.get("dtype") or "-") for n in nodes), default=0)
    mod_w = min(max((len(n["module"] or "<step>") for n in nodes), default=0), 40)
    for n in nodes:
        phase = "bw" if n["phase"] == "backward" else "fw"
        out.append(
            f"  {phase} {n['name']:<{name_w}}  {n['op']:<{op_w}}  {n.get('dtype') or '-':<{dtype_w}}  "
            f"{n['module'] or '<step>':<{mod_w}}  {n['strategy']}"
        )
        out += [_redistribution_line(r) for r in n["redistributions"]]
    return out


def _sink_lines(report: dict) -> list[str]:
    """The loss and gradients with the redistributions into their final layouts."""
    sinks = report["sinks"]
    out = [
        "",
        f"== sinks: loss and gradients ({len(sinks)}, "
        f"{sum(len(s['redistributions']) for s in sinks)} redistributions) ==",
    ]
    label_w = max((len(s["fqn"] or "loss") for s in sinks), default=0)
    for s in sinks:
        label = f"grad {s['fqn']:<{label_w}}" if s["kind"] == "grad" else f"loss {'':<{label_w}}"
        out.append(f"  {label}  {s['layout']}")
        out += [_redistribution_line(r) for r in s["redistributions"]]
    return out


def _totals_lines(report: dict) -> list[str]:
    """Modeled step, collectives per rank, parameters' device order and the ILP's figures."""
    t = report["totals"]
    out = ["", "== totals =="]
    k, held = t.get("micro_batches", 1), t.get("held_comm_s", 0.0)
    if k > 1:  # gradient accumulation: the figures below are one micro-batch's
        out.append(
            f"modeled step time per rank: {human_time(t['step_time_s'])} = {k} micro-batches x (compute "
            f"{human_time(t['compute_s'])} + comm {human_time(t['comm_s'] - held)}) + gradient all-reduces held "
            f"for the last {human_time(held)} + optimizer {human_time(t.get('optimizer_s', 0.0))} (no overlap)"
        )
    else:
        out.append(
            f"modeled step time per rank: {human_time(t['step_time_s'])} = compute {human_time(t['compute_s'])} "
            f"+ optimizer {human_time(t.get('optimizer_s', 0.0))} + comm {human_time(t['comm_s'])} (no overlap)"
        )
    if "overlapped_step_s" in t:
        out.append(
            f"as the program overlaps them (bucketed gathers and gradient reductions launched ahead, "
            f"compute on one stream, each mesh dim's collectives on their own): {human_time(t['overlapped_step_s'])}, "
            f"{human_time(t['step_time_s'] - t['overlapped_step_s'])} of comm hidden"
        )
    if report.get("host"):
        out.append(host_line(report["host"]))
    if report.get("experts"):
        out.append(experts_line(report["experts"]))
    kinds = sorted(set(t["count_by_collective"]) | set(t["bytes_by_collective"]))
    if kinds:
        out += [f"collectives per rank{' and micro-batch (held all-reduces: once a step)' if k > 1 else ''}:"]
        rows = [
            [k, str(t["count_by_collective"].get(k, 0)), human_bytes(t["bytes_by_collective"].get(k, 0.0))]
            for k in kinds
        ]
        rows.append(["total", str(sum(t["count_by_collective"].values())), human_bytes(t["comm_bytes"])])
        out += ["  " + line for line in _table(["kind", "count", "bytes"], rows, right={1, 2})]
        if "program_count_by_collective" in t:
            out.append(
                f"as the program runs them (a block's parameter gathers / gradient scatters bucketed): "
                f"{_counts(t['program_count_by_collective'])}"
            )
    else:
        out.append(f"collectives per rank: {no_collectives(report) or 'none'}")
    out.append(f"redistributions: {t['redistributions']}")
    out.append(
        f"parameters: {t['non_default_order_params']} / {t['params']} in non-default device order, "
        f"{human_bytes(t['param_bytes_per_rank'])} per rank"
    )
    out.append(_ilp_line(t["ilp"]))
    return out


def _signed_time(seconds: float) -> str:
    return ("-" if seconds < 0 else "+") + human_time(abs(seconds))


def explain_lines(ex: dict) -> list[str]:
    """The report's "explain" entry as text: the chosen layout, then each alternative with its
    step-time difference and the redistributions that change (before => after)."""

    def redist(r: dict | None) -> str:
        if r is None:
            return "none"
        return f"{r['src']} -> {r['dst']}: {' -> '.join(r['steps']) or '(no steps)'} ({human_time(r['cost_s'])})"

    names = ", ".join(ex["params"][:3]) + (f" (+{len(ex['params']) - 3} more)" if len(ex["params"]) > 3 else "")
    lines = [f"{names}: chosen {ex['layout']} (modeled step {human_time(ex['step_time_s'])} per rank)"]
    if ex["tied"]:
        tied = ", ".join(ex["tied"][:3]) + (", ..." if len(ex["tied"]) > 3 else "")
        lines.append(f"pinned with it (repeated blocks share choices): {len(ex['tied'])} more parameters ({tied})")
    how = ex["method"]
    if ex["infeasible"]:
        how += f"; {len(ex['infeasible'])} infeasible ({', '.join(ex['infeasible'])})"
    lines.append(f"next best layouts ({how}; {ex['seconds']:.1f} s):")
    if not ex["alternatives"]:
        lines.append("  none: no other layout is feasible")
    for i, a in enumerate(ex["alternatives"], 1):
        moved = f", {len(a['moved'])} other parameters change layout" if a["moved"] else ""
        status = "" if a["status"] == "optimal" else f" [{a['status']}]"
        lines.append(
            f"  {i}. {a['layout']}: step {human_time(a['step_time_s'])} ({_signed_time(a['delta_s'])}; "
            f"compute {human_time(a['compute_s'])}, comm {human_time(a['comm_s'])}){status}; "
            f"{a['changes_total']} redistributions change{moved}"
        )
        for c in a["changes"]:
            producer = f"{c['producer']} ({c['param']})" if c.get("param") else c["producer"]
            alike = f" (and {c['count'] - 1} edges alike)" if c["count"] > 1 else ""
            lines.append(
                f"       {producer} -> {c['consumer']} [slot {c['slot']}]{alike} {_signed_time(c['delta_s'])}"
                f" each: {redist(c['before'])}  =>  {redist(c['after'])}"
            )
        listed = sum(c["count"] for c in a["changes"])
        if a["changes_total"] > listed:
            lines.append(f"       ... and {a['changes_total'] - listed} more edges")
    return lines


def _ilp_line(ilp: dict) -> str:
    bound = ""
    if ilp.get("bound") is not None:  # plan.json files written before the bound was kept have none
        gap = (ilp["objective"] - ilp["bound"]) / ilp["objective"] if ilp["objective"] > 0 else 0.0
        bound = f"; proven lower bound {human_time(ilp['bound'])} (objective within {max(gap, 0.0):.3%})"
    return (
        f"ILP: {ilp['variables']:,} variables, {ilp['constraints']:,} constraints "
        f"({ilp['nodes']:,} nodes, {ilp['classes']:,} classes, {ilp['core']:,} core after presolve); "
        f"{ilp['backend']} {ilp['status']} in {ilp['solve_s']:.2f} s{bound}"
    )


# what the rest of a pipeline's report describes
STAGE_PLAN = (
    "layouts of the first stage's family: the whole model planned on the stage mesh, its blocks laid "
    "out as every stage of that family lays out its own (its step is the whole model's on that mesh)"
)


def summary_lines(report: dict) -> list[str]:
    """A compact console summary (at most 8 lines) of `plan_report`'s dict."""
    if report.get("pipeline"):
        return pipeline_summary(report["pipeline"])
    t = report["totals"]
    overlap = f", {human_time(t['overlapped_step_s'])} overlapped" if "overlapped_step_s" in t else ""
    lines = [
        f"mesh {tuple(report['mesh_shape'])}: modeled step {human_time(t['step_time_s'])} per rank "
        f"(compute {human_time(t['compute_s'])}, optimizer {human_time(t.get('optimizer_s', 0.0))}, "
        f"comm {human_time(t['comm_s'])}{overlap})"
    ]
    kinds = sorted(t["count_by_collective"])
    comm = (
        ", ".join(
            f"{k} {human_bytes(t['bytes_by_collective'].get(k, 0.0))} x{t['count_by_collective'][k]}" for k in kinds
        )
        or "none"
    )
    if "program_count_by_collective" in t:
        comm += f"; run as {_counts(t['program_count_by_collective'])}"
    lines.append(f"comm per rank: {no_collectives(report) or comm}")
    if report.get("experts"):
        lines.append(experts_line(report["experts"]))
    precision = report.get("precision")
    if precision and (precision["param_dtype"] != "param" or precision["reduce_dtype"] != "param"):
        lines.append(f"mixed precision: {precision['summary']}")
    lines.append(
        f"parameters: {t['non_default_order_params']} / {t['params']} in non-default device order, "
        f"{human_bytes(t['param_bytes_per_rank'])} per rank"
    )
    lines.append(_ilp_line(t["ilp"]))
    if report.get("memory"):
        lines.append(memory_line(report["memory"]))
    if (report.get("host") or {}).get("host_bound_ranks"):
        lines.append(host_line(report["host"]))
    lines += _fit_lines(report)
    if report.get("timings"):
        stages = ", ".join(f"{k} {v:.1f} s" for k, v in report["timings"].items())
        lines.append(f"stages: {stages} (total {sum(report['timings'].values()):.1f} s)")
    return lines


# the dry run's memory categories as the log, the page and its chart name them, in their order
MEMORY_PARTS = [
    ("params", "params"),
    ("grads", "grads"),
    ("optimizer", "AdamW states"),
    ("activations", "saved activations"),
    ("gathered_params", "gathered params"),
    ("transient", "transient"),
    ("buffers", "buffers"),
    ("inputs", "inputs"),
]


def _memory_lines(memory: dict) -> list[str]:
    rows = [
        [str(r["rank"]), r["phase"], human_bytes(r["peak_bytes"]), *(human_bytes(r[k]) for k, _ in MEMORY_PARTS)]
        for r in memory["ranks"]
    ]
    lines = _table(
        ["rank", "peak in", "peak", *(label for _, label in MEMORY_PARTS)],
        rows,
        right=set(range(2, 3 + len(MEMORY_PARTS))),
    )
    lines.append(
        "(live at the peak; AdamW keeps two fp32 states per parameter element; saved activations "
        "are what the forward hands to the backward)"
    )
    for r in memory["ranks"]:
        lines.append(
            f"rank {r['rank']}: forward peak {human_bytes(r['forward_peak_bytes'])}, backward peak "
            f"{human_bytes(r['backward_peak_bytes'])}, forward hands the backward {human_bytes(r['saved_bytes'])}"
        )
    lines.append(memory_line(memory))
    return lines


def _fit_lines(report: dict) -> list[str]:
    """The memory limit's verdict and which blocks recompute their forward or reshard after it."""
    lines = []
    if report.get("memory_fit"):
        lines.append(report["memory_fit"]["summary"])
    blocks = (report.get("recompute") or {}).get("blocks")
    if blocks:
        lines.append(
            f"activation checkpointing: the backward recomputes the forward of every block of "
            f"{', '.join(blocks)} ({report['recompute']['ops']} ops run twice)"
        )
    resharded = (report.get("reshard") or {}).get("blocks")
    if resharded:
        lines.append(
            f"reshard after forward: the backward gathers the parameters of every block of "
            f"{', '.join(resharded)} again ({report['reshard']['ops']} parameter casts and views run twice)"
        )
    return lines


def no_collectives(report: dict) -> str | None:
    """What a plan with no collective on a mesh of several ranks means, and what would change it
    (None: it has one): it is the cheapest modeled step, but no faster than one device."""
    t, shape = report["totals"], report["mesh_shape"]
    if t["count_by_collective"] or t.get("program_count_by_collective") or math.prod(shape) <= 1:
        return None
    return (
        f"none: every one of the {math.prod(shape)} ranks holds every parameter and computes the whole "
        "batch, as one device would (no speed-up); a larger batch, or a memory limit or parameter "
        "budget the whole model does not fit in (--memory-limit, --memory-budget), makes the plan split the work"
    )


def host_line(host: dict) -> str:
    """'host: rank 0 dispatches 10,867 ops a step, 228.2 ms at 21 us each on h200, over the device's
    modeled 161.1 ms: host-bound, a step takes 228.2 ms'."""
    worst = max(host["ranks"], key=lambda r: r["host_s"])
    line = (
        f"host: rank {worst['rank']} dispatches {worst['ops']:,} ops a step, {human_time(worst['host_s'])} at "
        f"{host['host_op_s'] * 1e6:.0f} us each on {host['device']}, "
    )
    if host["host_bound_ranks"]:
        return line + (
            f"over the device's modeled {human_time(host['device_step_s'])}: host-bound, a step takes "
            f"{human_time(host['step_s'])}"
        )
    return line + f"under the device's modeled {human_time(host['device_step_s'])}: the device bounds the step"


def memory_line(memory: dict) -> str:
    """'memory per rank: peak 30.8 GiB (rank 0, backward) of 79.2 GiB on h100 (39%): fits'."""
    worst = max(memory["ranks"], key=lambda r: r["peak_bytes"])
    line = f"memory per rank: peak {human_bytes(worst['peak_bytes'])} (rank {worst['rank']}, {worst['phase']})"
    capacity = memory.get("capacity_bytes")
    if capacity:
        share = worst["peak_bytes"] / capacity
        verdict = "fits" if memory["fits"] else f"DOES NOT FIT ({human_bytes(worst['peak_bytes'] - capacity)} over)"
        line += f" of {human_bytes(capacity)} on {memory['device']} ({share:.0%}): {verdict}"
    return line


def _counts(counts: dict[str, int]) -> str:
    return ", ".join(f"{k} x{n}" for k, n in counts.items()) or "none"


def compare_lines(report: dict) -> list[str]:
    """This plan beside each plan under `report['compare']`, with the ratio ours / theirs."""
    t = dict(report["totals"])
    if "memory" in report:
        t["peak_bytes"] = report["memory"]["peak_bytes"]
    rows_of = [
        ("step time", "step_time_s", human_time),
        ("overlapped", "overlapped_step_s", human_time),
        ("compute", "compute_s", human_time),
        ("comm", "comm_s", human_time),
        ("comm bytes", "comm_bytes", human_bytes),
        ("param bytes/rank", "param_bytes_per_rank", human_bytes),
        ("peak memory", "peak_bytes", human_bytes),
    ]
    lines = []
    for name, other in report.get("compare", {}).items():
        rows = []
        for label, key, fmt in rows_of:
            theirs = other.get(key)
            if key == "comm_bytes" and theirs is None:
                theirs = sum(other.get("bytes_by_collective", {}).values())
            if theirs is None or key not in t:
                continue
            ratio = f"{t[key] / theirs:.3f}" if theirs else "-"
            rows.append([label, fmt(t[key]), fmt(theirs), ratio])
        title = other.get("label", name)
        lines += _table(["", "autoshard", title, "ratio"], rows, right={1, 2, 3})
    return lines
