"""The parallel module: every rank simulated in one process (LocalTensorMode) must reproduce the
single-device loss, gradients and AdamW trajectory; the collectives it runs are the plan's."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from autoshard import _torch_compat as tc
from autoshard.capture.regions import block_of
from autoshard.driver.api import AutoShard, auto_shard
from autoshard.layout import Layout
from autoshard.program.modules import Bucket
from autoshard.runtime.module import parallelize
from autoshard_models import MarkovTokens, build_model, cross_entropy_loss, get_config
from autoshard_models.train_single import TrainSettings, make_optimizer
from plan_audit import assert_shards, batch_on_dp, budget_bytes, sharded_plan
from ranks import coords
from simulation import simulated_mesh

TINY = get_config("llama3-tiny")
BATCH, SEQ = 8, 16


def plan_llama(mesh_shape, inputs=None, pins=None):
    meta = build_model(TINY, device="meta")
    example = lambda: (torch.empty(BATCH, SEQ, dtype=torch.int64, device="meta"),) * 2  # noqa: E731
    with AutoShard(meta, example, mesh_shape, loss_fn=cross_entropy_loss) as auto:
        # every parameter fully sharded and the batch split: gathers, scatters and gradient
        # reductions to check (free, llama3-tiny plans replicated, with no collective at all)
        if inputs:
            auto.constrain_inputs(*inputs)
        if pins:
            auto.pin(pins)
        return sharded_plan(auto, budget=1.0)


def single_device(steps: int):
    """Losses of `steps` AdamW steps, and the gradients of the first, on one device."""
    model = build_model(TINY, seed=0)
    optim = make_optimizer(model.parameters(), TrainSettings())
    data = MarkovTokens(TINY.vocab_size, seed=0)
    losses, first_grads = [], None
    for step in range(steps):
        batch = data.batch(step, BATCH, SEQ)
        loss = cross_entropy_loss(model(batch.inputs), batch.targets)
        loss.backward()
        if first_grads is None:
            first_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    return losses, first_grads


def every_rank(mode, t: torch.Tensor) -> list[torch.Tensor]:
    with mode.disable():
        return list(tc.rank_values(t).values())


def trains_like_single_device(plan, mesh_shape, reference, names=None):
    """Train llama3-tiny with `plan` on simulated ranks for as many steps as `reference` (single
    device losses, first gradients) has: every rank's loss and first gradients match it. Returns
    the parallel module."""
    ref_losses, ref_grads = reference
    data = MarkovTokens(TINY.vocab_size, seed=0)
    with simulated_mesh(mesh_shape, names) as (mesh, mode):
        pmodel = parallelize(plan, mesh, build_model(TINY, device="meta"))
        pmodel.init_weights(0)
        optim = make_optimizer(pmodel.parameters(), TrainSettings())
        for step in range(len(ref_losses)):
            with mode.disable():
                batch = data.batch(step, BATCH, SEQ)
            loss = pmodel(*pmodel.shard_inputs(batch.inputs, batch.targets))
            loss.backward()
            if step == 0:
                for fqn, p in pmodel.named_parameters():
                    assert isinstance(p.grad, torch.distributed.tensor.DTensor)
                    assert p.grad.placements == p.placements, fqn
                    for got in every_rank(mode, p.grad.full_tensor()):
                        torch.testing.assert_close(got, ref_grads[fqn], rtol=1e-5, atol=1e-6, msg=fqn)
            optim.step()
            optim.zero_grad()
            for got in every_rank(mode, loss):
                assert abs(got.item() - ref_losses[step]) <= 1e-5, (step, got.item(), ref_losses[step])
    return pmodel


@pytest.fixture(scope="module")
def reference():
    return single_device(10)


@pytest.mark.slow
@pytest.mark.parametrize(
    "mesh_shape, inputs, pins",
    [
        (
            (2, 2),
            ("S(0)R", "S(0)R"),
            {"layers.*.feed_forward.w1.weight": "S(0)S(0)[1,0]", "layers.*.attention.wo.weight": "S(1)S(1)[1,0]"},
        ),
        ((4,), None, None),
    ],
    ids=["2x2-batch-on-dp-pinned-orders", "4"],
)
def test_llama_tiny_trains_like_single_device(reference, mesh_shape, inputs, pins):
    plan = plan_llama(mesh_shape, inputs, pins)
    pmodel = trains_like_single_device(plan, mesh_shape, reference)
    # What runs is what was priced: the plan's bytes; a block's parameter gathers (and gradient
    # scatters) on one set of mesh dims run as one collective, so the plan's count less the merged ones.
    assert dict(pmodel.comm.total_bytes()) == pytest.approx(plan.bytes_by_collective)
    buckets = [
        m for gm in (pmodel.program.forward, pmodel.program.backward) for m in gm.children() if isinstance(m, Bucket)
    ]
    merged = Counter()
    for bucket in buckets:
        merged[bucket.members[0].plan.steps[0].kind] += len(bucket.members) - 1
    assert pmodel.comm.total_count() == Counter(plan.count_by_collective) - merged
    fqn_of = {node.name: fqn for fqn, node in plan.graph.params.items()}
    gathers = [b for b in buckets if b.members[0].plan.steps[0].kind == "all_gather"]
    assert gathers and sum(merged.values()) > 0
    for bucket in gathers:  # one block's parameters per bucket
        assert len({block_of(fqn_of[m.producer]) for m in bucket.members}) == 1
    if pins:
        assert {fqn for fqn, lay in plan.param_layouts.items() if not lay.is_default_order} >= {
            f"layers.{i}.{name}.weight" for i in range(TINY.n_layers) for name in ("feed_forward.w1", "attention.wo")
        }


@pytest.mark.slow
def test_parameters_hold_the_rows_their_order_implies():
    """Non-default order: physically `_StridedShard`; each rank's local rows are the order's
    chunk; the DTensor's global value is the full parameter; state_dict keys are the model's."""
    plan = plan_llama(
        (2, 2),
        pins={"layers.*.feed_forward.w1.weight": "S(0)S(0)[1,0]", "layers.*.feed_forward.w2.weight": "S(0)S(0)[0,1]"},
    )
    full = build_model(TINY, seed=3)
    with simulated_mesh((2, 2)) as (mesh, mode):
        pmodel = parallelize(plan, mesh, full)
        state = pmodel.state_dict()
        assert list(state) == list(full.state_dict())
        w1 = pmodel.get_parameter("layers.0.feed_forward.w1.weight")
        assert any(type(p) is tc._StridedShard for p in w1.placements)
        assert not any(
            type(p) is tc._StridedShard for p in pmodel.get_parameter("layers.0.feed_forward.w2.weight").placements
        )
        gathered = {fqn: every_rank(mode, value.full_tensor()) for fqn, value in state.items()}
        with mode.disable():
            for fqn, value in state.items():
                layout = plan.param_layouts[fqn]
                for rank, local in tc.rank_values(value.to_local()).items():
                    want = layout.shard_of(full.state_dict()[fqn], (2, 2), coords(rank, (2, 2)))
                    assert torch.equal(local, want), (fqn, layout, rank)
                for got in gathered[fqn]:
                    assert torch.equal(got, full.state_dict()[fqn]), fqn
    rows = Layout.parse("S(0)S(0)[1,0]").shard_of(torch.arange(8), (2, 2), (0, 1))
    assert rows.tolist() == [4, 5]  # tp coordinate 1 picks the upper half first, dp then splits it


class MLP(nn.Module):
    def __init__(self, d: int, h: int, bias: bool = False):
        super().__init__()
        self.w1 = nn.Linear(d, h, bias=bias)
        self.w2 = nn.Linear(h, d, bias=bias)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)))


def mse(out, target):
    return (out - target).pow(2).mean()


def test_mlp_on_2x2x2_matches_single_device():
    torch.manual_seed(0)
    model = MLP(16, 32, bias=True)
    x, y = torch.randn(8, 16), torch.randn(8, 16)
    ref_loss = mse(model(x), y)
    ref_loss.backward()
    with simulated_mesh((2, 2, 2)) as (mesh, mode):  # unnamed: dp_replicate, dp_shard, tp
        # parameters replicated over dp_replicate: a budget over the other two dims' 4 ranks
        pmodel = auto_shard(
            model,
            lambda: (x, y),
            mesh,
            loss_fn=mse,
            memory_budget=budget_bytes(model, (2, 2)),
            input_layouts=(batch_on_dp(3),) * 2,
        )  # plan + apply in one call
        assert_shards(pmodel.plan)
        loss = pmodel(*pmodel.shard_inputs(x, y))
        loss.backward()
        for got in every_rank(mode, loss):
            torch.testing.assert_close(got, ref_loss.detach(), rtol=1e-6, atol=1e-7)
        for fqn, p in pmodel.named_parameters():
            for got in every_rank(mode, p.grad.full_tensor()):
                torch.testing.assert_close(got, model.get_parameter(fqn).grad, rtol=1e-5, atol=1e-7, msg=fqn)


def test_fsdp_over_tp_mlp_runs_one_gather_and_a_reduce_scatter_per_weight():
    """Weights stored FSDP-over-TP (tp splits first, dp splits each tp shard): the forward gathers
    both weights on dp only (to their TP shards) as one bucketed collective, the backward
    reduce-scatters each gradient on dp; the only other collectives are TP's all-reduce of the
    row-parallel output and the loss's."""
    d, h, batch, seq = 256, 1024, 2, 2048
    model = MLP(d, h)
    x = torch.randn(batch, seq, d, generator=torch.Generator().manual_seed(0))
    loss_fn = lambda out: out.pow(2).mean()  # noqa: E731
    with AutoShard(model, lambda: (x,), (2, 2), loss_fn=loss_fn) as auto:
        auto.constrain_inputs("S(0)R")
        auto.pin({"w1.weight": "S(0)S(0)[1,0]", "w2.weight": "S(1)S(1)[1,0]"})
        plan = auto.optimize()
    weights = {plan.graph.params[f].name for f in ("w1.weight", "w2.weight")}
    with simulated_mesh((2, 2)) as (mesh, mode):
        pmodel = parallelize(plan, mesh, model)
        steps = pmodel.comm.steps
        weight_gathers = [
            (set(producer.split(",")), kind, dims)
            for producer, _, kind, dims in steps["forward"]
            if set(producer.split(",")) & weights
        ]
        assert weight_gathers == [(weights, "all_gather", (0,))]
        assert sorted((k, d) for p, _, k, d in steps["forward"] if not set(p.split(",")) & weights) == [
            ("all_reduce", (0,)),
            ("all_reduce", (1,)),
        ]
        # The ILP reduce-scatters w2's gradient before its final transpose (inside the gradient's
        # tail): still a gradient reduction, bucketed with w1's once both are ready.
        assert [(k, d) for _, _, k, d in steps["backward"]] == [("reduce_scatter", (0,))]
        (bucket,) = [m for m in pmodel.program.backward.children() if isinstance(m, Bucket)]
        assert len(bucket.members) == 2
        loss = pmodel(*pmodel.shard_inputs(x))
        loss.backward()
        ref = loss_fn(model(x))
        ref.backward()
        for got in every_rank(mode, loss):
            torch.testing.assert_close(got, ref.detach(), rtol=1e-5, atol=0)
        for fqn, p in pmodel.named_parameters():
            for got in every_rank(mode, p.grad.full_tensor()):
                torch.testing.assert_close(got, model.get_parameter(fqn).grad, rtol=1e-4, atol=1e-7, msg=fqn)


@pytest.fixture(scope="module")
def small_mlp_plan():
    model = MLP(16, 32)
    x, y = torch.randn(2, 4, 16), torch.randn(2, 4, 16)
    with AutoShard(model, lambda: (x, y), (2, 2), loss_fn=mse) as auto:
        auto.constrain_inputs("S(0)R", "S(0)R")
        return sharded_plan(auto), model, x, y


def test_wrong_local_input_shape_names_the_expected_one(small_mlp_plan):
    plan, model, x, y = small_mlp_plan
    with simulated_mesh((2, 2)) as (mesh, mode):
        pmodel = parallelize(plan, mesh, model)
        with pytest.raises(
            ValueError,
            match=r"input 0: expected a local shard of shape \(1, 4, 16\) \(global \(2, 4, 16\) "
            r"in layout S\(0\)R on mesh \(2, 2\)\), got \(2, 4, 16\)",
        ):
            pmodel(x, y)
        with pytest.raises(ValueError, match="the plan has 2 inputs, got 1"):
            pmodel(x[:1])
        with pytest.raises(ValueError, match=r"w1.weight: full value has shape \(3, 3\), the model has \(32, 16\)"):
            pmodel.load_full({"w1.weight": torch.zeros(3, 3), "w2.weight": model.w2.weight})


def test_first_run_checks_local_shapes_node_by_node(small_mlp_plan):
    """A lowering mistake (here: a view to the wrong local shape) is reported with its node."""
    plan, model, x, y = small_mlp_plan
    with simulated_mesh((2, 2)) as (mesh, mode):
        pmodel = parallelize(plan, mesh, model)
        gm = pmodel.program.forward
        view = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.view.default)
        view.args = (view.args[0], [math.prod(view.args[1])])  # same elements, flattened
        gm.recompile()
        with pytest.raises(RuntimeError, match=r"lowering bug: aten.view.default \(view\w*\) produced local shape"):
            pmodel(*pmodel.shard_inputs(x, y))


def test_no_grad_forward_runs_only_the_forward(small_mlp_plan):
    plan, model, x, y = small_mlp_plan
    with simulated_mesh((2, 2)) as (mesh, mode):
        pmodel = parallelize(plan, mesh, model)

        def backward_must_not_run(*args):
            raise AssertionError("the backward graph ran")

        pmodel._checked["backward"] = True
        pmodel.program.backward = backward_must_not_run
        with torch.no_grad():
            loss = pmodel(*pmodel.shard_inputs(x, y))
        for got in every_rank(mode, loss):
            torch.testing.assert_close(got, mse(model(x), y).detach())
        assert not loss.requires_grad and all(p.grad is None for p in pmodel.parameters())
        with pytest.raises(AssertionError, match="the backward graph ran"):
            pmodel(*pmodel.shard_inputs(x, y)).backward()


class _MergeAfterGather(nn.Module):
    """x [4, 2, 3] arrives sharded on dim 1 (one row per rank); merging dims 0 and 1 in a `view`
    needs it gathered on that inner dim first."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(3, 5, generator=torch.Generator().manual_seed(0)))

    def forward(self, x):
        return (x.view(8, 3) @ self.w).sum()


def test_gather_on_an_inner_dim_feeds_a_view():
    """The executor gathers on dim 0 and moves the chunk axis into place, which can leave a strided
    view ([4, 2, 3] with strides (3, 12, 1) here); the traced `view` needs the traced value's
    (contiguous) strides. Every redistribution hands its consumer that memory layout."""
    model = _MergeAfterGather()
    with AutoShard(model, lambda: torch.empty(4, 2, 3, device="meta"), (2,)) as auto:
        auto.constrain_inputs("S(1)")
        auto.pin({"w": "R"})
        auto.memory_budget(1e6)
        plan = auto.optimize()
    (gather,) = plan.redistributions
    assert gather.plan.steps[0].kind == "all_gather" and gather.plan.steps[0].tensor_dims == (1,)
    x = torch.randn(4, 2, 3, generator=torch.Generator().manual_seed(1))
    loss = model(x)
    loss.backward()
    with simulated_mesh((2,)) as (mesh, mode):
        pmodel = parallelize(plan, mesh, model)
        got = pmodel(*pmodel.shard_inputs(x))
        got.backward()
        for value in every_rank(mode, got):
            torch.testing.assert_close(value, loss.detach())
        for grad in every_rank(mode, pmodel.w.grad.full_tensor()):
            torch.testing.assert_close(grad, model.w.grad)


# Real torchrun processes running the parallel module: tests/test_train.py (one launch covers both).
