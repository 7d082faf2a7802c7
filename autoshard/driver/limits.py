"""Solving under the user's `--time-limit`. A solve that the limit stopped before the solver had any
solution is the user's to fix (a larger limit): one `TimeLimitError` line, raised where the solve
runs (rank 0 hands it to every rank as it does infeasible constraints). Without a limit, the solver
stopping without a solution is the solver's failure: its own error, with its traceback. Solves run
beside their caller (`in_background`): HiGHS leaves Python's lock while it solves."""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Iterator, TypeVar

import autoshard_solver as solver
from autoshard.options import UsageError

T = TypeVar("T")


class TimeLimitError(UsageError):
    """The --time-limit ran out before the solver found any solution."""


@contextlib.contextmanager
def within_time_limit(time_limit: float | None) -> Iterator[None]:
    """Solves inside raise TimeLimitError, not SolveError, when `time_limit` stopped them."""
    try:
        yield
    except solver.SolveError:
        if time_limit is None:
            raise
        raise TimeLimitError(
            f"the solver stopped at --time-limit {time_limit:g} s without any solution; give it a larger --time-limit"
        ) from None


def solve(problem: solver.Problem, *, backend: str, time_limit: float | None, **kwargs: Any) -> solver.Solution:
    """`solver.solve`, with a solve the time limit stopped without a solution a TimeLimitError."""
    with within_time_limit(time_limit):
        return solver.solve(problem, backend=backend, time_limit=time_limit, **kwargs)


AT_ONCE = 2  # solves at once (the memory fit's: the asked option's budgeted one and one started ahead)


def in_background(work: Callable[[], T], gate: threading.Semaphore | None = None) -> Callable[[], T]:
    """Start `work` on a thread of its own (once `gate` lets it); the call returned waits for it
    and returns its result or raises its exception. A daemon thread: a solve nobody waits for
    (the fit failed, a signal stopped the wait: a join is interruptible, a solve in C is not)
    does not hold the process at exit."""
    outcome: list = []

    def run() -> None:
        with gate if gate is not None else contextlib.nullcontext():
            try:
                outcome.append((True, work()))
            except BaseException as err:  # noqa: BLE001 - raised again by the waiter
                outcome.append((False, err))

    thread = threading.Thread(target=run, name="autoshard-solve", daemon=True)
    thread.start()

    def wait() -> T:
        thread.join()
        ok, value = outcome[0]
        if not ok:
            raise value
        return value

    return wait


def solving_here(
    backend: str = "auto", time_limit: float | None = None
) -> Callable[..., Callable[[], solver.Solution]]:
    """`FitSteps.start` for solving in this process: each solve on a thread of its own, `AT_ONCE`
    at a time (their presolves and model building hold Python's lock: more at once would slow the
    one the fit waits for first)."""
    gate = threading.Semaphore(AT_ONCE)
    return lambda problem, cutoff: in_background(
        lambda: solve(problem, backend=backend, time_limit=time_limit, diagnose=False, cutoff=cutoff), gate
    )
