"""A llama3-style decoder written like a reference implementation.

Plain `nn.Module`s and plain tensor ops only (no fused kernels beyond
`scaled_dot_product_attention`), so the traced graph contains ops that sharding rules know.
Rotary embeddings use the real-valued rotate-half form: complex tensors have poor sharding support.
Module and parameter names follow the common llama3 layout (`layers.N.attention.wq.weight`, ...) so
that hand-written parallel plans and logs read the same.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from .configs import LlamaConfig


def rope_tables(head_dim: int, max_seq_len: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables of shape [max_seq_len, head_dim] for the rotate-half rotary form."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat([-second, first], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [batch, seq, heads, head_dim]; cos/sin: [seq, head_dim], or [batch, seq, head_dim] for
    each token's own position (fp32 tables, applied in x's dtype)."""
    if cos.dim() == 3:
        cos, sin = cos[:, :, None, :].to(x.dtype), sin[:, :, None, :].to(x.dtype)
    else:
        cos, sin = cos[None, :, None, :].to(x.dtype), sin[None, :, None, :].to(x.dtype)
    return x * cos + rotate_half(x) * sin


def document_mask(positions: torch.Tensor) -> torch.Tensor:
    """The block-causal mask of packed documents, [batch, 1, seq, seq] (True: attend): each token's
    position restarts at 0 where its document starts, so query i sees keys i - positions[i] .. i."""
    idx = torch.arange(positions.shape[1], device=positions.device)
    keys = idx[None, None, :]
    start = (idx[None, :] - positions)[:, :, None]
    return ((keys <= idx[None, :, None]) & (keys >= start))[:, None]


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """Repeat each key/value head n_rep times: [b, s, kv_heads, d] -> [b, s, kv_heads * n_rep, d]."""
    if n_rep == 1:
        return x
    b, s, kv_heads, d = x.shape
    return x[:, :, :, None, :].expand(b, s, kv_heads, n_rep, d).reshape(b, s, kv_heads * n_rep, d)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # normalized in fp32 whatever the compute dtype (as torchtitan and HF do), scaled in x's
        h = x.float()
        return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.n_kv_heads = cfg.n_kv_heads
        self.head_dim = cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        b, s, _ = x.shape
        # -1 for the head count keeps the views valid when heads are split across ranks.
        q = self.wq(x).view(b, s, -1, self.head_dim)
        k = self.wk(x).view(b, s, -1, self.head_dim)
        v = self.wv(x).view(b, s, -1, self.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        n_rep = self.n_heads // self.n_kv_heads
        k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if mask is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:  # packed documents: causal within each, nothing across
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = FeedForward(cfg.dim, cfg.ffn_hidden)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin, mask)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    """Token ids [batch, seq] -> logits [batch, seq, vocab]; with `positions` [batch, seq] (each
    token's position in its document, 0 where one starts) several documents share a row, each
    attending only to itself and rotated from its own start, as if it were alone."""

    block: type[nn.Module] = TransformerBlock  # what each of `layers` is

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(self.block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        cos, sin = rope_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta)
        # Not persistent: derived from the config, so checkpoints carry only learned weights.
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        h, cos, sin, mask = self.embed(tokens, positions)
        for layer in self.layers:
            h = layer(h, cos, sin, mask)
        return self.output(self.norm(h))

    def embed(self, tokens: torch.Tensor, positions: torch.Tensor | None) -> tuple:
        """(embedded tokens, rope cos and sin, attention mask or None): what every block takes."""
        seq_len = tokens.shape[1]
        if seq_len > self.cfg.max_seq_len:
            raise ValueError(f"sequence length {seq_len} exceeds max_seq_len {self.cfg.max_seq_len}")
        h = self.tok_embeddings(tokens)
        # the rope tables in the compute dtype, once for every block (a no-op in fp32)
        mask = None
        if positions is None:
            cos, sin = self.rope_cos[:seq_len].to(h.dtype), self.rope_sin[:seq_len].to(h.dtype)
        else:  # each token's row of the tables (an embedding lookup: sharding rules know it)
            cos = F.embedding(positions, self.rope_cos).to(h.dtype)
            sin = F.embedding(positions, self.rope_sin).to(h.dtype)
            mask = document_mask(positions)
        return h, cos, sin, mask

    def pipeline_stage(self, start: int, stop: int) -> "TransformerStage":
        """Blocks [start, stop) as one pipeline stage (`TransformerStage`), sharing this model's modules."""
        return TransformerStage(self, start, stop)

    @torch.no_grad()
    def init_weights(self, seed: int = 0) -> None:
        """Deterministic init from `seed`, independent of the global RNG and of the device.

        Values are drawn on CPU in `named_parameters()` order and copied in, so a model built on
        `meta` and materialized with `to_empty(device=...)` gets exactly the same weights.
        """
        params = dict(self.named_parameters())
        for name, values in self.initial_values(seed):
            if name in params:
                params[name].copy_(values.to(dtype=params[name].dtype))
            else:
                self.get_buffer(name).copy_(values)

    @torch.no_grad()
    def initial_values(self, seed: int = 0) -> Iterator[tuple[str, torch.Tensor]]:
        """What `init_weights(seed)` writes, one full fp32 CPU tensor at a time (parameters in its
        order, then the rope tables): a sharded copy of a model on `meta` keeps each one's shard
        and drops it, so no rank ever holds the whole model."""
        gen = torch.Generator(device="cpu").manual_seed(seed)
        residual_std = 0.02 / (2 * self.cfg.n_layers) ** 0.5
        for name, param in self.named_parameters():
            if name.endswith("norm.weight"):
                values = torch.ones(param.shape, device="cpu")
            else:
                if name == "tok_embeddings.weight":
                    std = 1.0
                elif name == "output.weight":
                    std = self.cfg.dim**-0.5
                elif name.endswith(("wo.weight", "w2.weight", "feed_forward.w2")):  # into the residual
                    std = residual_std
                else:
                    std = 0.02
                values = torch.empty(param.shape, device="cpu").normal_(0.0, std, generator=gen)
            yield name, values
            del values
        cos, sin = rope_tables(self.cfg.head_dim, self.cfg.max_seq_len, self.cfg.rope_theta)
        yield "rope_cos", cos
        yield "rope_sin", sin


class TransformerStage(nn.Module):
    """Blocks `[start, stop)` of a `Transformer` as one pipeline stage, sharing its modules under
    their names (`layers.5.attention.wq.weight`): the first stage also embeds the tokens, the last
    also applies the norm and head and returns the loss of `targets`; the others take and return
    the hidden states `[batch, seq, dim]`. No document positions: each row is one sequence."""

    def __init__(self, model: Transformer, start: int, stop: int):
        super().__init__()
        n = model.cfg.n_layers
        if not 0 <= start <= stop <= n or (start == stop and 0 < start < n):
            raise ValueError(
                f"a stage holds blocks [start, stop) of 0..{n} (some, unless it is the first or last), "
                f"got [{start}, {stop})"
            )
        self.cfg, self.start, self.stop = model.cfg, start, stop
        if start == 0:
            self.tok_embeddings = model.tok_embeddings
        self.layers = nn.ModuleDict({str(i): model.layers[i] for i in range(start, stop)})
        if stop == n:
            self.norm, self.output = model.norm, model.output
        self.register_buffer("rope_cos", model.rope_cos, persistent=False)
        self.register_buffer("rope_sin", model.rope_sin, persistent=False)

    @property
    def first(self) -> bool:
        return self.start == 0

    @property
    def last(self) -> bool:
        return self.stop == self.cfg.n_layers

    def example_inputs(self, tokens: torch.Tensor, targets: torch.Tensor, dtype: torch.dtype) -> tuple:
        """What this stage takes for a micro-batch of `tokens` and `targets` (shapes are what
        matter): the tokens, or the hidden states in `dtype` (requiring a gradient, which goes
        back to the previous stage); and the targets when it is the last."""
        x = tokens
        if not self.first:
            x = torch.empty(*tokens.shape, self.cfg.dim, dtype=dtype, device=tokens.device, requires_grad=True)
        return (x, targets) if self.last else (x,)

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        h = self.tok_embeddings(x) if self.first else x
        seq_len = h.shape[1]
        cos, sin = self.rope_cos[:seq_len].to(h.dtype), self.rope_sin[:seq_len].to(h.dtype)
        for layer in self.layers.values():
            h = layer(h, cos, sin)
        if not self.last:
            return h
        if targets is None:
            raise ValueError("the last stage computes the loss: it needs the targets")
        return cross_entropy_loss(self.output(self.norm(h)), targets)


def cross_entropy_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over all positions, computed in fp32."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def build_model(
    cfg: LlamaConfig, device: str | torch.device = "cpu", seed: int | None = 0, cls: type[Transformer] = Transformer
) -> Transformer:
    """Build a `cls` on `device`; on a real device, initialize it from `seed` (None: leave as built)."""
    with torch.device(device):
        model = cls(cfg)
    if torch.device(device).type != "meta" and seed is not None:
        model.init_weights(seed)
    return model
