"""Split a rank's local joint graph in two: `forward` (everything the loss needs, returning the loss
and the values the backward reads) and `backward` (the rest: tangent in, gradients out). A value
computed in the forward is handed over, unless the plan recomputes its block (`Plan.recomputed`):
then the backward computes it again just before its first use there, gathering a recomputed
bucket's members again as the plan priced it. Lowered to accumulate gradients, also the backward
that holds its reductions (`accumulate.py`). Each half's buckets are then launched ahead of their
waits (`buckets.overlap`).
"""

from __future__ import annotations

import operator

from torch import fx, nn

from autoshard import _torch_compat as tc
from autoshard.problem.plan import Plan
from autoshard.program.accumulate import ACCUMULATOR, HeldReductions, held_outputs, prune
from autoshard.program.buckets import overlap
from autoshard.program.modules import AWAIT, LOCAL_SHAPE, AwaitBucket, Bucket
from autoshard.program.weights import Halves, halves, subgraph


def split(
    plan: Plan,
    joint: fx.Graph,
    modules: dict[str, nn.Module],
    prefetch: int,
    held: HeldReductions | None = None,
    apart: bool = False,
) -> tuple[fx.GraphModule, fx.GraphModule, fx.GraphModule | None, Halves | None]:
    """(forward, backward, with `held` reductions the backward that returns their sums instead,
    with `apart` the backward's input and weight halves (`weights.py`)): forward = the loss and
    everything it depends on; backward = every other node. Values of a recomputed block
    (`plan.recompute_blocks`) that the backward reads are not handed over but computed again in
    the backward, from the block's inputs, just before their first use there. Each bucket is
    launched `prefetch` buckets ahead of its wait."""
    output = next(iter(reversed(joint.nodes)))
    loss, *grads = output.args[0]
    tangents = set(plan.graph.tangents)
    placeholders = [n for n in joint.nodes if n.op == "placeholder" and ACCUMULATOR not in n.meta]
    primal_inputs = [n for n in placeholders if n.meta["autoshard_source"] not in tangents]
    tangent_inputs = [n for n in placeholders if n.meta["autoshard_source"] in tangents]
    tangent_inputs += held.placeholders if held is not None else []
    needed = _forward_values(loss, modules)
    forward_nodes = [n for n in joint.nodes if n in needed and n.op != "placeholder"]
    backward_nodes = [n for n in joint.nodes if n not in needed and n.op not in ("placeholder", "output")]
    recomputed = _recomputable(plan, forward_nodes, modules, loss)
    saved_set = _handed_over(needed, recomputed, [*(a for n in backward_nodes for a in n.all_input_nodes), *grads])
    saved = [n for n in primal_inputs + forward_nodes if n in saved_set]

    fwd = subgraph(primal_inputs, forward_nodes, [loss, *saved])
    bwd = _backward_graph(saved, tangent_inputs, backward_nodes, grads, recomputed, modules, plan.recomputed)
    graphs = [fwd, bwd]
    if held is not None:
        outputs = held_outputs(grads, plan.graph.trained, held)
        graphs.append(
            _backward_graph(saved, tangent_inputs, backward_nodes, outputs, recomputed, modules, plan.recomputed)
        )
        prune(graphs[-1])
    cut: list[fx.Graph] = []
    if apart:
        trained = plan.graph.trained
        whole = _backward_graph(
            saved,
            tangent_inputs,
            backward_nodes,
            grads + (held.sums if held else []),
            recomputed,
            modules,
            plan.recomputed,
        )
        positions = None if held is None else [i for i, fqn in enumerate(trained) if fqn in held.params]
        cut = halves(whole, len(trained), len(grads) - len(trained), positions)
    modules[AWAIT] = AwaitBucket()
    for g in graphs + cut:
        overlap(g, modules, prefetch)

    def module(g: fx.Graph, name: str) -> fx.GraphModule:
        return tc.lazy_graph_module({k: modules[k] for k in _used_modules(g)}, g, name)

    forward, backward = module(graphs[0], "AutoshardForward"), module(graphs[1], "AutoshardBackward")
    backward_held = module(graphs[2], "AutoshardHeldBackward") if held is not None else None
    both = None
    if apart:
        weight_held = module(cut[2], "AutoshardHeldWeightBackward") if held is not None else None
        both = Halves(module(cut[0], "AutoshardInputBackward"), module(cut[1], "AutoshardWeightBackward"), weight_held)
    return forward, backward, backward_held, both


def _forward_values(loss: fx.Node, modules: dict[str, nn.Module]) -> set[fx.Node]:
    """The loss and every value it depends on; and a forward bucket's items, also those only the
    backward reads: the backward then reads them handed over (or recomputed), never out of a
    recomputed bucket."""
    needed: set[fx.Node] = set()
    stack = [loss]
    while stack:
        n = stack.pop()
        if n not in needed:
            needed.add(n)
            stack.extend(n.all_input_nodes)
    return needed | {
        u for n in needed if n.op == "call_module" and isinstance(modules[n.target], Bucket) for u in n.users
    }


def _handed_over(needed: set[fx.Node], recomputed: set[fx.Node], read: list[fx.Node]) -> set[fx.Node]:
    """What the backward reads from the forward (`read`: the values its nodes and gradients read),
    recomputable values replaced by what they are computed from, down to values handed over."""
    saved: set[fx.Node] = set()
    seen: set[fx.Node] = set()

    def reads(value: fx.Node) -> None:
        if value in seen or (value not in needed and value.op != "placeholder"):
            return
        seen.add(value)
        if value in recomputed:
            for arg in value.all_input_nodes:
                reads(arg)
        else:
            saved.add(value)

    for value in read:
        reads(value)
    return saved


def _recomputable(
    plan: Plan, forward_nodes: list[fx.Node], modules: dict[str, nn.Module], loss: fx.Node
) -> set[fx.Node]:
    """The forward nodes of this program that the plan recomputes (`plan.recomputed`, graph node
    names), with the redistributions into them (a bucket when any member's consumer is one)."""
    if not plan.recomputed:
        return set()
    names = plan.recomputed
    out: set[fx.Node] = set()
    for node in forward_nodes:  # in graph order: a bucket's getitems come after the bucket
        if node.op == "call_module":
            module = modules[node.target]
            members = module.members if isinstance(module, Bucket) else [module]
            hit = any(m.consumer in names for m in members)
        elif "autoshard_source" in node.meta:
            hit = node.meta["autoshard_source"].name in names
        else:  # a bucket's getitem: recomputed when its member's consumer is (the bucket gathers again
            parent, index = node.args  # only those; a member read by the backward is handed over)
            hit = parent in out and modules[parent.target].members[index].consumer in names
        if hit and node is not loss:
            out.add(node)
    return out


def _backward_graph(
    saved: list[fx.Node],
    tangents: list[fx.Node],
    nodes: list[fx.Node],
    outputs: list[fx.Node],
    recomputed: set[fx.Node],
    modules: dict[str, nn.Module],
    names: frozenset[str],
) -> fx.Graph:
    """The backward: `nodes` in order, except that recomputed forward values and backward nodes
    that do not depend on the tangent (the joint graph places those, e.g. `detach` of a saved
    value, at their forward position) are emitted, with what they need, just before their first
    reader: otherwise the backward would start by recomputing every block. A recomputed bucket
    gathers again only the members whose consumers are recomputed (`names`), as the plan priced it."""
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    tangent_dependent = set(tangents)
    for n in saved + tangents:
        env[n] = g.placeholder(n.name)
        env[n].meta.update(n.meta)
    for n in nodes:
        if any(a in tangent_dependent for a in n.all_input_nodes):
            tangent_dependent.add(n)
    lazy = recomputed | {n for n in nodes if n not in tangent_dependent}
    kept: dict[fx.Node, dict[int, int]] = {}  # recomputed bucket -> member index -> index in its copy

    def emit(n: fx.Node) -> None:
        if n in env:
            return
        assert n in lazy, f"{n.name} is neither handed over nor recomputed"
        for arg in n.all_input_nodes:
            emit(arg) if arg in lazy else None
        module = modules.get(n.target) if n.op == "call_module" else None
        if isinstance(module, Bucket) and n in recomputed:
            index = [i for i, m in enumerate(module.members) if m.consumer in names]
            kept[n] = {i: j for j, i in enumerate(index)}
            name = f"{n.target}_again"
            modules[name] = Bucket(name, [module.members[i] for i in index], module.mesh)
            env[n] = g.call_module(name, tuple(env[n.args[i]] for i in index))
            env[n].meta[LOCAL_SHAPE] = [n.meta[LOCAL_SHAPE][i] for i in index]
        elif n.op == "call_function" and n.target is operator.getitem and n.args[0] in kept:
            env[n] = g.call_function(operator.getitem, (env[n.args[0]], kept[n.args[0]][n.args[1]]))
            env[n].meta.update(n.meta)
        else:
            env[n] = g.node_copy(n, env.__getitem__)

    for n in nodes:
        if n in lazy:
            continue
        for arg in n.all_input_nodes:
            if arg in lazy:
                emit(arg)
        env[n] = g.node_copy(n, env.__getitem__)
    for n in outputs:
        if n in lazy:
            emit(n)
    g.output(tuple(env[n] for n in outputs))
    g.lint()
    return g


def _used_modules(graph: fx.Graph) -> list[str]:
    return list(dict.fromkeys(n.target for n in graph.find_nodes(op="call_module")))
