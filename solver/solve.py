"""solve(problem) -> Solution: presolve, build the ILP of what is left, solve, back-substitute."""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field

import numpy as np

from .diagnose import explain
from .model import pick_backend
from .presolve import Conflict, Reduction
from .problem import FORMAT, InfeasibleError, Problem
from .search import core_cost, solve_core


class SolveError(RuntimeError):
    """The backend stopped without any solution (time limit too short, solver failure)."""


class NoBetterError(ValueError):
    """No assignment costs less than the cutoff asked for: the LP relaxation's bound proves it.
    `bound` is that proven lower bound on the objective (at least the cutoff; None: unknown), so a
    caller can tell a later, higher cutoff that it is still out of reach without solving again."""

    def __init__(self, message: str, bound: float | None = None):
        super().__init__(message)
        self.bound = bound


@dataclass
class SolveStats:
    backend: str = ""
    variables: int = 0  # ILP columns as built (before triangle tightening)
    constraints: int = 0  # ILP rows as built
    presolve_s: float = 0.0
    build_s: float = 0.0
    solve_s: float = 0.0
    nodes: int = 0  # nodes of the original problem
    classes: int = 0  # variable groups after sharing (regions, SameChoice)
    core: int = 0  # classes left for the ILP after presolve
    removed_inf: int = 0
    removed_dominated: int = 0
    fixed: int = 0
    eliminated: int = 0
    folded_edges: int = 0
    triangles: int = 0  # triangles added to tighten the LP relaxation
    lp_fixed: int = 0  # ILP columns ruled out by LP reduced costs
    bound: float = 0.0  # proven lower bound on the objective (== objective if optimal)


@dataclass
class Solution:
    choice: dict[str, int]
    objective: float
    node_cost: float
    edge_cost: float
    status: str  # "optimal" or "feasible" (time limit hit with a solution)
    stats: SolveStats = field(default_factory=SolveStats)
    labels: dict[str, str] = field(default_factory=dict)

    def label(self, node: str) -> str:
        """Label of the choice taken by `node`."""
        return self.labels[node]

    def to_json(self, **kwargs) -> str:
        data = asdict(self)
        data["format"] = FORMAT
        return json.dumps(data, **kwargs)

    @classmethod
    def from_json(cls, text: str) -> "Solution":
        """The solution `to_json` wrote; ValueError for anything else (a damaged or foreign text)."""
        try:
            data = json.loads(text)
            if not isinstance(data, dict) or data.pop("format", None) != FORMAT:
                raise ValueError("unsupported solution format")
            data["stats"] = SolveStats(**data["stats"])
            return cls(**data)
        except (KeyError, TypeError) as e:
            raise ValueError(f"not a solution ({type(e).__name__}: {e})") from None


def solve(
    problem: Problem,
    backend: str = "auto",
    time_limit: float | None = None,
    msg: bool = False,
    rel_gap: float = 1e-6,
    presolve: bool = True,
    diagnose: bool = True,
    cutoff: float | None = None,
) -> Solution:
    """Pick one choice per node minimising node + edge cost under the problem's constraints.

    Raises ValueError for malformed input, InfeasibleError (a ValueError) naming the conflicting
    constraints when nothing is feasible, SolveError when the backend finds no solution in time.
    time_limit (seconds, from the call) bounds the solver phases; each backend call gets at least
    a second, so it can be overrun by a little. rel_gap is the relative gap at which a solution
    counts as optimal; presolve=False hands the whole (shared-variable) problem to the ILP, for
    testing and measuring. diagnose=False skips the search for the conflicting constraints when
    nothing is feasible (many ILP checks): the InfeasibleError then says only where it was found,
    for callers that expect some problems to be infeasible (e.g. trying pins one by one).
    cutoff: only a solution costing less is wanted (one already in hand costs that much): raises
    NoBetterError as soon as the LP relaxation proves there is none, before the MIP's search.
    """
    problem.validate()
    backend = pick_backend(backend)
    stats = SolveStats(backend=backend, nodes=len(problem.nodes))
    t0 = time.perf_counter()
    try:
        red = Reduction(problem, problem.constraints, problem.regions, reduce=presolve)
    except Conflict as conflict:
        raise (explain(problem, backend) if diagnose else _undiagnosed(conflict)) from None
    t1 = time.perf_counter()
    stats.presolve_s = t1 - t0
    for key, value in asdict(red.counts).items():
        setattr(stats, key, value)
    stats.core = len(red.core)
    status, core_choice = "optimal", {}
    if red.core:
        deadline = None if time_limit is None else t0 + time_limit
        stop_at = None if cutoff is None else _core_cutoff(problem, red, cutoff)
        result = solve_core(red, backend, deadline, msg, rel_gap, stop_at)
        model = result.model
        stats.build_s, stats.variables, stats.constraints = model.build_s, *model.built
        stats.solve_s = time.perf_counter() - t1 - model.build_s
        stats.lp_fixed, stats.triangles = result.lp_fixed, result.triangles
        if result.status == "infeasible":
            raise explain(problem, backend) if diagnose else InfeasibleError("infeasible (not diagnosed)")
        if result.status == "cutoff":
            assert cutoff is not None and stop_at is not None  # 'cutoff' needs a stop_at
            bound = max(cutoff, cutoff - stop_at + result.lower)  # the max only guards rounding
            raise NoBetterError(f"no solution costs less than {cutoff:.6g}: the LP bound is {bound:.6g}", bound)
        if result.status == "none":
            raise SolveError(
                f"{backend} stopped without a solution (time_limit={time_limit}, {stats.variables} variables)"
            )
        status, core_choice = result.status, result.choice
    choice = red.assign(core_choice)
    node_cost, edge_cost = problem.cost(choice)
    objective = node_cost + edge_cost
    # the core's share of the objective is bounded by the LP/MIP; the rest is exact
    stats.bound = objective if not red.core else max(0.0, objective - core_cost(red, core_choice) + result.lower)
    labels = {n.name: n.choices[choice[n.name]].label for n in problem.nodes}
    return Solution(choice, objective, node_cost, edge_cost, status, stats, labels)


def _core_cutoff(problem: Problem, red: Reduction, cutoff: float) -> float | None:
    """`cutoff` on the core's cost: less the cost presolve took out of the core (the fixed
    classes), read off one assignment (None if that one is infinite: no cutoff then)."""
    start = {c: int(np.where(red.alive[c], red.cost[c], np.inf).argmin()) for c in red.core}
    outside = sum(problem.cost(red.assign(start))) - core_cost(red, start)
    return cutoff - outside if np.isfinite(outside) else None


def _undiagnosed(conflict: Conflict) -> InfeasibleError:
    cause = conflict.cause
    what = (
        cause.describe()
        if hasattr(cause, "describe")
        else (f"edge {cause.src!r}->{cause.dst!r}" if hasattr(cause, "src") else str(cause))
    )
    where = (
        f"node {conflict.node!r} is left without a choice" if conflict.node is not None else "a budget cannot be met"
    )
    return InfeasibleError(f"infeasible (not diagnosed): {where} ({what})", node=conflict.node)
