"""Planner: pinned plans, plan/cost consistency, triangle inequality, uneven shapes, speed; costs."""

from __future__ import annotations

import itertools
import math
import random
import statistics
import time

import pytest
import torch

from autoshard.layout import Layout, P, R, S
from autoshard.pricing.planner import Planner
from autoshard.pricing.ring import step_cost, wire_bytes
from autoshard.profiles.network import NetworkProfile

BIG = (4096, 4096)


def steps(plan):
    return [(s.kind, s.mesh_dims) for s in plan.steps]


def layouts(mesh_shape, shape):
    """Every layout of a `shape` tensor on `mesh_shape` that splits evenly."""
    out = []
    for placements in itertools.product([R, P()] + [S(d) for d in range(len(shape))], repeat=len(mesh_shape)):
        base = Layout(placements)
        for combo in itertools.product(*[[(td, o) for o in itertools.permutations(mds)] for td, mds in base.order]):
            lay = Layout(placements, combo)
            if all(shape[td] % math.prod(mesh_shape[m] for m in mds) == 0 for td, mds in lay.order):
                out.append(lay)
    return out


# ----------------------------------------------------------------------------- pinned plans
@pytest.mark.parametrize("profile", ["cpu-gloo", "h100-node"])
def test_order_decides_the_gather(profile):
    """S(0)S(0) with tp (mesh dim 1) split first gives R S(0) by one all-gather on dp; the other
    order cannot (dp is not the last split) and pays more."""
    pl = Planner((2, 2), profile)
    tp_first = pl.plan("S(0)S(0)[1,0]", "RS(0)", (8, 8), 4)
    assert steps(tp_first) == [("all_gather", (0,))]
    dp_first = pl.plan("S(0)S(0)[0,1]", "RS(0)", (8, 8), 4)
    assert len(dp_first.steps) > 1 and dp_first.cost_s > tp_first.cost_s


@pytest.mark.parametrize("profile", ["cpu-gloo", "h100-node"])
def test_shard_to_shard_is_one_all_to_all(profile):
    plan = Planner((2, 2), profile).plan("S(0)R", "S(1)R", BIG, torch.bfloat16)
    assert steps(plan) == [("all_to_all", (0,))] and plan.steps[0].tensor_dims == (0, 1)
    assert plan.collective_counts == {"all_to_all": 1}


def test_partial_to_ordered_shard():
    # gloo: per-call overhead dominates -> one reduce-scatter over the flattened group, split order (1, 0)
    gloo = Planner((2, 2), "cpu-gloo").plan("PP", "S(0)S(0)[1,0]", (8, 8), 4)
    assert steps(gloo) == [("reduce_scatter", (1, 0))] and gloo.steps[0].tensor_dims == (0,)
    # H100, big tensor: reduce over fast NVLink first, then the slow inter-node link carries half
    h100 = Planner((2, 2), "h100-node").plan("PP", "S(0)S(0)[1,0]", BIG, torch.bfloat16)
    assert steps(h100) == [("reduce_scatter", (1,)), ("reduce_scatter", (0,))]
    assert [str(s.dst) for s in h100.steps] == ["PS(0)", "S(0)S(0)[1,0]"]


def test_one_shot_gather_where_cheaper():
    gloo = Planner((2, 2), "cpu-gloo")
    plan = gloo.plan("S(0)S(0)[0,1]", "RR", (8, 8), 4)
    assert steps(plan) == [("all_gather", (0, 1))]
    two_step = Planner((2, 2), "cpu-gloo", one_shot=False).plan("S(0)S(0)[0,1]", "RR", (8, 8), 4)
    assert steps(two_step) == [("all_gather", (1,)), ("all_gather", (0,))] and two_step.cost_s > plan.cost_s
    # a big tensor on H100: a flattened ring runs at inter-node speed, so not one-shot there
    assert all(len(s.mesh_dims) == 1 for s in Planner((2, 2), "h100-node").plan("S(0)S(0)[0,1]", "RR", BIG, 2).steps)


def test_order_change_is_one_permute():
    plan = Planner((8, 8), "h100-node").plan("S(0)S(0)[0,1]", "S(0)S(0)[1,0]", BIG, torch.bfloat16)
    assert steps(plan) == [("permute", (0, 1))]
    assert plan.bytes_per_rank == BIG[0] * BIG[1] * 2 / 64


def test_size_one_mesh_dims_are_relabels():
    pl = Planner((1, 4), "cpu-gloo")
    plan = pl.plan("S(0)S(0)[0,1]", "S(0)S(0)[1,0]", (8, 8), 4)
    assert steps(plan) == [("reorder", ())] and plan.cost_s == 0
    assert steps(pl.plan("S(1)S(0)", "RS(1)", (8, 8), 4)) == [("reorder", ()), ("all_to_all", (1,))]
    assert pl.plan("RR", "RR", (8, 8), 4).steps == ()


def test_one_shot_off_uses_single_dims_only():
    pl = Planner((2, 2, 2), "cpu-gloo", one_shot=False)
    for a, b in [("S(0)S(0)S(0)", "RRR"), ("PPP", "S(1)S(1)S(1)[2,1,0]"), ("S(0)S(0)S(1)", "S(1)S(1)S(0)")]:
        plan = pl.plan(a, b, (8, 8), 4)
        assert all(len(s.mesh_dims) == 1 or s.kind == "permute" for s in plan.steps), str(plan)


# ----------------------------------------------------------------------------- consistency
@pytest.mark.parametrize(
    "mesh, shape, profile",
    [
        ((2, 2), (8, 8), "cpu-gloo"),
        ((8, 8), BIG, "h100-node"),
        ((4, 4, 4), (64, 64, 64), "h100-node"),
        ((4,), (8, 8, 8, 8), "h100-node"),
    ],
)
def test_plans_are_consistent(mesh, shape, profile):
    """Steps chain src -> dst, each step is a legal single move, and their costs add up."""
    pl = Planner(mesh, profile)
    every = layouts(mesh, shape)
    rnd = random.Random(0)
    for src, dst in [(rnd.choice(every), rnd.choice(every)) for _ in range(150)]:
        plan = pl.plan(src, dst, shape, 2)
        chain = [src] + [s.dst for s in plan.steps]
        assert chain[-1] == dst and all(s.src == c for s, c in zip(plan.steps, chain)), str(plan)
        assert plan.cost_s == pytest.approx(sum(s.cost_s for s in plan.steps), rel=1e-9)
        assert plan.cost_s == pytest.approx(pl.cost(src, dst, shape, 2), rel=1e-12)
        assert plan.bytes_per_rank == pytest.approx(sum(s.bytes for s in plan.steps))
        for s in plan.steps:  # priced on the shard it actually moves
            n = math.prod(mesh[m] for m in s.mesh_dims)
            local = 2 * math.prod(s.src.local_shape(shape, mesh))
            expected = pl.step_cost(s.kind, s.mesh_dims, s.tensor_dims, s.src, shape, 2) if s.kind != "reorder" else 0.0
            assert s.cost_s == pytest.approx(expected)
            assert s.bytes == pytest.approx(wire_bytes(s.kind, n, local))


@pytest.mark.parametrize(
    "mesh, shape", [((2, 2), (8, 8)), ((8, 8), BIG), ((4, 4, 4), (64, 64, 64)), ((2, 2, 2), (16, 4, 8))]
)
def test_triangle_inequality(mesh, shape):
    pl = Planner(mesh, "h100-node")
    every = layouts(mesh, shape)
    rnd = random.Random(1)
    for _ in range(300):
        a, b, c = rnd.choice(every), rnd.choice(every), rnd.choice(every)
        assert pl.cost(a, c, shape, 2) <= pl.cost(a, b, shape, 2) + pl.cost(b, c, shape, 2) + 1e-12, (a, b, c)


def test_costs_are_shape_aware():
    pl = Planner((8, 8), "h100-node")
    assert pl.cost("S(0)S(0)", "RR", (1024, 1024), 2) < pl.cost("S(0)S(0)", "RR", BIG, 2)
    assert pl.cost("S(0)R", "RR", BIG, 2) < pl.cost("S(0)R", "RR", BIG, 4)
    # gathering the already smaller shard is cheaper than gathering the bigger one on the same dim
    assert pl.cost("S(0)S(0)[1,0]", "RS(0)", BIG, 2) < pl.cost("S(0)R", "RR", BIG, 2)


def test_one_shot_never_worse_than_single_dim_steps():
    full, single = Planner((4, 4, 4), "cpu-gloo"), Planner((4, 4, 4), "cpu-gloo", one_shot=False)
    every = layouts((4, 4, 4), (64, 64))
    rnd = random.Random(2)
    for _ in range(200):
        a, b = rnd.choice(every), rnd.choice(every)
        assert full.cost(a, b, (64, 64), 4) <= single.cost(a, b, (64, 64), 4) + 1e-12


# ----------------------------------------------------------------------------- uneven shapes
def test_uneven_layouts_raise_at_planning_time():
    pl = Planner((2, 2), "cpu-gloo")
    with pytest.raises(ValueError, match=r"tensor dim 1 of size 3 is not divisible by 2 \(mesh dims \[1\]"):
        pl.plan("RR", "RS(1)", (4, 3), 4)
    with pytest.raises(ValueError, match="tensor dim 0 of size 6 is not divisible by 4"):
        pl.cost("S(0)S(0)", "RR", (6, 4), 4)


def test_uneven_intermediates_are_avoided():
    pl = Planner((2, 2), "cpu-gloo")
    for src, dst in itertools.product(["S(0)S(1)", "S(1)S(0)", "PS(1)", "S(0)R", "RS(0)", "PP", "RR"], repeat=2):
        for s in pl.plan(src, dst, (6, 4), 4).steps:
            s.dst.local_shape((6, 4), (2, 2))  # raises if a step passed through S(0)S(0)


def test_bad_requests():
    with pytest.raises(ValueError, match="out of range for a rank-2 tensor"):
        Planner((2, 2)).plan("S(2)R", "RR", (4, 4), 2)
    with pytest.raises(ValueError, match="has 2 mesh dims"):
        Planner((4,)).plan("S(0)R", "R", (4, 4), 2)
    with pytest.raises(ValueError, match="profile 'h100-node' has 2 mesh dims"):
        Planner((2, 2, 2), NetworkProfile.preset("h100-node", 2))
    with pytest.raises(ValueError, match="itemsize"):
        Planner((2, 2)).plan("RR", "RR", (4, 4), 0)


# ----------------------------------------------------------------------------- speed
def test_planning_latency():
    pl = Planner((8, 8), "h100-node")
    src, dst = Layout.parse("S(0)S(0)[1,0]"), Layout.parse("RS(1)")
    pl.cost(src, dst, BIG, 2)
    cached = []
    for _ in range(2000):
        t = time.perf_counter()
        pl.cost(src, dst, BIG, 2)
        cached.append(time.perf_counter() - t)
    uncached = []
    for i in range(30):  # a new shape each time: a fresh Dijkstra and plan
        t = time.perf_counter()
        pl.plan(src, dst, (4096 + 64 * (i + 1), 4096), 2)
        uncached.append(time.perf_counter() - t)
    assert statistics.median(cached) < 50e-6
    assert statistics.median(uncached) < 5e-3


# ----------------------------------------------------------------------------- costs
def test_presets_and_profile_pricing():
    h = NetworkProfile.preset("h100-node", 3)
    assert h.beta[2] > h.beta[0] == h.beta[1] and h.alpha[2] < h.alpha[0]
    assert NetworkProfile.preset("cpu-gloo", 1).mesh_ndim == 1
    with pytest.raises(ValueError, match=r"unknown network profile 'tpu'; known: \['cpu-gloo', 'h100-node'\]"):
        NetworkProfile.preset("tpu", 2)
    prof = NetworkProfile(alpha=(1e-5, 1e-6), beta=(1e9, 1e10), launch_s=1e-4, mem_bw=1e11)
    m = 1e6
    assert step_cost(prof, "all_gather", (1,), 4, m) == pytest.approx(1e-4 + 3e-6 + 3 * m / 1e10)
    assert step_cost(prof, "reduce_scatter", (0,), 4, m) == pytest.approx(1e-4 + 3e-5 + 0.75 * m / 1e9)
    assert step_cost(prof, "all_reduce", (0,), 2, m) == pytest.approx(1e-4 + 2e-5 + m / 1e9)
    assert step_cost(prof, "all_to_all", (1,), 4, m) == pytest.approx(1e-4 + 3e-6 + 0.75 * m / 1e10)
    # a flattened group: slowest link's bandwidth, largest latency
    assert step_cost(prof, "all_gather", (0, 1), 8, m) == pytest.approx(1e-4 + 7e-5 + 7 * m / 1e9)
    assert step_cost(prof, "chunk", (0,), 4, m) == pytest.approx(0.25 * m / 1e11)
    assert wire_bytes("all_gather", 4, m) == 3 * m and wire_bytes("chunk", 4, m) == 0
    with pytest.raises(ValueError, match="one entry per mesh dim"):
        NetworkProfile(alpha=(1.0,), beta=(1.0, 2.0))
