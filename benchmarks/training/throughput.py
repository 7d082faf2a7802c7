"""Real training on gloo CPU ranks: autoshard's parallel module vs what a user would pick instead.

Back to back, same model, global batch, sequence, steps, lr, init seed, data seed and AdamW
settings, N processes under torchrun (OMP_NUM_THREADS=1):

  autoshard   `python -m autoshard train` with default flags (plans, applies, trains; planning is timed apart)
  recipe      benchmarks.baselines.train (torchtitan's llama3 TP plan + FSDP2, torch's own APIs; 2-D meshes)
  fsdp2       benchmarks.baselines.train --mesh Nx1 (pure FSDP2: fully_shard per block and root, all ranks)
  ddp         benchmarks.baselines.train --ddp --mesh Nx1 (torch's DistributedDataParallel, default
              buckets; fp32 only: DDP has no MixedPrecisionPolicy)
  autoshard_sync  `python -m autoshard train --prefetch 0` (the 2x2 case, full runs only): every bucket
              waited on where it is launched, to show what the overlap brings

Each trainer runs `repeats` times (3 in a full run), interleaved round by round so that a busy
spell of the machine hits all alike; a trainer's figures are those of its median run by tokens/s,
and autoshard is compared with the best of the baselines.

and, in this process, the single-device reference (models/train_single.py). Both parallel loss
curves must match the reference (fp32); a mismatch exits non-zero. Bytes on the wire are measured
the same way for both: `autoshard.runtime.wire.WireMeter` around one training step on every rank, pricing
each collective it sees (functional or c10d) with the ring model.

    python -m benchmarks.training.throughput               # llama3-debug 2x2, global batch 8, seq 256, 20 steps,
                                                           # 3 rounds (~20 min)
    python -m benchmarks.training.throughput --two-ranks   # the same on 2 ranks: mesh 2x1 against DDP and FSDP2
    python -m benchmarks.training.throughput --quick       # llama3-tiny, 5 steps (CI smoke check)
    python -m benchmarks.training.throughput --json out.json [--out runs/bench-training]
    python -m benchmarks.training.throughput --param-dtype bf16 --reduce-dtype fp32   # every trainer in bf16
    python -m benchmarks.training.throughput --wide --repeats 1   # llama3-wide, batch 4, seq 512: TP should win
    python -m benchmarks.training.throughput --make-train  # make train's configuration: llama3-debug 2x2, batch 8,
                                                           # seq 64
    python -m benchmarks.training.throughput --all         # the three above (make train's, seq 256, wide) in one
                                                           # run (~15 min)
    python -m benchmarks.training.throughput --moe         # moe-debug 2x2, batch 8, seq 256, 20 steps: against
                                                           # DDP (experts replicated) and FSDP2 (experts sharded)
    python -m benchmarks.training.throughput --make-train --repeats 5 --baselines ddp   # autoshard and DDP alone
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, replace
from pathlib import Path

from benchmarks.launch import ROOT
from benchmarks.training.runs import (
    LossMismatch,
    RunFigures,
    Workload,
    compare_losses,
    launch,
    median_run,
    read_figures,
)

# Parameters shown side by side: one of each role in the TP recipe.
SHOWN = (
    "tok_embeddings.weight",
    "layers.0.attention_norm.weight",
    "layers.0.attention.wq.weight",
    "layers.0.attention.wo.weight",
    "layers.0.feed_forward.w1.weight",
    "layers.0.feed_forward.w2.weight",
    "norm.weight",
    "output.weight",
)


FULL = Workload("llama3-debug", batch=8, seq=256, steps=20)
TWO_RANKS = Workload("llama3-debug", batch=8, seq=256, steps=20, mesh="2x1")  # a core per rank: nothing shared
QUICK = Workload("llama3-tiny", batch=8, seq=32, steps=5)
MAKE_TRAIN = Workload("llama3-debug", batch=8, seq=64, steps=20)  # what `make train` runs first (there 30 steps)
# where tensor parallelism should win on paper: wide layers, a small batch of long sequences
WIDE = Workload("llama3-wide", batch=4, seq=512, steps=8)  # batch: pure FSDP2 splits it over 4 ranks
# a mixture of experts: against experts replicated (DDP) and experts sharded (FSDP2); no TP recipe for it
MOE = Workload("moe-debug", batch=8, seq=256, steps=20, routed=True)


BASELINES = ("recipe", "fsdp2", "ddp")


def _trainers(work: Workload, quick: bool, overlap: bool = True) -> list[tuple[str, list[str], Workload]]:
    """(name, torchrun target, workload) of every trainer of `work` (`overlap`: with
    autoshard_sync where it applies)."""
    world = math.prod(int(size) for size in work.mesh.split("x"))
    tp = int(work.mesh.split("x")[1]) if "x" in work.mesh else 1
    recipe = ["-m", "benchmarks.baselines.train"]
    every_rank = replace(work, mesh=f"{world}x1")  # no TP: data parallel over every rank
    return [
        ("autoshard", ["-m", "autoshard", "train"], work),
        *([("recipe", recipe, work)] if tp > 1 and work.model != MOE.model else []),
        ("fsdp2", recipe, every_rank),
        *([("ddp", [*recipe, "--ddp"], every_rank)] if not work.param_dtype else []),
        *(
            [("autoshard_sync", ["-m", "autoshard", "train", "--prefetch", "0"], work)]
            if overlap and not quick and tp > 1 and (work.model, work.seq) == (FULL.model, FULL.seq)
            else []
        ),
    ]


def run(
    quick: bool = False,
    out_dir: str | os.PathLike = ROOT / "runs" / "bench-training",
    precision: tuple[str, str] | None = None,
    repeats: int | None = None,
    wide: bool = False,
    two_ranks: bool = False,
    make_train: bool = False,
    overlap: bool = True,
    moe: bool = False,
    baselines: Sequence[str] | None = None,
) -> dict:
    """Train the parallel versions `repeats` times each (default 3, 1 with `quick`) and the
    reference once; print and return the comparison. `precision`: (param dtype, reduce dtype) for
    every trainer and the reference, e.g. ("bf16", "fp32"). Raises `LossMismatch` (after printing)
    when a parallel loss curve leaves the reference. `wide` / `two_ranks` / `make_train` / `moe`: the
    WIDE / TWO_RANKS / MAKE_TRAIN / MOE workload instead; `overlap=False` leaves autoshard_sync out;
    `baselines` (names of `_trainers`) runs only those beside autoshard."""
    from autoshard.capture.precision import parse_dtype
    from autoshard_models.train_single import TrainSettings, train_single

    work = WIDE if wide else TWO_RANKS if two_ranks else MAKE_TRAIN if make_train else QUICK if quick else FULL
    work = MOE if moe else work
    repeats = repeats or (1 if quick else 3)
    if precision:
        work = replace(work, param_dtype=precision[0], reduce_dtype=precision[1])
    dtypes = "fp32" if not precision else f"{precision[0]}-{precision[1]}"
    out = Path(out_dir) / dtypes / f"{work.model}-{work.mesh}"
    total_start = time.perf_counter()
    trainers = _trainers(work, quick, overlap)
    if baselines is not None:  # autoshard and the baselines named
        unknown = set(baselines) - {name for name, _, _ in trainers}
        if unknown:
            raise ValueError(f"--baselines: {', '.join(sorted(unknown))} do not run on this workload")
        trainers = [t for t in trainers if t[0] == "autoshard" or t[0] in baselines]
    runs: dict[str, list[RunFigures]] = {name: [] for name, _, _ in trainers}
    for repeat in range(repeats):
        for name, target, w in trainers:
            run_dir = out / name / f"run{repeat + 1}" if repeats > 1 else out / name
            figures = read_figures(name, run_dir, work, launch(name, target, w, run_dir))
            if name.startswith("autoshard"):
                report = json.loads((run_dir / "plan.json").read_text())
                figures.layouts = {p["fqn"]: p["layout"] for p in report["parameters"] if p["fqn"] in SHOWN}
            else:
                figures.layouts = {
                    k: v for k, v in json.loads((run_dir / "layouts.json").read_text()).items() if k in SHOWN
                }
            runs[name].append(figures)
    chosen = {name: median_run(r) for name, r in runs.items()}
    auto = chosen["autoshard"]
    report = json.loads((Path(auto.run_dir) / "plan.json").read_text())
    planning_s = sum(s for stage, s in report["timings"].items() if stage != "dry_run")  # the dry run is not planning

    start = time.perf_counter()
    single = train_single(
        TrainSettings(
            model=work.model,
            steps=work.steps,
            batch=work.batch,
            seq=work.seq,
            lr=work.lr,
            seed=work.seed,
            data_seed=work.data_seed,
            param_dtype=parse_dtype(work.param_dtype) if work.param_dtype else None,
            reduce_dtype=parse_dtype(work.reduce_dtype) if work.reduce_dtype else None,
        )
    )
    reference_s = time.perf_counter() - start
    for r in (f for every in runs.values() for f in every):
        compare_losses(r, single.losses)
    baselines = [chosen[name] for name in BASELINES if name in chosen]
    best = max(baselines, key=lambda r: r.tokens_per_s)

    from autoshard.report.text import summary_lines

    def entry(f: RunFigures) -> dict:
        return asdict(f) | {"peak_rss_mb": f.peak_rss_mb, "wire_bytes": f.wire_bytes}

    figures = {
        "workload": asdict(work),
        "repeats": repeats,
        "autoshard": entry(auto)
        | {
            "planning_s": planning_s,
            "planning_stages_s": report["timings"],
            "plan_summary": summary_lines(report),
            "modeled_step_s": report["totals"]["step_time_s"],
            "modeled_comm_bytes": report["totals"]["comm_bytes"],
            "modeled_overlapped_step_s": report["totals"].get("overlapped_step_s"),
        },
        **{r.name: entry(r) for r in baselines},
        "baselines": [r.name for r in baselines],
        "best_baseline": best.name,
        "best_baseline_ratio": auto.tokens_per_s / best.tokens_per_s,
        # round by round (each pair ran back to back): steadier than the medians' ratio on a noisy host
        "paired_ratio_median": statistics.median(
            a.tokens_per_s / b.tokens_per_s for a, b in zip(runs["autoshard"], runs[best.name])
        ),
        "reference": {"losses": single.losses, "wall_s": reference_s, "tokens_per_s": single.tokens_per_s},
        "wire_ratio": auto.wire_bytes / best.wire_bytes if best.wire_bytes else None,
        "loss_rtol": work.loss_rtol,
        "wall_s": time.perf_counter() - total_start,
    }
    if "recipe" in chosen:
        figures["throughput_ratio"] = auto.tokens_per_s / chosen["recipe"].tokens_per_s
    if "autoshard_sync" in chosen:
        figures["autoshard_sync"] = entry(chosen["autoshard_sync"])
        figures["overlap_ratio"] = auto.tokens_per_s / chosen["autoshard_sync"].tokens_per_s
    _print(figures, [chosen[name] for name, _, _ in trainers])
    bad = sorted({r.name for every in runs.values() for r in every if not r.max_rel_loss_dev <= work.loss_rtol})
    if bad:
        raise LossMismatch(
            f"loss curve of {', '.join(bad)} differs from the single-device reference by more "
            f"than {work.loss_rtol:g} relative (see the table)",
            figures,
        )
    return figures


# ---------------------------------------------------------------------------------- printing
TITLES = {
    "autoshard": "autoshard",
    "recipe": "recipe (FSDP2+TP)",
    "fsdp2": "pure FSDP2",
    "ddp": "torch DDP",
    "autoshard_sync": "autoshard, prefetch 0",
}


def _print(figures: dict, runs: list[RunFigures]) -> None:
    w = figures["workload"]
    mib = 2**20
    dtypes = f"param {w['param_dtype']}, reduce {w['reduce_dtype']}" if w.get("param_dtype") else "fp32"
    world = math.prod(int(size) for size in w["mesh"].split("x"))
    print(
        f"\n{w['model']} on mesh {w['mesh']} ({dtypes}; gloo, {world} processes, OMP_NUM_THREADS=1): "
        f"global batch {w['batch']}, "
        f"seq {w['seq']}, {w['steps']} steps; throughput = mean of steps {w['warmup'] + 1}-{w['steps']}; "
        f"wire = ring-model bytes per rank during step {w['wire_step']}; the median of {figures['repeats']} "
        f"run(s) per trainer"
    )
    auto = runs[0]
    kinds = sorted(set().union(*(r.wire_bytes_by_kind for r in runs)))
    rows = [
        ("tokens/s", *(f"{r.tokens_per_s:,.0f}" for r in runs)),
        ("tokens/s of each run", *(" ".join(f"{x:,.0f}" for x in r.runs_tokens_per_s) for r in runs)),
        ("tokens/s (median)", *(f"{r.median_tokens_per_s:,.0f}" for r in runs)),
        ("step s", *(f"{r.step_s:.3f}" for r in runs)),
        ("peak RSS MiB per rank (max)", *(f"{r.peak_rss_mb:,.0f}" for r in runs)),
        ("peak RSS MiB per rank (each)", *(" ".join(f"{x:.0f}" for x in r.peak_rss_mb_per_rank) for r in runs)),
        ("wire MiB per rank per step", *(f"{r.wire_bytes / mib:.2f}" for r in runs)),
        *[(f"  {kind} MiB (count)", *(_kind(r, kind) for r in runs)) for kind in kinds],
        ("max |loss - single|", *(f"{r.max_abs_loss_dev:.2e}" for r in runs)),
        ("max relative loss dev", *(f"{r.max_rel_loss_dev:.2e}" for r in runs)),
        ("planning s", f"{figures['autoshard']['planning_s']:.1f}", *["-"] * (len(runs) - 1)),
        ("torchrun wall s", *(f"{r.wall_s:.1f}" for r in runs)),
    ]
    width = max(len(r[0]) for r in rows) + 2
    print(f"{'':<{width}}" + "".join(f"{TITLES[r.name]:>22}" for r in runs))
    for label, *cells in rows:
        print(f"{label:<{width}}" + "".join(f"{c:>22}" for c in cells))
    wire = f"{figures['wire_ratio']:.2f}" if figures["wire_ratio"] is not None else "-"
    print(
        (
            f"throughput ratio autoshard / recipe: {figures['throughput_ratio']:.2f}; "
            if "throughput_ratio" in figures
            else ""
        )
        + f"autoshard / best baseline ({figures['best_baseline']}): {figures['best_baseline_ratio']:.2f} "
        f"(target >= 1.0; round by round, median {figures['paired_ratio_median']:.2f}); "
        + (f"autoshard / its prefetch 0: {figures['overlap_ratio']:.2f}; " if "overlap_ratio" in figures else "")
        + f"wire ratio vs {figures['best_baseline']}: {wire}; single-device loss {auto.losses[0]:.4f} -> "
        f"{figures['reference']['losses'][-1]:.4f}; total wall {figures['wall_s']:.0f} s"
    )
    other = runs[1]
    print("\nparameter layouts [dp, tp]:")
    print(f"{'parameter':<34}{'autoshard':>22}   {other.name} (torch placements)")
    for name in SHOWN:
        print(f"{name:<34}{auto.layouts.get(name, '?'):>22}   {other.layouts.get(name, '?')}")
    print("\nautoshard plan: " + "\n                ".join(figures["autoshard"]["plan_summary"]))


def _kind(run: RunFigures, kind: str) -> str:
    return f"{run.wire_bytes_by_kind.get(kind, 0) / 2**20:.2f} ({run.wire_count_by_kind.get(kind, 0)})"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="llama3-tiny, 5 steps (smoke check)")
    p.add_argument("--json", help="write the figures here")
    p.add_argument("--out", default=str(ROOT / "runs" / "bench-training"), help="run directories go here")
    p.add_argument("--param-dtype", default=None, help="mixed precision for both trainers, e.g. bf16")
    p.add_argument("--reduce-dtype", default="fp32", help="with --param-dtype (default fp32)")
    p.add_argument("--repeats", type=int, default=None, help="runs per trainer (default 3; 1 with --quick)")
    p.add_argument(
        "--wide",
        action="store_true",
        help=f"the case where TP should win on paper: {WIDE.model}, "
        f"batch {WIDE.batch}, seq {WIDE.seq}, {WIDE.steps} steps",
    )
    p.add_argument(
        "--two-ranks",
        action="store_true",
        help=f"{TWO_RANKS.model} on 2 ranks (mesh {TWO_RANKS.mesh}) against DDP and FSDP2 on 2 ranks",
    )
    p.add_argument(
        "--make-train",
        action="store_true",
        help=f"`make train`'s configuration: {MAKE_TRAIN.model}, mesh 2x2, batch {MAKE_TRAIN.batch}, "
        f"seq {MAKE_TRAIN.seq}, {MAKE_TRAIN.steps} steps",
    )
    p.add_argument(
        "--moe",
        action="store_true",
        help=f"a mixture of experts: {MOE.model}, mesh 2x2, batch {MOE.batch}, seq {MOE.seq}, {MOE.steps} steps, "
        "against DDP (experts replicated) and FSDP2 (experts sharded)",
    )
    p.add_argument("--all", action="store_true", help="make train's configuration, seq 256 and wide in one run")
    p.add_argument(
        "--baselines",
        default=None,
        help="comma-separated: only these beside autoshard (recipe, fsdp2, ddp, autoshard_sync; default: all that run)",
    )
    a = p.parse_args(argv)
    if a.all:
        return run_all(a.out, a.repeats, a.json)
    code = 0
    try:
        figures = run(
            quick=a.quick,
            out_dir=a.out,
            repeats=a.repeats,
            wide=a.wide,
            two_ranks=a.two_ranks,
            make_train=a.make_train,
            moe=a.moe,
            baselines=a.baselines.split(",") if a.baselines else None,
            precision=(a.param_dtype, a.reduce_dtype) if a.param_dtype else None,
        )
    except LossMismatch as e:
        print(f"FAIL: {e}", file=sys.stderr)
        figures, code = e.figures, 1
    if a.json:
        Path(a.json).write_text(json.dumps(figures, indent=1))
    return code


ALL = {"make-train": {"make_train": True}, "seq256": {}, "wide": {"wide": True}}


def run_all(out_dir: str, repeats: int | None, json_path: str | None) -> int:
    """`run` on each configuration of ALL (fp32), then one line each: autoshard against the best
    baseline, by throughput and by the whole torchrun's wall time. 1 if a loss curve left the
    reference."""
    results, code = {}, 0
    for name, kind in ALL.items():
        try:
            results[name] = run(out_dir=Path(out_dir) / name, repeats=repeats, overlap=False, **kind)
        except LossMismatch as e:
            print(f"FAIL ({name}): {e}", file=sys.stderr)
            results[name], code = e.figures, 1
    print("\nautoshard against the best baseline of each configuration (median runs):")
    for name, f in results.items():
        best = f[f["best_baseline"]]
        print(
            f"  {name:<11} autoshard {f['autoshard']['tokens_per_s']:,.0f} tok/s, {f['best_baseline']} "
            f"{best['tokens_per_s']:,.0f}: {f['best_baseline_ratio']:.3f}x; torchrun wall "
            f"{f['autoshard']['wall_s']:.1f} s (planning {f['autoshard']['planning_s']:.1f} s) against "
            f"{best['wall_s']:.1f} s"
        )
    if json_path:
        Path(json_path).write_text(json.dumps(results, indent=1))
    return code


if __name__ == "__main__":
    sys.exit(main())
