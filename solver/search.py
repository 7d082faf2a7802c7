"""Solve the presolved core: LP relaxation, incumbent, reduced-cost fixing, then a small MIP.

The local-polytope LP is nearly tight on sharding problems, but a MIP solver spends most of its
time finding a good incumbent and proving the last fraction of a percent. So we solve the LP first,
tightened on small triangles through fractional classes (frustrated cycles are what make it
loose). If it is still fractional, the sub-problem left when the LP-integral classes are pinned
is presolved again and solved as a (small) MIP: an incumbent, usually the optimum, polished by
local search (best response of one class to its neighbours). With that upper bound UB and the LP
bound LB, every choice or edge entry whose reduced cost exceeds UB - LB cannot be part of a better
solution (LP duality); ruling them out and presolving again leaves a MIP that is a small fraction
of the size, and it only has to beat UB. If UB meets LB, the incumbent is already optimal.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from .model import Model, choices, run
from .presolve import Conflict, Reduction


@dataclass
class CoreResult:
    status: str  # 'optimal', 'feasible', 'infeasible' or 'none'
    choice: dict[int, int]  # class -> choice index
    model: Model
    lower: float = -np.inf  # proven lower bound on core_cost (unscaled)
    triangles: int = 0  # triangles added to tighten the LP
    lp_fixed: int = 0  # columns ruled out by reduced cost


def solve_core(
    red: Reduction, backend: str, deadline: float | None, msg: bool, rel_gap: float, stop_at: float | None = None
) -> CoreResult:
    """Solve the core; `deadline` is a time.perf_counter() value or None. With `stop_at` (a core
    cost), stop with status 'cutoff' once the LP proves that no solution costs less."""

    def left():
        return None if deadline is None else max(deadline - time.perf_counter(), 1.0)

    model = Model(red)
    result = CoreResult("none", {}, model)
    status, result.triangles = _tightened_lp(red, model, backend, left, msg, rel_gap, stop_at)
    if status == "infeasible":
        result.status = "infeasible"
        return result
    incumbent = None
    if status == "optimal":
        assert model.objective is not None  # an optimal LP has a solution
        lower = model.objective
        result.lower = lower / model.scale
        if _reaches(red, model, stop_at):  # the bound less the LP's tolerance: still at least stop_at
            result.status, result.lower = "cutoff", (lower - _lp_tolerance(red, lower)) / model.scale
            return result
        incumbent = _incumbent(red, model, backend, msg, left())
    if incumbent is None:  # no LP or no incumbent: the plain MIP
        status = run(model, backend, left(), msg, rel_gap)
        if status in ("optimal", "feasible"):
            result.choice = choices(model)
        result.status = status
        return result
    upper = core_cost(red, incumbent) * model.scale
    tol = _lp_tolerance(red, upper)
    slack = upper - lower
    result.status, result.choice = "optimal", incumbent
    if slack <= tol + rel_gap * abs(upper):
        return result
    keep, forbid, result.lp_fixed = _ruled_out(red, model, slack + tol)
    try:
        sub = red.narrowed(keep, forbid)
    except Conflict:  # nothing can beat the incumbent
        return result
    found, status = _solve_narrowed(red, sub, backend, left(), msg, rel_gap, incumbent)
    if found is not None and core_cost(red, found) < core_cost(red, incumbent):
        result.choice = found
    if status != "optimal":  # stopped early: the incumbent may not be optimal
        result.status = "feasible"
    else:
        result.lower = core_cost(red, result.choice)
    return result


def _ruled_out(red: Reduction, model: Model, threshold: float):
    """From the LP's reduced costs: keep-masks of the choices and forbid-masks of the edge
    entries that no solution better than the incumbent can use (reduced cost > threshold),
    and how many columns that rules out."""
    reduced = model.reduced
    assert reduced is not None, "reduced costs come from an optimal LP"
    keep, forbid, count = {}, {}, 0
    for c, (idx, xs) in model.x.items():
        out = reduced[xs] > threshold
        keep[c] = red.alive[c].copy()
        keep[c][idx[out]] = False
        count += int(out.sum())
    for (a, b), (row_of, col_of, ys) in model.pairs.items():
        groups = np.zeros((row_of.max() + 1, col_of.max() + 1), bool)
        for (g, h), v in ys.items():
            if reduced[v] > threshold:
                groups[g, h] = True
                count += 1
        mask = np.zeros(red.mat[(a, b)].shape, bool)
        mask[np.ix_(np.flatnonzero(red.alive[a]), np.flatnonzero(red.alive[b]))] = groups[np.ix_(row_of, col_of)]
        forbid[(a, b)] = mask
    return keep, forbid, count


def _solve_narrowed(
    red: Reduction,
    sub: Reduction,
    backend: str,
    time_limit,
    msg: bool,
    rel_gap: float,
    incumbent: dict[int, int] | None = None,
):
    """MIP over what is left of `red` in `sub` (a narrowed copy); returns (choice per core
    class of `red` or None, status). A known `incumbent` gives the MIP a cutoff."""
    status, core_choice = "optimal", {}
    if sub.core:
        model = Model(sub)
        cutoff = None
        if incumbent is not None:
            known = core_cost(sub, {c: incumbent[c] for c in sub.core}) * model.scale
            cutoff = known * (1 + 1e-7) + 1e-9
        status = run(model, backend, time_limit, msg, rel_gap, cutoff=cutoff)
        if status not in ("optimal", "feasible"):
            return None, status
        core_choice = choices(model)
    nodes = sub.assign(core_choice)
    return {c: nodes[red.names[c]] for c in red.core}, status


def _reaches(red: Reduction, model: Model, stop_at: float | None) -> bool:
    """Whether the LP just solved proves that no solution of the core costs less than `stop_at`."""
    if stop_at is None:
        return False
    lower = model.objective
    assert lower is not None, "only an optimal LP proves a bound"
    return lower - _lp_tolerance(red, lower) >= stop_at * model.scale


def _tightened_lp(
    red: Reduction,
    model: Model,
    backend: str,
    left,
    msg: bool,
    rel_gap: float,
    stop_at: float | None = None,
    rounds: int = 4,
    growth: float = 0.5,
    largest: int = 4096,
) -> tuple[str, int]:
    """Solve the LP relaxation; while it is fractional, tighten it on the triangles that have
    two or more fractional classes (frustrated cycles are what make the local polytope loose)
    and re-solve. The LP gets slow quickly as it grows, so at most `growth` times the original
    number of columns is added in all, and no triangle of more than `largest` choice triples
    (with many choices per node a triangle costs more than the MIP it would help). Tightening
    only raises the bound: it stops as soon as the bound reaches `stop_at` (a core cost).
    Returns the LP status and the triangles added."""
    done: set[tuple[int, int, int]] = set()
    budget = int(growth * model.variables)
    for round_ in range(rounds + 1):
        status = run(model, backend, left(), msg, rel_gap, mip=False)
        if status != "optimal" or budget <= 0 or round_ == rounds or _reaches(red, model, stop_at):
            break
        value = model.value
        assert value is not None  # the LP is optimal
        frac = {c for c, (_, xs) in model.x.items() if value[xs].max() < 1 - 1e-6}
        found = {
            tri
            for a in frac
            for b in red.adj[a]
            for c in red.adj[a] & red.adj[b]
            if len(frac.intersection(tri := _triangle(a, b, c))) >= 2
        }
        added = 0
        for tri in sorted(found - done, key=lambda t: -len(frac.intersection(t))):
            size = model.add_triangle(*tri, limit=min(budget, largest)) if budget > 0 else 0
            budget -= size
            added += size
            if size:
                done.add(tri)
        if not added:
            break
    return status, len(done)


def _triangle(a: int, b: int, c: int) -> tuple[int, int, int]:
    """The triangle's classes in increasing order."""
    first, second, third = sorted((a, b, c))
    return first, second, third


def _incumbent(red: Reduction, model: Model, backend: str, msg: bool, time_limit):
    """A good solution from the LP optimum in `model`: round it, and if some classes are
    fractional also solve the sub-problem left when the LP-integral classes are pinned (after
    presolving it again it is small); polish by local search."""
    value = model.value
    assert value is not None, "the incumbent is rounded from an optimal LP"
    candidates = [choices(model)]
    keep = {}
    for c, (idx, xs) in model.x.items():
        if value[xs].max() > 1 - 1e-6:
            keep[c] = np.zeros(len(red.alive[c]), bool)
            keep[c][candidates[0][c]] = True
    if len(keep) < len(model.x):
        try:
            found, _ = _solve_narrowed(red, red.narrowed(keep), backend, time_limit, msg, 1e-2)
        except Conflict:
            found = None
        if found is not None:
            candidates.append(found)
    best, best_cost = None, np.inf
    for start in candidates:
        found = local_search(red, start)
        if found is not None and core_cost(red, found) < best_cost:
            best, best_cost = found, core_cost(red, found)
    return best


def _lp_tolerance(red: Reduction, objective: float) -> float:
    """How far an LP objective (scaled) may be off: each chosen column by ~1e-7 in reduced cost."""
    return 1e-7 * (len(red.core) + len(red.mat)) + 1e-9 * abs(objective)


def core_cost(red: Reduction, choice: dict[int, int]) -> float:
    """Cost of the core part of an assignment (what the ILP objective measures, unscaled)."""
    cost = sum(float(red.cost[c][choice[c]]) for c in red.core)
    return cost + sum(float(m[choice[a], choice[b]]) for (a, b), m in red.mat.items())


def local_search(red: Reduction, start: dict[int, int], sweeps: int = 50) -> dict[int, int] | None:
    """Best-response descent from `start` within memory budgets; None if it stays infeasible."""
    choice = dict(start)
    loads = [budget.load(choice) for budget in red.budgets]
    limits = [budget.limit + 1e-9 * abs(budget.limit) for budget in red.budgets]
    if any(load > limit for load, limit in zip(loads, limits)):
        return None
    around = [budget.around() for budget in red.budgets]
    for _ in range(sweeps):
        changed = False
        for c in red.core:
            idx = np.flatnonzero(red.alive[c])
            local = red.cost[c][idx].copy()
            for nb in red.adj[c]:
                local += red.oriented(c, nb)[idx, choice[nb]]
            deltas = []  # per budget: its load change for each choice of c (None: c has no say)
            for budget, edges, load, limit in zip(red.budgets, around, loads, limits):
                delta = None
                if c in budget.memory:
                    delta = budget.memory[c][idx] - budget.memory[c][choice[c]]
                for nb, m in edges.get(c, ()):
                    step = m[idx, choice[nb]] - m[choice[c], choice[nb]]
                    delta = step if delta is None else delta + step
                if delta is not None:
                    local[load + delta > limit] = np.inf
                deltas.append(delta)
            best = int(np.argmin(local))
            current = local[np.searchsorted(idx, choice[c])]
            better = local[best] < current - 1e-12 * abs(current) if np.isfinite(current) else np.isfinite(local[best])
            if better:
                for i, delta in enumerate(deltas):
                    if delta is not None:
                        loads[i] += delta[best]
                choice[c] = int(idx[best])
                changed = True
        if not changed:
            break
    return choice if np.isfinite(core_cost(red, choice)) else None
