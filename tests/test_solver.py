"""solver/: optimality against brute force, presolve against none, backends against each other."""

import itertools
import math
import random

import numpy as np
import pytest

from autoshard_solver import (
    Allowed,
    Choice,
    Fixed,
    InfeasibleError,
    MemoryBudget,
    NoBetterError,
    Problem,
    SameChoice,
    available_backends,
    solve,
)

INF = math.inf


def brute(problem: Problem):
    """Minimum objective by enumerating every assignment (independent of solver code), or None."""
    index = problem.index()
    sizes = [len(n.choices) for n in problem.nodes]
    grid = np.array(list(itertools.product(*[range(k) for k in sizes])))
    total = np.zeros(len(grid))
    for i, node in enumerate(problem.nodes):
        total += np.array([c.cost for c in node.choices])[grid[:, i]]
    for e in problem.edges:
        total += np.array(e.cost)[grid[:, index[e.src]], grid[:, index[e.dst]]]
    ok = np.isfinite(total)
    for con in problem.constraints:
        if isinstance(con, Fixed):
            ok &= grid[:, index[con.node]] == con.choice_index
        elif isinstance(con, Allowed):
            ok &= np.isin(grid[:, index[con.node]], con.indices)
        elif isinstance(con, SameChoice):
            for n in con.nodes[1:]:
                ok &= grid[:, index[n]] == grid[:, index[con.nodes[0]]]
        elif isinstance(con, MemoryBudget):
            load = sum(
                np.array([c.memory for c in problem.nodes[index[n]].choices])[grid[:, index[n]]] for n in set(con.nodes)
            )
            for pair in con.edges:
                load = load + np.array(pair.memory)[grid[:, index[pair.src]], grid[:, index[pair.dst]]]
            ok &= load <= con.limit + 1e-9
    for region in problem.regions:
        for names in zip(*region.copies):
            for n in names[1:]:
                ok &= grid[:, index[n]] == grid[:, index[names[0]]]
    return float(total[ok].min()) if ok.any() else None


def random_problem(seed: int, max_nodes: int = 8, max_k: int = 4) -> Problem:
    rng = random.Random(seed)
    p = Problem()
    n = rng.randint(2, max_nodes)
    sizes = [rng.randint(1, max_k) for _ in range(n)]
    integer = rng.random() < 0.5  # integer costs create ties, which dominance must get right
    p_inf = rng.choice([0.0, 0.1, 0.3])

    def val(scale):
        return float(rng.randint(0, scale)) if integer else rng.uniform(0, scale)

    for i, k in enumerate(sizes):
        p.add_node(
            f"n{i}",
            [
                Choice(f"c{j}", INF if rng.random() < 0.03 else val(5), memory=float(rng.randint(0, 4)))
                for j in range(k)
            ],
        )
    density = rng.uniform(0.2, 0.7)
    for i in range(n):
        for j in range(i + 1, n):
            if rng.random() < density:
                p.add_edge(
                    f"n{i}",
                    f"n{j}",
                    [[INF if rng.random() < p_inf else val(9) for _ in range(sizes[j])] for _ in range(sizes[i])],
                )
    if rng.random() < 0.3:
        i = rng.randrange(n)
        p.fix(f"n{i}", rng.randrange(sizes[i]))
    if rng.random() < 0.3:
        i = rng.randrange(n)
        p.allow(f"n{i}", rng.sample(range(sizes[i]), rng.randint(1, sizes[i])))
    by_size = {}
    for i, k in enumerate(sizes):
        by_size.setdefault(k, []).append(f"n{i}")
    groups = [g for g in by_size.values() if len(g) >= 2]
    if groups and rng.random() < 0.3:
        p.same_choice(rng.sample(rng.choice(groups), 2), "tie")
    if len(groups) >= 1 and rng.random() < 0.2:
        g = rng.choice(groups)
        if len(g) >= 4:  # a region of two copies with two positions each
            a, b, c, d = rng.sample(g, 4)
            p.add_region([[a, b], [c, d]])
    if rng.random() < 0.3:
        nodes = rng.sample([x.name for x in p.nodes], rng.randint(1, n))
        hi = sum(max(c.memory for c in p.nodes[p.index()[x]].choices) for x in nodes)
        edges = {}
        if rng.random() < 0.5:  # memory on some pairs (an edge or not, a tied pair or not)
            for _ in range(rng.randint(1, 3)):
                i, j = rng.sample(range(n), 2)
                edges[(f"n{i}", f"n{j}")] = [
                    [float(rng.randint(0, 4) * (rng.random() < 0.6)) for _ in range(sizes[j])] for _ in range(sizes[i])
                ]
            hi += sum(max(map(max, m)) for m in edges.values())
        p.memory_budget(nodes, rng.uniform(0, hi), "mem", edges=edges)
    return p


def check_against_brute(problem: Problem, **kwargs):
    expected = brute(problem)
    if expected is None:
        with pytest.raises(InfeasibleError):
            solve(problem, **kwargs)
        return None
    sol = solve(problem, **kwargs)
    assert sol.objective == pytest.approx(expected, rel=1e-6, abs=1e-9)
    node_cost, edge_cost = problem.cost(sol.choice)
    assert node_cost + edge_cost == pytest.approx(sol.objective)
    assert brute(_pinned(problem, sol.choice)) is not None  # the answer meets every constraint
    return sol


def _pinned(problem: Problem, choice: dict) -> Problem:
    pinned = Problem(problem.nodes, problem.edges, list(problem.constraints), problem.regions)
    pinned.constraints += [Fixed(n, k) for n, k in choice.items()]
    return pinned


@pytest.mark.parametrize("presolve", [True, False])
def test_random_problems_match_brute_force(presolve):
    infeasible = with_core = 0
    for seed in range(400):
        sol = check_against_brute(random_problem(seed), presolve=presolve)
        infeasible += sol is None
        with_core += sol is not None and sol.stats.variables > 0
    assert 20 <= infeasible <= 200  # both outcomes are exercised
    assert with_core >= 40  # the ILP itself is exercised, not only presolve


def test_a_cutoff_stops_only_where_nothing_costs_less():
    """With a cutoff above the optimum the optimum comes back; at or below it, either the optimum
    or NoBetterError naming the LP bound that proved it: at least the cutoff, at most the optimum."""
    proved = 0
    for seed in range(300):
        problem = random_problem(seed)
        best = brute(problem)
        if best is None:
            continue
        margin = 1e-3 * max(1.0, abs(best))
        assert solve(problem, cutoff=best + margin).objective == pytest.approx(best, rel=1e-6, abs=1e-9)
        try:
            sol = solve(problem, cutoff=best - margin)
        except NoBetterError as err:
            proved += 1
            assert "no solution costs less than" in str(err) and f"the LP bound is {err.bound:.6g}" in str(err)
            assert best - margin <= err.bound <= best + 1e-6 * max(1.0, abs(best))
        else:
            assert sol.objective == pytest.approx(best, rel=1e-6, abs=1e-9)
    assert proved >= 10  # 18 of the 300: most are solved by presolve alone, without an LP


def test_presolve_matches_plain_ilp_on_larger_problems():
    for seed in range(12):
        p = random_problem(1000 + seed, max_nodes=40, max_k=5)
        p.constraints = [c for c in p.constraints if not isinstance(c, MemoryBudget)]
        try:
            plain = solve(p, presolve=False)
        except InfeasibleError:
            with pytest.raises(InfeasibleError):
                solve(p)
            continue
        reduced = solve(p)
        assert reduced.objective == pytest.approx(plain.objective, rel=1e-6, abs=1e-9)
        assert reduced.stats.variables <= plain.stats.variables


def test_long_chain_is_solved_by_presolve_alone():
    rng = random.Random(7)
    p = Problem()
    for i in range(300):
        p.add_node(f"v{i}", [f"c{j}" for j in range(4)])
        for ch in p.nodes[-1].choices:
            ch.cost = rng.uniform(0, 5)
        if i:
            p.add_edge(f"v{i - 1}", f"v{i}", [[rng.uniform(0, 5) for _ in range(4)] for _ in range(4)])
    full = solve(p)
    assert full.stats.variables == 0
    assert full.objective == pytest.approx(solve(p, presolve=False).objective, rel=1e-9)


@pytest.mark.skipif(len(available_backends()) < 2, reason="needs both HiGHS and CBC")
def test_backends_agree():
    for seed in range(20):
        p = random_problem(500 + seed, max_nodes=12, max_k=4)
        try:
            highs = solve(p, backend="highs", presolve=False)
        except InfeasibleError:
            with pytest.raises(InfeasibleError):
                solve(p, backend="cbc", presolve=False)
            continue
        cbc = solve(p, backend="cbc", presolve=False)
        assert cbc.objective == pytest.approx(highs.objective, rel=1e-6, abs=1e-9)
        assert (highs.stats.backend, cbc.stats.backend) == ("highs", "cbc")


def test_unknown_backend_is_rejected():
    with pytest.raises(ValueError, match="backend"):
        solve(random_problem(0), backend="gurobi")


@pytest.mark.skipif("highs" not in available_backends(), reason="HiGHS not installed")
def test_highs_prints_nothing_without_msg():
    """HiGHS's banner (printed by its constructor, once per process, to fd 1) stays out of the
    user's console; msg=True shows the solver's output, banner included."""
    import subprocess
    import sys
    from pathlib import Path

    child = (
        "from test_solver import random_problem; from autoshard_solver import solve; "
        "solve(random_problem(3), backend='highs', presolve=False, msg={msg})"
    )
    tests = Path(__file__).parent
    out = {
        msg: subprocess.run(
            [sys.executable, "-c", child.format(msg=msg)],
            capture_output=True,
            text=True,
            cwd=tests,
            env={"PYTHONPATH": f"{tests}:{tests.parent}", "PATH": "/usr/bin:/bin"},
            timeout=120,
        )
        for msg in (False, True)
    }
    assert out[False].returncode == 0 and out[False].stdout == "", out[False].stdout + out[False].stderr
    assert "HiGHS" in out[True].stdout
