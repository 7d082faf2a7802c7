"""A mean cross-entropy over targets some of which are ignored (padding, a masked LM's unmasked
tokens), with those ignored targets spread unevenly over the batch: on a split batch its loss and
gradients equal one device's. Averaging each rank's mean (what `Partial(avg)` does) gave a biased
loss before the traced graph summed and divided by the global count (`capture.losses`)."""

from __future__ import annotations

import contextlib
import functools

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from autoshard import _torch_compat as tc
from autoshard.capture.losses import ARGS
from autoshard.capture.trace import trace_joint
from autoshard.driver.api import AutoShard
from autoshard.layout import Layout
from autoshard.runtime.module import parallelize
from plan_audit import sharded_plan
from simulation import simulated_mesh

VOCAB, DIM, BATCH, SEQ = 512, 256, 16, 128


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, x):
        return self.head(self.embed(x))


def loss_fn(logits, targets, **options):
    return F.cross_entropy(logits.view(-1, VOCAB), targets.view(-1), **options)


# what else a mean cross-entropy divides by the counted targets' total (smoothing: its own sum)
OPTIONS = {"plain": {}, "label smoothing": {"label_smoothing": 0.1}}


def uneven_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and targets whose first rows are nearly all ignored (-100) and the last rows not."""
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    y = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    y[: BATCH // 2, 1:] = -100
    return x, y


def traced(model: nn.Module):
    meta_args = (torch.empty(BATCH, SEQ, dtype=torch.int64, device="meta"),) * 2
    stack = contextlib.ExitStack()
    return stack, trace_joint(model, lambda m, x, y: loss_fn(m(x), y), meta_args, stack)


def test_the_traced_graph_sums_and_divides_by_the_total_weight_once():
    # the rewrite reads the op's arguments by these names, whichever way the graph passes them
    assert tuple(a.name for a in torch.ops.aten.nll_loss_forward.default._schema.arguments) == ARGS
    with torch.device("meta"):
        model = TinyLM()
    stack, joint = traced(model)
    with stack:
        nodes = {n.name: n for n in joint.gm.graph.nodes}
        forward = nodes["nll_loss_forward"]
        assert forward.args[3] == 2  # reduction: sum
        assert nodes["nll_loss_mean"].target == torch.ops.aten.div.Tensor
        assert joint.loss is nodes["nll_loss_mean"]
        total = nodes["nll_loss_total"]
        # the division and the backward read one node for the total: one all-reduce of it
        assert {u.name for u in total.users} == {"nll_loss_mean", "nll_loss_backward"}
        assert nodes["nll_loss_backward"].args[4] == 1  # the backward still divides by the total


@pytest.mark.parametrize("ignored", ["some", "all"])
def test_sum_over_total_is_the_mean_bit_for_bit_on_one_device(ignored):
    x = torch.randn(12, VOCAB).log_softmax(-1)
    y = torch.randint(0, VOCAB, (12,))
    y[: 12 if ignored == "all" else 5] = -100
    mean, _ = torch.ops.aten.nll_loss_forward(x, y, None, 1, -100)
    total_sum, total = torch.ops.aten.nll_loss_forward(x, y, None, 2, -100)
    torch.testing.assert_close(total_sum / total, mean, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("options", OPTIONS)
@pytest.mark.parametrize("mesh_shape", [(4,), (2, 2)])
def test_a_split_batch_with_unevenly_ignored_targets_gives_one_devices_loss(mesh_shape, options):
    torch.manual_seed(0)
    model = TinyLM()
    x, y = uneven_batch()
    step_loss = functools.partial(loss_fn, **OPTIONS[options])
    want = step_loss(model(x), y)
    want.backward()
    with torch.device("meta"):
        meta = TinyLM()
    example = lambda: (torch.empty(BATCH, SEQ, dtype=torch.int64, device="meta"),) * 2  # noqa: E731
    auto = AutoShard(meta, example, mesh_shape, loss_fn=step_loss, device="cpu", network="cpu-gloo")
    split = Layout.parse("S(0)" * len(mesh_shape))  # the batch on every mesh dim: the loss splits
    auto.spec.input_layouts = {0: split, 1: split}
    plan = sharded_plan(auto, budget=None, params_sharded=False)
    # the loss is summed on every rank's own rows, over every mesh dim
    assert all(p.kind == "P" for lay in plan.strategies["nll_loss_forward"].outputs for p in lay.placements)
    with simulated_mesh(mesh_shape) as (mesh, mode):
        pmodel = parallelize(plan, mesh, meta)
        pmodel.load_full({k: v.detach().clone() for k, v in model.state_dict().items()})
        loss = pmodel(*pmodel.shard_inputs(x, y))
        loss.backward()
        with mode.disable():
            for got in tc.rank_values(loss).values():
                assert abs(got.item() - want.item()) <= 1e-6 * abs(want.item()), (got.item(), want.item())
        for fqn, p in pmodel.named_parameters():
            full = p.grad.full_tensor()
            with mode.disable():
                for got in tc.rank_values(full).values():
                    torch.testing.assert_close(got, model.get_parameter(fqn).grad, rtol=1e-5, atol=1e-7)
