"""torch.distributed.pipelining's schedules as the cost model sees them: which micro-batch counts
each accepts, how many micro-batches' activations a rank holds at its peak, and the step's time.

With chunk (virtual stage) j on pp rank j mod P, t_j its forward + backward of one micro-batch,
T_r the sum over rank r's chunks and v chunks per rank, a step of m micro-batches takes
m * max(T_r) + (sum(t_j) - max(T_r)) / v: for v = 1, Alpa's sum(t) + (m - 1) * max(t), GPipe and
1F1B alike; for even stages (P - 1) * t of bubble, or (P - 1) * t / v interleaved. What differs
between GPipe and 1F1B is memory: GPipe holds every micro-batch's activations at once, 1F1B
P - r on rank r, Interleaved 1F1B its warm-up's forwards (torch's `_get_warmup_ops`).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Schedule:
    """One of torch's schedules with `virtual` chunks per rank."""

    name: str  # GPipe, 1F1B, Interleaved1F1B: torch's class is `Schedule` + name
    virtual: int = 1

    @property
    def torch_class(self) -> str:
        return f"Schedule{self.name}"

    def refuses(self, ranks: int, micro_batches: int) -> str | None:
        """Why torch's schedule would not run `micro_batches` over `ranks` pp ranks (None: it does)."""
        if self.name == "1F1B" and micro_batches < ranks:
            return f"1F1B needs at least as many micro-batches as stages ({ranks})"
        if self.name == "Interleaved1F1B":
            rounds = max(1, micro_batches // ranks)
            if micro_batches % rounds:
                return f"Interleaved1F1B needs the micro-batches to be a multiple of its rounds ({rounds})"
        return None

    def in_flight(self, rank: int, ranks: int, micro_batches: int) -> list[int]:
        """Per local chunk of `rank` (in order), how many micro-batches' activations it holds at
        the rank's peak."""
        m, v = micro_batches, self.virtual
        if self.name == "GPipe":
            return [m]
        if self.name == "1F1B":
            return [min(m, ranks - rank)]
        per_round = m // max(1, m // ranks)
        warmup = min((v - 1) * per_round + 2 * (ranks - 1 - rank), m * v)
        held = [0] * v
        for k in range(min(warmup + 1, m * v)):
            held[(k // per_round) % v] += 1
        return held

    def step_s(self, chunk_s: list[float], ranks: int, micro_batches: int) -> float:
        """The step's time (no once-a-step work) for these chunk times, chunk j on rank j mod P."""
        per_rank = [sum(chunk_s[r::ranks]) for r in range(ranks)]
        slowest = max(per_rank)
        return micro_batches * slowest + (sum(chunk_s) - slowest) / self.virtual


def schedules(ranks: int, max_virtual: int = 2) -> list[Schedule]:
    """The schedules the search weighs: 1F1B, Interleaved1F1B with 2..max_virtual chunks per
    rank (none on one rank), and GPipe, in the order ties go (1F1B holds no more than GPipe)."""
    interleaved = [Schedule("Interleaved1F1B", v) for v in range(2, max_virtual + 1)] if ranks > 1 else []
    return [Schedule("1F1B"), *interleaved, Schedule("GPipe")]
