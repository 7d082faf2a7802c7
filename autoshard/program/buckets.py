"""Grouping a program's collectives and placing them: a block's parameter gathers (gradient
reduce-scatters) become one `Bucket`, as FSDP2 groups them; gradient all-reduces (replicated
parameters) become size-capped buckets in the order the backward produces the gradients, as DDP
groups them (`bucket`). Each bucket is launched ahead of its wait (`overlap`): FSDP2's prefetch,
DDP's all-reduce of a bucket as soon as its last gradient exists. Both move nodes of the lowered
joint graph; values never change."""

from __future__ import annotations

import heapq
import itertools
import math
import operator
from typing import Any

from torch import fx, nn

from autoshard.capture.precision import gradient_tail, is_cast
from autoshard.capture.regions import block_of
from autoshard.problem.plan import Plan
from autoshard.program.modules import AWAIT, LOCAL_SHAPE, Bucket, Redistribute

DEFAULT_BUCKET_BYTES = 25 * 2**20  # DDP's bucket_cap_mb


def bucket(
    plan: Plan, joint: fx.Graph, modules: dict[str, nn.Module], mesh: Any, cap_bytes: float = DEFAULT_BUCKET_BYTES
) -> None:
    """Group parameter all-gathers (plans starting with one, reading a parameter or its mixed
    precision cast) and gradient reduce-scatters (plans starting with one, on an edge where the
    plan reduces a gradient) by (block, mesh dims, dtype), and gradient all-reduces by (mesh dims,
    dtype) into buckets of at most `cap_bytes` (one gradient larger than that alone), filled in
    the order the backward produces the gradients; each group of 2+ becomes one `Bucket`.
    Gathers run per block at first use, reductions once every member's gradient is ready."""
    graph = plan.graph
    output = next(iter(reversed(joint.nodes)))
    grad_of = dict(zip(output.args[0][1:], graph.trained))  # gradient redistribution -> FQN
    param_of = {
        node: fqn for fqn, param in graph.params.items() for node in [param, *(u for u in param.users if is_cast(u))]
    }
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
        elif first.kind in ("reduce_scatter", "all_reduce") and (node in grad_of or module.consumer in tail_of):
            fqn = grad_of.get(node) or tail_of[module.consumer]
            grad_kind.add(node)
        else:
            continue
        dtype = source.meta["val"].dtype
        block = block_of(fqn) if first.kind != "all_reduce" else None  # DDP's buckets span blocks
        groups.setdefault((first.kind, block, tuple(sorted(first.mesh_dims)), dtype), []).append(node)
    order = _Positions(joint)
    # gathers and per-block reduce-scatters first, then the all-reduces; a group of gradient
    # reductions is cut into buckets knowing the dependencies the buckets made so far add (a
    # bucket joins its members' paths into one collective)
    for key, members in sorted(groups.items(), key=lambda item: item[0][0] == "all_reduce"):
        if members[0] not in grad_kind:
            _make_bucket(joint, modules, mesh, order, output, members, gradients=False, block=key[1])
            continue
        upstream = _reductions_upstream(grad_kind, order)
        cap = cap_bytes if key[0] == "all_reduce" else math.inf
        for chunk in _ready_buckets(members, modules, order, upstream, cap):
            chunk.sort(key=order.__getitem__)
            _make_bucket(joint, modules, mesh, order, output, chunk, gradients=True, block=key[1])


def _make_bucket(
    joint: fx.Graph,
    modules: dict[str, nn.Module],
    mesh: Any,
    order: _Positions,
    output: fx.Node,
    members: list[fx.Node],
    gradients: bool,
    block: tuple[str, int] | None,
) -> None:
    """2+ redistributions (in program order) replaced by one `Bucket` and a getitem per member,
    where `_bucket_site` finds room for it."""
    site = _bucket_site(order, members, output, gradients) if len(members) > 1 else None
    if site is None:
        return
    name = f"bucket_{sum(isinstance(m, Bucket) for m in modules.values())}"
    modules[name] = Bucket(name, [modules[m.target] for m in members], mesh, block)
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


def _reductions_upstream(reductions: set[fx.Node], order: _Positions) -> dict[fx.Node, int]:
    """Per node computed from gradient reductions (or one itself), which, as a bit mask; nodes
    not listed are computed from none. Walks only what the reductions feed (a gradient's tail,
    buckets, the output) in program order: a few nodes per parameter, not the whole graph."""
    bit = {m: 1 << i for i, m in enumerate(reductions) if m.graph is not None and m in order.pos}
    upstream: dict[fx.Node, int] = {}
    heap = [(order[m], i, m) for i, m in enumerate(bit)]
    heapq.heapify(heap)
    tie = itertools.count(len(heap))
    while heap:
        _, _, node = heapq.heappop(heap)
        if node in upstream:
            continue
        mask = bit.get(node, 0)
        for arg in node.all_input_nodes:
            mask |= upstream.get(arg, 0)
        upstream[node] = mask
        for user in node.users:
            if user not in upstream:
                heapq.heappush(heap, (order[user], next(tie), user))
    return upstream


def _ready_buckets(
    members: list[fx.Node],
    modules: dict[str, nn.Module],
    order: _Positions,
    upstream: dict[fx.Node, int],
    cap_bytes: float,
) -> list[list[fx.Node]]:
    """`members` (gradient reductions) in the order their gradients are computed, cut into
    consecutive buckets of at most `cap_bytes` of input each; a member computed from the result
    of one already in the bucket (a gradient reduced over one mesh dim, then over another)
    starts the next bucket: one collective cannot wait for itself."""
    ready = sorted(members, key=lambda m: order[m.args[0]])
    out: list[list[fx.Node]] = []
    size, inside = 0.0, 0
    for m in ready:
        nbytes = modules[m.target].plan.steps[0].in_bytes
        if not out or size + nbytes > cap_bytes or upstream.get(m.args[0], 0) & inside:
            out.append([])
            size, inside = 0.0, 0
        out[-1].append(m)
        size += nbytes
        inside |= upstream[m]
    return out


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
    - parameter gathers, by block (a block's gathers over different mesh dims or in different
      dtypes are one unit, as one FSDP module's): block k's launch just after block k-`prefetch`'s
      first gather is waited on, so the rank computes one block while the next blocks' parameters
      arrive; at most `prefetch` blocks' gathers in flight beside the block in use;
    - gradient reduce-scatters: each launches as soon as its gradients exist and is waited on just
      before reduction k+`prefetch` launches (at most `prefetch` in flight), or where its result
      is first read, if that is earlier;
    - gradient all-reduces (DDP's buckets): each launches as soon as its gradients exist and is
      waited on where its result is first read (the end of the backward), as DDP waits for all of
      them before the optimizer; the output is the size of the gradients, which live anyway.
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
    units: list[list[fx.Node]] = []
    for launch in gathers:
        block = modules[launch.target].block
        if not units or block is None or modules[units[-1][0].target].block != block:
            units.append([])
        units[-1].append(launch)
    pos = _numbered(graph)
    for k in range(prefetch, len(units)):
        after = min((waits[g] for g in units[k - prefetch]), key=pos.__getitem__)
        for launch in units[k]:
            _launch_early(launch, after, pos, modules)
    for launch in reductions + [b for b in buckets if modules[b.target].kind == "all_reduce"]:
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


def _launch_early(
    launch: fx.Node, after: fx.Node | None, pos: dict[fx.Node, float], modules: dict[str, nn.Module]
) -> None:
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
