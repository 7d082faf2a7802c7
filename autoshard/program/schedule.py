"""The modeled step time of a lowered program on streams: one computes, and each mesh dim's link
communicates.

The plan's step time is compute + communication, each priced once (the ILP's objective, no
overlap). The program decides what can overlap: a bucket's collective runs from its launch to its
wait while the rank computes on, paying one launch for all its members (`bucket_cost_s`), after
the rank has copied them into the bucket's buffer (their copies out of it are priced there too);
every other redistribution is waited on where it runs. Each mesh dim's process group has its own
link (its own communication stream: on GPUs a NCCL communicator per group, intra-node NVLink beside
inter-node InfiniBand; on gloo a group's own threads), so a data-parallel gather in flight does not
hold up a tensor-parallel collective the rank waits on; a collective over several dims holds all
of their links. Walking the forward then the backward program in order:
- an op adds its modeled compute to the compute stream, and so does a local step (a chunk);
- a collective starts when both the rank has reached it and its links are free; the rank goes on
  at once after a launch, and waits for it at the `AwaitBucket` (or at once, not bucketed).
Then the optimizer steps on the compute stream, once every gradient has arrived. The step ends
when every stream is done. With nothing launched ahead (`prefetch=0`) this is the plan's sum,
except that the plan shares a bucket's launch evenly among its block's parameters and the
program pays it once per bucket it forms; the difference is the communication the schedule hides
behind compute.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass

from torch import fx

from autoshard.pricing.planner import Step
from autoshard.pricing.ring import COLLECTIVE_KINDS
from autoshard.problem.plan import Plan
from autoshard.program.modules import AWAIT, Bucket, Redistribute


@dataclass(frozen=True)
class StepModel:
    """Modeled seconds per step of one rank's program."""

    compute_s: float
    comm_s: float
    overlapped_s: float  # on streams, as the program schedules its collectives
    optimizer_s: float = 0.0  # after the backward, on the compute stream

    @property
    def no_overlap_s(self) -> float:
        return self.compute_s + self.optimizer_s + self.comm_s

    @property
    def hidden_comm_s(self) -> float:
        return self.no_overlap_s - self.overlapped_s


def bucket_cost_s(bucket: Bucket) -> float:
    """One collective carrying every member's first step: their bytes, one launch and latency."""
    firsts = [m.plan.steps[0] for m in bucket.members]
    return sum(st.cost_s for st in firsts) - sum(st.fixed_s for st in firsts[1:])


def model_step(plan: Plan, graphs: list[fx.GraphModule]) -> StepModel:
    """Stream model of running `graphs` (forward, then backward) in program order."""
    compute = 0.0  # when the compute stream is next free
    links: dict[int, float] = {}  # mesh dim -> when its link is next free
    total_compute = total_comm = 0.0
    in_flight: dict[fx.Node, float] = {}  # bucket launch -> when its collective ends

    def on_link(step: Step, ready: float) -> float:
        """Run `step` on its mesh dims' links from `ready` on; when it ends."""
        end = max([ready, *(links.get(m, 0.0) for m in step.mesh_dims)]) + step.cost_s
        links.update(dict.fromkeys(step.mesh_dims, end))
        return end

    def blocking(steps: Iterable[Step]) -> None:
        nonlocal compute, total_comm
        for step in steps:
            compute = on_link(step, compute) if step.kind in COLLECTIVE_KINDS else compute + step.cost_s
            total_comm += step.cost_s

    for gm in graphs:
        for n in gm.graph.nodes:
            if n.op == "call_module" and n.target == AWAIT:
                launch = n.args[0]
                compute = max(compute, in_flight.pop(launch))
                for member in gm.get_submodule(launch.target).members:  # the rest of each plan
                    blocking(member.plan.steps[1:])
            elif n.op == "call_module":
                module = gm.get_submodule(n.target)
                if isinstance(module, Bucket):
                    first = module.members[0].plan.steps[0]
                    cost = bucket_cost_s(module)
                    copies = sum(m.copy_s for m in module.members)
                    compute += copies  # the rank copies the members in (and out) itself
                    in_flight[n] = on_link(dataclasses.replace(first, cost_s=cost), compute)
                    total_comm += cost + copies
                elif isinstance(module, Redistribute):
                    blocking(module.plan.steps)
            elif n.op == "call_function" and "autoshard_source" in n.meta:
                name = n.meta["autoshard_source"].name
                # a recomputed op's price covers both of its runs
                cost = plan.node_compute_s.get(name, 0.0) / (2 if name in plan.recomputed else 1)
                compute += cost
                total_compute += cost
    assert not in_flight, "a bucket was launched and never waited on"
    end = max([compute, *links.values()]) + plan.optimizer_s  # the optimizer reads every gradient
    return StepModel(total_compute, total_comm, end, plan.optimizer_s)
