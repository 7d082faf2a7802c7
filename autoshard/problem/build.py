"""Joint graph + strategies + planner costs + user constraints -> solver.Problem, and back.

Every ILP node is either a graph node (an op, a parameter, an input) or a *sink*: the loss (must be
replicated) and one per parameter gradient (must land in its parameter's layout, SameChoice). Every
edge is priced by the redistribute planner for that tensor's shape and dtype: the only cost model.
`getitem` nodes are not ILP nodes: they alias one output of their producer.

The objective is the whole step: each op's compute (dispatch overhead + roofline), each
redistribution, and each parameter's optimizer step in its layout (`DeviceProfile.optimizer_s` of
its local elements). The program runs a block's parameter gathers and gradient reductions as one
collective each (`program.buckets`), so an edge that gathers a parameter or reduces a gradient
pays its first step's launch and latency (`Step.fixed_s`) shared with the block's other
parameters, and its part of the bucket's copies (`buckets.BucketShare`): one launch per block, as
the program pays it.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass, field
from typing import Sequence

import torch
from torch import fx

import autoshard_solver as solver
from autoshard.capture.loops import find_repeated_steps
from autoshard.capture.precision import gradient_tail
from autoshard.capture.regions import assign_blocks, find_repeated_blocks
from autoshard.capture.trace import JointGraph
from autoshard.layout import Layout
from autoshard.pricing.compute import ComputePricer
from autoshard.pricing.planner import Planner, holds_for_accumulation, reduces
from autoshard.problem.buckets import GRAD_BUCKET_KINDS, BucketShare, bucket_shares

# the ILP's nodes and their choices live in `choices`; these names stay importable from here
from autoshard.problem.choices import (
    LOSS_SINK as LOSS_SINK,
)
from autoshard.problem.choices import Choices, add_sinks, collect_choices, optimizer_step_s
from autoshard.problem.choices import (
    DimPlacements as DimPlacements,
)
from autoshard.problem.choices import (
    FixedMeshDim as FixedMeshDim,
)
from autoshard.problem.choices import (
    ProblemSpec as ProblemSpec,
)
from autoshard.problem.choices import (
    Producer as Producer,
)
from autoshard.problem.choices import (
    dim_placements as dim_placements,
)
from autoshard.problem.choices import (
    grad_sink as grad_sink,
)
from autoshard.problem.choices import (
    input_grad_sink as input_grad_sink,
)
from autoshard.profiles.device import DeviceProfile
from autoshard.strategies import Strategy, StrategyCatalog
from autoshard_solver.problem import problem_digest

log = logging.getLogger("autoshard")


@dataclass
class ShardingProblem:
    """The ILP in terms of the graph: what each solver choice index means."""

    graph: JointGraph
    mesh_shape: tuple[int, ...]
    strategies: dict[str, list[Strategy]]  # ILP node name -> its choices
    compute_s: dict[str, list[float]]  # ILP node name -> modeled compute seconds of each choice
    fx_nodes: dict[str, fx.Node]  # ILP node name -> graph node (sinks: the node they consume)
    inputs: dict[str, list[Producer]]  # ILP node name -> producer of each input slot
    problem: solver.Problem
    # parameter ILP node -> modeled optimizer step seconds of each choice (its local elements)
    optimizer_s: dict[str, list[float]] = field(default_factory=dict)
    # (producer, consumer) ILP nodes -> the bucket its redistribution's first step may share
    bucket_shares: dict[tuple[str, str], BucketShare] = field(default_factory=dict)
    # activation checkpointing: block-list prefixes recomputed, and the ILP nodes that run twice
    # (their compute and the redistributions into them are priced twice); resharding after the
    # forward runs twice only what blocks compute from their parameters alone (`reshard_blocks`)
    recompute_blocks: tuple[str, ...] = ()
    recomputed: frozenset[str] = frozenset()
    reshard_blocks: tuple[str, ...] = ()
    # the graph's repeated blocks, kept for `with_options` (the memory fit's other options)
    repeated: list[list[list[fx.Node]]] | None = field(default=None, repr=False, compare=False)
    # gradient accumulation: the graph is a micro-batch, this many per optimizer step; the ILP
    # prices one micro-batch plus 1/micro_batches of what runs once a step (the optimizer, the
    # gradient all-reduces the program holds: `pricing.planner.holds_for_accumulation`)
    micro_batches: int = 1

    def choice_costs(self, name: str) -> list[float]:
        """A node's cost per choice in the ILP: its compute, plus a parameter's optimizer step
        (once per `micro_batches`)."""
        compute, step = self.compute_s[name], self.optimizer_s.get(name)
        if step is None:
            return compute
        return [c + o / self.micro_batches for c, o in zip(compute, step)]

    def fingerprint(self) -> str:
        """Hash of the whole ILP (nodes, choice labels and costs, edges, constraints): equal
        fingerprints mean the same graph, mesh, profiles and constraints, so a saved solution of
        one applies to the other."""
        return problem_digest(self.problem)[:16]

    def tensor_meta(self, producer: Producer) -> tuple[tuple[int, ...], torch.dtype]:
        val = self.fx_nodes[producer.node].meta["val"]
        if isinstance(val, (tuple, list)):
            val = val[producer.output]
        return tuple(val.shape), val.dtype


def _val(node: fx.Node, index: int = 0):
    val = node.meta.get("val")
    return val[index] if isinstance(val, (tuple, list)) else val


def _local_bytes(layout: Layout, val, mesh_shape) -> float:
    return math.prod(layout.local_shape(tuple(val.shape), mesh_shape)) * val.dtype.itemsize


def build_problem(
    graph: JointGraph,
    mesh_shape: tuple[int, ...],
    planner: Planner,
    device: DeviceProfile,
    spec: ProblemSpec,
    *,
    catalog: StrategyCatalog | None = None,
    repeated: list[list[list[fx.Node]]] | None = None,
) -> ShardingProblem:
    """Price every choice and edge; the returned problem is ready for `solver.solve`.

    `catalog` (strategies on this mesh) and `repeated` (the graph's repeated blocks) are made here
    unless given: pass a catalog to reuse its strategies across builds, e.g. for another device
    profile, and the repeated blocks when they are already found (a 3D plan builds twice). Other
    recompute or reshard options of a built problem: `with_options`, in a fraction of the time."""
    mesh_shape = tuple(mesh_shape)
    catalog = catalog if catalog is not None else StrategyCatalog(mesh_shape)
    if catalog.mesh_shape != mesh_shape:
        raise ValueError(f"catalog (mesh {catalog.mesh_shape}) must be for the problem's mesh {mesh_shape}")
    pricer = ComputePricer(device, mesh_shape, planner.profile)
    choices = Choices()
    collect_choices(choices, graph, catalog, pricer, spec, mesh_shape)
    add_sinks(choices, graph, mesh_shape, spec.stage_layout)
    repeated = find_repeated_blocks(graph) if repeated is None else repeated
    recompute_blocks, reshard_blocks, recomputed = _runs_twice(graph, repeated, spec)
    compute_s = choices.compute_s
    for name in recomputed & compute_s.keys():
        compute_s[name] = [2 * cost for cost in compute_s[name]]
    sharding = ShardingProblem(
        graph=graph,
        mesh_shape=mesh_shape,
        strategies=choices.strategies,
        compute_s=compute_s,
        fx_nodes=choices.fx_nodes,
        inputs=choices.inputs,
        problem=solver.Problem(),
        optimizer_s=optimizer_step_s(graph, choices.strategies, device, mesh_shape),
        bucket_shares=bucket_shares(graph, choices.inputs, 1 / planner.profile.mem_bw),
        recompute_blocks=recompute_blocks,
        recomputed=recomputed,
        reshard_blocks=reshard_blocks,
        repeated=repeated,
        micro_batches=spec.micro_batches,
    )
    _fill_solver_problem(sharding, planner, spec, graph.param_names, repeated)
    return sharding


def with_options(sp: ShardingProblem, spec: ProblemSpec) -> ShardingProblem:
    """`sp` with `spec`'s recompute and reshard options: the problem `build_problem` makes of the
    same graph, in a fraction of the time (the memory fit derives each option). The options change
    only what runs twice, so only the prices of those nodes change (their compute, and the
    redistributions into them, doubled or halved: exact in floating point); every other node
    keeps its list of choices and every other edge its matrix, shared with `sp`."""
    graph, repeated = sp.graph, sp.repeated if sp.repeated is not None else find_repeated_blocks(sp.graph)
    recompute_blocks, reshard_blocks, recomputed = _runs_twice(graph, repeated, spec)
    factor = {name: 2.0 for name in recomputed - sp.recomputed}
    factor.update({name: 0.5 for name in sp.recomputed - recomputed})
    compute_s = dict(sp.compute_s)
    for name in factor.keys() & compute_s.keys():
        compute_s[name] = [factor[name] * c for c in compute_s[name]]
    problem, scaled = solver.Problem(), {}  # (id of sp's choice list or matrix, factor) -> its scaled copy
    for node in sp.problem.nodes:
        choices, times = node.choices, factor.get(node.name)
        if times is not None and node.name in compute_s:
            key = (id(choices), times)
            if key not in scaled:
                costs = dataclasses.replace(sp, compute_s=compute_s).choice_costs(node.name)
                scaled[key] = [solver.Choice(c.label, cost, c.memory, c.tags) for c, cost in zip(choices, costs)]
            choices = scaled[key]
        problem.nodes.append(solver.Node(node.name, choices))
    for edge in sp.problem.edges:  # matrices of floats already: shared as they are
        matrix, times = edge.cost, factor.get(edge.dst)
        if times is not None:
            key = (id(matrix), times)
            if key not in scaled:
                scaled[key] = [[times * c for c in row] for row in matrix]
            matrix = scaled[key]
        problem.edges.append(solver.Edge(edge.src, edge.dst, matrix))
    problem.constraints, problem.regions = list(sp.problem.constraints), list(sp.problem.regions)
    return dataclasses.replace(
        sp,
        compute_s=compute_s,
        problem=problem,
        recompute_blocks=recompute_blocks,
        recomputed=recomputed,
        reshard_blocks=reshard_blocks,
        repeated=repeated,
    )


def _runs_twice(
    graph: JointGraph, repeated: list[list[list[fx.Node]]], spec: ProblemSpec
) -> tuple[tuple[str, ...], tuple[str, ...], frozenset[str]]:
    """What `spec`'s options run twice: the recomputed and the resharded block-list prefixes, and
    the ILP nodes (their compute and the redistributions into them are priced twice)."""
    if spec.recompute:
        blocks, nodes = _recomputed(graph, repeated)
        return blocks, (), nodes
    if spec.reshard:
        blocks, nodes = _resharded(graph, repeated)
        return (), blocks, nodes
    return (), (), frozenset()


def _fill_solver_problem(
    sp: ShardingProblem, planner: Planner, spec: ProblemSpec, param_fqn, repeated: list[list[list[fx.Node]]]
) -> None:
    _add_nodes(sp, param_fqn)
    _add_edges(sp, planner)
    problem = sp.problem
    for fqn in sp.graph.trained:
        problem.same_choice(
            [sp.graph.params[fqn].name, grad_sink(fqn)], name=f"grad of {fqn} in its parameter's layout"
        )
    limit = spec.param_memory_bytes
    if limit is not None and math.isfinite(limit):
        _add_param_budget(problem, sp.graph, limit)
    for copies in repeated:
        problem.add_region([_ilp_names(sp, copy) for copy in copies])
    loops = []
    for steps in find_repeated_steps(sp.graph):
        tied = _alike_choices(sp, steps)
        if tied:
            problem.add_region(tied)
            loops.append(f"{sp.graph.module_path(steps[0][0]) or 'the model'}: {len(tied)} x {len(tied[0])} ops")
    if loops:
        log.info("autoshard: loops planned as one step each (steps x ops per step): %s", "; ".join(loops))


def _add_param_budget(problem: solver.Problem, graph: JointGraph, limit: float) -> None:
    problem.memory_budget(
        [node.name for node in graph.params.values()], limit * (1 + 1e-9), name="parameter bytes per rank"
    )


def with_param_budget(sp: ShardingProblem, limit: float) -> solver.Problem:
    """`sp`'s problem with its parameters' bytes per rank under `limit`, as `ProblemSpec`'s
    `param_memory_bytes` would have built it (`sp.problem` itself is left as it is)."""
    problem = sp.problem.copy()
    _add_param_budget(problem, sp.graph, limit)
    return problem


def _add_nodes(sp: ShardingProblem, param_fqn) -> None:
    """One ILP node per graph node and sink, its choices priced (`choice_costs`), a parameter's
    with its local bytes. Repeated blocks have equal choices position by position: they share one
    list of Choice objects (a 3D 70B problem has millions of choices)."""
    choice_lists: dict[tuple, list[solver.Choice]] = {}
    for name, choices in sp.strategies.items():
        node = sp.fx_nodes[name]
        memory = [0.0] * len(choices)
        if node in param_fqn and name == node.name:
            memory = [_local_bytes(s.outputs[0], node.meta["val"], sp.mesh_shape) for s in choices]
        costs = sp.choice_costs(name)
        key = (tuple(map(id, choices)), tuple(costs), tuple(memory))
        if key not in choice_lists:
            choice_lists[key] = [
                solver.Choice(label=s.label, cost=c, memory=m) for s, c, m in zip(choices, costs, memory)
            ]
        sp.problem.add_node(name, choice_lists[key])


def _add_edges(sp: ShardingProblem, planner: Planner) -> None:
    """One edge per (producer, consumer) pair; several slots fed by one producer add up. Repeated
    blocks share Strategy objects (the catalog caches them by op signature), so matrices are
    looked up by Strategy identity first: comparing layouts is the slow part."""
    matrix_cache: dict = {}  # by layouts
    matrix_by_id: dict = {}  # by Strategy identity
    variants: dict = {}  # (key, without reduction, priced twice, held) -> that variant of the key's matrix
    reduce_dtypes = _gradient_reduce_dtypes(sp)
    held = sp.micro_batches > 1  # gradient edges: a held all-reduce costs 1/micro_batches
    for consumer, producers in sp.inputs.items():
        merged: dict[str, list[list[float]]] = {}
        for slot, producer in enumerate(producers):
            shape, dtype = sp.tensor_meta(producer)
            src_choices, dst_choices = sp.strategies[producer.node], sp.strategies[consumer]
            share = sp.bucket_shares.get((producer.node, consumer))
            key = (
                tuple(map(id, src_choices)),
                producer.output,
                tuple(map(id, dst_choices)),
                slot,
                shape,
                dtype.itemsize,
                share,
            )
            matrix = matrix_by_id.get(key)
            if matrix is None:
                srcs = tuple(s.outputs[producer.output] for s in src_choices)
                dsts = tuple(s.inputs[slot] for s in dst_choices)
                by_value = (srcs, dsts, shape, dtype.itemsize, share)
                matrix = matrix_cache.get(by_value)
                if matrix is None:
                    matrix = matrix_cache[by_value] = _cost_matrix(planner, srcs, dsts, shape, dtype.itemsize, share)
                matrix_by_id[key] = matrix
            no_reduction = consumer in reduce_dtypes and dtype != reduce_dtypes[consumer]
            twice = consumer in sp.recomputed  # the recomputation redistributes its inputs again
            once = held and share is not None and share.kinds == GRAD_BUCKET_KINDS
            if no_reduction or twice or once:
                how = (no_reduction, twice, once)
                if (key, *how) not in variants:
                    variants[(key, *how)] = _variant(matrix, how, sp, planner, producer, consumer, slot)
                matrix = variants[(key, *how)]
            if producer.node in merged:
                merged[producer.node] = [
                    [a + b for a, b in zip(r1, r2)] for r1, r2 in zip(merged[producer.node], matrix)
                ]
            else:
                merged[producer.node] = matrix
        for producer_node, matrix in merged.items():
            sp.problem.add_edge(producer_node, consumer, matrix)


def _variant(
    matrix, how: tuple[bool, bool, bool], sp: ShardingProblem, planner: Planner, producer: Producer, consumer: str, slot
) -> list[list[float]]:
    """`matrix` of the edge `producer` -> `consumer`'s `slot` as `how` says: without reductions
    (mixed precision reduces a gradient in its own dtype only), priced twice (a recomputed
    consumer), with the held reductions of gradient accumulation at their share."""
    no_reduction, twice, once = how
    src_choices, dst_choices = sp.strategies[producer.node], sp.strategies[consumer]
    if no_reduction:
        matrix = _without_reduction(matrix, src_choices, producer.output, dst_choices, slot)
    if twice:
        matrix = [[2 * c for c in row] for row in matrix]
    if once:
        shape, dtype = sp.tensor_meta(producer)
        matrix = _held(matrix, src_choices, producer.output, dst_choices, slot, shape, dtype, sp, planner)
    return matrix


def _repeated_forward_ops(
    graph: JointGraph, repeated: list[list[list[fx.Node]]]
) -> tuple[tuple[str, ...], dict[fx.Node, tuple]]:
    """The list prefixes of the repeated blocks, and each forward op in one of them -> its block."""
    blocks = assign_blocks(graph)
    prefixes = tuple(
        sorted({blocks[copy[0]][0] for copies in repeated for copy in copies if copy and copy[0] in blocks})
    )
    return prefixes, {
        n: b for n, b in blocks.items() if n.op == "call_function" and not graph.is_backward(n) and b[0] in prefixes
    }


def _recomputed(graph: JointGraph, repeated: list[list[list[fx.Node]]]) -> tuple[tuple[str, ...], frozenset[str]]:
    """Activation checkpointing of the repeated blocks: their list prefixes, and the forward ops
    the backward runs again. A block's outputs (values a forward op outside the block reads) are
    handed over as checkpoints; of the rest, what the backward reads is recomputed, with what it
    is computed from inside the block. `program.lower` recomputes exactly these nodes."""
    prefixes, block = _repeated_forward_ops(graph, repeated)
    candidates = {
        n
        for n, b in block.items()
        if all(block.get(u) == b for u in n.users if u.op == "call_function" and not graph.is_backward(u))
    }
    return prefixes, _read_by_backward(graph, candidates)


def _resharded(graph: JointGraph, repeated: list[list[list[fx.Node]]]) -> tuple[tuple[str, ...], frozenset[str]]:
    """Reshard after forward (FSDP's `reshard_after_forward`) for the repeated blocks: their list
    prefixes, and the forward ops computed from a block's parameters alone (casts, transposes: what
    a gathered parameter goes through before it meets an activation) that the backward reads. The
    backward computes those again, gathering the parameters again, instead of holding every
    block's gathered parameters from the forward on."""
    prefixes, block = _repeated_forward_ops(graph, repeated)
    return prefixes, _read_by_backward(graph, {n for n in graph.from_params if n in block})


def _read_by_backward(graph: JointGraph, candidates: set[fx.Node]) -> frozenset[str]:
    """Names of the candidates the backward reads, directly or through other candidates."""
    recomputed: set[fx.Node] = set()
    stack = [a for n in graph.nodes if n.op == "call_function" and graph.is_backward(n) for a in n.all_input_nodes]
    while stack:
        n = stack.pop()
        if n in candidates and n not in recomputed:
            recomputed.add(n)
            stack.extend(n.all_input_nodes)
    return frozenset(n.name for n in recomputed)


def _gradient_reduce_dtypes(sp: ShardingProblem) -> dict[str, torch.dtype]:
    """Under mixed precision: ILP node -> the only dtype in which an edge into it may reduce a
    partial gradient (its parameter's reduce dtype), for every gradient sink and node of a
    gradient's tail (`capture.precision.gradient_tail`). Empty without mixed precision."""
    precision = sp.graph.precision
    if not precision.casts:
        return {}
    dtypes: dict[str, torch.dtype] = {}
    for fqn, grad in sp.graph.grads.items():
        dtype = precision.gradient_dtype(_val(sp.graph.params[fqn]).dtype)
        dtypes[grad_sink(fqn)] = dtype
        for node in gradient_tail(grad):
            if node.name in sp.strategies:
                dtypes[node.name] = dtype
    return dtypes


def _without_reduction(matrix, src_choices, output: int, dst_choices, slot: int) -> list[list[float]]:
    """`matrix` with inf where the edge would reduce a partial value (a mesh dim partial in the
    source layout and not in the destination's)."""

    srcs = [s.outputs[output] for s in src_choices]
    dsts = [s.inputs[slot] for s in dst_choices]
    return [
        [
            math.inf if src is not None and dst is not None and reduces(src, dst) else cost
            for dst, cost in zip(dsts, row)
        ]
        for src, row in zip(srcs, matrix)
    ]


def _held(matrix, src_choices, output: int, dst_choices, slot: int, shape, dtype, sp, planner: Planner):
    """`matrix` (edges into a gradient's sink or tail) with the reductions gradient accumulation
    holds for the last micro-batch at 1/`sp.micro_batches` of their cost."""
    srcs = [s.outputs[output] for s in src_choices]
    dsts = [s.inputs[slot] for s in dst_choices]

    def price(src: Layout | None, dst: Layout | None, cost: float) -> float:
        if src is None or dst is None or not 0 < cost < math.inf:
            return cost
        return (
            cost / sp.micro_batches if holds_for_accumulation(planner.plan(src, dst, shape, dtype.itemsize)) else cost
        )

    return [[price(src, dst, cost) for dst, cost in zip(dsts, row)] for src, row in zip(srcs, matrix)]


def _alike_choices(sp: ShardingProblem, steps: list[list[fx.Node]]) -> list[list[str]]:
    """A loop's steps as ILP nodes, position by position, keeping the positions whose nodes have
    the same choices in every step (a step's index can change an op's strategies)."""
    positions = [
        names
        for names in zip(*([n.name for n in step] for step in steps))
        if all(name in sp.strategies for name in names)
        and len({tuple(s.label for s in sp.strategies[name]) for name in names}) == 1
    ]
    return [list(step) for step in zip(*positions)]


def _ilp_names(sp: ShardingProblem, copy: Sequence[fx.Node]) -> list[str]:
    """ILP nodes of one block copy, in position order: its ops and params, then its params' grad sinks."""
    names = [n.name for n in copy if n.name in sp.strategies]
    sinks = [grad_sink(sp.graph.param_names[n]) for n in copy if n in sp.graph.param_names]
    return names + [sink for sink in sinks if sink in sp.strategies]  # a frozen parameter has none


def _cost_matrix(planner: Planner, srcs, dsts, shape, itemsize, share: BucketShare | None = None) -> list[list[float]]:
    """cost[i][j] = planner cost of srcs[i] -> dsts[j] (memoized by the planner), its first step's
    launch shared when the program buckets it (`share`); inf where the planner refuses (a layout
    that does not split the shape evenly)."""
    return [[_edge_cost(planner, src, dst, shape, itemsize, share) for dst in dsts] for src in srcs]


def _edge_cost(planner: Planner, src, dst, shape, itemsize, share: BucketShare | None) -> float:
    if src is None or dst is None:
        return 0.0
    try:
        cost = planner.cost(src, dst, shape, itemsize)
    except ValueError:
        return math.inf
    if share is None or share.members <= 1 or cost == 0.0:
        return cost
    return share.cost_s(planner.plan(src, dst, shape, itemsize))
