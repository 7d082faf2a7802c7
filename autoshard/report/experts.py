"""What a plan does with its mixture-of-experts layers: per routed-experts op, how each mesh dim
splits it, the dims it runs expert parallel over and the bytes its all-to-alls send (priced
with balanced routing, twice for a forward the backward recomputes); and one line saying it for
the log, the console and the page. Each expert-parallel run reads its split sizes on the host
once: a step a CUDA graph could capture needs fixed capacities instead."""

from __future__ import annotations

import math

from autoshard.layout import Layout
from autoshard.pricing.experts import exchange_bytes
from autoshard.pricing.ring import wire_bytes
from autoshard.problem.plan import Plan
from autoshard.report.units import human_bytes
from autoshard.strategies.call import OpCall
from autoshard.strategies.rules.experts import EXPERTS, SLOTS, split_of

# how one mesh dim splits the op, read off (tokens, w1) placements
_KINDS = {
    ("R", "R"): "replicated",
    ("S", "R"): "data parallel",
    ("R", "S1"): "tensor parallel",
    ("R", "S0"): "experts split, tokens replicated",
    ("S", "S0"): "expert parallel",
}


def _kind(tokens: Layout, w1: Layout, m: int) -> str:
    t, w = tokens.placements[m], w1.placements[m]
    return _KINDS.get((t.kind, w.kind + (str(w.dim) if w.kind == "S" else "")), "other")


def experts_entry(plan: Plan, mesh_names: list[str] | None = None) -> dict | None:
    """The plan's routed-experts ops, or None when the model has none."""
    ops = []
    names = mesh_names or [str(m) for m in range(len(plan.mesh_shape))]
    for node in plan.graph.nodes:
        if node.op != "call_function" or node.target not in SLOTS:
            continue
        inputs = plan.strategies[node.name].inputs
        call = OpCall(node, plan.mesh_shape)
        split = split_of(node.target, inputs, call.in_vals, plan.mesh_shape)
        tokens, w1 = (inputs[i] for i in SLOTS[node.target])
        sent = exchange_bytes(call, inputs)
        runs = 2 if node.name in plan.recomputed else 1  # the backward runs a recomputed forward again
        ops.append({
            "node": node.name,
            "pass": "forward" if node.target is EXPERTS else "backward",
            "module": plan.graph.module_path(node),
            "by_dim": [_kind(tokens, w1, m) for m in range(len(plan.mesh_shape))],
            "parallel_dims": [names[m] for m in split.parallel_dims],
            "runs": runs,
            "all_to_all_bytes": runs * math.fsum(wire_bytes("all_to_all", split.group_size, b) for b in sent),
            "all_to_alls": runs * len(sent),
        })  # fmt: skip
    if not ops:
        return None
    parallel = [op for op in ops if op["parallel_dims"]]
    return {
        "ops": ops,
        "layers": len({op["module"] for op in ops}),
        "parallel_layers": len({op["module"] for op in parallel}),
        "all_to_all_bytes": math.fsum(op["all_to_all_bytes"] for op in ops),
        "host_reads": sum(op["runs"] for op in parallel),
    }


def experts_line(entry: dict) -> str:
    """One line: how many MoE layers run expert parallel, over which dims, and what they send."""
    ops = entry["ops"]
    if not entry["parallel_layers"]:
        kinds = sorted({", ".join(op["by_dim"]) for op in ops})
        return f"experts: {entry['layers']} MoE layers, none expert parallel ({'; '.join(kinds)} per mesh dim)"
    groups = sorted({"+".join(op["parallel_dims"]) for op in ops if op["parallel_dims"]})
    return (
        f"experts: {entry['parallel_layers']} of {entry['layers']} MoE layers expert parallel over "
        f"mesh dim {', '.join(groups)}; all-to-all {human_bytes(entry['all_to_all_bytes'])} per rank a step "
        f"(priced in the ops' time, balanced routing), {entry['host_reads']} host reads of the split sizes"
    )
