"""A solved plan read as a chain of segments a pipeline can cut between: what runs before the
repeated blocks (the embedding), each block, and what runs after them (the head and the loss).

Each figure is the plan's own, split by where its nodes belong: compute and redistributions run
per micro-batch, held gradient reductions and the optimizer once a step, and the modeled peak's
linear terms (`problem.memory`) as state (parameters, gradients, AdamW states) and as what one
micro-batch hands to its backward. Summed over the segments they give the plan's totals back.
A forward node between the blocks belongs to the block before it; the backward mirrors the
forward (its nodes before the first block's backward are the head's, those after the last are
the embedding's). `out_bytes` is what a segment sends the next one per micro-batch (the backward
sends a gradient of the same size back); values that skip a segment (a rotary table every block
reads) are left out: each stage makes its own from its buffers.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

from torch import fx

from autoshard.capture.regions import assign_blocks
from autoshard.problem.build import LOSS_SINK, ShardingProblem, grad_sink
from autoshard.problem.memory import PeakTable, peak_memory_table
from autoshard.problem.plan import Plan


@dataclass(frozen=True)
class Segment:
    """One cuttable piece of the step, per rank of the stage's sub-mesh."""

    name: str  # "layers.7", or "before layers" / "after layers"
    micro_s: float  # compute and redistributions, once per micro-batch (forward + backward)
    step_s: float  # held gradient reductions and the optimizer step, once per step
    state_bytes: float  # parameters, gradients and AdamW states
    act_bytes: float  # what one micro-batch's forward hands to its backward
    out_bytes: float  # sent to the next segment per micro-batch (0 for the last)
    input_s: float = 0.0  # of micro_s, the backward the segment before it waits for
    weight_s: float = 0.0  # of micro_s, the backward only the weights' gradients wait for


@dataclass(frozen=True)
class Segments:
    """The step as segments in order: the part before the blocks, one per block, the part after."""

    blocks: str  # the cut block list's prefix, e.g. "layers"
    items: tuple[Segment, ...]

    @property
    def n_blocks(self) -> int:
        return len(self.items) - 2


@dataclass(frozen=True)
class SegmentMap:
    """Which segment each ILP node of a problem belongs to: 0 before the blocks, 1..n block
    i - 1, n + 1 after them (the same for every problem built from one graph)."""

    where: dict[str, int]
    prefix: str  # the cut block list's, e.g. "layers"
    n: int  # its blocks
    backward: frozenset[str]  # the backward's ops
    deferrable: frozenset[str]  # of them, those only the weights' gradients wait for (`_deferrable`)


def plan_segments(
    plan: Plan,
    sp: ShardingProblem,
    *,
    gathered_once: bool = False,
    segment_map: SegmentMap | None = None,
    table: PeakTable | None = None,
) -> Segments:
    """`plan` (a solution of `sp`) split into segments at its longest list of numbered blocks.
    `gathered_once`: priced as a pipeline stage runs it when it holds what it gathers across the
    step's micro-batches (torch's pipelining stage turns FSDP's reshard after backward and
    gradient sync off until the last micro-batch): every redistribution of a parameter (or of what
    is computed from parameters alone) runs once a step and its result is held all step, and every
    gradient reaches its layout once a step, held unreduced until then. ValueError when the model
    has no list of numbered blocks (nothing to cut a pipeline between). Plans of problems built
    from one graph share its `segment_map` (`segments_of`), plans of one problem its `table`."""
    graph = sp.graph
    found = segment_map if segment_map is not None else segments_of(sp)
    where, prefix, n = found.where, found.prefix, found.n
    of = lambda name: where[name]  # noqa: E731
    micro, step, state, act, inputs, weights = Counter(), Counter(), Counter(), Counter(), Counter(), Counter()

    def per_micro(name: str, seconds: float) -> None:
        micro[of(name)] += seconds
        if name in found.deferrable or name.startswith("sink:grad:"):
            weights[of(name)] += seconds
        elif name in found.backward:
            inputs[of(name)] += seconds

    for name, seconds in plan.node_compute_s.items():
        if name != LOSS_SINK:
            per_micro(name, seconds)
    from_params = {node.name for node in graph.from_params} | {node.name for node in graph.params.values()}
    held_copies: set[tuple[str, object]] = set()  # (producer, layout): one held copy each
    for r in plan.redistributions:
        runs = 2 if r.consumer in sp.recomputed else 1
        if gathered_once and r.producer in from_params:
            step[of(r.consumer)] += r.cost_s
            if (r.producer, r.plan.dst) not in held_copies:
                held_copies.add((r.producer, r.plan.dst))
                state[of(r.consumer)] += _local_bytes(r.plan.dst, r.plan.shape, sp.mesh_shape, r.plan.itemsize)
        elif gathered_once and r.consumer.startswith("sink:grad:"):
            step[of(r.consumer)] += r.cost_s
            unreduced = _local_bytes(r.plan.src, r.plan.shape, sp.mesh_shape, r.plan.itemsize)
            state[of(r.consumer)] += max(
                0.0, unreduced - _local_bytes(r.plan.dst, r.plan.shape, sp.mesh_shape, r.plan.itemsize)
            )
        elif r.held:
            step[of(r.consumer)] += r.cost_s
            per_micro(r.consumer, (runs - 1) * r.cost_s)
        else:
            per_micro(r.consumer, runs * r.cost_s)
    choice = plan.solution.choice
    for name, row in sp.optimizer_s.items():
        step[of(name)] += row[choice[name]]
    table = table if table is not None else peak_memory_table(sp)
    params = {node.name for node in graph.params.values()}
    for name, row in table.nodes.items():
        (state if name in params else act)[of(name)] += row[choice[name]]
    for (src, dst), matrix in table.edges.items():
        act[of(dst)] += matrix[choice[src]][choice[dst]]
    sent = _boundary_bytes(plan, sp, where)
    items = tuple(
        Segment(
            _segment_name(i, prefix, n),
            micro[i],
            step[i],
            state[i],
            act[i],
            sent.get(i, 0.0),
            inputs[i],
            weights[i],
        )
        for i in range(n + 2)
    )
    return Segments(prefix, items)


def _deferrable(sp: ShardingProblem, where: dict[str, int]) -> frozenset[str]:
    """The backward nodes from which no path leads to the backward of an earlier segment: the
    work of a segment's backward that no earlier stage waits for (its weights' gradients), what
    a zero-bubble schedule runs apart (`program.weights`)."""
    graph = sp.graph
    earliest: dict[fx.Node, float] = {}  # per node, the earliest segment of a backward node it reaches
    found: set[str] = set()
    for n in reversed(graph.nodes):
        reach = math.inf
        for u in n.users:
            reach = min(reach, earliest.get(u, math.inf))
            if u.op == "call_function" and graph.is_backward(u) and u.name in where:
                reach = min(reach, where[u.name])
        earliest[n] = reach
        if n.op == "call_function" and graph.is_backward(n) and n.name in where and reach >= where[n.name]:
            found.add(n.name)
    return frozenset(found)


def _local_bytes(layout, shape, mesh_shape, itemsize: int) -> float:
    return float(math.prod(layout.local_shape(shape, mesh_shape)) * itemsize)


def _segment_name(index: int, prefix: str, n: int) -> str:
    if index == 0:
        return f"before {prefix}"
    if index == n + 1:
        return f"after {prefix}"
    return f"{prefix}.{index - 1}"


def segments_of(sp: ShardingProblem) -> SegmentMap:
    """The segment of each of `sp`'s ILP nodes. ValueError when the model has no list of
    numbered blocks."""
    graph = sp.graph
    blocks = assign_blocks(graph)
    counts = Counter(prefix for prefix, _ in blocks.values())
    if not counts:
        raise ValueError(
            "the model has no list of numbered blocks (e.g. layers.0, layers.1, ...) to cut stages between"
        )
    prefix = max(counts, key=lambda p: (len({i for q, i in blocks.values() if q == p}), counts[p]))
    n = 1 + max(i for q, i in blocks.values() if q == prefix)
    nodes = graph.nodes
    block_index = {node: i + 1 for node, (q, i) in blocks.items() if q == prefix}
    by_node: dict[fx.Node, int] = {}
    for backward in (False, True):
        part = [node for node in nodes if node.op == "call_function" and graph.is_backward(node) == backward]
        inside = [k for k, node in enumerate(part) if node in block_index]
        before, after = (n + 1, 0) if backward else (0, n + 1)
        current = before
        for k, node in enumerate(part):
            if node in block_index:
                current = block_index[node]
            elif not inside or k < inside[0]:
                current = before
            elif k > inside[-1]:
                current = after
            by_node[node] = current
    where: dict[str, int] = {}
    fqn_of = graph.param_names
    for name, node in sp.fx_nodes.items():
        if name.startswith("sink:grad:"):
            continue
        if name == LOSS_SINK:
            where[name] = n + 1
        elif node.op == "placeholder":
            users = [by_node[u] for u in node.users if u in by_node]
            param_block = blocks.get(node) if node in fqn_of else None
            if param_block is not None and param_block[0] == prefix:
                where[name] = param_block[1] + 1
            else:
                where[name] = min(users) if users else 0
        else:
            where[name] = by_node.get(node, n + 1)
    for fqn, node in graph.params.items():
        if grad_sink(fqn) in sp.fx_nodes:
            where[grad_sink(fqn)] = where[node.name]
    backward = frozenset(node.name for node in nodes if node.op == "call_function" and graph.is_backward(node))
    return SegmentMap(where, prefix, n, backward, _deferrable(sp, where))


def _boundary_bytes(plan: Plan, sp: ShardingProblem, where: dict[str, int]) -> dict[int, float]:
    """Per segment, the local bytes of the forward values it computes that the next segment reads
    (each value once, in the layout its producer chose)."""
    graph, mesh = sp.graph, sp.mesh_shape
    seen: set[tuple[str, int]] = set()
    sent: Counter = Counter()
    for consumer, producers in sp.inputs.items():
        node = sp.fx_nodes[consumer]
        if consumer.startswith("sink:") or node.op != "call_function" or graph.is_backward(node):
            continue
        for producer in producers:
            src = sp.fx_nodes[producer.node]
            if src.op != "call_function" or where[consumer] != where[producer.node] + 1:
                continue
            if (producer.node, producer.output) in seen:
                continue
            seen.add((producer.node, producer.output))
            layout = plan.strategies[producer.node].outputs[producer.output]
            shape, dtype = sp.tensor_meta(producer)
            if layout is not None:
                sent[where[producer.node]] += _local_bytes(layout, shape, mesh, dtype.itemsize)
    return dict(sent)
