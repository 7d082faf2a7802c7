"""The modeled step time of a lowered program on two streams: one computes, one communicates.

The plan's step time is compute + communication, each priced once (the ILP's objective, no
overlap). The program decides what can overlap: a bucket's collective runs from its launch to its
wait while the rank computes on; every other redistribution is waited on where it runs. Walking
the forward then the backward program in order:
- an op adds its modeled compute to the compute stream;
- a collective starts when both the rank has reached it and the link is free; the rank goes on at
  once after a launch, and waits for it at the `AwaitBucket` (or at once, not bucketed).
The step ends when both streams are done. With nothing launched ahead (`prefetch=0`) this is the
plan's sum; the difference is the communication the schedule hides behind compute.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import fx

from autoshard.problem.plan import Plan
from autoshard.program.modules import AWAIT, Bucket, Redistribute


@dataclass(frozen=True)
class StepModel:
    """Modeled seconds per step of one rank's program."""

    compute_s: float
    comm_s: float
    overlapped_s: float  # on two streams, as the program schedules its collectives

    @property
    def no_overlap_s(self) -> float:
        return self.compute_s + self.comm_s

    @property
    def hidden_comm_s(self) -> float:
        return self.no_overlap_s - self.overlapped_s


def model_step(plan: Plan, graphs: list[fx.GraphModule]) -> StepModel:
    """Two-stream model of running `graphs` (forward, then backward) in program order."""
    compute = link = 0.0  # when each stream is next free
    total_compute = total_comm = 0.0
    in_flight: dict[fx.Node, float] = {}  # bucket launch -> when its collective ends

    def blocking(cost: float) -> None:
        nonlocal compute, link, total_comm
        compute = link = max(compute, link) + cost
        total_comm += cost

    for gm in graphs:
        for n in gm.graph.nodes:
            if n.op == "call_module" and n.target == AWAIT:
                launch = n.args[0]
                compute = max(compute, in_flight.pop(launch))
                for member in gm.get_submodule(launch.target).members:  # the rest of each plan
                    blocking(sum(st.cost_s for st in member.plan.steps[1:]))
            elif n.op == "call_module":
                module = gm.get_submodule(n.target)
                if isinstance(module, Bucket):
                    cost = sum(m.plan.steps[0].cost_s for m in module.members)
                    link = max(compute, link) + cost
                    total_comm += cost
                    in_flight[n] = link
                elif isinstance(module, Redistribute):
                    blocking(module.plan.cost_s)
            elif n.op == "call_function" and "autoshard_source" in n.meta:
                name = n.meta["autoshard_source"].name
                # a recomputed op's price covers both of its runs
                cost = plan.node_compute_s.get(name, 0.0) / (2 if name in plan.recomputed else 1)
                compute += cost
                total_compute += cost
    assert not in_flight, "a bucket was launched and never waited on"
    return StepModel(total_compute, total_comm, max(compute, link))
