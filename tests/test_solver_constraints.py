"""solver/: repeated regions, constraints, infeasibility messages, JSON, validation, no torch."""

import itertools
import json
import math
import random
import subprocess
import sys

import pytest

from autoshard_solver import Choice, InfeasibleError, Problem, Solution, solve

INF = math.inf


def block_chain(copies: int, seed: int = 0, external: bool = False) -> tuple[Problem, list]:
    """`copies` identical 3-node blocks (in -> mid -> out, in -> out), out_c -> in_c+1 edges and
    out_c -> out_c+1 edges (same position: a diagonal-only edge once copies share variables).
    With `external`, a global node feeds every block's mid with a different matrix per copy."""
    rng = random.Random(seed)
    k = 3
    cost = {pos: [rng.uniform(0, 10) for _ in range(k)] for pos in ("in", "mid", "out")}
    inner = {e: [[rng.uniform(0, 10) for _ in range(k)] for _ in range(k)] for e in (("in", "mid"), ("mid", "out"))}
    # strongly prefer in == out inside a block and across blocks, so the unclustered optimum is
    # one repeated block state (each block state that is best alone is also best in the chain)
    same = [[0.0 if i == j else 100.0 for j in range(k)] for i in range(k)]
    p, region = Problem(), []
    if external:
        p.add_node("g", [Choice("g0", 1.0), Choice("g1", 2.0)])
    for c in range(copies):
        names = [f"b{c}.{pos}" for pos in ("in", "mid", "out")]
        for name, pos in zip(names, ("in", "mid", "out")):
            p.add_node(name, [Choice(f"s{j}", cost[pos][j]) for j in range(k)])
        (i, m, o) = names
        p.add_edge(i, m, inner[("in", "mid")])
        p.add_edge(m, o, inner[("mid", "out")])
        p.add_edge(i, o, same)
        if c:
            p.add_edge(f"b{c - 1}.out", i, same)
            p.add_edge(f"b{c - 1}.out", o, [[rng.uniform(0, 1) for _ in range(k)] for _ in range(k)])
        if external:
            p.add_edge("g", m, [[rng.uniform(0, 5) for _ in range(k)] for _ in range(2)])
        region.append(names)
    return p, region


def test_repeated_region_equals_unclustered_with_a_32th_of_the_variables():
    p, copies = block_chain(32)
    plain = solve(p, presolve=False)
    p.add_region(copies)
    shared = solve(p, presolve=False)
    assert shared.objective == pytest.approx(plain.objective, rel=1e-9)
    assert shared.choice == plain.choice
    assert shared.stats.classes == 3
    ratio = shared.stats.variables / plain.stats.variables
    assert ratio < 1.1 / 32, ratio  # cross-copy edges merge into one, same-position ones vanish


@pytest.mark.parametrize("presolve", [True, False])
def test_region_prices_external_and_cross_copy_edges(presolve):
    """Copies differ in their edges from outside; the shared solve must price each one."""
    p, copies = block_chain(32, seed=3, external=True)
    p.add_region(copies)
    sol = solve(p, presolve=presolve)
    best = math.inf
    for g, states in itertools.product(range(2), itertools.product(range(3), repeat=3)):
        choice = {"g": g}
        for names in copies:
            choice.update(zip(names, states))
        best = min(best, sum(p.cost(choice)))
    assert sol.objective == pytest.approx(best, rel=1e-9)
    assert all(sol.choice[a] == sol.choice[b] for names in zip(*copies) for a, b in zip(names, names[1:]))


def tiny() -> Problem:
    """Two producers feeding one consumer; choice 1 is faster but needs more memory."""
    p = Problem()
    for name in ("w", "v"):
        p.add_node(name, [Choice("R", cost=4.0, memory=10.0), Choice("S", cost=1.0, memory=2.0)])
    p.add_node("y", [Choice("R", 1.0), Choice("S", 3.0)])
    p.add_edge("w", "y", [[0, 2], [2, 0]])
    p.add_edge("v", "y", [[0, 2], [2, 0]])
    return p


def test_memory_budget_binding_changes_the_answer():
    p = tiny()
    free = solve(p)
    assert free.choice == {"w": 1, "v": 1, "y": 1}
    p.nodes[0].choices[1].memory = 30.0  # S of w now heavy
    p.memory_budget(["w", "v"], 15.0, "hbm")
    tight = solve(p)
    assert tight.choice["w"] == 0 and tight.choice["v"] == 1
    assert tight.objective > free.objective


def test_a_budget_with_its_own_memory_table():
    """A budget may carry its own figures per choice (a peak-memory budget weighs a parameter more
    than the parameter-bytes budget does): those count, not `Choice.memory`; both budgets hold at
    once; the table survives JSON; a table of the wrong length is refused."""
    from autoshard_solver.problem import problem_from_json, problem_to_json

    p = tiny()
    free = solve(p)
    assert free.choice["w"] == 1
    p.memory_budget(["w", "v"], 15.0, "params")  # over the choices' own memory: S needs 2, fits
    table = {"w": [1.0, 40.0], "v": [1.0, 1.0]}  # w's S heavy in this budget only
    budget = p.memory_budget(["w", "v"], 20.0, "peak", memory=table)
    tight = solve(p)
    assert tight.choice["w"] == 0 and tight.objective > free.objective
    again = problem_from_json(problem_to_json(p))
    assert again.constraints[-1] == budget and solve(again).choice == tight.choice
    p.constraints.append(type(budget)(["w"], 1.0, "bad", {"w": [1.0]}))
    with pytest.raises(ValueError, match="needs 2 finite memory figures"):
        p.validate()


def test_a_budget_counts_memory_on_edges():
    """Bytes that exist only for some pairs of choices (a copy the edge's redistribution makes)
    count when that pair is chosen: the cheapest pair is ruled out by them alone, pairs that
    hold nothing stay open, and the terms survive JSON; a matrix of the wrong shape is refused."""
    from autoshard_solver.problem import problem_from_json, problem_to_json

    p = tiny()
    free = solve(p)
    assert (free.choice["w"], free.choice["v"]) == (1, 1)
    copy = [[0.0, 0.0], [0.0, 50.0]]  # w S feeding v S holds 50 bytes; every other pair none
    budget = p.memory_budget(
        ["w", "v"], 20.0, "peak", memory={"w": [1.0, 1.0], "v": [1.0, 1.0]}, edges={("w", "v"): copy}
    )
    tight = solve(p)
    assert (tight.choice["w"], tight.choice["v"]) != (1, 1) and tight.objective > free.objective
    assert tight.objective == pytest.approx(
        min(
            sum(p.cost({"w": a, "v": b, "y": y})) for a, b, y in itertools.product((0, 1), repeat=3) if (a, b) != (1, 1)
        )
    )
    again = problem_from_json(problem_to_json(p))
    assert again.constraints[-1] == budget and solve(again).choice == tight.choice
    p.constraints[-1].limit = 60.0  # now the copy fits: the free answer again
    assert solve(p).choice == free.choice
    p.constraints.append(type(budget)(["w"], 1.0, "bad", None, [type(budget.edges[0])("w", "v", [[1.0]])]))
    with pytest.raises(ValueError, match="edge 'w'->'v' needs a 2x2 matrix"):
        p.validate()


def test_the_digest_is_the_problem_s_content():
    """`problem_digest` (the fingerprint plan files are matched by) is equal for problems equal in
    content, whether their blocks share matrices and choice lists or hold copies, and after a JSON
    round trip; any change to a cost cell, a label, a choice's memory, a constraint or a region
    changes it."""
    from autoshard_solver.problem import problem_digest, problem_from_json, problem_to_json

    shared, region = block_chain(4, external=True)
    copied = problem_from_json(problem_to_json(shared))  # no matrix or list shared any more
    assert copied.edges[0].cost is not copied.edges[3].cost
    base = problem_digest(shared)
    assert len(base) == 64 and problem_digest(copied) == base

    def changed(edit) -> str:
        p = problem_from_json(problem_to_json(shared))
        edit(p)
        return problem_digest(p)

    edits = {
        "a cost cell": lambda p: p.edges[5].cost[1].__setitem__(2, p.edges[5].cost[1][2] + 1e-9),
        "an inf cell": lambda p: p.edges[5].cost[0].__setitem__(0, INF),
        "a label": lambda p: setattr(p.nodes[2].choices[0], "label", "other"),
        "a memory": lambda p: setattr(p.nodes[2].choices[0], "memory", 1.0),
        "a pin": lambda p: p.fix("b1.mid", 0),
        "a region": lambda p: p.add_region(region),
    }
    digests = {what: changed(edit) for what, edit in edits.items()}
    assert base not in digests.values() and len(set(digests.values())) == len(edits), digests


def test_pins_and_same_choice_are_respected():
    p = tiny()
    p.fix("w", 0)
    p.allow("y", [0])
    p.same_choice(["w", "v"], "param+grad")
    sol = solve(p)
    assert sol.choice == {"w": 0, "v": 0, "y": 0}
    assert sol.label("w") == "R" and sol.objective == pytest.approx(9.0)


def test_infeasible_names_the_conflicting_constraints_only():
    p = tiny()
    unrelated = [p.allow("y", [0, 1]), p.memory_budget(["w", "v", "y"], 1e9, "loose")]
    conflict = [p.fix("w", 0), p.same_choice(["w", "v"], "tie"), p.fix("v", 1)]
    with pytest.raises(InfeasibleError) as err:
        solve(p)
    assert sorted(map(repr, err.value.constraints)) == sorted(map(repr, conflict))
    text = str(err.value)
    assert "Fixed('w', 0)" in text and "Fixed('v', 1)" in text and "tie" in text
    assert all(c.describe() not in text for c in unrelated)


def test_infeasible_budget_and_region_are_named():
    p = tiny()
    budget = p.memory_budget(["w", "v"], 5.0, "hbm")
    pin = p.fix("w", 0)  # R needs 10 bytes alone
    with pytest.raises(InfeasibleError, match="hbm") as err:
        solve(p)
    assert err.value.constraints == [budget, pin]

    q, copies = block_chain(4)
    q.add_region(copies)
    q.fix("b0.mid", 0)
    q.fix("b2.mid", 2)
    with pytest.raises(InfeasibleError, match=r"RepeatedRegion\(4 copies x 3 nodes\)") as err:
        solve(q)
    assert len(err.value.constraints) == 3


def test_infeasible_structure_names_node_and_edge():
    p = Problem()
    p.add_node("a", ["R", "S"])
    p.add_node("b", ["R", "S"])
    p.add_node("c", ["R"])
    p.add_edge("a", "b", [[0, INF], [INF, 0]])
    p.add_edge("b", "c", [[INF], [1.0]])  # b must be S
    p.add_edge("a", "c", [[0.0], [INF]])  # a must be R, hence b R: conflict
    with pytest.raises(InfeasibleError, match=r"node '[abc]'.*edge '[abc]'->'[abc]'") as err:
        solve(p)
    assert err.value.edge is not None and err.value.constraints == []


def full_problem() -> Problem:
    p, copies = block_chain(3, seed=1, external=True)
    p.nodes[1].choices[0].cost = INF
    p.nodes[1].choices[1].tags = ("dp", "tp")
    p.edges[0].cost[0][0] = INF
    p.add_region(copies)
    p.fix("g", 1)
    p.allow("b0.in", [0, 2])
    p.same_choice(["b0.in", "b0.out"], "pair")
    p.memory_budget(["b0.in", "g"], 1e12, "hbm")
    p.memory_budget(["b1.in"], INF, "unbounded")
    return p


def test_json_round_trip():
    p = full_problem()
    text = p.to_json()
    json.loads(text, parse_constant=lambda c: pytest.fail(f"non-JSON constant {c}"))
    assert Problem.from_json(text) == p
    sol = solve(p)
    again = Solution.from_json(sol.to_json())
    assert again == sol and again.label("g") == sol.label("g")
    assert solve(Problem.from_json(text)).choice == sol.choice


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda p: p.add_edge("a", "nope", [[0]]), "unknown node 'nope'"),
        (lambda p: p.add_edge("a", "b", [[0, 1]]), r"edge 'a'->'b': cost matrix must be 2x2"),
        (lambda p: p.add_edge("a", "b", [[0, -1], [0, 0]]), "must be >= 0"),
        (lambda p: p.add_edge("a", "b", [[0, math.nan], [0, 0]]), "must be >= 0"),
        (lambda p: setattr(p.nodes[0].choices[0], "cost", -2.0), "node 'a' choice 'R' cost"),
        (lambda p: p.fix("a", 5), r"Fixed\('a', 5\): choice index out of range"),
        (lambda p: p.same_choice(["a", "c"]), "different numbers of choices"),
        (lambda p: p.add_region([["a"], ["c"]]), "different numbers of choices"),
        (lambda p: p.add_node("a", ["R"]), "duplicate node name 'a'"),
    ],
)
def test_bad_input_is_named(mutate, message):
    p = Problem()
    p.add_node("a", ["R", "S"])
    p.add_node("b", ["R", "S"])
    p.add_node("c", ["R"])
    mutate(p)
    with pytest.raises(ValueError, match=message):
        solve(p)


def test_import_does_not_pull_torch():
    code = "import sys, solver; solver.solve(solver.Problem()); print('torch' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=__file__.rsplit("/tests/", 1)[0]
    )
    assert out.stdout.strip() == "False"
