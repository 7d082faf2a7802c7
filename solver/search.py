"""Solve the presolved core: LP relaxation, incumbent, reduced-cost fixing, then the MIP.

The local-polytope LP is nearly tight on sharding problems, but a MIP solver spends most of its
time finding a good incumbent and proving the last fraction of a percent. So we solve the LP first,
tightened on triangles through fractional classes until it is integral or a size budget is spent.
If it is still fractional, the sub-problem left when the LP-integral classes are pinned is
presolved again and solved as a (small) MIP, which gives an incumbent (usually the optimum),
polished by local search (best response of one class to its neighbours).
With that upper bound UB and the LP bound LB, every column whose reduced cost exceeds UB - LB
cannot be part of a better solution (LP duality) and is fixed to zero; the MIP that remains is
usually a fraction of the size. If UB meets LB, the incumbent is already optimal.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import pulp

from .model import Model, choices, run
from .presolve import Conflict, Reduction


@dataclass
class CoreResult:
    status: str                    # 'optimal', 'feasible', 'infeasible' or 'none'
    choice: dict[int, int]         # class -> choice index
    model: Model
    lower: float = -np.inf         # proven lower bound on core_cost (unscaled)
    triangles: int = 0             # triangles added to tighten the LP
    lp_fixed: int = 0              # columns fixed to zero by reduced cost


def solve_core(red: Reduction, backend: str, deadline: float | None, msg: bool,
               rel_gap: float) -> CoreResult:
    """Solve the core; `deadline` is a time.perf_counter() value or None."""

    def left():
        return None if deadline is None else max(deadline - time.perf_counter(), 1.0)

    model = Model(red)
    result = CoreResult("none", {}, model)
    status, result.triangles = _tightened_lp(red, model, backend, left, msg, rel_gap)
    if status == "infeasible":
        result.status = "infeasible"
        return result
    incumbent = None
    if status == "optimal":
        lower = pulp.value(model.lp.objective) or 0.0
        result.lower = lower / model.scale
        incumbent = _incumbent(red, model, backend, msg, left())
    if incumbent is not None:
        upper = core_cost(red, incumbent) * model.scale
        # LP tolerances: each chosen column may be off by ~1e-7 in reduced cost
        tol = 1e-7 * (len(red.core) + len(red.mat)) + 1e-9 * abs(upper)
        slack = upper - lower
        if slack <= tol + rel_gap * abs(upper):
            result.status, result.choice = "optimal", incumbent
            return result
        for v in model.columns:
            if v.dj is not None and v.dj > slack + tol:
                v.upBound = 0
                result.lp_fixed += 1
    cutoff = None if incumbent is None else upper * (1 + 1e-7) + 1e-9
    status = run(model, backend, left(), msg, rel_gap, cutoff=cutoff)
    best = choices(model) if status in ("optimal", "feasible") else None
    if incumbent is not None and (best is None or core_cost(red, incumbent) < core_cost(red, best)):
        # the MIP can only fail to beat the incumbent by stopping early (or numerically)
        best, status = incumbent, "optimal" if status == "optimal" else "feasible"
    result.status, result.choice = status, best or {}
    if status == "optimal":
        result.lower = core_cost(red, best)
    return result


def _tightened_lp(red: Reduction, model: Model, backend: str, left, msg: bool, rel_gap: float,
                  rounds: int = 4, growth: float = 0.5) -> tuple[str, int]:
    """Solve the LP relaxation; while it is fractional, tighten it on the triangles that have
    two or more fractional classes (frustrated cycles are what make the local polytope loose)
    and re-solve. The LP gets slow quickly as it grows, so at most `growth` times the original
    number of columns is added in all. Returns the LP status and the triangles added."""
    done: set[tuple[int, int, int]] = set()
    budget = int(growth * model.variables)
    for round_ in range(rounds + 1):
        status = run(model, backend, left(), msg, rel_gap, mip=False)
        if status != "optimal" or budget <= 0 or round_ == rounds:
            break
        frac = {c for c, (_, xs) in model.x.items() if max(v.varValue for v in xs) < 1 - 1e-6}
        found = {tri for a in frac for b in red.adj[a] for c in red.adj[a] & red.adj[b]
                 if len(frac.intersection(tri := tuple(sorted((a, b, c))))) >= 2}
        added = 0
        for tri in sorted(found - done, key=lambda t: -len(frac.intersection(t))):
            size = model.add_triangle(*tri, limit=budget) if budget > 0 else 0
            budget -= size
            added += size
            if size:
                done.add(tri)
        if not added:
            break
    return status, len(done)


def _incumbent(red: Reduction, model: Model, backend: str, msg: bool, time_limit):
    """A good solution from the LP optimum in `model`: round it, and if some classes are
    fractional also solve the sub-problem left when the LP-integral classes are pinned (after
    presolving it again it is small); polish by local search."""
    candidates = [choices(model)]
    integral = {c: k for c, k in candidates[0].items()
                if max(v.varValue for v in model.x[c][1]) > 1 - 1e-6}
    if len(integral) < len(model.x):
        try:
            sub = red.restricted(integral)
        except Conflict:
            sub = None
        if sub is not None and sub.core:
            sub_model = Model(sub)
            if run(sub_model, backend, time_limit, msg, 1e-2) not in ("optimal", "feasible"):
                sub = None
        if sub is not None:
            nodes = sub.assign(choices(sub_model) if sub.core else {})
            candidates.append({c: nodes[red.names[c]] for c in red.core})
    best, best_cost = None, np.inf
    for start in candidates:
        found = local_search(red, start)
        if found is not None and core_cost(red, found) < best_cost:
            best, best_cost = found, core_cost(red, found)
    return best


def core_cost(red: Reduction, choice: dict[int, int]) -> float:
    """Cost of the core part of an assignment (what the ILP objective measures, unscaled)."""
    cost = sum(float(red.cost[c][choice[c]]) for c in red.core)
    return cost + sum(float(m[choice[a], choice[b]]) for (a, b), m in red.mat.items())


def local_search(red: Reduction, start: dict[int, int], sweeps: int = 50) -> dict[int, int] | None:
    """Best-response descent from `start` within memory budgets; None if it stays infeasible."""
    choice = dict(start)
    loads = [sum(float(m[choice[c]]) for c, m in mem.items()) for _, mem, _ in red.budgets]
    if any(load > limit + 1e-9 * abs(limit) for load, (_, _, limit) in zip(loads, red.budgets)):
        return None
    for _ in range(sweeps):
        changed = False
        for c in red.core:
            idx = np.flatnonzero(red.alive[c])
            local = red.cost[c][idx].copy()
            for nb in red.adj[c]:
                local += red.oriented(c, nb)[idx, choice[nb]]
            for i, (_, mem, limit) in enumerate(red.budgets):
                if c in mem:
                    over = loads[i] - mem[c][choice[c]] + mem[c][idx] > limit + 1e-9 * abs(limit)
                    local[over] = np.inf
            best = int(np.argmin(local))
            current = local[np.searchsorted(idx, choice[c])]
            better = local[best] < current - 1e-12 * abs(current) if np.isfinite(current) \
                else np.isfinite(local[best])
            if better:
                for i, (_, mem, _) in enumerate(red.budgets):
                    if c in mem:
                        loads[i] += mem[c][idx[best]] - mem[c][choice[c]]
                choice[c] = int(idx[best])
                changed = True
        if not changed:
            break
    return choice if np.isfinite(core_cost(red, choice)) else None
