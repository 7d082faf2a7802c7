"""A LoRA run's checkpoint exported: the adapter alone in peft's own format (adapter_config.json
and adapter_model.safetensors, what `PeftModel.from_pretrained(base, OUT)` loads), or merged into
the base model's weights (`--merge`: W + alpha / rank * B @ A for a linear, the transpose of
B @ A for an embedding, what peft's `merge_and_unload` computes), written as the base model's own
Hugging Face directory. Tensors are read one at a time from the checkpoint, as `export` reads
them; a merged weight holds its A and B beside it."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable

import torch

from autoshard.workloads.finetune import ADAPTER_MARK, PEFT_PREFIX

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_NAME = "default"  # peft's name of the one adapter `get_peft_model` adds


def is_adapter(fqn: str) -> bool:
    return ADAPTER_MARK in fqn


def adapter_name(fqn: str) -> str:
    """A checkpoint's adapter name -> the name peft saves it under (without the adapter's own name)."""
    return fqn.replace(f".{ADAPTER_NAME}.", ".")


def base_name(fqn: str) -> str:
    """A wrapped model's parameter name -> its name in the base model."""
    return fqn.removeprefix(PEFT_PREFIX).replace(".base_layer.", ".")


def adapter_config(model: Any, base_model: str | None) -> str:
    """adapter_config.json of a model `peft.get_peft_model` wrapped (its resolved targets), as
    peft's `save_pretrained` writes it: sets as lists."""
    config = model.peft_config[ADAPTER_NAME]
    entries = config.to_dict() | {"base_model_name_or_path": base_model}
    return json.dumps({k: sorted(v) if isinstance(v, set) else v for k, v in entries.items()}, indent=2) + "\n"


@dataclass(frozen=True)
class _Pair:
    a: str  # the checkpoint FQN of lora_A.default.weight (an embedding's: lora_embedding_A.default)
    b: str
    embedding: bool  # peft's Embedding: A is [rank, rows], B [dim, rank], the update (B @ A)^T


# peft's names of a linear's and an embedding's adapter halves (A, B)
HALVES = ((".lora_A.", ".lora_B.", False), (".lora_embedding_A.", ".lora_embedding_B.", True))


def merged(tensors: dict[str, Any], read: Callable, scale: float) -> tuple[dict[str, Any], Callable]:
    """The base model's tensors of a LoRA checkpoint (`tensors`: FQN -> DCP metadata) and a reader
    that gives each wrapped linear's or embedding's weight merged with its adapter, computed in
    fp32 as peft's `merge_and_unload` does. ValueError for an adapter of another kind."""
    pairs: dict[str, _Pair] = {}
    for fqn in tensors:
        if not is_adapter(fqn):
            continue
        half = next((h for h in HALVES if h[0] in fqn or h[1] in fqn), None)
        if half is None:
            raise ValueError(
                f"--merge: {fqn} is not a linear layer's or an embedding's adapter (lora_A/lora_B); export the adapter"
            )
        a_mark, b_mark, embedding = half
        if a_mark in fqn:
            module = fqn.split(a_mark)[0]
            pairs[f"{module}.base_layer.weight"] = _Pair(fqn, fqn.replace(a_mark, b_mark), embedding)
    base = {fqn: meta for fqn, meta in tensors.items() if not is_adapter(fqn)}

    def read_merged(fqn: str, meta: Any, dtype: torch.dtype) -> torch.Tensor:
        pair = pairs.get(fqn)
        if pair is None:
            return read(fqn, meta, dtype)
        weight = read(fqn, meta, torch.float32)
        a = read(pair.a, tensors[pair.a], torch.float32)
        b = read(pair.b, tensors[pair.b], torch.float32)
        if pair.embedding:  # W [rows, dim] + scale * (B @ A)^T = W + scale * A^T @ B^T
            return weight.addmm_(a.t(), b.t(), alpha=scale).to(dtype)
        return weight.addmm_(b, a, alpha=scale).to(dtype)

    return base, read_merged
