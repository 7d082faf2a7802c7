"""The loss: negative log-likelihood over a batch (and sequence) sharded across ranks."""

from __future__ import annotations

import torch

from autoshard.layout import P, R, S
from autoshard.strategies.call import OpCall
from autoshard.strategies.expand import expand
from autoshard.strategies.layouts import LayoutCache
from autoshard.strategies.rules.base import rule
from autoshard.strategies.strategy import Found

aten = torch.ops.aten
MEAN, SUM = 1, 2  # torch's Reduction values


@rule(aten.nll_loss_forward.default)
def nll_loss_forward(call: OpCall, layouts: LayoutCache) -> list[Found] | None:
    """Per mesh dim: replicated, or every non-class dim of the input sharded with the target's
    matching dim, each rank's mean (sum) loss pending an average (sum) and the total weight a sum.
    DTensor offers these for a mean loss up to torch 2.13 and none from 2.14 (its per-dim rules
    cover only sum and none): without them the whole loss, and the logits before it, would run
    replicated. An even split is what makes the average of the ranks' means the global mean;
    layouts only split evenly. Other reductions: DTensor's registry."""
    args = call.node.args
    reduction = args[3] if len(args) > 3 else MEAN
    if reduction not in (MEAN, SUM) or len(call.in_vals) < 2 or call.in_vals[0] is None:
        return None
    n_in = call.in_vals[0].dim()
    channel = 1 if n_in >= 2 else 0
    extra = [R] * (len(call.in_vals) - 2)  # a class weight: replicated
    rules = [[R, R, R, R, *extra]]
    for dim in range(n_in):
        if dim != channel:
            target_dim = dim if dim < channel else dim - 1
            rules.append([P("avg") if reduction == MEAN else P(), P(), S(dim), S(target_dim), *extra])
    return expand(rules, len(call.mesh_shape), call.n_out)
