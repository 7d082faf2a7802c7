"""Modeled memory per rank, linear in the ILP's choices: what a budget on the peak can constrain.

At the peak of a step (in the backward) a rank holds its parameter shards and their AdamW states
for the whole step, the gradients the backward has produced (all of them, at worst: with
replicated parameters, the peak is at the end of the backward, where DDP's buckets hold every
gradient), and every value the forward hands to the backward. All are sums over ILP nodes of a
figure per choice: a parameter's local bytes, its gradient's (in the parameter's dtype) and two
fp32 states per local element; a handed-over value's local bytes in the layout its producer chose;
and, over ILP edges, a figure per pair of choices: the copy a redistribution into a handed-over
view makes (a sequence-parallel activation gathered for a matmul whose backward reads it). What is not linear —
the transient working set of the op running at the peak, a recomputed block's activations while
its backward runs — is measured by the dry run and carried as a constant (`driver.fit` fits a plan
under a limit that way; `MemoryFit` says how it did).
"""

from __future__ import annotations

import dataclasses
import math
import operator
from dataclasses import dataclass

import solver
from torch import fx

from autoshard import _torch_compat as tc
from autoshard.capture.trace import JointGraph
from autoshard.problem.build import ShardingProblem
from autoshard.problem.plan import Plan

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
        peak = (f"dry-run peak {size_text(self.peak_bytes)}" if self.peak_bytes is not None else
                "not dry-run (far below)" if self.dry_runs else "not dry-run (the modeled part alone checked)")
        how = "planned under the budget" if self.constrained else "the plan as solved fits"
        return (f"memory limit {size_text(self.limit)} per rank: {how}; modeled {size_text(self.modeled_bytes)} "
                f"(params + grads + AdamW states + handed-over values), {peak}; "
                f"reshard after forward {'on' if self.reshard else 'off'}, "
                f"activation checkpointing {'on' if self.recompute else 'off'}")


def size_text(n: float) -> str:
    """Bytes as GiB (from 1 GiB) or MiB, one decimal."""
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"



@dataclass
class HandedOver:
    """What the forward hands to the backward: producing node -> which of its outputs, each
    storage once (`storages`), and the views on the way from a handed-over value to its storage
    (`views`): where the edge into such a view redistributes, the view reads a copy of its own."""

    storages: dict[fx.Node, set[int]]
    views: set[fx.Node]


def handed_over(graph: JointGraph, recomputed: frozenset[str]) -> HandedOver:
    """Forward values the backward reads (those of recomputed nodes replaced by what they are
    computed from). A view shares its base's storage, so a handed-over view counts as its base (q,
    k and v's projections read three views of one normalized activation: one storage) — except
    views of what a block computes from its parameters alone (a transposed weight), which read a
    redistributed copy of their own. Placeholders are not listed."""
    out = HandedOver({}, set())
    seen: set[fx.Node] = set()
    from_params = graph.from_params

    def storage(value: fx.Node) -> tuple[fx.Node, int] | None:
        while (value.op == "call_function" and value not in from_params and value.args
               and isinstance(value.args[0], fx.Node) and tc.shares_input_storage(value.target)):
            out.views.add(value)
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
    table = PeakTable({}, {})
    for fqn, node in sp.graph.params.items():
        val = node.meta["val"]
        per_element = val.dtype.itemsize * (2 if fqn in sp.graph.grads else 1) + ADAMW_STATE_BYTES
        table.nodes[node.name] = [math.prod(s.outputs[0].local_shape(tuple(val.shape), ms)) * per_element
                                  for s in sp.strategies[node.name]]
    held = handed_over(sp.graph, sp.recomputed)
    for node, outputs in held.storages.items():
        if node.name not in sp.strategies:
            continue
        vals = node.meta["val"] if isinstance(node.meta["val"], (tuple, list)) else [node.meta["val"]]
        row = []
        for strategy in sp.strategies[node.name]:
            total = 0.0
            for i in outputs:
                layout, val = strategy.outputs[i], vals[i]
                if layout is not None and hasattr(val, "shape"):
                    total += math.prod(layout.local_shape(tuple(val.shape), ms)) * val.dtype.itemsize
            row.append(total)
        table.nodes[node.name] = row
    copies: dict = {}  # repeated blocks share strategy lists: one matrix per distinct edge
    for view in held.views:
        if view.name not in sp.strategies or not sp.inputs[view.name]:
            continue
        producer = sp.inputs[view.name][0]
        srcs, dsts = sp.strategies[producer.node], sp.strategies[view.name]
        shape, dtype = sp.tensor_meta(producer)
        key = (id(srcs), producer.output, id(dsts), shape, dtype)
        if key not in copies:
            copies[key] = (srcs, dsts, _copy_matrix([s.outputs[producer.output] for s in srcs],
                                                    [s.inputs[0] for s in dsts], shape, dtype.itemsize, ms))
        matrix = copies[key][2]
        if any(map(any, matrix)):
            table.edges[(producer.node, view.name)] = matrix
    return table


def _copy_matrix(srcs, dsts, shape, itemsize, mesh_shape) -> list[list[float]]:
    """Bytes of the copy a redistribution src -> dst makes: dst's local bytes where they differ."""
    local = [0.0 if dst is None else math.prod(dst.local_shape(shape, mesh_shape)) * itemsize for dst in dsts]
    return [[0.0 if src is None or src == dst else size for dst, size in zip(dsts, local)] for src in srcs]


def modeled_bytes(table: PeakTable, choice: dict[str, int]) -> float:
    """The table's bytes for one solution's choices."""
    nodes = sum(row[choice[name]] for name, row in table.nodes.items())
    return nodes + sum(m[choice[src]][choice[dst]] for (src, dst), m in table.edges.items())


def with_peak_budget(sp: ShardingProblem, table: PeakTable, limit: float) -> solver.Problem:
    """The problem with one more constraint: the table's bytes of the chosen layouts <= `limit`."""
    problem = sp.problem
    extended = solver.Problem(list(problem.nodes), list(problem.edges), list(problem.constraints),
                              list(problem.regions))
    extended.memory_budget(list(table.nodes), limit, name="modeled peak bytes per rank", memory=table.nodes,
                           edges=table.edges)
    return extended
