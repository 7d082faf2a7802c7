"""What one GPU sustains on the ops of a large plan, beside what a device preset models for them.

    python -m benchmarks.gpu.rates                   # preset by the GPU's name (h200 on an H200, else h100)
    python -m benchmarks.gpu.rates --preset h100 --out rates.json

Times (CUDA events, median of 20 after 5 warm-ups) bf16 matmuls of the local shapes of llama3-8b
on (8, 8) and llama3-70b on (64, 8) (seq 8192, TP 8: 8192 tokens per rank; forward and both
backward products), fp32 matmuls (no TF32, torch's default), causal flash attention on the TP
split's heads, elementwise ops on activation-sized tensors, and fused AdamW. Each row prints the
preset's roofline for the op (`DeviceProfile.roofline_s` plus its per-op overhead, with the flops
and bytes the planner counts: attention as torch's flop counter counts it, whole not causal) and
modeled / measured. The summary gives the medians a preset should carry. The h100 / h200 presets
were set from this script's runs on one H100 and one H200 (docs/benchmarks.md, GPU rates).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
from dataclasses import asdict, dataclass

from benchmarks.launch import ROOT

TOKENS = 8192
# (label, in features, out features): the local matmuls of one block and the LM head, TP 8
MATMULS = (
    ("8b q", 4096, 512),
    ("8b o", 512, 4096),
    ("8b w1", 4096, 1792),
    ("8b w2", 1792, 4096),
    ("8b lm head", 4096, 16032),
    ("70b q", 8192, 1024),
    ("70b w1", 8192, 3584),
    ("70b w2", 3584, 8192),
    ("square", 8192, 8192),
)
HEAD_DIM = 128


@dataclass
class Row:
    kind: str  # matmul (bf16 / fp32), attention, memory, optimizer
    label: str
    seconds: float  # measured, median
    modeled: float  # the preset's roofline + per-op overhead
    flops: float
    nbytes: float

    @property
    def rate(self) -> str:
        return (
            f"{self.flops / self.seconds / 1e12:6.1f} TFLOP/s"
            if self.flops
            else f"{self.nbytes / self.seconds / 1e9:6.0f} GB/s"
        )


def _timed(fn, reps: int = 20, warm: int = 5) -> float:
    import torch

    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def measure(profile, adamw_step_bytes: int) -> list[Row]:
    import torch
    import torch.nn.functional as F

    dev = torch.device("cuda")
    rows: list[Row] = []

    def row(kind, label, seconds, flops=0.0, nbytes=0.0, dtype=torch.bfloat16, modeled=None):
        if modeled is None:
            modeled = profile.op_overhead_s + profile.roofline_s(flops, nbytes, dtype)
        rows.append(Row(kind, label, seconds, modeled, flops, nbytes))
        r = rows[-1]
        print(
            f"{kind:9s} {label:40s} {seconds * 1e6:9.1f} us  modeled {modeled * 1e6:9.1f} us  "
            f"modeled/measured {modeled / seconds:5.2f}  {r.rate}",
            flush=True,
        )

    for dtype, shapes in ((torch.bfloat16, MATMULS), (torch.float32, MATMULS[:2])):
        name = str(dtype).removeprefix("torch.")
        for label, k, n in shapes:
            x = torch.randn(TOKENS, k, device=dev, dtype=dtype)
            w = torch.randn(n, k, device=dev, dtype=dtype)
            g = torch.randn(TOKENS, n, device=dev, dtype=dtype)
            flops, nbytes = 2 * TOKENS * k * n, (TOKENS * k + n * k + TOKENS * n) * x.element_size()
            for what, fn in (("fwd", lambda: x @ w.t()), ("dgrad", lambda: g @ w), ("wgrad", lambda: g.t() @ x)):
                row("matmul", f"{name} {what} {label} ({k}->{n})", _timed(fn), flops, nbytes, dtype)
    for label, heads in (("8b, 4 heads", 4), ("70b, 8 heads", 8)):
        q, k, v = (
            torch.randn(1, heads, TOKENS, HEAD_DIM, device=dev, dtype=torch.bfloat16, requires_grad=True)
            for _ in range(3)
        )
        flops = 4 * heads * TOKENS * TOKENS * HEAD_DIM  # torch's flop counter: whole attention, forward
        nbytes = 4 * q.numel() * q.element_size()
        grad = torch.randn_like(q)

        def both(q=q, k=k, v=v, grad=grad):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            torch.autograd.grad(out, (q, k, v), grad)

        row(
            "attention",
            f"fwd causal {label}",
            _timed(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)),
            flops,
            nbytes,
        )
        row("attention", f"fwd+bwd causal {label}", _timed(both), 3.5 * flops, 3 * nbytes)
    x = torch.randn(TOKENS, 4096, device=dev, dtype=torch.bfloat16)
    y, w = torch.randn_like(x), torch.randn(4096, device=dev, dtype=torch.bfloat16)
    size = x.numel() * x.element_size()
    for label, fn, nbytes in (
        ("add bf16 8192x4096", lambda: x + y, 3 * size),
        ("mul bf16 8192x4096", lambda: x * y, 3 * size),
        ("silu bf16 8192x4096", lambda: F.silu(x), 2 * size),
        ("to fp32 8192x4096", lambda: x.float(), 3 * size),
        ("rms_norm bf16 8192x4096", lambda: F.rms_norm(x, (4096,), w), 2 * size),
    ):
        row("memory", label, _timed(fn), 0.0, nbytes)
    elements = 100_000_000
    p = torch.randn(elements, device=dev, requires_grad=True)
    p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW([p], lr=1e-4, fused=True)
    row(
        "optimizer",
        "fused AdamW, 100M fp32 elements",
        _timed(opt.step, reps=10, warm=3),
        0.0,
        adamw_step_bytes * elements,
        modeled=profile.optimizer_s(elements),
    )
    return rows


def summary(rows: list[Row]) -> dict[str, float]:
    """The medians a preset should carry: bf16 and fp32 matmul flop/s, elementwise bytes/s."""

    def median_rate(pick, by_flops):
        return statistics.median((r.flops if by_flops else r.nbytes) / r.seconds for r in rows if pick(r))

    return {
        "bf16_flops": median_rate(lambda r: r.kind == "matmul" and r.label.startswith("bfloat16"), True),
        "fp32_flops": median_rate(lambda r: r.kind == "matmul" and r.label.startswith("float32"), True),
        "memory_bytes_s": median_rate(lambda r: r.kind == "memory", False),
        "modeled_over_measured": statistics.median(r.modeled / r.seconds for r in rows),
    }


def device_profiles():
    """`autoshard.profiles.device` loaded alone (it needs only torch): importing the package pulls in
    the planner, which needs a supported torch, and this runs with whatever torch a GPU machine has."""
    spec = importlib.util.spec_from_file_location(
        "autoshard_device_profiles", ROOT / "autoshard" / "profiles" / "device.py"
    )
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default=None, help="device preset to compare with (default: by the GPU's name)")
    parser.add_argument("--out", default=None, help="also write the rows and the summary as JSON")
    a = parser.parse_args(argv)
    import torch

    profiles = device_profiles()
    DeviceProfile = profiles.DeviceProfile
    if not torch.cuda.is_available():
        print("error: no CUDA device: this benchmark times one GPU", file=sys.stderr)
        return 2
    name = torch.cuda.get_device_name()
    preset = a.preset or ("h200" if "H200" in name else "h100")
    try:
        profile = DeviceProfile.preset(preset)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"{name}, torch {torch.__version__}, against the {preset} preset", flush=True)
    rows = measure(profile, profiles.ADAMW_STEP_BYTES)
    result = summary(rows)
    print(
        f"medians: bf16 matmuls {result['bf16_flops'] / 1e12:.0f} TFLOP/s (preset {profile.peak_flops / 1e12:.0f}), "
        f"fp32 matmuls {result['fp32_flops'] / 1e12:.1f} TFLOP/s "
        f"(preset {profile.peak_for(torch.float32) / 1e12:.0f}), "
        f"elementwise {result['memory_bytes_s'] / 1e12:.2f} TB/s (preset {profile.mem_bw / 1e12:.2f}); "
        f"modeled / measured {result['modeled_over_measured']:.2f}"
    )
    if a.out:
        with open(a.out, "w") as f:
            json.dump(
                {
                    "device": name,
                    "torch": torch.__version__,
                    "preset": preset,
                    "summary": result,
                    "rows": [asdict(r) for r in rows],
                },
                f,
                indent=1,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
