"""Attention on a GPU for a program traced on CPU. The step is traced on CPU fake tensors, so its
attention is torch's CPU flash attention (`_scaled_dot_product_flash_attention_for_cpu` and its
backward), which has no CUDA kernel. On a mesh of another device the program calls these functions
instead, with the same arguments and outputs (the output, and the logsumexp [b, h, s] in fp32).
Without a mask or dropout they run the kernel `scaled_dot_product_attention` would pick for the
same inputs in training: cuDNN's (where torch prefers it, as on Hopper; its logsumexp is
[b, h, s, 1], handed over as [b, h, s]) or flash attention's (fp16 / bf16; its dense form takes no
sequence offsets, without dropout it reads no random state, and its backward reads the logsumexp
as contiguous rows). Otherwise `scaled_dot_product_attention` itself runs, and the backward
computes the forward again under autograd (no logsumexp to hand over: an unused one of the traced
shape stands in). The output and the gradients keep the CPU op's memory layout, [b, h, s, d] laid
out as [b, s, h, d]: the traced views after them rely on it."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from autoshard import _torch_compat as tc

aten = torch.ops.aten


def _kernel(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, dropout_p: float, attn_mask: Any,
            is_causal: bool, scale: float | None) -> str:  # fmt: skip
    """'cudnn' or 'flash' where the fused kernels apply, else 'sdpa'."""
    if attn_mask is not None or dropout_p != 0.0 or query.device.type != "cuda":
        return "sdpa"
    choice = tc.sdpa_backend(query, key, value, is_causal, scale)
    if choice == "cudnn":
        return choice
    return "flash" if query.dtype in (torch.float16, torch.bfloat16) else "sdpa"


def _bshd(t: torch.Tensor) -> torch.Tensor:
    """`t` [b, h, s, d] laid out as [b, s, h, d], as the CPU op makes it (copied only when not)."""
    return t if t.transpose(1, 2).is_contiguous() else t.transpose(1, 2).contiguous().transpose(1, 2)


def _check(dropout_p: float) -> None:
    if dropout_p:
        raise NotImplementedError("autoshard: attention dropout on a GPU mesh is not implemented")


def attention_forward(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    *,
    attn_mask: torch.Tensor | None = None,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`_scaled_dot_product_flash_attention_for_cpu` on the inputs' device."""
    kernel = _kernel(query, key, value, dropout_p, attn_mask, is_causal, scale)
    if kernel == "cudnn":
        out = aten._scaled_dot_product_cudnn_attention.default(
            query, key, value, None, True, 0.0, is_causal, False, scale=scale
        )
        return _bshd(out[0]), out[1].squeeze(-1)
    if kernel == "flash":
        out = aten._scaled_dot_product_flash_attention.default(query, key, value, 0.0, is_causal, False, scale=scale)
        return _bshd(out[0]), out[1]
    _check(dropout_p)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, is_causal=is_causal, scale=scale)
    return _bshd(out), query.new_empty(query.shape[:-1], dtype=torch.float32)


def attention_backward(
    grad_out: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    out: torch.Tensor,
    logsumexp: torch.Tensor,
    dropout_p: float,
    is_causal: bool,
    *,
    attn_mask: torch.Tensor | None = None,
    scale: float | None = None,
) -> tuple[torch.Tensor, ...]:
    """`_scaled_dot_product_flash_attention_for_cpu_backward` on the inputs' device (the kernel
    the forward chose: the same inputs choose the same one)."""
    kernel = _kernel(query, key, value, dropout_p, attn_mask, is_causal, scale)
    if kernel == "cudnn":
        no_rng = torch.empty((), dtype=torch.int64, device=query.device)  # read only with dropout
        return tuple(map(_bshd,
            aten._scaled_dot_product_cudnn_attention_backward.default(
                grad_out, query, key, value, out, logsumexp.contiguous().unsqueeze(-1), no_rng, no_rng, None, None,
                None, query.shape[2], key.shape[2], 0.0, is_causal, scale=scale,
            ),
        ))  # fmt: skip
    if kernel == "flash":
        no_rng = torch.zeros(2, dtype=torch.uint64, device=query.device)  # read only with dropout
        return tuple(map(_bshd,
            aten._scaled_dot_product_flash_attention_backward.default(
                grad_out, query, key, value, out, logsumexp.contiguous(), None, None, query.shape[2], key.shape[2],
                0.0, is_causal, no_rng, no_rng, scale=scale,
            ),
        ))  # fmt: skip
    _check(dropout_p)
    with torch.enable_grad():
        q, k, v = (t.detach().requires_grad_() for t in (query, key, value))
        again = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale)
        return tuple(map(_bshd, torch.autograd.grad(again, (q, k, v), grad_out)))


# the traced op -> what a program on another device calls instead
ON_DEVICE = {
    aten._scaled_dot_product_flash_attention_for_cpu.default: attention_forward,
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default: attention_backward,
}
