"""Random ops with DTensor's semantics: the program's random ops draw from (run seed, step, op,
shard), not from each rank's generator, so ranks holding the same value draw the same."""

from __future__ import annotations

import collections

import pytest
import torch
from torch import nn

from autoshard.driver.api import AutoShard
from autoshard.layout import Layout
from autoshard.program.random import RandomStream, SeededOp, draws, is_random, shard_key
from plan_audit import assert_shards, sharded_plan
from simulation import simulated_mesh
from torchrun import run_ranks

aten = torch.ops.aten


def test_a_seeded_op_ignores_and_keeps_the_generator_state():
    stream = RandomStream(seed=3, step=1)
    op = SeededOp(aten.native_dropout.default, stream, "drop", "cpu")
    x = torch.ones(64)
    torch.manual_seed(1)
    first = op(x, 0.5, True)[1]
    after = torch.rand(4)
    torch.manual_seed(2)  # another state: the same draw
    assert torch.equal(op(x, 0.5, True)[1], first)
    torch.manual_seed(1)
    op(x, 0.5, True)
    assert torch.equal(torch.rand(4), after)  # the rank's generator moved as if the op had not run
    assert not torch.equal(SeededOp(aten.native_dropout.default, stream, "drop@0:1", "cpu")(x, 0.5, True)[1], first)
    stream.step = 2
    assert not torch.equal(op(x, 0.5, True)[1], first)  # each step draws anew


def test_the_key_names_the_shard_a_rank_holds():
    node = torch.fx.Graph().placeholder("native_dropout_3")
    assert shard_key(node, Layout.parse("RR"), [1, 0]) == "native_dropout_3"
    assert shard_key(node, Layout.parse("S(0)R"), [1, 0]) == "native_dropout_3@0:1"
    assert shard_key(node, Layout.parse("RS(2)"), [1, 0]) == "native_dropout_3@1:0"
    assert is_random(aten.native_dropout.default) and is_random(aten.rand_like.default)
    assert not is_random(aten.add.Tensor) and not is_random(print)
    g = torch.fx.Graph()
    x = g.placeholder("x")
    sdpa = aten._scaled_dot_product_flash_attention_for_cpu.default
    assert is_random(sdpa) and not draws(g.call_function(sdpa, (x, x, x)))  # tagged for its dropout_p
    assert draws(g.call_function(sdpa, (x, x, x, 0.1)))
    assert draws(g.call_function(aten.native_dropout.default, (x, 0.1, True)))
    assert not draws(g.call_function(aten.native_dropout.default, (x, 0.0, True)))
    assert not draws(g.call_function(aten.native_dropout.default, (x, 0.1, False)))


class Dropped(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.drop = nn.Dropout(0.5)

    def forward(self, x):
        return self.drop(self.lin(x)).sum()


def test_lowering_seeds_every_random_op_from_the_run_seed():
    """The lowered program calls dropout through a SeededOp reading the parallel module's stream:
    the seed given to apply, the step counted by forward calls."""
    model = Dropped()
    plan = sharded_plan(AutoShard(model, lambda: (torch.randn(8, 8),), (4,)))
    with simulated_mesh((4,)) as (mesh, _):
        pmodel = AutoShard(model, lambda: (torch.randn(8, 8),), mesh).apply(plan, seed=7)
        seeded = [
            n.target
            for gm in (pmodel.program.forward, pmodel.program.backward)
            for n in gm.graph.nodes
            if n.op == "call_function" and isinstance(n.target, SeededOp)
        ]
        assert [t.op for t in seeded] == [aten.native_dropout.default]
        assert seeded[0].stream is pmodel.random and pmodel.random.seed == 7 and pmodel.random.step == 0
        assert seeded[0].key.startswith("native_dropout")
        pmodel(*pmodel.shard_inputs(torch.randn(8, 8))).backward()
        assert pmodel.random.step == 1


@pytest.mark.slow
@pytest.mark.ranks
def test_torchrun_dropout_with_per_rank_seeds_stays_consistent(executed_plans):
    """4 gloo ranks (2,2), HF GPT-2 with dropout 0.1 on a sharded plan, each rank's generator seeded
    1000 + rank: every rank reports the same loss and every replica of a parameter shard is
    identical after 3 AdamW steps; with dropout 0 the losses are the single device's."""
    ranks = run_ranks("dist_random.py", timeout=500)
    for facts in executed_plans():
        assert_shards(facts)
    assert len({tuple(r["losses"]) for r in ranks}) == 1, [r["losses"] for r in ranks]
    digests = collections.defaultdict(set)
    for r in ranks:
        for name, (split, digest) in r["shards"].items():
            digests[(name, tuple(split))].add(digest)
    assert digests and all(len(d) == 1 for d in digests.values())
    want = ranks[0]["single_device"]
    for r in ranks:
        for got, ref in zip(r["no_dropout"], want, strict=True):
            assert abs(got - ref) <= 1e-5 * abs(ref), (r["rank"], got, ref)
