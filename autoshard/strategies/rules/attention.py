"""Flash attention on CPU and its backward: DTensor has no strategy for them."""

from __future__ import annotations

import torch

from autoshard.layout import R, S
from autoshard.strategies.call import OpCall
from autoshard.strategies.expand import MeshDimRule, expand
from autoshard.strategies.layouts import LayoutCache
from autoshard.strategies.rules.base import rule
from autoshard.strategies.strategy import Found

aten = torch.ops.aten


@rule(
    aten._scaled_dot_product_flash_attention_for_cpu.default,
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
)
def flash_attention(call: OpCall, layouts: LayoutCache) -> list[Found]:
    """Tensors [b, h, s, d] and logsumexp [b, h, s]: shard batch or heads of everything, or
    replicate. Outputs are never partial: attention is nonlinear in its inputs. Sequence sharding
    is left out (causal masks would need position offsets)."""
    rules: list[MeshDimRule] = [[None if t is None else R for t in call.out_vals + call.in_vals]]
    for dim in (0, 1):  # batch, heads
        mesh_dim_rule = [S(dim) if t is not None else None for t in call.out_vals]
        for slot, t in zip(call.slots, call.in_vals):
            if t is None:
                mesh_dim_rule.append(None)
            elif call.node.kwargs.get("attn_mask") is slot:  # broadcast dims stay replicated
                mesh_dim_rule.append(S(dim) if t.dim() == 4 and t.shape[dim] > 1 else R)
            else:
                mesh_dim_rule.append(S(dim))
        rules.append(mesh_dim_rule)
    return expand(rules, len(call.mesh_shape), call.n_out)
