"""The ILP's nodes and what each may choose: the graph's placeholders and ops plus the sinks (the
loss, each parameter's gradient), their candidate strategies narrowed by the user's constraints
(`ProblemSpec`: pins, fixed input and output layouts, a mesh dim decided beforehand), and what each
choice costs by itself (compute, a parameter's optimizer step).

Apart from `build`, which prices the edges between these nodes and assembles the solver problem:
this half only asks the strategy catalog and the compute pricer.
"""

from __future__ import annotations

import fnmatch
import math
import operator
from dataclasses import dataclass, field
from typing import Sequence

import torch
from torch import fx

from autoshard.capture.trace import JointGraph
from autoshard.layout import Layout, Placement
from autoshard.pricing.compute import ComputePricer
from autoshard.profiles.device import DeviceProfile
from autoshard.strategies import Strategy, StrategyCatalog, input_slots

LOSS_SINK = "sink:loss"


def grad_sink(fqn: str) -> str:
    return f"sink:grad:{fqn}"


def input_grad_sink(index: int) -> str:
    return f"sink:input_grad:{index}"


@dataclass(frozen=True)
class Producer:
    """Where an input slot's value comes from: ILP node name and which of its outputs."""

    node: str
    output: int


# One node's placements on one mesh dim: (its outputs', its input slots'), None for non-tensors.
DimPlacements = tuple[tuple[Placement | None, ...], tuple[Placement | None, ...]]


@dataclass(frozen=True)
class FixedMeshDim:
    """Placements decided on one mesh dim before the ILP (a `dp_replicate` dim, from a
    data-parallel solve of that dim alone): a node keeps only the strategies that place its
    outputs and inputs so on `mesh_dim`, which makes a 3D problem about as small as a 2D one.
    Nodes not listed (or with no such strategy) keep all of theirs."""

    mesh_dim: int
    placements: dict[str, DimPlacements]
    # (id of a catalog's strategy tuple, placements) -> (that tuple, kept indices): repeated
    # blocks share both, so each distinct pair is filtered once
    _kept: dict = field(default_factory=dict, compare=False, repr=False)

    def keep(self, name: str, choices: Sequence[Strategy]) -> list[int]:
        """Indices of `choices` that agree with this dim's placements for node `name`."""
        want = self.placements.get(name)
        if want is None:
            return list(range(len(choices)))
        key = (id(choices), want)
        hit = self._kept.get(key)
        if hit is None or hit[0] is not choices:
            kept = [i for i, s in enumerate(choices) if dim_placements(s, self.mesh_dim) == want]
            hit = self._kept[key] = (choices, kept or list(range(len(choices))))
        return hit[1]


def dim_placements(strategy: Strategy, mesh_dim: int = 0) -> DimPlacements:
    """A strategy's placements on one mesh dim (what `FixedMeshDim` keeps)."""
    on_dim = lambda layouts: tuple(None if lay is None else lay.placements[mesh_dim] for lay in layouts)  # noqa: E731
    return on_dim(strategy.outputs), on_dim(strategy.inputs)


@dataclass
class ProblemSpec:
    """User constraints on top of the graph (layouts are text or Layout)."""

    input_layouts: dict[int, Layout] = field(default_factory=dict)  # user input index -> layout
    output_layouts: dict[int, Layout] = field(default_factory=dict)  # model output index -> layout
    pins: dict[str, Layout] = field(default_factory=dict)  # parameter FQN pattern -> layout
    param_memory_bytes: float | None = None  # parameter bytes per rank; None: no such budget (the memory
    #                                          limit, `driver.fit`, bounds what a rank holds)
    recompute: bool = False  # activation checkpointing of every repeated block
    reshard: bool = False  # reshard after forward: every repeated block gathers its parameters again in the backward
    fixed_dim: FixedMeshDim | None = None  # placements decided on one mesh dim before the ILP
    micro_batches: int = 1  # gradient accumulation: the graph is one of these per optimizer step
    # a pipeline stage's boundary: its output (sent on, not a loss), that output's gradient (the
    # tangent) and each input's gradient (sent back) are in this layout, as the neighbours' are
    stage_layout: Layout | None = None


def _placeholder_strategies(
    node: fx.Node, catalog: StrategyCatalog, allowed: Layout | None, fixed_dim: FixedMeshDim | None
) -> list[Strategy]:
    """Every even layout of a placeholder (or just `allowed`; those `fixed_dim` keeps). The
    catalog shares the Strategy objects per shape: placeholders of repeated blocks then share
    cost matrices."""
    choices = catalog.source_strategies(node.meta["val"].shape)
    if fixed_dim is not None:
        choices = [choices[i] for i in fixed_dim.keep(node.name, choices)]
    if allowed is None:
        return list(choices)
    return [s for s in choices if s.outputs[0] == allowed]


def _with_output(node: fx.Node, choices: Sequence[Strategy], index: int, layout: Layout, mesh_shape) -> list[int]:
    """Which strategies (indices) of model output `index` produce `layout`."""
    shape = tuple(node.meta["val"].shape)
    try:
        layout.validate(len(shape), mesh_shape)
    except ValueError as err:
        raise ValueError(f"output {index} (shape {shape}): {err}") from None
    kept = [i for i, s in enumerate(choices) if s.outputs[0] == layout]
    if not kept:
        raise ValueError(f"output {index}: layout {layout} does not split shape {shape} evenly on mesh {mesh_shape}")
    return kept


@dataclass
class Choices:
    """Per node name: its strategies, their compute costs, its fx node and its input producers
    (`alias` maps a getitem to the output of its parent it reads)."""

    strategies: dict[str, list[Strategy]] = field(default_factory=dict)
    compute_s: dict[str, list[float]] = field(default_factory=dict)
    fx_nodes: dict[str, fx.Node] = field(default_factory=dict)
    inputs: dict[str, list[Producer]] = field(default_factory=dict)
    alias: dict[fx.Node, Producer] = field(default_factory=dict)


def collect_choices(
    c: Choices,
    graph: JointGraph,
    catalog: StrategyCatalog,
    pricer: ComputePricer,
    spec: ProblemSpec,
    mesh_shape: tuple[int, ...],
) -> None:
    """Every placeholder's and op's strategies (pinned parameters, fixed input and output layouts
    kept to the one they allow) and their compute costs."""
    param_fqn = graph.param_names
    user_inputs = {node: i for i, node in enumerate(graph.inputs)}
    pins = _resolve_pins(graph, spec.pins, mesh_shape)
    tangents = set(graph.tangents)

    for node in graph.nodes:
        if node.op == "placeholder":
            if node in param_fqn:
                fixed = pins.get(param_fqn[node])
            elif node in user_inputs:
                fixed = spec.input_layouts.get(user_inputs[node])
            elif node in tangents and node.meta["val"].dim() > 0:  # a stage's output's gradient
                fixed = spec.stage_layout
            else:
                fixed = None
            c.strategies[node.name] = _placeholder_strategies(node, catalog, fixed, spec.fixed_dim)
            c.compute_s[node.name] = [0.0] * len(c.strategies[node.name])
            if not c.strategies[node.name]:
                what = param_fqn.get(node) or f"input {user_inputs.get(node, node.name)}"
                raise ValueError(
                    f"{what}: layout {fixed} does not split shape {tuple(node.meta['val'].shape)} "
                    f"evenly on mesh {mesh_shape}"
                )
        elif node.op == "call_function":
            if node.target is operator.getitem:
                parent, index = node.args
                c.alias[node] = Producer(c.alias[parent].node if parent in c.alias else parent.name, index)
                continue
            choices = catalog.strategies(node)
            costs = pricer.node_compute_s(node, choices)
            output = graph.output_index(node)
            if output in spec.output_layouts:
                kept = _with_output(node, choices, output, spec.output_layouts[output], mesh_shape)
                choices, costs = [choices[i] for i in kept], [costs[i] for i in kept]
            if spec.fixed_dim is not None:
                kept = spec.fixed_dim.keep(node.name, choices)
                choices, costs = [choices[i] for i in kept], [costs[i] for i in kept]
            c.strategies[node.name], c.compute_s[node.name] = list(choices), list(costs)
        elif node.op == "get_attr" and isinstance(node.meta.get("val"), torch.Tensor):
            # a constant the forward made (`torch.tensor(...)`, a scalar written into a tensor):
            # every rank holds all of it; its readers take it in whatever layout is cheapest
            c.strategies[node.name] = [Strategy(outputs=(Layout.replicate(len(mesh_shape)),), inputs=())]
            c.compute_s[node.name] = [0.0]
        else:
            continue
        c.fx_nodes[node.name] = node
        c.alias[node] = Producer(node.name, 0)
        c.inputs[node.name] = [c.alias[slot] for slot in input_slots(node)] if node.op == "call_function" else []


def add_sinks(c: Choices, graph: JointGraph, mesh_shape: tuple[int, ...], stage_layout: Layout | None = None) -> None:
    """Sinks: the loss stays replicated (a pipeline stage's output and its inputs' gradients
    land in `stage_layout`); each gradient lands in its parameter's layout."""
    if graph.input_grads and stage_layout is None:
        raise ValueError("inputs that require a gradient are a pipeline stage's: plan it with a stage layout")
    loss = c.alias[graph.loss]
    scalar = graph.loss.meta["val"].dim() == 0  # a last stage's output is its loss
    out = Layout.replicate(len(mesh_shape)) if scalar or stage_layout is None else stage_layout
    c.strategies[LOSS_SINK] = [Strategy(outputs=(), inputs=(out,))]
    c.compute_s[LOSS_SINK] = [0.0]
    c.fx_nodes[LOSS_SINK], c.inputs[LOSS_SINK] = graph.loss, [loss]
    for index, grad in graph.input_grads.items():
        name = input_grad_sink(index)
        c.strategies[name] = [Strategy(outputs=(), inputs=(stage_layout,))]
        c.compute_s[name] = [0.0]
        c.fx_nodes[name], c.inputs[name] = grad, [c.alias[grad]]
    for fqn, grad in graph.grads.items():
        name = grad_sink(fqn)
        param_choices = c.strategies[graph.params[fqn].name]
        c.strategies[name] = [Strategy(outputs=(), inputs=s.outputs) for s in param_choices]
        c.compute_s[name] = [0.0] * len(param_choices)
        c.fx_nodes[name], c.inputs[name] = grad, [c.alias[grad]]


def optimizer_step_s(
    graph: JointGraph, strategies: dict[str, list[Strategy]], device: DeviceProfile, mesh_shape: tuple[int, ...]
) -> dict[str, list[float]]:
    """Per trained parameter: the optimizer step's seconds over its local elements, per choice."""
    out = {}
    for fqn, node in graph.params.items():
        if fqn in graph.grads:
            shape = tuple(node.meta["val"].shape)
            out[node.name] = [
                device.optimizer_s(math.prod(s.outputs[0].local_shape(shape, mesh_shape)))
                for s in strategies[node.name]
            ]
    return out


def _resolve_pins(graph: JointGraph, pins: dict[str, Layout], mesh_shape) -> dict[str, Layout]:
    """Parameter FQN -> pinned layout; two patterns pinning one parameter differently is an error."""
    chosen: dict[str, tuple[str, Layout]] = {}
    for pattern, layout in pins.items():
        layout = Layout.parse(layout) if isinstance(layout, str) else layout
        matched = [fqn for fqn in graph.params if fnmatch.fnmatchcase(fqn, pattern)]
        if not matched:
            raise ValueError(f"pin {pattern!r} matches no parameter")
        for fqn in matched:
            shape = tuple(graph.params[fqn].meta["val"].shape)
            layout.validate(len(shape), mesh_shape)
            if fqn in chosen and chosen[fqn][1] != layout:
                raise ValueError(
                    f"conflicting pins for {fqn}: {chosen[fqn][0]!r} -> {chosen[fqn][1]} and {pattern!r} -> {layout}"
                )
            chosen[fqn] = (pattern, layout)
    return {fqn: layout for fqn, (_, layout) in chosen.items()}
