"""Hugging Face transformers language models as workloads: `--model hf:PATH`.

PATH is a local `config.json` or a directory holding one (a model saved with `save_pretrained`);
nothing is downloaded. The model is the class the config's `architectures` names, or else its
causal-LM class (LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, ...), or else its
sequence-to-sequence LM class (T5ForConditionalGeneration, ...), in fp32 with sdpa attention where
the model has attention, and no KV cache (a training step has no use for one). A causal LM is
called as `model(tokens)`, its `.logits` scored against the targets with the same cross-entropy as
our own models; a sequence-to-sequence LM as `model(input_ids=tokens, labels=targets)`, its own
`.loss` the step's loss (the decoder reads the targets shifted right, as transformers trains it).
Parameter names are the model's own, so an HF state dict or safetensors directory loads as it is.
Tied input/output embeddings are one parameter (transformers ties them; `named_parameters` lists
the embedding once).

Needs the `autoshard[hf]` extra (transformers, safetensors). A workload family: it imports torch,
transformers and `models` (data, loss), never a stage package.
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

from autoshard.fileio import read_json
from autoshard.workloads import hf_init
from autoshard.workloads.base import HFFormat, Workload, full_state, token_batches, token_inputs
from autoshard.workloads.hf_experts import routed_experts_implementation

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
    SDPA attention (`training_config`), no KV cache. Raises ValueError naming what is wrong with the file."""
    file = config_file(path)
    data = read_json(file, name=f"hf:{file}")
    if not isinstance(data, dict) or "model_type" not in data:
        raise ValueError(f"hf:{file}: no model_type in the config (a transformers config.json has one)")
    transformers = _transformers()
    model_type = data["model_type"]
    if model_type not in transformers.CONFIG_MAPPING:
        raise ValueError(f"hf:{file}: transformers {transformers.__version__} knows no model_type {model_type!r}")
    _check_sizes(data, transformers.CONFIG_MAPPING[model_type], file)
    data = {k: v for k, v in data.items() if k not in ("dtype", "torch_dtype")}  # fp32: the numerics contract
    try:
        config = transformers.CONFIG_MAPPING[model_type].from_dict(data, attn_implementation="sdpa")
    except Exception as err:  # transformers validates fields its own way
        raise ValueError(f"hf:{file}: transformers rejects the config ({type(err).__name__}: {err})") from None
    if not runs_attention(model_class(config, file)):  # fail now, not at build
        config._attn_implementation = None  # no attention to run with SDPA (Mamba): transformers' default
    return training_config(config)


def runs_attention(cls: type[nn.Module]) -> bool:
    """Whether a transformers model class runs attention through SDPA (state-space models do not)."""
    return bool(getattr(cls, "_supports_sdpa", False))


# the sizes a causal LM's config gives (under these names, or its class's `attribute_map` aliases)
SIZES = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "max_position_embeddings",
)


def _check_sizes(data: dict, config_class: Any, file: Path) -> None:
    """Every size the file gives is a positive integer: transformers takes `"hidden_size": -8` or
    0 layers as they are, and the model then fails deep in building or tracing (or plans a model of
    nothing). Null (the class's default) is left to transformers."""
    aliases = getattr(config_class, "attribute_map", {}) or {}
    for name in (*SIZES, *(aliases[s] for s in SIZES if s in aliases)):
        value = data.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f'hf:{file}: "{name}" is {json.dumps(value)}; a size must be a positive integer')


def training_config(config: Any) -> Any:
    """A copy of a transformers config set up for a training step: no KV cache, for models of
    full causal attention the `causal_sdpa` implementation (no [b, 1, s, s] mask in the graph),
    and for models with experts autoshard's routed-experts op (`hf_experts`)."""
    config = copy.deepcopy(config)
    config.use_cache = False
    cls = model_class(config)
    if full_causal_attention(config) and runs_attention(cls) and not is_seq2seq(cls):
        config._attn_implementation = causal_sdpa()
    if has_experts(cls):
        config._experts_implementation = routed_experts_implementation()
    return config


def has_experts(cls: type[nn.Module]) -> bool:
    """Whether a model class runs its experts through transformers' experts interface."""
    source = sys.modules.get(cls.__module__)
    return source is not None and "use_experts_implementation" in vars(source)


CAUSAL_SDPA = "autoshard_causal_sdpa"


def full_causal_attention(config: Any) -> bool:
    """Whether every layer attends to every earlier position (no sliding window, chunks or other
    attention kinds): then the causal mask is a pure function of positions."""
    kinds = set(getattr(config, "layer_types", None) or ["full_attention"])
    windowed = getattr(config, "sliding_window", None) is not None and getattr(config, "use_sliding_window", True)
    return kinds == {"full_attention"} and not windowed and getattr(config, "attention_chunk_size", None) is None


def causal_sdpa() -> str:
    """The attention implementation `hf:` models of full causal attention run with (registered in
    transformers under CAUSAL_SDPA; registering again is harmless): transformers' own SDPA, with a
    mask function that makes no mask when there is none to make.

    A training step calls the model with tokens only: no padding mask, positions 0..s-1, no cache.
    The causal mask is then a pure function of positions, and SDPA's `is_causal=True` says it
    without the [b, 1, s, s] tensor. transformers skips that tensor itself, but not while tracing
    (dynamo export, or the make_fx fallback): it cannot see that the padding mask is absent or
    that the positions are not packed sequences. Here both are known: our workloads pass neither
    (packed instruction rows, which pass positions, run the workload's `packed` variant, on
    transformers' own SDPA). With a padding mask passed (the API, a model of one's own), the mask
    is made as transformers makes it."""
    transformers = _transformers()
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import sdpa_mask

    def causal_or_sdpa_mask(
        batch_size: int,
        q_length: int,
        kv_length: int,
        q_offset: int = 0,
        kv_offset: int = 0,
        attention_mask: torch.Tensor | None = None,
        local_size: int | None = None,
        **kwargs: Any,
    ):
        if (
            attention_mask is None
            and local_size is None
            and q_length == kv_length
            and isinstance(q_offset, int)
            and isinstance(kv_offset, int)
            and q_offset == kv_offset == 0
        ):
            return None  # SDPA runs with is_causal=True
        return sdpa_mask(
            batch_size,
            q_length,
            kv_length,
            q_offset,
            kv_offset,
            attention_mask=attention_mask,
            local_size=local_size,
            **kwargs,
        )

    transformers.AttentionInterface.register(CAUSAL_SDPA, sdpa_attention_forward)
    transformers.AttentionMaskInterface.register(CAUSAL_SDPA, causal_or_sdpa_mask)
    return CAUSAL_SDPA


def model_class(config: Any, where: Any = "the config") -> type[nn.Module]:
    """The class the config's model trains as: the one its `architectures` names when that is a
    causal or sequence-to-sequence LM, else its causal-LM class, else its sequence-to-sequence LM
    class; ValueError when its architecture has neither."""
    transformers = _transformers()
    mappings = (transformers.MODEL_FOR_CAUSAL_LM_MAPPING, transformers.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING)
    classes = [mapping[type(config)] for mapping in mappings if type(config) in mapping]
    if not classes:
        raise ValueError(
            f"hf:{where}: model_type {config.model_type!r} has no causal-LM or sequence-to-sequence LM class in "
            "transformers (autoshard trains language models: Llama, Qwen2, Qwen3, T5, ...)"
        )
    named = set(getattr(config, "architectures", None) or ())
    return next((cls for cls in classes if cls.__name__ in named), classes[0])


def is_seq2seq(cls: type[nn.Module]) -> bool:
    """Whether a model class is an encoder-decoder LM (trained on its own `.loss` of `labels=`)."""
    mapping, config = _transformers().MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING, getattr(cls, "config_class", None)
    return config in mapping and mapping[config] is cls  # looks up one entry: the mapping imports lazily


def build(config: Any, device: str | torch.device = "meta", seed: int | None = None) -> nn.Module:
    """The language model of `config` on `device` (meta: no memory, no init); on a real device its
    weights are transformers' own init drawn after `manual_seed(seed)`, leaving the global RNG as
    it was."""
    cls = model_class(config)
    with torch.random.fork_rng(devices=[]):
        if seed is not None:
            torch.manual_seed(seed)
        with torch.device(device):
            model = cls(config)
    return model.train()


def logits_loss(outputs: Any, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of a `ModelOutput`'s logits (AutoShard hands the loss the logits already)."""
    from autoshard_models import cross_entropy_loss

    return cross_entropy_loss(getattr(outputs, "logits", outputs), targets)


def labelled_inputs(batch: int, seq: int, device: str | torch.device) -> dict[str, torch.Tensor]:
    """`token_inputs` by keyword, for `model(input_ids=tokens, labels=targets)`."""
    return dict(zip(("input_ids", "labels"), token_inputs(batch, seq, device)))


def names() -> list[str]:
    return [PREFIX + "PATH (a local transformers config.json or model directory)"]


def resolve(name: str, seq: int) -> Workload | None:
    """`hf:PATH`: the language model a local transformers config describes; None for other names."""
    return workload(name[len(PREFIX) :], seq) if name.startswith(PREFIX) else None


def workload(path: str, seq: int, packed: bool = False) -> Workload:
    """The workload `hf:PATH`: tokens in, `.logits` against targets (a sequence-to-sequence LM:
    its own `.loss` of the targets as labels), Markov-chain token data. `packed`: the model on
    transformers' own SDPA, which makes the mask of packed examples from the positions it is
    given (`Workload.packed`; the default implementation assumes positions 0..s-1)."""
    config = load_config(path)
    if packed and config._attn_implementation == CAUSAL_SDPA:
        config._attn_implementation = "sdpa"
    seq2seq = is_seq2seq(model_class(config))
    return Workload(
        name=PREFIX + path,
        build=lambda device: build(config, device),
        example_inputs=labelled_inputs if seq2seq else token_inputs,
        loss_fn=None if seq2seq else logits_loss,
        n_model_inputs=2 if seq2seq else 1,
        data=lambda seed: token_batches(config.vocab_size, seed),
        initial_state=lambda seed: full_state(build(config, "cpu", seed)),
        initial_values=lambda seed, want=None: hf_init.initial_values(config, model_class(config), seed, want),
        hf_format=lambda: hf_format(path),
        vocab_size=config.vocab_size,
        packed=None if seq2seq else lambda: workload(path, seq, packed=True),
    )


def hf_format(path: str | Path) -> HFFormat:
    """The model's own files (config.json, with fp32 weights said; generation_config.json when
    there is one) and names: what transformers' from_pretrained expects back."""
    file = config_file(path)
    config = {k: v for k, v in read_json(file, name=f"hf:{file}").items() if k != "torch_dtype"} | {"dtype": "float32"}
    files = {"config.json": json.dumps(config, indent=2) + "\n"}
    generation = file.with_name("generation_config.json")
    if generation.is_file():
        files[generation.name] = generation.read_text()
    return HFFormat(files, lambda name: name)
