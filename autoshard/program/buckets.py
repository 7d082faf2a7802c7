"""Grouping a program's collectives and placing them: a block's parameter gathers (gradient
reductions) become one `Bucket` (`bucket`), and each bucket is launched ahead of its wait
(`overlap`), as FSDP2 prefetches. Both move nodes of the lowered joint graph; values never change."""

from __future__ import annotations

import itertools
import operator
from typing import Any

from torch import fx, nn

from autoshard.capture.precision import gradient_tail, is_cast
from autoshard.capture.regions import block_of
from autoshard.problem.plan import Plan
from autoshard.program.modules import AWAIT, LOCAL_SHAPE, Bucket, Redistribute


def bucket(plan: Plan, joint: fx.Graph, modules: dict[str, nn.Module], mesh: Any) -> None:
    """Group parameter all-gathers (plans starting with one, reading a parameter or its mixed
    precision cast) and gradient reduce-scatters (plans starting with one, on an edge where the
    plan reduces a gradient) by (block, mesh dims, dtype); each group of 2+ becomes one `Bucket`.
    Gathers run per block at first use, scatters once every member's gradient is ready."""
    graph = plan.graph
    output = next(iter(reversed(joint.nodes)))
    grad_of = dict(zip(output.args[0][1:], graph.params))  # gradient redistribution -> FQN
    param_of = {node: fqn for fqn, param in graph.params.items()
                for node in [param, *(u for u in param.users if is_cast(u))]}
    tail_of = {node.name: fqn for fqn, grad in graph.grads.items() for node in gradient_tail(grad)}
    groups: dict[tuple, list[fx.Node]] = {}
    grad_kind: set[fx.Node] = set()  # gradient reductions (the rest are parameter gathers)
    for node in joint.nodes:
        if node.op != "call_module" or not modules[node.target].plan.steps:
            continue
        module = modules[node.target]
        first = module.plan.steps[0]
        source = node.args[0].meta.get("autoshard_source")
        if first.kind == "all_gather" and source in param_of:
            fqn = param_of[source]
        elif first.kind == "reduce_scatter" and (node in grad_of or module.consumer in tail_of):
            fqn = grad_of.get(node) or tail_of[module.consumer]
            grad_kind.add(node)
        else:
            continue
        dtype = source.meta["val"].dtype
        groups.setdefault((first.kind, block_of(fqn), tuple(sorted(first.mesh_dims)), dtype), []).append(node)
    order = _Positions(joint)
    for members in groups.values():
        if len(members) < 2:
            continue
        site = _bucket_site(order, members, output, gradients=members[0] in grad_kind)
        if site is None:
            continue
        name = f"bucket_{sum(isinstance(m, Bucket) for m in modules.values())}"
        modules[name] = Bucket(name, [modules[m.target] for m in members], mesh)
        with joint.inserting_before(site):
            bucket = joint.call_module(name, tuple(m.args[0] for m in members))
            bucket.meta[LOCAL_SHAPE] = [m.meta[LOCAL_SHAPE] for m in members]
            order.inserted(bucket, site)
            for i, member in enumerate(members):
                item = joint.call_function(operator.getitem, (bucket, i))
                item.meta[LOCAL_SHAPE] = member.meta[LOCAL_SHAPE]
                order.inserted(item, site)
                member.replace_all_uses_with(item)
        for member in members:
            joint.erase_node(member)
            del modules[member.target]


class _Positions:
    """Graph positions kept up to date while nodes move or are inserted (numbering the graph
    again per bucket is quadratic: 16 s for llama3-70b). A node placed before `anchor` gets a
    position between the anchor's predecessor and the anchor, after anything placed there before."""

    def __init__(self, graph: fx.Graph):
        self.pos = {n: float(i) for i, n in enumerate(graph.nodes)}
        self.placed = itertools.count(1)

    def __getitem__(self, node: fx.Node) -> float:
        return self.pos[node]

    def inserted(self, node: fx.Node, anchor: fx.Node) -> None:
        self.pos[node] = self.pos[anchor] - 0.5 + 1e-7 * next(self.placed)

    def move_before(self, node: fx.Node, anchor: fx.Node) -> None:
        anchor.prepend(node)
        self.inserted(node, anchor)


def _bucket_site(order: _Positions, members: list[fx.Node], output: fx.Node, gradients: bool) -> fx.Node | None:
    """Where a bucket runs: before its first member when every member's input exists by then or
    is computed from parameters alone (a mixed-precision cast, maybe of a redistributed parameter:
    it moves up). Otherwise, for gradient reductions, just before the output, with what the
    members fed (the rest of each gradient's tail, which feeds only the output) moved after it;
    for anything else None: not bucketed."""
    start = order[members[0]]
    late: list[fx.Node] = []

    def from_parameters(node: fx.Node) -> bool:
        if node.op == "placeholder" or order[node] < start or node in late:
            return True
        if not (is_cast(node) or node.op == "call_module") or not all(map(from_parameters, node.all_input_nodes)):
            return False
        late.append(node)
        return True

    if all(from_parameters(m.args[0]) for m in members):
        for node in sorted(late, key=order.__getitem__):
            order.move_before(node, members[0])
        return members[0]
    if not gradients:
        return None
    downstream: dict[fx.Node, None] = {}
    stack = [u for m in members for u in m.users]
    while stack:
        node = stack.pop()
        if node is not output and node not in downstream:
            downstream[node] = None
            stack.extend(node.users)
    moved = sorted(downstream, key=order.__getitem__)
    for node in moved:
        order.move_before(node, output)
    return moved[0] if moved else output


def overlap(graph: fx.Graph, modules: dict[str, nn.Module], prefetch: int) -> None:
    """Give every bucket its wait (an `AwaitBucket` node, where the results are first needed) and
    move launches ahead of it, as FSDP2 schedules its collectives:
    - parameter gathers: gather k launches just after gather k-`prefetch` is waited on, so the
      rank computes one block while the next blocks' parameters arrive; at most `prefetch`
      gathers in flight beside the one in use;
    - gradient reductions: each launches as soon as its gradients exist and is waited on just
      before reduction k+`prefetch` launches (at most `prefetch` in flight), or where its result
      is first read, if that is earlier.
    Values do not change: only where each collective starts and where the rank waits for it."""
    buckets = [n for n in graph.nodes if n.op == "call_module" and isinstance(modules[n.target], Bucket)]
    waits: dict[fx.Node, fx.Node] = {}
    for launch in buckets:
        with graph.inserting_after(launch):
            wait = graph.call_module(AWAIT, (launch,))
        launch.replace_all_uses_with(wait, delete_user_cb=lambda user: user is not wait)
        wait.meta[LOCAL_SHAPE] = launch.meta.pop(LOCAL_SHAPE, None)
        waits[launch] = wait
    if prefetch == 0:
        return
    gathers = [b for b in buckets if modules[b.target].kind == "all_gather"]
    reductions = [b for b in buckets if modules[b.target].kind == "reduce_scatter"]
    pos = _numbered(graph)
    for k in range(prefetch, len(gathers)):
        _launch_early(gathers[k], waits[gathers[k - prefetch]], pos, modules)
    for launch in reductions:
        _launch_early(launch, None, pos, modules)
    pos = _numbered(graph)
    reductions.sort(key=pos.__getitem__)
    for k in range(len(reductions) - prefetch):
        wait, bound = waits[reductions[k]], reductions[k + prefetch]
        if pos[wait] > pos[bound]:
            for node in [wait, *wait.users]:  # the wait and its getitems; their readers come later
                bound.prepend(node)


def _numbered(graph: fx.Graph) -> dict[fx.Node, float]:
    return {n: float(i) for i, n in enumerate(graph.nodes)}


def _launch_early(launch: fx.Node, after: fx.Node | None, pos: dict[fx.Node, float],
                  modules: dict[str, nn.Module]) -> None:
    """Move `launch` up to just after `after` (None: as early as its inputs allow). Inputs computed
    later from parameters alone (mixed-precision casts, redistributions) move up with it; any
    other input holds it just after that input."""
    if after is not None and pos[after] >= pos[launch]:
        return
    late: list[fx.Node] = []
    seen: set[fx.Node] = set()
    stack = list(launch.all_input_nodes)
    movable = True
    while stack and after is not None:
        node = stack.pop()
        if node in seen or pos[node] <= pos[after]:
            continue
        seen.add(node)
        movable &= is_cast(node) or (node.op == "call_module" and isinstance(modules[node.target], Redistribute))
        late.append(node)
        stack.extend(node.all_input_nodes)
    if after is None or not movable:
        anchor = max([*launch.all_input_nodes, *([after] if after is not None else [])], key=pos.__getitem__)
        if anchor.op == "placeholder":  # nothing runs among the placeholders
            anchor = max((n for n in pos if n.op == "placeholder"), key=pos.__getitem__)
        late = []
    else:
        anchor = after
    if pos[anchor] >= pos[launch]:
        return
    cursor = anchor
    for i, node in enumerate(sorted(late, key=pos.__getitem__) + [launch], start=1):
        cursor.append(node)
        pos[node] = pos[anchor] + i * 1e-6
        cursor = node
