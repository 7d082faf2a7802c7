"""LoRA fine-tuning on gloo CPU ranks: `autoshard train --lora` against what a user writes by hand,
peft's `get_peft_model` then torch's `DistributedDataParallel` (or `fully_shard`) with fused AdamW
over the adapters.

Same model (llama3-debug), init (the adapters start from the values `train --lora` gives them),
data, batch, steps and AdamW settings; 4 processes under torchrun (OMP_NUM_THREADS=1), each trainer
`repeats` times (3) interleaved round by round, a trainer's figures those of its median run by
tokens/s. The loss curves must agree (relative 1e-4, every step): autoshard's against DDP's.

    python -m benchmarks.training.lora              # rank 8 on every projection, seq 256, 20 steps (~6 min)
    python -m benchmarks.training.lora --repeats 1 --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import replace
from pathlib import Path

from benchmarks.launch import ROOT
from benchmarks.training.runs import RunFigures, launch, median_run, read_figures
from benchmarks.training.throughput import FULL

LORA = "8,targets=wq,wk,wv,wo,w1,w2,w3"
WORK = replace(FULL, mesh="4x1")  # data parallel over 4 ranks: DDP's shape
LOSS_RTOL = 1e-4


def trainers(spec: str) -> list[tuple[str, list[str]]]:
    baseline = ["-m", "benchmarks.baselines.train", "--lora", spec]
    return [
        ("autoshard", ["-m", "autoshard", "train", "--lora", spec]),
        ("ddp", [*baseline, "--ddp"]),
        ("fsdp2", baseline),
    ]


def run(repeats: int = 3, spec: str = LORA, out_dir: Path = ROOT / "runs" / "bench-lora") -> dict:
    runs: dict[str, list[RunFigures]] = {name: [] for name, _ in trainers(spec)}
    for repeat in range(repeats):
        for name, target in trainers(spec):
            run_dir = out_dir / name / f"run{repeat + 1}"
            runs[name].append(read_figures(name, run_dir, WORK, launch(name, target, WORK, run_dir)))
    chosen = {name: median_run(r) for name, r in runs.items()}
    reference = chosen["ddp"].losses
    deviation = max(abs(a - b) / abs(b) for every in runs["autoshard"] for a, b in zip(every.losses, reference))
    best = max((chosen[n] for n in ("ddp", "fsdp2")), key=lambda r: r.tokens_per_s)
    plan = json.loads((Path(chosen["autoshard"].run_dir) / "plan.json").read_text())
    frozen = [p for p in plan["parameters"] if p["frozen"]]
    result = {
        "workload": {"model": WORK.model, "mesh": WORK.mesh, "batch": WORK.batch, "seq": WORK.seq, "lora": spec},
        "tokens_per_s": {n: r.tokens_per_s for n, r in chosen.items()},
        "runs_tokens_per_s": {n: r.runs_tokens_per_s for n, r in chosen.items()},
        "peak_rss_mb": {n: r.peak_rss_mb for n, r in chosen.items()},
        "autoshard_over_best": chosen["autoshard"].tokens_per_s / best.tokens_per_s,
        "best_baseline": best.name,
        "max_rel_loss_dev_vs_ddp": deviation,
        "frozen_layouts": sorted({p["layout"] for p in frozen}),
        "step_s_median": {n: statistics.median(r.step_s for r in rs) for n, rs in runs.items()},
    }
    for name, r in chosen.items():
        print(f"{name:10s} {r.tokens_per_s:8.0f} tok/s (runs {', '.join(f'{t:.0f}' for t in r.runs_tokens_per_s)})")
    print(f"autoshard / best ({best.name}): {result['autoshard_over_best']:.3f}; loss deviation vs DDP {deviation:.1e}")
    if deviation > LOSS_RTOL:
        raise SystemExit(f"error: autoshard's losses leave DDP's by {deviation:.1e} (> {LOSS_RTOL:g})")
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--lora", default=LORA, help=f"train --lora's SPEC (default {LORA})")
    p.add_argument("--json", default=None, help="write the figures here")
    args = p.parse_args(argv)
    result = run(args.repeats, args.lora)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
