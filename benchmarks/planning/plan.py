"""Planning speed and plan quality at llama3 scale, beside the nearest peer's published figures.

Each case runs in a fresh process (so peak RSS is that case's own), on meta tensors with no
process group: trace, problem build (strategies + planner-priced edges), solve, decode.

Plan quality: llama3-8b on (8,8), seq 8192, b = 1 and 8 sequences per data-parallel group (global
batch 8b), h100-node network and h100 device. autoshard free vs the FSDP+TP recipe pinned (same
parameter budget), autoshard free vs pure FSDP pinned (budget total / world), the same autoshard
plan with its parameters' device orders forced to the default, and the analytic ring-optimal volumes.

    python -m benchmarks.planning.plan          # 8B (8,8), (32,8), 70B (32,8), (64,8); quality at b=1 and b=8
    python -m benchmarks.planning.plan --quick  # a 2-layer 8B on (8,8), quality at b=1 only (smoke check)
    python -m benchmarks.planning.plan --json out.json
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import resource
import sys
import time

from benchmarks.launch import ROOT

# The nearest peer's published figures on this machine class: trace, ILP build, solve seconds; peak GiB.
PEER = {
    ("llama3-8b", (8, 8)): dict(trace=25.9, build=56.7, solve=46.8, total=129.4, rss_gib=4.2),
    ("llama3-8b", (32, 8)): dict(trace=19.5, build=56.5, solve=43.0, total=119.0, rss_gib=4.1),
}


def _plan_case(
    model: str,
    mesh: tuple,
    batch: int,
    seq: int,
    layers: int | None,
    pins: str | dict | None,
    budget_from_recipe: bool,
    dry: bool,
    precision: tuple[str, str] | None = None,
) -> dict:
    import torch

    from autoshard.driver.api import AutoShard
    from autoshard.driver.config import mp_policy
    from autoshard.problem.recipes import param_bytes_per_rank, recipe_layouts, recipe_pins
    from autoshard_models import build_model, cross_entropy_loss, get_config

    cfg = get_config(model)
    if layers:
        cfg = cfg.with_(n_layers=layers)
    start = time.perf_counter()
    net = build_model(cfg, device="meta")
    with AutoShard(
        net,
        lambda: (torch.empty(batch, seq, dtype=torch.int64),) * 2,
        mesh,
        loss_fn=cross_entropy_loss,
        mp_policy=mp_policy(*precision) if precision else None,
    ) as auto:
        auto.memory_limit(math.inf)  # planning speed and modeled quality as they were measured: no fitting
        if pins:
            auto.pin(recipe_pins(pins, len(mesh)) if isinstance(pins, str) else pins)
        if budget_from_recipe:
            auto.memory_budget(param_bytes_per_rank(net, recipe_layouts(net, "fsdp-tp", len(mesh)), mesh))
        plan = auto.optimize()
        total = time.perf_counter() - start  # planning: the dry run is timed on its own
        memory = auto.dry_run(plan) if dry else None
    stats = plan.solution.stats
    dry_figures = (
        {}
        if memory is None
        else dict(
            dry_s=memory.seconds,
            peak_gib=memory.peak_bytes / 2**30,
            peak_phase=memory.ranks[0].phase,
            activations_gib=memory.ranks[0].activations / 2**30,
        )
    )
    return dict(
        **dry_figures,
        timings=auto.timings,
        total=total,
        rss_gib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        variables=stats.variables,
        constraints=stats.constraints,
        nodes=stats.nodes,
        step_ms=plan.step_time_s * 1e3,
        compute_ms=plan.compute_s * 1e3,
        comm_ms=plan.comm_s * 1e3,
        comm_gb=plan.comm_bytes / 1e9,
        non_default_order=len(plan.non_default_order_params()),
        params=len(plan.param_layouts),
        layouts={fqn: str(lay) for fqn, lay in plan.param_layouts.items()},
    )


def run_case(
    model, mesh, batch=8, seq=8192, layers=None, pins=None, budget_from_recipe=False, dry=False, precision=None
) -> dict:
    """`precision`: (param dtype, reduce dtype) names for mixed precision, e.g. ("bf16", "fp32")."""
    return in_fresh_process(_plan_case, model, mesh, batch, seq, layers, pins, budget_from_recipe, dry, precision)


def in_fresh_process(fn, *args):
    """`fn(*args)` in a fresh process: its peak RSS and memory are that case's own; errors come
    back as exceptions."""
    with mp.get_context("spawn").Pool(1, maxtasksperchild=1) as pool:
        return pool.apply(fn, args)


def analytic_gb(cfg, mesh, batch, seq, itemsize=4, reduce_itemsize=None) -> dict:
    """Analytic per-rank volumes (ring-optimal): FSDP on dp + TP (sequence parallel) on tp, and
    pure FSDP over every rank; gathers and activations in `itemsize` bytes, gradient reductions in
    `reduce_itemsize` (default the same)."""
    dp, tp = mesh
    params = sum(p.numel() for p in __import__("autoshard_models").build_model(cfg, device="meta").parameters())
    per_element = 2 * itemsize + (reduce_itemsize or itemsize)  # gather fwd, gather bwd, reduce-scatter
    fsdp = per_element * (dp - 1) / dp * params / tp
    tp_bytes = cfg.n_layers * 8 * (tp - 1) / tp * (batch // dp) * seq * cfg.dim * itemsize
    pure = per_element * (dp * tp - 1) / (dp * tp) * params
    return dict(fsdp_tp=(fsdp + tp_bytes) / 1e9, fsdp=pure / 1e9)


def case_name(model: str, layers: int | None) -> str:
    """'llama3-8b', or 'llama3-8b/2L' for a model cut to 2 layers."""
    return f"{model}{'/' + str(layers) + 'L' if layers else ''}"


def speed(quick: bool = False) -> list[dict]:
    """Seconds per stage, total, peak RSS and ILP size of each case, then the dry run of rank 0's
    program (seconds, peak memory per rank, fp32), with the peer's figures. 8B at global batch 8 (the
    peer's case); 70B at one sequence per data-parallel rank."""
    cases = (
        [("llama3-8b", (8, 8), 2, 8)]
        if quick
        else [
            ("llama3-8b", (8, 8), None, 8),
            ("llama3-8b", (32, 8), None, 8),
            ("llama3-70b", (32, 8), None, 32),
            ("llama3-70b", (64, 8), None, 64),
        ]
    )
    print("Planning speed (one process each, fake tensors, no process group; seq 8192), then the dry run")
    print(
        f"{'case':<26}{'batch':>6}{'trace':>7}{'build':>7}{'solve':>7}{'total':>8}{'RSS GiB':>9}{'ILP vars':>10}"
        f"{'dry s':>7}{'peak GiB':>10}   | peer: total, RSS"
    )
    rows = []
    for model, mesh, layers, batch in cases:
        r = run_case(model, mesh, batch=batch, layers=layers, dry=True)
        r.pop("layouts")
        t = r["timings"]
        peer = PEER.get((model, mesh)) if not layers else None
        peer_text = f"{peer['total']:.1f} s, {peer['rss_gib']:.1f} GiB" if peer else "-"
        print(
            f"{case_name(model, layers) + ' ' + str(mesh):<26}{batch:>6}{t['trace']:>7.1f}{t['build']:>7.1f}"
            f"{t['solve']:>7.1f}{r['total']:>8.1f}{r['rss_gib']:>9.2f}{r['variables']:>10}{r['dry_s']:>7.1f}"
            f"{r['peak_gib']:>10.1f}   | {peer_text}",
            flush=True,
        )
        rows.append(dict(model=model, mesh=mesh, layers=layers, batch=batch, **r, peer=peer))
    return rows


def command_wall(quick: bool = False, repeats: int = 3) -> list[dict]:
    """`python -m autoshard plan` as a user runs it, process start to exit, median of `repeats`:
    without the dry run (target 8B (8,8) <= 10 s, 70B (64,8) <= 12 s) and with it (<= 5 s more)."""
    import statistics
    import subprocess
    import tempfile

    cases = (
        [("llama3-tiny", (2, 2), 8, 64)]
        if quick
        else [("llama3-8b", (8, 8), 8, 8192), ("llama3-70b", (64, 8), 64, 8192)]
    )
    print("\nThe plan command, process start to exit (median of %d)" % repeats)
    print(f"{'case':<26}{'--no-dry-run s':>15}{'with dry run s':>16}")
    rows = []
    for model, mesh, batch, seq in cases:
        walls = {}
        for dry in (False, True):
            times = []
            for _ in range(repeats):
                with tempfile.TemporaryDirectory() as out:
                    # planning alone: no memory limit (70B fp32 does not fit 80 GB)
                    cmd = [
                        sys.executable,
                        "-m",
                        "autoshard",
                        "plan",
                        "--model",
                        model,
                        "--mesh",
                        "x".join(map(str, mesh)),
                        "--batch",
                        str(batch),
                        "--seq",
                        str(seq),
                        "--out",
                        out,
                        "--memory-limit",
                        "none",
                    ]
                    start = time.perf_counter()
                    subprocess.run(cmd + ([] if dry else ["--no-dry-run"]), cwd=ROOT, check=True, capture_output=True)
                    times.append(time.perf_counter() - start)
            walls[dry] = statistics.median(times)
        print(f"{model + ' ' + str(mesh):<26}{walls[False]:>15.1f}{walls[True]:>16.1f}", flush=True)
        rows.append(
            dict(model=model, mesh=mesh, batch=batch, seq=seq, no_dry_run_s=walls[False], dry_run_s=walls[True])
        )
    return rows


def quality(quick: bool = False) -> list[dict]:
    """Modeled step time and comm bytes per rank of autoshard's plan and the hand-written ones:
    fp32 at b=1 and b=8, then bf16 compute with fp32 gradient reduction at b=1."""
    from autoshard.layout import Layout
    from autoshard_models import get_config

    model, mesh, seq = "llama3-8b", (8, 8), 8192
    layers = 2 if quick else None
    cfg = get_config(model).with_(n_layers=layers) if layers else get_config(model)
    results = []
    cases = [(1, None)] if quick else [(1, None), (8, None), (1, ("bf16", "fp32"))]
    for b, precision in cases:
        batch = b * mesh[0]
        what = "fp32" if precision is None else f"param {precision[0]}, reduce {precision[1]}"
        print(
            f"\nPlan quality: {case_name(model, layers)} on {mesh}, b={b} (global batch {batch}), seq {seq}, "
            f"h100-node network, h100 device (modeled per step, per rank, {what})"
        )
        print(f"{'plan':<48}{'step ms':>9}{'comm ms':>9}{'comm GB':>9}{'non-default order':>19}")
        rows = []

        def show(label: str, r: dict) -> dict:
            row = dict(plan=label, **{k: v for k, v in r.items() if k != "layouts"})
            print(
                f"{label:<48}{r['step_ms']:>9.2f}{r['comm_ms']:>9.2f}{r['comm_gb']:>9.2f}"
                f"{r['non_default_order']:>12}/{r['params']}",
                flush=True,
            )
            rows.append(row)
            return r

        case = dict(batch=batch, seq=seq, layers=layers, precision=precision)
        free = show("autoshard (budget = recipe's)", run_case(model, mesh, budget_from_recipe=True, **case))
        show(
            "FSDP+TP recipe, params pinned (acts free)",
            run_case(model, mesh, pins="fsdp-tp", budget_from_recipe=True, **case),
        )
        default = {fqn: str(Layout(Layout.parse(text).placements)) for fqn, text in free["layouts"].items()}
        show(
            "autoshard, param orders forced to default",
            run_case(model, mesh, pins=default, budget_from_recipe=True, **case),
        )
        show("autoshard (budget = total / world)", run_case(model, mesh, **case))
        show("FSDP, params pinned (acts free)", run_case(model, mesh, pins="fsdp", **case))
        est = analytic_gb(cfg, mesh, batch, seq) if precision is None else analytic_gb(cfg, mesh, batch, seq, 2, 4)
        print(f"{'analytic estimate, FSDP+TP':<48}{'':>18}{est['fsdp_tp']:>9.2f}")
        print(f"{'analytic estimate, pure FSDP':<48}{'':>18}{est['fsdp']:>9.2f}")
        by = {r["plan"]: r for r in rows}
        checks = {
            "autoshard <= recipe": by["autoshard (budget = recipe's)"]["step_ms"]
            <= by["FSDP+TP recipe, params pinned (acts free)"]["step_ms"] * (1 + 1e-9),
            "autoshard <= FSDP": by["autoshard (budget = total / world)"]["step_ms"]
            <= by["FSDP, params pinned (acts free)"]["step_ms"] * (1 + 1e-9),
        }
        print("  " + ", ".join(f"{k}: {'yes' if v else 'NO'}" for k, v in checks.items()))
        results.append(
            dict(b=b, batch=batch, seq=seq, layers=layers, precision=what, plans=rows, analytic_gb=est, checks=checks)
        )
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="2-layer llama3-8b on (8,8) only")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()
    results = {"speed": speed(args.quick), "quality": quality(args.quick)}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1, default=str)


if __name__ == "__main__":
    main()
