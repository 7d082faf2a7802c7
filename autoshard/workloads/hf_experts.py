"""Hugging Face mixture-of-experts layers as autoshard's routed-experts op.

transformers (5.x) runs an MoE model's experts through an interface (`ALL_EXPERTS_FUNCTIONS`)
chosen by `config._experts_implementation`. Its own implementations either loop over the experts
a batch reaches (data-dependent: no fixed-shape trace) or sort tokens into a grouped GEMM (one
op with no sharding rule: every rank would compute every expert). Registered here, `ROUTED`
passes the same weights to `autoshard_models`' op, which traces as one node per layer and which
the planner can run data, tensor or expert parallel. Experts of another form (biases, no gate,
transposed or interleaved weights, an activation other than SiLU) keep transformers' own.
"""

from __future__ import annotations

from typing import Any

import torch

ROUTED = "autoshard_routed_experts"


def _ours(experts: Any) -> bool:
    """Whether these experts are SwiGLU over [gate; up] stacked as [E, 2F, D], down [E, D, F]."""
    plain = experts.has_gate and not experts.has_bias and not experts.is_transposed
    plain = plain and getattr(experts, "is_concatenated", True) and not getattr(experts, "has_post_expert_norm", False)
    return plain and getattr(experts.config, "hidden_act", None) == "silu"


def routed_experts_forward(
    self: Any, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """transformers' experts forward, as `routed_experts` of the gate, up and down weights."""
    from transformers.integrations.moe import grouped_mm_experts_forward

    from autoshard_models.experts import routed_experts

    if not _ours(self):
        return grouped_mm_experts_forward(self, hidden_states, top_k_index, top_k_weights)
    width = self.gate_up_proj.shape[1] // 2
    gate, up = self.gate_up_proj[:, :width], self.gate_up_proj[:, width:]
    return routed_experts(hidden_states, top_k_weights, top_k_index, gate, up, self.down_proj)


def routed_experts_implementation() -> str:
    """The experts implementation `hf:` models train with (registered in transformers under
    `ROUTED`; registering again is harmless)."""
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register(ROUTED, routed_experts_forward)
    return ROUTED
