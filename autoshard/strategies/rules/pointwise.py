"""Elementwise ops DTensor's registries lack (T5's `_shift_right` writes, Mamba's softplus
backward): each output element depends on the same element of its inputs, so any layout that
does not leave a partial sum works, the inputs in the output's layout."""

from __future__ import annotations

import torch

from autoshard.layout import Layout
from autoshard.strategies.call import OpCall
from autoshard.strategies.layouts import LayoutCache
from autoshard.strategies.rules.base import rule
from autoshard.strategies.strategy import Found

aten = torch.ops.aten


@rule(aten.softplus_backward.default, aten.copy.default, aten.fill.Tensor, aten.fill.Scalar)
def same_shape_elementwise(call: OpCall, layouts: LayoutCache) -> list[Found] | None:
    """Inputs of the output's shape take its layout; a 0-d input (fill's value) is whole on every
    rank. Inputs that broadcast otherwise are left to the registry (None)."""
    if len(call.out_vals) != 1 or call.out_vals[0] is None:
        return None
    shape = tuple(call.out_vals[0].shape)
    if any(t is not None and tuple(t.shape) not in (shape, ()) for t in call.in_vals):
        return None
    found, whole = [], Layout.replicate(len(call.mesh_shape))
    for lay in layouts(shape, allow_partial=False, all_orders=True):
        ins = tuple(None if t is None else lay if tuple(t.shape) == shape else whole for t in call.in_vals)
        found.append(((lay,), ins))
    return found


@rule(aten.lift_fresh_copy.default)
def fresh_constant(call: OpCall, layouts: LayoutCache) -> list[Found]:
    """A constant the forward made (`torch.tensor(...)`, a scalar written into a tensor): small,
    whole on every rank, as constants are planned."""
    return [call.replicated()]
