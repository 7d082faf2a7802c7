"""Gradient accumulation: several micro-batches per optimizer step, replicated gradients reduced once.

A replicated parameter's gradient is all-reduced (DDP's reduction), and a reduction is linear:
reducing the sum of K micro-batches' partial gradients once gives what K reductions summed give.
Lowering with `accumulate=True` (`hold_reductions`) gives each such reduction an accumulator input,
added to the partial gradient just before it. The program's held backward (`Program.held`, made
with `held_outputs` and `prune`) runs for every micro-batch but the last: it returns those sums
instead of reducing them. The ordinary backward runs last and reduces the sums of all K,
overlapped with its own compute as always. Gradients whose reduction also splits them
(reduce-scatter: sharded parameters, FSDP's) are reduced every micro-batch, as FSDP2 does by
default: holding them would need their unsharded size. Only reductions whose accumulator is no
larger than the gradient they produce are held.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import fx, nn

from autoshard.capture.precision import gradient_tail
from autoshard.pricing.planner import holds_for_accumulation, reduces
from autoshard.problem.plan import Plan
from autoshard.program.collectives import dim_order
from autoshard.program.modules import LOCAL_SHAPE, Redistribute

ACCUMULATOR = "autoshard_accumulator"  # node meta of an accumulator placeholder: its index


@dataclass(frozen=True)
class Accumulator:
    """One held reduction's running sum on this rank: its local shape, dtype and memory order
    (the traced partial gradient's, so that the sum is laid out as the value it replaces)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    order: tuple[int, ...] | None

    def zeros(self, device: torch.device | str) -> torch.Tensor:
        if self.order is None:
            return torch.zeros(self.shape, dtype=self.dtype, device=device)
        physical = torch.zeros([self.shape[d] for d in self.order], dtype=self.dtype, device=device)
        return physical.permute([self.order.index(d) for d in range(len(self.shape))])


@dataclass(frozen=True)
class HeldReductions:
    """What `hold_reductions` changed in the joint graph: per held reduction its accumulator
    placeholder and the sum the reduction now reads; the parameters whose gradients are held."""

    placeholders: list[fx.Node]
    sums: list[fx.Node]
    accumulators: list[Accumulator]
    params: frozenset[str]


def hold_reductions(plan: Plan, joint: fx.Graph, modules: dict[str, nn.Module]) -> HeldReductions:
    """Give every held gradient reduction of the local joint graph (before bucketing) an
    accumulator placeholder, added to its input. A parameter is held when every reduction of its
    gradient (into its sink or its tail: `gradient_tail`) can be (`holds_for_accumulation`);
    otherwise none of them is.
    Redistributions of its gradient that reduce nothing run every micro-batch before a held
    reduction, and once, in the last backward, after one."""
    graph = plan.graph
    output = next(iter(reversed(joint.nodes)))
    grad_of = dict(zip(output.args[0][1:], graph.trained))  # gradient redistribution -> FQN
    tail_of = {node.name: fqn for fqn, grad in graph.grads.items() for node in gradient_tail(grad)}
    reductions: dict[str, list[fx.Node]] = {}
    refused: set[str] = set()
    for node in joint.nodes:
        module = modules.get(node.target) if node.op == "call_module" else None
        if not isinstance(module, Redistribute) or not reduces(module.plan.src, module.plan.dst):
            continue
        fqn = grad_of.get(node) or tail_of.get(module.consumer)
        if fqn is None:
            continue
        if holds_for_accumulation(module.plan):
            reductions.setdefault(fqn, []).append(node)
        else:
            refused.add(fqn)
    placeholders: list[fx.Node] = []
    sums: list[fx.Node] = []
    accumulators: list[Accumulator] = []
    last = [n for n in joint.nodes if n.op == "placeholder"][-1]
    for fqn in sorted(reductions.keys() - refused):
        for node in reductions[fqn]:
            value = node.args[0]
            with joint.inserting_after(last):
                last = joint.placeholder(f"accumulated_{len(placeholders)}")
            last.meta[ACCUMULATOR] = len(placeholders)
            last.meta[LOCAL_SHAPE] = value.meta[LOCAL_SHAPE]
            with joint.inserting_before(node):
                total = joint.call_function(torch.ops.aten.add.Tensor, (value, last))
            total.meta.update({k: value.meta[k] for k in (LOCAL_SHAPE, "autoshard_source") if k in value.meta})
            node.replace_input_with(value, total)
            traced = value.meta["autoshard_source"].meta.get("val")
            placeholders.append(last)
            sums.append(total)
            accumulators.append(
                Accumulator(tuple(value.meta[LOCAL_SHAPE]), traced.dtype, dim_order(traced) if traced.dim() else None)
            )
    return HeldReductions(placeholders, sums, accumulators, frozenset(reductions.keys() - refused))


def prune(graph: fx.Graph) -> None:
    """Erase what the graph's output no longer needs (the held reductions and what only they
    fed); an op with side effects stays, with what it reads."""
    output = next(iter(reversed(graph.nodes)))
    roots = [output] + [n for n in graph.nodes if n.op == "call_function" and n.is_impure()]
    live: set[fx.Node] = set()
    stack = list(roots)
    while stack:
        n = stack.pop()
        if n not in live:
            live.add(n)
            stack.extend(n.all_input_nodes)
    for n in reversed(list(graph.nodes)):
        if n not in live and n.op != "placeholder":
            graph.erase_node(n)
    graph.lint()


def held_outputs(grads: list[fx.Node], names: list[str], held: HeldReductions) -> list[fx.Node]:
    """The held backward's outputs: the gradients of the parameters not held, the inputs'
    gradients (a pipeline stage's, after the parameters' in `grads`), then every sum."""
    return [g for g, fqn in zip(grads, names) if fqn not in held.params] + grads[len(names) :] + held.sums
