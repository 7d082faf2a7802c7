"""Hugging Face transformers causal LMs as workloads: `--model hf:PATH`.

PATH is a local `config.json` or a directory holding one (a model saved with `save_pretrained`);
nothing is downloaded. The model is the config's causal-LM class (LlamaForCausalLM,
Qwen2ForCausalLM, Qwen3ForCausalLM, ...) in fp32 with sdpa attention and no KV cache (a training
step has no use for one), called as `model(tokens)`, its `.logits` scored against the targets
with the same cross-entropy as our own models. Parameter names are the model's own, so an HF
state dict or safetensors directory loads as it is. Tied input/output embeddings are one
parameter (transformers ties them; `named_parameters` lists the embedding once).

Needs the `autoshard[hf]` extra (transformers, safetensors). A workload family: it imports torch,
transformers and `models` (data, loss), never a stage package.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from autoshard.workloads.base import HFFormat, Workload, full_state, token_batches, token_inputs

ORDER = 10  # asked after the plain model names
PREFIX = "hf:"
INSTALL = "pip install 'autoshard[hf]'"


def _transformers():
    try:
        import transformers
    except ImportError:
        raise ValueError(f"Hugging Face models need transformers: {INSTALL}") from None
    return transformers


def config_file(path: str | Path) -> Path:
    """The config.json that PATH names (the file itself, or the one in a directory)."""
    path = Path(path)
    if not path.exists():
        raise ValueError(f"hf:{path}: no such file or directory")
    if path.is_dir():
        path = path / "config.json"
        if not path.is_file():
            raise ValueError(f"hf:{path.parent}: the directory has no config.json")
    return path


def load_config(path: str | Path) -> Any:
    """The transformers config that PATH's config.json describes, set up for training: fp32,
    sdpa attention, no KV cache. Raises ValueError naming what is wrong with the file."""
    file = config_file(path)
    try:
        data = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"hf:{file}: not a JSON config ({err})") from None
    if not isinstance(data, dict) or "model_type" not in data:
        raise ValueError(f"hf:{file}: no model_type in the config (a transformers config.json has one)")
    transformers = _transformers()
    model_type = data["model_type"]
    if model_type not in transformers.CONFIG_MAPPING:
        raise ValueError(f"hf:{file}: transformers {transformers.__version__} knows no model_type {model_type!r}")
    data = {k: v for k, v in data.items() if k not in ("dtype", "torch_dtype")}  # fp32: the numerics contract
    try:
        config = transformers.CONFIG_MAPPING[model_type].from_dict(data, attn_implementation="sdpa")
    except Exception as err:  # transformers validates fields its own way
        raise ValueError(f"hf:{file}: transformers rejects the config ({type(err).__name__}: {err})") from None
    config.use_cache = False
    causal_lm_class(config, file)  # fail now, not at build
    return config


def causal_lm_class(config: Any, where: Any = "the config") -> type[nn.Module]:
    """The config's causal-LM class; ValueError when its architecture has none."""
    mapping = _transformers().MODEL_FOR_CAUSAL_LM_MAPPING
    if type(config) not in mapping:
        raise ValueError(f"hf:{where}: model_type {config.model_type!r} has no causal-LM class in transformers "
                         "(autoshard trains causal LMs: Llama, Qwen2, Qwen3, ...)")
    return mapping[type(config)]


def build(config: Any, device: str | torch.device = "meta", seed: int | None = None) -> nn.Module:
    """The causal LM of `config` on `device` (meta: no memory, no init); on a real device its
    weights are transformers' own init drawn after `manual_seed(seed)`, leaving the global RNG as
    it was."""
    cls = causal_lm_class(config)
    with torch.random.fork_rng(devices=[]):
        if seed is not None:
            torch.manual_seed(seed)
        with torch.device(device):
            model = cls(config)
    return model.train()


def logits_loss(outputs: Any, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of a `ModelOutput`'s logits (AutoShard hands the loss the logits already)."""
    from models import cross_entropy_loss

    return cross_entropy_loss(getattr(outputs, "logits", outputs), targets)


def names() -> list[str]:
    return [PREFIX + "PATH (a local transformers config.json or model directory)"]


def resolve(name: str, seq: int) -> Workload | None:
    """`hf:PATH`: the causal LM a local transformers config describes; None for other names."""
    return workload(name[len(PREFIX):], seq) if name.startswith(PREFIX) else None


def workload(path: str, seq: int) -> Workload:
    """The workload `hf:PATH`: tokens in, `.logits` against targets, Markov-chain token data."""
    config = load_config(path)
    return Workload(
        name=PREFIX + path,
        build=lambda device: build(config, device),
        example_inputs=token_inputs,
        loss_fn=logits_loss,
        data=lambda seed: token_batches(config.vocab_size, seed),
        initial_state=lambda seed: full_state(build(config, "cpu", seed)),
        hf_format=lambda: hf_format(path),
    )


def hf_format(path: str | Path) -> HFFormat:
    """The model's own files (config.json, with fp32 weights said; generation_config.json when
    there is one) and names: what transformers' from_pretrained expects back."""
    file = config_file(path)
    config = {k: v for k, v in json.loads(file.read_text()).items() if k != "torch_dtype"} | {"dtype": "float32"}
    files = {"config.json": json.dumps(config, indent=2) + "\n"}
    generation = file.with_name("generation_config.json")
    if generation.is_file():
        files[generation.name] = generation.read_text()
    return HFFormat(files, lambda name: name)
