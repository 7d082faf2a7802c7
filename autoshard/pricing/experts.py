"""The exchanges inside an expert-parallel strategy of the experts ops, priced as the all-to-alls
`program/experts.py` runs, on the network profile's links for the group's mesh dims.

Routing is data, so the price assumes it balanced: each rank sends each of its routed pairs to
the member holding its expert, `1/n` of them to itself. Forward: the split sizes (one count per
member), the pairs' rows and expert ids out, the results back. Backward: the split sizes, the
pairs' token and gradient rows, ids and routing weights out, their gradients back.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from autoshard.layout import Layout
from autoshard.pricing.ring import step_cost
from autoshard.profiles.network import NetworkProfile
from autoshard.strategies.call import OpCall
from autoshard.strategies.rules.experts import EXPERTS, EXPERTS_BACKWARD, SLOTS, split_of

_ID_BYTES = 8  # int64 expert ids


def exchange_bytes(call: OpCall, ins: Sequence[Layout | None]) -> list[float]:
    """Local input bytes of each all-to-all the strategy runs (none unless expert parallel)."""
    if call.op not in SLOTS:
        return []
    split = split_of(call.op, ins, call.in_vals, call.mesh_shape)
    if not split.parallel_dims:
        return []
    tokens = call.in_vals[SLOTS[call.op][0]]
    experts = call.in_vals[SLOTS[call.op][0] + 2]
    local_tokens, dim = ins[SLOTS[call.op][0]].local_shape(tokens.shape, call.mesh_shape)
    pairs = local_tokens * experts.shape[1]
    row, counts = tokens.element_size() * dim, _ID_BYTES * split.group_size
    if call.op is EXPERTS:
        return [counts, pairs * _ID_BYTES, pairs * row, pairs * row]
    assert call.op is EXPERTS_BACKWARD
    weights = call.in_vals[SLOTS[call.op][0] + 1].element_size()
    return [counts, pairs * 2 * row, pairs * _ID_BYTES, pairs * weights, pairs * row, pairs * weights]


def exchange_s(call: OpCall, ins: Sequence[Layout | None], network: NetworkProfile) -> float:
    """Seconds of those all-to-alls on the group's links."""
    sizes = exchange_bytes(call, ins)
    if not sizes:
        return 0.0
    split = split_of(call.op, ins, call.in_vals, call.mesh_shape)
    return math.fsum(step_cost(network, "all_to_all", split.parallel_dims, split.group_size, b) for b in sizes)
