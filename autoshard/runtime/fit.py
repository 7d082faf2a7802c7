"""Fit a plan under a memory limit per rank: the ILP chooses layouts, resharding after the forward
and activation checkpointing under a budget on the modeled peak, and the dry run checks the result.

The budget's linear part is `problem.memory.peak_memory_table` (parameters with their AdamW
states, values handed to the backward). What is not linear in the choices — the working set of the
op running at the peak, a recomputed block's activations during its backward — is taken from the
dry run of the last plan and subtracted from the limit. When a plan needs more than the limit:

1. for each option the user did not rule out — keep (as asked), reshard every repeated block after
   its forward, recompute every repeated block — solve with the budget;
2. keep the feasible plan with the lowest modeled step time; dry-run it;
3. if its peak is still over the limit, that option's non-linear part grew: tighten its budget and
   go again; an option that misses `ROUNDS` times is dropped, so a stronger one gets its turn.

A plan whose linear part is under `TRUST` of the limit is not dry-run here: far from binding.

How it solves and dry-runs is a `FitSteps` (default: here, on a fake process group). Under torchrun
every rank runs the fit beside the others; `train` gives steps whose results are the same on every
rank (rank 0 solves and dry-runs, and broadcasts the results), so every rank decides alike.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Callable

import solver

from autoshard.pricing.planner import Planner
from autoshard.problem.build import ProblemSpec, ShardingProblem, build_problem
from autoshard.problem.memory import modeled_bytes, peak_memory_table, with_peak_budget
from autoshard.problem.plan import Plan, decode
from autoshard.profiles.device import DeviceProfile
from autoshard.runtime.dryrun import DryRunResult, dry_run

log = logging.getLogger("autoshard")

MEMORY_RESERVE = 0.10  # of a device's capacity kept free: allocator slack, collective buffers, context
TRUST = 0.5  # a plan whose linear part is under this share of the limit fits without a dry run
ROUNDS = 2  # dry runs over the limit after which an option is given up
MODES = ("keep", "reshard", "recompute")  # what the backward gets from the forward, most kept first


class MemoryLimitError(ValueError):
    """No plan fits the memory limit: names the smallest peak reached and what fills it."""


@dataclass
class MemoryFit:
    """How a plan meets the memory limit (bytes per rank)."""

    limit: float
    plan: Plan
    modeled_bytes: float  # the linear part for the chosen plan
    peak_bytes: float | None  # its dry run's peak (None: not dry-run, the linear part was far below)
    constrained: bool  # the unconstrained optimum did not fit; the budget chose this plan
    mode: str  # one of MODES: what the plan's backward gets from its forward
    dry_run: DryRunResult | None = None
    tried: list[tuple[str, float]] = dataclasses.field(default_factory=list)  # (mode, peak) of each dry run

    @property
    def recompute(self) -> bool:
        return self.mode == "recompute"

    @property
    def reshard(self) -> bool:
        """Parameters gathered again in the backward (recomputation implies it)."""
        return self.mode != "keep"

    def summary(self) -> str:
        peak = "not dry-run (far below)" if self.peak_bytes is None else f"dry-run peak {_size(self.peak_bytes)}"
        how = "planned under the budget" if self.constrained else "the plan as solved fits"
        return (f"memory limit {_size(self.limit)} per rank: {how}; modeled {_size(self.modeled_bytes)} "
                f"(params + AdamW states + handed-over values), {peak}; "
                f"reshard after forward {'on' if self.reshard else 'off'}, "
                f"activation checkpointing {'on' if self.recompute else 'off'}")


@dataclass(frozen=True)
class FitSteps:
    """What `fit_memory` asks of the outside: solve a budgeted problem (InfeasibleError when nothing
    fits the budget) and dry-run a plan. Replaceable so that ranks fitting side by side agree."""

    solve: Callable[[solver.Problem], solver.Solution]
    dry_run: Callable[[Plan], DryRunResult]


def mode_of(spec: ProblemSpec) -> str:
    """The problem's option, one of MODES."""
    return "recompute" if spec.recompute else "reshard" if spec.reshard else "keep"


def _size(n: float) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def fit_memory(plan: Plan, sharding: ShardingProblem, planner: Planner, device: DeviceProfile, spec: ProblemSpec,
               limit: float, *, backend: str = "auto", time_limit: float | None = None,
               steps: FitSteps | None = None) -> tuple[Plan, ShardingProblem, MemoryFit]:
    """`plan` if it fits `limit`, else the best plan that does (with the problem it solves);
    MemoryLimitError when none does. `steps` default to solving and dry-running in this process."""
    if steps is None:
        steps = FitSteps(lambda problem: solver.solve(problem, backend=backend, time_limit=time_limit), dry_run)
    table = peak_memory_table(sharding)
    linear = modeled_bytes(table, plan.solution.choice)
    asked = mode_of(spec)
    tried: list[tuple[str, float]] = []  # (mode, dry-run peak) of every plan dry-run

    def fit(chosen: Plan, mode: str, linear: float, result: DryRunResult | None, constrained: bool) -> MemoryFit:
        peak = None if result is None else float(result.peak_bytes)
        return MemoryFit(limit, chosen, linear, peak, constrained, mode, result, tried)

    if linear <= TRUST * limit:
        return plan, sharding, fit(plan, asked, linear, None, False)
    result = steps.dry_run(plan)
    tried.append((asked, float(result.peak_bytes)))
    if result.peak_bytes <= limit:
        return plan, sharding, fit(plan, asked, linear, result, False)
    log.info("autoshard: the plan needs %s per rank, over the %s limit: planning under a budget",
             _size(result.peak_bytes), _size(limit))
    problems = {asked: sharding}
    for mode in MODES[MODES.index(asked) + 1:]:  # what the user did not ask for, the budget may choose
        problems[mode] = build_problem(sharding.graph, sharding.mesh_shape, planner, device,
                                       dataclasses.replace(spec, recompute=mode == "recompute",
                                                           reshard=mode == "reshard"))
    tables = {mode: table if sp is sharding else peak_memory_table(sp) for mode, sp in problems.items()}
    # the non-linear part, as the dry run found it: one figure per option, grown by its own misses
    extra = dict.fromkeys(problems, result.peak_bytes - linear)
    misses = dict.fromkeys(problems, 0)
    smallest = (result.peak_bytes, result)
    while problems:
        best = None
        for mode, sp in problems.items():
            try:
                solution = steps.solve(with_peak_budget(sp, tables[mode], limit - extra[mode]))
            except solver.InfeasibleError:
                continue
            candidate = decode(sp, solution, planner)
            if best is None or candidate.step_time_s < best[0].step_time_s:
                best = (candidate, sp, mode)
        if best is None:
            break
        candidate, sp, mode = best
        result = steps.dry_run(candidate)
        linear = modeled_bytes(tables[mode], candidate.solution.choice)
        tried.append((mode, float(result.peak_bytes)))
        if result.peak_bytes < smallest[0]:
            smallest = (result.peak_bytes, result)
        if result.peak_bytes <= limit:
            return candidate, sp, fit(candidate, mode, linear, result, True)
        extra[mode] = max(extra[mode], result.peak_bytes - linear) * 1.02
        misses[mode] += 1
        if misses[mode] == ROUNDS:  # this option keeps missing: leave it to the others
            del problems[mode]
    peak, worst = smallest
    rank = max(worst.ranks.values(), key=lambda m: m.peak_bytes)
    parts = sorted(((getattr(rank, k), k) for k in ("activations", "gathered_params", "transient", "params",
                                                     "optimizer", "grads")), reverse=True)
    largest = ", ".join(f"{k} {_size(v)}" for v, k in parts[:3])
    raise MemoryLimitError(f"no plan fits {_size(limit)} per rank: the smallest peak reached is {_size(peak)} "
                           f"(largest: {largest}); use more devices, a smaller batch or sequence, or bf16 "
                           f"parameters (--param-dtype bf16)")
