"""Does the modeled overlapped step track the measured one? `--prefetch 0, 1, 2` on gloo CPU ranks.

autoshard's program launches a block's bucketed parameter gathers (and gradient reductions) up to
`--prefetch N` buckets ahead of their use and waits on them where the values are needed;
`autoshard.program.schedule` prices that schedule on two streams (compute, communication). Every
metrics row of `python -m autoshard train` carries the measured `step_s` beside the plan's
`modeled_step_s` (no overlap: compute + optimizer + communication, the ILP's objective) and
`modeled_overlapped_step_s` (the program's schedule on two streams). This benchmark trains the
same sharded plan with each prefetch setting under torchrun (gloo, OMP_NUM_THREADS=1):

  - the model's parameters are forced to shard by `--memory-budget` = 1.5 x the model's parameter
    bytes / world (tests/plan_audit.py's `budget_bytes`), and the run fails unless the plan shards
    parameters on the dp mesh dim and its sharding.log has all-gathers on that dim (FSDP-style
    parameter gathers, the ones prefetch moves);
  - the settings run interleaved, round by round (round 1: prefetch 0, 1, 2; round 2: the same...),
    so that a busy spell of the machine hits all of them alike; each run has its own `--out` (with
    `--overwrite`);
  - per setting: the median measured step over every round's steps after `--warmup` (each round's
    median beside it), the modeled steps, modeled / measured, and the measured speed-up of each
    prefetch over prefetch 0 (pooled medians, and each round's paired ratio) against the modeled
    one (overlapped step at prefetch 0 / at N).

`--calibrated` first runs `torchrun ... -m autoshard calibrate [--quick]` on the same mesh and
trains every setting under that profile as well (`--network FILE --device FILE`), interleaved in
the same rounds; the presets (`cpu-gloo`, `cpu`: an idle core per rank) are the default.

    python -m benchmarks.cost_model.overlap               # llama3-debug, mesh 4, batch 8, seq 256, 20 steps,
                                                          # 3 rounds (~6 min)
    python -m benchmarks.cost_model.overlap --calibrated  # the same, also under a profile calibrated just before
                                                          # (~13 min)
    python -m benchmarks.cost_model.overlap --quick       # llama3-tiny, seq 16, 3 steps, prefetch 0 and 1, 1 round
    python -m benchmarks.cost_model.overlap --json out.json --out runs/bench-overlap --mesh 2x2 --prefetch 0,2
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from benchmarks.launch import ROOT, rank_env, torchrun

BUDGET_FRACTION = 1.5  # parameter budget per rank, x the model's parameter bytes / world (tests/plan_audit.py)
PRESETS = ("cpu-gloo", "cpu")


@dataclass(frozen=True)
class Case:
    model: str
    batch: int  # global
    seq: int
    steps: int
    mesh: str = "4"  # one dp dim: every sharded parameter is gathered FSDP-style
    warmup: int = 3  # steps left out of the medians
    rounds: int = 3
    prefetch: tuple[int, ...] = (0, 1, 2)
    bucket_cap_mb: float | None = None  # None: train's default (25)

    @property
    def world(self) -> int:
        return math.prod(int(size) for size in self.mesh.split("x"))


FULL = Case("llama3-debug", batch=8, seq=256, steps=20)
QUICK = Case("llama3-tiny", batch=8, seq=16, steps=3, warmup=1, rounds=1, prefetch=(0, 1))


def budget_bytes(model: str, world: int, fraction: float = BUDGET_FRACTION) -> float:
    """`fraction` x the model's parameter bytes / world: below the whole model, so parameters shard."""
    from autoshard_models import build_model, get_config

    module = build_model(get_config(model), device="meta")
    return fraction * sum(p.numel() * p.element_size() for p in module.parameters()) / world


# ---------------------------------------------------------------------------------- running
def _launch(cmd: list[str], console: Path) -> float:
    """Run `cmd`, its output to `console`; wall seconds. Raises with the tail when it fails."""
    print(f"  $ {' '.join(cmd)}", flush=True)
    start = time.perf_counter()
    with console.open("w") as f:
        done = subprocess.run(cmd, env=rank_env(), cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"failed (exit {done.returncode}):\n{console.read_text()[-4000:]}")
    return time.perf_counter() - start


def calibrate(case: Case, out: Path, quick: bool) -> tuple[Path, float]:
    """`autoshard calibrate` on the case's mesh; the profile file and the wall seconds."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"profile-{case.mesh}.json"
    cmd = [*torchrun(), "--standalone", f"--nproc_per_node={case.world}", "-m", "autoshard", "calibrate"]
    cmd += ["--mesh", case.mesh, "--out", str(path), *(["--quick"] if quick else [])]
    return path, _launch(cmd, out / f"calibrate-{case.mesh}.txt")


def train(case: Case, prefetch: int, budget: float, profiles: tuple[str, str], out: Path) -> dict:
    """One `train` run at `prefetch`; its figures from metrics.jsonl, plan.json and sharding.log."""
    out.mkdir(parents=True, exist_ok=True)
    cmd = [*torchrun(), "--standalone", f"--nproc_per_node={case.world}", "-m", "autoshard", "train"]
    cmd += ["--model", case.model, "--mesh", case.mesh, "--batch", str(case.batch), "--seq", str(case.seq)]
    cmd += ["--steps", str(case.steps), "--memory-budget", f"{budget:.0f}", "--prefetch", str(prefetch)]
    cmd += ["--network", profiles[0], "--device", profiles[1], "--out", str(out), "--overwrite"]
    if case.bucket_cap_mb is not None:
        cmd += ["--bucket-cap-mb", str(case.bucket_cap_mb)]
    wall = _launch(cmd, out / "console.txt")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    if [r["step"] for r in rows] != list(range(1, case.steps + 1)):
        raise RuntimeError(f"{out / 'metrics.jsonl'} has steps {[r['step'] for r in rows]}")
    timed = [r["step_s"] for r in rows if r["step"] > case.warmup]
    report = json.loads((out / "plan.json").read_text())
    return {
        "prefetch": prefetch,
        "measured_steps_s": timed,
        "measured_s": statistics.median(timed),
        "modeled_s": rows[-1]["modeled_step_s"],
        "overlapped_s": rows[-1]["modeled_overlapped_step_s"],
        "wall_s": wall,
        "run_dir": str(out),
        "plan": plan_facts(report, (out / "sharding.log").read_text()),
    }


def plan_facts(report: dict, sharding_log: str) -> dict:
    """What the plan gathers: its collectives, the parameters sharded on the dp dim, and the
    all-gathers on that dim in sharding.log (`all_gather[0]`: the mesh dims it runs on)."""
    names = report.get("mesh_names") or []
    dp = names.index("dp") if "dp" in names else names.index("dp_shard") if "dp_shard" in names else 0
    width = len(report["mesh_shape"])
    sharded_on_dp = 0
    for p in report["parameters"]:
        placements = re.findall(r"S\(\d+\)|R|P", p["layout"].split("[")[0])
        if len(placements) == width and placements[dp].startswith("S"):
            sharded_on_dp += 1
    gathers = [[int(d) for d in dims.split(",") if d] for dims in re.findall(r"all_gather\[([\d,]*)\]", sharding_log)]
    totals = report["totals"]
    return {
        "mesh": report["mesh_shape"],
        "mesh_names": names,
        "dp_dim": dp,
        "params": len(report["parameters"]),
        "params_sharded_on_dp": sharded_on_dp,
        "all_gathers_on_dp": sum(dp in dims for dims in gathers),
        "count_by_collective": totals.get("count_by_collective", {}),
        "bytes_by_collective": totals.get("bytes_by_collective", {}),
        "compute_s": totals["compute_s"],
        "comm_s": totals["comm_s"],
        "optimizer_s": totals.get("optimizer_s", 0.0),
    }


def run(
    case: Case = FULL,
    out_dir: str | os.PathLike = ROOT / "runs" / "bench-overlap",
    calibrated: bool = False,
    presets: bool = True,
    quick_calibration: bool = True,
) -> dict:
    """Train `case` at every prefetch setting, `case.rounds` rounds interleaved, under the presets
    and/or (`calibrated`) a profile calibrated on the mesh just before; print and return the
    figures. Raises when a plan does not gather parameters on the dp dim."""
    out = Path(out_dir)
    start = time.perf_counter()
    budget = budget_bytes(case.model, case.world)
    sets: dict[str, tuple[str, str]] = {}
    calibrate_s = None
    if calibrated:
        profile, calibrate_s = calibrate(case, out, quick_calibration)
        sets["calibrated"] = (str(profile), str(profile))
    if presets:
        sets["presets"] = PRESETS
    runs: dict[str, dict[int, list[dict]]] = {name: {p: [] for p in case.prefetch} for name in sets}
    for round_ in range(case.rounds):
        for name, profiles in sets.items():
            for prefetch in case.prefetch:
                print(f"[overlap] round {round_ + 1}/{case.rounds}, {name}, prefetch {prefetch}", flush=True)
                run_dir = out / name / f"prefetch{prefetch}" / f"round{round_ + 1}"
                runs[name][prefetch].append(train(case, prefetch, budget, profiles, run_dir))
    figures = {
        "case": asdict(case),
        "memory_budget_bytes": budget,
        "calibrate_s": calibrate_s,
        "sets": {name: _summary(case, by_prefetch) for name, by_prefetch in runs.items()},
        "wall_s": time.perf_counter() - start,
    }
    print()
    print(markdown(figures))
    for name, s in figures["sets"].items():
        plan = s["plan"]
        if not (plan["params_sharded_on_dp"] and plan["all_gathers_on_dp"]):
            raise RuntimeError(f"{name}: the plan gathers no parameter on the dp dim: {plan}")
    return figures


def _summary(case: Case, by_prefetch: dict[int, list[dict]]) -> dict:
    """Per prefetch setting: the pooled median step, each round's, the modeled ones and ratios;
    speed-ups over the first setting (prefetch 0), measured (pooled and per round) and modeled."""
    rows = []
    for prefetch, done in by_prefetch.items():
        pooled = statistics.median(s for r in done for s in r["measured_steps_s"])
        modeled = statistics.median(r["modeled_s"] for r in done)
        overlapped = statistics.median(r["overlapped_s"] for r in done)
        rows.append(
            {
                "prefetch": prefetch,
                "measured_s": pooled,
                "rounds_measured_s": [r["measured_s"] for r in done],
                "modeled_s": modeled,
                "overlapped_s": overlapped,
                "modeled_over_measured": modeled / pooled,
                "overlapped_over_measured": overlapped / pooled,
                "modeled_values": sorted({r["modeled_s"] for r in done}),  # one value: the same plan every round
                "overlapped_values": sorted({r["overlapped_s"] for r in done}),
                "wall_s": [r["wall_s"] for r in done],
                "run_dirs": [r["run_dir"] for r in done],
            }
        )
    base, base_runs = rows[0], by_prefetch[rows[0]["prefetch"]]
    for row in rows:
        done = by_prefetch[row["prefetch"]]
        row["measured_speedup"] = base["measured_s"] / row["measured_s"]
        row["rounds_speedup"] = [b["measured_s"] / r["measured_s"] for b, r in zip(base_runs, done)]
        row["modeled_speedup"] = base["overlapped_s"] / row["overlapped_s"]
    first = next(iter(by_prefetch.values()))[0]["plan"]
    plans = [r["plan"] for done in by_prefetch.values() for r in done]
    same = all(p["count_by_collective"] == first["count_by_collective"] for p in plans)
    return {"rows": rows, "plan": first, "same_plan_every_run": same}


# ---------------------------------------------------------------------------------- printing
def markdown(figures: dict) -> str:
    c = figures["case"]
    lines = [
        f"{c['model']} on mesh {c['mesh']} (gloo, {math.prod(int(s) for s in c['mesh'].split('x'))} processes, "
        f"OMP_NUM_THREADS=1), global batch {c['batch']}, seq {c['seq']}, {c['steps']} steps, "
        f"--memory-budget {figures['memory_budget_bytes']:.0f}; measured = median of steps "
        f"{c['warmup'] + 1}-{c['steps']} pooled over {c['rounds']} interleaved round(s) (each round's median "
        f"in brackets); speed-up = prefetch 0's step / this one's (measured: pooled, then each round's)",
    ]
    for name, s in figures["sets"].items():
        plan = s["plan"]
        counts = ", ".join(f"{k} x{v}" for k, v in sorted(plan["count_by_collective"].items()))
        lines += [
            "",
            f"{name}: plan {counts}; {plan['params_sharded_on_dp']}/{plan['params']} parameters sharded on "
            f"the dp dim (mesh dim {plan['dp_dim']}), {plan['all_gathers_on_dp']} all-gathers on it in "
            f"sharding.log; modeled compute {plan['compute_s'] * 1e3:.1f} ms, comm {plan['comm_s'] * 1e3:.1f} ms, "
            f"optimizer {plan['optimizer_s'] * 1e3:.1f} ms" + ("" if s["same_plan_every_run"] else " (PLANS DIFFER)"),
            "",
            "| prefetch | measured step ms | modeled ms (no overlap) | modeled overlapped ms | "
            "modeled / measured | overlapped / measured | measured speed-up | modeled speed-up |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in s["rows"]:
            each = " / ".join(f"{x * 1e3:.0f}" for x in r["rounds_measured_s"])
            speed = " / ".join(f"{x:.2f}" for x in r["rounds_speedup"])
            lines.append(
                f"| {r['prefetch']} | {r['measured_s'] * 1e3:.1f} ({each}) | {r['modeled_s'] * 1e3:.1f} | "
                f"{r['overlapped_s'] * 1e3:.1f} | {r['modeled_over_measured']:.2f} | "
                f"{r['overlapped_over_measured']:.2f} | {r['measured_speedup']:.3f} ({speed}) | "
                f"{r['modeled_speedup']:.3f} |"
            )
    lines += ["", f"total wall {figures['wall_s']:.0f} s"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="llama3-tiny, seq 16, 3 steps, prefetch 0 and 1, 1 round")
    p.add_argument("--model", help=f"model (default {FULL.model}; quick {QUICK.model})")
    p.add_argument("--mesh", help=f"mesh shape (default {FULL.mesh}: one dp dim)")
    p.add_argument("--batch", type=int, help="global batch size")
    p.add_argument("--seq", type=int, help="sequence length")
    p.add_argument("--steps", type=int, help="steps per run")
    p.add_argument("--warmup", type=int, help="steps left out of the medians")
    p.add_argument("--rounds", type=int, help="interleaved rounds")
    p.add_argument("--prefetch", help="comma-separated settings, the first is the speed-ups' base (default 0,1,2)")
    p.add_argument("--bucket-cap-mb", type=float, help="train's --bucket-cap-mb (default: train's, 25)")
    p.add_argument("--calibrated", action="store_true", help="also under a profile calibrated on the mesh first")
    p.add_argument("--calibrated-only", action="store_true", help="only under the calibrated profile")
    p.add_argument("--full-calibration", action="store_true", help="calibrate without --quick")
    p.add_argument("--out", default=str(ROOT / "runs" / "bench-overlap"), help="run directories go here")
    p.add_argument("--json", help="write the figures here")
    a = p.parse_args(argv)
    case = QUICK if a.quick else FULL
    given = {
        "model": a.model,
        "mesh": a.mesh,
        "batch": a.batch,
        "seq": a.seq,
        "steps": a.steps,
        "warmup": a.warmup,
        "rounds": a.rounds,
        "bucket_cap_mb": a.bucket_cap_mb,
        "prefetch": tuple(int(x) for x in a.prefetch.split(",")) if a.prefetch else None,
    }
    case = replace(case, **{k: v for k, v in given.items() if v is not None})
    if case.warmup >= case.steps:
        p.error(f"--warmup {case.warmup} leaves no step of {case.steps} to time")
    figures = run(
        case,
        out_dir=a.out,
        calibrated=a.calibrated or a.calibrated_only,
        presets=not a.calibrated_only,
        quick_calibration=not a.full_calibration,
    )
    if a.json:
        Path(a.json).write_text(json.dumps(figures, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
