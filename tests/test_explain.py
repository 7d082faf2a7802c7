"""`explain`: a parameter's next best layouts, each re-solved from the already built problem with
the parameter pinned, checked against planning from scratch with `AutoShard.pin`."""

import pytest
import torch

import autoshard_solver as solver
from autoshard.driver.api import AutoShard
from autoshard.problem.explain import ExplainError, match_params, redistribution_changes
from autoshard.report.build import plan_report
from autoshard.report.text import explain_lines, format_log
from autoshard_models import build_model, cross_entropy_loss, get_config

WQ = "layers.0.attention.wq.weight"


def tokens(batch=8, seq=64):
    return lambda: (torch.empty(batch, seq, dtype=torch.int64, device="meta"),) * 2


def fresh(pins=None):
    model = build_model(get_config("llama3-tiny"), device="meta")
    auto = AutoShard(model, tokens(), (2, 2), loss_fn=cross_entropy_loss)
    auto.memory_budget(sum(p.numel() * p.element_size() for p in model.parameters()) / 4)  # every one sharded
    if pins:
        auto.pin(pins)
    return auto.optimize(), auto


@pytest.fixture(scope="module")
def tiny():
    return fresh()


@pytest.fixture(scope="module")
def wq(tiny):
    # max_solves=3: the three candidates with the best estimate (the cheap path the CLI takes
    # when a parameter has many candidates); the slow test below re-solves all of them
    _, auto = tiny
    return auto.explain(WQ, top=0, max_solves=3)


def pinned_from_scratch(ex, alt):
    """Plan again, from a fresh AutoShard, with every parameter the explanation moved pinned."""
    plan, _ = fresh({fqn: alt.layout for fqn in ex.params + ex.tied})
    return plan


@pytest.mark.slow
def test_chosen_layout_and_alternatives(tiny, wq):
    plan, _ = tiny
    assert wq.params == [WQ] and wq.layout == plan.param_layouts[WQ]
    assert wq.tied == ["layers.1.attention.wq.weight"]  # the repeated block's copy moves with it
    assert wq.step_time_s == plan.step_time_s
    assert wq.candidates == 10 and wq.solved == 3 and len(wq.skipped) == 7 and "estimate" in wq.method
    assert wq.alternatives, wq
    times = [a.step_time_s for a in wq.alternatives]
    assert times == sorted(times)
    for alt in wq.alternatives:
        assert alt.layout != wq.layout and alt.status == "optimal"
        assert alt.step_time_s >= plan.step_time_s * (1 - 1e-9)  # the chosen plan is optimal
        assert alt.delta_s == pytest.approx(alt.step_time_s - plan.step_time_s, abs=1e-15)
        # wq feeds matmuls: another layout changes how it (at least) is redistributed
        assert alt.changes and any(c.producer == plan.graph.params[WQ].name for c in alt.changes)
        assert all(c.before != c.after for c in alt.changes)


@pytest.mark.slow
def test_best_alternative_equals_pinning_from_scratch(wq):
    best = wq.alternatives[0]
    assert pinned_from_scratch(wq, best).step_time_s == pytest.approx(best.step_time_s, rel=1e-9)


@pytest.mark.slow
def test_every_alternative_is_solved_and_the_last_equals_pinning_from_scratch(tiny):
    """Every candidate re-solved; the last (slowest) alternative planned again from scratch, as
    test_best_alternative_equals_pinning_from_scratch does the first (the ones between take the
    same path: each from scratch costs a full plan, ~20 s here)."""
    plan, auto = tiny
    ex = auto.explain(WQ, top=0)
    assert ex.solved == ex.candidates == 10 and not ex.skipped
    assert {str(lay) for lay in ex.infeasible} == {"RR", "RS(0)", "RS(1)", "S(0)R", "S(1)R"}  # memory budget
    assert len(ex.alternatives) == ex.candidates - len(ex.infeasible)  # candidates: the other layouts
    times = [a.step_time_s for a in ex.alternatives]
    assert times == sorted(times) and min(times) >= plan.step_time_s * (1 - 1e-9)
    last = ex.alternatives[-1]
    assert pinned_from_scratch(ex, last).step_time_s == pytest.approx(last.step_time_s, rel=1e-9)


@pytest.mark.slow
def test_top_limits_the_list_and_a_pattern_names_one_layout(tiny):
    plan, auto = tiny
    ex = auto.explain("norm.weight", top=1)
    assert len(ex.alternatives) <= 1 and ex.layout == plan.param_layouts["norm.weight"]
    for alt in ex.alternatives:
        assert alt.changes  # the final norm's weight is consumed by a mul
    # layers.*.attention.wq.weight names two parameters with one layout: explained together
    both = auto.explain("layers.*.attention.wq.weight", top=1, max_solves=1)
    assert both.params == [WQ, "layers.1.attention.wq.weight"] and both.tied == []


def test_unknown_or_ambiguous_fqn_is_named(tiny):
    plan, auto = tiny
    with pytest.raises(
        ExplainError,
        match=r"'layers\.0\.attention\.wq' matches no parameter; close matches: "
        r"layers\.0\.attention\.wq\.weight",
    ):
        auto.explain("layers.0.attention.wq")
    mixed = [f for f in plan.param_layouts if plan.param_layouts[f] != plan.param_layouts[WQ]]
    assert mixed
    with pytest.raises(ExplainError, match="different layouts"):
        auto.explain("*")
    with pytest.raises(ExplainError, match="a.wq.weight"):
        match_params("wq.weight", ["a.wq.weight", "b.wk.weight"])


def test_explain_needs_optimize_first():
    auto = AutoShard(
        build_model(get_config("llama3-tiny"), device="meta"), tokens(), (2, 2), loss_fn=cross_entropy_loss
    )
    with pytest.raises(ValueError, match="optimize"):
        auto.explain(WQ)


def test_redistribution_changes_of_a_plan_with_itself_are_empty(tiny):
    plan, _ = tiny
    assert redistribution_changes(plan, plan) == []


def test_report_section(tiny, wq):
    plan, _ = tiny
    report = plan_report(plan, explanation=wq)
    entry = report["explain"]
    assert entry["layout"] == str(wq.layout) and len(entry["alternatives"]) == len(wq.alternatives)
    for a, alt in zip(entry["alternatives"], wq.alternatives):
        assert a["changes_total"] == len(alt.changes) and 0 < len(a["changes"]) <= 10
        assert sum(g["count"] for g in a["changes"]) <= len(alt.changes)
    log = format_log(report)
    assert f"== explain {WQ}" in log and "next best layouts" in log
    assert "\n".join(explain_lines(entry)) in log


def test_restricted_problem_pins_tied_nodes_and_leaves_the_original_alone():
    p = solver.Problem()
    for name in "abcd":
        p.add_node(name, ["x", "y"])
    p.add_edge("a", "b", [[0, 5], [5, 0]])
    p.add_edge("c", "d", [[0, 5], [5, 0]])
    p.same_choice(["a", "c"])
    p.add_region([["a", "b"], ["c", "d"]])
    assert p.tied("a") == ["a", "c"] and p.tied("d") == ["b", "d"]
    q = p.restricted({"c": 1})
    assert len(p.constraints) == 1 and len(q.constraints) == 2 and q.edges[0].cost is p.edges[0].cost
    assert solver.solve(q).choice == {"a": 1, "b": 1, "c": 1, "d": 1}
    assert solver.solve(p).objective == 0
    with pytest.raises(ValueError, match="out of range"):
        p.restricted({"a": 2})
    p.memory_budget(["a"], 0)
    p.nodes[0].choices[1].memory = 1.0
    with pytest.raises(solver.InfeasibleError, match="not diagnosed"):
        solver.solve(p.restricted({"a": 1}), diagnose=False)


def test_cli_bad_fqn_is_one_error_line(capsys):
    from autoshard.__main__ import main

    with pytest.raises(SystemExit) as exit_:
        main(
            [
                "plan",
                "--model",
                "llama3-tiny",
                "--mesh",
                "2x2",
                "--batch",
                "8",
                "--seq",
                "64",
                "--no-dry-run",
                "--explain",
                "nope",
            ]
        )
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and "nope" in err[0] and "close matches: " in err[0]


@pytest.mark.slow
def test_cli_explain_prints_and_logs(tmp_path, capsys):
    from autoshard.__main__ import main

    out = tmp_path / "plan"
    main(
        [
            "plan",
            "--model",
            "llama3-tiny",
            "--mesh",
            "2x2",
            "--batch",
            "8",
            "--seq",
            "64",
            "--no-dry-run",
            "--explain",
            "norm.weight",
            "--explain-top",
            "1",
            "--out",
            str(out),
        ]
    )
    printed = capsys.readouterr().out
    assert "explain norm.weight:" in printed and "next best layouts" in printed
    assert "== explain norm.weight" in (out / "sharding.log").read_text()
