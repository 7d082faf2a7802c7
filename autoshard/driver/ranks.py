"""Planning beside the other ranks of a process group: solve once, broadcast, check.

Every rank traces the step and builds the ILP (cheap and deterministic); rank 0 solves it, or takes
a saved solution made for the same problem (same fingerprint: graph, mesh, profiles, constraints),
and broadcasts the answer; every rank checks it traced the same problem, and in the end that it
holds the same plan. Fitting a memory limit goes the same way: rank 0 solves each budgeted problem
and dry-runs each candidate, every rank gets the results, so every rank decides alike. A failure
(infeasible constraints, a program that cannot run) is every rank's one `UsageError`, and any other
exception on rank 0 is raised on every rank (`on_rank_zero`), not rank 0's traceback and the
others' hang.

`AutoShard.optimize` plans this way by default inside a process group of more than one rank;
`train` always does (it also passes the solution of a `--plan-file`).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

import torch.distributed as dist

import autoshard_solver as solver
from autoshard.driver import limits
from autoshard.driver.fit import FitSteps
from autoshard.options import UsageError
from autoshard.problem.build import ShardingProblem
from autoshard.problem.plan import Plan
from autoshard.program.lower import Program, lower
from autoshard.runtime import dryrun
from autoshard.runtime.dryrun import DryRunError, DryRunResult

log = logging.getLogger("autoshard")

T = TypeVar("T")


def in_process_group() -> bool:
    """Inside a real process group of more than one rank (not the fake one that plans at scale)."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1 and dist.get_backend() != "fake"


def broadcast(value: Any) -> Any:
    """Rank 0's `value` on every rank."""
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def same_on_every_rank(what: str, value: str) -> None:
    """Every rank calls this: one error, raised alike everywhere, unless all ranks hold the same
    `value` (a fingerprint)."""
    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    if len(set(values)) != 1:
        raise UsageError(f"ranks {what} (fingerprints {values}); same code and inputs on every rank?")


class RankZeroFailed(RuntimeError):
    """Raised on every other rank when rank 0 failed in a step it runs for all of them."""


def on_rank_zero(work: Callable[[], T]) -> T:
    """Rank 0's `work()`, on every rank. An exception in `work` on rank 0 is raised on every
    rank, rank 0's own there and a `RankZeroFailed` naming it elsewhere: the other ranks would
    otherwise wait for rank 0's broadcast until the process group times out (30 minutes). An
    interrupt of rank 0 meanwhile (KeyboardInterrupt, a stop signal: not an `Exception`) is
    raised on every rank as it is: the others stop as rank 0 does, not on a broken connection."""
    outcome: tuple[str, Any] = ("", None)
    failure: BaseException | None = None
    if dist.get_rank() == 0:
        try:
            outcome = ("ok", work())
        except Exception as err:  # noqa: BLE001 - every rank must hear of it
            outcome, failure = ("failed", f"{type(err).__name__}: {err}"), err
        except BaseException as err:
            with contextlib.suppress(Exception):  # the others may be stopping too (one signal to all)
                broadcast(("interrupted", err))
            raise
    kind, payload = broadcast(outcome)
    if kind == "interrupted":
        raise payload
    if kind == "failed":
        if failure is not None:
            raise failure
        raise RankZeroFailed(f"rank 0 failed while planning for every rank: {payload}")
    return payload


@dataclass(frozen=True)
class SavedSolution:
    """A solution saved with the fingerprint of the problem it solves (plan.json), and where it
    came from (for messages)."""

    fingerprint: str
    solution: str  # Solution.to_json()
    source: str
    required: bool = True  # made for another problem: an error (else solved afresh)


def solution_hash(plan: Plan) -> str:
    return hashlib.sha256(plan.solution.to_json().encode()).hexdigest()[:16]


class RankZeroPlanning:
    """The solve, fit and dry-run steps of planning, run by rank 0 for every rank of the process
    group. `mesh`: the DeviceMesh the program is lowered on for dry runs."""

    def __init__(
        self, mesh: Any, *, saved: SavedSolution | None = None, backend: str = "auto", time_limit: float | None = None
    ):
        self.mesh = mesh
        self.saved = saved
        self.backend = backend
        self.time_limit = time_limit

    def _solve(self, problem: solver.Problem, diagnose: bool = True, cutoff: float | None = None) -> solver.Solution:
        return limits.solve(problem, backend=self.backend, time_limit=self.time_limit, diagnose=diagnose, cutoff=cutoff)

    def solve(self, sharding: ShardingProblem) -> solver.Solution:
        """Every rank calls this with the problem it built; rank 0's answer for all."""
        fingerprint = sharding.fingerprint()
        same_on_every_rank("traced different problems", fingerprint)

        def answer() -> tuple[str, str]:
            saved = self.saved
            if saved is not None and saved.fingerprint != fingerprint and not saved.required:
                log.info("autoshard: %s was made for another problem; solving", saved.source)
                saved = None
            if saved is not None and saved.fingerprint != fingerprint:
                return (
                    "error",
                    f"{saved.source} was made for another problem (fingerprint {saved.fingerprint}, "
                    f"this run's is {fingerprint}): different model, shapes, mesh, profiles or "
                    "constraints",
                )
            if saved is not None:
                try:
                    solver.Solution.from_json(saved.solution)
                except ValueError as e:
                    return ("error", f"{saved.source}: its solution is damaged ({e})")
                log.info("autoshard: reusing the solution in %s", saved.source)
                return ("ok", saved.solution)
            try:  # on a thread: rank 0 waits for it where a signal can interrupt it
                return ("ok", limits.in_background(lambda: self._solve(sharding.problem))().to_json())
            except ValueError as e:  # infeasible constraints: a usage error on every rank
                return ("error", str(e))

        kind, payload = on_rank_zero(answer)
        if kind == "error":
            raise UsageError(payload)
        return solver.Solution.from_json(payload)

    def solve_problem(
        self, problem: solver.Problem, cutoff: float | None = None, *, diagnose: bool = True
    ) -> solver.Solution:
        """Rank 0 solves `problem` for every rank (InfeasibleError on every rank when nothing is
        feasible; `diagnose=False` skips finding out why, for callers that expect it;
        NoBetterError on every rank when nothing costs less than `cutoff`)."""
        return self.start_problem(problem, cutoff, diagnose=diagnose)()

    def start_problem(
        self,
        problem: solver.Problem,
        cutoff: float | None = None,
        *,
        diagnose: bool = True,
        gate: threading.Semaphore | None = None,
    ) -> Callable[[], solver.Solution]:
        """`solve_problem`, with rank 0 solving beside the caller (once `gate` lets it): every rank
        calls what this returns, in the same order as the other ranks, for rank 0's answer."""
        if dist.get_rank() == 0:
            outcome = limits.in_background(lambda: self._outcome(problem, cutoff, diagnose), gate)
        else:

            def outcome() -> tuple[str, str, float | None]:
                raise AssertionError("only rank 0 solves")  # never called: on_rank_zero runs it on rank 0

        return lambda: self._answer(outcome)

    def _outcome(self, problem: solver.Problem, cutoff: float | None, diagnose: bool) -> tuple[str, str, float | None]:
        """Rank 0's solve as something to broadcast: the solution, or which error and why."""
        try:
            return ("ok", self._solve(problem, diagnose, cutoff).to_json(), None)
        except solver.InfeasibleError as err:
            return ("infeasible", str(err), None)
        except solver.NoBetterError as err:
            return ("no better", str(err), err.bound)
        except limits.TimeLimitError as err:  # every rank's one error line
            return ("usage", str(err), None)

    @staticmethod
    def _answer(outcome: Callable[[], tuple[str, str, float | None]]) -> solver.Solution:
        """Rank 0's `outcome()` on every rank, as the solution or the error it names."""
        kind, payload, bound = on_rank_zero(outcome)
        if kind == "infeasible":
            raise solver.InfeasibleError(payload)
        if kind == "no better":
            raise solver.NoBetterError(payload, bound)
        if kind == "usage":
            raise limits.TimeLimitError(payload)
        return solver.Solution.from_json(payload)

    def fit_steps(self, dry_runs: bool = True) -> FitSteps:
        """The memory fit's solves and dry runs, with the same result on every rank: rank 0 solves
        each budgeted problem beside the fit and broadcasts the solution (or that none fits);
        every rank lowers a candidate (lowering may create flattened groups, a collective) and gets
        rank 0's dry run. `dry_runs=False`: none (the fit checks the modeled peak alone)."""
        gate = threading.Semaphore(limits.AT_ONCE)

        def start(problem: solver.Problem, cutoff: float | None) -> Callable[[], solver.Solution]:
            return self.start_problem(problem, cutoff, diagnose=False, gate=gate)

        return FitSteps(start, (lambda plan: self.dry_run(lower(plan, self.mesh), plan)) if dry_runs else None)

    def dry_run(self, program: Program, plan: Plan) -> DryRunResult:
        """Every rank calls this with its program of `plan`: rank 0 dry-runs its own (fake tensors:
        no memory, no communication; every rank holds the same local shapes) and every rank gets
        the result."""

        def outcome() -> tuple[str, Any]:
            start = time.perf_counter()
            try:
                result = DryRunResult(plan.mesh_shape, {0: dryrun.estimate(program, 0, plan.module_paths)})
            except DryRunError as err:
                return ("error", err.line)
            result.seconds = time.perf_counter() - start
            return ("ok", result)

        kind, payload = on_rank_zero(outcome)
        if kind == "error":
            raise UsageError(f"the planned program cannot run: {payload}")
        return payload

    @staticmethod
    def agree(sharding: ShardingProblem, plan: Plan) -> None:
        """Every rank holds the same problem and solution (one error on every rank otherwise)."""
        same_on_every_rank("planned different plans", sharding.fingerprint() + solution_hash(plan))
