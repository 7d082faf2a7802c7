"""solver/search.py: the LP-first pipeline (triangles, incumbent, reduced-cost fixing) against one
plain MIP of the same presolved model, on problems too large for brute force."""

import random

import pytest

from autoshard_solver import InfeasibleError, Problem, search, solve
from autoshard_solver.model import Model, choices, run
from autoshard_solver.presolve import Reduction
from autoshard_solver.search import core_cost


def frustrated(seed: int, n: int = 14, k: int = 4) -> Problem:
    """Random graph with many triangles; most edges like equal layouts, a few ('matmul-like')
    like a permuted one, which makes cycles frustrated and the LP relaxation fractional."""
    rng = random.Random(seed)
    p = Problem()
    for i in range(n):
        node = p.add_node(f"v{i}", [f"c{j}" for j in range(k)])
        for ch in node.choices:
            ch.cost, ch.memory = rng.uniform(0, 8), float(rng.randint(1, 4))
    for i in range(1, n):
        for j in rng.sample(range(max(0, i - 4), i), min(i, rng.randint(1, 3))):
            perm = rng.sample(range(k), k) if rng.random() < 0.3 else range(k)
            p.add_edge(
                f"v{j}", f"v{i}", [[0.0 if perm[a] == b else rng.uniform(1, 6) for b in range(k)] for a in range(k)]
            )
    if seed % 3 == 0:
        p.memory_budget([f"v{i}" for i in range(0, n, 2)], 2.2 * n / 2, "hbm")
    return p


def plain_mip(problem: Problem) -> float:
    """Optimum by a single MIP over the un-reduced model (no LP phase, no fixing)."""
    red = Reduction(problem, problem.constraints, problem.regions, reduce=False)
    model = Model(red)
    assert run(model, "highs", None, False, 1e-9) == "optimal"
    chosen = {c: int(idx[max(range(len(xs)), key=lambda i: model.value[xs[i]])]) for c, (idx, xs) in model.x.items()}
    return sum(problem.cost(red.assign(chosen)))


@pytest.mark.slow
@pytest.mark.parametrize("weak_incumbent", [False, True])
def test_lp_pipeline_matches_a_plain_mip(weak_incumbent, monkeypatch):
    if weak_incumbent:  # rounding + local search only: fixing and the MIP must do the rest
        monkeypatch.setattr(search, "_incumbent", lambda red, model, *_: search.local_search(red, choices(model)))
    used_triangles = used_fixing = 0
    for seed in range(20):
        p = frustrated(seed)
        try:
            sol = solve(p)
        except InfeasibleError:
            pytest.fail(f"seed {seed}: unexpectedly infeasible")
        assert sol.objective == pytest.approx(plain_mip(p), rel=1e-6)
        assert sol.stats.bound <= sol.objective + 1e-9
        used_triangles += sol.stats.triangles > 0
        used_fixing += sol.stats.lp_fixed > 0
    assert used_triangles >= 3 and used_fixing >= 3  # the pipeline's stages were exercised


def test_time_limit_returns_a_solution_with_a_bound():
    p = frustrated(1, n=60, k=6)
    sol = solve(p, time_limit=1)
    assert sol.status in ("optimal", "feasible")
    assert 0 <= sol.stats.bound <= sol.objective + 1e-9


def test_core_cost_is_the_objective_up_to_a_constant():
    p = frustrated(4)
    red = Reduction(p, p.constraints, p.regions)
    rng = random.Random(0)
    gaps = set()
    for _ in range(5):
        choice = {c: int(rng.choice(list(red.alive[c].nonzero()[0]))) for c in red.core}
        gaps.add(round(sum(p.cost(red.assign(choice))) - core_cost(red, choice), 9))
    assert len(gaps) == 1


def test_tightening_stops_once_the_lp_bound_reaches_the_cutoff(monkeypatch):
    """Triangles only raise the LP bound: with a cutoff the first bound already reaches, one LP
    is solved; with one between the first and the last bound, rounds go on until it is reached."""
    bounds, real_run = [], search.run

    def run(model, *args, mip=True, **kwargs):
        status = real_run(model, *args, mip=mip, **kwargs)
        if not mip:
            bounds.append(model.objective / model.scale)
        return status

    monkeypatch.setattr(search, "run", run)
    tightened = 0
    for seed in range(20):
        p = frustrated(seed)
        red = Reduction(p, p.constraints, p.regions)
        bounds.clear()
        search._tightened_lp(red, Model(red), "highs", lambda: None, False, 1e-6)
        rounds = list(bounds)
        if len(rounds) < 2 or rounds[-1] <= rounds[0] + 1e-6:
            continue
        tightened += 1
        assert rounds == sorted(rounds)
        for stop_at, expected in ((rounds[0] * 0.999, 1), ((rounds[0] + rounds[-1]) / 2, None)):
            bounds.clear()
            search._tightened_lp(red, Model(red), "highs", lambda: None, False, 1e-6, stop_at)
            if expected is not None:
                assert len(bounds) == expected
            else:
                assert 1 < len(bounds) <= len(rounds) and bounds[-1] >= stop_at * (1 - 1e-6)
                assert all(b < stop_at for b in bounds[:-1])
    assert tightened >= 3
