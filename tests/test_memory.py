"""Activation checkpointing of repeated blocks: the backward recomputes a block's forward from its
input instead of keeping its activations; numbers are bit-equal, memory drops, and what runs is
what the plan priced. A memory limit per rank, which turns these on: tests/test_memory_limit.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from autoshard import _torch_compat as tc
from autoshard.driver.api import AutoShard
from autoshard.runtime.dryrun import dry_run
from autoshard.runtime.module import parallelize
from autoshard_models import MarkovTokens, build_model, cross_entropy_loss, get_config
from autoshard_models.train_single import TrainSettings, make_optimizer
from plan_audit import sharded_plan
from simulation import simulated_mesh

TINY = get_config("llama3-tiny")
BATCH, SEQ = 8, 16


def plan_tiny(mesh_shape, **options):
    """llama3-tiny with every parameter fully sharded and the batch split (on H100s it is cheapest
    replicated, with no gathers to recompute)."""
    example = lambda: (torch.empty(BATCH, SEQ, dtype=torch.int64, device="meta"),) * 2  # noqa: E731
    with AutoShard(
        build_model(TINY, device="meta"), example, mesh_shape, loss_fn=cross_entropy_loss, **options
    ) as auto:
        return sharded_plan(auto, budget=1.0)


def train(plan, mesh_shape, steps=3, cfg=TINY, batch_size=BATCH, seq=SEQ):
    """Losses of `steps` AdamW steps, first-step gradients (rank 0's shards), and the module."""
    data = MarkovTokens(cfg.vocab_size, seed=0)
    losses, grads = [], None
    with simulated_mesh(mesh_shape) as (mesh, mode):
        pmodel = parallelize(plan, mesh, build_model(cfg, device="meta"))
        pmodel.init_weights(0)
        optim = make_optimizer(pmodel.parameters(), TrainSettings())
        for step in range(steps):
            with mode.disable():
                batch = data.batch(step, batch_size, seq)
            loss = pmodel(*pmodel.shard_inputs(batch.inputs, batch.targets))
            loss.backward()
            with mode.disable():
                if grads is None:
                    grads = {n: tc.rank_values(p.grad.to_local())[0].clone() for n, p in pmodel.named_parameters()}
                losses.append(tc.rank_values(loss)[0].item())
            optim.step()
            optim.zero_grad()
    return losses, grads, pmodel


@pytest.mark.slow
@pytest.mark.parametrize("mesh_shape", [(2, 2), (4,)])
def test_recompute_is_bit_equal_and_runs_what_the_plan_priced(mesh_shape):
    """The same layouts with and without recomputation: losses and gradients bit-equal; the
    recomputing program hands fewer values to its backward, runs the blocks' forward ops again
    there (parameter gathers included), and its collectives are the plan's to the byte."""
    plan = plan_tiny(mesh_shape, recompute=True)
    assert plan.recompute_blocks == ("layers",) and plan.recomputed
    kept = dataclasses.replace(plan, recompute_blocks=(), recomputed=frozenset())
    losses, grads, pmodel = train(plan, mesh_shape)
    kept_losses, kept_grads, kept_pmodel = train(kept, mesh_shape)
    assert losses == kept_losses
    assert all(torch.equal(grads[n], kept_grads[n]) for n in grads)

    def handed_over(pm):
        (output,) = pm.program.forward.graph.find_nodes(op="output")
        return len(output.args[0]) - 1

    assert handed_over(pmodel) < handed_over(kept_pmodel)
    assert len(pmodel.program.backward.graph.nodes) > len(kept_pmodel.program.backward.graph.nodes)
    assert dict(pmodel.comm.total_bytes()) == pytest.approx(plan.bytes_by_collective)
    again = {k: v for k, v in pmodel.comm.bytes["backward"].items() if k == "all_gather"}
    assert again and again["all_gather"] > kept_pmodel.comm.bytes["backward"].get("all_gather", 0)


@pytest.mark.slow
def test_recompute_lowers_the_dry_runs_activations_and_is_priced():
    plan = plan_tiny((2, 2), recompute=True)
    kept = dataclasses.replace(plan, recompute_blocks=(), recomputed=frozenset())
    with_recompute, without = dry_run(plan).ranks[0], dry_run(kept).ranks[0]
    assert with_recompute.activations < without.activations / 2
    free = plan_tiny((2, 2))
    assert not free.recomputed and plan.step_time_s > free.step_time_s  # recomputation costs time
    forward_mm = [n for n in plan.recomputed if n.startswith("mm")]
    assert forward_mm and all(plan.node_compute_s[n] > 0 for n in forward_mm)


def test_another_option_derived_from_a_problem_is_the_problem_built_with_it():
    """The memory fit derives each option's problem from the one it has (`with_options`): the
    same ILP that `build_problem` makes with that option (the same fingerprint: every choice's
    cost, every edge's matrix), from a problem without recomputation and from one with it; the
    nodes and edges that do not run twice keep their choice lists and matrices."""
    from autoshard.problem.build import build_problem, with_options

    example = lambda: (torch.empty(BATCH, SEQ, dtype=torch.int64, device="meta"),) * 2  # noqa: E731
    with AutoShard(build_model(TINY, device="meta"), example, (2, 2), loss_fn=cross_entropy_loss) as auto:
        auto.optimize()
        kept, planner, device, spec = auto.sharding, auto.planner, auto.device, auto.spec
    options = {
        mode: dataclasses.replace(spec, recompute=mode == "recompute", reshard=mode == "reshard")
        for mode in ("keep", "reshard", "recompute")
    }
    built = {mode: build_problem(kept.graph, kept.mesh_shape, planner, device, o) for mode, o in options.items()}
    assert built["keep"].fingerprint() == kept.fingerprint() and built["recompute"].recomputed
    assert built["reshard"].recomputed and built["reshard"].fingerprint() != kept.fingerprint()
    for base in (kept, built["recompute"]):
        for mode, option in options.items():
            derived = with_options(base, option)
            assert derived.fingerprint() == built[mode].fingerprint(), (mode, base.recomputed)
            assert (derived.recomputed, derived.recompute_blocks, derived.reshard_blocks, derived.compute_s) == (
                built[mode].recomputed,
                built[mode].recompute_blocks,
                built[mode].reshard_blocks,
                built[mode].compute_s,
            )
    derived = with_options(kept, options["recompute"])
    same = [a.choices is b.choices for a, b in zip(kept.problem.nodes, derived.problem.nodes)]
    assert sum(same) == len(same) - len(derived.recomputed & kept.compute_s.keys()) > 0
    assert all(
        a.cost is b.cost for a, b in zip(kept.problem.edges, derived.problem.edges) if b.dst not in derived.recomputed
    )
