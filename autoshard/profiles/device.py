"""Compute profiles of one rank's device, for the roofline cost of a node.

A node's compute time is max(flops / peak_flops, bytes / mem_bw): matmuls and attention are
bound by the first, everything elementwise by the second. One peak per device (the dense
16-bit tensor-core rate on GPUs) is enough for the planner: it compares strategies of the same op
against the network cost of the edges, not kernels against each other.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

# name -> (peak flops/s, memory bandwidth bytes/s, memory capacity bytes; None = this machine's RAM)
_PRESETS = {
    # H100 SXM: 989 TFLOP/s dense bf16, 3.35 TB/s HBM3, 79.2 GiB as torch.cuda reports it.
    "h100": (989e12, 3.35e12, 85.0e9),
    # H200 SXM: same compute as H100, 4.8 TB/s HBM3e, 139.8 GiB as torch.cuda reports it.
    "h200": (989e12, 4.8e12, 150.1e9),
    # A small CPU share (the 2-core CI machine class): ~100 GFLOP/s fp32, ~20 GB/s DRAM.
    "cpu": (100e9, 20e9, None),
}


def _physical_memory() -> float:
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


@dataclass(frozen=True)
class DeviceProfile:
    peak_flops: float  # flop/s
    mem_bw: float  # bytes/s
    name: str = "custom"
    memory_bytes: float | None = None  # capacity of one device; None = unknown

    def __post_init__(self) -> None:
        if not (self.peak_flops > 0 and self.mem_bw > 0):
            raise ValueError(f"peak_flops and mem_bw must be positive, got {self.peak_flops} and {self.mem_bw}")

    @classmethod
    def preset(cls, name: str) -> DeviceProfile:
        if name not in _PRESETS:
            raise ValueError(f"unknown device profile {name!r}; known: {sorted(_PRESETS)}")
        flops, bw, memory = _PRESETS[name]
        return cls(flops, bw, name, memory if memory is not None else _physical_memory())

    def roofline_s(self, flops: float, bytes_moved: float) -> float:
        """Time of a kernel doing `flops` and moving `bytes_moved`, whichever bound dominates."""
        return max(flops / self.peak_flops, bytes_moved / self.mem_bw)
