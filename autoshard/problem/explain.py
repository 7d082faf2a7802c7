"""Why this layout? Re-solve the already built problem with a parameter pinned to each other layout.

`explain(sharding, plan, planner, "layers.0.attention.wq.weight")` answers "what would the next best
layouts of this parameter cost?" without tracing or building again: for each candidate layout the
solver problem is copied with the parameter's ILP node pinned to that choice
(`solver.Problem.restricted`, which shares every node, matrix and region with the original) and
solved again. The pin reaches everything tied to the node: its gradient sink (SameChoice) and the
same parameter in every copy of a repeated block (regions share choices), so pinning
`layers.0...wq.weight` pins every layer's wq, exactly as `AutoShard.pin("layers.*.attention.wq.weight",
layout)` would. Each re-solve is decoded into a Plan and compared edge by edge with the chosen one.

Which candidates are solved: every other layout of the parameter when there are at most
`max_solves`; otherwise the `max_solves` with the lowest *best-response estimate* (the chosen
plan with only the pinned nodes moved to the candidate, every other node kept: an upper bound on
the pinned optimum, computed from the edges around the pinned nodes in microseconds). A pin that
the parameter memory budget rules out fails in presolve, a fraction of a solve, and is listed as
infeasible.
"""

from __future__ import annotations

import difflib
import fnmatch
import math
import time
from dataclasses import dataclass, field
from typing import Iterable

import autoshard_solver as solver
from autoshard.layout import Layout
from autoshard.pricing.planner import Planner, RedistributePlan
from autoshard.problem.build import ShardingProblem
from autoshard.problem.plan import Plan, decode

MAX_SOLVES = 12  # llama3-8b (8,8): 11 candidates per weight, ~2 s per feasible re-solve


class ExplainError(ValueError):
    """The FQN names no parameter (or a pattern names parameters laid out differently)."""


@dataclass(frozen=True)
class EdgeChange:
    """One edge whose redistribution differs between the chosen plan and an alternative
    (None: no redistribution on that edge in that plan)."""

    producer: str  # graph node name
    consumer: str  # graph node name or sink name
    slot: int
    before: RedistributePlan | None
    after: RedistributePlan | None

    @property
    def delta_s(self) -> float:
        return _cost(self.after) - _cost(self.before)


@dataclass
class Alternative:
    """The best plan with the parameter pinned to `layout`."""

    layout: Layout
    choice: int  # the candidate's choice index on the parameter's ILP node
    step_time_s: float
    compute_s: float
    comm_s: float
    delta_s: float  # step_time_s minus the chosen plan's (>= 0 up to the solver's gap)
    status: str  # the solver's: "optimal" or "feasible"
    solve_s: float
    changes: list[EdgeChange]  # every edge whose redistribution differs, largest |delta| first
    moved: dict[str, tuple[Layout, Layout]] = field(default_factory=dict)  # other parameters: (chosen, here)


@dataclass
class Explanation:
    fqn: str  # as asked (an FQN or a pattern)
    params: list[str]  # the parameters it names
    layout: Layout  # their chosen layout
    step_time_s: float  # the chosen plan's modeled step time
    tied: list[str]  # parameters that move with them (the same position in every repeated block)
    alternatives: list[Alternative]  # sorted by step time
    candidates: int  # other layouts the parameters could take
    solved: int  # candidates re-solved (feasible or not)
    infeasible: list[Layout]  # candidates re-solved and found infeasible (e.g. the memory budget)
    skipped: list[Layout]  # candidates not solved (beyond max_solves, by estimate)
    method: str  # how the candidates were chosen
    seconds: float
    param_nodes: dict[str, str] = field(default_factory=dict, repr=False)  # graph node name -> parameter FQN

    def top(self, n: int) -> list[Alternative]:
        return self.alternatives[:n]


def match_params(pattern: str, names: Iterable[str]) -> list[str]:
    """The parameter FQNs `pattern` names (exactly, else as an fnmatch pattern); ExplainError
    with the closest names when it names none."""
    names = list(names)
    if pattern in names:
        return [pattern]
    matched = [n for n in names if fnmatch.fnmatchcase(n, pattern)]
    if matched:
        return matched
    close = (
        [n for n in names if pattern and pattern in n][:5]  # e.g. a name without its prefix
        or difflib.get_close_matches(pattern, names, n=5, cutoff=0.5)
        or difflib.get_close_matches(pattern, names, n=3, cutoff=0.0)
    )
    hint = f"; close matches: {', '.join(close)}" if close else ""
    raise ExplainError(f"{pattern!r} matches no parameter{hint}")


def explain(
    sp: ShardingProblem,
    plan: Plan,
    planner: Planner,
    fqn: str,
    *,
    top: int = 3,
    max_solves: int = MAX_SOLVES,
    backend: str = "auto",
    time_limit: float | None = None,
    rel_gap: float = 1e-6,
) -> Explanation:
    """The chosen layout of `fqn` (an FQN or a pattern naming parameters with one layout) and the
    best plans with it pinned to each other candidate layout, from the problem `plan` was solved
    from. `top` only limits how many alternatives are kept (all solved ones when 0)."""
    start = time.perf_counter()
    if top < 0 or max_solves < 1:
        raise ValueError(f"top must be >= 0 and max_solves >= 1, got {top} and {max_solves}")
    params = match_params(fqn, sp.graph.params)
    chosen = _one_layout(fqn, params, plan)
    nodes = [sp.graph.params[name].name for name in params]
    pins = _candidate_pins(sp, nodes, chosen)
    node_param = {node.name: name for name, node in sp.graph.params.items()}
    tied_nodes = {t for n in nodes for t in sp.problem.tied(n)}
    tied = [
        node_param[t]
        for t in sorted(tied_nodes, key=sp.problem.index().__getitem__)
        if t in node_param and node_param[t] not in params
    ]
    order, skipped, method = _solve_order(sp.problem, plan, pins, max_solves)
    alternatives, infeasible = [], []
    for lay in order:
        alt = _re_solved(sp, plan, planner, lay, pins[lay], {*params, *tied}, backend, time_limit, rel_gap)
        if alt is None:
            infeasible.append(lay)
        else:
            alternatives.append(alt)
    alternatives.sort(key=lambda a: (a.step_time_s, str(a.layout)))
    return Explanation(
        fqn=fqn,
        params=params,
        layout=chosen,
        step_time_s=plan.step_time_s,
        tied=tied,
        alternatives=alternatives[:top] if top else alternatives,
        candidates=len(pins),
        solved=len(order),
        infeasible=infeasible,
        skipped=skipped,
        method=method,
        seconds=time.perf_counter() - start,
        param_nodes=node_param,
    )


def _one_layout(fqn: str, params: list[str], plan: Plan) -> Layout:
    """The layout the plan gives every parameter `fqn` names; ExplainError when they differ."""
    layouts = {name: plan.param_layouts[name] for name in params}
    if len(set(layouts.values())) > 1:
        shown = ", ".join(f"{n} {lay}" for n, lay in list(layouts.items())[:4])
        raise ExplainError(
            f"{fqn!r} names {len(params)} parameters with different layouts "
            f"({shown}{', ...' if len(params) > 4 else ''}); name one of them"
        )
    return layouts[params[0]]


def _candidate_pins(sp: ShardingProblem, nodes: list[str], chosen: Layout) -> dict[Layout, dict[str, int]]:
    """Each layout other than `chosen` that every one of the parameters' ILP `nodes` can take ->
    the choice index it is on each node."""
    options = [[s.outputs[0] for s in sp.strategies[n]] for n in nodes]
    candidates = [lay for lay in options[0] if lay != chosen and all(lay in o for o in options[1:])]
    return {lay: {n: o.index(lay) for n, o in zip(nodes, options)} for lay in candidates}


def _solve_order(
    problem: solver.Problem, plan: Plan, pins: dict[Layout, dict[str, int]], max_solves: int
) -> tuple[list[Layout], list[Layout], str]:
    """(the candidates to re-solve, those skipped, how they were chosen): all of them up to
    `max_solves`, else the `max_solves` with the lowest best-response estimate."""
    candidates = list(pins)
    if len(candidates) <= max_solves:
        return candidates, [], f"all {len(candidates)} other candidate layouts re-solved"
    estimate = _best_response(problem, plan.solution.choice, pins)
    order = sorted(candidates, key=lambda lay: estimate[lay])
    method = (
        f"{max_solves} of {len(candidates)} other candidate layouts re-solved: those with the "
        f"lowest best-response estimate (only the pinned nodes moved)"
    )
    return order[:max_solves], order[max_solves:], method


def _re_solved(
    sp: ShardingProblem,
    plan: Plan,
    planner: Planner,
    layout: Layout,
    pin: dict[str, int],
    pinned: set[str],
    backend: str,
    time_limit: float | None,
    rel_gap: float,
) -> Alternative | None:
    """The best plan with the parameters pinned to `layout` (`pin`: ILP node -> choice index)
    against the chosen `plan`: its step, the redistributions that change, and the other
    parameters that move (not those `pinned` or tied to them); None when the pin is infeasible."""
    t0 = time.perf_counter()
    try:
        sol = solver.solve(
            sp.problem.restricted(pin), backend=backend, time_limit=time_limit, rel_gap=rel_gap, diagnose=False
        )
    except solver.InfeasibleError:
        return None
    alt = decode(sp, sol, planner)
    return Alternative(
        layout=layout,
        choice=next(iter(pin.values())),  # on the first parameter's node
        step_time_s=alt.step_time_s,
        compute_s=alt.compute_s,
        comm_s=alt.comm_s,
        delta_s=alt.step_time_s - plan.step_time_s,
        status=sol.status,
        solve_s=time.perf_counter() - t0,
        changes=redistribution_changes(plan, alt),
        moved={
            name: (plan.param_layouts[name], alt.param_layouts[name])
            for name in plan.param_layouts
            if name not in pinned and alt.param_layouts[name] != plan.param_layouts[name]
        },
    )


def redistribution_changes(before: Plan, after: Plan) -> list[EdgeChange]:
    """Edges whose redistribution (layouts or steps) differs between two plans of one problem,
    the largest change in modeled cost first."""

    def by_edge(plan: Plan) -> dict:
        return {(r.producer, r.consumer, r.slot): r.plan for r in plan.redistributions}

    old, new = by_edge(before), by_edge(after)
    changes = [
        EdgeChange(*key, old.get(key), new.get(key)) for key in {**old, **new} if not _same(old.get(key), new.get(key))
    ]
    changes.sort(key=lambda c: (-abs(c.delta_s), c.producer, c.consumer, c.slot))
    return changes


def _same(a: RedistributePlan | None, b: RedistributePlan | None) -> bool:
    if a is None or b is None:
        return a is b
    return (a.src, a.dst, a.steps) == (b.src, b.dst, b.steps)


def _cost(plan: RedistributePlan | None) -> float:
    return 0.0 if plan is None else plan.cost_s


def _best_response(
    problem: solver.Problem, choice: dict[str, int], pins: dict[Layout, dict[str, int]]
) -> dict[Layout, float]:
    """Objective change of moving only the pinned nodes (and the nodes tied to them) to each
    candidate, every other node kept at its chosen choice: an upper bound on what the candidate
    costs once re-solved (inf where that assignment is forbidden or over a memory budget)."""
    index = problem.index()
    groups = {n: problem.tied(n) for n in next(iter(pins.values()))}
    moving = {t for ts in groups.values() for t in ts}
    edges = [e for e in problem.edges if e.src in moving or e.dst in moving]
    budgets = [c for c in problem.constraints if isinstance(c, solver.MemoryBudget)]
    out = {}
    for lay, pin in pins.items():
        new = dict(choice)
        for n, k in pin.items():
            new.update(dict.fromkeys(groups[n], k))
        delta = sum(
            problem.nodes[index[t]].choices[new[t]].cost - problem.nodes[index[t]].choices[choice[t]].cost
            for t in moving
        )
        delta += sum(e.cost[new[e.src]][new[e.dst]] - e.cost[choice[e.src]][choice[e.dst]] for e in edges)
        over = any(sum(problem.nodes[index[n]].choices[new[n]].memory for n in b.nodes) > b.limit for b in budgets)
        out[lay] = math.inf if over or math.isnan(delta) else delta
    return out
