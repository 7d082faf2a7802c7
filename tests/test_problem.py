"""The sharding problem: a traced llama step, planner-priced edges, constraints, and the plan read back."""

import math

import pytest
import torch

from autoshard import _torch_compat as tc
from autoshard.driver.api import AutoShard
from autoshard.layout import Layout
from autoshard.pricing.ring import bucket_copy_bytes
from autoshard.problem.build import grad_sink
from autoshard.problem.recipes import param_bytes_per_rank, recipe_layouts, recipe_pins
from autoshard_models import build_model, cross_entropy_loss, get_config


def tokens(batch, seq):
    return lambda: (torch.empty(batch, seq, dtype=torch.int64, device="meta"),) * 2


def plan_for(mesh, batch=8, seq=64, cfg=None, device="h100", pins=None, budget=None, inputs=None, outputs=None, **kw):
    cfg = cfg or get_config("llama3-tiny")
    model = build_model(cfg, device="meta")
    with AutoShard(model, tokens(batch, seq), mesh, loss_fn=cross_entropy_loss, device=device, **kw) as auto:
        if pins:
            auto.pin(pins)
        if budget is not None:
            auto.memory_budget(budget)
        if inputs:
            auto.constrain_inputs(*inputs)
        if outputs:
            auto.constrain_outputs(*outputs)
        return auto.optimize(), auto


# llama3-tiny's parameter bytes / 4: every parameter fully sharded on (2, 2). Without a budget,
# h100 compute is so cheap for it that replicating everything (no collective at all) wins.
FULLY_SHARDED = (
    sum(p.numel() * p.element_size() for p in build_model(get_config("llama3-tiny"), device="meta").parameters()) / 4
)


@pytest.fixture(scope="module")
def tiny_2x2():
    return plan_for((2, 2), budget=FULLY_SHARDED)


@pytest.mark.slow
def test_every_op_has_a_strategy_and_grads_follow_params(tiny_2x2):
    plan, auto = tiny_2x2
    model = build_model(get_config("llama3-tiny"), device="meta")
    assert set(plan.param_layouts) == {name for name, _ in model.named_parameters()}
    ops = [name for name, path in plan.module_paths.items()]
    assert len(plan.strategies) > 400 and len(ops) > 500
    for fqn, layout in plan.param_layouts.items():
        assert plan.strategies[grad_sink(fqn)].inputs[0] == layout
        assert all(p.kind != "P" for p in layout.placements)
    # The plan's own figures are the solver's objective: one cost model, priced once; the
    # optimizer step is part of it (every trained parameter's local elements at the device's rate).
    assert plan.step_time_s == pytest.approx(plan.solution.objective, rel=1e-6)
    assert plan.comm_s == pytest.approx(plan.solution.edge_cost, rel=1e-6)
    elements = sum(
        math.prod(lay.local_shape(tuple(p.shape), (2, 2)))
        for fqn, p in model.named_parameters()
        for lay in [plan.param_layouts[fqn]]
    )
    assert plan.optimizer_s == pytest.approx(auto.device.optimizer_s(elements), rel=1e-9) and plan.optimizer_s > 0
    assert set(auto.timings) == {"trace", "build", "solve", "decode"}


def test_a_parameter_budget_of_total_over_world_shards_every_parameter_fully(tiny_2x2):
    plan, _ = tiny_2x2
    for fqn, layout in plan.param_layouts.items():
        assert sorted(m for _, mds in layout.order for m in mds) == [0, 1], (fqn, layout)


def test_without_a_budget_the_ilp_may_replicate():
    """llama3-debug on 2x2 gloo CPU ranks (the presets): replicated parameters and gradients
    all-reduced (DDP's plan) cost less than any sharding, and nothing forbids them any more; the
    memory limit (the machine's RAM less 10%) holds them easily."""
    plan, auto = plan_for((2, 2), batch=8, seq=256, cfg=get_config("llama3-debug"), device="cpu", network="cpu-gloo")
    assert {str(lay) for lay in plan.param_layouts.values()} == {"RR"}
    assert set(plan.count_by_collective) == {"all_reduce"}
    assert auto.fit is not None and not auto.fit.constrained and auto.fit.modeled_bytes < auto.fit.limit


def test_redistributions_are_planner_plans_between_chosen_layouts(tiny_2x2):
    plan, auto = tiny_2x2
    assert plan.redistributions
    for r in plan.redistributions:
        assert r.plan.src != r.plan.dst
        assert r.plan.src == plan.strategies[r.producer].outputs[0] or len(plan.strategies[r.producer].outputs) > 1
        assert r.plan.dst == plan.strategies[r.consumer].inputs[r.slot]
        # a bucketed gather or reduction shares its launch and latency with its block (never more)
        # and pays the executor's copies of its part of the bucket at the network's copy rate
        assert 0 <= r.plan.cost_s + r.copy_s - r.cost_s <= r.plan.steps[0].fixed_s * (1 + 1e-9)
        first = r.plan.steps[0]
        if r.copy_s:
            group = math.prod(plan.mesh_shape[d] for d in first.mesh_dims)
            copied = bucket_copy_bytes(first.kind, group, first.in_bytes)
            assert r.copy_s == pytest.approx(copied / auto.network.mem_bw, rel=1e-12)
    assert sum(r.cost_s for r in plan.redistributions) == pytest.approx(plan.comm_s)
    assert any(r.cost_s < r.plan.cost_s for r in plan.redistributions)
    assert {r.plan.steps[0].kind for r in plan.redistributions if r.copy_s} == {"all_gather", "reduce_scatter"}
    assert sum(plan.count_by_collective.values()) == sum(
        sum(r.plan.collective_counts.values()) for r in plan.redistributions
    )


def test_1d_mesh_with_memory_budget_is_fsdp():
    # Slow compute (cpu profile) and a real batch make data parallelism pay; a budget of the
    # parameters / world size forces every parameter to be sharded: that is FSDP.
    plan, _ = plan_for((4,), batch=64, seq=256, device="cpu", network="cpu-gloo", budget=FULLY_SHARDED)
    assert all(lay.placements[0].kind == "S" for lay in plan.param_layouts.values())
    assert plan.input_layouts[0] == Layout.parse("S(0)")
    # Gradients: one reduce-scatter each (of a gradient-shaped tensor), no all-reduce beyond the loss.
    model = build_model(get_config("llama3-tiny"), device="meta")
    param_sizes = sorted(p.numel() for p in model.parameters())
    scattered = sorted(
        math.prod(r.plan.shape) for r in plan.redistributions for step in r.plan.steps if step.kind == "reduce_scatter"
    )
    assert scattered == param_sizes
    assert plan.bytes_by_collective.get("all_reduce", 0) < 1024


@pytest.mark.slow
def test_pinned_layout_is_obeyed_and_costs_no_less():
    free, _ = plan_for((2, 2))
    pinned, _ = plan_for((2, 2), pins={"layers.*.attention.wq.weight": "S(1)S(1)[0,1]"})
    assert {str(lay) for lay in free.param_layouts.values()} == {"RR"}  # no budget: replicated is cheapest here
    for fqn, layout in pinned.param_layouts.items():
        if fqn.endswith("attention.wq.weight"):
            assert str(layout) == "S(1)S(1)[0,1]"
    assert pinned.step_time_s >= free.step_time_s * (1 - 1e-9)


def test_mesh_size_must_match_world_size():
    with tc.fake_process_group(4):
        with pytest.raises(ValueError, match=r"mesh \(2, 4\) has 8 devices but the world size is 4"):
            AutoShard(torch.nn.Linear(4, 4), lambda: torch.zeros(2, 4), (2, 4))


def test_conflicting_pins_are_named():
    with pytest.raises(ValueError, match=r"conflicting pins for layers\.0\.attention\.wq\.weight"):
        plan_for(
            (2, 2), pins={"layers.*.attention.wq.weight": "S(0)S(0)[1,0]", "layers.0.attention.*": "S(0)S(0)[0,1]"}
        )


def test_pin_matching_nothing_is_an_error():
    with pytest.raises(ValueError, match=r"pin 'layers\.\*\.attn\.weight' matches no parameter"):
        plan_for((2, 2), pins={"layers.*.attn.weight": "S(0)R"})


def test_pin_that_cannot_split_the_parameter_is_named():
    # wk of llama3-tiny is [32, 64]: its 32 rows cannot be split over the 64 ranks of (4, 4, 4).
    with pytest.raises(
        ValueError,
        match=r"layers\.0\.attention\.wk\.weight: layout S\(0\)S\(0\)S\(0\)\[0,1,2\] "
        r"does not split shape \(32, 64\) evenly",
    ):
        plan_for((4, 4, 4), pins={"layers.0.attention.wk.weight": "S(0)S(0)S(0)"})


def test_input_constraint_on_a_missing_tensor_dim():
    with pytest.raises(ValueError, match=r"input 0 \(shape \(8, 64\)\).*shards tensor dim 2"):
        plan_for((2, 2), inputs=["S(2)R"])


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["S(0)S(2)", "RR"])
def test_output_constraint_fixes_the_logits_layout(tiny_2x2, layout):
    free, _ = tiny_2x2
    plan, auto = plan_for((2, 2), outputs=[layout], budget=FULLY_SHARDED)
    marked = [n for n in plan.graph.nodes if plan.graph.output_index(n) == 0]
    assert len(marked) == 1 and tuple(marked[0].meta["val"].shape) == (8, 64, 256)  # the logits
    assert str(plan.strategies[marked[0].name].outputs[0]) == layout
    assert plan.step_time_s >= free.step_time_s * (1 - 1e-9)


def test_output_constraint_errors():
    with pytest.raises(ValueError, match=r"output 0 \(shape \(8, 64, 256\)\).*shards tensor dim 3"):
        plan_for((2, 2), outputs=["S(3)R"])
    with pytest.raises(ValueError, match=r"output constraint for output 1, but the model returns 1 tensor"):
        plan_for((2, 2), outputs=[None, "RR"])
    model = torch.nn.Linear(4, 4)
    with AutoShard(model, lambda: torch.zeros(2, 4), (2,)) as auto:
        with pytest.raises(ValueError, match="constrain_outputs needs a loss_fn"):
            auto.constrain_outputs("R")


def test_unknown_profiles_are_named():
    with pytest.raises(ValueError, match="unknown device profile 'tpu'"):
        plan_for((2, 2), device="tpu")


# llama3-8b's shapes (two layers) on an (8, 8) mesh at batch 8, sequence 8192: the regime where
# FSDP on dp and tensor parallelism on tp both pay (planned on meta: no memory for weights).
WIDE = get_config("llama3-8b").with_(n_layers=2)
WIDE_RUN = dict(batch=8, seq=8192, cfg=WIDE)


@pytest.fixture(scope="module")
def wide_free():
    return plan_for((8, 8), **WIDE_RUN)[0]


@pytest.mark.slow
def test_ilp_chooses_tp_first_order_for_column_parallel_weights(wide_free):
    colwise = {
        fqn: lay
        for fqn, lay in wide_free.param_layouts.items()
        if fqn.endswith(("wq.weight", "w1.weight", "w3.weight"))
    }
    assert {str(lay) for lay in colwise.values()} == {"S(0)S(0)[1,0]"}, colwise
    # The same plan with those weights forced into the default order costs more.
    pinned, _ = plan_for((8, 8), **WIDE_RUN, pins={"layers.*.feed_forward.w[13].weight": "S(0)S(0)[0,1]"})
    assert pinned.step_time_s > wide_free.step_time_s * 1.001


@pytest.mark.slow
def test_hand_written_fsdp_tp_recipe_costs_at_least_the_free_plan():
    model = build_model(WIDE, device="meta")
    layouts = recipe_layouts(model, "fsdp-tp", 2)
    assert str(layouts["layers.1.feed_forward.w2.weight"]) == "S(0)S(1)"
    assert str(layouts["layers.0.attention.wk.weight"]) == "S(0)S(0)[1,0]"
    assert str(layouts["norm.weight"]) == "S(0)R"
    budget = param_bytes_per_rank(model, layouts, (8, 8))
    recipe, _ = plan_for((8, 8), **WIDE_RUN, pins=recipe_pins("fsdp-tp", 2), budget=budget)
    assert recipe.param_layouts == layouts
    free, _ = plan_for((8, 8), **WIDE_RUN, budget=budget)
    assert recipe.step_time_s >= free.step_time_s * (1 - 1e-9)


def test_unknown_recipe_is_named():
    with pytest.raises(ValueError, match="unknown recipe 'megatron'; known: fsdp-tp, fsdp, ddp$"):
        recipe_pins("megatron", 2)


def test_ddp_and_fsdp_recipes_lay_out_every_parameter_alike():
    """`train --recipe ddp` replicates every parameter; `--recipe fsdp` splits each on dim 0 over
    both mesh dims (dp first): a quarter of the bytes on (2,2)."""
    model = build_model(get_config("llama3-tiny"), device="meta")
    ddp, fsdp = recipe_layouts(model, "ddp", 2), recipe_layouts(model, "fsdp", 2)
    assert set(map(str, ddp.values())) == {"RR"} and set(map(str, fsdp.values())) == {"S(0)S(0)[0,1]"}
    assert len(ddp) == len(fsdp) == len(list(model.parameters()))
    assert param_bytes_per_rank(model, fsdp, (2, 2)) == param_bytes_per_rank(model, ddp, (2, 2)) / 4


@pytest.mark.parametrize("mesh", [(4,), (2, 2, 2)])
def test_ddp_and_fsdp_recipes_fit_any_mesh_and_plan_as_pinned(mesh):
    """On a 1-D or a 3-D mesh DDP replicates on every dim and FSDP splits dim 0 over every dim, the
    first outermost; the planner takes the pins as they are (2-D layouts crashed there)."""
    model = build_model(get_config("llama3-tiny"), device="meta")
    n = len(mesh)
    ddp, fsdp = recipe_layouts(model, "ddp", n), recipe_layouts(model, "fsdp", n)
    assert set(map(str, ddp.values())) == {"R" * n}
    assert {(lay.placements, lay.order) for lay in fsdp.values()} == {
        (Layout.parse("S(0)" * n).placements, ((0, tuple(range(n))),))
    }
    assert param_bytes_per_rank(model, fsdp, mesh) == param_bytes_per_rank(model, ddp, mesh) / math.prod(mesh)
    plan, _ = plan_for(mesh, pins=recipe_pins("fsdp", n), budget=param_bytes_per_rank(model, fsdp, mesh))
    assert plan.param_layouts == fsdp


@pytest.mark.parametrize("mesh_ndim", [1, 3])
def test_the_fsdp_tp_recipe_names_the_mesh_it_needs(mesh_ndim):
    needs = rf"recipe 'fsdp-tp' needs a 2-D \(dp, tp\) mesh; this mesh has {mesh_ndim} dim"
    with pytest.raises(ValueError, match=needs):
        recipe_pins("fsdp-tp", mesh_ndim)
