"""Where to cut the blocks into pipeline stages: a dynamic program over cut points (Alpa's
inter-operator pass) whose stage costs are sums of per-segment figures from solved plans.

Chunk j (a stage, or a virtual stage under an interleaved schedule) runs on pp rank j mod P and
holds a contiguous run of blocks, the first chunk also what runs before them and the last what
runs after. A chunk's time per micro-batch is its segments' time plus sending its output forward
and the gradient back; its memory is its state plus its in-flight micro-batches' activations
(`Schedule.in_flight`). Each chunk takes the fastest of the solved layout families (plans of the
whole model on the stage sub-mesh: free, fully sharded, with or without recomputation) that fits
the memory limit, so one stage may keep its activations while the first, which holds the most
micro-batches, recomputes them. The program minimizes the step's value over prefixes of chunks
(`Schedule.step_s` with each chunk's own time standing in for its rank's), then the chosen cut
is priced exactly: by the formula, or where torch's schedule keeps an order of every rank's work
(the interleaved ones), by that order (`schedules.timeline_s`). Chunks hold at most twice the
even share of blocks plus two, which keeps the search fast at 126 blocks and 16 chunks; a cut
more uneven than that is not searched.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Callable, Mapping, Sequence

from autoshard.pipeline.schedules import Action, Schedule, timeline_s
from autoshard.pipeline.segments import Segments


@dataclass(frozen=True)
class Link:
    """The pp dim's link: latency (s) and bandwidth (bytes/s) of one point-to-point send."""

    alpha: float
    beta: float

    def send_s(self, nbytes: float) -> float:
        return 0.0 if nbytes <= 0 else self.alpha + nbytes / self.beta


@dataclass(frozen=True)
class Stage:
    """One chunk of the pipeline, per rank of its sub-mesh."""

    chunk: int
    rank: int  # the pp rank that runs it
    first_block: int
    n_blocks: int
    before: bool  # holds what runs before the blocks (the embedding)
    after: bool  # holds what runs after them (the head and the loss)
    family: str  # the layout family its layouts come from
    micro_s: float  # forward + backward of one micro-batch, its sends included
    step_s: float  # once a step: held gradient reductions and the optimizer
    state_bytes: float
    act_bytes: float  # one micro-batch's handed-over values
    in_flight: int  # micro-batches whose activations it holds at its rank's peak
    send_bytes: float  # sent forward per micro-batch (and as much back)
    input_s: float = 0.0  # of micro_s, the backward the chunk before waits for
    weight_s: float = 0.0  # of micro_s, the backward a zero-bubble schedule runs apart (the
    # weights' gradients; for the first chunk, which sends no gradient back, its whole backward)

    @property
    def deferred_s(self) -> float:
        """How much less than micro_s the chunk adds to a zero-bubble schedule's bubble: the
        weights' part of its drain, and as much of its input part as that part covers (never
        below its forward: the fill waits for it)."""
        return self.weight_s + min(self.weight_s, self.input_s)

    @property
    def memory_bytes(self) -> float:
        return self.state_bytes + self.in_flight * self.act_bytes


@dataclass(frozen=True)
class Pipeline:
    """A cut, a schedule and a micro-batch count, priced."""

    schedule: Schedule
    ranks: int
    micro_batches: int
    rows: int  # rows (sequences) of one micro-batch, over the whole sub-mesh
    stages: tuple[Stage, ...]
    # torch's order of each rank's work under this schedule (`schedules.timeline_s`), where the
    # step is priced by it rather than by the schedule's formula
    order: tuple[tuple[Action, ...], ...] | None = field(default=None, repr=False)

    @property
    def rank_micro_s(self) -> list[float]:
        return [sum(s.micro_s for s in self.stages if s.rank == r) for r in range(self.ranks)]

    @property
    def pipelined_s(self) -> float:
        if self.order is not None:
            forward = [s.micro_s - s.input_s - s.weight_s for s in self.stages]
            return timeline_s(self.order, forward, [s.input_s for s in self.stages], [s.weight_s for s in self.stages])
        micro, deferred = [s.micro_s for s in self.stages], [s.deferred_s for s in self.stages]
        return self.schedule.step_s(micro, self.ranks, self.micro_batches, deferred)

    @property
    def once_s(self) -> float:
        return max(sum(s.step_s for s in self.stages if s.rank == r) for r in range(self.ranks))

    @property
    def step_time_s(self) -> float:
        return self.pipelined_s + self.once_s

    @property
    def bubble_s(self) -> float:
        """The step's time beyond the busiest rank's own work."""
        return self.pipelined_s - self.micro_batches * max(self.rank_micro_s)

    def rank_bytes(self, rank: int) -> float:
        return sum(s.memory_bytes for s in self.stages if s.rank == rank)

    @property
    def peak_bytes(self) -> float:
        return max(self.rank_bytes(r) for r in range(self.ranks))

    @property
    def blocks(self) -> list[int]:
        return [s.n_blocks for s in self.stages]


class _Prices:
    """Chunk prices from prefix sums of each family's segments, each computed once."""

    def __init__(self, families: Mapping[str, Segments], link: Link):
        self.families = dict(families)
        self.link = link
        first = next(iter(self.families.values()))
        self.n = first.n_blocks
        self.sums = {}
        self.known: dict[tuple, list[tuple[str, tuple[float, ...]]]] = {}
        for name, segs in self.families.items():
            if segs.n_blocks != self.n:
                raise ValueError(f"family {name}: {segs.n_blocks} blocks, others {self.n}")
            table = []
            for column in ("micro_s", "step_s", "state_bytes", "act_bytes", "input_s", "weight_s"):
                acc = [0.0]
                for seg in segs.items[1:-1]:
                    acc.append(acc[-1] + getattr(seg, column))
                table.append(acc)
            self.sums[name] = table

    def chunk(self, family: str, start: int, stop: int, before: bool, after: bool) -> tuple[float, ...]:
        """(micro_s, step_s, state, act, send bytes, input_s, weight_s) of blocks [start, stop) in
        `family`."""
        segs, sums = self.families[family].items, self.sums[family]
        micro, step, state, act, inputs, weight = (acc[stop] - acc[start] for acc in sums)
        for seg, holds in ((segs[0], before), (segs[-1], after)):
            if holds:
                micro, step = micro + seg.micro_s, step + seg.step_s
                state, act = state + seg.state_bytes, act + seg.act_bytes
                inputs, weight = inputs + seg.input_s, weight + seg.weight_s
        if before:  # the first chunk sends no gradient back: all its backward can wait
            inputs, weight = 0.0, weight + inputs
        send = 0.0 if after else segs[stop].out_bytes  # block stop-1 is segment `stop`
        return micro + 2 * self.link.send_s(send), step, state, act, send, inputs, weight

    def options(self, start: int, stop: int, before: bool, after: bool) -> list[tuple[str, tuple[float, ...]]]:
        """Every family's chunk prices for these blocks, fastest first."""
        key = (start, stop, before, after)
        found = self.known.get(key)
        if found is None:
            found = sorted(
                ((f, self.chunk(f, start, stop, before, after)) for f in self.families), key=lambda o: o[1][0]
            )
            self.known[key] = found
        return found

    def stage(self, chunk: int, ranks: int, held: int, start: int, stop: int, last: int, limit: float) -> Stage | None:
        """The fastest family's Stage for this chunk that fits `limit` (None: none fits)."""
        for family, (micro, step, state, act, send, *halves) in self.options(start, stop, chunk == 0, chunk == last):
            if state + held * act <= limit:
                before, after = chunk == 0, chunk == last
                return Stage(
                    chunk,
                    chunk % ranks,
                    start,
                    stop - start,
                    before,
                    after,
                    family,
                    micro,
                    step,
                    state,
                    act,
                    held,
                    send,
                    *halves,
                )
        return None


@dataclass(frozen=True)
class Run:
    """What every cut of one search shares: the pp ranks, the micro-batches and their rows, the
    pp link, and the memory limit per rank."""

    ranks: int
    micro_batches: int
    rows: int  # rows (sequences) of one micro-batch, over the whole sub-mesh
    link: Link
    limit: float


class _Cuts:
    """Cuts of the blocks into chunks under one schedule, priced."""

    def __init__(self, prices: _Prices, schedule: Schedule, run: Run):
        self.prices, self.schedule, self.run = prices, schedule, run
        self.chunks = run.ranks * schedule.virtual
        per_rank = [schedule.in_flight(r, run.ranks, run.micro_batches) for r in range(run.ranks)]
        self.held = [per_rank[j % run.ranks][j // run.ranks] for j in range(self.chunks)]
        self.share = run.limit / schedule.virtual  # each chunk under its rank's share

    def stage(self, chunk: int, start: int, stop: int) -> Stage | None:
        if stop <= start:
            return None
        return self.prices.stage(chunk, self.run.ranks, self.held[chunk], start, stop, self.chunks - 1, self.share)

    def at(self, starts: Sequence[int]) -> Pipeline | None:
        """The cut whose chunk j starts at block starts[j] (None: a chunk is empty or fits in no family)."""
        stages = []
        for j, (start, stop) in enumerate(zip(starts, [*starts[1:], self.prices.n])):
            stage = self.stage(j, start, stop)
            if stage is None:
                return None
            stages.append(stage)
        return self.pipeline(stages)

    def pipeline(self, stages: Sequence[Stage]) -> Pipeline:
        run = self.run
        return Pipeline(self.schedule, run.ranks, run.micro_batches, run.rows, tuple(stages))

    def best(self) -> Pipeline | None:
        """The dynamic program's cut, improved (`improved`); None when no cut fits."""
        chunks, n = self.chunks, self.prices.n
        if n < chunks:
            return None
        longest = min(n - chunks + 1, 2 * math.ceil(n / chunks) + 2)
        m, v = self.run.micro_batches, self.schedule.virtual
        # per chunk count: blocks covered -> (value, slowest, its bubble share, the bubble
        # shares' total, the previous cover, the stage); a chunk's bubble share is its time, less
        # what a zero-bubble schedule defers (`Schedule.step_s`)
        layers: list[dict[int, tuple[float, float, float, float, int, Stage]]] = []
        best: dict[int, tuple[float, float, float, float]] = {0: (0.0, 0.0, 0.0, 0.0)}
        deferring = self.schedule.zero_bubble
        for j in range(chunks):
            grown: dict[int, tuple[float, float, float, float, int, Stage]] = {}
            high = n - (chunks - 1 - j)  # leave a block for every chunk after this one
            for start, (_, slowest, slowest_share, total) in best.items():
                stops = [n] if j == chunks - 1 else range(start + 1, min(high, start + longest) + 1)
                for stop in stops:
                    stage = self.stage(j, start, stop) if stop - start <= longest else None
                    if stage is None:
                        continue
                    share = stage.micro_s - (stage.deferred_s if deferring else 0.0)
                    s, s_share = (stage.micro_s, share) if stage.micro_s > slowest else (slowest, slowest_share)
                    t = total + share
                    key = m * s + (t - s_share) / v
                    if stop not in grown or key < grown[stop][0]:
                        grown[stop] = (key, s, s_share, t, start, stage)
            layers.append(grown)
            best = {stop: entry[:4] for stop, entry in grown.items()}
        if n not in best:
            return None
        stages, stop = [], n
        for grown in reversed(layers):
            entry = grown[stop]
            stages.append(entry[5])
            stop = entry[4]
        return self.improved(self.pipeline(stages[::-1]))

    def improved(self, pipeline: Pipeline) -> Pipeline:
        """`pipeline` with single blocks moved from one chunk to another (the chunks between them
        shifted a block along) while the exact step gets faster: the program prices a chunk by its
        own time, which an interleaved rank's sum of chunks (and the once-a-step work) only
        approximates."""
        starts = [s.first_block for s in pipeline.stages]
        better = True
        while better:
            better = False
            for giver in range(len(starts)):
                for taker in range(len(starts)):
                    if giver == taker:
                        continue
                    low, high, step = (giver, taker, -1) if giver < taker else (taker, giver, 1)
                    moved = [start + step if low < k <= high else start for k, start in enumerate(starts)]
                    other = self.at(moved)
                    if other is not None and other.step_time_s < pipeline.step_time_s - 1e-12:
                        pipeline, starts, better = other, moved, True
        return pipeline

    def even(self) -> Pipeline | None:
        """torchtitan's split: the blocks with what runs before and after them counted as one
        block each, cut into equal shares."""
        chunks, n = self.chunks, self.prices.n
        bounds = [round(j * (n + 2) / chunks) for j in range(chunks)]
        return self.at([min(max(b - 1, 0), n) for b in bounds])  # unit 0 is the part before the blocks


def best_cut(families: Mapping[str, Segments], schedule: Schedule, run: Run) -> Pipeline | None:
    """The cheapest cut of the blocks into `run.ranks * schedule.virtual` chunks under the memory
    limit (each chunk in the fastest family that fits); None when no cut fits."""
    return _Cuts(_Prices(families, run.link), schedule, run).best()


Orders = Callable[[Schedule, int, int], tuple[tuple[Action, ...], ...] | None]  # (schedule, ranks, m) -> order


def even_cut(
    families: Mapping[str, Segments], schedule: Schedule, run: Run, orders: Orders | None = None
) -> Pipeline | None:
    """torchtitan's even split priced the same way (None when some chunk fits in no family)."""
    return _timed(_Cuts(_Prices(families, run.link), schedule, run).even(), orders)


def search(
    by_micro_batches: Mapping[int, tuple[int, Mapping[str, Segments]]],
    schedules: Sequence[Schedule],
    ranks: int,
    link: Link,
    limit: float,
    orders: Orders | None = None,
) -> list[Pipeline]:
    """Every (micro-batch count, schedule) that torch runs and some cut fits, each with its best
    cut, fastest first. `by_micro_batches`: micro-batch count -> (rows per micro-batch, families).
    `orders(schedule, ranks, m)`: torch's order of each rank's work, where it keeps one; the cut
    found by the schedule's formula is then priced by that order (`schedules.timeline_s`)."""
    found = []
    for m, (rows, families) in by_micro_batches.items():
        prices = _Prices(families, link)  # shared by the schedules
        for schedule in schedules:
            if schedule.refuses(ranks, m) is None:
                cut = _timed(_Cuts(prices, schedule, Run(ranks, m, rows, link, limit)).best(), orders)
                if cut is not None:
                    found.append(cut)
    return sorted(found, key=lambda p: (p.step_time_s, p.peak_bytes))


def _timed(pipeline: Pipeline | None, orders: Orders | None) -> Pipeline | None:
    """`pipeline` priced by torch's order of its schedule, where there is one."""
    if pipeline is None or orders is None:
        return pipeline
    order = orders(pipeline.schedule, pipeline.ranks, pipeline.micro_batches)
    return pipeline if order is None else replace(pipeline, order=order)
