"""llama-style model family, synthetic data and the single-device reference trainer (no autoshard imports)."""

from .configs import CONFIGS, MOE_CONFIGS, LlamaConfig, MoEConfig, get_config
from .data import Batch, MarkovTokens
from .llama import Transformer, build_model, cross_entropy_loss
from .moe import MoETransformer, build_any, build_moe_model, moe_loss, named_config, training_loss

__all__ = [
    "CONFIGS",
    "MOE_CONFIGS",
    "LlamaConfig",
    "MoEConfig",
    "get_config",
    "Batch",
    "MarkovTokens",
    "Transformer",
    "build_model",
    "cross_entropy_loss",
    "MoETransformer",
    "build_moe_model",
    "moe_loss",
    "named_config",
    "build_any",
    "training_loss",
]
