"""Activation checkpointing of repeated blocks: the backward recomputes a block's forward from its
input instead of keeping its activations; numbers are bit-equal, memory drops, and what runs is
what the plan priced."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from autoshard import _torch_compat as tc
from autoshard.api import AutoShard
from autoshard.runtime.dryrun import dry_run
from autoshard.runtime.module import parallelize
from models import MarkovTokens, build_model, cross_entropy_loss, get_config
from models.train_single import TrainSettings, make_optimizer
from simulation import simulated_mesh

TINY = get_config("llama3-tiny")
BATCH, SEQ = 8, 16


def plan_tiny(mesh_shape, **options):
    example = lambda: (torch.empty(BATCH, SEQ, dtype=torch.int64, device="meta"),) * 2  # noqa: E731
    with AutoShard(build_model(TINY, device="meta"), example, mesh_shape, loss_fn=cross_entropy_loss,
                   **options) as auto:
        return auto.optimize()


def train(plan, mesh_shape, steps=3):
    """Losses of `steps` AdamW steps, first-step gradients (rank 0's shards), and the module."""
    data = MarkovTokens(TINY.vocab_size, seed=0)
    losses, grads = [], None
    with simulated_mesh(mesh_shape) as (mesh, mode):
        pmodel = parallelize(plan, mesh, build_model(TINY, device="meta"))
        pmodel.init_weights(0)
        optim = make_optimizer(pmodel.parameters(), TrainSettings())
        for step in range(steps):
            with mode.disable():
                batch = data.batch(step, BATCH, SEQ)
            loss = pmodel(*pmodel.shard_inputs(batch.inputs, batch.targets))
            loss.backward()
            with mode.disable():
                if grads is None:
                    grads = {n: tc.rank_values(p.grad.to_local())[0].clone() for n, p in pmodel.named_parameters()}
                losses.append(tc.rank_values(loss)[0].item())
            optim.step()
            optim.zero_grad()
    return losses, grads, pmodel


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


def test_recompute_lowers_the_dry_runs_activations_and_is_priced():
    plan = plan_tiny((2, 2), recompute=True)
    kept = dataclasses.replace(plan, recompute_blocks=(), recomputed=frozenset())
    with_recompute, without = dry_run(plan).ranks[0], dry_run(kept).ranks[0]
    assert with_recompute.activations < without.activations / 2
    free = plan_tiny((2, 2))
    assert not free.recomputed and plan.step_time_s > free.step_time_s  # recomputation costs time
    forward_mm = [n for n in plan.recomputed if n.startswith("mm")]
    assert forward_mm and all(plan.node_compute_s[n] > 0 for n in forward_mm)
