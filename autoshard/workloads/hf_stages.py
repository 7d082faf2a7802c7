"""A Hugging Face decoder-only LM of Llama's layout (`model.embed_tokens`, `model.layers`,
`model.norm`, `model.rotary_emb`, `lm_head`: Llama, Qwen2, Mistral without a window, ...) split
into pipeline stages, as `Transformer.pipeline_stage` splits ours:

    result = plan_pipeline(hf_model, inputs, config, batch=..., loss_fn=logits_loss)
    run = apply_pipeline(DecoderStages(hf_model), result, mesh, inputs)

A stage keeps the model's parameter names (`model.layers.5.self_attn.q_proj.weight`), so a
state dict of the whole model loads into it. Each stage computes its own rotary tables from the
positions 0..s-1 and attends causally with no mask tensor (SDPA's `is_causal`), as a training
step of tokens alone does: so it needs a model of full causal attention on an SDPA
implementation (`hf.training_config` sets one up), and untied embeddings (a tied head would live
on two stages).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from autoshard.workloads.hf import CAUSAL_SDPA, causal_sdpa, full_causal_attention
from autoshard.workloads.hf_experts import ROUTED, routed_experts_implementation

LAYOUT = ("embed_tokens", "layers", "norm", "rotary_emb")


def splittable(model: nn.Module) -> Any:
    """`model` when it splits itself into stages (`pipeline_stage(start, stop)`, our llama), else
    a Hugging Face decoder of Llama's layout cut by `DecoderStages`; ValueError otherwise."""
    return model if hasattr(model, "pipeline_stage") else DecoderStages(model)


class DecoderStages:
    """`hf_model` with `pipeline_stage(start, stop)`, what `apply_pipeline` splits a model by;
    ValueError when the model cannot be split this way."""

    def __init__(self, hf_model: nn.Module):
        inner = getattr(hf_model, "model", None)
        missing = [name for name in LAYOUT if not hasattr(inner, name)]
        if missing or not hasattr(hf_model, "lm_head"):
            raise ValueError(
                f"{type(hf_model).__name__} is not a decoder of Llama's layout (model.embed_tokens, "
                "model.layers, model.norm, model.rotary_emb, lm_head): build its StageSpecs by hand"
            )
        config = hf_model.config
        if getattr(config, "tie_word_embeddings", False):
            raise ValueError("a model whose head is tied to its embedding cannot be cut into stages")
        attention = getattr(config, "_attn_implementation", None)
        if not full_causal_attention(config) or attention not in ("sdpa", CAUSAL_SDPA):
            raise ValueError(
                f"stages attend causally through SDPA, with no mask: the model runs {attention!r} "
                "attention or not fully causal layers (hf.training_config sets up one that does)"
            )
        self.model = hf_model

    def parameters(self) -> Iterator[nn.Parameter]:
        return self.model.parameters()

    def pipeline_stage(self, start: int, stop: int) -> DecoderStage:
        return DecoderStage(self.model, start, stop)


class DecoderStage(nn.Module):
    """Layers `[start, stop)` of an HF decoder: the first stage also embeds the tokens, the last
    also applies the norm and head and returns the cross-entropy of `targets` (the next tokens,
    as `hf.logits_loss` takes them)."""

    def __init__(self, hf_model: nn.Module, start: int, stop: int):
        super().__init__()
        inner, n = hf_model.model, len(hf_model.model.layers)
        if not 0 <= start <= stop <= n or (start == stop and 0 < start < n):
            raise ValueError(
                f"a stage holds layers [start, stop) of 0..{n} (some, unless it is the first or last), "
                f"got [{start}, {stop})"
            )
        self.start, self.stop, self.n_layers = start, stop, n
        self.dim = hf_model.config.hidden_size
        self.implementations = (  # what its layers look up in transformers' registries as they run
            getattr(hf_model.config, "_attn_implementation", None),
            getattr(hf_model.config, "_experts_implementation", None),
        )
        self.model = nn.Module()  # the model's own names: model.layers.5...., lm_head.weight
        if start == 0:
            self.model.embed_tokens = inner.embed_tokens
        self.model.layers = nn.ModuleDict({str(i): inner.layers[i] for i in range(start, stop)})
        self.model.rotary_emb = inner.rotary_emb
        if stop == n:
            self.model.norm, self.lm_head = inner.norm, hf_model.lm_head

    def __setstate__(self, state: dict) -> None:
        """Unpickled in another process (`plan`'s dry-run workers), the stage registers there the
        attention and experts implementations of ours its layers run."""
        super().__setstate__(state)
        attention, experts = self.implementations
        if attention == CAUSAL_SDPA:
            causal_sdpa()
        if experts == ROUTED:
            routed_experts_implementation()

    @property
    def first(self) -> bool:
        return self.start == 0

    @property
    def last(self) -> bool:
        return self.stop == self.n_layers

    def example_inputs(self, tokens: torch.Tensor, targets: torch.Tensor, dtype: torch.dtype) -> tuple:
        """What this stage takes for a micro-batch (`Transformer`'s stages take the same)."""
        x = tokens
        if not self.first:
            x = torch.empty(*tokens.shape, self.dim, dtype=dtype, device=tokens.device, requires_grad=True)
        return (x, targets) if self.last else (x,)

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> Any:
        from autoshard_models import cross_entropy_loss

        h = self.model.embed_tokens(x) if self.first else x
        positions = torch.arange(h.shape[1], device=h.device)[None]
        rotary = self.model.rotary_emb(h, position_ids=positions)
        for layer in self.model.layers.values():
            out = layer(h, attention_mask=None, position_embeddings=rotary, position_ids=positions)
            h = out[0] if isinstance(out, tuple) else out  # a tuple before transformers 4.54
        if not self.last:
            return h
        if targets is None:
            raise ValueError("the last stage computes the loss: it needs the targets")
        return cross_entropy_loss(self.lm_head(self.model.norm(h)), targets)
