"""A solved sharding problem, read back in terms of the model: what every node and parameter does.

The plan's figures are recomputed from the chosen strategies and the planner's redistribute plans,
not copied from the solver, so a test can check the two agree (one cost model, priced once).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import autoshard_solver as solver
from autoshard.capture.trace import JointGraph
from autoshard.layout import Layout
from autoshard.pricing.planner import Planner, RedistributePlan, holds_for_accumulation
from autoshard.pricing.ring import COLLECTIVE_KINDS
from autoshard.problem.buckets import GRAD_BUCKET_KINDS
from autoshard.problem.build import LOSS_SINK, ShardingProblem, grad_sink, input_grad_sink
from autoshard.strategies import Strategy


@dataclass(frozen=True)
class Redistribution:
    """One edge whose producer layout differs from what the consumer needs, and how it is done."""

    producer: str  # graph node name (the producing op, parameter or input)
    consumer: str  # graph node name, or a `Sink.name`
    slot: int  # which input slot of the consumer
    plan: RedistributePlan
    cost_s: float  # what the edge costs in the plan: the plan's, with a bucketed first step's launch shared
    copy_s: float = 0.0  # of cost_s, the executor's copies into and out of the bucket it rides in
    held: bool = False  # a gradient reduction accumulation holds for the last micro-batch (once a step)


@dataclass(frozen=True)
class Sink:
    """Where a step's result must land: the loss (replicated) or one parameter's gradient (in the
    parameter's layout). `name` is how redistributions into it are addressed (`Redistribution.consumer`)."""

    name: str
    kind: str  # "loss", "grad" or "input_grad"
    fqn: str  # the parameter of a gradient; "" for the loss; an input gradient's input index
    layout: Layout


@dataclass
class Plan:
    mesh_shape: tuple[int, ...]
    strategies: dict[str, Strategy]  # ILP node name (graph node name or sink) -> chosen strategy
    param_layouts: dict[str, Layout]  # parameter FQN -> layout (its gradient's layout too)
    input_layouts: list[Layout]  # one per user input
    redistributions: list[Redistribution]
    module_paths: dict[str, str]  # graph node name -> module path
    loss_sink: Sink
    grad_sinks: dict[str, Sink]  # parameter FQN -> its gradient's sink
    solution: solver.Solution
    graph: JointGraph = field(repr=False)  # the traced step the strategies refer to (apply lowers it)
    compute_s: float = 0.0
    # ILP node name -> modeled compute seconds of its chosen strategy (0 for placeholders and sinks)
    node_compute_s: dict[str, float] = field(default_factory=dict)
    comm_s: float = 0.0
    optimizer_s: float = 0.0  # the optimizer step over this rank's parameter shards
    bytes_by_collective: dict[str, float] = field(default_factory=dict)
    count_by_collective: dict[str, int] = field(default_factory=dict)
    # activation checkpointing: prefixes of the block lists (e.g. "layers") whose forward the
    # backward recomputes, and the graph nodes it runs again
    recompute_blocks: tuple[str, ...] = ()
    recomputed: frozenset[str] = frozenset()
    # reshard after forward: prefixes of the block lists whose parameters the backward gathers
    # again (the ops it runs again, casts and transposes of parameters, are in `recomputed`)
    reshard_blocks: tuple[str, ...] = ()
    # gradient accumulation: the graph is one of `micro_batches` per optimizer step; the gradient
    # all-reduces held for the last one (`comm_s` includes them) cost `held_comm_s` once per step
    micro_batches: int = 1
    held_comm_s: float = 0.0
    # a pipeline stage: user input index -> the sink of its gradient, sent back to the previous stage
    input_grad_sinks: dict[int, Sink] = field(default_factory=dict)

    @property
    def step_time_s(self) -> float:
        """Modeled time of one training step: compute + optimizer + communication, no overlap
        assumed (the ILP's objective, times `micro_batches`). With gradient accumulation the
        graph is a micro-batch: all but the held reductions and the optimizer run once per
        micro-batch."""
        per_micro = self.compute_s + self.comm_s - self.held_comm_s
        return self.micro_batches * per_micro + self.held_comm_s + self.optimizer_s

    @property
    def comm_bytes(self) -> float:
        return sum(self.bytes_by_collective.values())

    def non_default_order_params(self) -> list[str]:
        return [fqn for fqn, lay in self.param_layouts.items() if not lay.is_default_order]

    def summary(self) -> str:
        kinds = (
            ", ".join(
                f"{k} x{self.count_by_collective[k]} ({self.bytes_by_collective[k] / 1e6:.2f} MB)"
                for k in sorted(self.count_by_collective)
            )
            or "none"
        )
        return (
            f"mesh {self.mesh_shape}: modeled step {self.step_time_s * 1e3:.3f} ms "
            f"(compute {self.compute_s * 1e3:.3f} ms, optimizer {self.optimizer_s * 1e3:.3f} ms, "
            f"comm {self.comm_s * 1e3:.3f} ms); "
            f"collectives per rank: {kinds}; "
            f"{len(self.non_default_order_params())}/{len(self.param_layouts)} parameters in non-default device order"
        )


def decode(sp: ShardingProblem, solution: solver.Solution, planner: Planner) -> Plan:
    """Turn the solver's choice per ILP node into a Plan, with a redistribute plan per changed edge."""
    chosen = {name: sp.strategies[name][solution.choice[name]] for name in sp.strategies}
    node_compute_s = {name: sp.compute_s[name][solution.choice[name]] for name in sp.strategies}
    graph = sp.graph
    params = {fqn: chosen[node.name].outputs[0] for fqn, node in graph.params.items()}
    for fqn in graph.trained:  # the SameChoice constraint, double-checked
        assert chosen[grad_sink(fqn)].inputs[0] == params[fqn], fqn
    inputs = [chosen[node.name].outputs[0] for node in graph.inputs]

    redistributions = []
    bytes_by, count_by = Counter(), Counter()
    comm_s = held_comm_s = 0.0
    gradient_edges = {edge for edge, share in sp.bucket_shares.items() if share.kinds == GRAD_BUCKET_KINDS}
    for consumer, producers in sp.inputs.items():
        for slot, producer in enumerate(producers):
            src = chosen[producer.node].outputs[producer.output]
            dst = chosen[consumer].inputs[slot]
            if src is None or dst is None or src == dst:
                continue
            shape, dtype = sp.tensor_meta(producer)
            plan = planner.plan(src, dst, shape, dtype)
            share = sp.bucket_shares.get((producer.node, consumer))
            cost = plan.cost_s if share is None else share.cost_s(plan)
            copies = 0.0 if share is None else share.copy_s(plan)
            held = sp.micro_batches > 1 and (producer.node, consumer) in gradient_edges and holds_for_accumulation(plan)
            redistributions.append(Redistribution(producer.node, consumer, slot, plan, cost, copies, held))
            runs = 2 if consumer in sp.recomputed else 1  # once more in the recomputation
            comm_s += runs * cost
            if held:
                held_comm_s += cost
            for step in plan.steps:
                if step.kind in COLLECTIVE_KINDS:
                    bytes_by[step.kind] += runs * step.bytes
            count_by.update({kind: runs * n for kind, n in plan.collective_counts.items()})
    return Plan(
        mesh_shape=sp.mesh_shape,
        strategies=chosen,
        param_layouts=params,
        input_layouts=inputs,
        redistributions=redistributions,
        module_paths={n.name: graph.module_path(n) for n in graph.nodes},
        loss_sink=Sink(LOSS_SINK, "loss", "", chosen[LOSS_SINK].inputs[0]),
        grad_sinks={fqn: Sink(grad_sink(fqn), "grad", fqn, params[fqn]) for fqn in graph.trained},
        solution=solution,
        graph=graph,
        compute_s=sum(c for name, c in node_compute_s.items() if name != LOSS_SINK),
        node_compute_s=node_compute_s,
        comm_s=comm_s,
        optimizer_s=sum(row[solution.choice[name]] for name, row in sp.optimizer_s.items()),
        bytes_by_collective={k: float(v) for k, v in bytes_by.items()},
        count_by_collective=dict(count_by),
        recompute_blocks=sp.recompute_blocks,
        recomputed=sp.recomputed,
        reshard_blocks=sp.reshard_blocks,
        micro_batches=sp.micro_batches,
        held_comm_s=held_comm_s,
        input_grad_sinks={
            i: Sink(input_grad_sink(i), "input_grad", str(i), chosen[input_grad_sink(i)].inputs[0])
            for i in graph.input_grads
        },
    )
