"""Routed experts as one op: `routed_experts(x, weights, experts, w1, w3, w2)`.

Each token `t` of `x` [T, D] goes to the experts `experts[t]` [K] its router chose, and comes back
as `sum_k weights[t, k] * ffn_e(x[t])`, with `ffn_e(h) = w2[e] (silu(w1[e] h) * w3[e] h)` (SwiGLU;
`w1`, `w3` [E, F, D], `w2` [E, D, F]). Dropless: every chosen pair is computed.

Why an op of its own (with its backward, `routed_experts_backward`): how many tokens each expert
gets is data, so traced as loose aten ops it is either a data-dependent loop or a dense product of
every token with every expert. As one op it traces as one node per layer with fixed shapes, and a
planner can give it layouts of its own: tokens split, experts split by expert or by their hidden
width, or both, which is where expert parallelism comes from.

`first` is the global index of `w1[0]`: a rank holding experts `[first, first + len(w1))` computes
only the pairs routed to them (the others count as zero: a partial sum over the ranks holding the
rest). The row functions (`rows_forward`, `rows_backward`) work on pairs already gathered, as a
rank receiving tokens from others does.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch.utils.flop_counter import register_flop_formula


class Grouped(NamedTuple):
    """Matmuls over rows sorted into groups, one group per expert (`counts` rows each):
    `mm(x, w, counts)` stacks `x_e @ w[e]`; `outer(x, y, counts)` is `[x_e.T @ y_e for each e]`,
    the weight gradients. `LOOP` runs one matmul per expert; a grouped GEMM kernel can stand in."""

    mm: Callable[[torch.Tensor, torch.Tensor, list[int]], torch.Tensor]
    outer: Callable[[torch.Tensor, torch.Tensor, list[int]], torch.Tensor]


def _loop_mm(x: torch.Tensor, w: torch.Tensor, counts: list[int]) -> torch.Tensor:
    return torch.cat([x_e @ w[e] for e, x_e in enumerate(torch.split(x, counts))])


def _loop_outer(x: torch.Tensor, y: torch.Tensor, counts: list[int]) -> torch.Tensor:
    return torch.stack([x_e.T @ y_e for x_e, y_e in zip(torch.split(x, counts), torch.split(y, counts))])


LOOP = Grouped(_loop_mm, _loop_outer)


def _by_expert(ids: torch.Tensor, first: int, n_local: int) -> tuple[torch.Tensor, list[int]]:
    """(order of the rows grouped by local expert, rows per local expert): one host read."""
    order = torch.argsort(ids, stable=True)
    counts = torch.bincount(ids - first, minlength=n_local).tolist()
    return order, counts


def rows_forward(rows: torch.Tensor, ids: torch.Tensor, w1, w3, w2, first: int = 0, grouped: Grouped = LOOP):
    """ffn_{ids[i]}(rows[i]) for rows whose expert ids all lie in [first, first + len(w1))."""
    order, counts = _by_expert(ids, first, w1.shape[0])
    h = rows[order]
    m = F.silu(grouped.mm(h, w1.mT, counts)) * grouped.mm(h, w3.mT, counts)
    out = rows.new_empty(rows.shape[0], w2.shape[1])
    out[order] = grouped.mm(m, w2.mT, counts)
    return out


def rows_backward(
    grad: torch.Tensor, rows: torch.Tensor, ids: torch.Tensor, w1, w3, w2, first: int = 0, grouped: Grouped = LOOP
):
    """(grad of rows, of w1, w3, w2, and the forward's output rows) of `rows_forward`, given the
    gradient of its output rows."""
    order, counts = _by_expert(ids, first, w1.shape[0])
    h, g = rows[order], grad[order]
    a, b = grouped.mm(h, w1.mT, counts), grouped.mm(h, w3.mT, counts)
    sig = torch.sigmoid(a)
    s = a * sig
    m = s * b
    gm = grouped.mm(g, w2, counts)
    ga = gm * b * (sig * (1 + a * (1 - sig)))
    gb = gm * s
    grad_rows, out = torch.empty_like(rows), rows.new_empty(rows.shape[0], w2.shape[1])
    grad_rows[order] = grouped.mm(ga, w1, counts) + grouped.mm(gb, w3, counts)
    out[order] = grouped.mm(m, w2.mT, counts)
    g1, g3, g2 = grouped.outer(ga, h, counts), grouped.outer(gb, h, counts), grouped.outer(g, m, counts)
    return grad_rows, g1, g3, g2, out


def _local_pairs(experts: torch.Tensor, first: int, n_local: int) -> torch.Tensor:
    """Indices (into the flattened [T*K] pairs) of the pairs routed to experts held here."""
    flat = experts.reshape(-1)
    return torch.nonzero((flat >= first) & (flat < first + n_local)).squeeze(1)


def experts_forward(x, weights, experts, w1, w3, w2, first: int = 0, grouped: Grouped = LOOP) -> torch.Tensor:
    """The op's value, over the pairs routed to experts [first, first + len(w1))."""
    k = experts.shape[1]
    pairs = _local_pairs(experts, first, w1.shape[0])
    tokens = pairs // k
    out = rows_forward(x[tokens], experts.reshape(-1)[pairs], w1, w3, w2, first, grouped)
    scaled = out * weights.reshape(-1)[pairs, None].to(out.dtype)
    return torch.zeros_like(x).index_add_(0, tokens, scaled)


def experts_backward(grad, x, weights, experts, w1, w3, w2, first: int = 0, grouped: Grouped = LOOP):
    """(grad of x, weights, w1, w3, w2) of `experts_forward` given the gradient of its output."""
    k = experts.shape[1]
    pairs = _local_pairs(experts, first, w1.shape[0])
    tokens = pairs // k
    g_tok = grad[tokens]
    pair_weights = weights.reshape(-1)[pairs, None].to(grad.dtype)
    g_rows, g1, g3, g2, out = rows_backward(
        g_tok * pair_weights, x[tokens], experts.reshape(-1)[pairs], w1, w3, w2, first, grouped
    )
    grad_x = torch.zeros_like(x).index_add_(0, tokens, g_rows)
    grad_w = torch.zeros(weights.numel(), dtype=weights.dtype, device=weights.device)
    grad_w[pairs] = (out * g_tok).sum(-1).to(weights.dtype)
    return grad_x, grad_w.view_as(weights), g1, g3, g2


# ------------------------------------------------------------------------------------ the ops
@torch.library.custom_op("autoshard_models::routed_experts", mutates_args=())
def routed_experts(
    x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor
) -> torch.Tensor:
    return experts_forward(x, weights, experts, w1, w3, w2)


@routed_experts.register_fake
def _(x, weights, experts, w1, w3, w2):
    return torch.empty_like(x)


@torch.library.custom_op("autoshard_models::routed_experts_backward", mutates_args=())
def routed_experts_backward(
    grad: torch.Tensor,
    x: torch.Tensor,
    weights: torch.Tensor,
    experts: torch.Tensor,
    w1: torch.Tensor,
    w3: torch.Tensor,
    w2: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return experts_backward(grad, x, weights, experts, w1, w3, w2)


@routed_experts_backward.register_fake
def _(grad, x, weights, experts, w1, w3, w2):
    return tuple(torch.empty_like(t) for t in (x, weights, w1, w3, w2))


def _setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _backward(ctx, grad):
    x, weights, experts, w1, w3, w2 = ctx.saved_tensors
    gx, gw, g1, g3, g2 = routed_experts_backward(grad.contiguous(), x, weights, experts, w1, w3, w2)
    return gx, gw, None, g1, g3, g2


routed_experts.register_autograd(_backward, setup_context=_setup)


@register_flop_formula(torch.ops.autoshard_models.routed_experts)
def _forward_flops(x_shape, weights_shape, experts_shape, w1_shape, *args, **kwargs) -> int:
    """Three matmuls per routed pair (every pair computed: dropless)."""
    pairs = experts_shape[0] * experts_shape[1]
    return 3 * 2 * pairs * w1_shape[1] * w1_shape[2]


@register_flop_formula(torch.ops.autoshard_models.routed_experts_backward)
def _backward_flops(grad_shape, x_shape, weights_shape, experts_shape, w1_shape, *args, **kwargs) -> int:
    """The forward again (its output rows give the routing weights' gradient), then two matmuls
    per forward matmul."""
    pairs = experts_shape[0] * experts_shape[1]
    return 9 * 2 * pairs * w1_shape[1] * w1_shape[2]
