"""A LoRA run's checkpoint exported: the adapter alone in peft's own format (adapter_config.json
and adapter_model.safetensors, what `PeftModel.from_pretrained(base, OUT)` loads), or merged into
the base model's weights (`--merge`: W + alpha / rank * B @ A, what peft's `merge_and_unload`
computes), written as the base model's own Hugging Face directory. Tensors are read one at a
time from the checkpoint, as `export` reads them; a merged weight holds its A and B beside it."""

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
    a: str  # the checkpoint FQN of lora_A.default.weight
    b: str


def merged(tensors: dict[str, Any], read: Callable, scale: float) -> tuple[dict[str, Any], Callable]:
    """The base model's tensors of a LoRA checkpoint (`tensors`: FQN -> DCP metadata) and a reader
    that gives each wrapped linear's weight merged with its adapter, computed in fp32. ValueError
    for an adapter it cannot merge (an embedding's)."""
    pairs: dict[str, _Pair] = {}
    for fqn in tensors:
        if not is_adapter(fqn):
            continue
        if ".lora_A." not in fqn and ".lora_B." not in fqn:
            raise ValueError(f"--merge: {fqn} is not a linear layer's adapter (lora_A/lora_B); export the adapter")
        if ".lora_A." in fqn:
            module = fqn.split(".lora_A.")[0]
            weight = f"{module}.base_layer.weight"
            pairs[weight] = _Pair(fqn, fqn.replace(".lora_A.", ".lora_B."))
    base = {fqn: meta for fqn, meta in tensors.items() if not is_adapter(fqn)}

    def read_merged(fqn: str, meta: Any, dtype: torch.dtype) -> torch.Tensor:
        pair = pairs.get(fqn)
        if pair is None:
            return read(fqn, meta, dtype)
        weight = read(fqn, meta, torch.float32)
        a = read(pair.a, tensors[pair.a], torch.float32)
        b = read(pair.b, tensors[pair.b], torch.float32)
        return weight.addmm_(b, a, alpha=scale).to(dtype)

    return base, read_merged
