"""The ILP over a presolved core, built as arrays and solved with HiGHS (highspy) or CBC (PuLP).

x[c, k] one-hot per class. Pairwise costs use the local-polytope ("marginal") linearization: one
y per *finite* entry with sum_l y[k, l] = x_a[k] and sum_k y[k, l] = x_b[l]; forbidden (inf) entries
simply have no y, which forbids the pair. Rows (columns) of an edge matrix that are equal (in its
cost and in every budget's memory on it) are merged first, the y then pairing groups of choices,
which is exact and often much smaller. A memory budget's row sums its classes' x and its edges' y.
Triangles of the class graph can be tightened on demand (`Model.add_triangle`).
"""

from __future__ import annotations

import os
import sys
import time
import warnings

import numpy as np
import pulp

from .presolve import Reduction


def available_backends() -> list[str]:
    have = pulp.listSolvers(onlyAvailable=True)
    return [b for b, name in (("highs", "HiGHS"), ("cbc", "PULP_CBC_CMD")) if name in have]


def pick_backend(backend: str) -> str:
    have = available_backends()
    if backend == "auto":
        if not have:
            raise RuntimeError("no ILP backend available: install highspy or PuLP's CBC")
        return have[0]
    if backend not in ("highs", "cbc"):
        raise ValueError(f"backend must be 'auto', 'highs' or 'cbc', got {backend!r}")
    if backend not in have:
        raise RuntimeError(f"backend {backend!r} is not available (have: {have})")
    return backend


class Model:
    """The LP/MIP of a Reduction's core as plain arrays (objective=False: a pure feasibility
    model): class `c`'s choices `x[c][0]` are the columns `x[c][1]`. Building it as PuLP
    variables and having PuLP copy them into HiGHS one by one took longer than HiGHS's own
    solve on a 70B problem; HiGHS now gets the arrays in one call, CBC through PuLP."""

    def __init__(self, red: Reduction, objective: bool = True):
        start = time.perf_counter()
        self.cost: list[float] = []  # per column, scaled
        self.binary: list[bool] = []  # per column: an x (binary in the MIP) or a y/z (continuous)
        self.rows: list[tuple[np.ndarray, np.ndarray, float, float]] = []  # (columns, coefficients, lower, upper)
        self.value: np.ndarray | None = None  # after `run`: each column's value
        self.reduced: np.ndarray | None = None  # after an LP: each column's reduced cost
        self.objective: float | None = None  # after `run`: the objective of `value` (scaled)
        self.x: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # class -> (choice indices, columns)
        # edge (a, b) -> (row group of each a choice, column group of each b choice, {(g, h): y column})
        self.pairs: dict[tuple[int, int], tuple[np.ndarray, np.ndarray, dict]] = {}
        blocks = {}
        for a, b in red.mat:
            ia, ib = np.flatnonzero(red.alive[a]), np.flatnonzero(red.alive[b])
            blocks[(a, b)] = red.mat[(a, b)][np.ix_(ia, ib)]
        self.scale = _scale([red.cost[c][red.alive[c]] for c in red.core] + list(blocks.values()))
        for c in red.core:
            idx = np.flatnonzero(red.alive[c])
            xs = self._columns(red.cost[c][idx] * self.scale if objective else np.zeros(len(idx)), binary=True)
            self.x[c] = (idx, xs)
            self._equal(xs, np.ones(len(xs)), 1.0)
        budget_terms: list[list] = [[] for _ in red.budgets]  # per budget: (y columns, bytes) of its edges
        for (a, b), block in blocks.items():
            (ia, xa), (ib, xb) = self.x[a], self.x[b]
            counted = [
                (i, m[np.ix_(ia, ib)])
                for i, budget in enumerate(red.budgets)
                if (m := budget.edges.get((a, b))) is not None
            ]
            # entries [k, l, 0] cost, [k, l, 1 + i] the i-th counting budget's bytes: choices with
            # equal rows in all of them share their y
            stack = np.stack([block] + [m for _, m in counted], axis=2)
            rows, row_of = np.unique(stack.reshape(len(ia), -1), axis=0, return_inverse=True)
            rows = rows.reshape(len(rows), len(ib), -1)
            cols, col_of = np.unique(rows.transpose(1, 0, 2).reshape(len(ib), -1), axis=0, return_inverse=True)
            cols = cols.reshape(len(cols), len(rows), -1)  # [h, g, entry]
            row_of, col_of = row_of.ravel(), col_of.ravel()
            # y[g, h]: row group g of a paired with column group h of b, finite entries only
            gs, hs = np.nonzero(np.isfinite(cols[:, :, 0].T))
            ys = self._columns(cols[hs, gs, 0] * self.scale if objective else np.zeros(len(gs)), binary=False)
            for entry, (i, _) in enumerate(counted, start=1):
                used = cols[hs, gs, entry] != 0
                budget_terms[i].append((ys[used], cols[hs, gs, entry][used]))
            for group, of, own in ((gs, row_of, xa), (hs, col_of, xb)):
                for g in range(int(of.max()) + 1):
                    mine, paired = ys[group == g], own[of == g]
                    self._equal(
                        np.concatenate([mine, paired]), np.concatenate([np.ones(len(mine)), -np.ones(len(paired))]), 0.0
                    )
            self.pairs[(a, b)] = (row_of, col_of, dict(zip(zip(gs.tolist(), hs.tolist()), ys.tolist())))
        for budget, pairs in zip(red.budgets, budget_terms):
            terms = [(self.x[c][1], row[self.x[c][0]]) for c, row in budget.memory.items()] + pairs
            columns = np.concatenate([t[0] for t in terms]) if terms else np.zeros(0, int)
            coefficients = np.concatenate([t[1] for t in terms]) if terms else np.zeros(0)
            used = coefficients != 0
            if used.any():
                self.rows.append((columns[used], coefficients[used], -np.inf, float(budget.limit)))
        self.build_s = time.perf_counter() - start
        self.built = (len(self.cost), len(self.rows))  # size before any tightening

    @property
    def variables(self) -> int:
        return len(self.cost)

    @property
    def constraints(self) -> int:
        return len(self.rows)

    def _columns(self, costs: np.ndarray, binary: bool) -> np.ndarray:
        """New columns with these (scaled) costs; their indices."""
        first = len(self.cost)
        self.cost.extend(np.asarray(costs, float).tolist())
        self.binary.extend([binary] * len(costs))
        return np.arange(first, len(self.cost))

    def _equal(self, columns: np.ndarray, coefficients: np.ndarray, rhs: float) -> None:
        used = coefficients != 0
        self.rows.append((np.asarray(columns)[used], np.asarray(coefficients, float)[used], rhs, rhs))

    def add_triangle(self, a: int, b: int, c: int, limit: int = 20000) -> int:
        """Tighten the relaxation on triangle a < b < c: z over consistent choice triples whose
        marginals are the three edges' y (the local polytope of the 3-clique). Integer
        solutions are unchanged; fractional 'frustrated cycle' solutions are cut off.
        Returns the number of z added (0 if there would be more than `limit`)."""
        sides = [self.pairs[(a, b)], self.pairs[(a, c)], self.pairs[(b, c)]]
        masks = []
        for row_of, col_of, ys in sides:
            finite = np.zeros((row_of.max() + 1, col_of.max() + 1), bool)
            finite[tuple(np.array(list(ys)).T)] = True
            masks.append(finite[np.ix_(row_of, col_of)])
        triples = np.nonzero(masks[0][:, :, None] & masks[1][:, None, :] & masks[2][None, :, :])
        if len(triples[0]) > limit:
            return 0
        zs = self._columns(np.zeros(len(triples[0])), binary=False)
        for (row_of, col_of, ys), (u, v) in zip(sides, ((0, 1), (0, 2), (1, 2))):
            members: dict = {}
            for z, g, h in zip(zs.tolist(), row_of[triples[u]].tolist(), col_of[triples[v]].tolist()):
                members.setdefault((g, h), []).append(z)
            for key, y in ys.items():
                mine = members.get(key, [])
                self._equal(np.array(mine + [y]), np.array([1.0] * len(mine) + [-1.0]), 0.0)
        return len(zs)


def _scale(arrays) -> float:
    """Bring the largest finite coefficient to 1 so solver tolerances mean the same everywhere."""
    top = max((float(np.max(a, initial=0, where=np.isfinite(a))) for a in arrays), default=0.0)
    return 1.0 / top if top > 0 else 1.0


def run(
    model: Model, backend: str, time_limit, msg: bool, rel_gap: float, mip: bool = True, cutoff: float | None = None
) -> str:
    """Solve (mip=False: the LP relaxation, leaving reduced costs in `model.reduced`). `cutoff`
    (an objective value some solution is known to reach) lets HiGHS prune; CBC ignores it.

    Returns 'optimal', 'feasible' (stopped early with a solution), 'infeasible' or 'none'.
    """
    model.value = model.reduced = model.objective = None
    status, value, reduced = (_run_highs if backend == "highs" else _run_cbc)(
        model, time_limit, msg, rel_gap, mip, cutoff
    )
    if value is not None:
        model.value, model.reduced = value, reduced
        model.objective = float(np.dot(model.cost, value))
    return status


def _new_highs(msg: bool):
    """A HiGHS instance. Its C++ constructor prints HiGHS's banner (version, copyright) to the
    process's stdout, once per process: a solver log (`msg`) may show it, a user's console not,
    so without `msg` file descriptor 1 points at /dev/null while the instance is made."""
    import highspy  # optional: `available_backends` says whether it is installed

    if msg:
        return highspy.Highs()
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 1)
            return highspy.Highs()
    finally:
        os.dup2(saved, 1)
        os.close(saved)


def _run_highs(model: Model, time_limit, msg: bool, rel_gap: float, mip: bool, cutoff: float | None):
    import highspy

    h = _new_highs(msg)
    h.setOptionValue("output_flag", bool(msg))
    h.setOptionValue("mip_rel_gap", rel_gap)
    # HiGHS 1.15's presolve can loop forever (ignoring time_limit) in its doubleton-equation
    # pass on models like ours; ours has presolved them already, so it is not missed much
    h.setOptionValue("presolve", "off")
    if time_limit is not None:
        h.setOptionValue("time_limit", float(time_limit))
    if cutoff is not None:
        h.setOptionValue("objective_bound", cutoff)
    lp = highspy.HighsLp()
    lp.num_col_, lp.num_row_ = len(model.cost), len(model.rows)
    lp.col_cost_ = np.array(model.cost, float)
    lp.col_lower_ = np.zeros(lp.num_col_)
    lp.col_upper_ = np.where(np.array(model.binary, bool), 1.0, highspy.kHighsInf)  # kHighsInf is float inf
    lp.row_lower_ = np.array([r[2] for r in model.rows], float)
    lp.row_upper_ = np.array([r[3] for r in model.rows], float)
    lengths = np.array([len(r[0]) for r in model.rows], np.int32)
    lp.a_matrix_.format_ = highspy.MatrixFormat.kRowwise
    lp.a_matrix_.start_ = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    lp.a_matrix_.index_ = (
        np.concatenate([r[0] for r in model.rows]).astype(np.int32) if model.rows else np.zeros(0, np.int32)
    )
    lp.a_matrix_.value_ = np.concatenate([r[1] for r in model.rows]).astype(float) if model.rows else np.zeros(0)
    if mip:
        lp.integrality_ = [
            highspy.HighsVarType.kInteger if b else highspy.HighsVarType.kContinuous for b in model.binary
        ]
    h.passModel(lp)
    h.run()
    status = h.getModelStatus()
    solution = h.getSolution()
    has_values = h.getInfo().primal_solution_status == 2  # kSolutionStatusFeasible
    value = np.array(solution.col_value) if has_values else None
    reduced = np.array(solution.col_dual) if has_values and not mip else None
    kinds = highspy.HighsModelStatus
    if status == kinds.kOptimal:
        return "optimal", value, reduced
    if status in (kinds.kInfeasible, kinds.kUnboundedOrInfeasible):
        return "infeasible", None, None
    return ("feasible" if value is not None else "none"), value, reduced


class _LpProblem(pulp.LpProblem):
    """LpProblem that knows its columns: PuLP's own variables() re-scans every constraint and
    re-sorts, several times per solve, which costs more than building the model."""

    columns: list

    def variables(self):
        return self.columns


def _run_cbc(model: Model, time_limit, msg: bool, rel_gap: float, mip: bool, cutoff: float | None):
    lp = _LpProblem("autoshard", pulp.LpMinimize)
    cols = lp.columns = [
        lp.add_variable(f"v{i}", 0, 1 if b else None, pulp.LpBinary if b and mip else pulp.LpContinuous)
        for i, b in enumerate(model.binary)
    ]
    lp.setObjective(pulp.LpAffineExpression([(v, w) for v, w in zip(cols, model.cost) if w]))
    for i, (columns, coefficients, lower, upper) in enumerate(model.rows):
        expression = pulp.LpAffineExpression([(cols[j], float(w)) for j, w in zip(columns.tolist(), coefficients)])
        sense, rhs = (pulp.LpConstraintEQ, lower) if lower == upper else (pulp.LpConstraintLE, upper)
        lp.addConstraint(pulp.LpConstraint(expression, sense, f"c{i}", rhs))
    with warnings.catch_warnings():  # PuLP 3.3 deprecates its bundled CBC, still the default
        warnings.simplefilter("ignore", DeprecationWarning)
        solver = pulp.PULP_CBC_CMD(mip=mip, msg=msg, timeLimit=time_limit, gapRel=rel_gap)
    lp.solve(solver)
    if lp.status == pulp.LpStatusInfeasible:
        return "infeasible", None, None
    values = [v.varValue for v in cols]
    if any(v is None for v in values):
        return "none", None, None
    value = np.array(values, float)
    reduced = np.array([v.dj if v.dj is not None else 0.0 for v in cols], float) if not mip else None
    if lp.sol_status == pulp.LpSolutionOptimal:
        return "optimal", value, reduced
    if lp.sol_status == pulp.LpSolutionIntegerFeasible:
        return "feasible", value, reduced
    return "none", None, None


def choices(model: Model) -> dict[int, int]:
    """Chosen choice index per core class (after a `run` that found a solution)."""
    value = model.value
    assert value is not None, "choices() needs a solved model"
    return {c: int(idx[int(np.argmax(value[xs]))]) for c, (idx, xs) in model.x.items()}
