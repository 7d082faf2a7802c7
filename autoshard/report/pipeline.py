"""A planned pipeline as report data (plan.json's "pipeline"), as log lines and as a page section.

The entry says what the search chose (schedule, micro-batches, the blocks of each stage and the
pp rank that runs it, each stage's layout family and modeled memory), the modeled step with its
bubble, the runners-up, and torchtitan's even split priced the same way.
"""

from __future__ import annotations

import math
from html import escape
from typing import Any

from autoshard.pipeline.search import Pipeline
from autoshard.report.units import human_bytes, human_time


def pipeline_figures(p: Pipeline) -> dict[str, Any]:
    """One pipeline's schedule, cut and modeled figures."""
    return {
        "schedule": p.schedule.name,
        "torch_schedule": p.schedule.torch_class,
        "virtual_stages": p.schedule.virtual,
        "micro_batches": p.micro_batches,
        "rows_per_micro_batch": p.rows,
        "blocks_per_stage": p.blocks,
        "step_time_s": p.step_time_s,
        "bubble_s": p.bubble_s,
        "once_s": p.once_s,
        "peak_bytes": p.peak_bytes,
    }


def pipeline_entry(result: Any, tokens_per_step: int | None = None, memory: Any = None) -> dict[str, Any]:
    """plan.json's "pipeline" for a `driver.pipeline.PipelinePlan`; `tokens_per_step` adds the
    modeled tokens per second per device, `memory` (`driver.stage_memory.StageMemory`) each
    stage's and each pp rank's dry-run memory."""
    best, config = result.best, result.config
    names = list(config.mesh_names)
    entry: dict[str, Any] = {
        "mesh": list(config.mesh),
        "mesh_names": names,
        "stage_mesh": list(config.mesh[1:]),
        "ranks": best.ranks,
        **pipeline_figures(best),
        "rank_bytes": [best.rank_bytes(r) for r in range(best.ranks)],
        "stages": [
            {
                "chunk": s.chunk,
                "rank": s.rank,
                "blocks": _blocks_text(s.first_block, s.n_blocks),
                "n_blocks": s.n_blocks,
                "before_blocks": s.before,
                "after_blocks": s.after,
                "family": s.family,
                "micro_s": s.micro_s,
                "step_s": s.step_s,
                "state_bytes": s.state_bytes,
                "activation_bytes": s.act_bytes,
                "in_flight": s.in_flight,
                "memory_bytes": s.memory_bytes,
                "send_bytes": s.send_bytes,
            }
            for s in best.stages
        ],
        "runners_up": [pipeline_figures(p) for p in result.others],
        "even_split": None if result.even is None else pipeline_figures(result.even),
        "families": result.family_steps(),
        "memory_checked": "modeled (parameters, gradients, AdamW states, in-flight activations)"
        + ("" if memory is not None else "; stages not dry-run"),
    }
    if tokens_per_step:
        entry["tokens_per_s_per_device"] = tokens_per_step / best.step_time_s / math.prod(config.mesh)
    if memory is not None:
        for stage, run in zip(entry["stages"], memory.stages):
            stage["dry_run_bytes"] = run.estimate.peak_bytes  # one micro-batch
            stage["dry_run_held_bytes"] = run.held_bytes
        entry["rank_dry_run_bytes"] = [memory.rank_bytes(r) for r in range(best.ranks)]
        entry["memory_limit_bytes"] = config.memory_limit_bytes(config.device_profile)
        entry["dry_run_peak_bytes"] = memory.peak_bytes
        entry["dry_run_seconds"] = memory.seconds
        entry["dry_run_programs"] = memory.plans
    return entry


def _blocks_text(first: int, n: int) -> str:
    return f"{first}" if n == 1 else f"{first}-{first + n - 1}"


def _where(stage: dict) -> str:
    parts = [
        "before" if stage["before_blocks"] else "",
        f"blocks {stage['blocks']}",
        "after" if stage["after_blocks"] else "",
    ]
    return " + ".join(p for p in parts if p)


def _one_line(p: dict) -> str:
    v = f" x{p['virtual_stages']}" if p["virtual_stages"] > 1 else ""
    return (
        f"{p['schedule']}{v}, {p['micro_batches']} micro-batches: step {human_time(p['step_time_s'])} "
        f"(bubble {human_time(p['bubble_s'])}), peak {human_bytes(p['peak_bytes'])}, "
        f"blocks per stage {p['blocks_per_stage']}"
    )


def pipeline_summary(entry: dict) -> list[str]:
    """The console's lines: what was chosen, its step, and how it compares."""
    shape = " x ".join(f"{n} {s}" for n, s in zip(entry["mesh_names"], entry["mesh"]))
    v = f" with {entry['virtual_stages']} stages per rank" if entry["virtual_stages"] > 1 else ""
    lines = [
        f"pipeline over {shape}: {entry['schedule']}{v} (torch {entry['torch_schedule']}), "
        f"{entry['micro_batches']} micro-batches of {entry['rows_per_micro_batch']} rows",
        f"modeled step {human_time(entry['step_time_s'])} (bubble {human_time(entry['bubble_s'])}, "
        f"once a step {human_time(entry['once_s'])}), peak {human_bytes(entry['peak_bytes'])} per rank "
        f"({entry['memory_checked']})",
        f"blocks per stage: {entry['blocks_per_stage']}",
    ]
    if "tokens_per_s_per_device" in entry:
        lines[1] += f"; {entry['tokens_per_s_per_device']:,.1f} tokens/s per device"
    if "dry_run_peak_bytes" in entry:
        per_rank = ", ".join(human_bytes(b) for b in entry["rank_dry_run_bytes"])
        lines.insert(
            2,
            f"dry-run peak {human_bytes(entry['dry_run_peak_bytes'])} per rank (pp ranks: {per_rank}; each distinct "
            f"stage's program run on one micro-batch, {entry['dry_run_programs']} programs, plus the saved values of "
            "its other micro-batches in flight)",
        )
        limit = entry.get("memory_limit_bytes")
        over = [r for r, b in enumerate(entry["rank_dry_run_bytes"]) if limit is not None and b > limit]
        if over:
            lines.insert(3, f"warning: the dry runs exceed the memory limit {human_bytes(limit)} on pp ranks {over}")
    even = entry.get("even_split")
    if even is not None:
        ratio = even["step_time_s"] / entry["step_time_s"]
        lines.append(
            f"even split (torchtitan's, same schedule): blocks {even['blocks_per_stage']}, step "
            f"{human_time(even['step_time_s'])} ({ratio:.3f}x the chosen cut's)"
        )
    elif "even_split" in entry:
        lines.append("even split (torchtitan's, same schedule): does not fit the memory limit")
    flat = entry.get("without_pp")
    if flat is not None:
        peak = "" if flat["peak_bytes"] is None else f", peak {human_bytes(flat['peak_bytes'])} dry-run"
        lines.append(
            f"without pp, mesh {tuple(flat['mesh'])} ({','.join(flat['mesh_names'])}): modeled step "
            f"{human_time(flat['step_time_s'])}{peak}, {flat['tokens_per_s_per_device']:,.1f} tokens/s per device; "
            f"the pipeline's step is {entry['step_time_s'] / flat['step_time_s']:.3f}x its"
        )
    return lines


COLUMNS = ("stage", "pp rank", "holds", "layout family", "per micro-batch", "in flight", "memory", "dry run, held")


def _row(s: dict) -> tuple[str, ...]:
    """A stage's cells, in `COLUMNS` order."""
    return (
        str(s["chunk"]),
        str(s["rank"]),
        _where(s),
        s["family"],
        human_time(s["micro_s"]),
        str(s["in_flight"]),
        human_bytes(s["memory_bytes"]),
        human_bytes(s["dry_run_held_bytes"]) if "dry_run_held_bytes" in s else "-",
    )


def pipeline_explain_lines(entry: dict) -> list[str]:
    """`plan --explain` on a pp mesh: the chosen pipeline, then the runners-up and torchtitan's even
    split, each with its modeled step and how much slower than the chosen one it is."""
    chosen = entry["step_time_s"]
    lines = [f"  chosen: {_one_line(entry)}"]
    for p in entry["runners_up"]:
        lines.append(f"  {_one_line(p)} ({p['step_time_s'] / chosen:.3f}x)")
    even = entry.get("even_split")
    if even is not None:
        lines.append(f"  even split: {_one_line(even)} ({even['step_time_s'] / chosen:.3f}x)")
    return lines


def pipeline_lines(entry: dict) -> list[str]:
    """The log's section: the summary, one row per stage, the runners-up."""
    out = ["", "== pipeline (modeled, per rank of a stage) =="] + pipeline_summary(entry) + [""]
    rows = [COLUMNS] + [_row(s) for s in entry["stages"]]
    widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS))]
    left = {2, 3}  # text columns; the others are numbers
    for row in rows:
        cells = [cell.ljust(w) if i in left else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths))]
        out.append("  ".join(cells).rstrip())
    if entry["runners_up"]:
        out += ["", "runners-up (each schedule and micro-batch count at its best cut):"]
        out += [f"  {_one_line(p)}" for p in entry["runners_up"]]
    families = ", ".join(f"{name} {human_time(s)}" for name, s in entry["families"].items())
    out += ["", f"layout families (the whole model's step on the stage mesh): {families}"]
    return out


def pipeline_section(entry: dict) -> str:
    """report.html's pipeline section."""
    head = "<tr>" + "".join(f"<th>{escape(c)}</th>" for c in COLUMNS) + "</tr>"
    rows = "".join("<tr>" + "".join(f"<td>{escape(c)}</td>" for c in _row(s)) + "</tr>" for s in entry["stages"])
    summary = "".join(f"<p>{escape(line)}</p>" for line in pipeline_summary(entry))
    others = "".join(f"<li>{escape(_one_line(p))}</li>" for p in entry["runners_up"])
    return (
        f'<section id="pipeline"><h2>Pipeline</h2>{summary}<table>{head}{rows}</table>'
        f"{'<h3>Runners-up</h3><ul>' + others + '</ul>' if others else ''}</section>"
    )
