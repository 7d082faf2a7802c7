"""Buckets as the ILP prices them: which edges ride in a bucket with their block's other parameters,
and what a bucketed edge pays, a share of its bucket's launch and its part of the executor's copies
(the program forms the buckets: `program.buckets`)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from autoshard.capture.precision import gradient_tail, is_cast
from autoshard.capture.regions import block_of
from autoshard.capture.trace import JointGraph
from autoshard.pricing.planner import RedistributePlan, Step
from autoshard.pricing.ring import bucket_copy_bytes
from autoshard.problem.choices import Producer, grad_sink

# first-step kinds the program runs as one collective per block (`program.buckets`)
PARAM_BUCKET_KINDS = ("all_gather",)
GRAD_BUCKET_KINDS = ("reduce_scatter", "all_reduce")


@dataclass(frozen=True)
class BucketShare:
    """An edge whose redistribution's first step, if of one of `kinds`, rides in a bucket with
    `members` edges of its block: it pays 1/`members` of that step's launch and latency, and the
    executor's copies of its part of the bucket (`bucket_copy_bytes` at `copy_s_per_byte`, the
    network profile's local copy rate)."""

    kinds: tuple[str, ...]
    members: int
    copy_s_per_byte: float = 0.0

    def _bucketed(self, plan: RedistributePlan) -> Step | None:
        first = plan.steps[0] if plan.steps else None
        if first is None or first.kind not in self.kinds or self.members <= 1:
            return None
        return first

    def copy_s(self, plan: RedistributePlan) -> float:
        """The executor's copies into (and, for a gather, out of) the bucket's buffer."""
        first = self._bucketed(plan)
        if first is None:
            return 0.0
        group = math.prod(plan.mesh_shape[d] for d in first.mesh_dims)
        return bucket_copy_bytes(first.kind, group, first.in_bytes) * self.copy_s_per_byte

    def cost_s(self, plan: RedistributePlan) -> float:
        """The edge's price: the plan's cost, its first step's fixed part shared, and the copies."""
        first = self._bucketed(plan)
        if first is None:
            return plan.cost_s
        return plan.cost_s - first.fixed_s * (1 - 1 / self.members) + self.copy_s(plan)


def bucket_shares(
    graph: JointGraph, inputs: dict[str, list[Producer]], copy_s_per_byte: float
) -> dict[tuple[str, str], BucketShare]:
    """The edges the program buckets: from a parameter (or its mixed-precision cast) to its
    consumers, and into a gradient's sink or tail; each shared by the parameters of its block."""
    members: dict[tuple[str, int] | None, int] = {}  # parameters per block: its gathers' bucket
    for fqn in graph.params:
        members[block_of(fqn)] = members.get(block_of(fqn), 0) + 1
    trained: dict[tuple[str, int] | None, int] = {}  # gradients per block: its reductions' bucket
    for fqn in graph.trained:
        trained[block_of(fqn)] = trained.get(block_of(fqn), 0) + 1
    source = {}  # ILP node of a parameter or its cast -> the parameter's block
    for fqn, param in graph.params.items():
        for node in [param, *(u for u in param.users if is_cast(u))]:
            source[node.name] = block_of(fqn)
    grad_of = {}  # ILP node (sink or gradient tail) -> the parameter's block
    for fqn, grad in graph.grads.items():
        grad_of[grad_sink(fqn)] = block_of(fqn)
        for node in gradient_tail(grad):
            grad_of[node.name] = block_of(fqn)
    out = {}
    for consumer, producers in inputs.items():
        for producer in producers:
            if consumer in grad_of:
                out[(producer.node, consumer)] = BucketShare(
                    GRAD_BUCKET_KINDS, trained[grad_of[consumer]], copy_s_per_byte
                )
            elif producer.node in source:
                out[(producer.node, consumer)] = BucketShare(
                    PARAM_BUCKET_KINDS, members[source[producer.node]], copy_s_per_byte
                )
    return out
