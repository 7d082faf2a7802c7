"""3D meshes (HSDP: dp_replicate x dp_shard x tp): planning speed, the decomposition's optimality
gap, and 2D against 3D for llama3-70b on 512 GPUs.

autoshard plans a dp_replicate dim first, as data parallelism (a 1D problem), and then solves the
full problem with each node's placement on that dim fixed (`autoshard.driver.replicas`). The
exact problem under the same roles fixes only what the roles say (parameters Replicate and the
inputs split along the batch on that dim) and leaves every other node free: its ILP is far
larger. Here both are solved on small 3D cases and their modeled steps compared.

    python -m benchmarks.planning.hsdp              # gap cases, 8B (4,2,8) and 70B (8,8,8) plans, 70B 2D vs 3D
    python -m benchmarks.planning.hsdp --gap-only   # only the gap cases
"""

from __future__ import annotations

import argparse
import dataclasses
import resource
import time

from benchmarks.planning.plan import in_fresh_process

ROLES3 = ("dp_replicate", "dp_shard", "tp")
# (model, layers, mesh, batch, seq): the exact ILP finishes on the first two on a CPU core, not on the third
GAP_CASES = [
    ("llama3-tiny", None, (2, 2, 2), 8, 16),
    ("llama3-debug", 1, (2, 2, 2), 8, 32),
    ("llama3-8b", 1, (2, 2, 2), 8, 1024),
]
EXACT_TIME_LIMIT = 1800.0  # the exact llama3-debug case took 18 minutes on a slow core


def _gap_case(
    model: str, layers: int | None, mesh: tuple, batch: int, seq: int, time_limit: float = EXACT_TIME_LIMIT
) -> dict:
    import torch

    import autoshard_solver as solver
    from autoshard import PlanConfig
    from autoshard.driver.api import AutoShard
    from autoshard.layout import R, S
    from autoshard.problem.build import FixedMeshDim, build_problem, grad_sink
    from autoshard_models import build_model, cross_entropy_loss, get_config

    cfg = get_config(model)
    if layers:
        cfg = cfg.with_(n_layers=layers)
    net = build_model(cfg, device="meta")
    config = PlanConfig(mesh=mesh, mesh_names=ROLES3, memory_limit=float("inf"))
    with AutoShard(
        net, lambda: (torch.empty(batch, seq, dtype=torch.int64),) * 2, config=config, loss_fn=cross_entropy_loss
    ) as auto:
        start = time.perf_counter()
        plan = auto.optimize()
        decomposed_s = time.perf_counter() - start
        sp = auto.sharding
        graph = sp.graph
        # the roles alone: parameters (and so their gradients) Replicate on dim 0, inputs split on it
        roles = {node.name: ((R,), ()) for node in graph.params.values()}
        roles.update({grad_sink(fqn): ((), (R,)) for fqn in graph.params})
        roles.update({node.name: ((S(0),), ()) for node in graph.inputs})
        spec = dataclasses.replace(auto.spec, fixed_dim=FixedMeshDim(0, roles))
        start = time.perf_counter()
        exact = build_problem(graph, sp.mesh_shape, auto.planner, auto.device, spec)
        build_s = time.perf_counter() - start
        try:
            solution = solver.solve(exact.problem, time_limit=time_limit)
        except solver.SolveError:  # no solution within the time limit
            solution = None
        exact_s = time.perf_counter() - start
    return dict(
        case=f"{model}{'/' + str(layers) + 'L' if layers else ''} {mesh} b{batch} s{seq}",
        decomposed_ms=plan.solution.objective * 1e3,
        exact_ms=solution and solution.objective * 1e3,
        exact_status=solution.status if solution else "none",
        decomposed_vars=plan.solution.stats.variables,
        exact_vars=solution.stats.variables if solution else 0,
        decomposed_s=decomposed_s,
        exact_build_s=build_s,
        exact_s=exact_s,
    )


def _plan_case(model: str, mesh: tuple, names: tuple | None, batch: int, seq: int) -> dict:
    import torch

    from autoshard import PlanConfig
    from autoshard.driver.api import AutoShard
    from autoshard_models import build_model, cross_entropy_loss, get_config

    start = time.perf_counter()
    net = build_model(get_config(model), device="meta")
    config = PlanConfig(mesh=mesh, mesh_names=names, param_dtype="bf16", reduce_dtype="fp32")
    with AutoShard(
        net, lambda: (torch.empty(batch, seq, dtype=torch.int64),) * 2, config=config, loss_fn=cross_entropy_loss
    ) as auto:
        plan = auto.optimize()
        memory = auto.fit_dry_run or auto.dry_run(plan)
    return dict(
        case=f"{model} {mesh} {','.join(names or ())} b{batch} s{seq} bf16",
        total_s=time.perf_counter() - start,
        timings=auto.timings,
        rss_gib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        step_ms=plan.step_time_s * 1e3,
        comm_ms=plan.comm_s * 1e3,
        peak_gib=memory.peak_bytes / 2**30,
        fit=auto.fit.mode if auto.fit else "-",
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gap-only", action="store_true")
    args = parser.parse_args()
    print("optimality gap: decomposed (dp_replicate planned first) vs the exact ILP under the same roles")
    print(
        f"{'case':42s} {'decomposed ms':>13s} {'exact ms':>10s} {'gap':>8s} {'vars (dec/exact)':>20s} "
        f"{'time s (dec/exact)':>19s}"
    )
    for case in GAP_CASES:
        r = in_fresh_process(_gap_case, *case)
        if r["exact_ms"] is None:
            exact, gap = "none", "-"
        else:
            exact = f"{r['exact_ms']:.4f}" + ("" if r["exact_status"] == "optimal" else "*")
            gap = f"{(r['decomposed_ms'] - r['exact_ms']) / r['exact_ms']:.3%}"
        print(
            f"{r['case']:42s} {r['decomposed_ms']:13.4f} {exact:>10s} {gap:>8s} "
            f"{r['decomposed_vars']:>9,d}/{r['exact_vars']:<10,d} {r['decomposed_s']:8.1f}/{r['exact_s']:<8.1f}",
            flush=True,
        )
    if args.gap_only:
        return
    print("\nplanning whole (trace to fitted, dry-run plan), h100-node network, h100 device")
    print(f"{'case':58s} {'total s':>7s} {'RSS GiB':>7s} {'step ms':>8s} {'comm ms':>8s} {'peak GiB':>8s} fit")
    for model, mesh, names, batch in (
        ("llama3-8b", (4, 2, 8), ROLES3, 8),
        ("llama3-70b", (8, 8, 8), ROLES3, 64),
        ("llama3-70b", (64, 8), None, 64),
    ):
        r = in_fresh_process(_plan_case, model, mesh, names, batch, 8192)
        print(
            f"{r['case']:58s} {r['total_s']:7.1f} {r['rss_gib']:7.2f} {r['step_ms']:8.1f} {r['comm_ms']:8.1f} "
            f"{r['peak_gib']:8.1f} {r['fit']}",
            flush=True,
        )


if __name__ == "__main__":
    main()
