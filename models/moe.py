"""A llama3-style decoder whose feed-forward is a mixture of experts (Qwen3-MoE's, Mixtral's shape):
each token's router picks `top_k` of `n_experts` SwiGLU experts, dropless, weighted by its
renormalized softmax probabilities; an optional shared expert every token goes through. The
model returns `(logits, aux)`, `aux` the load-balancing loss averaged over the layers, which
`moe_loss` adds to the cross-entropy with the config's weight.

Expert weights are stacked per layer (`feed_forward.w1` [E, F, D], `w3` [E, F, D], `w2` [E, D, F])
and run by one op (`experts.routed_experts`).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from .configs import CONFIGS, MOE_CONFIGS, LlamaConfig, MoEConfig, get_config
from .experts import routed_experts
from .llama import Attention, FeedForward, RMSNorm, Transformer, build_model, cross_entropy_loss


class MoEFeedForward(nn.Module):
    """Router, routed experts and the optional shared expert: x [b, s, d] -> (y [b, s, d], aux)."""

    def __init__(self, cfg: MoEConfig):
        super().__init__()
        e, f, d = cfg.n_experts, cfg.expert_ffn, cfg.dim
        self.top_k = cfg.top_k
        self.router = nn.Linear(d, e, bias=False)
        self.w1 = nn.Parameter(torch.empty(e, f, d))
        self.w3 = nn.Parameter(torch.empty(e, f, d))
        self.w2 = nn.Parameter(torch.empty(e, d, f))
        self.shared = FeedForward(d, cfg.shared_ffn) if cfg.shared_ffn else None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, s, d = x.shape
        h = x.reshape(b * s, d)
        probs = F.softmax(self.router(h).float(), dim=-1)
        top, chosen = torch.topk(probs, self.top_k, dim=-1)
        top = top / top.sum(-1, keepdim=True)
        y = routed_experts(h, top, chosen, self.w1, self.w3, self.w2).view(b, s, d)
        if self.shared is not None:
            y = y + self.shared(x)
        return y, balance_loss(probs, chosen)


def balance_loss(probs: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    """Switch Transformer's load-balancing loss: E * sum_e (share of the routed pairs sent to e) *
    (mean router probability of e); 1 when balanced."""
    n_experts = probs.shape[-1]
    sent = torch.zeros_like(probs).scatter_add_(1, chosen, torch.ones_like(chosen, dtype=probs.dtype))
    return n_experts * (sent.mean(0) / chosen.shape[1] * probs.mean(0)).sum()


class MoEBlock(nn.Module):
    def __init__(self, cfg: MoEConfig):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = MoEFeedForward(cfg)

    def forward(self, x, cos, sin, mask, aux: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the next hidden states, `aux` plus this layer's load-balancing loss): carried from
        block to block like the hidden states, every block is wired alike."""
        h = x + self.attention(self.attention_norm(x), cos, sin, mask)
        y, balance = self.feed_forward(self.ffn_norm(h))
        return h + y, aux + balance


class MoETransformer(Transformer):
    """Token ids [batch, seq] -> (logits [batch, seq, vocab], load-balancing loss)."""

    block = MoEBlock

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None):  # type: ignore[override]
        h, cos, sin, mask = self.embed(tokens, positions)
        aux = torch.zeros((), device=h.device)
        for layer in self.layers:
            h, aux = layer(h, cos, sin, mask, aux)
        # the config's depth, not len(self.layers): planning traces a few blocks and unrolls the rest
        return self.output(self.norm(h)), aux / self.cfg.n_layers

    pipeline_stages = False  # its blocks return the carried aux loss too: no stages yet

    def pipeline_stage(self, start: int, stop: int):
        raise NotImplementedError("pipeline stages of a mixture-of-experts model are not implemented")


def moe_loss(outputs: tuple[torch.Tensor, torch.Tensor], targets: torch.Tensor, aux_loss_coef: float) -> torch.Tensor:
    """Cross-entropy of the logits plus the weighted load-balancing loss."""
    logits, aux = outputs
    return cross_entropy_loss(logits, targets) + aux_loss_coef * aux


def build_moe_model(cfg: MoEConfig, device: str | torch.device = "cpu", seed: int | None = 0) -> Transformer:
    """Build on `device`; on a real device, initialize it from `seed` (None: leave as built)."""
    return build_model(cfg, device, seed, MoETransformer)


def named_config(name: str) -> LlamaConfig:
    """A dense or mixture-of-experts config by name; unknown names raise ValueError listing both."""
    if name in MOE_CONFIGS:
        return MOE_CONFIGS[name]
    try:
        return get_config(name)
    except ValueError:
        raise ValueError(f"unknown model config {name!r}; valid names: {', '.join([*CONFIGS, *MOE_CONFIGS])}") from None


def build_any(cfg: LlamaConfig, device: str | torch.device = "cpu", seed: int | None = 0) -> Transformer:
    """`build_moe_model` for a mixture-of-experts config, `build_model` for a dense one."""
    return build_moe_model(cfg, device, seed) if isinstance(cfg, MoEConfig) else build_model(cfg, device, seed)


def training_loss(cfg: LlamaConfig) -> Callable[..., torch.Tensor]:
    """The loss of (model outputs, targets) a model of `cfg` trains on."""
    return partial(moe_loss, aux_loss_coef=cfg.aux_loss_coef) if isinstance(cfg, MoEConfig) else cross_entropy_loss
