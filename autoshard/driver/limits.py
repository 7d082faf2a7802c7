"""Solving under the user's `--time-limit`. A solve that the limit stopped before the solver had any
solution is the user's to fix (a larger limit): one `TimeLimitError` line, raised where the solve
runs (rank 0 hands it to every rank as it does infeasible constraints). Without a limit, the solver
stopping without a solution is the solver's failure: its own error, with its traceback."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import autoshard_solver as solver
from autoshard.options import UsageError


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
