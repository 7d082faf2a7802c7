"""`make bench`: the planning benchmarks and the training throughput in one run, each beside its
baseline; the tables of docs/benchmarks.md; and results.json, the file the README's figures come from.

    python -m benchmarks.suite.run            # make bench (within ~35 min on 2 cores); writes results.json here
    python -m benchmarks.suite.run --quick    # smoke check: small cases, writes nothing unless --json
    python -m benchmarks.suite.run --only speed,quality --json /tmp/r.json
    python -m benchmarks.suite.run --only accuracy,training_wide   # sections make bench leaves out

Sections; make bench runs the first six (each benchmark also runs alone: benchmarks/README.md):
  speed     planning llama3-8b (8,8), (32,8) and llama3-70b (32,8), (64,8): seconds per stage, peak RSS,
            ILP size, beside the nearest peer's published figures (benchmarks.planning.plan)
  command   `python -m autoshard plan` as a whole process (median of 3), with and without the dry run
  quality   modeled step time and comm bytes of autoshard's plan vs the FSDP+TP recipe, pure FSDP,
            forced-default device orders and the analytic estimate (llama3-8b (8,8), b=1 and 8 in fp32,
            b=1 with bf16 compute and fp32 gradient reduction)
  memory    autoshard under the memory limit vs the FSDP+TP recipe with full activation checkpointing:
            dry-run peak per rank and modeled step (llama3-8b (8,8), llama3-70b (32,8) and (64,8), bf16/fp32)
            (benchmarks.planning.memory)
  planner   redistribution: our planner vs torch's greedy and graph planners (wins/ties/losses)
            (benchmarks.planning.redistribute)
  training  real training on 4 gloo CPU ranks (llama3-debug 2x2, fp32, seq 256): autoshard vs torch DDP,
            torch's fully_shard+parallelize_module and pure fully_shard, medians of 3 interleaved runs
            (benchmarks.training.throughput; --quick: llama3-tiny in bf16 / fp32)
  training_two_ranks, training_bf16, training_wide
            the same on 2 ranks (mesh 2x1), with bf16 compute and fp32 reduction (every trainer under
            the same MixedPrecisionPolicy), and on llama3-wide (batch 4, seq 512), where TP should win
  accuracy  the cost model vs the clock: calibrate this machine, then modeled vs measured step time of
            autoshard's plan, the FSDP+TP recipe pinned and pure FSDP pinned, calibrated vs presets
            (benchmarks.cost_model.accuracy: ~8 min a round, 3 rounds)

Exit status 1 if a check fails: a loss curve off the single-device one, autoshard's plan
costing more than the recipe or pure FSDP, or its plan under the memory limit not fitting or
costing more than the recipe with full activation checkpointing.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

from benchmarks.cost_model import accuracy as accuracy_bench
from benchmarks.planning import memory as memory_bench
from benchmarks.planning import plan as plan_bench
from benchmarks.planning import redistribute as planner_bench
from benchmarks.training import throughput as training_bench

# make bench: the planning sections (a few minutes) and one training comparison (~20 min)
DEFAULT = ("speed", "command", "quality", "memory", "planner", "training")
SECTIONS = (*DEFAULT, "training_two_ranks", "training_bf16", "training_wide", "accuracy")
# each training section: its key in the results, and the throughput benchmark's arguments
TRAINING = {
    "training": {},
    "training_two_ranks": {"two_ranks": True},
    "training_bf16": {"precision": ("bf16", "fp32")},
    "training_wide": {"wide": True},  # TP should win on paper
}
RESULTS = Path(__file__).resolve().parent / "results.json"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small cases only (CI smoke check)")
    p.add_argument(
        "--only",
        default=",".join(DEFAULT),
        help=f"comma-separated sections of {','.join(SECTIONS)} (default, as make bench: {','.join(DEFAULT)})",
    )
    p.add_argument("--json", help=f"write results here (default for make bench's sections: {RESULTS})")
    a = p.parse_args(argv)
    only = [s.strip() for s in a.only.split(",") if s.strip()]
    unknown = sorted(set(only) - set(SECTIONS))
    if unknown:
        p.error(f"unknown section(s) {', '.join(unknown)}; known: {', '.join(SECTIONS)}")

    import torch

    results: dict = {
        "meta": {
            "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "quick": a.quick,
            "sections": only,
            "torch": torch.__version__,
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
        }
    }
    failures: list[str] = []
    start = time.perf_counter()
    for section in only:
        print(f"\n===== {section} =====", flush=True)
        t0 = time.perf_counter()
        if section == "speed":
            results["speed"] = plan_bench.speed(a.quick)
        elif section == "command":
            results["command"] = plan_bench.command_wall(a.quick, repeats=1 if a.quick else 3)
        elif section == "quality":
            results["quality"] = plan_bench.quality(a.quick)
            failures += [
                f"quality b={q['b']}: {name}" for q in results["quality"] for name, ok in q["checks"].items() if not ok
            ]
        elif section == "memory":
            results["memory"] = memory_bench.run(a.quick)
            failures += [
                f"memory {r['model']} {tuple(r['mesh'])}: goal not met"
                for r in results["memory"]["cases"]
                if not r["goal"]
            ]
        elif section == "planner":
            results["planner"] = planner_bench.run(a.quick)
        elif section in TRAINING:
            # quick: the training section runs bf16 only (the fp32 trainers are the same scripts with no
            # policy, and fp32 parallel training is checked against one device by tests/test_train.py)
            key, case = section, TRAINING[section]
            if a.quick and section == "training":
                key, case = "training_bf16", TRAINING["training_bf16"]
            try:
                results[key] = training_bench.run(quick=a.quick, **case)
            except training_bench.LossMismatch as err:
                results[key] = err.figures
                failures.append(f"{key}: {err}")
        elif section == "accuracy":
            results["accuracy"] = accuracy_bench.run(quick=a.quick)
        results["meta"][f"{section}_s"] = round(time.perf_counter() - t0, 1)
    results["meta"]["wall_s"] = round(time.perf_counter() - start, 1)

    print("\n===== tables (docs/benchmarks.md) =====\n")
    print(markdown(results))
    target = a.json or (None if a.quick or set(only) != set(DEFAULT) else str(RESULTS))
    if target:
        Path(target).write_text(json.dumps(results, indent=1, default=str) + "\n")
        print(f"\nresults: {target}")
    print(f"total {results['meta']['wall_s']:.0f} s")
    for failure in failures:
        print(f"FAIL {failure}", file=sys.stderr)
    return 1 if failures else 0


# ---------------------------------------------------------------------------------- tables
def markdown(results: dict) -> str:
    """The benchmark tables (docs/benchmarks.md), from a results dict (any subset of sections)."""
    parts = []
    if "speed" in results:
        parts.append(_speed_table(results["speed"]))
    if "command" in results:
        parts.append(_command_table(results["command"]))
    parts += [_quality_table(q) for q in results.get("quality", [])]
    if "memory" in results:
        parts.append(memory_bench.markdown(results["memory"]))
    if "planner" in results:
        parts.append(_planner_table(results["planner"]))
    parts += [
        _training_table(results[key])
        for key in ("training", "training_two_ranks", "training_bf16", "training_wide")
        if key in results
    ]
    if "accuracy" in results:
        parts.append(accuracy_bench.markdown(results["accuracy"]))
    return "\n\n".join(parts)


def _speed_table(speed: list[dict]) -> str:
    rows = [
        "| case | batch | trace s | build s | solve s | total s | peak RSS | ILP vars | dry run s | "
        "peak memory/rank (fp32) | nearest peer |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in speed:
        t, peer = r["timings"], r.get("peer")
        name = f"{plan_bench.case_name(r['model'], r.get('layers'))} {tuple(r['mesh'])}"
        peer_text = f"{peer['total']:.1f} s, {peer['rss_gib']:.1f} GiB" if peer else "-"
        rows.append(
            f"| {name} | {r.get('batch', 8)} | {t['trace']:.1f} | {t['build']:.1f} | {t['solve']:.1f} | "
            f"{r['total']:.1f} | {r['rss_gib']:.2f} GiB | {r['variables']:,} | {r['dry_s']:.1f} | "
            f"{r['peak_gib']:.1f} GiB | {peer_text} |"
        )
    return "\n".join(rows)


def _command_table(command: list[dict]) -> str:
    rows = ["| case | `plan --no-dry-run` s | `plan` (with dry run) s |", "|---|---|---|"]
    rows += [
        f"| {r['model']} {tuple(r['mesh'])}, batch {r['batch']} | {r['no_dry_run_s']:.1f} | {r['dry_run_s']:.1f} |"
        for r in command
    ]
    return "\n".join(rows)


def _quality_table(q: dict) -> str:
    rows = [
        f"b={q['b']} (global batch {q['batch']}), seq {q['seq']}, {q.get('precision', 'fp32')}:",
        "",
        "| plan | step ms | comm ms | comm GB/rank | non-default order params |",
        "|---|---|---|---|---|",
    ]
    rows += [
        f"| {r['plan']} | {r['step_ms']:.1f} | {r['comm_ms']:.1f} | {r['comm_gb']:.2f} | "
        f"{r['non_default_order']}/{r['params']} |"
        for r in q["plans"]
    ]
    est = q["analytic_gb"]
    rows += [
        f"| analytic estimate, FSDP+TP | | | {est['fsdp_tp']:.2f} | |",
        f"| analytic estimate, pure FSDP | | | {est['fsdp']:.2f} | |",
    ]
    return "\n".join(rows)


def _planner_table(planner: dict) -> str:
    rows = [
        "| mesh | pairs | vs torch greedy W/T/L | cost ratio | vs torch graph W/T/L | cost ratio |",
        "|---|---|---|---|---|---|",
    ]
    for r in planner["costs"]:
        cells = []
        for g in (r["greedy"], r["graph"]):
            na = f" ({g['torch_errors']} n/a)" if g["torch_errors"] else ""
            cells.append(f"{g['wins']}/{g['ties']}/{g['losses']}{na} | {g['total_cost_ratio']:.3f}")
        rows.append(f"| {tuple(r['mesh'])} | {r['pairs']} | {' | '.join(cells)} |")
    return "\n".join(rows)


TRAINERS = {
    "recipe": "recipe (fully_shard + parallelize_module)",
    "fsdp2": "pure FSDP2 (fully_shard per block and root, all ranks)",
    "ddp": "torch DistributedDataParallel (all ranks)",
}


def _training_table(t: dict) -> str:
    w, a = t["workload"], t["autoshard"]
    mib = 2**20
    dtypes = f"param {w['param_dtype']}, reduce {w['reduce_dtype']}" if w.get("param_dtype") else "fp32"
    repeats = f", median of {t['repeats']} runs each" if t.get("repeats", 1) > 1 else ""
    world = math.prod(int(size) for size in w["mesh"].split("x"))
    rows = [
        f"{w['model']}, mesh {w['mesh']}, {dtypes}, gloo, {world} processes, global batch {w['batch']}, "
        f"seq {w['seq']}, {w['steps']} steps{repeats}:",
        "",
        "| | tokens/s | peak RSS/rank | wire MiB/rank/step | max rel. loss dev vs 1 device |",
        "|---|---|---|---|---|",
    ]
    named = [("autoshard", a), *((TRAINERS[name], t[name]) for name in TRAINERS if name in t)]
    if "autoshard_sync" in t:
        named.append(("autoshard `--prefetch 0` (no overlap)", t["autoshard_sync"]))
    for name, f in named:
        runs = f.get("runs_tokens_per_s", [])
        each = f" ({' / '.join(f'{x:,.0f}' for x in runs)})" if len(runs) > 1 else ""
        rows.append(
            f"| {name} | {f['tokens_per_s']:,.0f}{each} | {f['peak_rss_mb']:,.0f} MiB | "
            f"{f['wire_bytes'] / mib:.2f} | {f['max_rel_loss_dev']:.1e} |"
        )
    recipe = f"autoshard / recipe: **{t['throughput_ratio']:.2f}**; " if "throughput_ratio" in t else ""
    rows += [
        "",
        f"Throughput ratio {recipe}autoshard / best baseline ({t['best_baseline']}): "
        f"**{t['best_baseline_ratio']:.2f}** (target >= 1.0); autoshard planning {a['planning_s']:.1f} s "
        f"(not in tokens/s).",
    ]
    return "\n".join(rows)


if __name__ == "__main__":
    sys.exit(main())
