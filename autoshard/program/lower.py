"""Lower a plan to the program every rank runs: the traced joint graph on local shards.

Each op of the joint graph runs unchanged on this rank's shard; the only rewrites are
- every edge the plan redistributes calls a `Redistribute` module that runs exactly the planner's
  plan (the one the ILP paid for) with our executor, and
- size arguments of view/expand/factory ops become the output's local shape, and
- devices (casts, factory ops: the trace ran on CPU) become the mesh's device, and on a GPU mesh
  the trace's CPU-only attention ops become the device's own (`attention.py`), and
- the routed-experts ops become this rank's form of the chosen strategy, all-to-alls included
  under expert parallelism (`experts.py`).

A block's parameter gathers (gradient reduce-scatters) become one `Bucket` each, gradient all-reduces
size-capped buckets in the backward's order (`buckets.py`). The joint graph is
then split in two (`split.py`): `forward` (everything the loss needs, returning the loss and the
values the backward reads) and `backward` (the rest: tangent in, gradients out, each already in its
parameter's layout). A value computed in the forward is handed over, unless the plan recomputes
its block (`Plan.recomputed`). Each bucket is launched ahead of its wait (`buckets.overlap`), as
FSDP2 prefetches, and the program's step is modeled on streams (`schedule.model_step`: one
computes, each mesh dim's link communicates).
The first run of either half can be checked node by node against the local shapes the plan
implies (`CheckedRun`), so a lowering mistake names its node instead of corrupting numbers.
"""

from __future__ import annotations

import itertools
import operator
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn

from autoshard.layout import Layout
from autoshard.problem.plan import Plan
from autoshard.program.accumulate import Accumulator, hold_reductions
from autoshard.program.attention import ON_DEVICE
from autoshard.program.buckets import DEFAULT_BUCKET_BYTES, bucket
from autoshard.program.collectives import dim_order, prepare_groups
from autoshard.program.experts import REGIONS, prepare_expert_groups
from autoshard.program.modules import AWAIT, LOCAL_SHAPE, Redistribute
from autoshard.program.random import RandomStream, SeededOp, draws, shard_key
from autoshard.program.schedule import StepModel, model_step
from autoshard.program.split import split
from autoshard.program.weights import Halves
from autoshard.strategies.call import OpCall

aten = torch.ops.aten

# Ops whose argument at this index is the (global) output size: it becomes the local one.
_SIZE_ARG = {
    aten.view.default: 1,
    aten._unsafe_view.default: 1,
    aten.reshape.default: 1,
    aten.expand.default: 1,
    aten.new_empty.default: 1,
    aten.new_zeros.default: 1,
    aten.new_ones.default: 1,
    aten.new_full.default: 1,
    aten.full.default: 0,
    aten.zeros.default: 0,
    aten.ones.default: 0,
    aten.empty.memory_format: 0,
    aten.empty_strided.default: 0,
    aten.slice_backward.default: 1,
    aten.select_backward.default: 1,  # input_sizes (HF's rotate_half)
}


@dataclass
class CommStats:
    """Collectives one training step runs per rank, read off the lowered program."""

    count: dict[str, Counter] = field(default_factory=dict)  # phase -> kind -> collectives
    bytes: dict[str, Counter] = field(default_factory=dict)  # phase -> kind -> bytes sent per rank
    steps: dict[str, list[tuple[str, str, str, tuple[int, ...]]]] = field(default_factory=dict)
    # phase -> (producer, consumer, kind, mesh dims) of every collective, in program order

    def total_count(self) -> Counter:
        return sum(self.count.values(), Counter())

    def total_bytes(self) -> Counter:
        return sum(self.bytes.values(), Counter())


@dataclass
class HeldBackward:
    """The backward of every micro-batch but the last (`accumulate.py`): `graph(*saved, tangent,
    *accumulated) -> (*grads of the parameters not held, *accumulated)`, the held reductions'
    sums returned instead of reduced."""

    graph: fx.GraphModule
    params: list[int]  # positions in `grad_names` of the parameters whose gradients are held
    accumulators: list[Accumulator]
    comm: CommStats  # forward and held backward: the collectives of such a micro-batch
    step: StepModel  # the modeled forward + held backward


@dataclass
class Program:
    """The per-rank step: `forward(*params, *buffers, *inputs) -> (loss, *saved)` and
    `backward(*saved, tangent) -> grads` (one per trained parameter, in `grad_names` order: the
    frozen ones, `requires_grad=False`, get none; then, for a pipeline stage, one per input in
    `input_grads`: its output is not a loss, and the tangent is its gradient). Lowered to
    accumulate (`held` set), the backward also takes the held reductions' sums so far, after the
    tangent, and reduces them with its own."""

    forward: fx.GraphModule
    backward: fx.GraphModule
    param_names: list[str]
    buffer_names: list[str]
    input_shapes: list[tuple[tuple[int, ...], Layout]]  # (global shape, layout) per user input
    comm: CommStats
    step: StepModel  # modeled step time on streams, as this program overlaps its collectives
    random: RandomStream = field(default_factory=RandomStream)  # the seed and step its random ops draw from
    device_type: str = "cpu"  # the mesh's: where its values live (a dry run makes its fakes there)
    held: HeldBackward | None = None  # lowered to accumulate gradients over micro-batches
    grad_names: list[str] = field(default_factory=list)  # the trained parameters, in `param_names` order
    input_grads: list[int] = field(default_factory=list)  # the inputs whose gradients the backward returns
    halves: Halves | None = None  # lowered for a zero-bubble schedule: the backward's input and weight halves

    def step_s(self, micro_batches: int = 1) -> float:
        """Modeled seconds of an optimizer step of `micro_batches` micro-batches, on streams:
        all but the last run the held backward, and no optimizer step."""
        if micro_batches == 1:
            return self.step.overlapped_s
        if self.held is None:
            raise ValueError("the program was not lowered to accumulate gradients (accumulate=True)")
        held = self.held.step
        return (micro_batches - 1) * (held.overlapped_s - held.optimizer_s) + self.step.overlapped_s

    @property
    def backward_held(self) -> fx.GraphModule:
        if self.held is None:
            raise ValueError("the program was not lowered to accumulate gradients (accumulate=True)")
        return self.held.graph

    @property
    def backward_input(self) -> fx.GraphModule:
        return self._halves.input

    @property
    def backward_weight(self) -> fx.GraphModule:
        return self._halves.weight

    @property
    def backward_weight_held(self) -> fx.GraphModule:
        held = self._halves.weight_held
        if held is None:
            raise ValueError("the program was not lowered to accumulate gradients (accumulate=True)")
        return held

    @property
    def _halves(self) -> Halves:
        if self.halves is None:
            raise ValueError("the program was not lowered with its backward in halves (apart=True)")
        return self.halves


def lower(
    plan: Plan,
    mesh: Any,
    prefetch: int = 1,
    bucket_bytes: float = DEFAULT_BUCKET_BYTES,
    accumulate: bool = False,
    apart: bool = False,
) -> Program:
    """The per-rank program of `plan` on `mesh` (a DeviceMesh of the plan's mesh shape). Bucketed
    collectives run `prefetch` blocks (gathers) or buckets (reductions) ahead of their use
    (`buckets.overlap`); 0 waits on each at once.
    Gradient all-reduces are bucketed up to `bucket_bytes` each (DDP's bucket_cap_mb).
    `accumulate`: also the backward that holds gradient all-reduces for a later micro-batch.
    `apart`: also the backward in an input and a weight half (`weights.py`), for a pipeline stage
    under a zero-bubble schedule."""
    if prefetch < 0:
        raise ValueError(f"prefetch must be >= 0, got {prefetch}")
    if not bucket_bytes > 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    if tuple(mesh.shape) != plan.mesh_shape:
        raise ValueError(f"the plan is for mesh {plan.mesh_shape}, got a mesh of shape {tuple(mesh.shape)}")
    if mesh.mesh_dim_names is None and any(len(st.mesh_dims) > 1 for r in plan.redistributions for st in r.plan.steps):
        raise ValueError(
            "the plan runs collectives over several mesh dims at once, which needs a DeviceMesh "
            "with mesh_dim_names (init_device_mesh(..., mesh_dim_names=('dp', 'tp')))"
        )
    prepare_groups([r.plan for r in plan.redistributions], mesh)
    prepare_expert_groups(plan, mesh)
    stream = RandomStream()
    joint, modules = _local_joint_graph(plan, mesh, stream)
    held = hold_reductions(plan, joint, modules) if accumulate else None
    bucket(plan, joint, modules, mesh, bucket_bytes)
    forward, backward, backward_held, halves = split(plan, joint, modules, prefetch, held, apart)
    graph = plan.graph
    inputs = [(tuple(n.meta["val"].shape), lay) for n, lay in zip(graph.inputs, plan.input_layouts)]
    held_backward = None
    if held is not None and backward_held is not None:
        held_backward = HeldBackward(
            backward_held,
            [i for i, fqn in enumerate(graph.trained) if fqn in held.params],
            held.accumulators,
            _comm_stats(forward, backward_held),
            model_step(plan, [forward, backward_held]),
        )
    return Program(
        forward,
        backward,
        list(graph.params),
        list(graph.buffers),
        inputs,
        _comm_stats(forward, backward),
        model_step(plan, [forward, backward]),
        stream,
        mesh.device_type,
        held_backward,
        graph.trained,
        list(graph.input_grads),
        halves,
    )


# ---------------------------------------------------------------------------------- the local joint graph
def _local_joint_graph(plan: Plan, mesh: Any, stream: RandomStream) -> tuple[fx.Graph, dict[str, nn.Module]]:
    graph = plan.graph
    coordinate = mesh.get_coordinate()
    ms = plan.mesh_shape
    by_edge = {(r.consumer, r.slot): r for r in plan.redistributions}
    out = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    modules: dict[str, nn.Module] = {}

    def redistributed(value: fx.Node, consumer: str, slot: int) -> fx.Node:
        r = by_edge.get((consumer, slot))
        if r is None:
            return value
        name = f"redistribute_{len(modules)}"
        traced = value.meta["autoshard_source"].meta.get("val")
        order = dim_order(traced) if isinstance(traced, torch.Tensor) else None
        modules[name] = Redistribute(r.plan, mesh, r.producer, consumer, order, r.copy_s)
        node = out.call_module(name, (value,))
        node.meta[LOCAL_SHAPE] = r.plan.dst.local_shape(r.plan.shape, ms)
        return node

    for node in graph.nodes:
        if node.op == "output":
            continue
        if node.op == "placeholder":
            new = out.placeholder(node.name)
            new.meta[LOCAL_SHAPE] = _local_shapes(node, plan.strategies[node.name].outputs, ms)
        elif node.op == "get_attr":  # a constant the forward made: every rank holds all of it
            new = out.call_function(Constant(getattr(graph.gm, node.target), mesh.device_type, node.name), ())
            new.meta[LOCAL_SHAPE] = tuple(node.meta["val"].shape)
        elif node.target is operator.getitem:
            parent, index = node.args
            new = out.call_function(operator.getitem, (env[parent], index))
            new.meta[LOCAL_SHAPE] = env[parent].meta[LOCAL_SHAPE][index]
        else:
            strategy = plan.strategies[node.name]
            slot = itertools.count()
            args, kwargs = fx.node.map_arg(
                (node.args, node.kwargs), lambda n: redistributed(env[n], node.name, next(slot))
            )
            args, kwargs = _on_device(args, mesh.device_type), _on_device(kwargs, mesh.device_type)
            shapes = _local_shapes(node, strategy.outputs, ms)
            if node.target in _SIZE_ARG:
                i = _SIZE_ARG[node.target]
                args = args[:i] + (list(shapes),) + args[i + 1 :]
            target = node.target
            if target in REGIONS:  # an op that runs its own collectives under some strategies
                target = REGIONS[target](target, strategy.inputs, OpCall(node, ms).in_vals, mesh)
            if mesh.device_type != "cpu":  # CPU-only ops of the trace (attention): the device's own
                target = ON_DEVICE.get(target, target)
            if draws(node):  # drawn as DTensor would: the same on every rank holding its shard
                target = SeededOp(target, stream, shard_key(node, strategy.outputs[0], coordinate), mesh.device_type)
            new = out.call_function(target, args, kwargs)
            new.meta[LOCAL_SHAPE] = shapes
        new.meta["autoshard_source"] = node
        env[node] = new

    loss = redistributed(env[graph.loss], plan.loss_sink.name, 0)
    grads = [redistributed(env[graph.grads[fqn]], plan.grad_sinks[fqn].name, 0) for fqn in graph.trained]
    grads += [redistributed(env[graph.input_grads[i]], plan.input_grad_sinks[i].name, 0) for i in graph.input_grads]
    out.output((loss, *grads))
    return out, modules


class Constant:
    """A call_function target that gives a constant of the traced step (`torch.tensor(...)` in a
    forward) on the mesh's device, lifted as the trace lifted it: a fake copy under a dry run's
    fake mode, a fresh copy otherwise (an op that writes into it leaves the constant as it is)."""

    def __init__(self, value: torch.Tensor, device_type: str, name: str):
        self.value, self.__name__, self.__module__ = value.detach().to(device_type), name, __name__

    def __call__(self) -> torch.Tensor:
        return aten.lift_fresh_copy.default(self.value)


def _on_device(values: Any, device_type: str) -> Any:
    """`values` (an op's args or kwargs) with every device on the mesh's: the step is traced on
    CPU fake tensors, so casts and factory ops carry `device=cpu`, which on a CUDA mesh would copy
    each value to the host (or make it there) and fail at the next op."""
    on = lambda v: torch.device(device_type) if isinstance(v, torch.device) and v.type != device_type else v  # noqa: E731
    if isinstance(values, dict):
        return {k: on(v) for k, v in values.items()}
    return tuple(on(v) for v in values)


def _local_shapes(node: fx.Node, layouts, mesh_shape) -> Any:
    val = node.meta.get("val")
    if isinstance(val, (tuple, list)):  # several outputs: a list, one entry per output
        return [None if lay is None else lay.local_shape(tuple(v.shape), mesh_shape) for v, lay in zip(val, layouts)]
    lay = layouts[0]
    return None if lay is None or not isinstance(val, torch.Tensor) else lay.local_shape(tuple(val.shape), mesh_shape)


def _comm_stats(forward: fx.GraphModule, backward: fx.GraphModule) -> CommStats:
    """The collectives each phase of the program runs, in program order."""
    comm = CommStats()
    for phase, gm in (("forward", forward), ("backward", backward)):
        count, nbytes, steps = Counter(), Counter(), []
        for n in gm.graph.nodes:
            if n.op != "call_module" or n.target == AWAIT:
                continue
            for producer, consumer, kind, mesh_dims, size in gm.get_submodule(n.target).collectives():
                count[kind] += 1
                nbytes[kind] += size
                steps.append((producer, consumer, kind, mesh_dims))
        comm.count[phase], comm.bytes[phase], comm.steps[phase] = count, nbytes, steps
    return comm


# ---------------------------------------------------------------------------------- checked first run
class CheckedRun(fx.Interpreter):
    """Runs a lowered graph node by node and checks every tensor's local shape against the plan."""

    def run_node(self, n: fx.Node) -> Any:
        result = super().run_node(n)
        want = n.meta.get(LOCAL_SHAPE)
        if want is not None and _shapes(result, want) != want:
            src = n.meta.get("autoshard_source")
            what = f"{src.target} ({src.name})" if src is not None else n.name
            raise RuntimeError(
                f"autoshard lowering bug: {what} produced local shape {_shapes(result, want)}, the plan expects {want}"
            )
        return result


def _shapes(value: Any, like: Any) -> Any:
    """Local shape(s) of a node's value, in the form of its LOCAL_SHAPE entry."""
    if isinstance(like, list):
        return [None if w is None else tuple(v.shape) for v, w in zip(value, like)]
    return tuple(value.shape) if isinstance(value, torch.Tensor) else None
