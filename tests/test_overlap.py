"""Prefetched parameter gathers and asynchronous gradient reductions: where the lowered program
launches and waits on each bucket, that it changes no number, and the memory it costs."""

from __future__ import annotations

import dataclasses
import operator
import types

import pytest
import torch
from torch import fx

from autoshard import _torch_compat as tc
from autoshard.capture.precision import gradient_tail
from autoshard.capture.regions import block_of
from autoshard.driver.api import AutoShard
from autoshard.pricing.planner import RedistributePlan, Step
from autoshard.problem.build import grad_sink
from autoshard.problem.recipes import FSDP_TP_2D
from autoshard.profiles.files import network_profile
from autoshard.program.lower import lower
from autoshard.program.modules import AWAIT, AwaitBucket, Bucket, Redistribute
from autoshard.program.schedule import model_step
from autoshard.runtime.dryrun import dry_run
from autoshard.runtime.module import parallelize
from autoshard_models import MarkovTokens, build_model, cross_entropy_loss, get_config
from premises import cheap_launches, idle_core
from simulation import simulated_mesh
from torchrun import run_ranks

FOUR = dataclasses.replace(get_config("llama3-debug"), name="llama3-debug-4", n_layers=4)
BATCH, SEQ, MESH = 8, 64, (4,)


def fsdp_plan(recompute: bool):
    """Data parallel with every block's weights sharded (FSDP): a gather per block in the forward
    (and in the backward, recomputed), a reduce-scatter per block in the backward."""
    meta = build_model(FOUR, device="meta")
    example = lambda: (torch.empty(BATCH, SEQ, dtype=torch.int64, device="meta"),) * 2  # noqa: E731
    with AutoShard(
        meta,
        example,
        MESH,
        loss_fn=cross_entropy_loss,
        recompute=recompute,
        device=idle_core(),
        network=cheap_launches(MESH),  # launches a small part of the communication: see premises.py
    ) as auto:
        auto.constrain_inputs("S(0)", "S(0)")
        auto.pin({"layers.*": "S(0)"})
        return auto.optimize()


def two_steps(plan, mesh_shape, cfg, **apply):
    """Every rank's losses and gradients (stacked over ranks) of two AdamW steps of `plan` on
    simulated ranks, the module made with `apply` (prefetch, bucket_bytes)."""
    data = MarkovTokens(cfg.vocab_size, seed=0)
    with simulated_mesh(mesh_shape) as (mesh, mode):
        pmodel = parallelize(plan, mesh, build_model(cfg, device="meta"), **apply)
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
                grads.append(
                    {
                        f: torch.stack(list(tc.rank_values(p.grad.to_local()).values()))
                        for f, p in pmodel.named_parameters()
                    }
                )
            optim.step()
            optim.zero_grad()
    return losses, grads


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


@pytest.mark.slow
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
            assert events[i + 1 : i + 3] == [("launch", "all_gather", nxt), ("compute", "", "")], events[i : i + 3]
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


def test_a_blocks_gathers_on_two_mesh_dims_prefetch_as_one_unit():
    """FSDP+TP with the norms sharded over tp only: each block gathers its matrices over dp and its
    norms over tp, two buckets. Both of block k+1's launch right after block k's first wait (as
    one FSDP module's gathers), not one bucket ahead, which would leave the dp gather of a block
    launched just before its own use."""
    meta = build_model(FOUR, device="meta")
    example = lambda: (torch.empty(BATCH, SEQ, dtype=torch.int64, device="meta"),) * 2  # noqa: E731
    with AutoShard(meta, example, (2, 2), loss_fn=cross_entropy_loss, device=idle_core()) as auto:
        auto.pin({**FSDP_TP_2D, "*norm.weight": "RS(0)"})
        plan = auto.optimize()
    with simulated_mesh((2, 2)) as (mesh, _):
        events = schedule(lower(plan, mesh, prefetch=1).forward, plan)
    launches = [block for what, kind, block in events if (what, kind) == ("launch", "all_gather")]
    assert launches == ["root", "0", "0", "1", "1", "2", "2", "3", "3", "root"]  # the root's norm comes last
    for block in range(3):
        first_wait = events.index(("wait", "all_gather", str(block)))
        assert events[first_wait + 1 : first_wait + 3] == [("launch", "all_gather", str(block + 1))] * 2, events


def test_each_mesh_dims_collectives_run_on_its_own_link():
    """A bucketed gather in flight on mesh dim 0 (FSDP over InfiniBand) does not hold up a blocking
    collective on dim 1 (TP over NVLink: another process group, another stream); one over both
    dims waits for it. Program: launch the dim-0 bucket (3 s), compute 2 s, a blocking collective
    (0.5 s), compute 1 s, wait for the bucket."""
    with simulated_mesh((2, 2)) as (mesh, _):

        def redistribute(mesh_dims, cost):
            step = Step("all_gather", mesh_dims, None, None, (0,), cost, bytes=1.0)
            plan = RedistributePlan((step,), cost, 1.0, {"all_gather": 1}, None, None, (4,), 4, (2, 2))
            return Redistribute(plan, mesh, "x", "y")

        def modeled(blocking_dims):
            modules = {
                "bucket": Bucket("bucket", [redistribute((0,), 3.0)], mesh),
                "blocking": redistribute(blocking_dims, 0.5),
            }
            graph = fx.Graph()
            x = graph.placeholder("x")
            launch = graph.call_module("bucket", (x,))
            a = graph.call_function(torch.neg, (x,))
            b = graph.call_function(torch.neg, (graph.call_module("blocking", (a,)),))
            graph.output((b, graph.call_module(AWAIT, (launch,))))
            for node, name in ((a, "a"), (b, "b")):
                node.meta["autoshard_source"] = types.SimpleNamespace(name=name)
            plan = types.SimpleNamespace(node_compute_s={"a": 2.0, "b": 1.0}, recomputed=set(), optimizer_s=0.25)
            return model_step(plan, [fx.GraphModule({**modules, AWAIT: AwaitBucket()}, graph)])

        own, shared = modeled((1,)), modeled((0, 1))
    assert (own.compute_s, own.comm_s) == (shared.compute_s, shared.comm_s) == (3.0, 3.5)
    assert own.overlapped_s == pytest.approx(2.0 + 0.5 + 1.0 + 0.25)  # the gather ends at 3.0, hidden
    assert shared.overlapped_s == pytest.approx(3.0 + 0.5 + 1.0 + 0.25)  # waits for dim 0's link


@pytest.mark.slow
def test_prefetch_changes_no_number(recomputed_plan):
    """On the recomputing plan, which launches ahead in the forward and in the backward."""
    plan = recomputed_plan

    sync_losses, sync_grads = two_steps(plan, MESH, FOUR, prefetch=0)
    losses, grads = two_steps(plan, MESH, FOUR, prefetch=1)
    assert len(losses) == 2 and len(grads[0]) == len(list(build_model(FOUR, device="meta").parameters()))
    for a, b in zip(losses, sync_losses):
        assert torch.equal(a, b)
    for a, b in zip(grads, sync_grads):
        assert a.keys() == b.keys() and all(torch.equal(a[f], b[f]) for f in a)


def test_prefetch_costs_at_most_the_buckets_in_flight(plan):
    """The dry run's peak grows by at most the gathered bytes of the extra buckets in flight."""
    with simulated_mesh(MESH) as (mesh, _):
        program = lower(plan, mesh, prefetch=0)
    biggest = max(
        sum(torch.Size(m.plan.shape).numel() * 4 for m in bucket.members)
        for gm in (program.forward, program.backward)
        for bucket in gm.children()
        if isinstance(bucket, Bucket) and bucket.kind == "all_gather"
    )
    peaks = {k: dry_run(plan, ranks=[0], prefetch=k).peak_bytes for k in (0, 1, 2)}
    assert peaks[1] <= peaks[0] + biggest and peaks[2] <= peaks[0] + 2 * biggest, (peaks, biggest)


def program_comm_s(program) -> float:
    """The program's collectives as it runs them: every redistribution's plan, except that a
    bucket's shared first step pays its launch and latency once, and its members' copies."""
    total = 0.0
    for gm in (program.forward, program.backward):
        for module in gm.children():
            if isinstance(module, Bucket):
                total += sum(m.plan.cost_s + m.copy_s for m in module.members)
                total -= sum(m.plan.steps[0].fixed_s for m in module.members[1:])
            elif hasattr(module, "plan"):
                total += module.plan.cost_s
    return total


def test_step_model_hides_communication_behind_compute(plan):
    """One cost model: the synchronous program's two-stream time is the plan's sum (compute,
    communication, optimizer), but for the launches: the plan shares a bucketed first step's
    launch among all its block's parameters, the program pays one per bucket it forms, of those
    parameters whose first steps match (here 5 of a block's 9 gather together, 2 reduce-scatter
    together): never less than the plan, a few percent more. Prefetching
    hides part of the communication, never more than the compute it runs beside. (Deeper is not
    always faster: on this 1-D mesh one link carries everything, so a gather launched far ahead
    can delay a blocking collective the rank waits on.)"""
    with simulated_mesh(MESH) as (mesh, _):
        programs = {k: lower(plan, mesh, prefetch=k) for k in (0, 1, 2)}
    steps = {k: p.step for k, p in programs.items()}
    # a recomputed op is priced for two runs; a recomputed view the backward does not need runs once
    views = len(plan.recomputed) * idle_core().op_overhead_s
    for k, step in steps.items():
        assert step.compute_s == pytest.approx(plan.compute_s, abs=views + 1e-12)
        assert step.comm_s == pytest.approx(program_comm_s(programs[k]), rel=1e-9)
        assert plan.comm_s <= step.comm_s <= 1.1 * plan.comm_s
        assert step.optimizer_s == plan.optimizer_s > 0
    assert steps[0].overlapped_s == pytest.approx(steps[0].no_overlap_s, rel=1e-9)
    assert steps[1].hidden_comm_s > 0.02 * plan.comm_s
    for k in (1, 2):
        assert max(plan.compute_s, plan.comm_s) <= steps[k].overlapped_s < steps[0].overlapped_s


# ---------------------------------------------------------------------------------- DDP's buckets
def replicated_plan():
    """llama3-tiny on (2,2) with every parameter replicated: gradients all-reduced over both dims."""
    meta = build_model(get_config("llama3-tiny"), device="meta")
    example = lambda: (torch.empty(BATCH, SEQ, dtype=torch.int64, device="meta"),) * 2  # noqa: E731
    with AutoShard(meta, example, (2, 2), loss_fn=cross_entropy_loss, device="cpu", network="cpu-gloo") as auto:
        auto.pin({"*": "RR"})
        auto.constrain_inputs("S(0)S(0)", "S(0)S(0)")  # the batch over all 4 ranks, as DDP splits it
        return auto.optimize()


@pytest.mark.slow
def test_replicated_gradients_all_reduce_in_capped_buckets_in_the_backward_order():
    """Gradient all-reduces group as DDP groups them: consecutive gradients in the order the
    backward produces them, at most the cap of input bytes per bucket (a gradient larger than
    the cap alone); each bucket is launched right after its last gradient is computed and waited
    on only at the end of the backward; a cap below every gradient runs each alone. The
    collectives are the same bytes either way, and the numbers bit-equal."""
    plan = replicated_plan()
    cap = 128 * 2**10
    with simulated_mesh((2, 2)) as (mesh, _):
        program, alone = lower(plan, mesh, bucket_bytes=cap), lower(plan, mesh, bucket_bytes=1)
    graph = program.backward.graph
    nodes = list(graph.nodes)
    launches = [
        n for n in nodes if n.op == "call_module" and isinstance(program.backward.get_submodule(n.target), Bucket)
    ]
    waits = [n for n in nodes if n.op == "call_module" and n.target == AWAIT]
    buckets = [program.backward.get_submodule(n.target) for n in launches]
    assert len(buckets) >= 3 and all(b.kind == "all_reduce" for b in buckets)
    sizes = [sum(m.plan.steps[0].in_bytes for m in b.members) for b in buckets]
    assert all(size <= cap or len(b.members) == 1 for b, size in zip(buckets, sizes))
    assert sum(len(b.members) for b in buckets) >= len(plan.graph.params) - 2  # nearly every gradient rides one
    # launched right after its last gradient exists, in that order; every wait after the last launch
    for launch in launches:
        assert nodes.index(launch) == 1 + max(nodes.index(a) for a in launch.all_input_nodes)
    assert [nodes.index(n) for n in launches] == sorted(nodes.index(n) for n in launches)
    assert min(nodes.index(w) for w in waits) > max(nodes.index(n) for n in launches)
    assert [w.args[0] for w in waits] == launches
    # the backward runs the model backwards: the last block's gradients first, the embedding's last
    # (alone here: the bucket before it is full)
    owner = {grad_sink(fqn): fqn for fqn in plan.graph.grads}
    owner |= {node.name: fqn for fqn, grad in plan.graph.grads.items() for node in gradient_tail(grad)}
    blocks = [block_of(owner[m.consumer]) for b in buckets for m in b.members]
    layers = [index for _, index in filter(None, blocks)]
    assert layers == sorted(layers, reverse=True) and layers[0] == get_config("llama3-tiny").n_layers - 1
    (last,) = [
        n
        for n in nodes
        if n.op == "call_module"
        and getattr(program.backward.get_submodule(n.target), "consumer", None) == "sink:grad:tok_embeddings.weight"
    ]
    assert nodes.index(last) > nodes.index(launches[-1])
    # a cap of 1 byte: no bucket at all, the same collectives and bytes
    assert not any(isinstance(m, Bucket) for m in alone.backward.children())
    assert alone.comm.total_bytes() == program.comm.total_bytes()
    assert program.comm.total_count()["all_reduce"] == alone.comm.total_count()["all_reduce"] - sum(
        len(b.members) - 1 for b in buckets
    )
    # one launch per bucket in the modeled step: the program's comm is the unbucketed one less
    # every bucket's shared launches, plus the copies into its buffer (a gradient's bytes twice,
    # read and written, at the network profile's copy rate)
    saved = sum(m.plan.steps[0].fixed_s for b in buckets for m in b.members[1:])
    copies = sum(m.copy_s for b in buckets for m in b.members)
    rate = 1 / network_profile("cpu-gloo", (2, 2)).mem_bw
    assert copies == pytest.approx(sum(2 * m.plan.steps[0].in_bytes * rate for b in buckets for m in b.members))
    assert program.step.comm_s == pytest.approx(alone.step.comm_s - saved + copies, rel=1e-9) and saved > copies > 0

    tiny = get_config("llama3-tiny")
    (losses, grads), (alone_losses, alone_grads) = (two_steps(plan, (2, 2), tiny, bucket_bytes=b) for b in (cap, 1))
    assert all(torch.equal(a, b) for a, b in zip(losses, alone_losses))
    for a, b in zip(grads, alone_grads):
        assert a.keys() == b.keys() and all(torch.equal(a[f], b[f]) for f in a)


@pytest.mark.slow
@pytest.mark.ranks
def test_ddp_buckets_on_4_gloo_ranks_launch_in_the_backward_and_wait_at_its_end():
    """The same replicated plan on 4 real gloo processes (128 KiB buckets): as the program runs,
    every bucket is launched (in the backward's order, at most the cap each) before the first is
    waited on, and they are waited on in launch order; losses and gradients equal the single
    device's."""
    ranks = run_ranks("dist_buckets.py", timeout=600)
    assert len(ranks) == 4 and all(r["events"] == ranks[0]["events"] for r in ranks)
    for r in ranks:
        assert r["layouts"] == ["RR"]
        launches = [e for e in r["events"] if e[0] == "launch"]
        waits = [e for e in r["events"] if e[0] == "wait"]
        assert len(launches) >= 3 and [e[0] for e in r["events"]] == ["launch"] * len(launches) + ["wait"] * len(waits)
        assert [w[1] for w in waits] == [e[1] for e in launches]
        assert all(nbytes <= r["cap"] or len(members) == 1 for _, _, members, nbytes in launches)

        # blocks in reverse: a bucket never holds a gradient of an earlier block than the next bucket's
        def block(fqn):
            return int(fqn.split(".")[1]) if fqn.startswith("layers.") else None

        order = [block(f) for _, _, members, _ in launches for f in members if block(f) is not None]
        assert order == sorted(order, reverse=True)
        for got, want in zip(r["losses"], r["want_losses"], strict=True):
            assert abs(got - want) <= 1e-5 * abs(want), (r["losses"], r["want_losses"])
        for name, want in r["want_grads"].items():
            torch.testing.assert_close(
                torch.tensor(r["grads"][name]), torch.tensor(want), rtol=1e-4, atol=1e-6, msg=name
            )
