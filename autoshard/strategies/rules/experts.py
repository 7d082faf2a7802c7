"""Routed experts (`autoshard_models.experts`): the layouts of a mixture-of-experts layer.

Per mesh dim, one of:
- replicated: every rank routes every token through every expert;
- tokens split (data parallel): each rank its own tokens through all the experts;
- experts split by hidden width (tensor parallel): partial outputs, summed later;
- experts split by expert, tokens not: each rank only the pairs routed to its experts (partial);
- experts and tokens split (expert parallel): each rank sends its tokens to the ranks holding
  their experts and gets the results back (`program/experts.py` runs the all-to-alls; the
  pricing adds them, `pricing/experts.py`).
The gradient op mirrors them; its expert-weight gradients are partial where the tokens are split
and the experts are not.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from autoshard.layout import Layout, P, R, S, split_digits
from autoshard.strategies.call import OpCall
from autoshard.strategies.expand import expand
from autoshard.strategies.layouts import LayoutCache
from autoshard.strategies.rules.base import rule
from autoshard.strategies.strategy import Found
from autoshard_models.experts import routed_experts  # noqa: F401  (registers the ops)

EXPERTS = torch.ops.autoshard_models.routed_experts.default
EXPERTS_BACKWARD = torch.ops.autoshard_models.routed_experts_backward.default

# Per mesh dim: (tokens, expert weights w1/w3, w2, the output) for forward; the backward's
# gradients follow (gradient of tokens, routing weights, w1, w3, w2).
_FORWARD = [
    # y,     x,    weights, experts, w1,   w3,   w2
    [R, R, R, R, R, R, R],
    [S(0), S(0), S(0), S(0), R, R, R],
    [P(), R, R, R, S(1), S(1), S(2)],
    [P(), R, R, R, S(0), S(0), S(0)],
    [S(0), S(0), S(0), S(0), S(0), S(0), S(0)],
]
_BACKWARD = [
    # gx,  gweights, g1, g3,  g2,  | grad, x,    weights, experts, w1,  w3,   w2
    [R, R, R, R, R, R, R, R, R, R, R, R],
    [S(0), S(0), P(), P(), P(), S(0), S(0), S(0), S(0), R, R, R],
    [P(), P(), S(1), S(1), S(2), R, R, R, R, S(1), S(1), S(2)],
    [P(), P(), S(0), S(0), S(0), R, R, R, R, S(0), S(0), S(0)],
    [S(0), S(0), S(0), S(0), S(0), S(0), S(0), S(0), S(0), S(0), S(0), S(0)],
]


@rule(EXPERTS)
def routed_experts_forward(call: OpCall, layouts: LayoutCache) -> list[Found]:
    return expand(_FORWARD, len(call.mesh_shape), call.n_out)


@rule(EXPERTS_BACKWARD)
def routed_experts_backward(call: OpCall, layouts: LayoutCache) -> list[Found]:
    return expand(_BACKWARD, len(call.mesh_shape), call.n_out)


# Input slots of (tokens, expert weights w1) in each op.
SLOTS = {EXPERTS: (0, 3), EXPERTS_BACKWARD: (1, 4)}


@dataclass(frozen=True)
class ExpertSplit:
    """How a strategy of the experts ops splits the experts: `expert_dims`, the mesh dims that
    split them by expert (in shard order); `parallel_dims`, those of them that also split the
    tokens (ascending: the flattened group the all-to-alls run on); `local`, experts per rank."""

    expert_dims: tuple[int, ...]
    parallel_dims: tuple[int, ...]
    local: int
    mesh_shape: tuple[int, ...]

    @classmethod
    def of(cls, tokens: Layout, w1: Layout, n_experts: int, mesh_shape: Sequence[int]) -> ExpertSplit:
        expert_dims = dict(w1.order).get(0, ())
        token_dims = set(dict(tokens.order).get(0, ()))
        parallel = tuple(sorted(m for m in expert_dims if m in token_dims))
        pieces = math.prod([mesh_shape[m] for m in expert_dims])
        return cls(tuple(expert_dims), parallel, n_experts // pieces, tuple(mesh_shape))

    def first(self, coord: Sequence[int]) -> int:
        """The global index of the first expert the rank at `coord` holds."""
        piece = 0
        for m in self.expert_dims:
            piece = piece * self.mesh_shape[m] + coord[m]
        return piece * self.local

    def group_firsts(self, coord: Sequence[int]) -> list[int]:
        """`first` of each member of this rank's expert-parallel group, by group rank (row-major
        over `parallel_dims`, the coordinates on other dims this rank's)."""
        sizes = [self.mesh_shape[m] for m in self.parallel_dims]
        firsts = []
        for j in range(math.prod(sizes)):
            member = list(coord)
            for m, c in zip(self.parallel_dims, split_digits(j, sizes)):
                member[m] = c
            firsts.append(self.first(member))
        return firsts

    @property
    def group_size(self) -> int:
        return math.prod([self.mesh_shape[m] for m in self.parallel_dims])


def split_of(op: Any, inputs: Sequence[Layout | None], vals: Sequence[Any], mesh_shape: Sequence[int]) -> ExpertSplit:
    """The `ExpertSplit` of a strategy of `op` (its input layouts, the traced input values)."""
    tokens, w1 = SLOTS[op]
    return ExpertSplit.of(inputs[tokens], inputs[w1], vals[w1].shape[0], mesh_shape)
