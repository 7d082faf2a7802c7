"""What a numerics test's plan does, and the checks that it shards.

A parallel-vs-single-device test on a plan with no collective (every rank holding every parameter
and computing the whole batch) passes whatever the redistributions, ordered shards, buckets or
gradient reductions do. So:

- `sharded_plan(auto, ...)` plans for a numerics test with sharding forced (a parameter budget
  below the whole model, the batch split on the first mesh dim) and asserts the plan shards;
- `assert_shards(plan, ...)` is that assertion, for plans made another way (pins, recipes, a CLI run's
  plan.json);
- every `ParallelModule` a test builds, in the test's process or in the torchrun processes it
  launches, is recorded (`record`), and conftest fails any test whose executed plan leaves a mesh
  dim without a collective unless the test is marked `replicated_plan`.
"""

from __future__ import annotations

import functools
import json
import math
import os
from collections import Counter
from typing import Any

AUDIT_ENV = "AUTOSHARD_TEST_PLAN_AUDIT"  # a JSON-lines file every built ParallelModule is recorded in
BUDGET_FRACTION = 1.5  # parameter budget per rank, as a multiple of the whole model's bytes / world
# AutoShard's profiles for a numerics test's plan of a tiny model: on the h100 presets its budgeted
# ILP is a long search of near-ties (HF llama on 2x2: 13 s of 17 s planning), and any sharded
# plan checks the numerics
CPU_PRICED = {"device": "cpu", "network": "cpu-gloo"}


def collectives_by_mesh_dim(plan: Any) -> dict[int, dict[str, int]]:
    """Mesh dim -> collective kind -> how many of the plan's redistribution steps run on that dim
    (a step over several mesh dims counts on each)."""
    from autoshard.pricing.ring import COLLECTIVE_KINDS

    counts: dict[int, Counter] = {dim: Counter() for dim in range(len(plan.mesh_shape))}
    for redistribution in plan.redistributions:
        for step in redistribution.plan.steps:
            if step.kind in COLLECTIVE_KINDS:
                for dim in step.mesh_dims:
                    counts[dim][step.kind] += 1
    return {dim: dict(sorted(c.items())) for dim, c in counts.items()}


def summary(plan: Any) -> dict:
    """The facts the checks read, JSON-ready (torchrun ranks write it; the test process reads it)."""
    sharded = sorted(fqn for fqn, lay in plan.param_layouts.items() if any(p.kind == "S" for p in lay.placements))
    first_input = plan.input_layouts[0] if plan.input_layouts else None
    batch_dims = (
        [] if first_input is None else [m for m, p in enumerate(first_input.placements) if p.kind == "S" and p.dim == 0]
    )
    return {
        "mesh": list(plan.mesh_shape),
        "collectives": {str(dim): kinds for dim, kinds in collectives_by_mesh_dim(plan).items()},
        "sharded_params": len(sharded),
        "params": len(plan.param_layouts),
        "batch_split_on": batch_dims,
    }


def problems(facts: dict, *, params_sharded: bool = False, batch_split: bool = False) -> list[str]:
    """What keeps a plan (its `summary`) from testing sharding; empty when it shards."""
    if math.prod(facts["mesh"]) == 1:
        return ["a world of one: nothing is sharded"]
    out = [
        f"no collective on mesh dim {dim} (of mesh {tuple(facts['mesh'])})"
        for dim, size in enumerate(facts["mesh"])
        if size > 1 and not facts["collectives"][str(dim)]
    ]
    if params_sharded and facts["sharded_params"] == 0:
        out.append(f"all {facts['params']} parameters replicated")
    if batch_split and 0 not in facts["batch_split_on"]:
        out.append(f"the batch is not split on mesh dim 0 (split on {facts['batch_split_on']})")
    return out


def assert_shards(plan_or_facts: Any, *, params_sharded: bool = True, batch_split: bool = True) -> dict:
    """Fail unless the plan spans more than one rank, runs a collective on every mesh dim (of size
    over 1), shards at least one parameter (`params_sharded`) and splits the batch on mesh dim 0
    (`batch_split`, where the test means data parallelism). Takes a Plan or its `summary` (e.g.
    from a run's plan.json); returns the summary."""
    facts = plan_or_facts if isinstance(plan_or_facts, dict) else summary(plan_or_facts)
    found = problems(facts, params_sharded=params_sharded, batch_split=batch_split)
    assert not found, "the plan does not test sharding: " + "; ".join(found) + f"\n{facts}"
    return facts


def budget_bytes(model: Any, mesh_shape: Any, fraction: float = BUDGET_FRACTION) -> float:
    """A parameter budget per rank of `fraction` x the model's parameter bytes / world: below the
    whole model, so the plan must shard parameters (1.0: every one fully)."""
    return fraction * sum(p.numel() * p.element_size() for p in model.parameters()) / math.prod(mesh_shape)


def batch_on_dp(mesh_ndim: int) -> str:
    """The layout of a batch split on mesh dim 0 (dim 0 = batch), replicated on the others."""
    return "S(0)" + "R" * (mesh_ndim - 1)


def force_sharding(auto: Any, *, budget: float | None = BUDGET_FRACTION, split_batch: bool = True) -> None:
    """Constrain `auto` (an AutoShard) so its plan shards: parameters under `budget_bytes(budget)`
    per rank, and (unless the test constrained it already) the first input's batch split on mesh dim 0."""
    from autoshard.layout import Layout

    if budget is not None:
        auto.memory_budget(budget_bytes(auto.model, auto.mesh_shape, budget))
    if split_batch and 0 not in auto.spec.input_layouts:
        auto.spec.input_layouts = dict(auto.spec.input_layouts) | {0: Layout.parse(batch_on_dp(len(auto.mesh_shape)))}


def sharded_plan(
    auto: Any, *, budget: float | None = BUDGET_FRACTION, split_batch: bool = True, params_sharded: bool = True
) -> Any:
    """`auto.optimize()` for a numerics test: sharding forced (`force_sharding`) and asserted
    (`assert_shards`)."""
    force_sharding(auto, budget=budget, split_batch=split_batch)
    plan = auto.optimize()
    assert_shards(plan, params_sharded=params_sharded, batch_split=split_batch)
    return plan


# ---------------------------------------------------------------------- recording built modules
def _append(plan: Any) -> None:
    import torch.distributed as dist

    path = os.environ.get(AUDIT_ENV)
    if not path or (dist.is_available() and dist.is_initialized() and dist.get_rank() != 0):
        return  # not under the test suite, or not rank 0 (every rank holds the same plan)
    with open(path, "a") as f:
        f.write(json.dumps(summary(plan)) + "\n")


def record(module_cls: Any) -> None:
    """Wrap `module_cls.__init__` (ParallelModule's) so every instance appends its plan's summary to
    the file AUDIT_ENV names when it is built."""
    original = module_cls.__init__

    @functools.wraps(original)
    def init(self, plan, *args, **kwargs):
        original(self, plan, *args, **kwargs)
        _append(plan)

    module_cls.__init__ = init


def recorded(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]
