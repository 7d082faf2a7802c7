"""Explain infeasibility: name the node and edge, or the smallest set of conflicting constraints.

First the structure alone (inf entries, inf node costs) is checked. If that is satisfiable the user
constraints and regions are the culprits: QuickXplain (Junker 2004) searches an irreducible
conflicting subset with O(k log n) feasibility checks, each a presolve (which catches most
conflicts on its own) and, where presolve cannot decide, a small ILP without objective.
"""

from __future__ import annotations

from .constraints import RepeatedRegion
from .model import Model, run
from .presolve import Arrays, Conflict, Reduction
from .problem import Edge, InfeasibleError, Problem


def explain(problem: Problem, backend: str) -> InfeasibleError:
    # regions first: QuickXplain then keeps them in the background of most checks, and a
    # check with the regions shared is much smaller than one without
    items = list(problem.regions) + list(problem.constraints)
    arrays = Arrays.of(problem, costs=False)

    def check(subset) -> Conflict | bool:
        """True if feasible, else False or the presolve Conflict that proved it is not."""
        regions = [r for r in subset if isinstance(r, RepeatedRegion)]
        constraints = [c for c in subset if not isinstance(c, RepeatedRegion)]
        try:
            red = Reduction(problem, constraints, regions, arrays=arrays)
        except Conflict as conflict:
            return conflict
        if not red.core:
            return True
        return run(Model(red, objective=False), backend, None, False, 1e-4) != "infeasible"

    base = check([])
    if isinstance(base, Conflict):
        return _structural(base)
    if base is True:
        if check(items) is True:
            return InfeasibleError(
                "the ILP solver reported infeasible but every constraint can be met; numerically unstable costs?"
            )
        found = _quickxplain(items, lambda s: check(s) is True)
        detail = check(found)
        where = ""
        if isinstance(detail, Conflict) and detail.node is not None:
            where = f" (node {detail.node!r} is left without a choice)"
        names = "; ".join(c.describe() for c in found)
        return InfeasibleError(
            f"infeasible: these constraints conflict{where}: {names}. "
            "(Irreducible: without any one of them the rest is satisfiable.)",
            found,
        )
    return InfeasibleError(
        "infeasible: the inf entries of the edge matrices admit no assignment "
        "even without constraints (a cycle of incompatible edges)"
    )


def _structural(conflict: Conflict) -> InfeasibleError:
    cause = conflict.cause
    if isinstance(cause, Edge):
        return InfeasibleError(
            f"infeasible: node {conflict.node!r} has no allowed choice left: edge "
            f"{cause.src!r}->{cause.dst!r} is inf for every remaining combination",
            node=conflict.node,
            edge=cause,
        )
    return InfeasibleError(f"infeasible: node {conflict.node!r}: {cause}", node=conflict.node)


def _quickxplain(items: list, feasible) -> list:
    """Irreducible infeasible subset of `items`, given feasible([]) and not feasible(items)."""

    def qx(background: list, added: bool, candidates: list) -> list:
        if added and not feasible(background):
            return []
        if len(candidates) == 1:
            return list(candidates)
        half = len(candidates) // 2
        first, second = candidates[:half], candidates[half:]
        keep_second = qx(background + first, True, second)
        keep_first = qx(background + keep_second, bool(keep_second), first)
        return keep_first + keep_second

    return qx([], False, items)
