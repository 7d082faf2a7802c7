"""Modeled memory per rank, linear in the ILP's choices: what a budget on the peak can constrain.

At the peak of a step (in the backward) a rank holds its parameter shards and their AdamW states
for the whole step, the gradients the backward has produced (all of them, at worst: with
replicated parameters, the peak is at the end of the backward, where DDP's buckets hold every
gradient), and every value the forward hands to the backward. All are sums over ILP nodes of a
figure per choice: a parameter's local bytes, its gradient's (in the parameter's dtype) and two
fp32 states per local element; a handed-over value's local bytes in the layout its producer chose;
and, over ILP edges, a figure per pair of choices: the copy a redistribution into a handed-over
view makes (a sequence-parallel activation gathered for a matmul whose backward reads it). What
is not linear — the transient working set of the op running at the peak, a recomputed block's
activations while its backward runs — is measured by the dry run and carried as a constant
(`driver.fit` fits a plan under a limit that way; `MemoryFit` says how it did).
"""

from __future__ import annotations

import dataclasses
import math
import operator
from dataclasses import dataclass

from torch import fx

import autoshard_solver as solver
from autoshard import _torch_compat as tc
from autoshard.capture.trace import JointGraph
from autoshard.problem.build import ShardingProblem
from autoshard.problem.plan import Plan

GIB = 2**30

ADAMW_STATE_BYTES = 8  # AdamW keeps two fp32 states per parameter element
MODES = ("keep", "reshard", "recompute")  # what the backward gets from the forward, most kept first


@dataclass
class MemoryFit:
    """How a plan meets the memory limit (bytes per rank)."""

    limit: float
    plan: Plan
    modeled_bytes: float  # the linear part for the chosen plan
    peak_bytes: float | None  # its dry run's peak (None: not dry-run, the linear part was far below)
    constrained: bool  # the unconstrained optimum did not fit; the budget chose this plan
    mode: str  # one of MODES: what the plan's backward gets from its forward
    tried: list[tuple[str, float]] = dataclasses.field(default_factory=list)  # (mode, peak) of each dry run
    dry_runs: bool = True  # whether the fit could dry-run plans (False: the linear part alone was checked)

    @property
    def recompute(self) -> bool:
        return self.mode == "recompute"

    @property
    def reshard(self) -> bool:
        """Parameters gathered again in the backward (recomputation implies it)."""
        return self.mode != "keep"

    def summary(self) -> str:
        peak = (
            f"dry-run peak {size_text(self.peak_bytes)}"
            if self.peak_bytes is not None
            else "not dry-run (far below)"
            if self.dry_runs
            else "not dry-run (the modeled part alone checked)"
        )
        how = "planned under the budget" if self.constrained else "the plan as solved fits"
        return (
            f"memory limit {size_text(self.limit)} per rank: {how}; modeled {size_text(self.modeled_bytes)} "
            f"(params + grads + AdamW states + handed-over values), {peak}; "
            f"reshard after forward {'on' if self.reshard else 'off'}, "
            f"activation checkpointing {'on' if self.recompute else 'off'}"
        )


def size_text(n: float) -> str:
    """Bytes as GiB (from 1 GiB) or MiB, one decimal."""
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


@dataclass
class HandedOver:
    """What the forward hands to the backward: producing node -> which of its outputs, each
    storage once (`storages`), and the views on the way from a handed-over value to its storage
    (`views`, in the order met): where the edge into such a view redistributes, the view reads a
    copy of its own."""

    storages: dict[fx.Node, set[int]]
    views: dict[fx.Node, None]  # an ordered set: the budget's terms come out the same every run


def handed_over(graph: JointGraph, recomputed: frozenset[str]) -> HandedOver:
    """Forward values the backward reads (those of recomputed nodes replaced by what they are
    computed from). A view shares its base's storage, so a handed-over view counts as its base (q,
    k and v's projections read three views of one normalized activation: one storage) — except
    views of what a block computes from its parameters alone (a transposed weight), which read a
    redistributed copy of their own. Placeholders are not listed."""
    out = HandedOver({}, {})
    seen: set[fx.Node] = set()
    from_params = graph.from_params

    def storage(value: fx.Node) -> tuple[fx.Node, int] | None:
        while (
            value.op == "call_function"
            and value not in from_params
            and value.args
            and isinstance(value.args[0], fx.Node)
            and tc.shares_input_storage(value.target)
        ):
            out.views[value] = None
            value = value.args[0]
        if value.op != "call_function":
            return None  # a view of a placeholder: the parameter or input is counted already
        if value.target is operator.getitem:
            return value.args[0], value.args[1]
        return value, 0

    def reads(value: fx.Node) -> None:
        if value in seen or value.op != "call_function" or graph.is_backward(value):
            return
        seen.add(value)
        if value.name in recomputed:
            for arg in value.all_input_nodes:
                reads(arg)
            return
        where = storage(value)
        if where is not None:
            out.storages.setdefault(where[0], set()).add(where[1])

    for node in graph.nodes:
        if node.op == "call_function" and graph.is_backward(node):
            for arg in node.all_input_nodes:
                reads(arg)
    for grad in graph.grads.values():
        reads(grad)
    return out


@dataclass
class PeakTable:
    """Modeled bytes per rank at the step's peak, linear in the ILP's choices: per ILP node, of
    each of its choices; per (producer, consumer) edge, of each pair of choices (`solver.EdgeMemory`)."""

    nodes: dict[str, list[float]]
    edges: dict[tuple[str, str], list[list[float]]]


def peak_memory_table(sp: ShardingProblem) -> PeakTable:
    """Parameters with their gradients and AdamW states, and the values handed to the backward
    (under the problem's recomputation): each storage in the layout its producer chose, and the
    copy that a redistribution into a handed-over view makes (in the view's input layout; none
    where the producer's layout is already that one)."""
    ms = sp.mesh_shape
    elements: dict[tuple, int] = {}  # (layout, shape) -> local elements: repeated blocks ask alike
    rows: dict[tuple, list | None] = {}  # repeated blocks share strategies: one row (matrix) per distinct key

    def local(layout, shape: tuple[int, ...]) -> int:
        n = elements.get((layout, shape))
        if n is None:
            n = elements[(layout, shape)] = math.prod(layout.local_shape(shape, ms))
        return n

    def outputs_row(strategies, outputs: list[tuple[int, tuple[int, ...], int]]) -> list[float]:
        """Bytes of the given (output index, shape, bytes per element) in each strategy's layouts."""
        key = (tuple(map(id, strategies)), tuple(outputs))
        if key not in rows:
            rows[key] = [
                float(sum(local(s.outputs[i], shape) * size for i, shape, size in outputs if s.outputs[i] is not None))
                for s in strategies
            ]
        return rows[key]

    table = PeakTable({}, {})
    for fqn, node in sp.graph.params.items():
        val = node.meta["val"]
        trained = fqn in sp.graph.grads  # a frozen parameter: its value alone, no gradient or optimizer state
        per_element = val.dtype.itemsize * 2 + ADAMW_STATE_BYTES if trained else val.dtype.itemsize
        table.nodes[node.name] = outputs_row(sp.strategies[node.name], [(0, tuple(val.shape), per_element)])
    held = handed_over(sp.graph, sp.recomputed)
    for node, outputs in held.storages.items():
        if node.name not in sp.strategies:
            continue
        vals = node.meta["val"] if isinstance(node.meta["val"], (tuple, list)) else [node.meta["val"]]
        table.nodes[node.name] = outputs_row(
            sp.strategies[node.name],
            [(i, tuple(vals[i].shape), vals[i].dtype.itemsize) for i in sorted(outputs) if hasattr(vals[i], "shape")],
        )
    for view in held.views:
        if view.name not in sp.strategies or not sp.inputs[view.name]:
            continue
        producer = sp.inputs[view.name][0]
        srcs, dsts = sp.strategies[producer.node], sp.strategies[view.name]
        shape, dtype = sp.tensor_meta(producer)
        key = ("copy", tuple(map(id, srcs)), producer.output, tuple(map(id, dsts)), shape, dtype)
        if key not in rows:
            sizes = [0 if s.inputs[0] is None else local(s.inputs[0], shape) * dtype.itemsize for s in dsts]
            matrix = [
                [
                    0.0
                    if src.outputs[producer.output] is None or src.outputs[producer.output] == dst.inputs[0]
                    else float(size)
                    for dst, size in zip(dsts, sizes)
                ]
                for src in srcs
            ]
            rows[key] = matrix if any(map(any, matrix)) else None  # None: no pair makes a copy
        if rows[key] is not None:
            table.edges[(producer.node, view.name)] = rows[key]
    return table


def modeled_bytes(table: PeakTable, choice: dict[str, int]) -> float:
    """The table's bytes for one solution's choices."""
    nodes = sum(row[choice[name]] for name, row in table.nodes.items())
    return nodes + sum(m[choice[src]][choice[dst]] for (src, dst), m in table.edges.items())


def with_peak_budget(sp: ShardingProblem, table: PeakTable, limit: float) -> solver.Problem:
    """The problem with one more constraint: the table's bytes of the chosen layouts <= `limit`."""
    extended = sp.problem.copy()
    extended.memory_budget(
        list(table.nodes), limit, name="modeled peak bytes per rank", memory=table.nodes, edges=table.edges
    )
    return extended


def least_memory_problem(sp: ShardingProblem, table: PeakTable) -> solver.Problem:
    """The problem with the table's bytes (in GiB) as its objective in place of the step time, the
    same choices forbidden and the same constraints: its optimum is the least modeled memory any
    plan reaches, the lowest budget that is not infeasible. Repeated blocks keep sharing their
    rows and matrices (converted once each, as in the problem itself)."""
    problem = sp.problem
    out = solver.Problem(constraints=list(problem.constraints), regions=list(problem.regions))
    rows: dict[tuple, list[solver.Choice]] = {}
    for node in problem.nodes:
        row = table.nodes.get(node.name)
        key = (id(node.choices), None if row is None else tuple(row))
        if key not in rows:
            rows[key] = [
                solver.Choice(c.label, math.inf if c.cost == math.inf else (row[i] if row else 0.0) / GIB)
                for i, c in enumerate(node.choices)
            ]
        out.add_node(node.name, rows[key])
    matrices: dict[tuple[int, int], list[list[float]]] = {}

    def in_gib(cost: list[list[float]] | None, memory: list[list[float]] | None) -> list:
        """The edge's memory in GiB (none: 0) where its cost allows the pair, else inf."""
        key = (id(cost), id(memory))
        if key not in matrices:
            rows = cost if cost is not None else memory
            assert rows is not None
            matrices[key] = [
                [
                    math.inf if cost is not None and cost[i][j] == math.inf else (memory[i][j] / GIB if memory else 0.0)
                    for j in range(len(rows[0]))
                ]
                for i in range(len(rows))
            ]
        return matrices[key]

    seen = set()
    for edge in problem.edges:
        seen.add((edge.src, edge.dst))
        out.add_edge(edge.src, edge.dst, in_gib(edge.cost, table.edges.get((edge.src, edge.dst))))
    for (src, dst), memory in table.edges.items():
        if (src, dst) not in seen:
            out.add_edge(src, dst, in_gib(None, memory))
    return out
