"""Planning speed and plan quality at llama3 scale, beside the nearest peer's figures (ANCHORS.md).

Each case runs in a fresh process (so peak RSS is that case's own), on meta tensors with no
process group: trace, problem build (strategies + planner-priced edges), solve, decode.

    python benchmarks/plan.py            # 8B (8,8), 70B (32,8), plus plan quality on 8B
    python benchmarks/plan.py --quick    # a 2-layer 8B on (8,8) only (smoke check)
    python benchmarks/plan.py --json out.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import resource
import sys
import time

# This folder holds solver.py (the solver benchmark): keep it from shadowing the solver package.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]

# The nearest peer on this machine class (ANCHORS.md): trace, ILP build, solve seconds; peak GiB.
PEER = {
    ("llama3-8b", (8, 8)): dict(trace=25.9, build=56.7, solve=46.8, total=129.4, rss_gib=4.2),
    ("llama3-8b", (32, 8)): dict(trace=19.5, build=56.5, solve=43.0, total=119.0, rss_gib=4.1),
}


def _plan_case(model: str, mesh: tuple, batch: int, seq: int, layers: int | None, pins: str | None,
               budget_from_recipe: bool) -> dict:
    import torch

    from autoshard.api import AutoShard
    from autoshard.recipes import param_bytes_per_rank, recipe_layouts, recipe_pins
    from models import build_model, cross_entropy_loss, get_config

    cfg = get_config(model)
    if layers:
        cfg = cfg.with_(n_layers=layers)
    start = time.perf_counter()
    net = build_model(cfg, device="meta")
    with AutoShard(net, lambda: (torch.empty(batch, seq, dtype=torch.int64),) * 2, mesh,
                   loss_fn=cross_entropy_loss) as auto:
        if pins:
            auto.pin(recipe_pins(pins))
        if budget_from_recipe:
            auto.memory_budget(param_bytes_per_rank(net, recipe_layouts(net, "fsdp-tp"), mesh))
        plan = auto.optimize()
    stats = plan.solution.stats
    return dict(
        timings=auto.timings, total=time.perf_counter() - start,
        rss_gib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        variables=stats.variables, constraints=stats.constraints, nodes=stats.nodes,
        step_ms=plan.step_time_s * 1e3, compute_ms=plan.compute_s * 1e3, comm_ms=plan.comm_s * 1e3,
        comm_gb=plan.comm_bytes / 1e9, non_default_order=len(plan.non_default_order_params()),
        params=len(plan.param_layouts),
    )


def run_case(model, mesh, batch=8, seq=8192, layers=None, pins=None, budget_from_recipe=False) -> dict:
    # A fresh process per case: its peak RSS is that case's own; errors come back as exceptions.
    with mp.get_context("spawn").Pool(1, maxtasksperchild=1) as pool:
        return pool.apply(_plan_case, (model, mesh, batch, seq, layers, pins, budget_from_recipe))


def analytic_gb(cfg, mesh, batch, seq, itemsize=4) -> dict:
    """ANCHORS.md's per-rank volumes (ring-optimal), at our dtype: FSDP on dp + TP (sequence
    parallel) on tp, and pure FSDP over every rank."""
    dp, tp = mesh
    params = sum(p.numel() for p in __import__("models").build_model(cfg, device="meta").parameters())
    fsdp = 3 * (dp - 1) / dp * params / tp * itemsize
    tp_bytes = cfg.n_layers * 8 * (tp - 1) / tp * (batch // dp) * seq * cfg.dim * itemsize
    pure = 3 * (dp * tp - 1) / (dp * tp) * params * itemsize
    return dict(fsdp_tp=(fsdp + tp_bytes) / 1e9, fsdp=pure / 1e9)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="2-layer llama3-8b on (8,8) only")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()

    cases = [("llama3-8b", (8, 8), 2)] if args.quick else [
        ("llama3-8b", (8, 8), None), ("llama3-8b", (32, 8), None), ("llama3-70b", (32, 8), None)]
    results = {"speed": [], "quality": []}
    print("Planning speed (one process each, fake tensors, no process group)")
    print(f"{'case':<26}{'trace':>7}{'build':>7}{'solve':>7}{'total':>8}{'RSS GiB':>9}{'ILP vars':>10}"
          f"   | peer: total, RSS")
    for model, mesh, layers in cases:
        r = run_case(model, mesh, layers=layers)
        t = r["timings"]
        name = f"{model}{'/' + str(layers) + 'L' if layers else ''} {mesh}"
        peer = PEER.get((model, mesh)) if not layers else None
        peer_text = f"{peer['total']:.1f} s, {peer['rss_gib']:.1f} GiB" if peer else "-"
        print(f"{name:<26}{t['trace']:>7.1f}{t['build']:>7.1f}{t['solve']:>7.1f}{r['total']:>8.1f}"
              f"{r['rss_gib']:>9.2f}{r['variables']:>10}   | {peer_text}")
        results["speed"].append(dict(model=model, mesh=mesh, layers=layers, **r, peer=peer))

    from models import get_config

    model, mesh, layers = cases[0]
    cfg = get_config(model).with_(n_layers=layers) if layers else get_config(model)
    print(f"\nPlan quality: {model}{'/' + str(layers) + 'L' if layers else ''} on {mesh}, batch 8, seq 8192, "
          "h100-node network, h100 device (modeled per step, per rank, fp32)")
    print(f"{'plan':<44}{'step ms':>9}{'comm ms':>9}{'comm GB':>9}{'non-default order':>19}")
    variants = [("autoshard (free, budget = recipe's)", dict(budget_from_recipe=True)),
                ("FSDP+TP recipe params pinned (acts free)", dict(pins="fsdp-tp", budget_from_recipe=True)),
                ("autoshard (free, budget = total/world)", dict()),
                ("FSDP params pinned (acts free)", dict(pins="fsdp"))]
    for label, kw in variants:
        r = run_case(model, mesh, layers=layers, **kw)
        print(f"{label:<44}{r['step_ms']:>9.2f}{r['comm_ms']:>9.2f}{r['comm_gb']:>9.2f}"
              f"{r['non_default_order']:>12}/{r['params']}")
        results["quality"].append(dict(plan=label, **r))
    est = analytic_gb(cfg, mesh, 8, 8192)
    print(f"{'analytic estimate (ANCHORS.md), FSDP+TP':<44}{'':>9}{'':>9}{est['fsdp_tp']:>9.2f}")
    print(f"{'analytic estimate (ANCHORS.md), pure FSDP':<44}{'':>9}{'':>9}{est['fsdp']:>9.2f}")
    results["analytic_gb"] = est
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1, default=str)


if __name__ == "__main__":
    main()
