"""Find the repeated steps of loops unrolled into a joint graph, so the ILP solves one step for all.

A Python loop over time (Mamba's selective scan, an RNN cell, chunked attention) traces into the
same few ops again and again, in graph order, inside one module: module paths cannot tell its
steps apart the way they tell transformer blocks apart (`regions.find_repeated_blocks`). Here the
graph's ops, in order, are read as a sequence of labels (op, output shapes and dtypes, module path,
arguments with integers blanked, since a step's index is one) and its tandem repeats are found:
runs where the sequence repeats with a period P, at least `MIN_STEPS` times, and each step reads
what the step before computed (a loop carries state: Mamba's scan its hidden state, a backward its
accumulated gradients; ops that merely look alike, such as the two halves of a rotary slice, do
not). Positions where the steps are wired differently (inputs from the same step, the step before,
or outside) are dropped, so what is tied is a position that plays the same part in every step.

Tying positions of steps is a restriction the ILP accepts for speed, as it does for blocks: every
step takes the same layout, which is what a loop runs with anyway (its carried state cannot change
layout between steps without a redistribution each step).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from torch import fx

from autoshard.capture.regions import flat_args
from autoshard.capture.trace import JointGraph

MIN_STEPS = 4  # fewer repeats are not a loop worth tying (two adjacent transposes repeat too)
MAX_PERIOD = 512  # ops in one step at most


@dataclass(frozen=True)
class _Run:
    start: int  # index of the first op of the first step, in the sequence of ops
    period: int  # ops per step
    steps: int

    @property
    def end(self) -> int:
        return self.start + self.period * self.steps


def find_repeated_steps(graph: JointGraph) -> list[list[list[fx.Node]]]:
    """Groups of >= MIN_STEPS consecutive, positionally alike runs of ops; each group is a list of
    steps (node lists of equal length, position i of every step playing the same part)."""
    ops = [n for n in graph.nodes if n.op == "call_function"]
    if len(ops) < 2 * MIN_STEPS:
        return []
    labels: dict[tuple, int] = {}
    sequence = np.array([labels.setdefault(_label(graph, n), len(labels)) for n in ops])
    groups = []
    taken: list[_Run] = []
    # the runs that save the most variables first ((steps - 1) x period), the shortest period among
    # equals (a loop of period P also repeats with period 2P), none overlapping one taken
    for run in sorted(_runs(sequence), key=lambda r: (-(r.steps - 1) * r.period, r.period, r.start)):
        if any(run.start < t.end and t.start < run.end for t in taken):
            continue
        steps = [ops[run.start + k * run.period : run.start + (k + 1) * run.period] for k in range(run.steps)]
        kept = _alike_positions(steps)
        if kept:
            taken.append(run)
            groups.append([[step[i] for i in kept] for step in steps])
    return groups


def _label(graph: JointGraph, node: fx.Node) -> tuple:
    """What the i-th ops of two steps share: op, outputs, module path, arguments but integers."""
    val = node.meta.get("val")
    outputs = tuple(
        (tuple(v.shape), str(v.dtype))
        for v in (val if isinstance(val, (tuple, list)) else [val])
        if hasattr(v, "shape")
    )
    args = tuple(
        "node" if isinstance(a, fx.Node) else "int" if isinstance(a, int) and not isinstance(a, bool) else repr(a)
        for a in flat_args(node)
    )
    return str(node.target), outputs, graph.module_path(node), args


def _runs(sequence: np.ndarray) -> list[_Run]:
    """Every maximal tandem repeat of `sequence` with at least MIN_STEPS steps, for each period."""
    found = []
    for period in range(1, min(MAX_PERIOD, len(sequence) // MIN_STEPS) + 1):
        same = np.concatenate([[False], sequence[:-period] == sequence[period:], [False]])
        edges = np.flatnonzero(np.diff(same.astype(np.int8)))
        for begin, stop in zip(edges[::2], edges[1::2]):  # [begin, stop): sequence[i] == sequence[i + period]
            steps = (stop - begin) // period + 1
            if steps >= MIN_STEPS:
                found.append(_Run(int(begin), period, int(steps)))
    return found


def _alike_positions(steps: list[list[fx.Node]]) -> list[int]:
    """Positions whose inputs come from the same places in every step: the same position of this
    step, of the step before, or from outside the loop (the first step's 'step before' is outside);
    none when no kept position reads the step before (nothing is carried: not a loop)."""
    where = {node: (k, i) for k, step in enumerate(steps) for i, node in enumerate(step)}

    def wiring(k: int, node: fx.Node, first: bool) -> tuple:
        out = []
        for arg in flat_args(node):
            if not isinstance(arg, fx.Node):
                continue
            at = where.get(arg)
            if at is not None and at[0] == k:
                out.append(("this", at[1]))
            elif at is not None and at[0] == k - 1 and not first:
                out.append(("before", at[1]))
            else:
                out.append(("outside",))
        return tuple(out)

    kept, carried = [], False
    for i in range(len(steps[0])):
        later = {wiring(k, steps[k][i], first=False) for k in range(1, len(steps))}
        if len(later) != 1:
            continue
        (shared,) = later
        first = wiring(0, steps[0][i], first=True)
        if first == tuple(("outside",) if w[0] == "before" else w for w in shared):
            kept.append(i)
            carried = carried or any(w[0] == "before" for w in shared)
    return kept if carried else []
