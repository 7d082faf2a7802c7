"""Redistribute planner benchmark: our plans vs torch's greedy and graph planners.

For a 4096x4096 bf16 tensor, every layout pair on an (8,8) mesh and a sample on (4,4,4): the cost of
our plan against the steps torch's own redistribute would run (its planner, then its merge onto
flattened meshes, all of which we create), all priced with the same NetworkProfile. Also reports
planning latency: cached lookup, uncached plan (new shape), and a cold planner's first plan.

    python -m benchmarks.planning.redistribute [--quick] [--profile h100-node] [--json PATH]
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import random
import statistics
import time

import torch
from torch.distributed.device_mesh import init_device_mesh

from autoshard import _torch_compat as tc
from autoshard.layout import Layout, P, R, S
from autoshard.pricing.planner import Planner

SHAPE, DTYPE = (4096, 4096), torch.bfloat16


def all_layouts(mesh_ndim: int, tensor_ndim: int) -> list[Layout]:
    out = []
    for placements in itertools.product([R, P()] + [S(d) for d in range(tensor_ndim)], repeat=mesh_ndim):
        base = Layout(placements)
        for combo in itertools.product(*[[(td, o) for o in itertools.permutations(mds)] for td, mds in base.order]):
            out.append(Layout(placements, combo))
    return out


def torch_cost(planner: Planner, mesh, src: Layout, dst: Layout, use_graph: bool) -> float:
    """Price torch's executed steps with our profile, tracking the layout they pass through."""
    meta = tc.TensorMeta(torch.Size(SHAPE), (SHAPE[1], 1), DTYPE)
    steps = tc.torch_redistribute_steps(src.to_spec(mesh, meta), dst.to_spec(mesh, meta), use_graph)
    placements, order = list(src.placements), {td: list(mds) for td, mds in src.order}
    cost = 0.0
    for mesh_dims, before, after in steps:
        kind = _KIND.get((type(before).__name__, type(after).__name__))
        if kind is None:  # e.g. greedy's S -> P, which torch's forward redistribute rejects
            raise RuntimeError(f"torch plans {before} -> {after}, which it cannot run forward")
        here = Layout(tuple(placements), tuple((td, tuple(mds)) for td, mds in order.items() if mds))
        tensor_dims = tuple(p.dim for p in (before, after) if isinstance(p, tc.Shard))
        cost += planner.step_cost(kind, mesh_dims, tensor_dims, here, SHAPE, DTYPE.itemsize)
        if isinstance(before, tc.Shard):
            for _ in mesh_dims:
                order[before.dim].pop()
        if isinstance(after, tc.Shard):
            order.setdefault(after.dim, []).extend(mesh_dims)
        for m in mesh_dims:
            placements[m] = {"Shard": S(getattr(after, "dim", 0)), "Partial": P(), "Replicate": R}[type(after).__name__]
    reached = Layout(tuple(placements), tuple((td, tuple(mds)) for td, mds in order.items() if mds))
    if reached != dst:
        raise RuntimeError(f"torch's steps from {src} reach {reached}, not {dst}")
    return cost


_KIND = {
    ("Shard", "Replicate"): "all_gather",
    ("Partial", "Replicate"): "all_reduce",
    ("Partial", "Shard"): "reduce_scatter",
    ("Shard", "Shard"): "all_to_all",
    ("Replicate", "Shard"): "chunk",
    ("Replicate", "Partial"): "to_partial",
}


def compare(mesh_shape, pairs, profile: str) -> dict:
    names = tuple(f"d{i}" for i in range(len(mesh_shape)))
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    for k in range(2, len(mesh_shape) + 1):  # let torch merge collectives wherever it can
        for dims in itertools.combinations(range(len(mesh_shape)), k):
            tc.flattened_mesh(mesh, dims)
    planner = Planner(mesh_shape, profile)
    row = {"mesh": list(mesh_shape), "pairs": len(pairs)}
    ours = [planner.cost(a, b, SHAPE, DTYPE) for a, b in pairs]
    for name, use_graph in (("greedy", False), ("graph", True)):
        wins = ties = losses = errors = 0
        ours_sum = theirs_sum = 0.0
        for (a, b), mine in zip(pairs, ours):
            try:
                theirs = torch_cost(planner, mesh, a, b, use_graph)
            except Exception:
                errors += 1
                continue
            ours_sum, theirs_sum = ours_sum + mine, theirs_sum + theirs
            if mine < theirs * (1 - 1e-9):
                wins += 1
            elif mine > theirs * (1 + 1e-9):
                losses += 1
                print(f"  LOSS vs {name}: {a} -> {b}: ours {mine * 1e6:.1f} us, torch {theirs * 1e6:.1f} us")
            else:
                ties += 1
        row[name] = {
            "wins": wins,
            "ties": ties,
            "losses": losses,
            "torch_errors": errors,
            "total_cost_ratio": ours_sum / theirs_sum if theirs_sum else None,
        }
    return row


def latency(mesh_shape, profile: str, n: int) -> dict:
    src, dst = Layout.parse("S(0)" * len(mesh_shape)), Layout.parse("R" * (len(mesh_shape) - 1) + "S(1)")
    t = time.perf_counter()
    planner = Planner(mesh_shape, profile)
    planner.plan(src, dst, SHAPE, DTYPE)
    cold = time.perf_counter() - t
    cached, uncached = [], []
    for _ in range(20 * n):
        t = time.perf_counter()
        planner.cost(src, dst, SHAPE, DTYPE)
        cached.append(time.perf_counter() - t)
    for i in range(n):
        t = time.perf_counter()
        planner.plan(src, dst, (SHAPE[0] + 64 * (i + 1), SHAPE[1]), DTYPE)
        uncached.append(time.perf_counter() - t)
    return {
        "mesh": list(mesh_shape),
        "cached_us": statistics.median(cached) * 1e6,
        "uncached_ms": statistics.median(uncached) * 1e3,
        "cold_first_plan_ms": cold * 1e3,
    }


def run(quick: bool = False, profile: str = "h100-node") -> dict:
    """Our plans' costs vs torch's planners (W/T/L) and planning latency; prints a summary."""
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    rnd = random.Random(0)
    with tc.fake_process_group(64):
        every2 = all_layouts(2, 2)
        every3 = all_layouts(3, 2)
        cases = [
            ((8, 8), list(itertools.product(every2, every2))),
            ((4, 4, 4), [(rnd.choice(every3), rnd.choice(every3)) for _ in range(60 if quick else 400)]),
        ]
        rows = [compare(mesh_shape, pairs, profile) for mesh_shape, pairs in cases]
        lat = [latency(mesh_shape, profile, 20 if quick else 100) for mesh_shape, _ in cases]
    print(f"\n4096x4096 bf16, profile {profile}: our plan cost vs torch's (W/T/L = ours cheaper/equal/dearer;")
    print("n/a = pairs torch cannot redistribute; cost ratio = sum of ours / sum of torch's over the others)")
    print(
        f"{'mesh':<10}{'pairs':>6}  {'vs greedy W/T/L':>18} {'cost ratio':>10}  "
        f"{'vs graph W/T/L':>18} {'cost ratio':>10}"
    )
    for r in rows:
        cells = []
        for name in ("greedy", "graph"):
            g = r[name]
            err = f" ({g['torch_errors']} n/a)" if g["torch_errors"] else ""
            cells.append(f"{g['wins']:>5}/{g['ties']}/{g['losses']}{err:>6} {g['total_cost_ratio']:>10.3f}")
        print(f"{str(tuple(r['mesh'])):<10}{r['pairs']:>6}  " + "  ".join(cells))
    print(f"\n{'mesh':<10}{'cached lookup':>15}{'uncached plan':>15}{'cold first plan':>17}")
    for r in lat:
        print(
            f"{str(tuple(r['mesh'])):<10}{r['cached_us']:>12.2f} us{r['uncached_ms']:>12.3f} ms"
            f"{r['cold_first_plan_ms']:>14.2f} ms"
        )
    return {"profile": profile, "shape": SHAPE, "dtype": str(DTYPE), "costs": rows, "latency": lat}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer (4,4,4) pairs and latency samples")
    parser.add_argument("--profile", default="h100-node")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = parser.parse_args()
    results = run(args.quick, args.profile)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
