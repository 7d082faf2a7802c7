"""Alpha-beta network profiles as data: per mesh dim latency and bandwidth, a launch overhead per
collective, and local memory bandwidth. What a step costs under a profile is `pricing.ring`'s job."""

from __future__ import annotations

from dataclasses import dataclass

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
