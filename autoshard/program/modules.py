"""The modules a lowered program calls: each runs redistributions on this rank's shards.

`Redistribute` runs one planned redistribution where its consumer needs it; `Bucket` launches one
collective for several redistributions and `AwaitBucket` waits for it where the results are used.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from autoshard.pricing.planner import RedistributePlan
from autoshard.pricing.ring import COLLECTIVE_KINDS
from autoshard.program.collectives import PendingBucket, execute, finish_bucket, group_names, launch_bucket


class Redistribute(nn.Module):
    """One planned redistribution, run by the executor on this rank's shard. Its result is laid
    out in memory in the dim order the traced value had (`dim_order`), so the traced consumer
    (a `view` above all) accepts it as it accepted the traced value."""

    def __init__(
        self,
        plan: RedistributePlan,
        mesh: Any,
        producer: str,
        consumer: str,
        dim_order: tuple[int, ...] | None = None,
        copy_s: float = 0.0,
    ):
        super().__init__()
        self.plan, self.mesh, self.producer, self.consumer = plan, mesh, producer, consumer
        self.dim_order = dim_order
        self.copy_s = copy_s  # the plan's price of its copies when it rides in a bucket (`Bucket`)
        self.names = group_names(plan, mesh)  # its steps' process groups, resolved once

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return execute(self.plan, x, self.mesh, self.dim_order, self.names)

    def extra_repr(self) -> str:
        steps = " -> ".join(f"{s.kind}{list(s.mesh_dims)}" for s in self.plan.steps)
        return f"{self.producer} -> {self.consumer}: {self.plan.src} => {self.plan.dst} via {steps}"

    def collectives(self, first: int = 0) -> list[tuple[str, str, str, tuple[int, ...], float]]:
        """(producer, consumer, kind, mesh dims, bytes) of each collective it runs from step
        `first` on, in order."""
        return [
            (self.producer, self.consumer, st.kind, st.mesh_dims, st.bytes)
            for st in self.plan.steps[first:]
            if st.kind in COLLECTIVE_KINDS
        ]


class Bucket(nn.Module):
    """Redistributions whose first steps are one kind of collective on one set of mesh dims, run
    with that step as one collective: parameter all-gathers and gradient reduce-scatters, grouped
    per repeated block as FSDP groups them. Calling it launches the collective and returns it in
    flight; an `AwaitBucket` node later in the program waits and returns one local tensor per member.
    `block`: the repeated block whose parameters it gathers or whose gradients it reduces (None:
    none, or several), the unit the program prefetches by."""

    def __init__(self, name: str, members: list[Redistribute], mesh: Any, block: tuple[str, int] | None = None):
        super().__init__()
        self.name, self.members, self.mesh, self.block = name, members, mesh, block

    @property
    def kind(self) -> str:
        return self.members[0].plan.steps[0].kind

    def forward(self, *xs: torch.Tensor) -> PendingBucket:
        return launch_bucket(
            [m.plan for m in self.members],
            xs,
            self.mesh,
            [m.dim_order for m in self.members],
            [m.names for m in self.members],
        )

    def extra_repr(self) -> str:
        first = self.members[0].plan.steps[0]
        return f"{first.kind}{list(first.mesh_dims)} of {len(self.members)}: " + ", ".join(
            m.producer for m in self.members
        )

    def collectives(self) -> list[tuple[str, str, str, tuple[int, ...], float]]:
        """The shared first step (one collective carrying every member; producers joined by ','),
        then each member's remaining collectives."""
        first = self.members[0].plan.steps[0]
        shared = (
            ",".join(m.producer for m in self.members),
            self.name,
            first.kind,
            first.mesh_dims,
            sum(m.plan.steps[0].bytes for m in self.members),
        )
        return [shared] + [c for m in self.members for c in m.collectives(first=1)]


class AwaitBucket(nn.Module):
    """Waits for a launched bucket and finishes each member's redistribution (one module serves
    every bucket: it holds nothing)."""

    def forward(self, pending: PendingBucket) -> tuple[torch.Tensor, ...]:
        return tuple(finish_bucket(pending))


AWAIT = "await_bucket"  # the AwaitBucket's name in every program
LOCAL_SHAPE = "autoshard_local_shape"  # node meta: expected local shape(s) on every rank
