"""The ILP over a presolved core, built with PuLP and solved with HiGHS or CBC.

x[c, k] one-hot per class. Pairwise costs use the local-polytope ("marginal") linearization: one
y per *finite* entry with sum_l y[k, l] = x_a[k] and sum_k y[k, l] = x_b[l]; forbidden (inf) entries
simply have no y, which forbids the pair. Rows (columns) of an edge matrix that are equal (in its
cost and in every budget's memory on it) are merged first, the y then pairing groups of choices,
which is exact and often much smaller. A memory budget's row sums its classes' x and its edges' y.
Triangles of the class graph can be tightened on demand (`Model.add_triangle`).
"""

from __future__ import annotations

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


class _LpProblem(pulp.LpProblem):
    """LpProblem that knows its columns: PuLP's own variables() re-scans every constraint and
    re-sorts, several times per solve, which costs more than building the model."""

    columns: list

    def variables(self):
        return self.columns


class Model:
    """The PuLP model of a Reduction's core; objective=False gives a pure feasibility model."""

    def __init__(self, red: Reduction, objective: bool = True):
        start = time.perf_counter()
        self.lp = _LpProblem("autoshard", pulp.LpMinimize)
        self.x: dict[int, tuple[np.ndarray, list]] = {}  # class -> (choice indices, variables)
        self.columns: list = []                           # every variable, for reduced costs
        self.lp.columns = self.columns
        self.constraints = 0
        # edge (a, b) -> (row group of each a choice, column group of each b choice, {(g, h): y})
        self.pairs: dict[tuple[int, int], tuple[np.ndarray, np.ndarray, dict]] = {}
        blocks = {}
        for (a, b) in red.mat:
            ia, ib = np.flatnonzero(red.alive[a]), np.flatnonzero(red.alive[b])
            blocks[(a, b)] = red.mat[(a, b)][np.ix_(ia, ib)]
        self.scale = _scale([red.cost[c][red.alive[c]] for c in red.core] + list(blocks.values()))
        obj = []
        for c in red.core:
            idx = np.flatnonzero(red.alive[c])
            xs = [self._var(f"x{c}_{k}", pulp.LpBinary) for k in idx]
            self.x[c] = (idx, xs)
            self._equal([(v, 1) for v in xs], 1)
            obj += [(v, w) for v, w in zip(xs, (red.cost[c][idx] * self.scale).tolist()) if w]
        budget_terms: list[list] = [[] for _ in red.budgets]  # per budget: (y, bytes) of its edges
        for (a, b), block in blocks.items():
            xa, xb = self.x[a][1], self.x[b][1]
            ia, ib = self.x[a][0], self.x[b][0]
            counted = [(i, m[np.ix_(ia, ib)]) for i, budget in enumerate(red.budgets)
                       if (m := budget.edges.get((a, b))) is not None]
            # entries [k, l, 0] cost, [k, l, 1 + i] the i-th counting budget's bytes: choices with
            # equal rows in all of them share their y
            stack = np.stack([block] + [m for _, m in counted], axis=2)
            rows, row_of = np.unique(stack.reshape(len(ia), -1), axis=0, return_inverse=True)
            rows = rows.reshape(len(rows), len(ib), -1)
            cols, col_of = np.unique(rows.transpose(1, 0, 2).reshape(len(ib), -1), axis=0, return_inverse=True)
            cols = cols.reshape(len(cols), len(rows), -1)  # [h, g, entry]
            row_of, col_of = row_of.ravel(), col_of.ravel()
            # y[g, h]: row group g of a paired with column group h of b, finite entries only
            ys, by_row, by_col = {}, [[] for _ in rows], [[] for _ in cols]
            for g, h in zip(*np.nonzero(np.isfinite(cols[:, :, 0].T))):
                v = ys[g, h] = self._var(f"y{len(self.columns)}")
                by_row[g].append((v, 1))
                by_col[h].append((v, 1))
                w = float(cols[h, g, 0]) * self.scale
                if w:
                    obj.append((v, w))
                for entry, (i, _) in enumerate(counted, start=1):
                    if cols[h, g, entry]:
                        budget_terms[i].append((v, float(cols[h, g, entry])))
            for k, g in enumerate(row_of):
                by_row[g].append((xa[k], -1))
            for l, h in enumerate(col_of):
                by_col[h].append((xb[l], -1))
            for terms in by_row + by_col:
                self._equal(terms, 0)
            self.pairs[(a, b)] = (row_of, col_of, ys)
        for budget, pairs in zip(red.budgets, budget_terms):
            terms = [(v, m) for c, row in budget.memory.items()
                     for v, m in zip(self.x[c][1], row[self.x[c][0]].tolist()) if m] + pairs
            if terms:
                self._add(terms, pulp.LpConstraintLE, float(budget.limit))
        self.lp.setObjective(pulp.LpAffineExpression(obj if objective else []))
        self.build_s = time.perf_counter() - start
        self.built = (len(self.columns), self.constraints)  # size before any tightening

    @property
    def variables(self) -> int:
        return len(self.columns)

    def _var(self, name: str, cat=pulp.LpContinuous):
        v = self.lp.add_variable(name, 0, 1 if cat == pulp.LpBinary else None, cat)
        self.columns.append(v)
        return v

    def _add(self, terms, sense, rhs) -> None:
        self.lp.addConstraint(pulp.LpConstraint(pulp.LpAffineExpression(terms), sense,
                                                f"c{self.constraints}", rhs))
        self.constraints += 1

    def _equal(self, terms, rhs) -> None:
        self._add(terms, pulp.LpConstraintEQ, rhs)

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
        zs = [self._var(f"z{len(self.columns)}") for _ in range(len(triples[0]))]
        for (row_of, col_of, ys), (u, v) in zip(sides, ((0, 1), (0, 2), (1, 2))):
            members: dict = {}
            for z, g, h in zip(zs, row_of[triples[u]], col_of[triples[v]]):
                members.setdefault((g, h), []).append((z, 1))
            for key, y in ys.items():
                self._equal(members.get(key, []) + [(y, -1)], 0)
        return len(zs)


def _scale(arrays) -> float:
    """Bring the largest finite coefficient to 1 so solver tolerances mean the same everywhere."""
    top = max((float(np.max(a, initial=0, where=np.isfinite(a))) for a in arrays), default=0.0)
    return 1.0 / top if top > 0 else 1.0


def run(model: Model, backend: str, time_limit, msg: bool, rel_gap: float, mip: bool = True,
        cutoff: float | None = None) -> str:
    """Solve (mip=False: the LP relaxation, leaving reduced costs in `var.dj`). `cutoff` (an
    objective value some solution is known to reach) lets HiGHS prune; CBC ignores it.

    Returns 'optimal', 'feasible' (stopped early with a solution), 'infeasible' or 'none'.
    """
    if backend == "highs":
        # HiGHS 1.15's presolve can loop forever (ignoring time_limit) in its doubleton-equation
        # pass on models like ours; ours has presolved them already, so it is not missed much
        extra = {} if cutoff is None else {"objective_bound": cutoff}
        solver = pulp.HiGHS(mip=mip, msg=msg, timeLimit=time_limit, gapRel=rel_gap,
                            presolve="off", **extra)
    else:
        with warnings.catch_warnings():  # PuLP 3.3 deprecates its bundled CBC, still the default
            warnings.simplefilter("ignore", DeprecationWarning)
            solver = pulp.PULP_CBC_CMD(mip=mip, msg=msg, timeLimit=time_limit, gapRel=rel_gap)
    model.lp.solve(solver)
    status, sol = model.lp.status, model.lp.sol_status
    if status == pulp.LpStatusInfeasible:
        return "infeasible"
    if sol == pulp.LpSolutionOptimal:
        return "optimal"
    if sol == pulp.LpSolutionIntegerFeasible and all(
            v.varValue is not None for _, xs in model.x.values() for v in xs):
        return "feasible"
    return "none"


def choices(model: Model) -> dict[int, int]:
    """Chosen choice index per core class."""
    out = {}
    for c, (idx, xs) in model.x.items():
        out[c] = int(idx[int(np.argmax([v.varValue or 0.0 for v in xs]))])
    return out
