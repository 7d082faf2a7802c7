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
   dropped, so a stronger one gets its turn;
4. when no option has a plan under its budget, each budget rises to its option's floor, the least
   modeled memory its plans hold (`_to_floors`), never below what any plan holds;
5. when nothing has fit, the strongest option's plans from its floor up (`_least_peak`): the
   same plans whatever the limit, so the smallest peak the error names is near the least there
   is, and a limit just above it plans.

A plan whose linear part is under `TRUST` of the limit is not dry-run here: far from binding.
Without dry runs (`FitSteps.dry_run` None: `plan --no-dry-run`) the linear part alone is held
under the limit: a plan whose linear part fits is kept, else the budgeted options are solved with
the whole limit as their budget and the fastest is kept.

Solves run beside the fit (`in_background`; HiGHS leaves Python's lock while it solves): while
the asked option's budgeted solve runs, the fit derives the other options' problems from the one
it has (`with_options`) and starts their solves without the budget, which the first round then
reads (their optimum bounds their budgeted step from below, and is it when it fits).

How it solves and dry-runs is a `FitSteps` (default: here, on a fake process group). Under a
process group every rank runs the fit beside the others with steps whose results are the same on
every rank (`driver.ranks`: rank 0 solves and dry-runs and broadcasts the results), so every rank
decides alike.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass
from typing import Callable

import torch

import autoshard_solver as solver
from autoshard.driver import limits
from autoshard.pricing.planner import Planner
from autoshard.problem.build import ProblemSpec, ShardingProblem, with_options
from autoshard.problem.memory import (
    MODES,
    MemoryFit,
    PeakTable,
    least_memory_problem,
    modeled_bytes,
    peak_memory_table,
    size_text,
    with_peak_budget,
)
from autoshard.problem.plan import Plan, decode
from autoshard.runtime.dryrun import DryRunResult, dry_run

log = logging.getLogger("autoshard")

TRUST = 0.5  # a plan whose linear part is under this share of the limit fits without a dry run
ROUNDS = 3  # dry runs over the limit after which an option is given up
PROBES, PROBE_RATIO = 4, 2**0.5  # plans tried from the least memory up when nothing fits (`_least_peak`)


class MemoryLimitError(ValueError):
    """No plan fits the memory limit: names the smallest peak reached and what fills it."""


@dataclass(frozen=True)
class FitSteps:
    """What `fit_memory` asks of the outside: start solving a budgeted problem under a cutoff
    (None: none) and return what waits for its solution (raising InfeasibleError when nothing fits
    the budget, expected and not diagnosed; NoBetterError when nothing costs less than the cutoff),
    and dry-run a plan (None: no dry runs, the linear part alone is checked). Replaceable so that
    ranks fitting side by side agree: every rank waits for the solves in the same order."""

    start: Callable[[solver.Problem, float | None], Callable[[], solver.Solution]]
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


def fit_memory(
    plan: Plan,
    sharding: ShardingProblem,
    planner: Planner,
    spec: ProblemSpec,
    limit: float,
    *,
    backend: str = "auto",
    time_limit: float | None = None,
    steps: FitSteps | None = None,
) -> FittedPlan:
    """`plan` if it fits `limit`, else the best plan that does (with the problem it solves);
    MemoryLimitError when none does. `steps` default to solving and dry-running in this process."""
    steps = steps if steps is not None else FitSteps(limits.solving_here(backend, time_limit), dry_run)
    fit = _Fit(limit, steps, planner)
    table = peak_memory_table(sharding)
    linear = modeled_bytes(table, plan.solution.choice)
    asked = mode_of(spec)
    if linear <= TRUST * limit or (fit.steps.dry_run is None and linear <= limit):
        return fit.fitted(plan, sharding, asked, linear, None, False)
    result = fit.dry_run(plan, asked) if fit.steps.dry_run is not None else None
    if result is not None and result.peak_bytes <= limit:
        return fit.fitted(plan, sharding, asked, linear, result, False)
    log.info(
        "autoshard: the plan needs %s per rank%s, over the %s limit: planning under a budget",
        size_text(result.peak_bytes if result is not None else linear),
        "" if result is not None else " (modeled)",
        size_text(limit),
    )
    # each option's budget: the limit less the non-linear part the dry run found, tightened by its own misses
    extra = max(0.0, result.peak_bytes - linear) if result is not None else 0.0
    options = _start_options(plan, sharding, spec, table, limit - extra, fit.steps)
    return _fit_options(fit, options, result)


@dataclass
class _Fit:
    """One fit: the limit, how it solves and dry-runs, and the (mode, dry-run peak) of every plan
    it dry-ran (the `MemoryFit` of the plan it returns lists them)."""

    limit: float
    steps: FitSteps
    planner: Planner
    tried: list[tuple[str, float]] = dataclasses.field(default_factory=list)

    def dry_run(self, plan: Plan, mode: str) -> DryRunResult:
        assert self.steps.dry_run is not None
        result = self.steps.dry_run(plan)
        self.tried.append((mode, float(result.peak_bytes)))
        return result

    def logged_dry_run(self, plan: Plan, mode: str, budget: float, linear: float) -> DryRunResult:
        """`dry_run` of a plan solved under a budget, as a progress line."""
        result = self.dry_run(plan, mode)
        log.info(
            "autoshard: memory fit: the %s plan under a budget of %s: modeled %s, dry-run peak %s",
            mode,
            size_text(budget),
            size_text(linear),
            size_text(result.peak_bytes),
        )
        return result

    def fitted(
        self, plan: Plan, sp: ShardingProblem, mode: str, linear: float, result: DryRunResult | None, constrained: bool
    ) -> FittedPlan:
        peak = None if result is None else float(result.peak_bytes)
        dry_runs = self.steps.dry_run is not None
        return FittedPlan(
            plan,
            sp,
            MemoryFit(self.limit, plan, linear, peak, constrained, mode, self.tried, dry_runs=dry_runs),
            result,
        )


def _start_options(
    plan: Plan, sharding: ShardingProblem, spec: ProblemSpec, table: PeakTable, budget: float, steps: FitSteps
) -> list[_Option]:
    """The options the fit may take, the asked one first, each with `budget`: the asked option's
    budgeted solve starts at once, and while it runs the others are derived from its problem
    (`with_options`) and start solving without the budget."""
    asked = mode_of(spec)
    first = _Option(asked, sharding, table, budget, unbudgeted=_Unbudgeted(plan.solution))
    first.started = (budget, steps.start(with_peak_budget(sharding, table, budget), None))
    options = [first]
    for mode in MODES[MODES.index(asked) + 1 :]:  # what the user did not ask for, the budget may choose
        sp = with_options(sharding, dataclasses.replace(spec, recompute=mode == "recompute", reshard=mode == "reshard"))
        options.append(_Option(mode, sp, peak_memory_table(sp), budget, ahead=steps.start(sp.problem, None)))
    return options


def _fit_options(fit: _Fit, options: list[_Option], smallest: DryRunResult | None) -> FittedPlan:
    """Rounds over the options until the fastest plan under their budgets dry-runs under the limit:
    a miss tightens that option's budget (dropped after `ROUNDS` misses), nothing under the
    budgets raises them to their floors (`_to_floors`). MemoryLimitError naming the smallest peak
    seen when none fits."""
    limit, steps = fit.limit, fit.steps
    remedies = _remedies(options[0].sharding)
    every = list(options)  # the asked option first, the strongest last
    while options:
        best = _best_budgeted(options, steps, fit.planner)
        if best is None:
            if _to_floors(options, steps, limit):
                continue
            break
        candidate, option = best
        linear = modeled_bytes(option.table, candidate.solution.choice)
        if steps.dry_run is None:  # its linear part fits the limit: all that is checked
            return fit.fitted(candidate, option.sharding, option.mode, linear, None, True)
        result = fit.logged_dry_run(candidate, option.mode, option.budget, linear)
        if smallest is None or result.peak_bytes < smallest.peak_bytes:
            smallest = result
        if result.peak_bytes <= limit:
            return fit.fitted(candidate, option.sharding, option.mode, linear, result, True)
        option.missed.append((option.budget, float(result.peak_bytes)))
        budget = _next_budget(limit, option.budget, result.peak_bytes - linear, option.missed)
        if option.floor is not None:
            budget = max(budget, option.floor)  # no plan of this option holds less
        if len(option.missed) == ROUNDS or budget >= option.budget:  # it keeps missing, or can hold no less
            options.remove(option)
        else:
            option.budget = budget
    if steps.dry_run is not None:  # nothing fits: the strongest option's least-memory plans
        found = _least_peak(fit, every[-1], smallest)
        if isinstance(found, FittedPlan):
            return found
        smallest = found
    if smallest is None:
        raise MemoryLimitError(
            f"no plan fits {size_text(limit)} per rank: even with every option (resharding, "
            f"activation checkpointing) the modeled peak is over it; {remedies}"
        )
    raise MemoryLimitError(_no_fit_message(limit, smallest, remedies))


def _to_floors(options: list[_Option], steps: FitSteps, limit: float) -> bool:
    """No option has a plan under its budget: raise each budget to the least modeled memory any
    plan of that option holds (its floor, solved for once), the tightest budget that has a plan;
    drop the options with no plan at all or a floor over the limit. False when nothing changed:
    every budget is at its floor already."""
    changed = False
    for option in list(options):
        if option.floor is None and option.solved is not None and option.solved.plan is None:
            option.floor = _floor(option, steps)
        if option.floor is None or option.floor > limit:
            options.remove(option)
            changed = True
        elif option.budget < option.floor:
            log.info(
                "autoshard: memory fit: no %s plan fits a budget of %s; the least memory one holds %s (modeled)",
                option.mode,
                size_text(option.budget),
                size_text(option.floor),
            )
            option.budget, changed = option.floor, True
    return changed


def _least_peak(fit: _Fit, option: _Option, smallest: DryRunResult | None) -> FittedPlan | DryRunResult | None:
    """Nothing fits: the strongest option's plan holding the least modeled memory, then plans
    holding more (budgets rising by `PROBE_RATIO`: the least-memory plan's working set, its
    gathers and recomputed activations, may be what a plan holding more leaves out), while under
    the smallest peak seen (a plan holding that much cannot peak lower) and while the peaks fall,
    at most `PROBES` plans. The same plans whatever the limit, so the smallest peak the error names
    does not depend on how far the limit was missed. Returns the plan that fits, if one does,
    else the smallest dry run."""
    if option.floor is None:
        option.floor = _floor(option, fit.steps)
    if option.floor is None or (smallest is not None and option.floor >= smallest.peak_bytes):
        return smallest
    budget, last = option.floor, math.inf
    log.info(
        "autoshard: memory fit: nothing fits; the %s plans holding the least memory, from %s (modeled) up",
        option.mode,
        size_text(budget),
    )
    for _ in range(PROBES):
        if smallest is not None and budget >= smallest.peak_bytes:
            break
        peak = dict(option.missed).get(budget)  # dry-run in the rounds already: counted in `smallest`
        if peak is None:
            try:
                solution = fit.steps.start(with_peak_budget(option.sharding, option.table, budget), None)()
            except solver.InfeasibleError:  # the floor, within the solver's tolerance
                break
            candidate = decode(option.sharding, solution, fit.planner)
            linear = modeled_bytes(option.table, candidate.solution.choice)
            result = fit.logged_dry_run(candidate, option.mode, budget, linear)
            if result.peak_bytes <= fit.limit:
                return fit.fitted(candidate, option.sharding, option.mode, linear, result, True)
            if smallest is None or result.peak_bytes < smallest.peak_bytes:
                smallest = result
            peak = float(result.peak_bytes)
        if peak >= last:
            break
        budget, last = budget * PROBE_RATIO, peak
    return smallest


def _floor(option: _Option, steps: FitSteps) -> float | None:
    """The least modeled memory of the option's plans (a hair above it, for the solver's
    tolerance on the budget's row), or None when it has no plan at all."""
    try:
        least = steps.start(least_memory_problem(option.sharding, option.table), None)()
    except solver.InfeasibleError:
        return None
    return modeled_bytes(option.table, least.choice) * (1 + 1e-6)


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
    """An option solved without the budget: its optimum (None: `cut`, the proven lower bound that
    reached the cutoff it was solved under; neither: nothing is feasible even without the
    budget). No budgeted plan of the option costs less than the optimum, and the optimum is the
    budgeted one when it fits the budget; without the budget's row the problem solves in a
    fraction of the time (70B (8,8,8): ~2 s against 8-12 s)."""

    solution: solver.Solution | None
    cut: float | None = None


@dataclass
class _Option:
    """One way to fit the limit (`mode`: keep, reshard or recompute), its problem and peak table,
    its budget and dry-run misses (budget, peak), and its solves: the last budgeted one, the
    one without the budget, and solves started before the first round (`ahead`: without the
    budget; `started`: under the budget it names, without a cutoff)."""

    mode: str
    sharding: ShardingProblem
    table: PeakTable
    budget: float
    missed: list[tuple[float, float]] = dataclasses.field(default_factory=list)
    floor: float | None = None  # the least modeled memory of its plans, once a budget under it had none
    solved: _Solved | None = None
    unbudgeted: _Unbudgeted | None = None
    ahead: Callable[[], solver.Solution] | None = None
    started: tuple[float, Callable[[], solver.Solution]] | None = None


def _best_budgeted(options: list[_Option], steps: FitSteps, planner: Planner) -> tuple[Plan, _Option] | None:
    """Each option's plan under its budget; the one with the lowest modeled step (None: none fits).
    Options are solved in order with the best step so far as their cutoff. An option whose last
    solve is not stale keeps its result: on a 70B problem one budgeted solve takes seconds."""
    best: tuple[Plan, _Option] | None = None
    for option in options:
        cutoff = None if best is None else best[0].step_time_s
        if option.solved is None or option.solved.stale(option.budget, cutoff):
            option.solved = _solve_option(option, cutoff, steps, planner)
            if option.solved.cut is not None:
                assert best is not None and cutoff is not None  # only a cutoff (the best's step) cuts
                log.info(
                    "autoshard: memory fit: no %s plan under a budget of %s beats the %s plan's %.1f ms",
                    option.mode,
                    size_text(option.budget),
                    best[1].mode,
                    1e3 * cutoff,
                )
        candidate = option.solved.plan
        if candidate is not None and (best is None or candidate.step_time_s < best[0].step_time_s):
            best = (candidate, option)
    return best


def _solve_option(option: _Option, cutoff: float | None, steps: FitSteps, planner: Planner) -> _Solved:
    """One option under its budget and the cutoff: first without the budget (kept across
    budgets), whose optimum bounds the budgeted one from below and is it when it fits."""
    budget, sp = option.budget, option.sharding
    if option.ahead is not None:
        option.unbudgeted = _waited(option.ahead, None)
        option.ahead = None
    free = option.unbudgeted
    if cutoff is not None and (free is None or (free.cut is not None and cutoff > free.cut)):
        free = option.unbudgeted = _waited(steps.start(sp.problem, cutoff), cutoff)
    if free is not None:
        if free.solution is None and free.cut is None:  # infeasible without the budget: with it too
            return _Solved(budget, None)
        if free.solution is None and cutoff is not None:  # cut under a cutoff up to this one
            return _Solved(budget, None, free.cut)
        if free.solution is not None and cutoff is not None and free.solution.stats.bound >= cutoff:
            return _Solved(budget, None, free.solution.stats.bound)
        if free.solution is not None and modeled_bytes(option.table, free.solution.choice) <= budget:
            return _Solved(budget, decode(sp, free.solution, planner))
    started, option.started = option.started, None
    if started is None or started[0] != budget or cutoff is not None:  # it answers this budget without a cutoff
        started = (budget, steps.start(with_peak_budget(sp, option.table, budget), cutoff))
    try:
        return _Solved(budget, decode(sp, started[1](), planner))
    except solver.InfeasibleError:
        return _Solved(budget, None)
    except solver.NoBetterError as err:
        return _Solved(budget, None, _proven(err, cutoff))


def _waited(wait: Callable[[], solver.Solution], cutoff: float | None) -> _Unbudgeted:
    """An option's solve without the budget, once it is done."""
    try:
        return _Unbudgeted(wait())
    except solver.InfeasibleError:
        return _Unbudgeted(None)
    except solver.NoBetterError as err:
        return _Unbudgeted(None, _proven(err, cutoff))


def _proven(err: solver.NoBetterError, cutoff: float | None) -> float:
    """The lower bound a cut proved: the LP's when the solver names it (at least the cutoff, often
    above it: the fit's cutoff rises as tighter budgets cost the best option more, and an option
    cut once stays cut until the cutoff passes this), else the cutoff itself."""
    if err.bound is not None:
        return err.bound
    assert cutoff is not None, "NoBetterError comes only from a solve under a cutoff"
    return cutoff


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


def _remedies(sharding: ShardingProblem) -> str:
    """What a user can change when nothing fits (bf16 only for a run not already computing in it)."""
    computes_16_bit = sharding.graph.precision.param_dtype not in (None, torch.float32, torch.float64)
    return "use more devices, a smaller batch or sequence" + (
        "" if computes_16_bit else ", or bf16 parameters (--param-dtype bf16)"
    )


def _no_fit_message(limit: float, smallest: DryRunResult, remedies: str) -> str:
    rank = max(smallest.ranks.values(), key=lambda m: m.peak_bytes)
    parts = sorted(
        (
            (getattr(rank, k), k)
            for k in ("activations", "gathered_params", "transient", "params", "optimizer", "grads")
        ),
        reverse=True,
    )
    largest = ", ".join(f"{k} {size_text(v)}" for v, k in parts[:3])
    return (
        f"no plan fits {size_text(limit)} per rank: the smallest peak reached is {size_text(smallest.peak_bytes)} "
        f"(largest: {largest}); {remedies}"
    )
