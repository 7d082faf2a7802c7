"""Graph redistribute planner: the cheapest sequence of collectives turning one Layout into another.

States are layouts; edges are the steps below, priced by `NetworkProfile` on the local bytes of the
state they leave (so a gather of a smaller shard is cheaper), plus the local copy a collective on a
tensor dim other than the outermost needs (what the executor runs: gather, then move into place).
Dijkstra (networkx) runs once per (source, shape, itemsize) and answers every destination, so the
ILP's many cost queries for one edge share one search; shortest-path costs satisfy the triangle
inequality by construction.

Steps (a tensor dim's order is a stack: only its last mesh dims can be popped; new ones are pushed):
  all_gather      pop the last k mesh dims of a tensor dim's order (k > 1: one flattened group)
  all_to_all      move the last k mesh dims of S(a)'s order to the end of S(b)'s order
  all_reduce      P -> R on one or several P mesh dims of the same reduce op
  reduce_scatter  P -> S(d) on one or several P mesh dims, pushed onto d's order in any order
  chunk           R -> S(d) on one mesh dim, pushed onto d's order (local)
  to_partial      R -> P (local; only useful toward a partial destination)
  permute         reorder a tensor dim's mesh dims in place: one point-to-point exchange
  reorder         relabel only (positions of size-1 mesh dims, which move no data)
Multi-dim steps are valid because a flattened group's rank is row-major over its mesh dims: taken
in the order the dims split the tensor dim, that is exactly the nested chunk index (the executor
permutes chunks when that order is not ascending). Mesh dims of size 1 never take part: layouts
are planned in a "physical" form where those dims are R.

Only even splits are planned: a layout (source, destination or intermediate) that splits a dim
unevenly raises ValueError (source/destination) or is avoided (intermediate).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import combinations, pairwise, permutations
from typing import Any

import networkx as nx

from autoshard.layout import Layout, P, Placement, R, S
from autoshard.pricing.ring import COLLECTIVE_KINDS, linear_cost, step_cost, wire_bytes
from autoshard.profiles.network import NetworkProfile


@dataclass(frozen=True)
class Step:
    """One redistribution step. `mesh_dims` of a grouped step are in the order whose row-major
    index is the chunk index (split order); `tensor_dims` are the dims it gathers/splits
    ((a, b) for all_to_all: from a to b)."""

    kind: str
    mesh_dims: tuple[int, ...]
    src: Layout
    dst: Layout
    tensor_dims: tuple[int, ...]
    cost_s: float
    bytes: float  # sent per rank
    in_bytes: float = 0.0  # the local input it reads
    fixed_s: float = 0.0  # the part of cost_s that does not grow with the bytes (launch, latency): one
    #                       collective carrying several steps' bytes (a bucket) pays it once

    def __str__(self) -> str:
        return f"{self.kind}{list(self.mesh_dims)} {self.src} -> {self.dst}"


@dataclass(frozen=True)
class RedistributePlan:
    steps: tuple[Step, ...]
    cost_s: float
    bytes_per_rank: float
    collective_counts: dict[str, int]
    src: Layout
    dst: Layout
    shape: tuple[int, ...]
    itemsize: int
    mesh_shape: tuple[int, ...]

    def __str__(self) -> str:
        body = "; ".join(str(s) for s in self.steps) or "no-op"
        return f"{self.src} -> {self.dst} ({self.cost_s * 1e6:.1f} us): {body}"


def reduces(src: Layout, dst: Layout) -> bool:
    """Whether redistributing `src` to `dst` sums partial values (a mesh dim partial before, not after)."""
    return any(a.kind == "P" and b.kind != "P" for a, b in zip(src.placements, dst.placements))


def holds_for_accumulation(plan: RedistributePlan) -> bool:
    """Whether a gradient's reduction can wait for the last of several micro-batches (a reduction
    is linear: reducing the sum once equals summing the reductions): all-reduces only (beside
    local steps), no partial mesh dim left after it, its input no larger on a rank than its
    output (so holding it costs no memory beyond the gradient's own size)."""
    kinds = {st.kind for st in plan.steps if st.kind in COLLECTIVE_KINDS}
    return (
        kinds == {"all_reduce"}
        and reduces(plan.src, plan.dst)
        and not any(p.kind == "P" for p in plan.dst.placements)
        and plan.src.local_shape(plan.shape, plan.mesh_shape) == plan.dst.local_shape(plan.shape, plan.mesh_shape)
    )


# move = (per-byte coefficient of the total tensor bytes, fixed seconds, kind, mesh_dims,
#         tensor_dims, group size)
_Move = tuple[float, float, str, tuple[int, ...], tuple[int, ...], int]

# kind -> local copy passes (in units of the step's local input bytes) per tensor dim it touches
# that is not outermost: a gather writes n times its input into place, a scatter/all-to-all
# reads its input once to lay the chunks out.
_COPY_PASSES = {
    "all_gather": lambda n: float(n),
    "reduce_scatter": lambda n: 1.0,
    "all_to_all": lambda n: 1.0,
}


class _Space:
    """The state graph for one tensor rank and set of partial ops, grown lazily from sources.

    Its nodes are ints (`ids[layout]`, `layouts[id]`): the searches' dict operations then hash
    and compare ints, where a Layout's Python-level __hash__ and __eq__ cost millions of calls
    on a 3D mesh."""

    def __init__(self, planner: Planner, ndim: int, ops: tuple[str, ...]):
        self.planner, self.ndim, self.ops = planner, ndim, ops
        self.graph = nx.DiGraph()
        self.ids: dict[Layout, int] = {}
        self.layouts: list[Layout] = []
        self.splits: dict[Layout, tuple[tuple[int, int], ...]] = {}  # (tensor dim, #shards)
        self.shards: dict[Layout, int] = {}  # total shards = global bytes / local bytes
        self._expanded: set[int] = set()
        # An edge's weight depends on the tensor, not on where a search starts: each tensor
        # (shape, itemsize) gets an int slot in every edge's data, priced once for all searches.
        self._slots: dict[tuple[tuple[int, ...], int], int] = {}
        self._priced: list[int] = []  # per slot: how many edges (of self._edges) it has priced
        self._edges: list[tuple[Layout, Layout, dict]] = []

    def ensure(self, source: Layout) -> int:
        """Grow the graph from `source`; returns its node."""
        start = self._node(source)
        todo = [start]
        while todo:
            i = todo.pop()
            if i in self._expanded:
                continue
            self._expanded.add(i)
            u = self.layouts[i]
            for move, v in self.planner._successors(u, self.ndim, self.ops):
                j = self.ids.get(v)
                if j is None:
                    j = self._node(v)
                    todo.append(j)
                kind, mesh_dims, tensor_dims, n = move
                per_byte, fixed = linear_cost(self.planner.profile, kind, mesh_dims, n)
                entry = (per_byte / self.shards[u], fixed, kind, mesh_dims, tensor_dims, n)
                if self.graph.has_edge(i, j):
                    self.graph[i][j]["moves"].append(entry)
                else:
                    self.graph.add_edge(i, j, moves=[entry])
                    self._edges.append((u, self.layouts[j], self.graph[i][j]))
        return start

    def weight_slot(self, shape: tuple[int, ...], itemsize: int) -> int:
        """The edge-data key holding this tensor's weights (None: the move's target does not split
        the shape evenly), priced on every edge the graph has so far."""
        slot = self._slots.get((shape, itemsize))
        if slot is None:
            slot = self._slots[(shape, itemsize)] = len(self._priced)
            self._priced.append(0)
        if self._priced[slot] < len(self._edges):
            planner, total = self.planner, math.prod(shape) * itemsize
            for u, v, data in self._edges[self._priced[slot] :]:
                even = all(shape[td] % n == 0 for td, n in self.splits[v])
                data[slot] = (
                    min(planner._move_cost(self, u, move, shape, total) for move in data["moves"]) if even else None
                )
            self._priced[slot] = len(self._edges)
        return slot

    def _node(self, lay: Layout) -> int:
        i = self.ids.get(lay)
        if i is not None:
            return i
        mesh = self.planner.mesh_shape
        splits = tuple((td, math.prod(mesh[m] for m in mds)) for td, mds in lay.order)
        i = self.ids[lay] = len(self.layouts)
        self.layouts.append(lay)
        self.splits[lay] = splits
        self.shards[lay] = math.prod(n for _, n in splits)
        self.graph.add_node(i)
        return i


class Planner:
    """Plans and prices redistributions on one mesh shape under one network profile.

    Results are memoized per planner on (src, dst, shape, itemsize). `one_shot=False` disables
    steps over flattened groups of several mesh dims (for meshes without dim names)."""

    def __init__(
        self, mesh_shape: Sequence[int], profile: NetworkProfile | str = "h100-node", *, one_shot: bool = True
    ):
        self.mesh_shape = tuple(int(s) for s in mesh_shape)
        if not self.mesh_shape or min(self.mesh_shape) < 1:
            raise ValueError(f"bad mesh shape {mesh_shape}")
        if isinstance(profile, str):
            profile = NetworkProfile.preset(profile, len(self.mesh_shape))
        if profile.mesh_ndim != len(self.mesh_shape):
            raise ValueError(f"profile {profile.name!r} has {profile.mesh_ndim} mesh dims, mesh is {self.mesh_shape}")
        self.profile = profile
        self.one_shot = one_shot
        self._active = tuple(m for m, s in enumerate(self.mesh_shape) if s > 1)
        self._unit = frozenset(m for m, s in enumerate(self.mesh_shape) if s == 1)
        self._spaces: dict[tuple[int, tuple[str, ...]], _Space] = {}
        self._runs: dict[tuple, tuple[dict, dict]] = {}
        self._costs: dict[tuple, float] = {}
        self._plans: dict[tuple, RedistributePlan] = {}

    # ------------------------------------------------------------------ public API
    def cost(self, src: Layout | str, dst: Layout | str, shape: Sequence[int], itemsize: Any) -> float:
        """Seconds for the cheapest plan (the fast path the ILP calls)."""
        key = (
            src,
            dst,
            shape if type(shape) is tuple else tuple(shape),
            itemsize if type(itemsize) is int else _itemsize(itemsize),
        )
        c = self._costs.get(key)
        if c is None:
            c = self._costs[key] = self._search(*key)[0]
        return c

    def plan(
        self, src: Layout | str, dst: Layout | str, shape: Sequence[int], dtype_or_itemsize: Any
    ) -> RedistributePlan:
        key = (_layout(src), _layout(dst), tuple(shape), _itemsize(dtype_or_itemsize))
        p = self._plans.get(key)
        if p is None:
            p = self._plans[key] = self._build_plan(*key)
        return p

    # ------------------------------------------------------------------ search
    def _search(self, src: Layout | str, dst: Layout | str, shape: tuple[int, ...], itemsize: int):
        """(cost, physical src, physical dst, space, run) after validating the request."""
        src, dst = _layout(src), _layout(dst)
        for lay in (src, dst):
            lay.local_shape(shape, self.mesh_shape)  # validates rank, mesh and even splits
        ops = tuple(sorted({"sum"} | {p.op for p in src.placements + dst.placements if p.kind == "P"}))
        ps, pd = self._physical(src), self._physical(dst)
        space = self._spaces.get((len(shape), ops))
        if space is None:
            space = self._spaces[(len(shape), ops)] = _Space(self, len(shape), ops)
        run_key = (ps, shape, itemsize, ops)
        run = self._runs.get(run_key)
        if run is None:
            run = self._runs[run_key] = self._dijkstra(space, space.ensure(ps), shape, itemsize)
        pred, dist = run
        target = space.ids.get(pd)
        if target not in dist:  # cannot happen for even layouts; guard against silent nonsense
            raise ValueError(f"no redistribution from {src} to {dst} for shape {shape}")
        return dist[target], ps, pd, space, run

    def _dijkstra(self, space: _Space, source: int, shape: tuple[int, ...], itemsize: int):
        slot = space.weight_slot(shape, itemsize)
        return nx.dijkstra_predecessor_and_distance(space.graph, source, weight=lambda u, v, data: data[slot])

    def _move_cost(self, space: _Space, u: Layout, move: _Move, shape: tuple[int, ...], total: float) -> float:
        a, b, kind, _, tensor_dims, n = move
        cost = a * total + b
        if kind in _COPY_PASSES:
            split = dict(space.splits[u])
            local = [shape[d] // split.get(d, 1) for d in range(len(shape))]
            cost += self._copy_s(kind, tensor_dims, n, local, total / space.shards[u])
        return cost

    def _copy_s(self, kind: str, tensor_dims: Sequence[int], n: int, local: Sequence[int], in_bytes: float) -> float:
        """The local copy that puts a gathered/scattered tensor dim in place when it is not the
        outermost one: dim-0 collectives work in place, any other dim needs a pass at mem_bw."""
        passes = _COPY_PASSES[kind](n)
        return sum(
            passes * in_bytes / self.profile.mem_bw for td in tensor_dims if any(size > 1 for size in local[:td])
        )

    def step_cost(
        self,
        kind: str,
        mesh_dims: Sequence[int],
        tensor_dims: Sequence[int],
        src: Layout,
        shape: Sequence[int],
        itemsize: int,
    ) -> float:
        """Seconds of one step applied to a tensor in layout `src`, priced exactly as plans are
        (collective + local copy): for comparing other planners' step lists on equal terms."""
        local = src.local_shape(shape, self.mesh_shape)
        in_bytes = math.prod(local) * itemsize
        n = math.prod(self.mesh_shape[m] for m in mesh_dims)
        cost = step_cost(self.profile, kind, mesh_dims, n, in_bytes)
        if kind in _COPY_PASSES:
            cost += self._copy_s(kind, tensor_dims, n, local, in_bytes)
        return cost

    def _build_plan(self, src: Layout, dst: Layout, shape: tuple[int, ...], itemsize: int) -> RedistributePlan:
        cost, ps, pd, space, (pred, _) = self._search(src, dst, shape, itemsize)
        path, start = [space.ids[pd]], space.ids[ps]
        while path[-1] != start:
            path.append(pred[path[-1]][0])
        path.reverse()
        total = math.prod(shape) * itemsize
        steps = []
        for i, j in pairwise(path):
            u, v = space.layouts[i], space.layouts[j]
            costs = [(self._move_cost(space, u, mv, shape, total), mv) for mv in space.graph[i][j]["moves"]]
            cost_s, (_, fixed_s, kind, mesh_dims, tensor_dims, n) = min(costs, key=lambda c: c[0])
            in_bytes = total / space.shards[u]
            steps.append(
                Step(kind, mesh_dims, u, v, tensor_dims, cost_s, wire_bytes(kind, n, in_bytes), in_bytes, fixed_s)
            )
        if not steps and src != dst:
            steps.append(Step("reorder", (), src, dst, (), 0.0, 0.0))
        elif steps:  # relabel the ends from/to the physical forms
            if src != ps:
                steps.insert(0, Step("reorder", (), src, ps, (), 0.0, 0.0))
            if dst != pd:
                steps.append(Step("reorder", (), pd, dst, (), 0.0, 0.0))
        counts: dict[str, int] = {}
        for s in steps:
            if s.kind in COLLECTIVE_KINDS:
                counts[s.kind] = counts.get(s.kind, 0) + 1
        return RedistributePlan(
            tuple(steps), cost, sum(s.bytes for s in steps), counts, src, dst, shape, itemsize, self.mesh_shape
        )

    def _physical(self, lay: Layout) -> Layout:
        """The layout with size-1 mesh dims replicated: same data on every rank, no size-1 groups."""
        if not self._unit or all(lay.placements[m] == R for m in self._unit):
            return lay
        placements = tuple(R if m in self._unit else p for m, p in enumerate(lay.placements))
        order = tuple((td, kept) for td, mds in lay.order if (kept := tuple(m for m in mds if m not in self._unit)))
        return Layout._raw(placements, order)

    # ------------------------------------------------------------------ transitions
    def _successors(self, u: Layout, ndim: int, ops: tuple[str, ...]):
        """Yield ((kind, mesh_dims, tensor_dims, group size), next layout) for every step from u."""
        pl, order = u.placements, dict(u.order)
        size = self.mesh_shape
        max_k = len(self._active) if self.one_shot else 1

        def state(changes: dict[int, Placement], new_order: dict[int, tuple[int, ...]]) -> Layout:
            placements = tuple(changes.get(m, p) for m, p in enumerate(pl))
            return Layout._raw(placements, tuple(sorted((td, mds) for td, mds in new_order.items() if mds)))

        for a, mds in order.items():
            for k in range(1, min(len(mds), max_k) + 1):
                moved, rest = mds[-k:], mds[:-k]
                n = math.prod(size[m] for m in moved)
                yield ("all_gather", moved, (a,), n), state(dict.fromkeys(moved, R), {**order, a: rest})
                for b in range(ndim):
                    if b != a:
                        new_order = {**order, a: rest, b: order.get(b, ()) + moved}
                        yield ("all_to_all", moved, (a, b), n), state(dict.fromkeys(moved, S(b)), new_order)
            if len(mds) > 1:
                n = math.prod(size[m] for m in mds)
                for perm in permutations(mds):
                    if perm != mds:
                        yield ("permute", tuple(sorted(mds)), (a,), n), state({}, {**order, a: perm})

        for op in ops:
            partial = [m for m in self._active if pl[m] == P(op)]
            for k in range(1, min(len(partial), max_k) + 1):
                for group in combinations(partial, k):
                    n = math.prod(size[m] for m in group)
                    yield ("all_reduce", group, (), n), state(dict.fromkeys(group, R), order)
                    for perm in permutations(group):
                        for d in range(ndim):
                            new_order = {**order, d: order.get(d, ()) + perm}
                            yield ("reduce_scatter", perm, (d,), n), state(dict.fromkeys(perm, S(d)), new_order)

        for m in self._active:
            if pl[m] == R:
                for d in range(ndim):
                    yield ("chunk", (m,), (d,), size[m]), state({m: S(d)}, {**order, d: order.get(d, ()) + (m,)})
                for op in ops:
                    yield ("to_partial", (m,), (), size[m]), state({m: P(op)}, order)


def _layout(x: Layout | str) -> Layout:
    return Layout.parse(x) if isinstance(x, str) else x


def _itemsize(x: Any) -> int:
    """Accept an int itemsize or anything with `.itemsize` (torch.dtype)."""
    if isinstance(x, int):
        if x < 1:
            raise ValueError(f"itemsize must be >= 1, got {x}")
        return x
    return int(x.itemsize)
