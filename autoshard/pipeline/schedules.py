"""torch.distributed.pipelining's schedules as the cost model sees them: which micro-batch counts
each accepts, how many micro-batches' activations a rank holds at its peak, and the step's time.

With chunk (virtual stage) j on pp rank j mod P, t_j its forward + backward of one micro-batch,
T_r the sum over rank r's chunks and v chunks per rank, a step of m micro-batches takes
m * max(T_r) + (sum(t_j) - max(T_r)) / v: for v = 1, Alpa's sum(t) + (m - 1) * max(t), GPipe and
1F1B alike; for even stages (P - 1) * t of bubble, or (P - 1) * t / v interleaved. What differs
between GPipe and 1F1B is memory: GPipe holds every micro-batch's activations at once, 1F1B
P - r on rank r, Interleaved 1F1B its warm-up's forwards (torch's `_get_warmup_ops`).
The zero-bubble schedule (torch's InterleavedZeroBubble, the paper's ZB-H1 for v = 1) runs the
part of each backward that only the weights' gradients need (W) where 1F1B idles: each chunk
adds t_j - d_j to the bubble, d_j = W + min(W, B) (`search.Stage.deferred_s`; B, the part the
chunk before waits for), so (P - 1)(F + B - W) for even stages against 1F1B's (P - 1)(F + B +
W), and never less than the forward that fills the pipeline; it holds no more activations than
1F1B (a warm-up of P - 1 - r).

Those formulas price each cut in the search. The schedules that interleave chunks order each
rank's work in ways a formula follows only roughly when micro-batches are few (torch's
InterleavedZeroBubble with 2 chunks per rank and as many micro-batches as ranks runs a rank's
first chunk's backward last), so a searched pipeline is then priced by `timeline_s`: torch's own
order of each rank's work, each piece started once the piece it waits for is done.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

Action = tuple[str, int, int]  # F, B, I or W (backward halves: input, weights); chunk; micro-batch


@dataclass(frozen=True)
class Schedule:
    """One of torch's schedules with `virtual` chunks per rank."""

    name: str  # GPipe, 1F1B, Interleaved1F1B, InterleavedZeroBubble: torch's class is `Schedule` + name
    virtual: int = 1

    @property
    def torch_class(self) -> str:
        return f"Schedule{self.name}"

    @property
    def zero_bubble(self) -> bool:
        return self.name == "InterleavedZeroBubble"

    def refuses(self, ranks: int, micro_batches: int) -> str | None:
        """Why torch's schedule would not run `micro_batches` over `ranks` pp ranks (None: it does)."""
        if self.name == "1F1B" and micro_batches < ranks:
            return f"1F1B needs at least as many micro-batches as stages ({ranks})"
        if self.name.startswith("Interleaved"):
            rounds = max(1, micro_batches // ranks)
            if micro_batches % rounds:
                return f"{self.name} needs the micro-batches to be a multiple of its rounds ({rounds})"
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
        factor = 1 if self.zero_bubble else 2
        warmup = min((v - 1) * per_round + factor * (ranks - 1 - rank), m * v)
        held = [0] * v
        for k in range(min(warmup + 1, m * v)):
            held[(k // per_round) % v] += 1
        return held

    def step_s(
        self, chunk_s: list[float], ranks: int, micro_batches: int, deferred_s: list[float] | None = None
    ) -> float:
        """The step's time (no once-a-step work) for these chunk times, chunk j on rank j mod P;
        `deferred_s`, of each chunk's time, what the zero-bubble schedule takes off the bubble."""
        share = list(chunk_s)
        if self.zero_bubble and deferred_s is not None:
            share = [t - d for t, d in zip(chunk_s, deferred_s)]
        per_rank = [sum(chunk_s[r::ranks]) for r in range(ranks)]
        slowest = max(range(ranks), key=per_rank.__getitem__)
        bubble = sum(share) - sum(share[slowest::ranks])
        return micro_batches * per_rank[slowest] + bubble / self.virtual


def schedules(ranks: int, max_virtual: int = 2) -> list[Schedule]:
    """The schedules the search weighs: 1F1B, Interleaved1F1B with 2..max_virtual chunks per
    rank, InterleavedZeroBubble with 1..max_virtual (none of these on one rank), and GPipe, in
    the order ties go (1F1B holds no more than GPipe)."""
    if ranks == 1:
        return [Schedule("1F1B"), Schedule("GPipe")]
    interleaved = [Schedule("Interleaved1F1B", v) for v in range(2, max_virtual + 1)]
    zero_bubble = [Schedule("InterleavedZeroBubble", v) for v in range(1, max_virtual + 1)]
    return [Schedule("1F1B"), *interleaved, *zero_bubble, Schedule("GPipe")]


def timeline_s(
    order: Sequence[Sequence[Action]], forward_s: Sequence[float], input_s: Sequence[float], weight_s: Sequence[float]
) -> float:
    """The step's time when each pp rank runs its actions in `order` one after another, each
    starting once its rank is free and what it waits for is done: a forward, the chunk before's
    forward of that micro-batch; a backward or its input half, the chunk's own forward and the
    next chunk's input half (the gradient it sends back); a weight half, its input half. A full
    backward takes both halves' time. Per chunk: `forward_s` (its sends included), `input_s`
    and `weight_s`."""
    last = len(forward_s) - 1
    done: dict[tuple[str, int, int], float] = {}
    clock = [0.0] * len(order)
    at = [0] * len(order)
    while True:
        moved = False
        for rank, actions in enumerate(order):
            while at[rank] < len(actions):
                kind, chunk, micro = actions[at[rank]]
                if kind == "F":
                    needs = [("F", chunk - 1, micro)] if chunk > 0 else []
                    took = forward_s[chunk]
                elif kind in ("B", "I"):
                    needs = [("F", chunk, micro)] + ([("I", chunk + 1, micro)] if chunk < last else [])
                    took = input_s[chunk] + (weight_s[chunk] if kind == "B" else 0.0)
                else:
                    needs, took = [("I", chunk, micro)], weight_s[chunk]
                if any(need not in done for need in needs):
                    break
                start = max([clock[rank], *(done[need] for need in needs)])
                clock[rank] = start + took
                done[("I" if kind == "B" else kind, chunk, micro)] = clock[rank]
                at[rank] += 1
                moved = True
        if not moved:
            break
    if any(a < len(actions) for a, actions in zip(at, order)):
        raise ValueError("the schedule's order waits on work it never runs")
    return max(clock)
