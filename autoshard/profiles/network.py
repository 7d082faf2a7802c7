"""Alpha-beta network profiles as data: per mesh dim latency and bandwidth, a launch overhead per
collective, and local memory bandwidth. What a step costs under a profile is `pricing.ring`'s job.

A flattened group over several mesh dims runs on the slowest involved link unless the profile says
otherwise: a calibrated profile (`autoshard.profiles.files`) carries the latency and bandwidth it
measured on each flattened group (`groups`), since one ring through all ranks of a 2x2 CPU mesh is
not simply its slowest dim's ring, and per collective kind (`kinds`), since a library's kinds are
not equally efficient (gloo's all-gather moves a byte several times slower than its all-reduce)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import combinations

# name -> (inter-node alpha, beta), (last-dim alpha, beta), launch_s, mem_bw, {kind: its share of beta}
_PRESETS = {
    # H100 nodes: last mesh dim (tp) on NVLink 4, the others across InfiniBand NDR (400 Gb/s/GPU).
    "h100-node": ((8e-6, 45e9), (2e-6, 360e9), 10e-6, 3.0e12, {}),
    # CPU ranks talking gloo over loopback/TCP, a core each or fewer: every dim alike, slow, and
    # gloo's all-gather and reduce-scatter move a byte ~3x slower than its all-reduce (calibrated on
    # 2-core machines: 2 ranks 0.25 / 0.32 / 0.78 GB/s, 4 ranks sharing the cores 0.38 / 0.36 / 0.52
    # GB/s, latencies 0.2-1 ms). The launch is what a collective costs between compute, which
    # calibrate measures: 1 ms on 2 ranks, 2 ms on 4 ranks sharing 2 cores (the waits for a peer
    # that the compute of the others holds up); priced at 0.3 ms, plans chose many small
    # collectives that ran slower than DDP's few large ones.
    "cpu-gloo": ((150e-6, 0.6e9), (150e-6, 0.6e9), 1e-3, 20e9, {"all_gather": 0.4, "reduce_scatter": 0.4}),
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
    # measured (mesh dims ascending, alpha, beta) of flattened groups over 2+ mesh dims
    groups: tuple[tuple[tuple[int, ...], float, float], ...] = ()
    # measured (collective kind, mesh dims ascending, alpha, beta) of one kind on one group
    kinds: tuple[tuple[str, tuple[int, ...], float, float], ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "alpha", tuple(float(a) for a in self.alpha))
        object.__setattr__(self, "beta", tuple(float(b) for b in self.beta))
        object.__setattr__(
            self,
            "groups",
            tuple(sorted((tuple(sorted(int(m) for m in dims)), float(a), float(b)) for dims, a, b in self.groups)),
        )
        if len(self.alpha) != len(self.beta) or not self.alpha:
            raise ValueError(f"alpha and beta need one entry per mesh dim, got {self.alpha} and {self.beta}")
        if min(self.alpha) < 0 or min(self.beta) <= 0 or self.launch_s < 0 or self.mem_bw <= 0:
            raise ValueError(f"profile values must be positive (latencies may be 0): {self}")
        for dims, a, b in self.groups:
            if len(dims) < 2 or len(set(dims)) != len(dims) or not all(0 <= m < len(self.alpha) for m in dims):
                raise ValueError(f"a group override needs 2+ distinct mesh dims of {len(self.alpha)}, got {dims}")
            if a < 0 or b <= 0:
                raise ValueError(f"group {dims}: latency must be >= 0 and bandwidth > 0, got {a} and {b}")
        object.__setattr__(
            self,
            "kinds",
            tuple(
                sorted(
                    (str(k), tuple(sorted(int(m) for m in dims)), float(a), float(b)) for k, dims, a, b in self.kinds
                )
            ),
        )
        for kind, dims, a, b in self.kinds:
            if not dims or len(set(dims)) != len(dims) or not all(0 <= m < len(self.alpha) for m in dims):
                raise ValueError(f"{kind} override: needs distinct mesh dims of {len(self.alpha)}, got {dims}")
            if a < 0 or b <= 0:
                raise ValueError(f"{kind} on {dims}: latency must be >= 0 and bandwidth > 0, got {a} and {b}")

    def link(self, mesh_dims: Sequence[int], kind: str | None = None) -> tuple[float, float]:
        """(alpha, beta) of a collective (of `kind`, when given) over `mesh_dims`: that kind's
        measured link on that group, else the dim's own, a measured flattened group's, or else the
        largest latency and smallest bandwidth involved (synchronous ring steps, and some hop
        crosses the slowest link)."""
        if kind is not None and self.kinds:
            key = tuple(sorted(mesh_dims))
            for k, dims, a, b in self.kinds:
                if k == kind and dims == key:
                    return a, b
        if len(mesh_dims) == 1:
            m = mesh_dims[0]
            return self.alpha[m], self.beta[m]
        key = tuple(sorted(mesh_dims))
        for dims, a, b in self.groups:
            if dims == key:
                return a, b
        return max(self.alpha[m] for m in mesh_dims), min(self.beta[m] for m in mesh_dims)

    def restricted_to(self, mesh_dim: int) -> NetworkProfile:
        """This profile for a 1D mesh made of `mesh_dim` alone (its links, measured kinds included)."""
        kinds = tuple((k, (0,), a, b) for k, dims, a, b in self.kinds if dims == (mesh_dim,))
        return NetworkProfile(
            (self.alpha[mesh_dim],), (self.beta[mesh_dim],), self.launch_s, self.mem_bw, self.name, kinds=kinds
        )

    def without(self, mesh_dim: int) -> NetworkProfile:
        """This profile for the mesh with `mesh_dim` taken out (a pipeline stage's sub-mesh): the
        other dims' links, groups and kinds, renumbered."""
        keep = [m for m in range(self.mesh_ndim) if m != mesh_dim]
        if not keep:
            raise ValueError("a 1-D mesh has no sub-mesh without its only dim")
        new = {m: i for i, m in enumerate(keep)}
        groups = tuple((tuple(new[m] for m in dims), a, b) for dims, a, b in self.groups if mesh_dim not in dims)
        kinds = tuple((k, tuple(new[m] for m in dims), a, b) for k, dims, a, b in self.kinds if mesh_dim not in dims)
        alpha, beta = tuple(self.alpha[m] for m in keep), tuple(self.beta[m] for m in keep)
        return NetworkProfile(alpha, beta, self.launch_s, self.mem_bw, self.name, groups=groups, kinds=kinds)

    @property
    def mesh_ndim(self) -> int:
        return len(self.alpha)

    @classmethod
    def preset(cls, name: str, mesh_ndim: int, intra_node_dims: Sequence[int] | None = None) -> NetworkProfile:
        """Named profile for a mesh of `mesh_ndim` dims: `intra_node_dims` (default: the last dim)
        get the intra-node link, the others the inter-node one."""
        if name not in _PRESETS:
            raise ValueError(f"unknown network profile {name!r}; known: {sorted(_PRESETS)}")
        if mesh_ndim < 1:
            raise ValueError(f"mesh_ndim must be >= 1, got {mesh_ndim}")
        outer, inner, launch_s, mem_bw, kind_share = _PRESETS[name]
        inside = set(intra_node_dims) if intra_node_dims else {mesh_ndim - 1}
        dims = [inner if m in inside else outer for m in range(mesh_ndim)]
        alpha, beta = tuple(a for a, _ in dims), tuple(b for _, b in dims)
        kinds = tuple(
            (kind, group, max(alpha[m] for m in group), min(beta[m] for m in group) * share)
            for k in range(1, mesh_ndim + 1)
            for group in combinations(range(mesh_ndim), k)
            for kind, share in kind_share.items()
        )
        return cls(alpha, beta, launch_s, mem_bw, name, kinds=kinds)
