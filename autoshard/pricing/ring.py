"""The price of every redistribution step under an alpha-beta `NetworkProfile`.

A collective over a group of n ranks that reads `in_bytes` of local input costs

    launch_s + steps(n) * alpha + wire(n) * in_bytes / beta

with ring formulas (all-gather: wire n-1 = (n-1)/n of the gathered output, steps n-1;
reduce-scatter and all-to-all: wire (n-1)/n, steps n-1; all-reduce: twice reduce-scatter;
permute, a point-to-point exchange of the whole shard: wire 1, steps 1). Local steps (chunk, R->P)
cost one pass over the bytes they write at `mem_bw`. The fixed `launch_s` per collective is what
makes one collective over a flattened group cheaper than several small ones: with pure ring terms
the bandwidth of the two is identical and the ring latency of the big group is larger.

A flattened group over several mesh dims is priced as one ring through all its ranks: its
bandwidth is the slowest involved dim's beta (some hop of the ring crosses that link) and each
ring step pays the largest involved alpha (steps are synchronous) — unless the profile measured
that group, or that kind on that group (`NetworkProfile.link`). Calibration (`pricing.fit`) fits
exactly these terms.
"""

from __future__ import annotations

from collections.abc import Sequence

from autoshard.profiles.network import NetworkProfile

# kind -> (wire bytes per local input byte, latency steps) for a group of n ranks
_COLLECTIVE = {
    "all_gather": (lambda n: n - 1, lambda n: n - 1),
    "reduce_scatter": (lambda n: (n - 1) / n, lambda n: n - 1),
    "all_reduce": (lambda n: 2 * (n - 1) / n, lambda n: 2 * (n - 1)),
    "all_to_all": (lambda n: (n - 1) / n, lambda n: n - 1),
    "permute": (lambda n: 1.0, lambda n: 1),
}
# kind -> bytes written locally per input byte
_LOCAL = {
    "chunk": lambda n: 1.0 / n,
    "to_partial": lambda n: 1.0,
    "reorder": lambda n: 0.0,
}
COLLECTIVE_KINDS = tuple(_COLLECTIVE)
STEP_KINDS = COLLECTIVE_KINDS + tuple(_LOCAL)


def bucket_copy_bytes(kind: str, group_size: int, in_bytes: float) -> float:
    """Bytes read and written by the executor's copies when a collective step runs in a bucket:
    each member's input is copied into the bucket's buffer, and an all-gather's members are copied
    out of the gathered buffer (`group_size` times the input); a reduction's members are views of
    its output."""
    copy_out = group_size * in_bytes if kind == "all_gather" else 0.0
    return 2 * (in_bytes + copy_out)


def collective_terms(kind: str, group_size: int) -> tuple[float, float]:
    """(wire bytes per local input byte, latency steps) of a collective over `group_size` ranks:
    the coefficients of 1/beta and alpha in its cost."""
    wire, steps = _COLLECTIVE[kind]
    return float(wire(group_size)), float(steps(group_size))


def linear_cost(profile: NetworkProfile, kind: str, mesh_dims: Sequence[int], group_size: int) -> tuple[float, float]:
    """(seconds per local input byte, fixed seconds) of one step, so that
    cost = per_byte * in_bytes + fixed. The planner precomputes these per graph edge."""
    if kind in _LOCAL:
        return _LOCAL[kind](group_size) / profile.mem_bw, 0.0
    wire, steps = collective_terms(kind, group_size)
    alpha, beta = profile.link(mesh_dims, kind)
    return wire / beta, profile.launch_s + steps * alpha


def step_cost(profile: NetworkProfile, kind: str, mesh_dims: Sequence[int], group_size: int, in_bytes: float) -> float:
    per_byte, fixed = linear_cost(profile, kind, mesh_dims, group_size)
    return per_byte * in_bytes + fixed


def wire_bytes(kind: str, group_size: int, in_bytes: float) -> float:
    """Bytes each rank sends for one step (0 for local steps)."""
    if kind in _LOCAL:
        return 0.0
    return _COLLECTIVE[kind][0](group_size) * in_bytes
