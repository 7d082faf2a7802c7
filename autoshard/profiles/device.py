"""Compute profiles of one rank's device: what an op, and the optimizer step, cost.

A node's compute time is `op_overhead_s` + max(flops / peak, bytes / mem_bw): matmuls and
attention are bound by the flops, everything elementwise by the bytes, and every op pays the
dispatch of one eager call (Python and torch's dispatcher: serial with the work on a CPU rank,
hidden behind queued kernels on a busy GPU, so small there). Two peaks per device: the dense
16-bit rate (bf16/fp16: tensor cores on GPUs) and the fp32 rate (on GPUs the plain FP32 units:
torch runs fp32 matmuls without TF32 by default), chosen by the dtype an op computes in. The
optimizer step (torch's fused AdamW, one kernel over every parameter) costs
`optimizer_s(elements)`: it streams each local parameter element's value, gradient and two
states, bound by memory bandwidth unless a calibration measured its rate.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

ADAMW_STEP_BYTES = 28  # per fp32 parameter element: read value, gradient, two states; write value, two states

# name -> (16-bit peak flops/s, fp32 peak flops/s, memory bandwidth bytes/s, memory capacity bytes
# (None = this machine's RAM), per-op overhead s, host s per dispatched op (None: host and device are one))
_PRESETS = {
    # H100 SXM and H200: what one GPU sustains on the op shapes of llama3-8b and -70b plans (seq
    # 8192, TP 8), measured on each by benchmarks/gpu/rates.py (docs/benchmarks.md, "GPU rates",
    # has the figures, their spread and dates), not the datasheets' peaks, which plans never reach:
    # bf16 and fp32 (no TF32) matmuls, elementwise ops on activations (fused AdamW streams at the
    # same rate), the capacity torch.cuda reports, and the per-kernel launch the GPU cannot hide.
    # The host's time per op the program dispatches (Python, torch's dispatcher, the launch): the
    # GPU check's profiled host time of rank 0's own ops over their count, on an H200's host
    # (docs/benchmarks.md, "GPU check"); no H100 host was profiled: the same figure.
    "h100": (640e12, 46e12, 2.4e12, 85.0e9, 2e-6, 21e-6),
    "h200": (640e12, 46e12, 2.85e12, 150.1e9, 2e-6, 21e-6),
    # A small CPU share (the 2-core CI machine class, two ranks a core as `make train` runs them):
    # ~50 GFLOP/s fp32 inside a step (calibrate measures 48 there, 55 for a matmul alone), ~20 GB/s
    # DRAM. bf16 is anywhere from much slower to 4x faster by the CPU's ISA: the same rate here;
    # calibrate measures it. ~10 us per op: the lowered program's Python call and torch's dispatch.
    "cpu": (50e9, 50e9, 20e9, None, 10e-6, None),
}
_FP32_RATE = frozenset({torch.float32, torch.float64})


def _physical_memory() -> float:
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


@dataclass(frozen=True)
class DeviceProfile:
    peak_flops: float  # flop/s of 16-bit (bf16/fp16) compute
    mem_bw: float  # bytes/s
    name: str = "custom"
    memory_bytes: float | None = None  # capacity of one device; None = unknown
    peak_flops_fp32: float | None = None  # flop/s of fp32 compute; None = peak_flops
    op_overhead_s: float = 0.0  # every op of the program, on top of its roofline
    optimizer_rate: float | None = None  # parameter elements/s of the optimizer step; None: mem_bw / 28 B
    # host s per op the program dispatches, where the host runs ahead of the device (a GPU): a step
    # takes at least ops x this. None: host and device are one (a CPU), each op's dispatch is in
    # its compute already (op_overhead_s)
    host_op_s: float | None = None

    def __post_init__(self) -> None:
        if not (self.peak_flops > 0 and self.mem_bw > 0 and (self.peak_flops_fp32 or 1) > 0):
            raise ValueError(
                f"peak_flops, peak_flops_fp32 and mem_bw must be positive, got {self.peak_flops}, "
                f"{self.peak_flops_fp32} and {self.mem_bw}"
            )
        if not self.op_overhead_s >= 0 or not all(v is None or v > 0 for v in (self.optimizer_rate, self.host_op_s)):
            raise ValueError(
                f"op_overhead_s must be >= 0, optimizer_rate and host_op_s positive, got {self.op_overhead_s}, "
                f"{self.optimizer_rate} and {self.host_op_s}"
            )

    @classmethod
    def preset(cls, name: str) -> DeviceProfile:
        if name not in _PRESETS:
            raise ValueError(f"unknown device profile {name!r}; known: {sorted(_PRESETS)}")
        flops16, flops32, bw, memory, overhead, host = _PRESETS[name]
        capacity = memory if memory is not None else _physical_memory()
        return cls(flops16, bw, name, capacity, flops32, overhead, host_op_s=host)

    def peak_for(self, dtype: torch.dtype | None) -> float:
        """Peak flop/s of compute in `dtype` (fp32/fp64: the fp32 rate; anything else: 16-bit)."""
        if dtype in _FP32_RATE and self.peak_flops_fp32 is not None:
            return self.peak_flops_fp32
        return self.peak_flops

    def optimizer_s(self, elements: float) -> float:
        """The optimizer step over `elements` local parameter elements (AdamW, fused)."""
        rate = self.optimizer_rate if self.optimizer_rate is not None else self.mem_bw / ADAMW_STEP_BYTES
        return elements / rate

    def roofline_s(self, flops: float, bytes_moved: float, dtype: torch.dtype | None = None) -> float:
        """Time of a kernel doing `flops` in `dtype` and moving `bytes_moved`, whichever bound
        dominates."""
        return max(flops / self.peak_for(dtype) if flops else 0.0, bytes_moved / self.mem_bw)
