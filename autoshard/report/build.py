"""The report dict: what a `Plan` chose, in terms a person can check, as plain data (lists, str
keys, numbers: `json.loads(json.dumps(report)) == report`). plan.json is this dict; the sharding
log (`report.text`) and report.html (`report.html`) are rendered from it, so the three can never
disagree.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict
from typing import Any, Sequence

import torch
from torch import fx

from autoshard.capture.precision import dtype_name
from autoshard.layout import Layout
from autoshard.pricing.planner import RedistributePlan
from autoshard.pricing.ring import COLLECTIVE_KINDS
from autoshard.problem.explain import Explanation
from autoshard.problem.memory import MemoryFit
from autoshard.problem.plan import Plan, Redistribution, Sink
from autoshard.profiles.device import DeviceProfile
from autoshard.program.lower import Program
from autoshard.report.experts import experts_entry
from autoshard.runtime.dryrun import DryRunResult

# Top-level keys `plan_report` produces; anything else came in through `extra`.
OWN_KEYS = (
    "mesh_shape",
    "mesh_names",
    "precision",
    "recompute",
    "reshard",
    "memory_fit",
    "parameters",
    "inputs",
    "nodes",
    "sinks",
    "totals",
    "memory",
    "host",
    "timings",
    "compare",
    "explain",
    "pipeline",
    "experts",
)
EXPLAIN_CHANGES = 10  # redistribution changes listed per alternative (the rest counted)


def plan_report(
    plan: Plan,
    *,
    program: Program | None = None,
    dry_run: DryRunResult | None = None,
    device: DeviceProfile | None = None,
    timings: dict[str, float] | None = None,
    explanation: Explanation | None = None,
    memory_fit: MemoryFit | None = None,
    mesh_names: Sequence[str] | None = None,
    extra: dict | None = None,
) -> dict:
    """Everything the plan chose, as JSON-ready data: parameters, non-parameter inputs, every
    op with its strategy and incoming redistributions, sinks (loss, gradients), and totals; with
    the `program` lowered from it, also the collectives that program runs; with its `dry_run`,
    peak memory per rank beside the `device`'s capacity; with an `explanation` (AutoShard.explain),
    a parameter's next best layouts under "explain"; `mesh_names` label the mesh dims."""
    graph = plan.graph
    dtypes = {node.name: _dtype(node) for node in graph.nodes}
    text = _Texts()
    by_consumer: dict[str, list[dict]] = {}
    for r in plan.redistributions:
        by_consumer.setdefault(r.consumer, []).append(_redistribution_entry(r, dtypes.get(r.producer), text))
    parameters = _parameter_entries(plan)
    precision = graph.precision
    report: dict[str, Any] = {
        "mesh_shape": list(plan.mesh_shape),
        **({"mesh_names": list(mesh_names)} if mesh_names else {}),
        "precision": {
            "param_dtype": dtype_name(precision.param_dtype),
            "reduce_dtype": dtype_name(precision.reduce_dtype or precision.param_dtype),
            "output_dtype": dtype_name(precision.output_dtype),
            "summary": precision.describe(),
        },
        "recompute": {
            "blocks": list(plan.recompute_blocks),
            "ops": len(plan.recomputed) if plan.recompute_blocks else 0,
        },
        "reshard": {"blocks": list(plan.reshard_blocks), "ops": len(plan.recomputed) if plan.reshard_blocks else 0},
        "parameters": parameters,
        "inputs": _input_entries(plan),
        "nodes": _node_entries(plan, dtypes, by_consumer, text),
        "sinks": [_sink_entry(sink, by_consumer) for sink in [plan.loss_sink, *plan.grad_sinks.values()]],
        "totals": _totals(plan, parameters),
    }
    if program is not None:  # what the program runs, buckets counted once
        report["totals"]["program_count_by_collective"] = dict(sorted(program.comm.total_count().items()))
    step = program.step if program is not None else dry_run.step if dry_run is not None else None
    if program is not None and program.held is not None:  # one step is micro_batches of the program
        report["totals"]["overlapped_step_s"] = program.step_s(plan.micro_batches)
        names = program.grad_names
        report["accumulation"] = {
            "micro_batches": plan.micro_batches,
            "held_params": [names[i] for i in program.held.params],
            "held_reductions": len(program.held.accumulators),
            "held_comm_s": plan.held_comm_s,
        }
    elif step is not None:  # the program's schedule: bucketed collectives overlap compute
        report["totals"]["overlapped_step_s"] = step.overlapped_s
    if dry_run is not None:
        report["memory"] = memory_entry(dry_run, device)
        device_step = report["totals"].get("overlapped_step_s", plan.step_time_s)
        host = host_entry(dry_run, device, device_step, plan.micro_batches)
        if host is not None:
            report["host"] = host
    experts = experts_entry(plan, list(mesh_names) if mesh_names else None)
    if experts is not None:
        report["experts"] = experts
    if memory_fit is not None:
        report["memory_fit"] = _memory_fit_entry(memory_fit)
    if timings:
        report["timings"] = {k: float(v) for k, v in timings.items()}
    if explanation is not None:
        report["explain"] = explain_entry(explanation)
    report.update(extra or {})
    return report


def _parameter_entries(plan: Plan) -> list[dict]:
    out = []
    for fqn, node in plan.graph.params.items():
        layout = plan.param_layouts[fqn]
        out.append(
            {
                "fqn": fqn,
                **_tensor_entry(node, layout, plan.mesh_shape),
                "default_order": layout.is_default_order,
                "frozen": fqn not in plan.graph.grads,
            }
        )
    return out


def _input_entries(plan: Plan) -> list[dict]:
    """The graph's other placeholders: user inputs, buffers and the loss's seed gradient."""
    graph = plan.graph
    user_index = {node: i for i, node in enumerate(graph.inputs)}
    buffer_fqn = {node: fqn for fqn, node in graph.buffers.items()}
    out = []
    for node in graph.nodes:
        if node.op != "placeholder" or node in graph.param_names or node.name not in plan.strategies:
            continue
        if node in user_index:
            kind, what = "input", str(user_index[node])
        elif node in buffer_fqn:
            kind, what = "buffer", buffer_fqn[node]
        else:
            kind, what = "tangent", "seed gradient of the loss"
        out.append(
            {
                "name": node.name,
                "kind": kind,
                "what": what,
                **_tensor_entry(node, plan.strategies[node.name].outputs[0], plan.mesh_shape),
            }
        )
    return out


class _Texts(dict):
    """str() of each distinct layout, strategy or step sequence, made once: a 70B plan names a few
    hundred of them across ~60,000 entries."""

    def __missing__(self, key: Any) -> str:
        value = self[key] = (
            " ".join(f"{s.kind}[{','.join(map(str, s.mesh_dims))}]" for s in key)
            if isinstance(key, tuple)
            else str(key)
        )
        return value


def _node_entries(
    plan: Plan, dtypes: dict[str, str | None], by_consumer: dict[str, list[dict]], text: _Texts
) -> list[dict]:
    out = []
    for node in plan.graph.nodes:
        if node.op != "call_function" or node.name not in plan.strategies:
            continue  # getitem has no strategy: it aliases its parent's output
        out.append(
            {
                "name": node.name,
                "op": str(node.target),
                "module": plan.module_paths.get(node.name, ""),
                "phase": "backward" if plan.graph.is_backward(node) else "forward",
                "dtype": dtypes[node.name],
                "strategy": text[plan.strategies[node.name]],
                "compute_s": plan.node_compute_s[node.name],
                "redistributions": by_consumer.get(node.name, []),
            }
        )
    return out


def _totals(plan: Plan, parameters: list[dict]) -> dict:
    stats = plan.solution.stats
    return {
        **modeled_figures(plan),
        "redistributions": len(plan.redistributions),
        "params": len(parameters),
        "non_default_order_params": sum(not p["default_order"] for p in parameters),
        "param_bytes_per_rank": sum(p["bytes_per_rank"] for p in parameters),
        "ilp": {
            "backend": stats.backend,
            "status": plan.solution.status,
            "objective": plan.solution.objective,
            "bound": stats.bound,
            "variables": stats.variables,
            "constraints": stats.constraints,
            "nodes": stats.nodes,
            "classes": stats.classes,
            "core": stats.core,
            "solve_s": stats.solve_s,
        },
    }


def _memory_fit_entry(fit: MemoryFit) -> dict:
    return {
        "limit_bytes": fit.limit,
        "modeled_bytes": fit.modeled_bytes,
        "peak_bytes": fit.peak_bytes,
        "constrained": fit.constrained,
        "recompute": fit.recompute,
        "reshard": fit.reshard,
        "tried": [{"mode": mode, "peak_bytes": peak} for mode, peak in fit.tried],
        "summary": fit.summary(),
    }


def memory_entry(result: DryRunResult, device: DeviceProfile | None) -> dict:
    """Peak memory per checked rank with its breakdown (bytes), and the device's capacity."""
    capacity = device.memory_bytes if device is not None else None
    return {
        "source": "dry run: each checked rank's program on fake tensors (ranks not listed hold the same shapes)",
        "seconds": result.seconds,
        "device": device.name if device is not None else None,
        "capacity_bytes": capacity,
        "peak_bytes": result.peak_bytes,
        "fits": None if capacity is None else result.peak_bytes <= capacity,
        "ranks": [{**asdict(m), "peak_bytes": m.peak_bytes} for m in result.ranks.values()],
    }


def host_entry(
    result: DryRunResult, device: DeviceProfile | None, device_step_s: float, micro_batches: int
) -> dict | None:
    """The host's share of a step where it runs ahead of the device (`device.host_op_s`: a GPU):
    each checked rank's dispatched ops (the dry run's count, times the micro-batches) at the
    device's host time per op, beside the modeled device step; the step is the longer of the two.
    None where host and device are one (a CPU: dispatch is already in each op's compute)."""
    if device is None or device.host_op_s is None:
        return None
    ranks = [
        {"rank": m.rank, "ops": m.ops * micro_batches, "host_s": m.ops * micro_batches * device.host_op_s}
        for m in result.ranks.values()
    ]
    worst = max(ranks, key=lambda r: r["host_s"])
    return {
        "device": device.name,
        "host_op_s": device.host_op_s,
        "ranks": ranks,
        "host_s": worst["host_s"],
        "device_step_s": device_step_s,
        "step_s": max(device_step_s, worst["host_s"]),
        "host_bound_ranks": [r["rank"] for r in ranks if r["host_s"] > device_step_s],
    }


def modeled_figures(plan: Plan) -> dict[str, Any]:
    """A plan's modeled step time and communication, as the report (and comparisons) show them."""
    return {
        "step_time_s": plan.step_time_s,
        "micro_batches": plan.micro_batches,
        "held_comm_s": plan.held_comm_s,
        "compute_s": plan.compute_s,
        "optimizer_s": plan.optimizer_s,
        "comm_s": plan.comm_s,
        "comm_bytes": plan.comm_bytes,
        "bytes_by_collective": dict(sorted(plan.bytes_by_collective.items())),
        "count_by_collective": dict(sorted(plan.count_by_collective.items())),
    }


def explain_entry(ex: Explanation, max_changes: int = EXPLAIN_CHANGES) -> dict:
    """An Explanation as report data; each alternative lists its `max_changes` largest
    redistribution changes (before -> after on one edge, `count` edges alike: one per block copy)
    and counts the edges changed in all (`changes_total`)."""

    def plan_entry(p: RedistributePlan | None) -> dict | None:
        if p is None:
            return None
        return {
            "src": str(p.src),
            "dst": str(p.dst),
            "steps": [f"{s.kind}[{','.join(map(str, s.mesh_dims))}]" for s in p.steps],
            "cost_s": p.cost_s,
        }

    def grouped(changes) -> list[dict]:
        # the same change on every copy of a repeated block is one entry, with a count
        groups: dict = {}
        for c in changes:
            before, after = plan_entry(c.before), plan_entry(c.after)
            key = json.dumps([before, after], sort_keys=True)
            if key in groups:
                groups[key]["count"] += 1
            else:
                groups[key] = {
                    "producer": c.producer,
                    "consumer": c.consumer,
                    "slot": c.slot,
                    "count": 1,
                    "param": ex.param_nodes.get(c.producer, ""),
                    "delta_s": c.delta_s,
                    "before": before,
                    "after": after,
                }
        return sorted(groups.values(), key=lambda g: -abs(g["delta_s"]) * g["count"])

    entry = {
        "fqn": ex.fqn,
        "params": ex.params,
        "layout": str(ex.layout),
        "step_time_s": ex.step_time_s,
        "tied": ex.tied,
        "candidates": ex.candidates,
        "solved": ex.solved,
        "infeasible": [str(lay) for lay in ex.infeasible],
        "skipped": [str(lay) for lay in ex.skipped],
        "method": ex.method,
        "seconds": ex.seconds,
        "alternatives": [
            {
                "layout": str(a.layout),
                "step_time_s": a.step_time_s,
                "delta_s": a.delta_s,
                "compute_s": a.compute_s,
                "comm_s": a.comm_s,
                "status": a.status,
                "solve_s": a.solve_s,
                "moved": {fqn: [str(b), str(c)] for fqn, (b, c) in a.moved.items()},
                "changes_total": len(a.changes),
                "changes": grouped(a.changes)[:max_changes],
            }
            for a in ex.alternatives
        ],
    }
    return entry


def _tensor_entry(node: fx.Node, layout: Layout, mesh_shape: tuple[int, ...]) -> dict:
    val = node.meta["val"]
    shape = tuple(val.shape)
    local = layout.local_shape(shape, mesh_shape)
    return {
        "shape": list(shape),
        "dtype": dtype_name(val.dtype),
        "layout": str(layout),
        "local_shape": list(local),
        "bytes_per_rank": math.prod(local) * val.dtype.itemsize,
    }


def _dtype(node: fx.Node) -> str | None:
    """Short dtype name of a node's value (several outputs: joined by ','); None for non-tensors."""
    val = node.meta.get("val")
    vals = val if isinstance(val, (tuple, list)) else [val]
    names = [dtype_name(v.dtype) for v in vals if isinstance(v, torch.Tensor)]
    return ",".join(dict.fromkeys(names)) or None


def _redistribution_entry(r: Redistribution, dtype: str | None, text: _Texts) -> dict:
    plan = r.plan
    return {
        "from": r.producer,
        "slot": r.slot,
        "dtype": dtype,
        "src": text[plan.src],
        "dst": text[plan.dst],
        "steps": text[plan.steps].split(" ") if plan.steps else [],
        "cost_s": r.cost_s,  # the plan's, a bucketed first step's launch shared with its block
        # wire-level bytes of the collectives only, as in the plan's bytes_by_collective
        "bytes": float(sum(s.bytes for s in plan.steps if s.kind in COLLECTIVE_KINDS)),
        "shape": list(plan.shape),
    }


def _sink_entry(sink: Sink, by_consumer: dict) -> dict:
    return {
        "name": sink.name,
        "kind": sink.kind,
        "fqn": sink.fqn,
        "layout": str(sink.layout),
        "redistributions": by_consumer.get(sink.name, []),
    }
