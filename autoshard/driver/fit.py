"""Fit a plan under a memory limit per rank: the ILP chooses layouts, resharding after the forward
and activation checkpointing under a budget on the modeled peak, and the dry run checks the result.

The budget's linear part is `problem.memory.peak_memory_table` (parameters with their AdamW
states, values handed to the backward, the copies redistributions into handed-over views make).
What is not linear in the choices — the working set of the op running at the peak, a recomputed
block's activations during its backward — is taken from the dry run of the last plan and
subtracted from the limit. When a plan needs more than the limit:

1. for each option the user did not rule out — keep (as asked), reshard every repeated block after
   its forward, recompute every repeated block — solve with the budget, each after the first with
   the best step so far as a cutoff: the LP relaxation often proves that an option cannot beat it,
   and the MIP's search (tens of seconds on a 70B problem) is skipped. An option with a cutoff is
   first solved without the budget (a faster LP; its optimum, when it fits, is the budgeted one);
2. keep the feasible plan with the lowest modeled step time; dry-run it;
3. if its peak is still over the limit, that option's non-linear part grew: tighten its budget and
   go again (by the non-linear part seen, or, from its second miss on, by the slope of its last two
   peaks over their budgets, aiming just under the limit: a tighter budget shards more, and the
   gathers' working set grows back part of what it saves); an option that misses `ROUNDS` times is
   dropped, so a stronger one gets its turn.

A plan whose linear part is under `TRUST` of the limit is not dry-run here: far from binding.
Without dry runs (`FitSteps.dry_run` None: `plan --no-dry-run`) the linear part alone is held
under the limit: a plan whose linear part fits is kept, else the budgeted options are solved with
the whole limit as their budget and the fastest is kept.

How it solves and dry-runs is a `FitSteps` (default: here, on a fake process group). Under a
process group every rank runs the fit beside the others with steps whose results are the same on
every rank (`driver.ranks`: rank 0 solves and dry-runs and broadcasts the results), so every rank
decides alike.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Callable

import solver

from autoshard.pricing.planner import Planner
from autoshard.problem.build import ProblemSpec, ShardingProblem, build_problem
from autoshard.problem.memory import (MODES, MemoryFit, PeakTable, modeled_bytes, peak_memory_table, size_text,
                                      with_peak_budget)
from autoshard.problem.plan import Plan, decode
from autoshard.profiles.device import DeviceProfile
from autoshard.runtime.dryrun import DryRunResult, dry_run

log = logging.getLogger("autoshard")

TRUST = 0.5  # a plan whose linear part is under this share of the limit fits without a dry run
ROUNDS = 3  # dry runs over the limit after which an option is given up


class MemoryLimitError(ValueError):
    """No plan fits the memory limit: names the smallest peak reached and what fills it."""


@dataclass(frozen=True)
class FitSteps:
    """What `fit_memory` asks of the outside: solve a budgeted problem under a cutoff (None: none;
    InfeasibleError when nothing fits the budget, expected and not diagnosed; NoBetterError when
    nothing costs less than the cutoff) and dry-run a plan (None: no dry runs, the linear part
    alone is checked). Replaceable so that ranks fitting side by side agree."""

    solve: Callable[[solver.Problem, float | None], solver.Solution]
    dry_run: Callable[[Plan], DryRunResult] | None


@dataclass
class FittedPlan:
    """The plan that fits, the problem it solves, how it fits, and its dry run when one ran."""

    plan: Plan
    sharding: ShardingProblem
    fit: MemoryFit
    dry_run: DryRunResult | None


def mode_of(spec: ProblemSpec) -> str:
    """The problem's option, one of MODES."""
    return "recompute" if spec.recompute else "reshard" if spec.reshard else "keep"


def fit_memory(plan: Plan, sharding: ShardingProblem, planner: Planner, device: DeviceProfile, spec: ProblemSpec,
               limit: float, *, backend: str = "auto", time_limit: float | None = None,
               steps: FitSteps | None = None) -> FittedPlan:
    """`plan` if it fits `limit`, else the best plan that does (with the problem it solves);
    MemoryLimitError when none does. `steps` default to solving and dry-running in this process."""
    if steps is None:
        steps = FitSteps(lambda problem, cutoff: solver.solve(problem, backend=backend, time_limit=time_limit,
                                                              diagnose=False, cutoff=cutoff), dry_run)
    table = peak_memory_table(sharding)
    linear = modeled_bytes(table, plan.solution.choice)
    asked = mode_of(spec)
    tried: list[tuple[str, float]] = []  # (mode, dry-run peak) of every plan dry-run

    def fitted(chosen: Plan, sp: ShardingProblem, mode: str, linear: float, result: DryRunResult | None,
               constrained: bool) -> FittedPlan:
        peak = None if result is None else float(result.peak_bytes)
        return FittedPlan(chosen, sp, MemoryFit(limit, chosen, linear, peak, constrained, mode, tried,
                                                dry_runs=steps.dry_run is not None), result)

    if linear <= TRUST * limit or (steps.dry_run is None and linear <= limit):
        return fitted(plan, sharding, asked, linear, None, False)
    result = steps.dry_run(plan) if steps.dry_run is not None else None
    if result is not None:
        tried.append((asked, float(result.peak_bytes)))
        if result.peak_bytes <= limit:
            return fitted(plan, sharding, asked, linear, result, False)
    needs = result.peak_bytes if result is not None else linear
    log.info("autoshard: the plan needs %s per rank%s, over the %s limit: planning under a budget",
             size_text(needs), "" if result is not None else " (modeled)", size_text(limit))
    problems = {asked: sharding}
    for mode in MODES[MODES.index(asked) + 1:]:  # what the user did not ask for, the budget may choose
        problems[mode] = build_problem(sharding.graph, sharding.mesh_shape, planner, device,
                                       dataclasses.replace(spec, recompute=mode == "recompute",
                                                           reshard=mode == "reshard"),
                                       catalog=sharding.catalog, pricer=sharding.pricer, repeated=sharding.repeated)
    tables = {mode: table if sp is sharding else peak_memory_table(sp) for mode, sp in problems.items()}
    # each option's budget: the limit less the non-linear part the dry run found, tightened by its own misses
    extra = max(0.0, result.peak_bytes - linear) if result is not None else 0.0
    budgets = dict.fromkeys(problems, limit - extra)
    missed: dict[str, list[tuple[float, float]]] = {mode: [] for mode in problems}  # (budget, dry-run peak)
    smallest = result
    solved: dict[str, _Solved] = {}
    unbudgeted: dict[str, _Unbudgeted] = {}
    while problems:
        best = _best_budgeted(problems, tables, budgets, steps, planner, solved, unbudgeted)
        if best is None:
            break
        candidate, sp, mode = best
        if steps.dry_run is None:  # its linear part fits the limit: all that is checked
            return fitted(candidate, sp, mode, modeled_bytes(tables[mode], candidate.solution.choice), None, True)
        result = steps.dry_run(candidate)
        linear = modeled_bytes(tables[mode], candidate.solution.choice)
        tried.append((mode, float(result.peak_bytes)))
        log.info("autoshard: memory fit: the %s plan under a budget of %s: modeled %s, dry-run peak %s",
                 mode, size_text(solved[mode].budget), size_text(linear), size_text(result.peak_bytes))
        if result.peak_bytes < smallest.peak_bytes:
            smallest = result
        if result.peak_bytes <= limit:
            return fitted(candidate, sp, mode, linear, result, True)
        missed[mode].append((budgets[mode], float(result.peak_bytes)))
        budgets[mode] = _next_budget(limit, budgets[mode], result.peak_bytes - linear, missed[mode])
        if len(missed[mode]) == ROUNDS:  # this option keeps missing: leave it to the others
            del problems[mode]
    if smallest is None:
        raise MemoryLimitError(f"no plan fits {size_text(limit)} per rank: even with every option (resharding, "
                               f"activation checkpointing) the modeled peak is over it; use more devices, a smaller "
                               f"batch or sequence, or bf16 parameters (--param-dtype bf16)")
    raise MemoryLimitError(_no_fit_message(limit, smallest))


@dataclass(frozen=True)
class _Solved:
    """An option's last solve: its budget, its plan (None: nothing fits the budget, or nothing
    costs less than `cut`), and, when a cutoff ruled it out, the proven lower bound on its step
    that did (None: none did). A later cutoff up to that bound rules it out again unsolved."""

    budget: float
    plan: Plan | None
    cut: float | None = None

    def stale(self, budget: float, cutoff: float | None) -> bool:
        """Whether it must be solved again: its budget changed, or it was cut below a better step
        than the best one now (after a miss, the best option's tighter budget costs it more)."""
        return self.budget != budget or (self.cut is not None and (cutoff is None or cutoff > self.cut))


@dataclass(frozen=True)
class _Unbudgeted:
    """An option solved without the budget under a cutoff: its optimum (None: `cut`, the proven
    lower bound that reached the cutoff). No budgeted plan of the option costs less than the
    optimum, and the optimum is the budgeted one when it fits the budget; the LP without the
    budget's row solves in a fraction of the time (70B (8,8,8): ~3 s against 8-12 s)."""

    solution: solver.Solution | None
    cut: float | None = None


def _best_budgeted(problems: dict[str, ShardingProblem], tables: dict[str, PeakTable],
                   budgets: dict[str, float], steps: FitSteps, planner: Planner,
                   solved: dict[str, _Solved], unbudgeted: dict[str, _Unbudgeted]
                   ) -> tuple[Plan, ShardingProblem, str] | None:
    """Each option's plan under its budget; the one with the lowest modeled step (None: none fits).
    Options are solved in order with the best step so far as their cutoff. An option whose last
    solve (in `solved`, updated here) is not stale keeps its result: on a 70B problem one budgeted
    solve takes tens of seconds."""
    best = None
    for mode, sp in problems.items():
        budget, cutoff = budgets[mode], None if best is None else best[0].step_time_s
        if mode not in solved or solved[mode].stale(budget, cutoff):
            solved[mode] = _solve_option(sp, tables[mode], budget, cutoff, steps, planner, unbudgeted, mode)
            if solved[mode].cut is not None:
                log.info("autoshard: memory fit: no %s plan under a budget of %s beats the %s plan's %.1f ms",
                         mode, size_text(budget), best[2], 1e3 * cutoff)
        candidate = solved[mode].plan
        if candidate is None:
            continue
        if best is None or candidate.step_time_s < best[0].step_time_s:
            best = (candidate, sp, mode)
    return best


def _solve_option(sp: ShardingProblem, table: PeakTable, budget: float, cutoff: float | None, steps: FitSteps,
                  planner: Planner, unbudgeted: dict[str, _Unbudgeted], mode: str) -> _Solved:
    """One option under its budget and the cutoff: first without the budget (kept in
    `unbudgeted` across budgets), whose optimum bounds the budgeted one from below."""
    if cutoff is not None:
        free = unbudgeted.get(mode)
        if free is None or (free.cut is not None and cutoff > free.cut):
            try:
                free = unbudgeted[mode] = _Unbudgeted(steps.solve(sp.problem, cutoff))
            except solver.NoBetterError as err:
                free = unbudgeted[mode] = _Unbudgeted(None, _proven(err, cutoff))
        if free.solution is None:
            return _Solved(budget, None, free.cut)
        if free.solution.stats.bound >= cutoff:
            return _Solved(budget, None, free.solution.stats.bound)
        if modeled_bytes(table, free.solution.choice) <= budget:
            return _Solved(budget, decode(sp, free.solution, planner))
    try:
        return _Solved(budget, decode(sp, steps.solve(with_peak_budget(sp, table, budget), cutoff), planner))
    except solver.InfeasibleError:
        return _Solved(budget, None)
    except solver.NoBetterError as err:
        return _Solved(budget, None, _proven(err, cutoff))


def _proven(err: solver.NoBetterError, cutoff: float) -> float:
    """The lower bound a cut proved: the LP's when the solver names it (at least the cutoff, often
    above it: the fit's cutoff rises as tighter budgets cost the best option more, and an option
    cut once stays cut until the cutoff passes this), else the cutoff itself."""
    return cutoff if err.bound is None else err.bound


def _next_budget(limit: float, budget: float, nonlinear: float, missed: list[tuple[float, float]]) -> float:
    """The budget after a miss at `budget`: under the limit by the non-linear part seen so far
    (2% more), or lower where the last two misses' slope (peak per budget) says the limit needs it,
    aiming 1% under it (at most halving the budget)."""
    grown = max(limit - budget, nonlinear)
    out = limit - (grown + 0.02 * abs(grown))
    if len(missed) >= 2:
        (b1, p1), (b2, p2) = missed[-2:]
        if b1 != b2 and (p1 - p2) / (b1 - b2) > 0:
            secant = b2 - (p2 - 0.99 * limit) * (b1 - b2) / (p1 - p2)
            out = min(out, max(secant, 0.5 * b2))  # a nearly flat slope must not throw the budget away
    return out


def _no_fit_message(limit: float, smallest: DryRunResult) -> str:
    rank = max(smallest.ranks.values(), key=lambda m: m.peak_bytes)
    parts = sorted(((getattr(rank, k), k) for k in ("activations", "gathered_params", "transient", "params",
                                                     "optimizer", "grads")), reverse=True)
    largest = ", ".join(f"{k} {size_text(v)}" for v, k in parts[:3])
    return (f"no plan fits {size_text(limit)} per rank: the smallest peak reached is {size_text(smallest.peak_bytes)} "
            f"(largest: {largest}); use more devices, a smaller batch or sequence, or bf16 "
            f"parameters (--param-dtype bf16)")
