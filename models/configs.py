"""Named llama3-style model shapes, from a test-sized toy to the published 8B, 70B and 405B."""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class LlamaConfig:
    """Shape of a llama3-style decoder. `n_kv_heads < n_heads` gives grouped-query attention."""

    name: str
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    vocab_size: int
    ffn_hidden: int
    rope_theta: float = 500000.0
    norm_eps: float = 1e-5
    max_seq_len: int = 8192
    head_size: int = 0  # 0: dim // n_heads (Qwen3's heads are wider than dim / n_heads)

    def __post_init__(self) -> None:
        if self.dim % self.n_heads and not self.head_size:
            raise ValueError(f"{self.name}: dim {self.dim} is not divisible by n_heads {self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"{self.name}: n_heads {self.n_heads} is not divisible by n_kv_heads {self.n_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"{self.name}: head_dim {self.head_dim} must be even for rotary embeddings")

    @property
    def head_dim(self) -> int:
        return self.head_size or self.dim // self.n_heads

    def with_(self, **changes) -> "LlamaConfig":
        """A copy with some fields changed (e.g. a shorter max_seq_len for tests)."""
        return replace(self, **changes)


CONFIGS: dict[str, LlamaConfig] = {
    c.name: c
    for c in (
        LlamaConfig(
            "llama3-tiny", dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256, ffn_hidden=192, max_seq_len=256
        ),
        LlamaConfig(
            "llama3-debug",
            dim=256,
            n_layers=6,
            n_heads=16,
            n_kv_heads=16,
            vocab_size=2048,
            ffn_hidden=768,
            max_seq_len=2048,
        ),
        # few wide layers: with a small batch of long sequences, tensor parallelism should win on paper
        LlamaConfig(
            "llama3-wide",
            dim=1024,
            n_layers=2,
            n_heads=16,
            n_kv_heads=16,
            vocab_size=2048,
            ffn_hidden=3072,
            max_seq_len=2048,
        ),
        # llama 3.2 1B's shapes with an untied output (1.50B parameters): one GPU's training step
        LlamaConfig("llama3-1b", dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, vocab_size=128256, ffn_hidden=8192),
        LlamaConfig("llama3-8b", dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=128256, ffn_hidden=14336),
        LlamaConfig("llama3-70b", dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, vocab_size=128256, ffn_hidden=28672),
        LlamaConfig(
            "llama3-405b", dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, vocab_size=128256, ffn_hidden=53248
        ),
    )
}


@dataclass(frozen=True)
class MoEConfig(LlamaConfig):
    """A llama3-style decoder whose feed-forward is `n_experts` routed SwiGLU experts of width
    `expert_ffn`, each token sent to its router's `top_k` (plus a dense `shared_ffn` every token
    goes through, 0: none); `aux_loss_coef` weighs the load-balancing loss (Switch's)."""

    n_experts: int = 8
    top_k: int = 2
    expert_ffn: int = 0
    shared_ffn: int = 0
    aux_loss_coef: float = 0.001

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 < self.top_k <= self.n_experts:
            raise ValueError(f"{self.name}: top_k {self.top_k} must be in 1..n_experts ({self.n_experts})")
        if self.expert_ffn <= 0:
            raise ValueError(f"{self.name}: expert_ffn must be positive, got {self.expert_ffn}")


def _qwen3_moe(name: str, **shape) -> MoEConfig:
    """Qwen3-MoE's shapes (no q/k norms here: a few thousand weights of a 30B model)."""
    return MoEConfig(name, vocab_size=151936, head_size=128, rope_theta=1e6, norm_eps=1e-6, **shape)


MOE_CONFIGS: dict[str, MoEConfig] = {
    c.name: c
    for c in (
        MoEConfig("moe-tiny", dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256, ffn_hidden=0,
                  n_experts=8, top_k=2, expert_ffn=32, max_seq_len=256),
        MoEConfig("moe-debug", dim=256, n_layers=4, n_heads=8, n_kv_heads=8, vocab_size=2048, ffn_hidden=0,
                  n_experts=16, top_k=2, expert_ffn=384, max_seq_len=2048),
        _qwen3_moe("qwen3-30b-a3b", dim=2048, n_layers=48, n_heads=32, n_kv_heads=4, ffn_hidden=0,
                   n_experts=128, top_k=8, expert_ffn=768),
        _qwen3_moe("qwen3-235b-a22b", dim=4096, n_layers=94, n_heads=64, n_kv_heads=4, ffn_hidden=0,
                   n_experts=128, top_k=8, expert_ffn=1536),
    )
}  # fmt: skip


def get_config(name: str) -> LlamaConfig:
    """Look a config up by name; unknown names raise ValueError listing the valid ones."""
    try:
        return CONFIGS[name]
    except KeyError:
        raise ValueError(f"unknown model config {name!r}; valid names: {', '.join(CONFIGS)}") from None
