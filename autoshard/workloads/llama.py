"""Our own llama family (`models/`): llama3-tiny, llama3-debug, llama3-8b, llama3-70b, llama3-405b.

Its Hugging Face form is `LlamaForCausalLM`: the same architecture (rotate-half rotary, RMSNorm,
SwiGLU, grouped-query attention, untied output) under other names, so an exported run loads in
transformers with the same logits, and an HF Llama checkpoint of these shapes loads here
(`--init-from`, names mapped back).
"""

from __future__ import annotations

import json
import re
from typing import Any

from autoshard.workloads.base import HFFormat, Workload, sized_config, token_model

ORDER = 0  # asked first: plain model names


def names() -> list[str]:
    from autoshard_models import CONFIGS

    return list(CONFIGS)


def resolve(name: str, seq: int) -> Workload | None:
    """The workload of model config `name`, its rope tables long enough for `seq`; None when
    `name` is not one of ours."""
    from autoshard_models import CONFIGS

    cfg = sized_config(CONFIGS, name, seq)
    return None if cfg is None else _workload(name, cfg)


def _workload(name: str, cfg: Any) -> Workload:
    """The workload of config `cfg`; `resize_vocab` gives it another vocabulary (a tokenizer's)."""
    from autoshard_models import build_model, cross_entropy_loss

    return token_model(
        name,
        cfg,
        build_model,
        _workload,
        cross_entropy_loss,
        adapt_state_dict=from_hf_names,
        hf_format=lambda: HFFormat({"config.json": json.dumps(hf_config(cfg), indent=2) + "\n"}, hf_name),
    )


_TOP = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER = {
    "attention.wq": "self_attn.q_proj",
    "attention.wk": "self_attn.k_proj",
    "attention.wv": "self_attn.v_proj",
    "attention.wo": "self_attn.o_proj",
    "feed_forward.w1": "mlp.gate_proj",
    "feed_forward.w3": "mlp.up_proj",
    "feed_forward.w2": "mlp.down_proj",
    "attention_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_OURS = {v: k for k, v in _TOP.items()}
_OURS_LAYER = {v: k for k, v in _LAYER.items()}


def hf_name(name: str) -> str:
    """Our parameter name -> LlamaForCausalLM's (`layers.3.attention.wq.weight` ->
    `model.layers.3.self_attn.q_proj.weight`)."""
    if name in _TOP:
        return _TOP[name]
    m = re.fullmatch(r"layers\.(\d+)\.(.+)\.weight", name)
    if m is None or m.group(2) not in _LAYER:
        raise KeyError(f"{name} has no LlamaForCausalLM name")
    return f"model.layers.{m.group(1)}.{_LAYER[m.group(2)]}.weight"


def from_hf_names(state_dict: dict[str, Any]) -> dict[str, Any]:
    """A LlamaForCausalLM state dict under our names; any other state dict as it is."""
    if "model.embed_tokens.weight" not in state_dict:
        return state_dict
    out = {}
    for name, value in state_dict.items():
        m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)\.weight", name)
        if name in _OURS:
            out[_OURS[name]] = value
        elif m is not None and m.group(2) in _OURS_LAYER:
            out[f"layers.{m.group(1)}.{_OURS_LAYER[m.group(2)]}.weight"] = value
        else:
            out[name] = value  # reported by the checkpoint check as a tensor the model lacks
    return out


def hf_config(cfg: Any) -> dict[str, Any]:
    """The config.json of LlamaForCausalLM with `cfg`'s shapes (fp32 weights, default rotary)."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": cfg.dim,
        "intermediate_size": cfg.ffn_hidden,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "vocab_size": cfg.vocab_size,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "max_position_embeddings": cfg.max_seq_len,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "dtype": "float32",
    }
