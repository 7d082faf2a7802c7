"""The backward in two halves, for zero-bubble pipeline schedules: `input` computes what the
previous stage waits for (the gradients of the stage's inputs) and hands over what the rest
reads; `weight` computes the parameters' gradients (and reduces them) from that, later, where
the schedule has a bubble to fill.

The halves are cut from one backward whose outputs are every gradient (and, lowered to
accumulate, every held reduction's sum): `input` is what the inputs' gradients depend on, with
the items of any of its tuples (a bucket's, a multi-output op's) read there too, so that only
tensors are handed over; `weight` is every other node. A value both halves read is computed
once, in `input`. A first stage (whose input, the tokens, takes no gradient) has an empty
`input` half that hands its saved values on.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

from torch import fx

from autoshard.program.accumulate import ACCUMULATOR, prune


@dataclass(frozen=True)
class Halves:
    """`input(*saved, tangent) -> (*input grads, *handed)`; `weight(*handed, *accumulated) ->
    the backward's parameter gradients`; lowered to accumulate, `weight_held(*handed,
    *accumulated) -> (*gradients of the parameters not held, *sums)`."""

    input: fx.GraphModule
    weight: fx.GraphModule
    weight_held: fx.GraphModule | None


def halves(backward: fx.Graph, n_params: int, n_inputs: int, held: list[int] | None) -> list[fx.Graph]:
    """Cut `backward` (outputs: `n_params` parameter gradients, `n_inputs` input gradients, then
    the held reductions' sums) into [input, weight] (and, with `held`, weight_held: `held` are
    the positions of the parameters whose gradients are held)."""
    placeholders = [n for n in backward.nodes if n.op == "placeholder"]
    accumulators = [n for n in placeholders if ACCUMULATOR in n.meta]
    primals = [n for n in placeholders if ACCUMULATOR not in n.meta]
    outputs = list(next(iter(reversed(backward.nodes))).args[0])
    params, inputs, sums = outputs[:n_params], outputs[n_params : n_params + n_inputs], outputs[n_params + n_inputs :]
    first = _ancestors(inputs)
    for n in backward.nodes:  # an item of a tuple `input` makes is read there
        if n.op == "call_function" and n.target is operator.getitem and n.args[0] in first:
            first.add(n)
    rest = [n for n in backward.nodes if n.op not in ("placeholder", "output") and n not in first]
    read = {a for n in rest for a in n.all_input_nodes} | set(params) | set(sums)
    handed = [n for n in backward.nodes if n in read and (n in first or n in primals)]
    graphs = [subgraph(primals, [n for n in backward.nodes if n in first], [*inputs, *handed])]
    graphs.append(subgraph([*handed, *accumulators], rest, params))
    if held is not None:
        kept = [g for i, g in enumerate(params) if i not in held]
        graphs.append(subgraph([*handed, *accumulators], rest, [*kept, *sums]))
    for g in graphs[1:]:
        prune(g)
    return graphs


def _ancestors(values: list[fx.Node]) -> set[fx.Node]:
    """The nodes `values` are computed from (themselves included), placeholders left out."""
    found: set[fx.Node] = set()
    stack = list(values)
    while stack:
        n = stack.pop()
        if n not in found and n.op != "placeholder":
            found.add(n)
            stack.extend(n.all_input_nodes)
    return found


def subgraph(inputs: list[fx.Node], nodes: list[fx.Node], outputs: list[fx.Node]) -> fx.Graph:
    """A graph of `nodes` (in order) reading `inputs` as placeholders, returning `outputs`."""
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for n in inputs:
        env[n] = g.placeholder(n.name)
        env[n].meta.update(n.meta)
    for n in nodes:
        env[n] = g.node_copy(n, env.__getitem__)
    g.output(tuple(env[n] for n in outputs))
    g.lint()
    return g
