"""Our mixture-of-experts family (`models/moe.py`): moe-tiny, moe-debug, and Qwen3-MoE's shapes
qwen3-30b-a3b and qwen3-235b-a22b. The step's loss is the cross-entropy plus the weighted
load-balancing loss (`moe_loss`). Its Hugging Face form is MixtralForCausalLM (the same router,
experts and attention; `export --hf` joins each layer's `w1` and `w3` into `gate_up_proj`);
a model with a shared expert has none.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from autoshard.workloads.base import HFFormat, Workload, sized_config, token_model
from autoshard.workloads.llama import hf_config, hf_name

ORDER = 1  # after our llama names; plain model names


def names() -> list[str]:
    from autoshard_models import MOE_CONFIGS

    return list(MOE_CONFIGS)


def resolve(name: str, seq: int) -> Workload | None:
    """The workload of MoE config `name`, its rope tables long enough for `seq`; None when `name`
    is not one of ours."""
    from autoshard_models import MOE_CONFIGS

    cfg = sized_config(MOE_CONFIGS, name, seq)
    return None if cfg is None else _workload(name, cfg)


def _workload(name: str, cfg: Any) -> Workload:
    from autoshard_models import build_moe_model, moe_loss

    loss = partial(moe_loss, aux_loss_coef=cfg.aux_loss_coef)
    mixtral = None if cfg.shared_ffn else partial(_mixtral, cfg)  # Mixtral has no shared expert
    return token_model(name, cfg, build_moe_model, _workload, loss, hf_format=mixtral)


def _mixtral(cfg: Any) -> HFFormat:
    return HFFormat({"config.json": mixtral_config(cfg)}, mixtral_name, join)


def mixtral_name(name: str) -> str:
    """Our parameter name -> MixtralForCausalLM's (`join`'s `gate_up` included)."""
    m = re.fullmatch(r"layers\.(\d+)\.feed_forward\.(router\.weight|gate_up|w2)", name)
    if m is None:
        return hf_name(name)  # attention, norms, embedding and head: llama's
    part = {"router.weight": "gate.weight", "gate_up": "experts.gate_up_proj", "w2": "experts.down_proj"}[m.group(2)]
    return f"model.layers.{m.group(1)}.mlp.{part}"


@dataclass(frozen=True)
class _Joined:
    """DCP-like metadata of a tensor made of others: its size and the stored dtype."""

    size: torch.Size
    properties: Any


def join(tensors: dict[str, Any], read: Callable) -> tuple[dict[str, Any], Callable]:
    """Each layer's `w1` [E, F, D] and `w3` as Mixtral's `gate_up_proj` [E, 2F, D] (gate rows
    first), under the name `layers.N.feed_forward.gate_up`; every other tensor as it is."""
    parts: dict[str, tuple[str, str]] = {}
    out: dict[str, Any] = {}
    for fqn, meta in tensors.items():
        if fqn.endswith(".feed_forward.w1"):
            layer = fqn.removesuffix(".w1")
            parts[f"{layer}.gate_up"] = (fqn, f"{layer}.w3")
            e, f, d = meta.size
            out[f"{layer}.gate_up"] = _Joined(torch.Size([e, 2 * f, d]), meta.properties)
        elif not fqn.endswith(".feed_forward.w3"):
            out[fqn] = meta

    def read_joined(fqn: str, meta: Any, dtype: torch.dtype) -> torch.Tensor:
        if fqn not in parts:
            return read(fqn, meta, dtype)
        gate, up = parts[fqn]
        return torch.cat([read(gate, tensors[gate], dtype), read(up, tensors[up], dtype)], dim=1)

    return out, read_joined


def mixtral_config(cfg: Any) -> str:
    """The config.json of MixtralForCausalLM with `cfg`'s shapes: its router and experts are ours
    (softmax, top-k renormalized, SwiGLU experts), its attention llama's."""
    config = hf_config(cfg) | {
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        "intermediate_size": cfg.expert_ffn,
        "num_local_experts": cfg.n_experts,
        "num_experts_per_tok": cfg.top_k,
        "router_aux_loss_coef": cfg.aux_loss_coef,
        "sliding_window": None,
    }
    for llama_only in ("attention_bias", "mlp_bias"):
        config.pop(llama_only)
    return json.dumps(config, indent=2) + "\n"
