"""Alpha-beta network profiles and the price of every redistribution step.

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
ring step pays the largest involved alpha (steps are synchronous).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

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

# name -> (inter-node alpha, beta), (last-dim alpha, beta), launch_s, mem_bw
_PRESETS = {
    # H100 nodes: last mesh dim (tp) on NVLink 4, the others across InfiniBand NDR (400 Gb/s/GPU).
    "h100-node": ((8e-6, 45e9), (2e-6, 360e9), 10e-6, 3.0e12),
    # CPU ranks talking gloo over loopback/TCP: every dim alike, slow, high per-call overhead.
    "cpu-gloo": ((30e-6, 4e9), (30e-6, 4e9), 100e-6, 20e9),
}


@dataclass(frozen=True)
class NetworkProfile:
    """Per mesh dim latency `alpha` (s per ring step) and bandwidth `beta` (bytes/s), plus a
    fixed `launch_s` per collective and `mem_bw` (bytes/s) for local copies."""

    alpha: tuple[float, ...]
    beta: tuple[float, ...]
    launch_s: float = 10e-6
    mem_bw: float = 1e12
    name: str = "custom"

    def __post_init__(self) -> None:
        object.__setattr__(self, "alpha", tuple(float(a) for a in self.alpha))
        object.__setattr__(self, "beta", tuple(float(b) for b in self.beta))
        if len(self.alpha) != len(self.beta) or not self.alpha:
            raise ValueError(f"alpha and beta need one entry per mesh dim, got {self.alpha} and {self.beta}")
        if min(self.alpha) < 0 or min(self.beta) <= 0 or self.launch_s < 0 or self.mem_bw <= 0:
            raise ValueError(f"profile values must be positive (latencies may be 0): {self}")

    @property
    def mesh_ndim(self) -> int:
        return len(self.alpha)

    @classmethod
    def preset(cls, name: str, mesh_ndim: int) -> NetworkProfile:
        """Named profile for a mesh of `mesh_ndim` dims; the last dim is the intra-node one."""
        if name not in _PRESETS:
            raise ValueError(f"unknown network profile {name!r}; known: {sorted(_PRESETS)}")
        if mesh_ndim < 1:
            raise ValueError(f"mesh_ndim must be >= 1, got {mesh_ndim}")
        outer, inner, launch_s, mem_bw = _PRESETS[name]
        dims = [outer] * (mesh_ndim - 1) + [inner]
        return cls(tuple(a for a, _ in dims), tuple(b for _, b in dims), launch_s, mem_bw, name)

    def linear_cost(self, kind: str, mesh_dims: Sequence[int], group_size: int) -> tuple[float, float]:
        """(seconds per local input byte, fixed seconds) of one step, so that
        cost = per_byte * in_bytes + fixed. The planner precomputes these per graph edge."""
        if kind in _LOCAL:
            return _LOCAL[kind](group_size) / self.mem_bw, 0.0
        wire, steps = _COLLECTIVE[kind]
        alpha = max(self.alpha[m] for m in mesh_dims)
        beta = min(self.beta[m] for m in mesh_dims)
        return wire(group_size) / beta, self.launch_s + steps(group_size) * alpha

    def cost(self, kind: str, mesh_dims: Sequence[int], group_size: int, in_bytes: float) -> float:
        per_byte, fixed = self.linear_cost(kind, mesh_dims, group_size)
        return per_byte * in_bytes + fixed


def wire_bytes(kind: str, group_size: int, in_bytes: float) -> float:
    """Bytes each rank sends for one step (0 for local steps)."""
    if kind in _LOCAL:
        return 0.0
    return _COLLECTIVE[kind][0](group_size) * in_bytes
