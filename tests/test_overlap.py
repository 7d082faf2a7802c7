"""Prefetched parameter gathers and asynchronous gradient reductions: where the lowered program
launches and waits on each bucket, that it changes no number, and the memory it costs."""

from __future__ import annotations

import dataclasses
import operator

import pytest
import torch

from autoshard import _torch_compat as tc
from autoshard.driver.api import AutoShard
from autoshard.capture.regions import block_of
from autoshard.program.lower import AWAIT, Bucket, lower
from autoshard.runtime.dryrun import dry_run
from autoshard.runtime.module import parallelize
from models import MarkovTokens, build_model, cross_entropy_loss, get_config
from simulation import simulated_mesh

FOUR = dataclasses.replace(get_config("llama3-debug"), name="llama3-debug-4", n_layers=4)
BATCH, SEQ, MESH = 8, 64, (4,)


def fsdp_plan(recompute: bool):
    """Data parallel with every block's weights sharded (FSDP): a gather per block in the forward
    (and in the backward, recomputed), a reduce-scatter per block in the backward."""
    meta = build_model(FOUR, device="meta")
    example = lambda: (torch.empty(BATCH, SEQ, dtype=torch.int64, device="meta"),) * 2  # noqa: E731
    with AutoShard(meta, example, MESH, loss_fn=cross_entropy_loss, recompute=recompute,
                   device="cpu", network="cpu-gloo") as auto:
        auto.constrain_inputs("S(0)", "S(0)")
        auto.pin({"layers.*": "S(0)"})
        return auto.optimize()


@pytest.fixture(scope="module")
def recomputed_plan():
    return fsdp_plan(recompute=True)


@pytest.fixture(scope="module", params=[False, True], ids=["saved", "recomputed"])
def plan(request, recomputed_plan):
    return recomputed_plan if request.param else fsdp_plan(recompute=False)


def schedule(gm, plan) -> list[tuple[str, str, str]]:
    """(launch | wait, collective kind, block) of each bucket node in program order, and
    ("compute", "", "") for each run of other ops between them."""
    fqn = {node.name: f for f, node in plan.graph.params.items()}
    out = []
    for n in gm.graph.nodes:
        target = n.args[0].target if n.target == AWAIT else n.target if n.op == "call_module" else None
        module = gm.get_submodule(target) if target else None
        if isinstance(module, Bucket):
            where = {block_of(fqn.get(m.producer) or plan.module_paths.get(m.producer, "")) for m in module.members}
            assert len(where) == 1, where  # one block per bucket
            (block,) = where
            out.append(("wait" if n.target == AWAIT else "launch", module.kind, str(block[1]) if block else "root"))
        elif n.op == "call_function" and n.target is not operator.getitem and (not out or out[-1][0] != "compute"):
            out.append(("compute", "", ""))
    return out


def in_flight(events: list[tuple[str, str, str]], kind: str) -> int:
    """The most buckets of `kind` launched and not yet waited on, at any point."""
    now = most = 0
    for what, k, _ in events:
        if k == kind:
            now += 1 if what == "launch" else -1
            most = max(most, now)
    assert now == 0
    return most


def launched_then_waited(events) -> bool:
    buckets = [e for e in events if e[0] != "compute"]
    return all(a[0] == "launch" and b == ("wait", *a[1:]) for a, b in zip(buckets[::2], buckets[1::2]))


def test_gathers_run_one_block_ahead_and_reductions_in_the_background(plan):
    with simulated_mesh(MESH) as (mesh, _):
        program, synchronous = lower(plan, mesh, prefetch=1), lower(plan, mesh, prefetch=0)
        deeper = lower(plan, mesh, prefetch=2)
    # synchronous: every bucket waited on right where it is launched, nothing between
    for gm in (synchronous.forward, synchronous.backward):
        assert launched_then_waited(schedule(gm, plan))

    recomputed = bool(plan.recomputed)
    for phase in ("forward", "backward") if recomputed else ("forward",):
        events = schedule(getattr(program, phase), plan)
        gathers = [e for e in events if e[1] == "all_gather" and e[2] != "root"]
        blocks = [e[2] for e in gathers if e[0] == "launch"]
        assert blocks == (["0", "1", "2", "3"] if phase == "forward" else ["3", "2", "1", "0"])
        # the next block's gather launches right after this block's is waited on, then this
        # block computes while it is in flight
        for this, nxt in zip(blocks, blocks[1:]):
            i = events.index(("wait", "all_gather", this))
            assert events[i + 1:i + 3] == [("launch", "all_gather", nxt), ("compute", "", "")], events[i:i + 3]
            assert events.index(("wait", "all_gather", nxt)) > i + 2
        assert in_flight(events, "all_gather") == 1
        assert in_flight(schedule(getattr(deeper, phase), plan), "all_gather") == 2

    events = schedule(program.backward, plan)
    reductions = [e for e in events if e[1] == "reduce_scatter" and e[2] != "root"]
    assert [e[2] for e in reductions if e[0] == "launch"] == ["3", "2", "1", "0"]
    for k, block in enumerate("3210"):  # block k's gradients reduce while block k-1's backward computes
        i = events.index(("launch", "reduce_scatter", block))
        assert events[i + 1] == ("compute", "", "")
        if k:  # waited on just before the next reduction launches
            assert events[i - 1] == ("wait", "reduce_scatter", "3210"[k - 1])
    assert in_flight(events, "reduce_scatter") == 1
    assert in_flight(schedule(deeper.backward, plan), "reduce_scatter") == 2
    # the same collectives, only in another order
    for phase in ("forward", "backward"):
        assert sorted(program.comm.steps[phase]) == sorted(synchronous.comm.steps[phase])
        assert program.comm.bytes[phase] == synchronous.comm.bytes[phase]


def test_prefetch_changes_no_number(recomputed_plan):
    """On the recomputing plan, which launches ahead in the forward and in the backward."""
    plan = recomputed_plan

    def train(prefetch: int):
        data = MarkovTokens(FOUR.vocab_size, seed=0)
        with simulated_mesh(MESH) as (mesh, mode):
            pmodel = parallelize(plan, mesh, build_model(FOUR, device="meta"), prefetch=prefetch)
            pmodel.init_weights(0)
            optim = torch.optim.AdamW(pmodel.parameters(), lr=1e-2)
            losses, grads = [], []
            for step in range(2):
                with mode.disable():
                    batch = data.batch(step, BATCH, SEQ)
                loss = pmodel(*pmodel.shard_inputs(batch.inputs, batch.targets))
                loss.backward()
                with mode.disable():
                    losses.append(torch.stack(list(tc.rank_values(loss).values())))
                    grads.append({f: torch.stack(list(tc.rank_values(p.grad.to_local()).values()))
                                  for f, p in pmodel.named_parameters()})
                optim.step()
                optim.zero_grad()
        return losses, grads

    sync_losses, sync_grads = train(0)
    losses, grads = train(1)
    assert len(losses) == 2 and len(grads[0]) == len(list(build_model(FOUR, device="meta").parameters()))
    for a, b in zip(losses, sync_losses):
        assert torch.equal(a, b)
    for a, b in zip(grads, sync_grads):
        assert a.keys() == b.keys() and all(torch.equal(a[f], b[f]) for f in a)


def test_prefetch_costs_at_most_the_buckets_in_flight(plan):
    """The dry run's peak grows by at most the gathered bytes of the extra buckets in flight."""
    with simulated_mesh(MESH) as (mesh, _):
        program = lower(plan, mesh, prefetch=0)
    biggest = max(sum(torch.Size(m.plan.shape).numel() * 4 for m in bucket.members)
                  for gm in (program.forward, program.backward) for bucket in gm.children()
                  if isinstance(bucket, Bucket) and bucket.kind == "all_gather")
    peaks = {k: dry_run(plan, ranks=[0], prefetch=k).peak_bytes for k in (0, 1, 2)}
    assert peaks[1] <= peaks[0] + biggest and peaks[2] <= peaks[0] + 2 * biggest, (peaks, biggest)


def test_step_model_hides_communication_behind_compute(plan):
    """One cost model: the synchronous program's two-stream time is the plan's sum; prefetching
    hides part of the communication, never more than the compute it runs beside. (Deeper is not
    always faster: one link carries everything, so a gather launched far ahead can delay a
    blocking collective the rank waits on.)"""
    with simulated_mesh(MESH) as (mesh, _):
        steps = {k: lower(plan, mesh, prefetch=k).step for k in (0, 1, 2)}
    for step in steps.values():
        assert step.compute_s == pytest.approx(plan.compute_s, rel=1e-9)
        assert step.comm_s == pytest.approx(plan.comm_s, rel=1e-9)
    assert steps[0].overlapped_s == pytest.approx(plan.step_time_s, rel=1e-9)
    assert steps[1].hidden_comm_s > 0.02 * plan.comm_s
    for k in (1, 2):
        assert max(plan.compute_s, plan.comm_s) <= steps[k].overlapped_s < steps[0].overlapped_s
