"""Run under `torchrun --standalone --nproc_per_node=4`: `auto_shard()` and `AutoShard.optimize()` in a
real process group plan once, on rank 0, for every rank (driver.ranks).

1. `auto_shard(model, ...)` on a (2,2) mesh, sharding forced (tests/plan_audit.py): how many times
   each rank ran the solver, the plan's problem fingerprint and solution, and the first step's loss
   beside the single-device loss.
2. The same step under a memory limit below the plan's dry-run peak: the fit's solves and dry runs
   run on rank 0 only, and every rank ends with the same fitted plan.
3. Rank 0's solver stopping without a solution (a time limit too short): every rank raises, rank 0
   its own SolveError and the others a RankZeroFailed naming it, instead of waiting for rank 0.

Rank 0 prints one line `RESULT [json per rank]`; tests/test_driver.py asserts on it.
"""

import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import autoshard_solver as solver  # noqa: E402
from autoshard import AutoShard, PlanConfig, auto_shard  # noqa: E402
from autoshard.driver.ranks import solution_hash  # noqa: E402
from autoshard_models import MarkovTokens, build_model, cross_entropy_loss, get_config  # noqa: E402
from plan_audit import batch_on_dp, budget_bytes  # noqa: E402
from torchrun import report_ranks  # noqa: E402

TINY = get_config("llama3-tiny")
BATCH, SEQ = 8, 16
CONFIG = PlanConfig(network="cpu-gloo", device_profile="cpu")


def main() -> None:
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    solves = []
    real_solve = solver.solve

    def counting_solve(*args, **kwargs):
        solves.append(1)
        return real_solve(*args, **kwargs)

    solver.solve = counting_solve
    example = lambda: (torch.empty(BATCH, SEQ, dtype=torch.int64, device="meta"),) * 2  # noqa: E731
    model = build_model(TINY, seed=0)
    pmodel = auto_shard(
        model,
        example,
        mesh,
        loss_fn=cross_entropy_loss,
        config=CONFIG,
        memory_budget=budget_bytes(model, (2, 2)),
        input_layouts=(batch_on_dp(2),) * 2,
    )
    batch = MarkovTokens(TINY.vocab_size, seed=0).batch(0, BATCH, SEQ)
    loss = pmodel(*pmodel.shard_inputs(batch.inputs, batch.targets)).item()
    want = cross_entropy_loss(build_model(TINY, seed=0)(batch.inputs), batch.targets).item()
    result = {"solves": len(solves), "plan": pmodel.plan.solution.to_json(), "loss": loss, "single_device_loss": want}

    with AutoShard(build_model(TINY, device="meta"), example, mesh, loss_fn=cross_entropy_loss, config=CONFIG) as auto:
        free = auto.optimize()
        peak = auto.dry_run(free).peak_bytes
        solves.clear()
        auto.memory_limit(0.85 * peak)
        fitted = auto.optimize()
    result |= {
        "fit_solves": len(solves),
        "peak": peak,
        "fit_limit": auto.fit.limit,
        "fit_peak": auto.fit.peak_bytes,
        "fit_tried": len(auto.fit.tried),
        "fit_mode": auto.fit.mode,
        "fitted": auto.sharding.fingerprint() + solution_hash(fitted),
    }

    def stopped(*args, **kwargs):
        raise solver.SolveError("highs stopped without a solution (time_limit=1)")

    solver.solve = stopped
    try:
        with AutoShard(
            build_model(TINY, device="meta"), example, mesh, loss_fn=cross_entropy_loss, config=CONFIG
        ) as auto:
            auto.optimize()
        result["failure"] = None
    except Exception as err:  # noqa: BLE001 - what each rank raised is the result
        result["failure"] = f"{type(err).__name__}: {err}"
    report_ranks(result)


if __name__ == "__main__":
    main()
