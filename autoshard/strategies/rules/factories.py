"""Fill-factory ops: tensors created with a constant, from no tensor input."""

from __future__ import annotations

import torch

from autoshard.strategies.call import OpCall
from autoshard.strategies.layouts import LayoutCache
from autoshard.strategies.rules.base import rule
from autoshard.strategies.strategy import Found

aten = torch.ops.aten


@rule(
    aten.full.default,
    aten.zeros.default,
    aten.ones.default,
    aten.empty.memory_format,
    aten.scalar_tensor.default,
    aten.empty_strided.default,
)
def fill_factory(call: OpCall, layouts: LayoutCache) -> list[Found] | None:
    """Constant-filled tensors can be created directly in any R/S layout (each rank makes its
    local shard), so the ILP is free to place them where their consumers want them."""
    if len(call.out_vals) != 1 or call.out_vals[0] is None:
        return None
    (out,) = call.out_vals
    return [((lay,), ()) for lay in layouts(out.shape, allow_partial=False, all_orders=True)]


@rule(aten.arange.default, aten.arange.start, aten.arange.start_step)
def arange(call: OpCall, layouts: LayoutCache) -> list[Found]:
    """Positions (Hugging Face decoders build theirs from `arange`): one value per sequence
    position, small, made whole on every rank. A shard would need rank-dependent bounds the
    lowered program does not rewrite; consumers that want one slice the replicated value for free."""
    return [call.replicated()]
