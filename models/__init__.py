"""llama-style model family, synthetic data and the single-device reference trainer (no autoshard imports)."""

from .configs import CONFIGS, LlamaConfig, get_config
from .data import Batch, MarkovTokens
from .llama import Transformer, build_model, cross_entropy_loss

__all__ = [
    "CONFIGS",
    "LlamaConfig",
    "get_config",
    "Batch",
    "MarkovTokens",
    "Transformer",
    "build_model",
    "cross_entropy_loss",
]
